"""One grading pipeline: ``ddp-course grade`` and ``ddp-course autograde`` give every test cell the same
score and the same message, for right, untouched, wrong and hostile submissions alike.

Both verbs run :data:`course.grading.pipeline.GRADING_STEPS` (the config ``init`` writes imports
it); this test holds them to it on five real submissions of exercise 1, graded once each way (the two wrong
answers are one submission: mistakes in two answer cells, each losing exactly its own test cell, as
tests/submissions.py packs them).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import submissions

from course.grading.cells import is_test_cell
from course.grading.scoring import score_cell

A = "ex1-parallelism"
NOTEBOOK = "parallelism.ipynb"
# a test cell's checks re-implemented in the notebook: every check "passes" in the kernel
HOSTILE = '''
import sys, graders, graders.parallelism.checks
for _name in dir(graders.parallelism.checks):
    if _name.startswith("check_"):
        setattr(graders.parallelism.checks, _name, lambda *a, _n=_name, **k: print(f"passed {_n}"))
'''
#: seconds an answer cell may run, in both verbs: the endless loop of "broken_cells" is stopped there (it spins
#: that long in each verb; the course's own cells, ex1_imports with its cold ``import torch`` included, get the test
#: cells' limit, tests/test_grade.py::test_the_courses_own_code_cells_get_the_test_cells_limit)
CELL_TIMEOUT = 10


def _students(tmp_path: Path) -> dict[str, Path]:
    """reference, untouched, wrong (two mistakes), one hostile submission and one whose answer cells time out and
    raise, as students' files."""
    folder = tmp_path / "incoming"
    source = submissions.load(A)
    made = {
        "reference": source,
        # a sum, not the mean, of the gradients; and overlapping shards: each loses its own test cell only
        "wrong": submissions.patch_answer(
            submissions.patch_answer(source, "ex1_average_gradients", "            p.grad /= rows\n", ""),
            "ex1_shard_batch", "start = rank * base + min(rank, extra)", "start = rank"),
        "hostile": submissions.replace_answer(
            submissions.patch_answer(source, "ex1_average_gradients", "            p.grad /= rows\n", ""),
            "ex1_shard_batch", submissions.answer(source, "ex1_shard_batch") + "\n" + HOSTILE),
        # an endless loop above def shard_batch, 1 / 0 above def two_stage_step
        "broken_cells": submissions.replace_answer(
            submissions.replace_answer(source, "ex1_shard_batch",
                                       "while True:\n    pass\n\n" + submissions.answer(source, "ex1_shard_batch")),
            "ex1_two_stage_step", "1 / 0\n\n" + submissions.answer(source, "ex1_two_stage_step")),
    }
    paths = {}
    for student, nb in made.items():
        paths[student] = submissions.write(nb, folder / student, A)
    untouched = submissions.untouched_student_copy(A, tmp_path / "release")
    paths["untouched"] = folder / "untouched" / A / NOTEBOOK
    paths["untouched"].parent.mkdir(parents=True)
    paths["untouched"].write_bytes(untouched.read_bytes())
    return paths


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "course.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


_VARIABLE = [
    (re.compile(r"/tmp/[\w./-]+"), "<tmp>"),  # scratch folders, kernels' cell files
    (re.compile(r"\b\d+\.\d+ s\b"), "<t> s"),  # timings
    (re.compile(r"\bpid \d+\b"), "pid <n>"),
]


def normalise(message: str) -> str:
    for pattern, repl in _VARIABLE:
        message = pattern.sub(repl, message)
    return message


def autograded(course: Path, student: str) -> dict[str, tuple[float, str]]:
    """{grade_id: (score in the gradebook, message of the graded cell)} of one autograded submission."""
    from nbgrader.api import Gradebook

    nb = nbformat.read(str(course / "autograded" / student / A / NOTEBOOK), as_version=4)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", "ddp-course") as gb:
        submission = gb.find_submission(A, student)
        scores = {g.name: float(g.score) for n in submission.notebooks for g in n.grades if g.cell.cell_type == "code"}
    found = {}
    for cell in nb.cells:
        if is_test_cell(cell):
            gid = cell.metadata["nbgrader"]["grade_id"]
            result = score_cell(cell, float(cell.metadata["nbgrader"]["points"]), cell.get("execution_count") is not None)
            found[gid] = (scores[gid], normalise(result.message))
    return found


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_grade_and_autograde_give_every_test_cell_the_same_score_and_message(tmp_path):
    from course.grading.grade import grade_notebook, one_zygote
    from course.grading.notebook import Timeouts

    paths = _students(tmp_path)
    course = tmp_path / "course"
    _cli("init", course, "--cell-timeout", CELL_TIMEOUT, cwd=tmp_path)
    _cli("release", A, cwd=course)
    _cli("collect", tmp_path / "incoming", cwd=course)
    _cli("autograde", A, "--jobs", "2", cwd=course)

    full = submissions.full_marks(A)
    reports = {}
    with one_zygote():  # each kernel and verifier forked, as `ddp-course grade` does (the API's exec'd path: the attacks)
        for student, path in paths.items():
            reports[student] = grade_notebook(path, exercises=course / "source", timeouts=Timeouts(other=CELL_TIMEOUT))
    for student, report in reports.items():
        by_grade = {t.id: (t.score, normalise(t.message)) for t in report.tests}
        assert by_grade == autograded(course, student), student
        scores = {gid: score for gid, (score, _) in by_grade.items()}
        # and the grades are the right ones
        if student == "reference":
            assert scores == full
        elif student == "untouched":
            assert set(scores.values()) == {0.0}
            assert all("not written yet" in message for _, message in by_grade.values()), by_grade
        elif student == "hostile":
            assert scores == submissions.losing(A, "ex1_test_average_gradients"), (student, by_grade)
            assert "row-weighted SUM" in by_grade["ex1_test_average_gradients"][1]
        elif student == "wrong":
            assert scores == submissions.losing(A, "ex1_test_average_gradients", "ex1_test_shards"), by_grade
            # what is wrong, not the fix (hint level 1): "divide" is level 3's word
            message = by_grade["ex1_test_average_gradients"][1]
            assert "row-weighted SUM" in message and "divide" not in message and "try:" not in message, message
            assert "overlap" in by_grade["ex1_test_shards"][1]
        elif student == "broken_cells":  # the message nbgrader records (feedback shows it) says the cause first
            assert scores == submissions.losing(A, "ex1_test_shards", "ex1_test_shard_sizes", "ex1_test_two_stage"), \
                by_grade
            loop = ("before this test, cell 3 (ex1_shard_batch, which defines `shard_batch`) timed out after "
                    f"{CELL_TIMEOUT} s (its time limit)")
            zero = ("before this test, cell 11 (ex1_two_stage_step, which defines `two_stage_step`) raised "
                    "ZeroDivisionError: division by zero")
            assert by_grade["ex1_test_shards"][1] == (f"{loop}\nthen this test failed: FAILED check_shards: "
                                                      "`shard_batch` was not defined when this test ran")
            assert by_grade["ex1_test_two_stage"][1].splitlines() == [
                loop, zero, "then this test failed: FAILED check_two_stage: `two_stage_step` was not defined when "
                "this test ran"]
