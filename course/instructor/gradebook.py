"""Private gradebooks for parallel autograding, and merging their results into the real one.

SQLite is unsafe for parallel writers, and nbgrader writes the gradebook
throughout an autograde. So each worker grades against its own SQLite copy
(a snapshot of a SQLite gradebook; for PostgreSQL and others, a copy of just
what autograde reads: the assignments, their notebooks and cells as recorded
at release, and any extensions), and the parent copies the resulting scores
into the real gradebook, one submission at a time, in one transaction.
"""

from __future__ import annotations

import functools
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

from nbgrader.api import Gradebook


def _alembic_head_here() -> None:
    """Make nbgrader stamp a new gradebook without a process of its own.

    nbgrader's ``Gradebook`` stamps a database it creates with its schema's alembic head, which
    ``nbgrader.api.get_alembic_version`` finds by running ``alembic heads`` in a subprocess: a Python that imports
    alembic and SQLAlchemy, about 1.8 s for every new gradebook (each course made, each autograde's private
    copy). The same head, read here from nbgrader's own migration scripts with alembic's API, once per process;
    where that fails, nbgrader's own way."""
    import nbgrader.api

    original = nbgrader.api.get_alembic_version
    if getattr(original, "_ddp_course", False):
        return

    @functools.cache
    def get_alembic_version() -> str:
        try:
            from alembic.script import ScriptDirectory

            folder = os.path.join(os.path.dirname(nbgrader.__file__), "alembic")
            head = ScriptDirectory(folder).get_current_head()
        except Exception:  # noqa: BLE001 - an nbgrader laid out otherwise: ask alembic as nbgrader does
            head = None
        return head or original()

    get_alembic_version._ddp_course = True
    nbgrader.api.get_alembic_version = get_alembic_version



_alembic_head_here()  # every verb that opens a gradebook imports this module first (course.instructor.coursedir)


@contextmanager
def _quiet():
    """nbgrader's gradebook code trips SQLAlchemy's autoflush warnings; they are harmless noise here."""
    from sqlalchemy.exc import SAWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SAWarning)
        yield


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL, or None for any other database."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


#: pip packages of the drivers SQLAlchemy loads for a URL's ``+driver`` part (psycopg: postgresql:// on SQLAlchemy 2.1)
_DRIVER_PACKAGES = {"psycopg": "'psycopg[binary]'", "psycopg2": "psycopg2-binary", "pymysql": "pymysql"}


