"""``ddp-course status``: what is released, submitted, graded and sent back, and what failed to grade and why;
``status --student NAME``: one student's every assignment (read-only, no lock: it can run during an autograde)."""

from __future__ import annotations

from dataclasses import dataclass, field

import click

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
    # here, not at the top: status --student needs neither (autograde imports nbformat, seconds)
    from course.instructor.autograde.batch import elsewhere
    from course.instructor.autograde.records import Submission, is_graded, missing_notebook_reason, read_record

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


def student_table(course: Course, student: str):
    """One student's every assignment: score/max, late flag and penalty, the checks that failed and why."""
    from rich.markup import escape
    from rich.table import Table

    from course.instructor.late import late_by
    from course.instructor.results import check_descriptions, check_label, class_results

    results = class_results(course, students=[student])
    if not results:
        course.pick_students([student])  # the error, with the closest known name
    table = Table(title=f"{student} in course {course.course_id}", show_lines=True)
    for column in ("assignment", "state", "score", "late", "checks not passed (first line of the message)"):
        table.add_column(column, overflow="fold", no_wrap=column in ("assignment", "state", "score"))
    for result in results:
        described = check_descriptions(course, result.assignment) if result.failed else {}
        score = f"{result.score:g}/{result.max_score:g}" if result.score is not None else f"-/{result.max_score:g}"
        late = ""
        if result.late:
            late = f"[yellow]late {late_by(result.seconds_late)}, penalty {result.penalty:g}"
        elif result.extension:
            late = f"on time (extension +{late_by(result.extension.total_seconds())})"
        failed = "\n".join(
            f"[bold]{escape(check_label(c.grade_id, described.get((c.notebook, c.grade_id), '')))}[/bold] "
            f"({c.points or 0:g}/{c.max_points:g})\n  {escape(c.first_line)}" for c in result.failed)
        state = result.state
        if result.state == "not graded" and result.record_status in ("failed", "timeout"):
            state = f"[red]{result.record_status}"
            failed = escape(result.record_reason)
        table.add_row(result.assignment, state, score, late, failed, style="dim" if result.state == "not submitted" else None)
    return table


@click.command()
@click.option("--student", default=None, help="One student's every assignment: score, late penalty, what failed "
                                                "(reads only: it can run while autograde is grading).")
@course_dir_option
def command(student, course_dir):
    """Show what is released, submitted, graded and has feedback; list submissions that failed to grade.

    With --student NAME: that student's score, late flag and penalty, and failed checks per assignment.
    """
    from rich.console import Console
    from rich.table import Table

    course = Course.open(course_dir)
    console = Console()
    if student is not None:
        console.print(student_table(course, student))
        return
    report = course_status(course)
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
