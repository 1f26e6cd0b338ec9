"""The instructor workflow on a PostgreSQL gradebook grades exactly as on SQLite (issue 5).

The same class (three students of exercise 1) is graded twice with the real
``ddp-course`` commands and real nbgrader: in a course whose gradebook is a
fresh PostgreSQL database and in one on the default SQLite file. Every grade
cell, comment, export row and feedback score must agree, and must match what
the autograded notebooks themselves show.

The server comes from env DDP_COURSE_POSTGRES_URL (a SQLAlchemy URL whose role
may create databases; docker/ci/install-postgres.sh prints one). Each run makes
its own database there and drops it at the end. Without a URL (or a driver, or
an answering server) the test skips, unless DDP_COURSE_REQUIRE_POSTGRES=1 (CI),
where it fails.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
import requirements_gate
from nbgrader.api import Gradebook

from course.instructor.coursedir import Course
from course.instructor.gradebook import database_problem
from course.instructor.leaks import plain_text
from course.instructor.samples import make_sample

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_URL = os.environ.get("DDP_COURSE_POSTGRES_URL", "")
#: the fastest exercise, and a class with a full, a partial and a zero score
ASSIGNMENT, NOTEBOOK = "ex1-parallelism", "parallelism"
CLASS = {"ada": "reference", "bob": "partial", "cy": "untouched"}
DUE = datetime(2030, 1, 1, 12, 0)
BOB_HANDED_IN, BOB_UTC = "2030-01-02 10:30:00+02:00", datetime(2030, 1, 2, 8, 30)

# nbgrader's own gradebook code trips SQLAlchemy autoflush warnings (harmless, not ours)
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")


def unavailable(reason: str):
    """Skip, or fail where DDP_COURSE_REQUIRE_POSTGRES=1 (CI)."""
    requirements_gate.unavailable(reason, "DDP_COURSE_REQUIRE_POSTGRES")


@pytest.fixture
def new_database():
    """``new_database(encoding="UTF8")``: the URL of a new, empty database on the server; all dropped after the test."""
    if not POSTGRES_URL:
        unavailable("no PostgreSQL server: set DDP_COURSE_POSTGRES_URL (docker/ci/install-postgres.sh prints one)")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError

    server = make_url(POSTGRES_URL)
    if server.get_backend_name() != "postgresql":
        pytest.fail(f"DDP_COURSE_POSTGRES_URL is not a PostgreSQL URL: {server}", pytrace=False)
    try:
        admin = create_engine(server, isolation_level="AUTOCOMMIT")
    except ImportError as exc:
        unavailable(f"no driver for {server.drivername} ({exc}): pip install -e '.[dev]'")
    made = []

    def make(encoding: str = "UTF8") -> str:
        name = f"ddp_course_test_{uuid.uuid4().hex[:12]}"
        problem = None
        try:
            conn = admin.connect()
        except DBAPIError as exc:
            problem = f"PostgreSQL at {server} does not let us in: {exc.orig}"
        else:
            with conn:
                try:
                    # the encoding asked for even on a cluster made under another locale (collation C fits any)
                    conn.execute(text(f"CREATE DATABASE \"{name}\" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' "
                                      "TEMPLATE template0"))
                    made.append(name)
                except DBAPIError as exc:
                    problem = f"cannot create a database on {server} (its role needs CREATEDB): {exc.orig}"
        if problem:
            unavailable(problem)
        return server.set(database=name).render_as_string(hide_password=False)

    try:
        yield make
    finally:
        if made:
            with admin.connect() as conn:
                for name in made:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def cli(*args: str, cwd: Path, timeout: float = 300) -> str:
    """Run ``ddp-course ARGS`` in ``cwd`` as an instructor would; its stdout."""
    proc = subprocess.run(["ddp-course", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"ddp-course {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def nbgrader(*args: str, cwd: Path, timeout: float = 300) -> None:
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def read_csv(path: Path) -> dict[str, dict]:
    with open(path, newline="") as fh:
        return {row["student_id"]: row for row in csv.DictReader(fh) if row["assignment"] == ASSIGNMENT}


def gradebook_contents(course_dir: Path) -> dict:
    """Every grade and comment of the assignment as the course's own gradebook holds them."""
    course = Course.open(course_dir)
    found = {}
    with Gradebook(course.db_url, course.course_id) as gb:
        for submission in gb.assignment_submissions(ASSIGNMENT):
            for nb in submission.notebooks:
                for grade in nb.grades:
                    found[(submission.student.id, nb.name, grade.name)] = (
                        grade.auto_score, grade.manual_score, grade.max_score, grade.needs_manual_grade)
                for comment in nb.comments:
                    found[(submission.student.id, nb.name, comment.name)] = comment.auto_comment
            found[(submission.student.id, "timestamp")] = submission.timestamp
    return found


