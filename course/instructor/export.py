"""``ddp-course export``: the grades CSV, from nbgrader's own CsvExportPlugin, or a Canvas gradebook import.

One row per student and assignment, students without a submission included
(score 0, empty timestamp), as ``nbgrader export`` writes it (its ``late_submission_penalty`` is the penalty
nbgrader's late-submission plugin computed, already taken off ``score``), plus

* ``status``: ``graded``, ``not graded`` (submitted, no scores yet), ``not graded (interrupted)`` (submitted, and
  its grading was stopped before it ended: no failure, the next autograde grades it) or ``not submitted``: each
  can score 0, and only ``graded`` is a score the student earned;
* ``late`` (``yes``/``no``, empty when nothing was graded) and ``seconds_late`` (after any extension);

then a student-by-assignment table on the terminal (``-`` for no score, ``late -0.5`` for a penalty) and one
line saying what was written.

``--format canvas`` writes the layout Canvas's gradebook import reads: ``Student, ID, SIS User ID,
SIS Login ID, Section``, then one column per assignment (``Name (ID)`` when ``--canvas-id NAME=ID`` gives
Canvas's assignment id, else ``Name``: a new assignment), a ``Points Possible`` row, then one row per
student with the score after the late penalty, empty where nothing was graded (Canvas leaves those cells
alone, so "not submitted" never becomes a 0); the terminal gets only the line saying what was written (the file
is for Canvas, not a view: ``status`` and ``report`` are).
"""

from __future__ import annotations

import csv
import io
import tempfile
from pathlib import Path

import click

from course.errors import CourseError
from course.instructor.coursedir import Course, check_folder, course_dir_option, write_whole

#: Canvas's gradebook columns before the assignments, in its order
CANVAS_COLUMNS = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")
#: which Canvas column carries the nbgrader student id (--canvas-match)
CANVAS_MATCH = {"sis-login": "SIS Login ID", "sis-user": "SIS User ID", "id": "ID"}


