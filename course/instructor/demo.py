"""``ddp-course demo [DIR]``: the whole instructor workflow on sample submissions, in one command.

init -> release -> sample submissions (made now from the exercises' sources,
see :mod:`course.instructor.samples`) -> collect -> autograde -> grades table.
The course directory is kept, so every other verb (and plain nbgrader) can be
tried on it afterwards.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import click

from course.instructor.autograde import run_autograde, summary_table
from course.instructor.autograde.run import default_jobs
from course.instructor.collect import collect
from course.instructor.coursedir import Course
from course.instructor.export import export_grades, grade_table
from course.instructor.init import init_course
from course.instructor.release import release_assignment
from course.instructor.samples import write_samples

NAMES = ("ada", "bob", "chen", "dana", "eli", "fay", "gus", "hui")
#: what each demo student hands in, in order: a correct one first, then typical mistakes
DEMO_KINDS = ("reference", "mistakes", "partial", "untouched", "hang")


def demo_students(count: int) -> dict[str, str]:
    """``count`` students (name -> sample kind), cycling through the kinds."""
    names = (f"{n}{i or ''}" for i in itertools.count() for n in NAMES)
    return dict(zip(names, itertools.islice(itertools.cycle(DEMO_KINDS), count)))


def run_demo(root: Path, *, students: int = 2, jobs: int = 2, exercises: Path | None = None,
             assignments: tuple[str, ...] = (), console=None):
    """Run the whole workflow in ``root``; returns (course, autograde run, grade rows)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.rule(f"1. init {root}")
    init_course(root, exercises=exercises)
    course = Course.open(root)
    chosen = course.pick_assignments(assignments)

    console.rule("2. release (student copies, checked for solutions and hidden tests)")
    for assignment in chosen:
        release_assignment(course, assignment)
        console.print(f"released {assignment}")

    console.rule("3. sample submissions, filed with collect")
    roster = demo_students(students)
    notes = write_samples(course, roster, chosen, root / "incoming")
    report = collect(course, root / "incoming")
    table = Table("student", "assignment", "what it is", title=f"{len(report.filed)} submissions")
    for (student, assignment), note in sorted(notes.items()):
        table.add_row(student, assignment, note)
    console.print(table)

    console.rule(f"4. autograde, {jobs} at a time")
    run = run_autograde(course, chosen, jobs=jobs, console=console)
    console.print(summary_table(run.rows))

    console.rule("5. grades")
    rows = export_grades(course, root / "grades.csv")
    console.print(grade_table(rows))
    return course, run, rows


@click.command()
@click.argument("root", metavar="[DIR]", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--students", default=2, show_default=True, help="Sample students (reference solution, typical mistakes, ...).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=default_jobs(), show_default=True,
              help="Submissions graded at the same time (a positive integer; autograde's default).")
@click.option("--assignment", "assignments", multiple=True, help="Only this assignment (repeatable; default: all).")
@click.option("--exercises", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Folder of exercises to use (default: the course's).")
def command(root, students, jobs, assignments, exercises):
    """See the instructor workflow work: a course in DIR (default: a new temp folder), graded end to end."""
    from rich.console import Console

    root = root or Path(tempfile.mkdtemp(prefix="ddp-course-demo-"))
    console = Console()
    _, run, _ = run_demo(root, students=students, jobs=jobs, exercises=exercises, assignments=assignments,
                         console=console)
    console.print(f"\ncourse directory: {root}\n  grades:   {root / 'grades.csv'}\n"
                  f"  next:     ddp-course feedback -C {root}; ddp-course status -C {root}; "
                  f"or plain nbgrader commands in {root}")
    if run.interrupted:
        raise SystemExit(130)