def notebook_scores(course_dir: Path) -> dict[str, float]:
    """Each student's score as nbgrader's own rule reads it off the autograded notebook (not the gradebook)."""
    from nbgrader.utils import determine_grade

    scores = {}
    for path in (course_dir / "autograded").glob(f"*/{ASSIGNMENT}/{NOTEBOOK}.ipynb"):
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.metadata.get("nbgrader", {}).get("grade")]
        scores[path.parent.parent.name] = sum(determine_grade(c)[0] or 0 for c in cells)
    return scores


def feedback_scores(course_dir: Path) -> dict[str, list[str]]:
    """The "Score: x / y" lines of each student's feedback page, in page order."""
    pages = (course_dir / "feedback").glob(f"*/{ASSIGNMENT}/{NOTEBOOK}.html")
    return {p.parent.parent.name: re.findall(r"Score: [\d.]+ / [\d.]+", plain_text(p.read_text())) for p in pages}


def autograded_mtimes(course_dir: Path) -> dict[str, float]:
    return {str(p.relative_to(course_dir)): p.stat().st_mtime for p in (course_dir / "autograded").rglob("*.ipynb")}


def hidden_lines(source: Path) -> set[str]:
    found, inside = set(), False
    for cell in nbformat.read(source, as_version=4).cells:
        for line in cell.source.splitlines():
            if "BEGIN HIDDEN TESTS" in line or "END HIDDEN TESTS" in line:
                inside = "BEGIN" in line
            elif inside and len(line.strip()) >= 4:
                found.add(line.strip())
    return found


