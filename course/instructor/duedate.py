"""``ddp-course duedate``: due dates, extensions and the late policy (see :mod:`course.instructor.late`).

``ddp-course duedate`` lists them; ``ddp-course duedate ASSIGNMENT "2026-12-01 17:00" [--tz Europe/Berlin]``
sets nbgrader's own due date; ``--extend STUDENT 2d`` grants an extension (nbgrader's ``Submission.extension``;
``0`` removes it); ``--penalty 10%/day --cap 50%`` sets the course's late policy in nbgrader_config.py. Penalties
of submissions already graded are computed again by nbgrader's own AssignLatePenalties under the new settings
(no notebook runs again); every submission graded later gets them from autograde.
"""

from __future__ import annotations

from datetime import timedelta

import click

from course.errors import CourseError, unknown_names
from course.instructor.coursedir import CONFIG_FILE, Course, course_dir_option
from course.instructor.late import (
    course_policy,
    late_by,
    parse_duration,
    parse_percent,
    parse_rate,
    parse_when,
    shown,
    write_policy,
)


def set_duedate(course: Course, assignment: str, when) -> None:
    """nbgrader's due date of ``assignment`` (naive UTC; None removes it)."""
    with course.gradebook() as gb:
        gb.update_or_create_assignment(assignment, duedate=when)


def grant_extension(course: Course, assignment: str, student: str, length: timedelta | None) -> None:
    """nbgrader's extension for one submission; the row is made if the student has not submitted yet
    (it holds no scores: export and report still say "not submitted")."""
    with course.gradebook() as gb:
        gb.update_or_create_assignment(assignment)
        gb.update_or_create_student(student)
        gb.update_or_create_submission(assignment, student, extension=length)


def reapply_penalties(course: Course, assignments: list[str]) -> int:
    """Compute the late penalty of every graded notebook of ``assignments`` again, as nbgrader's autograde does
    (its AssignLatePenalties step with the course's plugin, on the gradebook's submission times); returns how
    many notebooks it went through. The caller holds the course lock: no autograde merges meanwhile."""
    from nbgrader.preprocessors import AssignLatePenalties

    step = AssignLatePenalties(config=course.config)
    done = 0
    with course.gradebook() as gb:
        step.init_plugin()
        step.gradebook = gb  # what its preprocess opens, here on the course's own gradebook and course id
        for assignment in gb.assignments:
            if assignment.name not in assignments:
                continue
            for submission in assignment.submissions:
                for notebook in submission.notebooks:
                    if not any(g.auto_score is not None or g.manual_score is not None for g in notebook.grades):
                        continue  # a row that only holds an extension: nothing graded
                    step.notebook_id, step.assignment_id, step.student_id = (notebook.name, assignment.name,
                                                                             submission.student_id)
                    # the lines of AssignLatePenalties.preprocess after it opens the gradebook
                    notebook.late_submission_penalty = None
                    if submission.total_seconds_late > 0:
                        penalty = step.plugin_inst.late_submission_penalty(
                            submission.student_id, notebook.score, submission.total_seconds_late)
                        if penalty is not None:
                            notebook.late_submission_penalty = step._check_late_penalty(notebook, penalty)
                    done += 1
        gb.db.commit()
    return done


def listing(course: Course):
    """The due dates, extensions and policy, as a rich table and a line."""
    from rich.table import Table

    from course.instructor.results import read_only_gradebook

    table = Table("assignment", "due", "extensions", title="due dates (nbgrader's gradebook)")
    with read_only_gradebook(course) as gb:
        recorded = {a.name: a for a in gb.assignments} if gb else {}
        for name in course.source_assignments():
            entry = recorded.get(name)
            extensions = ", ".join(f"{s.student_id} +{late_by(s.extension.total_seconds())}"
                                   for s in (entry.submissions if entry else []) if s.extension)
            table.add_row(name, shown(entry.duedate if entry else None), extensions or "")
    policy = course_policy(course.config)
    line = (f"late policy: {policy.describe()}" if policy else
            f"late policy: none set ({CONFIG_FILE} predates late policies; ddp-course duedate --penalty sets one)")
    return table, line


@click.command()
@click.argument("assignment", required=False)
@click.argument("when", metavar="[WHEN]", required=False)
@click.option("--tz", default=None, help="Time zone of WHEN, an IANA name (default: this machine's).")
@click.option("--clear", is_flag=True, help="Remove ASSIGNMENT's due date.")
@click.option("--extend", "extensions", nargs=2, multiple=True, metavar="STUDENT LENGTH",
              help="Give STUDENT more time on ASSIGNMENT: 2d, 36h, 1d12h, 90m; 0 removes it (repeatable).")
@click.option("--penalty", default=None, metavar="RATE",
              help="The course's late policy: PERCENT/hour or PERCENT/day of a notebook's points "
                   "(each started hour or day counts), or none.")
@click.option("--cap", default=None, metavar="PERCENT", help="The most a late penalty takes (default 100%).")
@course_dir_option
def command(assignment, when, tz, clear, extensions, penalty, cap, course_dir):
    """Set or list due dates, extensions and the late policy; penalties are nbgrader's, applied at autograde.

    \b
    ddp-course duedate                                   list them
    ddp-course duedate ex1-parallelism "2026-12-01 17:00" --tz Europe/Berlin
    ddp-course duedate ex1-parallelism --extend alice 2d
    ddp-course duedate --penalty 10%/day --cap 50%
    """
    from rich.console import Console

    course = Course.open(course_dir)
    console = Console()
    changes = bool(when or clear or extensions)
    if changes and not assignment:
        raise click.UsageError("name the ASSIGNMENT")
    if when and clear:
        raise click.UsageError("WHEN or --clear, not both")
    if assignment and not (changes or penalty or cap):
        raise click.UsageError("give WHEN, --clear or --extend for ASSIGNMENT (no options lists every due date)")
    # read and check everything first: a bad input changes nothing
    picked = course.pick_assignments([assignment]) if assignment else []
    due = parse_when(when, tz) if when else None
    granted = [(student, parse_duration(length)) for student, length in extensions]
    if granted:
        from course.instructor.results import read_only_gradebook

        with read_only_gradebook(course) as gb:
            known = set(course.students()) | ({s.id for s in gb.students} if gb else set())
        unknown = [s for s, _ in granted if s not in known]
        if unknown:
            raise CourseError(unknown_names("student", unknown, known) + " (students with a submission or in the "
                              "gradebook)")
    policy = None
    if penalty is not None or cap is not None:
        from course.instructor.latepolicy import LatePolicy

        current = course_policy(course.config) or LatePolicy()
        rate, per = parse_rate(penalty) if penalty is not None else (current.penalty, current.per)
        policy = (rate, per, parse_percent(cap, "--cap") if cap is not None else current.cap)

    if policy or changes:
        from course.instructor.autograde.guards import course_lock

        with course_lock(course):  # first: while an autograde runs, nothing here changes
            if policy:
                write_policy(course.root / CONFIG_FILE, *policy)
                course = Course.open(course.root)  # the new config
            if when or clear:
                set_duedate(course, picked[0], due)
                console.print(f"{picked[0]}: due {shown(due)}" if due else f"{picked[0]}: no due date")
            for student, length in granted:
                grant_extension(course, picked[0], student, length)
                console.print(f"{picked[0]}: {student} " + (f"has {late_by(length.total_seconds())} more" if length
                                                       else "has no extension"))
            count = reapply_penalties(course, picked or course.source_assignments())
        if count:
            console.print(f"late penalties of {count} graded notebook(s) computed again by nbgrader")
    table, line = listing(course)
    console.print(table)
    console.print(line)