def database_problem(url: str) -> str | None:
    """Why nbgrader cannot use the (non-SQLite) gradebook database at ``url``, said so an instructor can fix it;
    None when it can. nbgrader itself only shows a traceback deep in its log for these."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return "the gradebook setting (CourseDirectory.db_url) is not a database URL: dialect+driver://user:password@host:port/database"
    if parsed.get_backend_name() == "sqlite":
        return None
    shown = parsed.render_as_string(hide_password=True)
    try:
        engine = create_engine(parsed)
    except ImportError as exc:
        driver = parsed.get_driver_name()
        return (f"the gradebook URL {shown} needs the Python driver {driver}, which does not load ({exc}): "
                f"pip install {_DRIVER_PACKAGES.get(driver, driver)}")
    except NoSuchModuleError:
        return f"SQLAlchemy knows no database driver {parsed.drivername!r} (gradebook URL {shown})"
    # straight through the driver: SQLAlchemy's own first connect already fails on a SQL_ASCII database
    dialect = engine.dialect
    try:
        cargs, cparams = dialect.create_connect_args(parsed)
        conn = dialect.connect(*cargs, **cparams)
    except dialect.loaded_dbapi.Error as exc:
        return f"cannot open the gradebook database {shown}: {str(exc).strip()}"
    finally:
        engine.dispose()
    try:
        if parsed.get_backend_name() != "postgresql":
            return None
        cursor = conn.cursor()
        cursor.execute("SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()")
        encoding = cursor.fetchone()[0]
    finally:
        conn.close()
    if isinstance(encoding, bytes):  # what psycopg returns from a SQL_ASCII database
        encoding = encoding.decode()
    if encoding != "UTF8":
        return (f"the gradebook database {shown} uses encoding {encoding}, where nbgrader reads text back as bytes "
                f"and fails; make it UTF8: CREATE DATABASE {parsed.database} ENCODING 'UTF8' TEMPLATE template0")
    return None


def make_template(real_url: str, course_id: str, assignments: list[str], template: Path,
                  submissions: list[tuple[str, str]] = ()) -> None:
    """The gradebook each worker starts from: a consistent snapshot of a SQLite gradebook (fast),
    else (PostgreSQL, ...) a SQLite copy of what autograde needs (see :func:`copy_assignments`)."""
    import sqlite3

    source = sqlite_path(real_url)
    if source is None or not source.is_file():
        copy_assignments(real_url, course_id, assignments, template, submissions)
        return
    template = Path(template)
    if template.exists():
        template.unlink()
    with sqlite3.connect(source) as real, sqlite3.connect(template) as copy:
        real.backup(copy)


def copy_assignments(real_url: str, course_id: str, assignments: list[str], template: Path,
                     submissions: list[tuple[str, str]] = ()) -> None:
    """Write a fresh SQLite gradebook at ``template`` holding ``assignments`` as the real gradebook has them.

    Extensions granted on any of ``submissions`` ((assignment, student) pairs) are copied too,
    so nbgrader computes late penalties in the copy exactly as it would in the real gradebook.
    """
    from nbgrader.api import MissingEntry

    template = Path(template)
    if template.exists():
        template.unlink()
    with _quiet(), Gradebook(real_url, course_id) as real, Gradebook(sqlite_url(template), course_id) as copy:
        for name in assignments:
            assignment = real.find_assignment(name)
            copy.update_or_create_assignment(name, duedate=assignment.duedate)
            for notebook in assignment.notebooks:
                copy.update_or_create_notebook(notebook.name, name, kernelspec=notebook.kernelspec)
                for cell in notebook.grade_cells:
                    copy.update_or_create_grade_cell(cell.name, notebook.name, name,
                                                     max_score=cell.max_score, cell_type=cell.cell_type)
                for cell in notebook.solution_cells:
                    copy.update_or_create_solution_cell(cell.name, notebook.name, name)
                for cell in notebook.task_cells:
                    copy.update_or_create_task_cell(cell.name, notebook.name, name,
                                                    max_score=cell.max_score, cell_type=cell.cell_type)
                for cell in notebook.source_cells:
                    copy.update_or_create_source_cell(cell.name, notebook.name, name, cell_type=cell.cell_type,
                                                      locked=cell.locked, source=cell.source, checksum=cell.checksum)
        for name, student in submissions:
            try:
                extension = real.find_submission(name, student).extension
            except MissingEntry:
                continue
            if extension:
                copy.update_or_create_student(student)
                copy.update_or_create_submission(name, student, extension=extension)


def merge_submission(scratch_url: str, real_url: str, course_id: str, assignment: str, student: str) -> None:
    """Copy one autograded submission's scores and comments from a worker's gradebook into the real one.

    Manual scores already in the real gradebook are kept, and (as nbgrader's
    SaveAutoGrades does) a grade with one is flagged for review again.
    """
    with _quiet(), Gradebook(scratch_url, course_id) as scratch, Gradebook(real_url, course_id) as real:
        graded = scratch.find_submission(assignment, student)
        real.update_or_create_student(student)
        real.update_or_create_submission(assignment, student, timestamp=graded.timestamp)
        for graded_nb in graded.notebooks:
            notebook = real.find_submission_notebook(graded_nb.name, assignment, student)
            notebook.late_submission_penalty = graded_nb.late_submission_penalty
            for graded_grade in graded_nb.grades:
                grade = real.find_grade(graded_grade.name, graded_nb.name, assignment, student)
                grade.auto_score = graded_grade.auto_score
                grade.needs_manual_grade = grade.manual_score is not None or grade.auto_score is None
            for graded_comment in graded_nb.comments:
                comment = real.find_comment(graded_comment.name, graded_nb.name, assignment, student)
                comment.auto_comment = graded_comment.auto_comment
        real.db.commit()


def is_recorded(real_url: str, course_id: str, assignment: str, student: str) -> bool:
    """Whether the real gradebook holds autograder scores for this submission (every graded code cell scored)."""
    from nbgrader.api import MissingEntry

    with Gradebook(real_url, course_id) as gb:
        try:
            submission = gb.find_submission(assignment, student)
        except MissingEntry:
            return False
        for notebook in submission.notebooks:
            for grade in notebook.grades:
                if grade.cell.cell_type == "code" and grade.auto_score is None and grade.manual_score is None:
                    return False
        return True
