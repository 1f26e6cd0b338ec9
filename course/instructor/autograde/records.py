"""What autograde knows about each submission: whether it is graded, the record of its last outcome, the summary.

A :class:`Submission` is one (assignment, student) pair. A submission counts as graded
when its autograded notebooks exist, are newer than the submitted ones (and than its
timestamp.txt), and the gradebook holds its scores: the same test as nbgrader's own,
plus the scores. Each outcome is also recorded as JSON under the course's state folder,
for ``ddp-course status``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import nbformat

from course.instructor.coursedir import Course
from course.instructor.gradebook import is_recorded

#: how one submission's grading ended, as the summary table and ``ddp-course status`` say it
Status = Literal["graded", "already graded", "failed", "timeout", "interrupted", "not graded"]


@dataclass(frozen=True, order=True)
class Submission:
    assignment: str
    student: str

    def __str__(self) -> str:
        return f"{self.student} · {self.assignment}"


@dataclass
class Row:
    """One line of the summary table."""

    submission: Submission
    status: Status
    elapsed: float | None = None
    reason: str = ""
    score: float | None = None
    max_score: float | None = None
    zeroed: tuple[str, ...] = ()
    cell_timeouts: tuple[str, ...] = ()


# -- what is already done -------------------------------------------------------------------------------


def _submitted_notebooks(course: Course, submission: Submission) -> list[Path]:
    folder = course.folder("submitted", submission.student, submission.assignment)
    known = set(course.notebooks(submission.assignment))
    return sorted(p for p in folder.glob("*.ipynb") if p.stem in known)


def missing_notebook_reason(course: Course, submission: Submission) -> str | None:
    """Why nbgrader would find nothing to grade in this submission, or None."""
    if _submitted_notebooks(course, submission):
        return None
    folder = course.folder("submitted", submission.student, submission.assignment)
    found = ", ".join(p.name for p in sorted(folder.glob("*.ipynb"))) or "no notebook"
    wanted = ", ".join(f"{n}.ipynb" for n in course.notebooks(submission.assignment))
    return f"no {wanted} in {folder.relative_to(course.root)}/ (found: {found})"


def is_graded(course: Course, submission: Submission) -> bool:
    """Whether this submission's autograded notebooks are current and its scores are in the gradebook."""
    submitted = course.folder("submitted", submission.student, submission.assignment)
    autograded = course.folder("autograded", submission.student, submission.assignment)
    notebooks = _submitted_notebooks(course, submission)
    if not notebooks or not autograded.is_dir():
        return False
    for nb in notebooks:
        graded = autograded / nb.name
        if not graded.is_file() or graded.stat().st_mtime < nb.stat().st_mtime:
            return False
    new, old = (course.coursedir.get_existing_timestamp(str(p)) for p in (submitted, autograded))
    if new is not None and old is not None and new > old:
        return False
    return is_recorded(course.db_url, course.course_id, submission.assignment, submission.student)


# -- records of each outcome, for `ddp-course status` -------------------------------------------------------


def record_path(course: Course, submission: Submission) -> Path:
    return course.state_dir / "autograde" / submission.assignment / f"{submission.student}.json"


def log_path(course: Course, submission: Submission) -> Path:
    return course.state_dir / "logs" / submission.assignment / f"{submission.student}.log"


def write_record(course: Course, submission: Submission, status: Status, elapsed: float | None, reason: str = "",
                 log: str = "", isolation: str = "") -> None:
    """The submission's record: how its grading ended, why, its log; ``isolation``: the sandbox line of the
    machine that graded it (a Slurm task's node may isolate otherwise than this one)."""
    path = record_path(course, submission)
    path.parent.mkdir(parents=True, exist_ok=True)
    logfile = log_path(course, submission)
    if log:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        logfile.write_text(log)
    record = {
        "status": status,
        "reason": reason,
        "elapsed": round(elapsed, 1) if elapsed is not None else None,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "log": str(logfile.relative_to(course.root)) if log else None,
        "isolation": isolation or None,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def record_interrupted(course: Course, submission: Submission, elapsed: float | None, reason: str) -> Row:
    """Record that ``submission``'s grading was stopped before it ended (Ctrl-C, SIGTERM, a stop signal to its
    worker): not graded, and not a failure of the student's; the next run grades it. Its summary row. A submission
    that is still graded (``--force`` was grading it again) keeps that grading and its record."""
    if not is_graded(course, submission):
        write_record(course, submission, "interrupted", elapsed, reason)
    return Row(submission, "interrupted", elapsed, reason)


def read_record(course: Course, submission: Submission) -> dict | None:
    try:
        return json.loads(record_path(course, submission).read_text())
    except (OSError, ValueError):
        return None


# -- summary -------------------------------------------------------------------------------------------------


def fill_scores(course: Course, row: Row) -> Row:
    """Add the gradebook's score, zero-scored tests and timed-out cells to a summary row."""
    from nbgrader.api import MissingEntry

    with course.gradebook() as gb:
        try:
            submission = gb.find_submission(row.submission.assignment, row.submission.student)
        except MissingEntry:
            return row
        if row.status in ("graded", "already graded"):
            row.score, row.max_score = submission.score, submission.max_score
            row.zeroed = tuple(
                g.name for nb in submission.notebooks for g in nb.grades
                if g.max_score and g.score == 0 and g.cell.cell_type == "code"
            )
    autograded = course.folder("autograded", row.submission.student, row.submission.assignment)
    timeouts = []
    for path in sorted(autograded.glob("*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            for output in cell.get("outputs", []):
                if output.get("ename") == "CellTimeoutError":
                    timeouts.append(cell.metadata.get("nbgrader", {}).get("grade_id") or f"{path.stem} cell")
    row.cell_timeouts = tuple(timeouts)
    return row


def summary_table(rows: list[Row]):
    from rich.table import Table

    table = Table(title="autograde summary")
    for column in ("student", "assignment", "score", "status", "time", "notes"):
        # notes fold: a check id is never cut short ("ex2_test_set_epoc…"); status --student and report say what each does
        table.add_column(column, justify="right" if column in ("score", "time") else "left",
                         no_wrap=column != "notes", overflow="fold" if column == "notes" else "ellipsis")
    for row in sorted(rows, key=lambda r: (r.submission.student, r.submission.assignment)):
        score = f"{row.score:g} / {row.max_score:g}" if row.score is not None else "-"
        notes = []
        if row.zeroed:
            notes.append("0 points: " + ", ".join(row.zeroed))
        if row.cell_timeouts:
            notes.append("cell timed out: " + ", ".join(row.cell_timeouts))
        if row.reason:
            notes.append(row.reason)
        style = {"failed": "red", "timeout": "red", "interrupted": "yellow", "not graded": "yellow"}.get(row.status)
        table.add_row(row.submission.student, row.submission.assignment, score, row.status,
                      f"{row.elapsed:.0f} s" if row.elapsed is not None else "", "; ".join(notes), style=style)
    return table