def test_database_problems_are_explained(monkeypatch):
    """No server needed: a missing driver or an unknown one is named, with what to install; never the password."""
    assert database_problem("sqlite:////nowhere/gradebook.db") is None  # SQLite files are nbgrader's business
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if it were not installed
    said = database_problem("postgresql+psycopg://grader:s3cret@db.example:5432/ddp")
    assert "needs the Python driver psycopg" in said and "pip install 'psycopg[binary]'" in said, said
    assert "s3cret" not in said
    assert "no database driver 'postgresql+nosuch'" in database_problem("postgresql+nosuch://db.example/ddp")
    assert "not a database URL" in database_problem("db.example:5432/ddp")


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_unusable_postgres_databases_are_explained(tmp_path, new_database):
    """A database that does not exist, or whose encoding nbgrader cannot read, stops every verb with what to do."""
    from sqlalchemy.engine import make_url

    ascii_url = new_database("SQL_ASCII")
    said = database_problem(ascii_url)
    assert "uses encoding SQL_ASCII" in said and "ENCODING 'UTF8'" in said, said
    missing = make_url(new_database()).set(database="ddp_course_no_such_db").render_as_string(hide_password=False)
    assert 'database "ddp_course_no_such_db" does not exist' in database_problem(missing)
    assert database_problem(new_database()) is None

    cli("init", str(tmp_path / "course"), "--db", ascii_url, cwd=tmp_path)
    proc = subprocess.run(["ddp-course", "release"], cwd=tmp_path / "course", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "uses encoding SQL_ASCII" in proc.stderr, proc.stderr
    assert f":{make_url(ascii_url).password}@" not in proc.stderr and ":***@" in proc.stderr  # password hidden


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_postgres_gradebook_grades_like_sqlite(tmp_path, new_database):
    postgres_url = new_database()
    marks = [("start", time.monotonic())]
    pg, lite = tmp_path / "pg", tmp_path / "sqlite"
    cli("init", str(pg), "--db", postgres_url, cwd=tmp_path)
    cli("init", str(lite), cwd=tmp_path)
    assert Course.open(pg).db_url == postgres_url  # the setting plain nbgrader reads in that folder too
    for course_dir in (pg, lite):
        cli("release", ASSIGNMENT, cwd=course_dir)
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    source, release = (pg / kind / ASSIGNMENT / f"{NOTEBOOK}.ipynb" for kind in ("source", "release"))
    for student, kind in CLASS.items():
        nbformat.write(make_sample(kind, source, release)[0], incoming / f"{student}_{NOTEBOOK}.ipynb")
    for course_dir in (pg, lite):
        cli("collect", str(incoming), cwd=course_dir)
        # dates make the round trip too: a due date, and a late hand-in stamped in another time zone
        course = Course.open(course_dir)
        with Gradebook(course.db_url, course.course_id) as gb:
            gb.update_or_create_assignment(ASSIGNMENT, duedate=DUE)
        (course_dir / "submitted" / "bob" / ASSIGNMENT / "timestamp.txt").write_text(BOB_HANDED_IN)
    marks.append(("init+release+collect x2", time.monotonic()))

    graded = cli("autograde", "--jobs", "2", cwd=pg)
    marks.append(("autograde postgres", time.monotonic()))
    cli("autograde", "--jobs", "2", cwd=lite)
    marks.append(("autograde sqlite", time.monotonic()))
    assert graded.count(" graded ") >= len(CLASS), graded
    assert not (pg / "gradebook.db").exists()  # the scores went to PostgreSQL, not to a SQLite file

    # PostgreSQL holds exactly what SQLite holds, cell by cell, and what the graded notebooks show
    in_postgres = gradebook_contents(pg)
    assert len(in_postgres) >= 4 * len(CLASS)
    assert in_postgres == gradebook_contents(lite)
    scores = notebook_scores(pg)
    assert scores == notebook_scores(lite)
    top = sum(float(c.metadata["nbgrader"].get("points", 0)) for c in nbformat.read(source, as_version=4).cells
              if c.metadata.get("nbgrader", {}).get("grade"))
    assert scores["ada"] == top > 0 and 0 < scores["bob"] < top and scores["cy"] == 0, scores

    # a second run finds everything graded in PostgreSQL and regrades nothing
    before = autograded_mtimes(pg)
    again = cli("autograde", "--jobs", "2", cwd=pg)
    marks.append(("autograde postgres again", time.monotonic()))
    assert again.count("already graded") == len(CLASS), again
    assert autograded_mtimes(pg) == before and len(before) == len(CLASS)
    assert gradebook_contents(pg) == in_postgres

    for course_dir in (pg, lite):
        cli("export", "--out", str(course_dir / "grades.csv"), cwd=course_dir)
        cli("feedback", cwd=course_dir)
    nbgrader("export", "--to", str(tmp_path / "plain.csv"), cwd=pg)
    marks.append(("export+feedback x2, nbgrader export", time.monotonic()))
    grades = read_csv(pg / "grades.csv")
    assert grades == read_csv(lite / "grades.csv")
    plain = read_csv(tmp_path / "plain.csv")  # plain nbgrader reads the same PostgreSQL gradebook
    assert {k: {c: row[c] for c in plain[k]} for k, row in grades.items()} == plain  # (ours adds columns)
    assert {student: float(row["raw_score"]) for student, row in grades.items()} == scores
    assert (grades["bob"]["duedate"], grades["bob"]["timestamp"]) == (str(DUE), str(BOB_UTC)), grades["bob"]

    pages = feedback_scores(pg)
    assert sorted(pages) == sorted(CLASS) and all(pages.values()), pages
    assert pages == feedback_scores(lite)
    secrets = hidden_lines(source)
    assert secrets
    for page in (pg / "feedback").glob("*/*/*.html"):
        text = plain_text(page.read_text())
        assert not [s for s in secrets if s in text], page

    status = cli("status", cwd=pg)
    marks.append(("status", time.monotonic()))
    n = len(CLASS)
    assert re.search(rf"{ASSIGNMENT}\s*│\s*yes\s*│\s*{n}\s*│\s*{n}\s*│\s*{n}\s*│\s*0\s*│", status), status
    steps = [f"{name} {t - prev:.0f}s" for (_, prev), (name, t) in zip(marks, marks[1:])]
    print(f"\nphases: {', '.join(steps)}; total {marks[-1][1] - marks[0][1]:.0f}s")


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ctrl_c_during_autograde_with_two_jobs_on_postgres_leaves_the_submission_for_the_next_run(
        tmp_path, new_database):
    """Autograde with two workers on a PostgreSQL gradebook, stopped by Ctrl-C while sam's notebook runs: sam's
    submission is not graded (interrupted), in PostgreSQL and in what status says, nothing is called failed, no
    SQLite file appears; the next run grades what is left, and the export shows both graded."""
    from test_instructor import cli as course_cli
    from test_instructor import course_with_a_slow_submission, sam_row, stop_while_grading
    from test_instructor import read_csv as course_csv

    course_dir = course_with_a_slow_submission(tmp_path, db_url=new_database())
    rc, output, _ = stop_while_grading(course_dir, ["--jobs", "2"], "ctrl-c")
    assert rc == 130, output
    assert "interrupted" in sam_row(output) and "failed" not in output, output
    wide = {"COLUMNS": "250"}
    status = course_cli("status", cwd=course_dir, env=wide).stdout
    assert "not graded (interrupted)" in sam_row(status) and "failed" not in status, status
    assert not (course_dir / "gradebook.db").exists()

    rerun = course_cli("autograde", "--jobs", "2", cwd=course_dir, env=wide).stdout
    assert re.search(r"graded\s+sam · ex0-tiny 4/4", rerun), rerun
    assert "interrupted" not in course_cli("status", cwd=course_dir, env=wide).stdout
    course_cli("export", "--out", str(tmp_path / "grades.csv"), cwd=course_dir)
    grades = course_csv(tmp_path / "grades.csv")
    assert {student: grades[(student, "ex0-tiny")]["status"] for student in ("alice", "sam")} == \
        {"alice": "graded", "sam": "graded"}, grades

