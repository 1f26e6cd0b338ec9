"""The authoring guide (docs/writing-exercises.md) works as written.

Its example exercise is built from the guide's own code blocks (each ``<!-- file: PATH -->``
block is written to PATH, then ``make_exercise.py`` runs), and a right, a wrong and an
untouched answer are graded with ``ddp-course grade`` and with ``ddp-course autograde``:
right 2/2, wrong 0 with the very message the guide shows, untouched 0 "not written yet".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "writing-exercises.md"
BLOCK = re.compile(r"<!-- file: (?P<path>[\w./-]+) -->\n```python\n(?P<code>.*?)```", re.S)
MESSAGE = re.compile(r"```text\n(?P<text>FAILED .*?)```", re.S)
ASSIGNMENT, NOTEBOOK = "ex5-mean", "mean.ipynb"


def guide_files() -> dict[str, str]:
    return {m["path"]: m["code"] for m in BLOCK.finditer(GUIDE.read_text())}


def build(root: Path) -> Path:
    files = guide_files()
    assert {"checks/mycourse_checks/mean.py", "make_exercise.py"} <= set(files)
    for rel, code in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(code)
    (root / "exercises" / ASSIGNMENT).mkdir(parents=True)
    subprocess.run([sys.executable, "make_exercise.py"], cwd=root, check=True, timeout=60)
    return root / "exercises" / ASSIGNMENT / NOTEBOOK


def env_for(root: Path) -> dict:
    paths = [str(root / "checks"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)),
            "DDP_COURSE_CHECK_PACKAGES": "mycourse_checks"}


def answered(source: Path, folder: Path, answer: str) -> Path:
    nb = nbformat.read(str(source), as_version=4)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "answer":
            cell.source = answer
    path = folder / ASSIGNMENT / NOTEBOOK
    path.parent.mkdir(parents=True)
    nbformat.write(nb, str(path))
    return path


RIGHT = "def mean_over_ranks(value):\n    dist.all_reduce(value)\n    return value / dist.get_world_size()\n"
WRONG = "def mean_over_ranks(value):\n    dist.all_reduce(value)\n    return value\n"
UNTOUCHED = "def mean_over_ranks(value):\n    # YOUR CODE HERE\n    raise NotImplementedError()"


def cli(*args, cwd, env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "course.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_guides_exercise_grades_right_and_wrong_answers_both_ways(tmp_path):
    source = build(tmp_path)
    env = env_for(tmp_path)
    shown = MESSAGE.search(GUIDE.read_text())["text"].strip()
    answers = {"right": RIGHT, "wrong": WRONG, "untouched": UNTOUCHED}
    paths = {who: answered(source, tmp_path / "incoming" / who, text) for who, text in answers.items()}

    graded = {}
    for who, path in paths.items():
        report = json.loads(cli("grade", "--json", "--exercises", tmp_path / "exercises", path,
                                cwd=tmp_path, env=env).stdout)
        graded[who] = {t["id"]: (t["score"], t["message"]) for t in report["tests"]}
    assert graded["right"] == {"test_mean": (2.0, "")}
    assert graded["wrong"]["test_mean"][0] == 0.0
    assert graded["wrong"]["test_mean"][1].startswith(shown), graded["wrong"]
    assert graded["untouched"]["test_mean"][0] == 0.0
    assert "`mean_over_ranks` is not written yet" in graded["untouched"]["test_mean"][1]

    course = tmp_path / "course"
    cli("init", course, "--exercises", tmp_path / "exercises", cwd=tmp_path, env=env)
    cli("release", cwd=course, env=env)
    cli("collect", tmp_path / "incoming", cwd=course, env=env)
    cli("autograde", "--jobs", "2", cwd=course, env=env)
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", "ddp-course") as gb:
        scores = {who: gb.find_submission(ASSIGNMENT, who).score for who in answers}
    assert scores == {"right": 2.0, "wrong": 0.0, "untouched": 0.0}
    for who in answers:  # the same verdict in the autograded notebook as in grade's report
        nb = nbformat.read(str(course / "autograded" / who / ASSIGNMENT / NOTEBOOK), as_version=4)
        test = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "test_mean")
        errors = [o["evalue"] for o in test.outputs if o.get("output_type") == "error"]
        printed = "".join(o.get("text", "") for o in test.outputs if o.get("output_type") == "stream")
        if who == "right":
            assert errors == [] and "passed check_mean" in printed, test.outputs
        else:
            assert errors == [graded[who]["test_mean"][1]], (who, test.outputs)


def test_the_guides_code_blocks_are_short_and_complete():
    files = guide_files()
    lines = sum(len([line for line in code.splitlines() if line.strip()]) for code in files.values())
    assert lines <= 55, lines  # the check, its package and the source notebook
    assert "BEGIN HIDDEN TESTS" in files["make_exercise.py"]