def grade_rows(course: Course, assignments: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """nbgrader's CsvExportPlugin rows, with ``status``, ``late`` and ``seconds_late`` added."""
    from nbgrader.plugins import CsvExportPlugin

    from course.instructor.results import INTERRUPTED, read_record

    plugin = CsvExportPlugin(config=course.config)
    plugin.assignment = list(assignments)
    submitted = set(course.submitted(list(assignments) or None))
    with tempfile.TemporaryDirectory(prefix="ddp-export-") as tmp:
        plugin.to = str(Path(tmp) / "grades.csv")
        with course.gradebook() as gb:
            plugin.export(gb)
            with open(plugin.to, newline="") as fh:
                rows = list(csv.DictReader(fh))
            late = {(s.student_id, a.name): float(s.total_seconds_late or 0.0)
                    for a in gb.assignments for s in a.submissions if _scored(s)}
    for row in rows:  # nbgrader writes 0 for "graded 0" and for "never submitted" alike: say which
        key = (row["student_id"], row["assignment"])
        row["late"] = ("yes" if late[key] > 0 else "no") if key in late else ""
        row["seconds_late"] = f"{late[key]:g}" if key in late else ""
        if key in late:
            row["status"] = "graded"
        elif key[::-1] in submitted:
            interrupted = read_record(course, key[1], key[0]).get("status") == "interrupted"
            row["status"] = INTERRUPTED if interrupted else "not graded"
        else:
            row["status"] = "not submitted"
    return rows


def _scored(submission) -> bool:
    """Scored by autograde or a grader: a row nbgrader keeps only for an extension is not a graded submission."""
    return any(g.auto_score is not None or g.manual_score is not None for nb in submission.notebooks for g in nb.grades)


def canvas_table(rows: list[dict], canvas_ids: dict[str, str] | None = None, match: str = "sis-login") -> list[list]:
    """The rows of a Canvas gradebook import: header, ``Points Possible``, one row per student."""
    canvas_ids = canvas_ids or {}
    assignments = sorted({r["assignment"] for r in rows})
    points = {r["assignment"]: r["max_score"] for r in rows}
    header = [*CANVAS_COLUMNS, *(f"{a} ({canvas_ids[a]})" if a in canvas_ids else a for a in assignments)]
    table = [header, ["Points Possible", "", "", "", "", *(_number(points[a]) for a in assignments)]]
    by_student: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_student.setdefault(row["student_id"], {})[row["assignment"]] = row
    id_column = CANVAS_COLUMNS.index(CANVAS_MATCH[match])
    for student, done in sorted(by_student.items()):
        first = next(iter(done.values()))
        name = ", ".join(n for n in (first.get("last_name"), first.get("first_name")) if n) or student
        line = [name, "", "", "", ""]
        line[id_column] = student
        line += [_number(done[a]["score"]) if a in done and done[a]["status"] == "graded" else "" for a in assignments]
        table.append(line)
    return table


def canvas_summary(rows: list[dict], out: Path) -> str:
    """The one line ``export --format canvas`` prints: what it wrote where."""
    students = len({r["student_id"] for r in rows})
    assignments = len({r["assignment"] for r in rows})
    graded = sum(r["status"] == "graded" for r in rows)
    return (f"wrote {students} student(s) x {assignments} assignment(s) to {out} (Canvas gradebook import: "
            f"{graded} grade(s), {len(rows) - graded} empty cell(s) for work not graded)")


def _number(text: str) -> str:
    return f"{float(text):g}" if text not in ("", None) else ""


def write_csv(out: Path, table: list[list]) -> None:
    """Write ``table`` to ``out`` whole or not at all; one line naming the path and the cause when it cannot."""
    buffer = io.StringIO()
    csv.writer(buffer).writerows(table)
    write_whole(out, buffer.getvalue())


def export_grades(course: Course, out: Path, assignments: list[str] | tuple[str, ...] = (), fmt: str = "csv",
                  canvas_ids: dict[str, str] | None = None, match: str = "sis-login") -> list[dict]:
    """Write the grades to ``out`` (nbgrader's CSV and our columns, or Canvas's import layout); returns the rows."""
    out = Path(out).absolute()
    check_folder(out)  # before reading anything: one line, nothing written
    rows = grade_rows(course, assignments)
    if fmt == "canvas":
        write_csv(out, canvas_table(rows, canvas_ids, match))
    else:
        fields = [*(rows[0] if rows else {"late": "", "seconds_late": "", "status": ""})]
        write_csv(out, [fields, *([row[f] for f in fields] for row in rows)])
    return rows


def grade_table(rows: list[dict]):
    """A rich table: one line per student, one column per assignment, and the total."""
    from rich.table import Table

    assignments = sorted({r["assignment"] for r in rows})
    students = sorted({r["student_id"] for r in rows})
    by_key = {(r["student_id"], r["assignment"]): r for r in rows}
    table = Table("student", *assignments, "total", title="grades")
    for student in students:
        cells, total, total_max = [], 0.0, 0.0
        for assignment in assignments:
            row = by_key.get((student, assignment))
            if row is None:
                cells.append("")
                continue
            score, max_score = float(row["score"]), float(row["max_score"] or 0)
            total, total_max = total + score, total_max + max_score
            status = row.get("status", "graded" if row["timestamp"] or score else "")
            if status == "graded":
                penalty = float(row.get("late_submission_penalty") or 0)
                late = (f" [yellow]late -{penalty:g}" if penalty else " [yellow]late") if row.get("late") == "yes" else ""
                cells.append(f"{score:g}/{max_score:g}{late}")
            else:
                cells.append(f"[dim]-/{max_score:g} {status}")
        table.add_row(student, *cells, f"{total:g}/{total_max:g}")
    return table


def _canvas_ids(pairs: tuple[str, ...], known: list[str]) -> dict[str, str]:
    from course.errors import unknown_names

    found = {}
    for pair in pairs:
        name, _, number = pair.partition("=")
        if not number.strip().isdigit():
            raise CourseError(f"--canvas-id {pair!r}: write ASSIGNMENT=NUMBER (Canvas's assignment id, a number)")
        found[name] = number.strip()
    unknown = [n for n in found if n not in known]
    if unknown:
        raise CourseError(unknown_names("assignment", unknown, known) + " (in --canvas-id)")
    return found


@click.command()
@click.argument("assignments", nargs=-1)
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="CSV file to write (default: grades.csv, or canvas-grades.csv, in the course directory).")
@click.option("--format", "fmt", type=click.Choice(["csv", "canvas"]), default="csv", show_default=True,
              help="csv: nbgrader's columns plus status and late; canvas: Canvas's gradebook import layout.")
@click.option("--canvas-id", "canvas_ids", multiple=True, metavar="ASSIGNMENT=ID",
              help="[canvas] Canvas's id of an assignment, for its column \"ASSIGNMENT (ID)\" (repeatable; without "
                   "one Canvas makes a new assignment of the column).")
@click.option("--canvas-match", type=click.Choice(sorted(CANVAS_MATCH)), default="sis-login", show_default=True,
              help="[canvas] The Canvas column that holds the nbgrader student id Canvas matches students by.")
@course_dir_option
def command(assignments, out, fmt, canvas_ids, canvas_match, course_dir):
    """Export grades: one row per student and assignment, non-submitters and late penalties included."""
    from rich.console import Console

    course = Course.open(course_dir)
    picked = course.pick_assignments(assignments) if assignments else []
    ids = _canvas_ids(canvas_ids, course.source_assignments())
    if ids and fmt != "canvas":
        raise click.UsageError("--canvas-id: only with --format canvas")
    out = out or course.root / ("canvas-grades.csv" if fmt == "canvas" else "grades.csv")
    rows = export_grades(course, out, picked, fmt, ids, canvas_match)
    console = Console()
    if fmt == "csv":
        if rows:
            console.print(grade_table(rows))
        console.print(f"wrote {len(rows)} row(s) to {out}", soft_wrap=True)
    else:
        console.print(canvas_summary(rows, out), soft_wrap=True)  # one line, however narrow the terminal
