"""``ddp-course export``: the grades CSV, from nbgrader's own CsvExportPlugin.

One row per student and assignment, students without a submission included
(score 0, empty timestamp), as ``nbgrader export`` writes it, plus a ``status``
column (``graded`` or ``not submitted``: both can score 0); then a
student-by-assignment table on the terminal (``-`` for not submitted).
"""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path

import click

from course.errors import CourseError
from course.instructor.coursedir import Course, course_dir_option


def export_grades(course: Course, out: Path, assignments: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """Write the grades CSV to ``out`` with nbgrader's CsvExportPlugin; returns its rows."""
    from nbgrader.plugins import CsvExportPlugin

    out = Path(out).absolute()
    if not out.parent.is_dir():
        raise CourseError(f"cannot write {out}: the folder {out.parent} does not exist (nothing written)")
    if out.is_dir():
        raise CourseError(f"cannot write {out}: it is a folder (nothing written)")
    plugin = CsvExportPlugin(config=course.config)
    plugin.assignment = list(assignments)
    with tempfile.TemporaryDirectory(prefix="ddp-export-") as tmp:
        plugin.to = str(Path(tmp) / "grades.csv")
        with course.gradebook() as gb:
            plugin.export(gb)
            with open(plugin.to, newline="") as fh:
                rows = list(csv.DictReader(fh))
            graded = {(s.student.id, s.assignment.name) for a in gb.assignments for s in a.submissions}
    for row in rows:  # nbgrader writes 0 for "graded 0" and for "never submitted" alike: say which
        row["status"] = "graded" if (row["student_id"], row["assignment"]) in graded else "not submitted"
    try:
        with open(out, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=[*(rows[0] if rows else {"status": ""})])
            writer.writeheader()
            writer.writerows(rows)
    except OSError as err:
        raise CourseError(f"cannot write {out}: {err.strerror or err} (nothing written)") from None
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
            graded = row.get("status", "graded" if row["timestamp"] or score else "") == "graded"
            cells.append(f"{score:g}/{max_score:g}" if graded else f"[dim]-/{max_score:g}")
        table.add_row(student, *cells, f"{total:g}/{total_max:g}")
    return table


@click.command()
@click.argument("assignments", nargs=-1)
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="CSV file to write (default: grades.csv in the course directory).")
@course_dir_option
def command(assignments, out, course_dir):
    """Export grades to CSV: one row per student and assignment, non-submitters included."""
    from rich.console import Console

    course = Course.open(course_dir)
    out = out or course.root / "grades.csv"
    rows = export_grades(course, out, course.pick_assignments(assignments) if assignments else ())
    console = Console()
    if rows:
        console.print(grade_table(rows))
    console.print(f"wrote {len(rows)} row(s) to {out}")
