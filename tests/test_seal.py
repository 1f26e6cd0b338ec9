"""The check API's seal (course/checks/sealing.py): a thread that calls a student's prediction can start no process,
change no limit and, when asked, open no file; the threads it starts are sealed too; elsewhere it says it could not."""

from __future__ import annotations

import errno
import os
import platform
import resource
import subprocess
import threading

import pytest

from course.checks import seal

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"),
                                reason="seccomp filters are Linux's, on these processors")


def _fork() -> None:
    """A process started and ended at once (os.fork: no object left behind to warn when collected)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _in_a_sealed_thread(tmp_path, files: bool) -> dict:
    result: dict = {}

    def attempt(name, fn):
        try:
            fn()
            result[name] = "ran"
        except OSError as err:
            result[name] = err.errno
        except ValueError:  # Python's setrlimit turns the kernel's EPERM into "not allowed to raise maximum limit"
            result[name] = errno.EPERM

    def work():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # read first: glibc reads limits with prlimit64 too
        result["sealed"] = seal(files=files)
        attempt("open", lambda: open(tmp_path / "x", "w").close())  # noqa: SIM115
        attempt("process", _fork)
        attempt("limit", lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard)))
        child = threading.Thread(target=lambda: attempt("child's process", _fork))
        child.start()
        child.join()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return result


def test_a_sealed_thread_and_its_threads_start_no_process_and_open_no_file(tmp_path):
    got = _in_a_sealed_thread(tmp_path, files=True)
    assert got == {"sealed": True, "open": errno.EPERM, "process": errno.EPERM, "limit": errno.EPERM,
                   "child's process": errno.EPERM}, got
    subprocess.run(["true"], check=True)  # this thread, never sealed, still can


def test_files_stay_open_to_a_thread_sealed_without_them(tmp_path):
    got = _in_a_sealed_thread(tmp_path, files=False)
    assert got["open"] == "ran" and got["process"] == errno.EPERM, got


def test_a_platform_without_seccomp_seals_nothing_and_says_so(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert seal(files=True) is False
