"""``ddp-course collect ZIP_OR_DIR``: file students' notebooks into submitted/ and the gradebook.

Each notebook goes to nbgrader's standard place,
``submitted/<student>/<assignment>/<notebook>.ipynb``, and each student is
added to the gradebook. How names are read is documented in
:mod:`course.instructor.names`. A file that cannot be placed, is not a
readable notebook, or is an older duplicate is reported, not filed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import click
import nbformat

from course.errors import CourseError
from course.instructor.coursedir import Course, course_dir_option
from course.instructor.names import Placement, Unplaced, place

_SKIP_PARTS = {"__MACOSX", ".ipynb_checkpoints"}


@dataclass
class CollectReport:
    """What collect did with each file it was given."""

    #: (file as given, placement, "new" | "updated" | "unchanged")
    filed: list[tuple[str, Placement, str]] = field(default_factory=list)
    #: (file as given, why it was not filed)
    problems: list[tuple[str, str]] = field(default_factory=list)


def _candidates(folder: Path) -> list[Path]:
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not _SKIP_PARTS.intersection(rel.parts) and not any(p.startswith(".") for p in rel.parts):
            files.append(path)
    return files


def _extract(archive: Path, dest: Path) -> None:
    """Unzip safely (no absolute or ``..`` paths), keeping each member's date as its mtime."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            name = PurePosixPath(info.filename)
            if info.is_dir() or name.is_absolute() or ".." in name.parts:
                continue
            target = dest.joinpath(*name.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            stamp = time.mktime(info.date_time + (0, 0, -1))
            os.utime(target, (stamp, stamp))


def collect(course: Course, given: Path) -> CollectReport:
    """File every notebook in the folder or zip ``given`` into ``course``'s submitted/ folder."""
    notebooks = {nb: a for a in course.source_assignments() for nb in course.notebooks(a)}
    report = CollectReport()
    with tempfile.TemporaryDirectory(prefix="ddp-collect-") as tmp:
        if given.is_file() and zipfile.is_zipfile(given):
            folder = Path(tmp)
            _extract(given, folder)
        elif given.is_dir():
            folder = given
        else:
            raise CourseError(f"{given} is neither a folder nor a zip file")

        chosen: dict[tuple[str, str], tuple[Path, Placement]] = {}
        for path in _candidates(folder):
            rel = path.relative_to(folder).as_posix()
            try:
                placement = place(rel, notebooks)
                nbformat.read(str(path), as_version=4)
            except Unplaced as why:
                report.problems.append((rel, str(why)))
                continue
            except Exception as err:  # nbformat raises several kinds for a broken file
                report.problems.append((rel, f"not a readable notebook ({type(err).__name__}: {err})"))
                continue
            key = (placement.student, placement.notebook)
            if key in chosen:
                older, newer = sorted([chosen[key], (path, placement)], key=lambda c: (c[0].stat().st_mtime, str(c[0])))
                report.problems.append(
                    (older[0].relative_to(folder).as_posix(),
                     f"older duplicate of {newer[0].relative_to(folder).as_posix()} ({placement.student}, "
                     f"{placement.notebook}): not filed")
                )
                chosen[key] = newer
            else:
                chosen[key] = (path, placement)

        with course.gradebook() as gb:
            for path, placement in chosen.values():
                target = course.folder("submitted", placement.student, placement.assignment) / f"{placement.notebook}.ipynb"
                if target.is_file() and target.read_bytes() == path.read_bytes():
                    status = "unchanged"
                else:
                    status = "updated" if target.exists() else "new"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, target)  # a fresh mtime: autograde sees it is newer than any old grade
                gb.update_or_create_student(placement.student)
                report.filed.append((path.relative_to(folder).as_posix(), placement, status))
    report.filed.sort(key=lambda f: (f[1].assignment, f[1].student))
    return report


@click.command()
@click.argument("given", metavar="ZIP_OR_DIR", type=click.Path(exists=True, path_type=Path))
@course_dir_option
def command(given, course_dir):
    """File students' notebooks (a folder or zip, one notebook per student) into submitted/."""
    from rich.console import Console
    from rich.table import Table

    course = Course.open(course_dir)
    report = collect(course, given)
    console = Console()
    table = Table("student", "assignment", "notebook", "from", "status", title=f"filed {len(report.filed)} notebook(s)")
    for rel, p, status in report.filed:
        table.add_row(p.student, p.assignment, f"{p.notebook}.ipynb", rel, status)
    console.print(table)
    if report.problems:
        problems = Table("file", "not filed because", title=f"{len(report.problems)} file(s) not filed", style="red")
        for rel, why in report.problems:
            problems.add_row(rel, why)
        console.print(problems)
