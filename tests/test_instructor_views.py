"""The instructor's views and late work: ``status --student``, ``report``, ``duedate``, ``export`` (late marks,
Canvas CSV).

Most tests build a graded tiny course by hand (:func:`graded_course`: the gradebook entries nbgrader's release
and autograde make, and autograded notebooks with the outputs our grading pipeline writes), so they take well
under a second each; one test runs nbgrader's real autograde on one late submission of the tiny course to see
nbgrader's late-submission plugin compute the penalty export shows.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

import nbformat
import pytest
from click.testing import CliRunner

from course.cli import main
from course.instructor.coursedir import Course
from course.instructor.init import init_course

pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "files" / "exercises"
ASSIGNMENT, NOTEBOOK = "ex0-tiny", "tiny"
DUE = datetime(2026, 3, 1, 12, 0)  # naive UTC, as nbgrader stores it

#: the tiny notebook's checks and a class's outcomes: student -> {grade id: failure message, or None: passed}
CHECKS = {"test_double_visible": 1.0, "test_double_hidden": 1.0, "test_warning_is_harmless": 1.0,
          "test_rank_sum": 1.0}
SUM_HANG = ("FAILED check_rank_sum [rank 1]: the job did not finish within 20 s\n  try:      every rank must call "
            "the same collectives in the same order")
CLASS = {
    "alice": {},
    "bob": {"test_double_visible": "AssertionError: double(2) should be 4",
            "test_double_hidden": "NameError: name 'double' is not defined",
            "test_warning_is_harmless": "NameError: name 'double' is not defined",
            "test_rank_sum": "NameError: name 'rank_sum' is not defined"},
    "carol": {"test_rank_sum": SUM_HANG},
    "dave": {"test_rank_sum": SUM_HANG, "test_double_hidden": "AssertionError: secret: double(-5) should be -10"},
}
#: hand-in time relative to the due date (hours), and autograde's time spent (seconds)
HANDED_IN = {"alice": -2, "bob": -1, "carol": 30, "dave": 1}
ELAPSED = {"alice": 12.5, "bob": 8.0, "carol": 40.2, "dave": 39.0}


def _cli(*args: str, course: Course):
    """``ddp-course ARGS -C COURSE`` on a wide terminal (rich wraps tables to the width it sees)."""
    return CliRunner().invoke(main, [*args, "-C", str(course.root)], env={"COLUMNS": "300"})


#: the graded course, built once per process (a new nbgrader gradebook costs seconds: nbgrader runs `alembic heads`)
_BUILT = tempfile.TemporaryDirectory(prefix="ddp-graded-")


def graded_course(tmp_path: Path, penalty: dict[str, float] | None = None) -> Course:
    """The tiny course after release, collect and autograde of :data:`CLASS` (erin submitted, not graded;
    frank never submitted), built straight into the gradebook and folders; ``penalty``: late penalties as
    nbgrader's AssignLatePenalties would have set them."""
    built = Path(_BUILT.name) / "course"
    if not built.is_dir():
        _build(built)
    shutil.copytree(built, tmp_path / "course")
    course = Course(tmp_path / "course")
    with course.gradebook() as gb:
        for student, points in (penalty or {}).items():
            gb.find_submission_notebook(NOTEBOOK, ASSIGNMENT, student).late_submission_penalty = points
        gb.db.commit()
    return course


