"""``ddp-course release``: generate the student copies (nbgrader generate_assignment), then prove them clean.

Each copy in release/ is checked against its source notebook (see
:mod:`course.instructor.leaks`): no solution line, no hidden test line, no
region marker, no output; and every other file nbgrader copied from source/ must
be declared student material and hold no answer (:mod:`course.instructor.material`).
A release with any such file is deleted and the command fails, naming each file and
why, so nothing unsafe is left to hand out.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from course.errors import CourseError
from course.instructor.coursedir import Course, course_dir_option
from course.instructor.leaks import student_copy_leaks
from course.instructor.material import survey


class ReleaseLeak(CourseError):
    """A generated student copy contains solutions or hidden tests."""


def check_release(course: Course, assignment: str) -> dict[str, list[str]]:
    """{file: problems} for every file of ``assignment``'s release that must not reach students (a leaking
    student copy, a file no notebook declares, a declared file holding answers); empty when all are clean."""
    source = course.folder("source", assignment=assignment)
    release = course.folder("release", assignment=assignment)
    leaks = {}
    for src in sorted(source.glob("*.ipynb")):
        copy = release / src.name
        if not copy.is_file():
            leaks[src.name] = ["no student copy was generated"]
            continue
        problems = student_copy_leaks(src, copy)
        if problems:
            leaks[src.name] = problems
    for refused in survey(release, source).refused:  # every other file nbgrader copied from source/
        leaks.setdefault(refused.path, []).append(refused.reason)
    return leaks


def release_assignment(course: Course, assignment: str) -> Path:
    """Generate ``assignment``'s student copy and check it; returns its folder or raises ReleaseLeak."""
    result = course.api.generate_assignment(assignment, force=True, create=True)
    if not result["success"]:
        raise CourseError(f"nbgrader generate_assignment {assignment} failed:\n{result.get('error') or result.get('log')}")
    release = course.folder("release", assignment=assignment)
    leaks = check_release(course, assignment)
    if leaks:
        shutil.rmtree(release, ignore_errors=True)
        lines = [f"{assignment}/{name}: {p}" for name, problems in leaks.items() for p in problems]
        raise ReleaseLeak(
            f"the student copy of {assignment} would leak, so it was deleted:\n  " + "\n  ".join(lines)
            + "\nfix the source notebook (every solution inside ### BEGIN/END SOLUTION, hidden tests inside "
            "### BEGIN/END HIDDEN TESTS in a locked test cell), remove from source/ the files students must not "
            "get (a file they need is declared in its notebook's metadata: docs/writing-exercises.md) and release "
            "again"
        )
    return release


@click.command()
@click.argument("assignments", nargs=-1)
@course_dir_option
def command(assignments, course_dir):
    """Generate the student copies of all (or the named) assignments into release/ and check them."""
    course = Course.open(course_dir)
    for assignment in course.pick_assignments(assignments):
        release = release_assignment(course, assignment)
        names = ", ".join(p.relative_to(release).as_posix() for p in sorted(release.rglob("*")) if p.is_file())
        click.echo(f"released {assignment}: {release.relative_to(course.root)}/ ({names}); every file checked: "
                   "no solutions, no hidden tests")
