"""An nbgrader course directory as the instructor verbs see it: config, paths, gradebook.

Every verb loads the directory's own ``nbgrader_config.py`` (the file plain
``nbgrader`` commands read there too) and only pins ``CourseDirectory.root``,
so both kinds of commands agree on paths, course id and database URL.
"""

from __future__ import annotations

import logging
import os
from functools import cached_property
from pathlib import Path

import click

from course.errors import CourseError, unknown_names

CONFIG_FILE = "nbgrader_config.py"
#: our own records (autograde outcomes, logs, scratch space); nbgrader never looks inside
STATE_DIR = ".ddp-course"


def load_config(root: Path):
    """The traitlets config of the course at ``root`` (its nbgrader_config.py), rooted there."""
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    config = Config()
    if (root / CONFIG_FILE).is_file():
        try:
            config = PyFileConfigLoader(CONFIG_FILE, path=str(root)).load_config()
        except ImportError as err:
            if not (err.name or "").startswith("course."):
                raise
            raise CourseError(
                f"{root / CONFIG_FILE} was written by an older ddp-course: it imports {err.name}, which has moved. "
                f"Rewrite it with: ddp-course init --force {root} (your submissions and grades are kept)"
            ) from None
    config.CourseDirectory.root = str(root)
    return config


class Course:
    """One nbgrader course directory: its config, folders, gradebook and nbgrader API."""

    def __init__(self, root: Path | str, config=None):
        from nbgrader.coursedir import CourseDirectory

        self.root = Path(root).resolve()
        self.config = config if config is not None else load_config(self.root)
        self.coursedir = CourseDirectory(config=self.config)

    @classmethod
    def open(cls, root: Path | str | None = None) -> Course:
        """The course at ``root`` (default: the current folder); a clear error if it is not one,
        or if its gradebook is a database server that nbgrader cannot use (SQLite files are not checked)."""
        from course.instructor.gradebook import database_problem

        root = Path(root or os.getcwd()).resolve()
        if not (root / CONFIG_FILE).is_file():
            raise CourseError(
                f"{root} is not a course directory (no {CONFIG_FILE}); create one with: ddp-course init {root}"
            )
        course = cls(root)
        problem = database_problem(course.db_url)
        if problem:
            raise CourseError(problem)
        return course

    @property
    def course_id(self) -> str:
        return self.coursedir.course_id

    @property
    def db_url(self) -> str:
        return self.coursedir.db_url

    @cached_property
    def api(self):
        """nbgrader's own API on this course (generate_assignment, autograde, generate_feedback, ...)."""
        from nbgrader.apps import NbGraderAPI

        import course.instructor.gradebook  # noqa: F401 - new gradebooks stamped without a process of their own

        api = NbGraderAPI(coursedir=self.coursedir, config=self.config)
        api.log.setLevel(logging.WARNING)
        return api

    def gradebook(self):
        """A Gradebook on this course's database; use it as a context manager so it is closed."""
        from course.instructor.gradebook import Gradebook  # nbgrader's, its new gradebooks stamped in this process

        return Gradebook(self.db_url, self.course_id)

    def folder(self, kind: str, student: str = ".", assignment: str = ".") -> Path:
        """``kind`` is source, release, submitted, autograded or feedback (names as configured)."""
        name = getattr(self.coursedir, f"{kind}_directory")
        return Path(os.path.normpath(self.coursedir.format_path(name, student, assignment)))

    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    def source_assignments(self) -> list[str]:
        """Assignments in source/ (folders holding at least one notebook), sorted."""
        source = self.folder("source")
        if not source.is_dir():
            return []
        return sorted(p.name for p in source.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))

    def notebooks(self, assignment: str) -> list[str]:
        """Notebook names (file stems) of one source assignment."""
        return sorted(p.stem for p in self.folder("source", assignment=assignment).glob("*.ipynb"))

    def submitted(self, assignments: list[str] | None = None) -> list[tuple[str, str]]:
        """Every (assignment, student) with a folder in submitted/, sorted by assignment then student."""
        wanted = set(assignments) if assignments else None
        found = []
        submitted = self.folder("submitted")
        if not submitted.is_dir():
            return []
        for student_dir in submitted.iterdir():
            if not student_dir.is_dir() or student_dir.name.startswith("."):
                continue
            for assignment_dir in student_dir.iterdir():
                if assignment_dir.is_dir() and (wanted is None or assignment_dir.name in wanted):
                    found.append((assignment_dir.name, student_dir.name))
        return sorted(found)

    def pick_assignments(self, names: tuple[str, ...] | list[str]) -> list[str]:
        """The named assignments (all of source/ when none), with a clear error for unknown names."""
        known = self.source_assignments()
        if not names:
            return known
        unknown = [n for n in names if n not in known]
        if unknown:
            raise CourseError(unknown_names("assignment", unknown, known) + " (the folders of source/)")
        return list(names)

    def students(self) -> list[str]:
        """Every student with a folder in submitted/ or autograded/, sorted."""
        found = set()
        for kind in ("submitted", "autograded"):
            folder = self.folder(kind)
            if folder.is_dir():
                found.update(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        return sorted(found)

    def pick_students(self, names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """The named students, with a clear error (and the closest known name) for unknown ones."""
        if not names:
            return ()
        known = self.students()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise CourseError(unknown_names("student", unknown, known) + " (students with a submission)")
        return tuple(names)


def check_folder(out: Path) -> None:
    """That the folder ``out`` is to be written in exists: else one line naming the path and why (the folder
    does not exist, or a file stands where a folder of its path should be)."""
    out = Path(out).absolute()
    if out.parent.is_dir():
        return
    blocking = next((p for p in out.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise CourseError(f"cannot write {out}: {blocking} is a file, not a folder (nothing written)")
    raise CourseError(f"cannot write {out}: the folder {out.parent} does not exist (nothing written)")


def write_whole(out: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``out`` whole or not at all (a temporary file beside it, then a rename); one line naming
    the path and the cause when it cannot (a missing folder is not created). ``mode``: the file's permissions from
    the start (0o600: never readable by others, not even for a moment); default: as ``open`` makes it."""
    out = Path(out).absolute()
    check_folder(out)
    if out.is_dir():
        raise CourseError(f"cannot write {out}: it is a folder (nothing written)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666 if mode is None else mode)
        if mode is not None:
            os.fchmod(fd, mode)
        with open(fd, "w", newline="", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, out)
    except OSError as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise CourseError(f"cannot write {out}: {err.strerror or err} (nothing written)") from None


course_dir_option = click.option(
    "--course-dir",
    "-C",
    "course_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The nbgrader course directory (default: the current folder).",
)
