"""The hidden tests' stash: a grading killed while its kernel runs leaves it behind; the next grading removes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import nbformat
import pytest

from course.grading import execute

pytestmark = pytest.mark.timeout(120)


def _with_hidden_tests(path) -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("### BEGIN HIDDEN TESTS\nassert True\n### END HIDDEN TESTS")
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": "t", "locked": True, "points": 1, "solution": False,
                                 "schema_version": 3}
    nb.cells.append(cell)
    nbformat.write(nb, str(path))


def test_a_killed_gradings_stash_is_swept_by_the_next_and_a_live_ones_kept(tmp_path):
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmp.mkdir()
    _with_hidden_tests(work / "restored.ipynb")
    assert execute.holds_hidden_tests(str(work / "restored.ipynb"))
    # a grading process: its notebook moved away, then SIGKILL (no finally runs) while the "kernel" runs
    code = textwrap.dedent(f"""
        import os, sys, tempfile, time
        tempfile.tempdir = {str(tmp)!r}
        from course.grading import execute
        with execute.hidden_notebooks_away({str(work)!r}):
            print("away", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "away"
        left = [n for n in os.listdir(tmp) if n.startswith(execute.STASH_PREFIX)]
        assert left == [n for n in left if n.startswith(f"{execute.STASH_PREFIX}{proc.pid}-")] and len(left) == 1
        assert not (work / "restored.ipynb").exists()  # away from the kernel while it runs
        # while the grading runs, another grading's sweep leaves its stash alone
        assert execute.sweep_stale_stashes(str(tmp)) == []
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    stash = tmp / left[0]
    assert os.listdir(stash) == ["0.ipynb"]  # the hidden tests, left behind by the kill
    other = tmp / "ddp-course-stash-notapid"
    other.mkdir()
    assert execute.sweep_stale_stashes(str(tmp)) == [str(stash)]
    assert not stash.exists() and other.exists()


def test_the_next_grading_sweeps_before_it_stashes(tmp_path, monkeypatch):
    """hidden_notebooks_away sweeps first: a dead pid's stash is gone once the next grading starts."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    time.sleep(0.1)
    stale = tmp_path / f"{execute.STASH_PREFIX}{dead.pid}-abc"
    stale.mkdir()
    (stale / "0.ipynb").write_text("{}")
    work = tmp_path / "work"
    work.mkdir()
    _with_hidden_tests(work / "n.ipynb")
    with execute.hidden_notebooks_away(str(work)):
        assert not stale.exists()
        assert not (work / "n.ipynb").exists()
    assert (work / "n.ipynb").exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith(execute.STASH_PREFIX)] == []