def _build(root: Path) -> None:
    init_course(root, exercises=TINY)
    course = Course(root)
    source = nbformat.read(course.folder("source", assignment=ASSIGNMENT) / f"{NOTEBOOK}.ipynb", as_version=4)
    with course.gradebook() as gb:
        gb.update_or_create_assignment(ASSIGNMENT, duedate=DUE)
        gb.update_or_create_notebook(NOTEBOOK, ASSIGNMENT)
        for cell in source.cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade"):
                gb.update_or_create_grade_cell(meta["grade_id"], NOTEBOOK, ASSIGNMENT, max_score=meta["points"],
                                               cell_type="code")
        for student in [*CLASS, "erin", "frank"]:
            gb.update_or_create_student(student)
        for student, failures in CLASS.items():
            gb.update_or_create_submission(ASSIGNMENT, student, timestamp=DUE + timedelta(hours=HANDED_IN[student]))
            for grade_id in CHECKS:
                grade = gb.find_grade(grade_id, NOTEBOOK, ASSIGNMENT, student)
                grade.auto_score = 0.0 if grade_id in failures else CHECKS[grade_id]
            gb.db.commit()
            _write_notebooks(course, source, student, failures)
            record = course.state_dir / "autograde" / ASSIGNMENT / f"{student}.json"
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"status": "graded", "reason": "", "elapsed": ELAPSED[student]}))
    erin = course.folder("submitted", "erin", ASSIGNMENT)
    erin.mkdir(parents=True)
    nbformat.write(source, erin / f"{NOTEBOOK}.ipynb")
    record = course.state_dir / "autograde" / ASSIGNMENT / "erin.json"
    record.write_text(json.dumps({"status": "timeout", "reason": "stopped after 40 s", "elapsed": 40.0}))


def _write_notebooks(course: Course, source, student: str, failures: dict[str, str]) -> None:
    for kind in ("submitted", "autograded"):
        folder = course.folder(kind, student, ASSIGNMENT)
        folder.mkdir(parents=True, exist_ok=True)
        nb = nbformat.from_dict(json.loads(nbformat.writes(source)))
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if kind == "autograded" and grade_id in CHECKS:
                message = failures.get(grade_id)
                if message is None:
                    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="passed\n")]
                elif message.startswith("FAILED"):
                    cell.outputs = [nbformat.v4.new_output("error", ename="CheckFailed", evalue=message,
                                                           traceback=message.splitlines())]
                else:
                    name, value = message.split(": ", 1)
                    cell.outputs = [nbformat.v4.new_output("error", ename=name, evalue=value,
                                                           traceback=["Traceback ...", message])]
        nbformat.write(nb, folder / f"{NOTEBOOK}.ipynb")


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- what a check checks ---------------------------------------------------------------------------------------


def test_checks_are_described_by_their_own_words(tmp_path):
    from course.instructor.checknames import describe_cell
    from course.instructor.results import check_descriptions

    # a check call: the grader's docstring, its whole first paragraph on one line
    assert describe_cell("graders.parallelism.check_shards(shard_batch)\n### BEGIN HIDDEN TESTS\n"
                         "graders.parallelism.check_shards(shard_batch, world_sizes=(4,))\n### END HIDDEN TESTS") == (
        "Every row of the global batch is on exactly one rank (disjoint and covering), for every world size.")
    assert describe_cell("graders.ddp_basics.check_setup(setup)").startswith(
        "After setup(rank, world_size) every rank is in one process group of the job's backend, as ")
    # an instructor's first comment wins; hidden-test lines and markers are never the description
    assert describe_cell("# every rank sees the same batch\ngraders.parallelism.check_shards(f)") == (
        "every rank sees the same batch")
    assert describe_cell("assert f(1) == 2\n### BEGIN HIDDEN TESTS\n# secret\nassert f(3) == 6\n"
                         "### END HIDDEN TESTS") == "assert f(1) == 2"
    assert describe_cell('assert double(2) == 4, "double(2) should be 4"') == "double(2) should be 4"
    # every test cell of every exercise gets a description from its check, none of them a line of code
    init_course(tmp_path / "course")
    course = Course(tmp_path / "course")
    for assignment in course.source_assignments():
        described = check_descriptions(course, assignment)
        assert described and all(d and "graders." not in d for d in described.values()), described


