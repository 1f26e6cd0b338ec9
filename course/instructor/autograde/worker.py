"""One autograde worker: a long-lived process that runs nbgrader's autograde, one submission at a time.

The parent prepares a private scratch course for each submission (its own
SQLite gradebook, see :mod:`course.instructor.gradebook`); the worker grades it
there with ``NbGraderAPI.autograde`` under the course's own nbgrader_config.py,
and reports back. A worker is its own session (process group), writes all
nbgrader and kernel output to a log file, and kills its whole process tree and
exits if its parent dies, so no kernel or rank outlives an interrupted run.
Keeping it alive between submissions pays nbgrader's ~5 s import once, and its
zygote (:mod:`course.sandbox.zygote`, a child of the worker, so inside the tree a
timeout kills) pays torch's for every kernel and verifier it grades.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from pathlib import Path

from course import proc
from course.instructor.coursedir import load_config
from course.instructor.gradebook import sqlite_url
from course.launcher.job import CPUS_ENV


def kill_tree(pid: int, include_self: bool = True) -> None:
    """SIGKILL every descendant of ``pid`` (kernels and ranks run in sessions of their own, so its
    process group alone would miss them), then ``pid`` and what is left of its process group."""
    proc.kill_tree(pid, include_self)  # collects the tree before killing: no orphan escapes
    if include_self:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def grade(course_root: str, scratch: str, assignment: str, student: str) -> dict:
    """Autograde ``student``'s ``assignment`` in the scratch course at ``scratch``; nbgrader's result dict."""
    from nbgrader.apps import NbGraderAPI

    started = time.monotonic()
    try:
        config = load_config(Path(course_root))
        config.CourseDirectory.root = scratch
        config.CourseDirectory.db_url = sqlite_url(os.path.join(scratch, "gradebook.db"))
        api = NbGraderAPI(config=config)
        result = dict(api.autograde(assignment, student, force=True, create=True))
    except Exception:
        result = {"success": False, "error": traceback.format_exc(), "log": ""}
    result["elapsed"] = time.monotonic() - started
    return result


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    kill_tree(os.getpid(), include_self=False)
    os._exit(1)


def serve(conn, course_root: str, log_path: str, parent_pid: int, cpus: int | None = None) -> None:
    """Worker main loop: receive job dicts on ``conn``, send back results; ``None`` ends it.

    ``cpus``: this worker's share of the cores, for what it grades (kernel, verifier, ranks):
    threads sized to the machine would fight over the cores of the submissions graded alongside.
    """
    os.setsid()
    if cpus:
        os.environ[CPUS_ENV] = str(cpus)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, str(cpus))
    for signum in (signal.SIGINT, signal.SIGTERM):  # forked: drop the parent's handlers (Ctrl-C, SIGTERM)
        signal.signal(signum, signal.SIG_DFL)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from course.sandbox import zygote

    if zygote.enabled():  # imports torch, ipykernel and the graders while we get ready; every kernel and
        from course.grading.kernel import ZYGOTE_PRELOAD  # verifier of this worker is then forked from it

        zygote.use(zygote.Zygote(ZYGOTE_PRELOAD))  # (see course.sandbox.zygote)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    import nbgrader.apps  # noqa: F401  (already there when forked from autograde; else paid before the first job)

    conn.send({"ready": True})
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        conn.send(grade(course_root, **job))
