"""Every student's results, read and never written: what ``status --student`` and ``report`` show.

Where each fact comes from (nothing is run, nothing is locked):

* scores, late penalties, due dates, extensions, submission times: nbgrader's gradebook, opened read-only
  where it is a SQLite file (:func:`read_only_gradebook`);
* which notebooks were handed in: ``submitted/<student>/<assignment>/`` (nbgrader scores a notebook that is
  missing from a submission 0 and keeps no other trace of it);
* why a check failed: the autograded notebook's test cell outputs
  (``autograded/<student>/<assignment>/<notebook>.ipynb``, read as JSON);
* what a check checks: :func:`check_descriptions`, from the source notebook's test cells;
* how long grading took: autograde's records (``.ddp-course/autograde/<assignment>/<student>.json``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

from course.instructor.checknames import as_rich, describe_cell, first_line
from course.instructor.coursedir import Course

#: graded: scores in the gradebook; not graded: submitted (in submitted/) but not scored (yet, or grading failed)
State = Literal["graded", "not graded", "not submitted"]
#: how every view names a submission whose last grading was stopped before it ended (Ctrl-C, SIGTERM): not a
#: failure, and no score was earned; the next autograde grades it
INTERRUPTED = "not graded (interrupted)"


@dataclass
class CheckResult:
    """One test cell (a check) of one submission."""

    notebook: str
    grade_id: str
    max_points: float
    #: None: not scored
    points: float | None
    #: the failure message as the test cell's output shows it ("" when it passed)
    message: str = ""
    #: False: its notebook was not handed in (nbgrader scores its checks 0; they did not fail)
    handed_in: bool = True

    @property
    def passed(self) -> bool:
        return self.points is not None and self.points >= self.max_points

    @property
    def failed(self) -> bool:
        """Run and not passed: scored less than its points in a notebook that was handed in."""
        return self.handed_in and self.points is not None and not self.passed

    @property
    def first_line(self) -> str:
        """The message's first line: what groups failures of the same kind."""
        return first_line(self.message) if self.message else ("" if self.passed else "(no message: scored 0)")


@dataclass
class NotebookResult:
    """One notebook of one student's assignment."""

    name: str
    #: graded: scored; not graded: handed in, no scores (yet); not submitted: not handed in
    state: State
    max_score: float = 0.0
    #: after its late penalty; None unless graded
    score: float | None = None
    penalty: float = 0.0


@dataclass
class Result:
    """One student's result on one assignment."""

    assignment: str
    student: str
    state: State
    max_score: float = 0.0
    #: after the late penalty; None unless graded
    score: float | None = None
    penalty: float = 0.0
    seconds_late: float = 0.0
    duedate: datetime | None = None
    timestamp: datetime | None = None
    extension: timedelta | None = None
    checks: list[CheckResult] = field(default_factory=list)
    #: every notebook of the assignment, in name order
    notebooks: list[NotebookResult] = field(default_factory=list)
    #: autograde's record: "graded", "failed", "timeout", "interrupted", ... and why
    record_status: str = ""
    record_reason: str = ""
    #: seconds autograde spent on it (its last run)
    elapsed: float | None = None

    @property
    def late(self) -> bool:
        return self.seconds_late > 0

    @property
    def interrupted(self) -> bool:
        """Submitted and not graded because its last grading was stopped before it ended (:data:`INTERRUPTED`)."""
        return self.state == "not graded" and self.record_status == "interrupted"

    @property
    def failed(self) -> list[CheckResult]:
        """Checks that ran and did not pass (not those of a notebook that was not handed in)."""
        return [c for c in self.checks if c.failed]

    def notebooks_in(self, state: State) -> list[str]:
        """The names of this assignment's notebooks in ``state`` ("not submitted": missing from the submission)."""
        return [n.name for n in self.notebooks if n.state == state]


# -- the gradebook, read-only ------------------------------------------------------------------------------


@contextmanager
def read_only_gradebook(course: Course):
    """nbgrader's Gradebook on the course's database; a SQLite file is opened read-only (mode=ro), so reading
    can never change it, and it needs no lock (a running autograde keeps writing)."""
    from nbgrader.api import Gradebook

    from course.instructor.gradebook import sqlite_path

    path = sqlite_path(course.db_url)
    if path is not None and path.is_file():
        url = f"sqlite:///file:{path.resolve()}?mode=ro&uri=true"
        gb = Gradebook(url, course.course_id) if _has_course(path, course.course_id) else None
    else:
        gb = Gradebook(course.db_url, course.course_id) if path is None else None
    try:
        yield gb
    finally:
        if gb is not None:
            gb.close()