def test_descriptions_render_their_code_spans_on_the_terminal_and_in_html():
    from rich.text import Text

    from course.instructor.checknames import CODE_STYLE, as_html, as_plain, as_rich, shorten

    doc = ("Rank ``rank`` of ``world_size`` keeps `module.` off, within :func:`~graders.ddp_basics.checks.weight_tolerance`; "
           "``a<b & [bold]c[/bold]`` stays text. Then more.")
    assert as_plain(doc) == ("Rank rank of world_size keeps module. off, within weight_tolerance(); "
                             "a<b & [bold]c[/bold] stays text. Then more.")
    # the terminal: no backticks, the code in its style, rich's own markup in a description escaped
    text = Text.from_markup(as_rich(doc))
    assert text.plain == as_plain(doc) and "`" not in text.plain
    styled = [text.plain[span.start:span.end] for span in text.spans if str(span.style) == CODE_STYLE]
    assert styled == ["rank", "world_size", "module.", "weight_tolerance()", "a<b & [bold]c[/bold]"]
    # a page: <code>, everything else escaped
    assert as_html(doc) == ("Rank <code>rank</code> of <code>world_size</code> keeps <code>module.</code> off, within "
                            "<code>weight_tolerance()</code>; <code>a&lt;b &amp; [bold]c[/bold]</code> stays text. "
                            "Then more.")
    assert as_html("if a < b: `x`") == "if a &lt; b: <code>x</code>" and as_plain("one `` unpaired") == "one `` unpaired"
    # shortened for status: the first sentence, cut at a word, never inside a code span
    assert shorten(doc, limit=200) == doc[:doc.index(" Then")]
    assert shorten(doc, limit=30) == "Rank ``rank`` of ``world_size`` keeps…"
    assert shorten("x " * 80, limit=10) == "x x x x x…"


def test_feedback_contents_name_checks_with_code_spans(tmp_path):
    from course.instructor.feedback import name_test_links

    page = tmp_path / "tiny.html"
    page.write_text('<ul><li><a href="#test_a">Test cell</a></li><li><a href="#test_b">Test cell</a></li></ul>')
    name_test_links(page, {"test_a": "``plan_step`` predicts what <ran> & `x`"})
    assert page.read_text() == ('<ul><li><a href="#test_a">test_a: <code>plan_step</code> predicts what &lt;ran&gt; '
                                '&amp; <code>x</code></a></li><li><a href="#test_b">test_b</a></li></ul>')


# -- status --student --------------------------------------------------------------------------------------------


def test_status_of_one_student_reads_only_and_takes_no_lock(tmp_path):
    from course.instructor.autograde.guards import course_lock

    course = graded_course(tmp_path, penalty={"carol": 0.5})
    before = snapshot(course.root)
    with course_lock(course):  # an autograde is running: the view still works
        result = _cli("status", "--student", "carol", course=course)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "2.5/4" in out and "late 1 d 6 h, penalty 0.5" in out, out  # 3 - 0.5 (penalty), 30 h late
    assert "test_rank_sum: assert course.run_ranks(rank_sum, 2, echo=False, timeout=20) == [3.0, 3.0]" in out
    assert "FAILED check_rank_sum [rank 1]: the job did not finish within 20 s" in out
    assert "every rank must call" not in out  # the first line only
    assert snapshot(course.root) == {**before, ".ddp-course/autograde.lock": snapshot(course.root)[
        ".ddp-course/autograde.lock"]}

    bob = " ".join(_cli("status", "--student", "bob", course=course).output.split())
    assert "0/4" in bob and "test_double_visible: double(2) should be 4" in bob, bob
    assert "AssertionError: double(2) should be 4" in bob and "penalty" not in bob  # handed in on time
    erin = " ".join(_cli("status", "--student", "erin", course=course).output.split())
    assert "timeout" in erin and "stopped after 40 s" in erin, erin
    frank = " ".join(_cli("status", "--student", "frank", course=course).output.split())
    assert "not submitted" in frank, frank
    unknown = _cli("status", "--student", "carl", course=course)
    assert unknown.exit_code == 1 and "did you mean carol?" in unknown.output, unknown.output


