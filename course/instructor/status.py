"""``ddp-course status``: what is released, submitted, graded and sent back, and what failed to grade and why."""

from __future__ import annotations

from dataclasses import dataclass, field

import click

from course.instructor.autograde.records import Submission, is_graded, missing_notebook_reason, read_record
from course.instructor.coursedir import Course, course_dir_option


@dataclass
class AssignmentStatus:
    assignment: str
    released: bool
    submitted: int = 0
    graded: int = 0
    feedback: int = 0
    #: (student, "failed" | "timeout" | "on Slurm" | "on Kubernetes" | "not graded yet", why, log file or None)
    problems: list[tuple[str, str, str, str | None]] = field(default_factory=list)


def course_status(course: Course) -> list[AssignmentStatus]:
    """One entry per source assignment."""
    from course.instructor.autograde.batch import elsewhere

    with course.gradebook() as gb:
        in_gradebook = {a.name for a in gb.assignments}
    away = elsewhere(course)
    report = []
    for assignment in course.source_assignments():
        released = assignment in in_gradebook and any(course.folder("release", assignment=assignment).glob("*.ipynb"))
        status = AssignmentStatus(assignment, released)
        for _, student in course.submitted([assignment]):
            submission = Submission(assignment, student)
            status.submitted += 1
            if released and is_graded(course, submission):
                status.graded += 1
                if any(course.folder("feedback", student, assignment).glob("*.html")):
                    status.feedback += 1
                continue
            record = read_record(course, submission) or {}
            why = missing_notebook_reason(course, submission)
            if why:
                status.problems.append((student, "failed", why, None))
            elif submission in away:
                where = away[submission]
                status.problems.append((student, f"on {where.scheduler}", f"{where.place}: {where.merge}", None))
            elif record.get("status") in ("failed", "timeout"):
                status.problems.append((student, record["status"], record.get("reason", ""), record.get("log")))
            else:
                status.problems.append((student, "not graded yet", "run ddp-course autograde", None))
        report.append(status)
    return report


@click.command()
@course_dir_option
def command(course_dir):
    """Show what is released, submitted, graded and has feedback; list submissions that failed to grade."""
    from rich.console import Console
    from rich.table import Table

    course = Course.open(course_dir)
    report = course_status(course)
    console = Console()
    table = Table("assignment", "released", "submitted", "graded", "feedback", "not graded",
                  title=f"course {course.course_id} at {course.root}")
    for s in report:
        table.add_row(s.assignment, "yes" if s.released else "[yellow]no", str(s.submitted), str(s.graded),
                      str(s.feedback), f"[red]{len(s.problems)}" if s.problems else "0")
    console.print(table)
    problems = [(s.assignment, *p) for s in report for p in s.problems]
    if problems:
        detail = Table(title="submissions not graded")
        for column in ("assignment", "student", "state", "why", "log"):
            detail.add_column(column, no_wrap=column in ("assignment", "student", "state"), overflow="fold")
        for assignment, student, state, why, log in problems:
            detail.add_row(assignment, student, state, why, log or "",
                           style="red" if state in ("failed", "timeout") else None)
        console.print(detail)
