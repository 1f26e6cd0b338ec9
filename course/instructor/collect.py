"""``ddp-course collect ZIP_OR_DIR``: file students' notebooks into submitted/ and the gradebook.

Each notebook goes to nbgrader's standard place,
``submitted/<student>/<assignment>/<notebook>.ipynb``, and each student is
added to the gradebook. How names are read is documented in
:mod:`course.instructor.names`. A file that cannot be placed, is not a
readable notebook, or is an older duplicate is reported, not filed.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

import click
import nbformat

from course.errors import CourseError, PartlyDone
from course.instructor.coursedir import Course, course_dir_option
from course.instructor.names import Placement, Unplaced, place

_SKIP_PARTS = {"__MACOSX", ".ipynb_checkpoints"}
#: nbgrader's own file for when a submission was made (read by autograde for late penalties)
TIMESTAMP_FILE = "timestamp.txt"


@dataclass
class CollectReport:
    """What collect did with each file it was given: every entry is filed, not filed (with why) or skipped."""

    #: (file as given, placement, "new" | "updated" | "unchanged")
    filed: list[tuple[str, Placement, str]] = field(default_factory=list)
    #: (file as given, why it was not filed): a student's work that did not reach submitted/
    problems: list[tuple[str, str]] = field(default_factory=list)
    #: (file as given, why it was skipped): system files (macOS metadata, Jupyter checkpoints, hidden files)
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Copy:
    rel: str  # as given: the zip entry's name or the path in the folder
    path: Path  # where it is readable now
    time: float  # when it was submitted: the zip entry's date, or the file's modification time
    order: int  # position in the zip (later entries of the same name replace earlier ones when unzipped)


def _system(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return bool(_SKIP_PARTS.intersection(parts)) or any(p.startswith(".") for p in parts)


def _from_folder(folder: Path, report: CollectReport) -> list[_Copy]:
    copies = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_dir():
            continue
        if _system(rel):
            report.skipped.append((rel, "system file (macOS metadata, Jupyter checkpoint or hidden file)"))
        elif not path.is_file():
            report.problems.append((rel, "not a regular file (a link to nowhere, a device or a pipe)"))
        else:
            copies.append(_Copy(rel, path, path.stat().st_mtime, 0))
    return copies


def _from_zip(archive: Path, dest: Path, report: CollectReport) -> list[_Copy]:
    """Unzip safely: entries with absolute or ``..`` paths are reported, never written; each entry keeps its
    own file (two entries of one name are two copies), dated by the zip's record of it. A damaged zip is an error
    before anything is filed."""
    copies = []
    try:
        with zipfile.ZipFile(archive) as zf:
            for order, info in enumerate(zf.infolist()):
                name = PurePosixPath(info.filename)
                if info.is_dir():
                    continue
                if name.is_absolute() or ".." in name.parts or "\\" in info.filename:
                    report.problems.append((info.filename, "unsafe path in the zip (absolute, or with ..): not "
                                            "extracted; ask the student to submit it with a plain file name"))
                    continue
                if _system(info.filename):
                    report.skipped.append((info.filename, "system file (macOS metadata, Jupyter checkpoint or hidden "
                                           "file)"))
                    continue
                target = dest / str(order) / name.name  # one folder per entry: same names never overwrite
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                copies.append(_Copy(info.filename, target, time.mktime(info.date_time + (0, 0, -1)), order))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError) as err:
        raise CourseError(f"{archive}: the zip is damaged ({type(err).__name__}: {err}); nothing was filed. "
                          "Download it again") from None
    return copies


def _pick(copies: list[_Copy], placement: Placement, report: CollectReport) -> _Copy | None:
    """The copy to file when a student sent one notebook more than once: the newest (by submission time; a zip entry
    repeated under the same name: the later one, as unzip would); identical copies are one. Different copies with the
    same time under different names: none is guessed."""
    distinct: list[_Copy] = []
    for copy in sorted(copies, key=lambda c: (c.time, c.order), reverse=True):
        if any(c.path.read_bytes() == copy.path.read_bytes() for c in distinct):
            report.skipped.append((copy.rel, f"identical copy of {distinct[0].rel}"))
        else:
            distinct.append(copy)
    newest = distinct[0]
    tied = [c for c in distinct[1:] if c.time == newest.time and c.rel != newest.rel]  # one name twice: the later
    if tied:
        for copy in (newest, *tied):
            others = ", ".join(c.rel for c in (newest, *tied) if c is not copy)
            report.problems.append((copy.rel, f"{placement.student}'s {placement.notebook}.ipynb also came as {others}, "
                                    "different, with the same time: not filed (keep one copy and collect again)"))
        return None
    for copy in distinct[1:]:
        report.problems.append((copy.rel, f"older copy of {placement.student}'s {placement.notebook}.ipynb: "
                                f"{newest.rel} ({_when(newest.time)}) is newer than this one ({_when(copy.time)}) "
                                "and was filed"))
    return newest


def _when(stamp: float) -> str:
    return datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")


def _utc(stamp: float) -> str:
    """nbgrader's timestamp format (``parse_utc`` reads it)."""
    return datetime.fromtimestamp(stamp, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")


def _existing_time(course: Course, folder: Path) -> float | None:
    if not (folder / TIMESTAMP_FILE).is_file():
        return None
    try:
        found = course.coursedir.get_existing_timestamp(str(folder))
    except BaseException:  # nbgrader's fail() exits on an unreadable timestamp: write a new one
        return None
    if found is None:
        return None
    return (found if found.tzinfo else found.replace(tzinfo=timezone.utc)).timestamp()  # nbgrader: naive UTC


def collect(course: Course, given: Path) -> CollectReport:
    """File every notebook in the folder or zip ``given`` into ``course``'s submitted/ folder.

    Each submission folder gets nbgrader's ``timestamp.txt``: the newest submission time of the notebooks filed
    there (the zip entry's date, read as this machine's local time, or the file's modification time), so due dates
    and late penalties apply."""
    notebooks = {nb: a for a in course.source_assignments() for nb in course.notebooks(a)}
    report = CollectReport()
    with tempfile.TemporaryDirectory(prefix="ddp-collect-") as tmp:
        if given.is_dir():
            copies = _from_folder(given, report)
        elif given.is_file() and zipfile.is_zipfile(given):
            copies = _from_zip(given, Path(tmp), report)
        elif given.is_file() and given.suffix.lower() == ".zip":
            raise CourseError(f"{given}: not a readable zip file (damaged or truncated?); nothing was filed")
        else:
            raise CourseError(f"{given} is neither a folder nor a zip file")

        by_key: dict[tuple[str, str], list[_Copy]] = {}
        placements: dict[tuple[str, str], Placement] = {}
        for copy in copies:
            try:
                placement = place(copy.rel, notebooks)
                nbformat.read(str(copy.path), as_version=4)
            except Unplaced as why:
                report.problems.append((copy.rel, str(why)))
                continue
            except Exception as err:  # nbformat raises several kinds for a broken file
                report.problems.append((copy.rel, f"not a readable notebook ({type(err).__name__}: {err})"))
                continue
            key = (placement.student, placement.notebook)
            by_key.setdefault(key, []).append(copy)
            placements[key] = placement
        chosen = [(c, placements[k]) for k, cs in by_key.items() if (c := _pick(cs, placements[k], report))]

        stamps: dict[Path, float] = {}
        with course.gradebook() as gb:
            for copy, placement in chosen:
                folder = course.folder("submitted", placement.student, placement.assignment)
                target = folder / f"{placement.notebook}.ipynb"
                if target.is_file() and target.read_bytes() == copy.path.read_bytes():
                    status = "unchanged"
                else:
                    status = "updated" if target.exists() else "new"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(copy.path, target)  # a fresh mtime: autograde sees it is newer than any old grade
                    stamps[folder] = max(stamps.get(folder, 0.0), copy.time)
                gb.update_or_create_student(placement.student)
                report.filed.append((copy.rel, placement, status))
        for folder, stamp in stamps.items():  # the submission's time: its newest notebook's
            old = _existing_time(course, folder)
            if old is None or old < stamp:
                (folder / TIMESTAMP_FILE).write_text(_utc(stamp))
    report.filed.sort(key=lambda f: (f[1].assignment, f[1].student))
    return report


@click.command()
@click.argument("given", metavar="ZIP_OR_DIR", type=click.Path(exists=True, path_type=Path))
@course_dir_option
def command(given, course_dir):
    """File students' notebooks (a folder or zip, one notebook per student) into submitted/.

    Every file is filed or listed with the reason. A student who sent one notebook twice: the newest copy is filed
    (the zip entry's date or the file's time; one zip entry name twice: the later); identical copies count once;
    different copies with the same time are not filed. Exit status: 0 all filed, 1 nothing done (a damaged zip, not a
    course), 2 some files not filed (listed).
    """
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
    if report.skipped:
        console.print(f"[dim]skipped {len(report.skipped)} file(s): "
                      + "; ".join(f"{rel} ({why})" for rel, why in report.skipped[:5])
                      + (" ..." if len(report.skipped) > 5 else ""))
    if report.problems:
        raise PartlyDone(f"{len(report.problems)} file(s) not filed (listed above); the rest was filed")
