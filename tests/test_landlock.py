"""Landlock confinement (course/sandbox/landlock.py), the partial sandbox's last line: in a confined process the
kernel refuses writes outside the writable folders and reads of the denied ones, whoever asks (the process, its
children, code it execs), and allows the rest; the sandbox wrapper confines a submission that way where it cannot
isolate it (run here with the sandbox forced partial)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course.sandbox import landlock

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(landlock.abi() == 0, reason="no Landlock in this kernel")


def test_readable_except_grants_everything_but_the_denied_folders(tmp_path):
    for rel in ("a/secret/x", "a/open/y", "b/z"):
        (tmp_path / rel).mkdir(parents=True)
    (tmp_path / "a" / "file").write_text("1")
    (tmp_path / "a" / "link").symlink_to(tmp_path / "a" / "secret")
    (tmp_path / "b" / "up").symlink_to(tmp_path / "a")  # a link to a folder that holds a denied one
    found = set(landlock.readable_except([str(tmp_path / "a" / "secret")], root=str(tmp_path)))
    assert found == {str(tmp_path / "b"), str(tmp_path / "a" / "open"), str(tmp_path / "a" / "file")}
    assert landlock.readable_except([], root=str(tmp_path)) == [str(tmp_path)]
    assert landlock.readable_except([str(tmp_path)], root=str(tmp_path)) == []


def test_a_confined_process_and_its_children_write_only_where_allowed_and_read_all_but_the_denied(tmp_path):
    work, secret, other = tmp_path / "work", tmp_path / "secret", tmp_path / "other"
    for folder in (work, secret, other):
        folder.mkdir()
    (secret / "solution.txt").write_text("the answer")
    (other / "notebook.txt").write_text("another student's")
    script = textwrap.dedent(f'''
        import json, os, subprocess, sys
        from course.proc import PR_SET_NO_NEW_PRIVS, prctl
        from course.sandbox import landlock
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        readable = landlock.readable_except([{str(secret)!r}]) + [p for p in sys.path if os.path.isdir(p)]
        landlock.confine(readable, [{str(work)!r}, "/dev/null"])
        out = {{}}
        def attempt(name, fn):
            try:
                out[name] = fn()
            except OSError as exc:
                out[name] = type(exc).__name__
        attempt("write_work", lambda: open({str(work / "ok.txt")!r}, "w").write("x"))
        attempt("write_other", lambda: open({str(other / "notebook.txt")!r}, "a").write("pwned"))
        attempt("plant_other", lambda: open({str(other / "planted.txt")!r}, "w").write("pwned"))
        attempt("read_other", lambda: open({str(other / "notebook.txt")!r}).read())
        attempt("read_secret", lambda: open({str(secret / "solution.txt")!r}).read())
        attempt("list_secret", lambda: os.listdir({str(secret)!r}))
        attempt("child_reads_secret", lambda: subprocess.run(
            ["cat", {str(secret / "solution.txt")!r}], capture_output=True, text=True).stdout or "refused")
        attempt("devnull", lambda: open("/dev/null", "w").write("x"))
        print(json.dumps(out))
    ''')
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"write_work": 1, "write_other": "PermissionError", "plant_other": "PermissionError",
                   "read_other": "another student's", "read_secret": "PermissionError",
                   "list_secret": "PermissionError", "child_reads_secret": "refused", "devnull": 1}, out
    assert (other / "notebook.txt").read_text() == "another student's" and not (other / "planted.txt").exists()


def test_the_partial_sandbox_confines_a_submission_where_it_cannot_isolate(tmp_path, monkeypatch):
    """Forced partial (as without root or user namespaces): the wrapped command writes its work folder, not the
    folder beside it, and cannot read a hidden one; the summary says Landlock confines it."""
    from course.sandbox.box import Sandbox

    monkeypatch.setenv("DDP_COURSE_SANDBOX_PARTIAL", "1")
    beside, hidden = tmp_path / "beside", tmp_path / "sources"
    beside.mkdir()
    hidden.mkdir()
    (hidden / "solution.txt").write_text("the answer")
    targets = repr((("beside", str(beside / "x.txt")), ("hidden", str(hidden / "solution.txt"))))
    probe = ("open('mine.txt', 'w').write('ok')\n"
             f"for name, path in {targets}:\n"
             "    try:\n"
             "        open(path, 'a').write('x') if name == 'beside' else open(path).read()\n"
             "        print(name, 'reached')\n"
             "    except OSError:\n"
             "        print(name, 'refused')\n")
    with Sandbox(tmp_path / "w", hide=[str(hidden)]) as box:
        assert box.confined and "confined by Landlock" in box.summary
        proc = subprocess.run(box.command([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60)
        assert (Path(box.workdir) / "mine.txt").read_text() == "ok"
    assert proc.stdout.split("\n")[:2] == ["beside refused", "hidden refused"], proc.stdout + proc.stderr
    assert not (beside / "x.txt").exists()