def _has_course(path: Path, course_id: str) -> bool:
    """Gradebook() inserts a missing course row: only open read-only a gradebook that already has it."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True) as db:
            return db.execute("SELECT 1 FROM course WHERE id = ?", (course_id,)).fetchone() is not None
    except sqlite3.Error:
        return False


def class_results(course: Course, assignments: Iterable[str] = (), students: Iterable[str] = ()) -> list[Result]:
    """A :class:`Result` per (assignment, student): every student the gradebook or the folders know,
    every assignment of source/ (or those named), sorted by assignment then student."""
    assignments = list(assignments) or course.source_assignments()
    students = set(students)
    submitted = set(course.submitted(assignments))
    results: list[Result] = []
    with read_only_gradebook(course) as gb:
        known = set(course.students()) | ({s.id for s in gb.students} if gb else set())
        wanted = sorted(known & students if students else known)
        recorded = {a.name: a for a in gb.assignments} if gb else {}
        for assignment in assignments:
            entry = recorded.get(assignment)
            graded = {s.student_id: s for s in entry.submissions} if entry else {}
            # not released yet: the points its source's test cells are worth
            most = float(entry.max_score) if entry else sum(c[2] for c in source_checks(course, assignment))
            for student in wanted:
                result = Result(assignment, student, "not submitted", duedate=entry.duedate if entry else None,
                                max_score=most)
                submission = graded.get(student)
                if submission is not None:
                    result.extension = submission.extension
                if submission is not None and _scored(submission):
                    _fill(course, result, submission)
                else:
                    if (assignment, student) in submitted:
                        result.state = "not graded"
                    result.notebooks = [NotebookResult(name, "not graded" if _handed_in(course, result, name)
                                                       else "not submitted")
                                        for name in course.notebooks(assignment)]
                _fill_record(course, result)
                results.append(result)
    return results


def _scored(submission) -> bool:
    """Whether autograde (or a grader) scored anything: a submission row made only to hold an extension is not."""
    return any(g.auto_score is not None or g.manual_score is not None for nb in submission.notebooks for g in nb.grades)


def _handed_in(course: Course, result: Result, notebook: str) -> bool:
    return any((course.folder(kind, result.student, result.assignment) / f"{notebook}.ipynb").is_file()
               for kind in ("submitted", "autograded"))


def _fill(course: Course, result: Result, submission) -> None:
    result.state = "graded"
    result.penalty = float(submission.late_submission_penalty or 0.0)
    result.score = max(0.0, float(submission.score) - result.penalty)
    result.max_score = float(submission.max_score)
    result.timestamp = submission.timestamp
    result.seconds_late = float(submission.total_seconds_late or 0.0)
    for notebook in sorted(submission.notebooks, key=lambda nb: nb.name):
        handed_in = _handed_in(course, result, notebook.name)
        messages = failure_messages(course.folder("autograded", result.student, result.assignment)
                                    / f"{notebook.name}.ipynb") if handed_in else {}
        scored = False
        for grade in notebook.grades:
            if grade.cell.cell_type != "code" or not grade.max_score:
                continue
            points = None if grade.auto_score is None and grade.manual_score is None else float(grade.score)
            scored = scored or points is not None
            check = CheckResult(notebook.name, grade.name, float(grade.max_score), points, handed_in=handed_in)
            if check.failed:
                check.message = messages.get(grade.name, "")
            result.checks.append(check)
        entry = NotebookResult(notebook.name, "graded" if handed_in and scored else
                               "not graded" if handed_in else "not submitted", float(notebook.max_score or 0.0))
        if entry.state == "graded":
            entry.penalty = float(notebook.late_submission_penalty or 0.0)
            entry.score = max(0.0, float(notebook.score) - entry.penalty)
        result.notebooks.append(entry)


def read_record(course: Course, assignment: str, student: str) -> dict:
    """autograde's record of how the last grading of ``student``'s ``assignment`` ended ({} if none)."""
    # autograde.records.record_path's place, read here without importing autograde (nbformat's slow import)
    try:
        record = json.loads((course.state_dir / "autograde" / assignment / f"{student}.json").read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _fill_record(course: Course, result: Result) -> None:
    record = read_record(course, result.assignment, result.student)
    result.record_status = record.get("status") or ""
    result.record_reason = record.get("reason") or ""
    result.elapsed = record.get("elapsed")


def failure_messages(path: Path) -> dict[str, str]:
    """{grade id: what its test cell's outputs say went wrong} for an autograded notebook (read as JSON:
    fast, nothing run); errors first (a check's message, else ``Name: value``), else what went to stderr."""
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    found = {}
    for cell in nb.get("cells", []):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") != "code" or not meta.get("grade"):
            continue
        errors, stderr = [], []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                name, value = output.get("ename", ""), str(output.get("evalue", ""))
                errors.append(value if name in ("CheckFailed", "NotRun") and value else f"{name}: {value}")
            elif output.get("output_type") == "stream" and output.get("name") == "stderr":
                text = output.get("text", "")
                stderr.append("".join(text) if isinstance(text, list) else text)
        text = "\n".join(errors) or ("stderr: " + "".join(stderr).strip() if "".join(stderr).strip() else "")
        if text:
            found[meta.get("grade_id", "")] = text
    return found


# -- what each check checks ---------------------------------------------------------------------------------


def check_descriptions(course: Course, assignment: str) -> dict[tuple[str, str], str]:
    """{(notebook, grade id): a short description} for every test cell of ``assignment``'s source notebooks
    (:func:`source_checks`)."""
    return {(notebook, grade_id): text for notebook, grade_id, _, text in source_checks(course, assignment)}


def source_checks(course: Course, assignment: str) -> list[tuple[str, str, float, str]]:
    """(notebook, grade id, points, description) for every test cell of ``assignment``'s source notebooks.

    The first that applies: the cell's own first comment line (``# every rank ...``, an instructor's words);
    the docstring's first paragraph of the check the cell calls (``graders.parallelism.check_shards(...)``, read from
    the grader's source, never imported); the message of the cell's first ``assert`` that has one; its first
    ``assert``; its first line. Hidden tests are never read.
    """
    found = []
    for path in sorted(course.folder("source", assignment=assignment).glob("*.ipynb")):
        try:
            nb = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for cell in nb.get("cells", []):
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell.get("cell_type") == "code" and meta.get("grade") and meta.get("grade_id"):
                source = cell.get("source", "")
                text = describe_cell("".join(source) if isinstance(source, list) else source)
                found.append((path.stem, meta["grade_id"], float(meta.get("points") or 0), text))
    return found


def check_label(grade_id: str, description: str) -> str:
    """A check as terminal tables show it, in rich markup: its id, then what it checks, its code spans styled
    (:func:`~course.instructor.checknames.as_rich`)."""
    from rich.markup import escape

    return f"{escape(grade_id)}: {as_rich(description)}" if description else escape(grade_id)