def test_status_view_names_missing_notebooks_first_then_only_failed_checks():
    from course.instructor.results import CheckResult, NotebookResult, Result
    from course.instructor.status import check_rows, notebook_lines

    result = Result(ASSIGNMENT, "carol", "graded", max_score=8.0, score=2.5, penalty=0.5, seconds_late=108000.0)
    result.notebooks = [NotebookResult("second", "not submitted", 4.0), NotebookResult("third", "not graded", 1.0),
                        NotebookResult("tiny", "graded", 4.0, 2.5, 0.5)]
    result.checks = [CheckResult("second", "test_a", 1.0, 0.0, handed_in=False),  # nbgrader's 0 for a missing one
                     CheckResult("tiny", "test_ok", 1.0, 1.0),
                     CheckResult("tiny", "test_sum", 1.0, 0.0, message=SUM_HANG),
                     CheckResult("tiny", "test_manual", 1.0, None)]
    assert notebook_lines(result) == ["[red]second.ipynb not submitted", "[yellow]third.ipynb not graded",
                                      "tiny.ipynb 2.5/4 [yellow]late, penalty 0.5"]
    described = {("tiny", "test_sum"): "Every rank's ``rank_sum`` is 3. Both ranks must call it.",
                 ("second", "test_a"): "``double`` doubles"}
    rows = check_rows(result, described)
    assert len(rows) == 1  # only what ran and failed
    notebook, label, points, outcome = (_shown(cell) for cell in rows[0])
    assert (notebook, label, points) == ("tiny", "test_sum: Every rank's rank_sum is 3.", "0/1")
    assert outcome == "FAILED check_rank_sum [rank 1]: the job did not finish within 20 s"  # the first line only
    every = [tuple(_shown(cell) for cell in row) for row in check_rows(result, described, all_checks=True)]
    assert [(row[1], row[2], row[3]) for row in every] == [
        ("test_a: double doubles", "-/1", "not submitted"), ("test_ok", "1/1", "passed"),
        ("test_sum: Every rank's rank_sum is 3. Both ranks must call it.", "0/1", SUM_HANG.splitlines()[0]),
        ("test_manual", "-/1", "not graded")]


def _shown(markup: str) -> str:
    """What a cell's rich markup shows."""
    from rich.text import Text

    return Text.from_markup(markup).plain


def partial_course(tmp_path: Path) -> Course:
    """:func:`graded_course` with a second notebook (its first check described by a comment with code spans)
    that carol did not hand in: nbgrader scores its checks 0 and writes no file for it."""
    course = graded_course(tmp_path, penalty={"carol": 0.5})
    source = nbformat.read(course.folder("source", assignment=ASSIGNMENT) / f"{NOTEBOOK}.ipynb", as_version=4)
    for cell in source.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "test_double_visible":
            cell.source = "# ``double(2)`` is ``4``: :func:`double` doubles\n" + cell.source
    nbformat.write(source, course.folder("source", assignment=ASSIGNMENT) / "second.ipynb")
    with course.gradebook() as gb:
        gb.update_or_create_notebook("second", ASSIGNMENT)
        for grade_id, points in CHECKS.items():
            gb.update_or_create_grade_cell(grade_id, "second", ASSIGNMENT, max_score=points, cell_type="code")
        gb.remove_submission(ASSIGNMENT, "carol")
        gb.update_or_create_submission(ASSIGNMENT, "carol", timestamp=DUE + timedelta(hours=HANDED_IN["carol"]))
        for grade_id in CHECKS:
            gb.find_grade(grade_id, NOTEBOOK, ASSIGNMENT, "carol").auto_score = (
                0.0 if grade_id in CLASS["carol"] else CHECKS[grade_id])
            gb.find_grade(grade_id, "second", ASSIGNMENT, "carol").auto_score = 0.0
        gb.find_submission_notebook(NOTEBOOK, ASSIGNMENT, "carol").late_submission_penalty = 0.5
        gb.db.commit()
    return course


