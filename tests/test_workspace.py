"""The student's workspace (``ddp-course lab``): student copies only, edits kept across course updates, no
instructor tools in the lab, one-line errors for folders that cannot be one; ``check`` on a notebook with no
answer cells. Fast: the tiny course (tests/files/exercises) stands in for the real one where it can."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from click.testing import CliRunner

from course.cli import main
from course.instructor.leaks import find_in_text, markers_in, notebook_text, secrets_of
from course.student import labconfig
from course.student.workspace import MANIFEST, broken_notebooks, sync

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "files" / "exercises"
TOKEN = "ddp-course-workspace"


@pytest.fixture
def tiny_course(tmp_path):
    """An installed course: one lesson, the tiny exercise (a source notebook, with solutions and hidden tests)."""
    course = tmp_path / "course"
    (course / "lessons").mkdir(parents=True)
    shutil.copy(sorted((ROOT / "lessons").glob("01-*.ipynb"))[0], course / "lessons" / "01-intro.ipynb")
    shutil.copytree(TINY, course / "exercises")
    return course


@pytest.fixture
def public_tmp():
    """A temporary folder every user can read (pytest's are its owner's only)."""
    folder = Path(tempfile.mkdtemp(prefix="ddp-course-ws-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def lab(*args, course: Path):
    return CliRunner().invoke(main, ["lab", *args], env={"DDP_COURSE_ROOT": str(course)})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_the_workspace_holds_the_lessons_and_student_copies_only(tmp_path):
    ws = tmp_path / "work"
    report = sync(ws, ROOT)
    assert not report.problems
    for lesson in (ROOT / "lessons").glob("*.ipynb"):
        assert (ws / "lessons" / lesson.name).read_bytes() == lesson.read_bytes()
    sources = sorted((ROOT / "exercises").glob("*/*"))
    assert sources
    for source in sources:
        copy = ws / "exercises" / source.parent.name / source.name
        assert copy.is_file(), copy
        if source.suffix != ".ipynb":
            continue
        text = notebook_text(nbformat.read(copy, as_version=4))
        secrets = secrets_of(source)
        assert markers_in(text) == [], copy  # no BEGIN SOLUTION, no BEGIN HIDDEN TESTS
        assert find_in_text(text, secrets.solution | secrets.hidden_tests) == [], copy
    manifest = json.loads((ws / MANIFEST).read_text())
    assert manifest["files"]["exercises/ex1-parallelism/parallelism.ipynb"]["hidden"]["ex1_test_shards"] == 1


def test_a_students_edits_survive_an_update_of_the_course(tiny_course, tmp_path):
    ws = tmp_path / "work"
    assert lab("--dir", str(ws), "--make-only", course=tiny_course).exit_code == 0
    mine = ws / "exercises" / "ex0-tiny" / "tiny.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace("raise NotImplementedError()", "return 2 * x")
    nbformat.write(nb, mine)
    edited = mine.read_bytes()
    (ws / "lessons" / "01-intro.ipynb").unlink()  # deleting a notebook is how to start it over

    # the course is updated: its exercise notebook changes, a lesson and an exercise notebook are new
    source = tiny_course / "exercises" / "ex0-tiny" / "tiny.ipynb"
    src = nbformat.read(source, as_version=4)
    src.cells[0].source += "\n\nUpdated instructions."
    nbformat.write(src, source)
    shutil.copy(sorted((ROOT / "lessons").glob("02-*.ipynb"))[0], tiny_course / "lessons" / "02-next.ipynb")
    shutil.copy(source, tiny_course / "exercises" / "ex0-tiny" / "tiny_more.ipynb")

    result = lab("--dir", str(ws), "--make-only", course=tiny_course)
    assert result.exit_code == 0, result.output
    assert mine.read_bytes() == edited  # never overwritten
    offered = ws / "exercises" / "ex0-tiny" / "tiny.updated.ipynb"
    assert "Updated instructions." in offered.read_text() and "BEGIN SOLUTION" not in offered.read_text()
    assert "kept your exercises/ex0-tiny/tiny.ipynb" in result.output and "tiny.updated.ipynb" in result.output
    for new in ("lessons/02-next.ipynb", "exercises/ex0-tiny/tiny_more.ipynb"):
        assert (ws / new).is_file() and f"new: {new}" in result.output, result.output
    assert "fresh copy (it was gone): lessons/01-intro.ipynb" in result.output and (ws / "lessons/01-intro.ipynb").is_file()
    assert "BEGIN HIDDEN TESTS" not in (ws / "exercises/ex0-tiny/tiny_more.ipynb").read_text()

    before = snapshot(ws)
    again = lab("--dir", str(ws), "--make-only", course=tiny_course)
    assert again.exit_code == 0 and snapshot(ws) == before, again.output  # nothing new: nothing written twice

    # an untouched notebook follows the course in place
    src.cells[0].source += " Again."
    nbformat.write(src, tiny_course / "exercises" / "ex0-tiny" / "tiny_more.ipynb")
    third = lab("--dir", str(ws), "--make-only", course=tiny_course)
    assert "updated (you had not changed it): exercises/ex0-tiny/tiny_more.ipynb" in third.output, third.output
    assert "Again." in (ws / "exercises/ex0-tiny/tiny_more.ipynb").read_text()


def _as_nobody() -> list[str]:
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []


@pytest.mark.parametrize("case", ["file", "inside", "holds", "unwritable"])
def test_a_folder_that_cannot_be_a_workspace_is_one_line_and_nothing_written(case, tiny_course, tmp_path,
                                                                            public_tmp):
    if case == "file":
        folder = tmp_path / "notes.txt"
        folder.write_text("mine")
    elif case == "inside":
        folder = tiny_course / "exercises" / "work"
    elif case == "holds":
        folder = tmp_path
    else:  # as root every folder is writable: run as nobody, in folders nobody can read (pytest's are root's only)
        if os.geteuid() == 0 and not shutil.which("setpriv"):
            pytest.skip("root without setpriv: every folder is writable")
        tmp_path = public_tmp
        tiny_course = Path(shutil.copytree(tiny_course, tmp_path / "course"))
        (tmp_path / "locked").mkdir(mode=0o555)
        folder = tmp_path / "locked" / "work"
    before = snapshot(tmp_path)
    proc = subprocess.run([*_as_nobody() * (case == "unwritable"), sys.executable, "-m", "course.cli", "lab",
                           "--dir", str(folder), "--no-browser"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DDP_COURSE_ROOT": str(tiny_course), "HOME": "/"}, cwd="/")
    assert proc.returncode == 1, proc
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert {"file": "is a file", "inside": "inside the course's sources", "holds": "holds the course's sources",
            "unwritable": "not writable"}[case] in proc.stderr
    assert snapshot(tmp_path) == before


def test_root_outside_a_container_is_told_what_to_do(tiny_course, tmp_path, monkeypatch):
    monkeypatch.setattr(labconfig, "is_root", lambda: True)
    monkeypatch.setattr(labconfig, "in_container", lambda: False)
    result = lab("--dir", str(tmp_path / "work"), "--no-browser", course=tiny_course)
    assert result.exit_code == 1 and "--allow-root" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()
    monkeypatch.setattr(labconfig, "in_container", lambda: True)  # in a container root is the rule
    dry = lab("--dir", str(tmp_path / "work"), "--dry-run", course=tiny_course)
    assert dry.exit_code == 0 and "--allow-root" in dry.output and not (tmp_path / "work").exists()


def test_check_says_no_answer_cells_found_for_an_emptied_notebook(tmp_path):
    ws = tmp_path / "work"
    sync(ws, ROOT)
    mine = ws / "exercises" / "ex1-parallelism" / "parallelism.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells = []
    nbformat.write(nb, mine)
    for verb in ("check", "grade"):
        result = CliRunner().invoke(main, [verb, str(mine), "--json"])
        assert result.exit_code == 0, result.output
        assert "no answer cells found" in result.output and "not written yet" not in result.output


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(180)
def test_the_lab_shows_no_instructor_tool_and_names_a_broken_notebook(tiny_course, tmp_path):
    ws = tmp_path / "work"
    assert lab("--dir", str(ws), "--make-only", course=tiny_course).exit_code == 0
    (ws / "exercises" / "ex0-tiny" / "tiny.ipynb").write_text('{"cells": [')  # a student's broken notebook
    assert broken_notebooks(ws) and "exercises/ex0-tiny/tiny.ipynb is broken" in broken_notebooks(ws)[0]
    port = free_port()
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "course.cli", "lab", "--dir", str(ws), "--no-browser", "--port", str(port),
             f"--ServerApp.token={TOKEN}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            env={**os.environ, "DDP_COURSE_ROOT": str(tiny_course)}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{base}{path}{'&' if '?' in path else '?'}token={TOKEN}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, ""

    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if get("/api/status")[0] == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        status, listing = get("/api/contents")
        assert {item["name"] for item in json.loads(listing)["content"]} == {"lessons", "exercises"}
        assert get("/formgrader")[0] == 404 and get("/assignments")[0] == 404
        page = get("/lab")[1]
        config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                      page, re.S).group(1))
        assert set(labconfig.disabled_plugins()) <= set(config.get("disabledExtensions", [])), config
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=20)
    text = log.read_text()
    assert "warning: exercises/ex0-tiny/tiny.ipynb is broken" in text, text
    assert "No nbgrader_config.py" not in text and "Running as root" not in text, text


def test_the_lab_turns_off_jupyterlabs_news_prompt(tmp_path):
    """JupyterLab greets a new user with "Would you like to get notified about official Jupyter news?" from its
    announcements plugin; the lab's page config disables it, by an id the installed JupyterLab really has."""
    import jupyterlab

    folder = labconfig.write(tmp_path)
    page = json.loads((folder / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"].get("@jupyterlab/apputils-extension:announcements") is True
    bundles = Path(jupyterlab.__file__).parent / "static"
    assert any("@jupyterlab/apputils-extension:announcements" in p.read_text(errors="replace")
               for p in bundles.glob("*.js")), "the plugin id is gone from this JupyterLab: update LAB_PLUGINS_OFF"
