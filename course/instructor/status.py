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
    #: (student, "failed" | "timeout" | "on Slurm" | "on Kubernetes" | "not graded (interrupted)" | "not graded yet",
    #: why, log file or None)
    problems: list[tuple[str, str, str, str | None]] = field(default_factory=list)


def course_status(course: Course) -> list[AssignmentStatus]:
    """One entry per source assignment."""
    # here, not at the top: status --student needs neither (autograde imports nbformat, seconds)
    from course.instructor.autograde.batch import elsewhere
    from course.instructor.autograde.records import Submission, is_graded, missing_notebook_reason, read_record
    from course.instructor.results import INTERRUPTED

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
            elif record.get("status") == "interrupted":  # stopped before it ended: no failure, the next run grades it
                status.problems.append((student, INTERRUPTED, record.get("reason", ""), None))
            else:
                status.problems.append((student, "not graded yet", "run ddp-course autograde", None))
        report.append(status)
    return report


#: the styles of a notebook's state in ``status --student``
_NOTEBOOK_STYLE = {"not submitted": "red", "not graded": "yellow", "graded": ""}


def notebook_lines(result) -> list[str]:
    """What became of each notebook of one assignment, in rich markup, the missing (not submitted) ones first,
    then those not graded, then the graded ones with their score and late penalty."""
    from rich.markup import escape

    if result.state == "not submitted":
        return ["[dim]nothing submitted"]
    lines = []
    for state in ("not submitted", "not graded", "graded"):
        for notebook in (n for n in result.notebooks if n.state == state):
            name = escape(f"{notebook.name}.ipynb")
            if state != "graded":
                lines.append(f"[{_NOTEBOOK_STYLE[state]}]{name} {state}")
                continue
            line = f"{name} {notebook.score:g}/{notebook.max_score:g}"
            if result.late:
                line += f" [yellow]late, penalty {notebook.penalty:g}" if notebook.penalty else " [yellow]late"
            lines.append(line)
    if result.state == "not graded" and result.record_status in ("failed", "timeout"):
        lines.append(f"[red]grading {result.record_status}: {escape(result.record_reason)}")
    elif result.interrupted:
        lines.append(f"[yellow]grading interrupted: {escape(result.record_reason)}")
    return lines


def check_rows(result, described: dict[tuple[str, str], str], all_checks: bool = False,
               source: list[tuple[str, str, float, str]] = ()) -> list[tuple[str, str, str, str]]:
    """(notebook, check: what it checks, points, outcome) rows, in rich markup, for one assignment.

    By default only the checks that ran and failed, each with its description's first sentence and the first line
    of its message; ``all_checks``: every check with its whole description (passed, failed, not submitted, not
    graded); ``source``: the assignment's checks (:func:`~course.instructor.results.source_checks`), listed when
    nothing was graded."""
    from rich.markup import escape

    from course.instructor.checknames import shorten
    from course.instructor.results import check_label

    rows = []
    if all_checks and not result.checks:
        states = {n.name: n.state for n in result.notebooks}
        for notebook, grade_id, points, description in source:
            rows.append((notebook, check_label(grade_id, description), f"-/{points:g}",
                         f"[dim]{states.get(notebook, result.state)}"))
        return rows
    for check in result.checks:
        if not (all_checks or check.failed):
            continue
        description = described.get((check.notebook, check.grade_id), "")
        label = check_label(check.grade_id, description if all_checks else shorten(description))
        points = f"{check.points:g}/{check.max_points:g}" if check.points is not None else f"-/{check.max_points:g}"
        if check.failed:
            outcome = f"[red]{escape(check.first_line)}"
        elif not check.handed_in:
            outcome, points = "[dim]not submitted", f"-/{check.max_points:g}"
        elif check.points is None:
            outcome = "[yellow]not graded"
        else:
            outcome = "[green]passed"
        rows.append((check.notebook, label, points, outcome))
    return rows


def student_view(course: Course, student: str, all_checks: bool = False) -> list:
    """One student's every assignment, as rich renderables: a table of each assignment's state, score, lateness
    and notebooks (which are missing, not graded, late), then the checks that failed with the first line of their
    message (``all_checks``: every check)."""
    from rich.table import Table

    from course.instructor.late import late_by
    from course.instructor.results import INTERRUPTED, check_descriptions, class_results, source_checks

    results = class_results(course, students=[student])
    if not results:
        course.pick_students([student])  # the error, with the closest known name
    table = Table(title=f"{student} in course {course.course_id}", show_lines=True)
    for column in ("assignment", "state", "score", "late", "notebooks"):
        table.add_column(column, overflow="fold", no_wrap=column in ("assignment", "state", "score"))
    for result in results:
        score = f"{result.score:g}/{result.max_score:g}" if result.score is not None else f"-/{result.max_score:g}"
        late = ""
        if result.late:
            late = f"[yellow]late {late_by(result.seconds_late)}, penalty {result.penalty:g}"
        elif result.extension:
            late = f"on time (extension +{late_by(result.extension.total_seconds())})"
        state = result.state
        if result.state == "not graded" and result.record_status in ("failed", "timeout"):
            state = f"[red]{result.record_status}"
        elif result.interrupted:
            state = f"[yellow]{INTERRUPTED}"
        elif result.state == "graded" and result.notebooks_in("not submitted"):
            state = "graded, [red]partial"
        table.add_row(result.assignment, state, score, late, "\n".join(notebook_lines(result)),
                      style="dim" if result.state == "not submitted" else None)

    title = ("every check" if all_checks else
             "checks that failed (first line of the message; --all-checks: every check)")
    checks = Table(title=f"{student}: {title}", show_lines=True)
    for column in ("assignment", "notebook", "check: what it checks", "points",
                   "outcome" if all_checks else "first line of the message"):
        checks.add_column(column, overflow="fold", no_wrap=column in ("assignment", "notebook", "points"))
    for result in results:
        if not (result.checks or all_checks):
            continue
        described = check_descriptions(course, result.assignment)
        source = source_checks(course, result.assignment) if all_checks and not result.checks else ()
        for row in check_rows(result, described, all_checks, source):
            checks.add_row(result.assignment, *row)
    if checks.row_count:
        return [table, checks]
    graded = any(r.state == "graded" for r in results)
    return [table, "no check failed" if graded else "no graded submission yet: no checks to show"]


@click.command()
@click.option("--student", default=None, help="One student's every assignment: score, late penalty, notebooks "
                                                "missing or not graded, checks that failed (reads only: it can run "
                                                "while autograde is grading).")
@click.option("--all-checks", is_flag=True, help="With --student: every check (passed, failed, not submitted, not "
                                                 "graded) with its whole description, not only those that failed.")
@course_dir_option
def command(student, all_checks, course_dir):
    """Show what is released, submitted, graded and has feedback; list submissions that failed to grade.

    With --student NAME: per assignment that student's score, late flag and penalty, and which notebooks are
    missing, not graded or late; then the checks that failed, with the first line of their message.
    """
    from rich.console import Console
    from rich.table import Table

    course = Course.open(course_dir)
    console = Console()
    if all_checks and student is None:
        raise click.UsageError("--all-checks: only with --student NAME")
    if student is not None:
        for part in student_view(course, student, all_checks):
            console.print(part)
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