def test_status_of_a_partial_submission_names_the_missing_notebook_before_its_checks(tmp_path):
    course = partial_course(tmp_path)
    result = _cli("status", "--student", "carol", course=course)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.replace("│", " ").split())
    assert "graded, partial 2.5/8 late 1 d 6 h, penalty 0.5" in out, out
    assert "second.ipynb not submitted tiny.ipynb 2.5/4 late, penalty 0.5" in out, out
    assert out.index("second.ipynb not submitted") < out.index("checks that failed")
    # only the check that ran and failed, with the first line of its message; none of the missing notebook's
    checks = out[out.index("checks that failed"):]
    assert "ex0-tiny tiny test_rank_sum" in checks and "the job did not finish within 20 s" in checks, checks
    assert "every rank must call" not in checks and "second" not in checks and "no message" not in checks
    assert len(result.output.splitlines()) < 25, result.output
    # every check: passed, failed, not submitted; code spans without their backticks
    every = _cli("status", "--student", "carol", "--all-checks", course=course)
    assert every.exit_code == 0, every.output
    out = " ".join(every.output.replace("│", " ").split())
    assert out.count(" passed ") == 3 and out.count(" not submitted ") == 1 + 4 and "1 d 6 h" in out, out
    assert "test_double_visible: double(2) is 4: double() doubles -/1 not submitted" in out, out
    assert "`" not in every.output
    bad = _cli("status", "--all-checks", course=course)
    assert bad.exit_code == 1 and "only with --student" in bad.output, bad.output

    # the report counts carol's missing notebook as missing, not as four failed checks; its page shows <code>
    page = tmp_path / "report.html"
    report = _cli("report", "--html", str(page), course=course)
    assert report.exit_code == 0, report.output
    out = " ".join(report.output.replace("│", " ").split())
    assert "ex0-tiny: second.ipynb not submitted" in out and "no message" not in out, out
    assert "test_double_visible: double(2) is 4: double() doubles" in out and "``" not in report.output
    assert "<td><code>double(2)</code> is <code>4</code>: <code>double()</code> doubles</td>" in page.read_text()


# -- report --------------------------------------------------------------------------------------------------


def report_page(tmp_path: Path) -> tuple[Course, Path]:
    """The graded tiny course and its report page (``ddp-course report``), checked for exit status and that
    nothing else in the course changed; for this file's tests and the browser test."""
    course = graded_course(tmp_path, penalty={"carol": 0.5})
    before = snapshot(course.root)
    page = tmp_path / "report.html"
    result = _cli("report", "--html", str(page), course=course)
    assert result.exit_code == 0, result.output
    assert snapshot(course.root) == before  # reads only
    return course, page


def test_report_names_checks_by_what_they_check_and_groups_failures(tmp_path):
    course, page = report_page(tmp_path)
    result = _cli("report", "--html", str(page), course=course)
    out = " ".join(result.output.replace("│", " ").split())
    # the check's id and what it checks, whole; its pass rate; failures grouped by first line, most common first
    assert "test_double_visible: double(2) should be 4" in out, out
    assert "test_rank_sum: assert course.run_ranks(rank_sum, 2, echo=False, timeout=20) == [3.0, 3.0]" in out
    assert "1/4 25%" in out
    assert out.index("2 x FAILED check_rank_sum [rank 1]: the job did not finish within 20 s") < out.index(
        "1 x NameError: name 'rank_sum' is not defined")
    assert "every rank must call" not in out  # first lines only
    # students: what is missing and why; grading time from the records (12.5 + 8 + 40.2 + 39 s, erin's 40 s timeout)
    assert "ex0-tiny: submitted, grading timeout: stopped after 40 s" in out
    assert "ex0-tiny: not submitted" in out
    assert "2 min 20 s" in out

    from html.parser import HTMLParser

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.svgs, self.rows, self.current = [], 0, {}, None

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.current = dict(attrs)["id"]
                self.tables.append(self.current)
                self.rows[self.current] = 0
            elif tag == "tr" and self.current:
                self.rows[self.current] += 1
            elif tag == "svg":
                self.svgs += 1

    parsed = Page()
    text = page.read_text()
    parsed.feed(text)
    assert parsed.tables == ["assignments", "checks", "students", "grading-time"]
    assert parsed.rows == {"assignments": 2, "checks": 5, "students": 7, "grading-time": 3}  # header rows included
    assert parsed.svgs == 3  # scores, pass rates, grading time: matplotlib's, inline
    assert "<script" not in text and "double(2) should be 4" in text and "test_double_visible" in text

    for out, why in ((tmp_path / "no" / "report.html", "does not exist"), (Path("/proc/report.html"), "/proc")):
        bad = _cli("report", "--html", str(out), course=course)
        assert bad.exit_code == 1 and why in bad.output and "Traceback" not in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1, bad.output
    assert not (tmp_path / "no").exists()


# -- export: late marks, graded 0 vs not submitted, Canvas ----------------------------------------------------------


def test_export_marks_late_work_and_reads_back_as_a_canvas_import(tmp_path):
    course = graded_course(tmp_path, penalty={"carol": 0.5})
    with course.gradebook() as gb:
        gb.update_or_create_student("frank", first_name="Frank", last_name="Nobody")
        gb.update_or_create_submission(ASSIGNMENT, "frank", extension=timedelta(days=2))  # an extension, no work
    out = tmp_path / "grades.csv"
    result = _cli("export", "--out", str(out), course=course)
    assert result.exit_code == 0, result.output
    with open(out, newline="") as fh:
        rows = {r["student_id"]: r for r in csv.DictReader(fh)}
    assert (rows["carol"]["status"], rows["carol"]["late"], rows["carol"]["seconds_late"]) == ("graded", "yes", "108000")
    assert (float(rows["carol"]["late_submission_penalty"]), float(rows["carol"]["score"])) == (0.5, 2.5)
    assert (rows["alice"]["late"], rows["alice"]["score"]) == ("no", "4.0")
    assert (rows["bob"]["status"], rows["bob"]["score"]) == ("graded", "0.0")  # a graded 0 ...
    assert (rows["frank"]["status"], rows["frank"]["late"]) == ("not submitted", "")  # ... is not this 0
    assert rows["erin"]["status"] == "not graded"
    table = " ".join(result.output.split())
    assert "2.5/4 late -0.5" in table and "0/4" in table and "-/4 not submitted" in table, table

    canvas = tmp_path / "canvas.csv"
    result = _cli("export", "--format", "canvas", "--canvas-id", f"{ASSIGNMENT}=4242", "--out", str(canvas),
                  course=course)
    assert result.exit_code == 0, result.output
    # read back by Canvas's documented rules: five identity columns, then "Name (ID)" per assignment, a
    # "Points Possible" row, students matched by SIS Login ID, blank = no grade
    with open(canvas, newline="") as fh:
        header, points, *students = list(csv.reader(fh))
    assert header[:5] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
    assignments = [re.fullmatch(r"(.+) \((\d+)\)", h).groups() for h in header[5:]]
    assert assignments == [(ASSIGNMENT, "4242")]
    assert points[0] == "Points Possible" and points[1:5] == ["", "", "", ""] and float(points[5]) == 4.0
    by_login = {row[3]: row for row in students}
    assert sorted(by_login) == ["alice", "bob", "carol", "dave", "erin", "frank"]
    assert by_login["frank"][0] == "Nobody, Frank" and by_login["frank"][5] == ""
    assert by_login["carol"][5] == "2.5" and by_login["bob"][5] == "0" and by_login["erin"][5] == ""
    for row in students:
        assert len(row) == len(header) and all(cell == "" or float(cell) >= 0 for cell in row[5:])

    before = snapshot(course.root)
    for args, why in ((["--canvas-id", "ex0-tinny=1", "--format", "canvas"], "did you mean ex0-tiny?"),
                      (["--canvas-id", f"{ASSIGNMENT}=abc", "--format", "canvas"], "ASSIGNMENT=NUMBER"),
                      (["--out", str(tmp_path / "none" / "g.csv")], "does not exist")):
        bad = _cli("export", *args, course=course)
        assert bad.exit_code == 1 and why in bad.output and "Traceback" not in bad.output, bad.output
    assert snapshot(course.root) == before


def test_export_names_a_file_in_the_way_and_canvas_says_one_line(tmp_path):
    course = graded_course(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    for out in (tmp_path / "afile" / "grades.csv", tmp_path / "afile" / "deeper" / "grades.csv"):
        for fmt in ("csv", "canvas"):
            bad = _cli("export", "--format", fmt, "--out", str(out), course=course)
            assert bad.exit_code == 1 and f"{tmp_path / 'afile'} is a file, not a folder" in bad.output, bad.output
            assert "does not exist" not in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output
    assert (tmp_path / "afile").read_text() == "not a folder"
    page = _cli("report", "--html", str(tmp_path / "afile" / "report.html"), course=course)
    assert page.exit_code == 1 and "is a file, not a folder" in page.output, page.output

    canvas = _cli("export", "--format", "canvas", "--out", str(tmp_path / "canvas.csv"), course=course)
    assert canvas.exit_code == 0, canvas.output
    assert canvas.output.splitlines() == [  # no table: one line, however narrow the terminal
        f"wrote 6 student(s) x 1 assignment(s) to {tmp_path / 'canvas.csv'} (Canvas gradebook import: 4 grade(s), "
        "2 empty cell(s) for work not graded)"]
    plain = _cli("export", "--out", str(tmp_path / "grades.csv"), course=course)
    assert plain.exit_code == 0 and plain.output.splitlines()[-1] == f"wrote 6 row(s) to {tmp_path / 'grades.csv'}"
    assert "grades" in plain.output.splitlines()[0]  # csv: the student-by-assignment table first


# -- due dates, extensions, the late policy --------------------------------------------------------------------------


def test_duedate_extensions_and_policy_go_through_nbgrader(tmp_path):
    from course.instructor.late import course_policy

    course = graded_course(tmp_path)

    def penalties() -> dict[str, float | None]:
        with course.gradebook() as gb:
            return {s: gb.find_submission_notebook(NOTEBOOK, ASSIGNMENT, s).late_submission_penalty for s in CLASS}

    # input errors first: exit 1, one line, nothing changed
    before = snapshot(course.root)
    for args, why in (([ASSIGNMENT, "1 March"], "YYYY-MM-DD HH:MM"),
                      ([ASSIGNMENT, "2026-03-01 13:00", "--tz", "Mars/Olympus"], "not a time zone"),
                      ([ASSIGNMENT, "--extend", "carl", "2d"], "did you mean carol?"),
                      ([ASSIGNMENT, "--extend", "carol", "two days"], "such as 2d"),
                      (["ex0-tinny", "2026-03-01 13:00"], "did you mean ex0-tiny?"),
                      (["--penalty", "lots"], "PERCENT/day"),
                      (["--cap", "150%"], "from 0 to 100")):
        bad = _cli("duedate", *args, course=course)
        assert bad.exit_code == 1 and why in bad.output and "Traceback" not in bad.output, (args, bad.output)
    assert snapshot(course.root) == before
    from course.instructor.autograde.guards import course_lock

    with course_lock(course):  # an autograde is merging: no due date, policy or extension changes under it
        busy = _cli("duedate", ASSIGNMENT, "2026-03-01 13:00", "--penalty", "5%/hour", course=course)
    assert busy.exit_code == 1 and "another ddp-course autograde is running" in busy.output, busy.output
    assert {k: v for k, v in snapshot(course.root).items() if not k.endswith("autograde.lock")} == before

    # 13:00 in Berlin (winter, UTC+1) is 12:00 UTC, as nbgrader stores it
    result = _cli("duedate", ASSIGNMENT, "2026-03-01 13:00", "--tz", "Europe/Berlin", course=course)
    assert result.exit_code == 0 and "due 2026-03-01 12:00 UTC" in result.output, result.output
    with course.gradebook() as gb:
        assert gb.find_assignment(ASSIGNMENT).duedate == DUE
    assert penalties() == {s: None for s in CLASS}  # marked late, no policy yet

    result = _cli("duedate", "--penalty", "10%/day", "--cap", "15%", course=course)
    assert result.exit_code == 0, result.output
    assert "10% of a notebook's points per day late" in " ".join(result.output.split())
    policy = course_policy(Course(course.root).config)
    assert (policy.penalty, policy.per, policy.cap) == (10.0, "day", 15.0)
    # carol: 30 h late = 2 started days = 20%, capped at 15% of 4 points; dave: 1 h = 10%
    assert penalties() == {"alice": None, "bob": None, "carol": 0.6, "dave": 0.4}

    result = _cli("duedate", ASSIGNMENT, "--extend", "carol", "2d", "--extend", "frank", "1d", course=course)
    assert result.exit_code == 0, result.output
    assert penalties()["carol"] is None  # in time, with two more days
    with course.gradebook() as gb:
        assert gb.find_submission(ASSIGNMENT, "carol").extension == timedelta(days=2)
    listing = " ".join(_cli("duedate", course=course).output.split())
    assert "carol +2 d" in listing and "frank +1 d" in listing, listing
    frank = " ".join(_cli("status", "--student", "frank", course=course).output.split())
    assert "not submitted" in frank and "on time (extension +1 d)" in frank, frank
    again = _cli("duedate", "--penalty", "none", course=course)
    assert again.exit_code == 0 and "late work is marked, not penalised" in " ".join(again.output.split())
    assert penalties()["dave"] is None


# -- nbgrader computes the penalty: a real autograde of the tiny course ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_late_submission_gets_nbgraders_penalty_in_export(tmp_path):
    import zipfile

    from course.instructor.collect import collect
    from course.instructor.release import release_assignment
    from course.instructor.samples import make_sample

    init_course(tmp_path / "course", exercises=TINY)
    course = Course.open(tmp_path / "course")
    release_assignment(course, ASSIGNMENT)
    source = course.folder("source", assignment=ASSIGNMENT) / f"{NOTEBOOK}.ipynb"
    released = course.folder("release", assignment=ASSIGNMENT) / f"{NOTEBOOK}.ipynb"
    archive = tmp_path / "lms.zip"
    with zipfile.ZipFile(archive, "w") as zf:  # the zip's dates are what collect records (local time)
        zf.writestr(zipfile.ZipInfo(f"lena_{NOTEBOOK}.ipynb", (2026, 1, 10, 18, 0, 0)),
                    nbformat.writes(make_sample("reference", source, released)[0]))
        zf.writestr(zipfile.ZipInfo(f"mo_{NOTEBOOK}.ipynb", (2026, 1, 9, 11, 0, 0)),
                    nbformat.writes(make_sample("untouched", source, released)[0]))
    # due 30 h before lena's hand-in (this machine's time zone, as collect reads the zip): 2 started days late
    result = _cli("duedate", ASSIGNMENT, "2026-01-09 12:00", "--penalty", "25%/day", course=course)
    assert result.exit_code == 0, result.output
    assert not collect(course, archive).problems

    # as an instructor runs it: its own process (the worker pool forks, so not from this threaded test process)
    graded = subprocess.run(["ddp-course", "autograde", "--jobs", "2"], cwd=course.root, capture_output=True,
                            text=True, timeout=300)
    assert graded.returncode == 0, graded.stdout + graded.stderr
    assert re.search(r"lena\b.*graded", graded.stdout) and re.search(r"\bmo\b.*graded", graded.stdout), graded.stdout
    out = tmp_path / "grades.csv"
    assert _cli("export", "--out", str(out), course=course).exit_code == 0
    with open(out, newline="") as fh:
        rows = {r["student_id"]: r for r in csv.DictReader(fh)}
    lena, mo = rows["lena"], rows["mo"]
    assert (lena["late"], lena["seconds_late"]) == ("yes", "108000"), lena
    # nbgrader's AssignLatePenalties asked the course's LatePolicy: 2 days x 25% of 4 points
    assert (float(lena["raw_score"]), float(lena["late_submission_penalty"]), float(lena["score"])) == (4.0, 2.0, 2.0)
    assert (mo["late"], float(mo["late_submission_penalty"]), mo["status"]) == ("no", 0.0, "graded")

    # the views read the real autograded notebooks: what failed, and why, in their first lines
    lena_view = " ".join(_cli("status", "--student", "lena", course=course).output.split())
    assert "2/4" in lena_view and "late 1 d 6 h, penalty 2" in lena_view, lena_view
    mo_view = " ".join(_cli("status", "--student", "mo", course=course).output.split())
    assert "test_double_visible: double(2) should be 4" in mo_view and "NotImplementedError" in mo_view, mo_view
    report = _cli("report", course=course)
    assert report.exit_code == 0 and (course.root / "report.html").is_file(), report.output
    assert "1/2 50%" in " ".join(report.output.replace("│", " ").split()), report.output
