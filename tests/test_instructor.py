"""The instructor workflow on real nbgrader: init, release, collect, autograde, feedback, export, status.

Fast tests cover the pieces (file-name parsing, init idempotency, the release
leak check, the stderr pattern, feedback redaction, sample submissions). Slow
ones run the ``ddp-course`` commands end to end on a tiny assignment
(tests/files/exercises/ex0-tiny) and on the course's four exercises, and check
the results against plain ``nbgrader`` run in the same directory.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import psutil
import pytest

from course.grading.pipeline import WARNINGS_ONLY
from course.instructor import names
from course.instructor.coursedir import Course
from course.instructor.init import init_course
from course.instructor.leaks import plain_text, secrets_of, student_copy_leaks
from course.instructor.samples import make_sample, solution_text, stall_rank_one

# nbgrader's own gradebook code trips SQLAlchemy autoflush warnings (harmless, not ours)
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "files" / "exercises"
EXERCISES = ROOT / "exercises"
REAL = {
    "ex1-parallelism": "parallelism",
    "ex2-ddp-basics": "ddp_basics",
    "ex3-syncbn-sharding": "syncbn_sharding",
    "ex4-torchrun": "torchrun",
}


def cli(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None, check: bool = True):
    """Run ``ddp-course ARGS`` in ``cwd`` as an instructor would; the CompletedProcess."""
    proc = subprocess.run(["ddp-course", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, f"ddp-course {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def nbgrader(*args: str, cwd: Path, timeout: float = 600):
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def read_csv(path: Path) -> dict[tuple[str, str], dict]:
    with open(path, newline="") as fh:
        return {(r["student_id"], r["assignment"]): r for r in csv.DictReader(fh)}


def hidden_lines(source: Path) -> set[str]:
    """Hidden test lines of a source notebook, found independently of course.instructor.leaks."""
    found = set()
    for cell in nbformat.read(source, as_version=4).cells:
        inside = False
        for line in cell.source.splitlines():
            if "BEGIN HIDDEN TESTS" in line:
                inside = True
            elif "END HIDDEN TESTS" in line:
                inside = False
            elif inside and len(line.strip()) >= 4:
                found.add(line.strip())
    return found


def write_samples(course_dir: Path, kinds: dict[str, str], assignment: str, notebook: str, folder: Path) -> None:
    src = course_dir / "source" / assignment / f"{notebook}.ipynb"
    rel = course_dir / "release" / assignment / f"{notebook}.ipynb"
    for student, kind in kinds.items():
        nb, _ = make_sample(kind, src, rel)
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, folder / f"{student}_{notebook}.ipynb")


def edited(nb_path: Path, out: Path, old: str, new: str) -> None:
    nb = nbformat.read(nb_path, as_version=4)
    hits = 0
    for cell in nb.cells:
        if old in cell.source:
            cell.source = cell.source.replace(old, new)
            hits += 1
    assert hits, f"{old!r} not in {nb_path}"
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)


# -- fast: names ------------------------------------------------------------------------------------------

NOTEBOOKS = {name: assignment for assignment, name in REAL.items()}


@pytest.mark.parametrize(
    "path, student, assignment",
    [
        ("alice_parallelism.ipynb", "alice", "ex1-parallelism"),
        ("parallelism_alice.ipynb", "alice", "ex1-parallelism"),
        ("alice-ddp_basics.ipynb", "alice", "ex2-ddp-basics"),
        ("alice/parallelism.ipynb", "alice", "ex1-parallelism"),
        ("alice/ex4-torchrun/torchrun.ipynb", "alice", "ex4-torchrun"),
        ("submitted/alice/ex3-syncbn-sharding/syncbn_sharding.ipynb", "alice", "ex3-syncbn-sharding"),
        ("export/ex2-ddp-basics/bob_ddp_basics.ipynb", "bob", "ex2-ddp-basics"),
        ("alice_12345_67890_parallelism.ipynb", "alice", "ex1-parallelism"),
        ("alice_LATE_12345_67890_parallelism-1.ipynb", "alice", "ex1-parallelism"),
        ("alice_late_12345_67890_syncbn_sharding.ipynb", "alice", "ex3-syncbn-sharding"),
        ("Alice Smith_4242_assignsubmission_file_Torchrun.ipynb", "Alice_Smith", "ex4-torchrun"),
        ("12345_parallelism.ipynb", "12345", "ex1-parallelism"),
        ("bob.jones@uni.edu_ddp_basics.ipynb", "bob.jones@uni.edu", "ex2-ddp-basics"),
    ],
)
def test_collect_reads_student_and_assignment_from_names(path, student, assignment):
    placement = names.place(path, NOTEBOOKS)
    assert (placement.student, placement.assignment) == (student, assignment)
    assert placement.notebook == REAL[assignment]


@pytest.mark.parametrize(
    "path, why",
    [
        ("parallelism.ipynb", "folder named after the student"),
        ("alice_homework.ipynb", "no notebook name"),
        ("alice_parallelism.py", "not a notebook"),
        ("a$l_parallelism.ipynb", "cannot make a student id"),
        ("ex1-parallelism/parallelism.ipynb", "no student folder"),
    ],
)
def test_collect_reports_what_it_cannot_place(path, why):
    with pytest.raises(names.Unplaced, match=why):
        names.place(path, NOTEBOOKS)


def test_sample_mistakes_do_what_their_names_say():
    from course.instructor.samples import _answers, apply_mistakes

    def applied(assignment, notebook):
        answers = _answers(nbformat.read(EXERCISES / assignment / f"{notebook}.ipynb", as_version=4))
        return {name for text in answers.values() for name in apply_mistakes(text)[1]}

    # ex1 saves nothing: turning its other `if rank == 0:` guards into `if True:` is not "saves on every rank"
    assert "saves on every rank" not in applied("ex1-parallelism", "parallelism")
    assert "saves on every rank" in applied("ex2-ddp-basics", "ddp_basics")
    edited, names = apply_mistakes("if rank == 0:\n    print('loss', loss)\nif rank == 0:\n    torch.save(sd, p)\n")
    assert names == ["saves on every rank"] and edited.startswith("if rank == 0:\n    print")


def test_every_test_cell_is_described_by_what_it_checks_without_its_hidden_part():
    from course.instructor.checknames import describe_notebook

    for path in sorted(EXERCISES.glob("*/*.ipynb")):
        described = describe_notebook(path)
        hidden = hidden_lines(path)
        assert described, path
        for grade_id, about in described.items():
            assert len(about) > 20 and about != grade_id and "graders." not in about, (path.name, grade_id, about)
            assert not [line for line in hidden if line in about], (path.name, grade_id)


# -- fast: init --------------------------------------------------------------------------------------------


def test_init_is_idempotent_and_keeps_edits(tmp_path):
    course_dir = tmp_path / "course"
    first = dict(init_course(course_dir, exercises=TINY, course_id="cs-ddp"))
    assert first == {"nbgrader_config.py": "created", "source/ex0-tiny": "created"}
    again = dict(init_course(course_dir, exercises=TINY, course_id="cs-ddp"))
    assert set(again.values()) == {"unchanged"}

    config = course_dir / "nbgrader_config.py"
    config.write_text(config.read_text() + "\nTEST_CELL_TIMEOUT = 999  # the instructor's edit\n")
    notebook = course_dir / "source" / "ex0-tiny" / "tiny.ipynb"
    notebook.write_text(notebook.read_text().replace("return 2 * x", "return x + x"))
    kept = dict(init_course(course_dir, exercises=TINY, course_id="cs-ddp"))
    assert kept == {"nbgrader_config.py": "kept", "source/ex0-tiny": "kept"}
    assert "999" in config.read_text() and "return x + x" in notebook.read_text()

    forced = dict(init_course(course_dir, exercises=TINY, course_id="cs-ddp", force=True))
    assert set(forced.values()) == {"replaced"}
    assert "999" not in config.read_text() and "return x + x" not in notebook.read_text()


def test_init_config_is_what_nbgrader_reads(tmp_path):
    init_course(tmp_path, exercises=TINY, course_id="cs-ddp", db_url="postgresql://grader@db:5432/ddp",
                test_timeout=321, cell_timeout=12)
    course = Course(tmp_path)
    assert course.course_id == "cs-ddp"
    assert course.db_url == "postgresql://grader@db:5432/ddp"
    timeout_func = course.config.Execute.timeout_func
    test_cell = nbformat.v4.new_code_cell("x", metadata={"nbgrader": {"grade": True, "solution": False}})
    answer_cell = nbformat.v4.new_code_cell("x", metadata={"nbgrader": {"grade": False, "solution": True}})
    assert (timeout_func(test_cell), timeout_func(answer_cell), timeout_func(nbformat.v4.new_code_cell(""))) == (321, 12, 12)
    assert course.config.IgnorePattern.enabled is True
    assert course.config.Execute.kernel_name == "python3"
    assert course.config.Execute.shutdown_kernel == "immediate"


def test_only_pure_warning_stderr_is_ignored():
    pattern = re.compile(WARNINGS_ONLY)
    harmless = [
        "/x/torch/utils.py:12: UserWarning: TypedStorage is deprecated\n  return self.fget.__get__(instance)\n",
        "[W1129 16:21:00.123 ProcessGroupGloo.cpp:727] Warning: Unable to resolve hostname\n",
        "[rank0]:[W1129 16:21:00.1 Reducer.cpp:1] Warning: find_unused_parameters=True\n\n",
        "a.py:1: FutureWarning: x\n  y\nb.py:2: DeprecationWarning: z\n",
    ]
    harmful = [
        "Traceback (most recent call last):\n  File x\nValueError: boom\n",
        "a.py:1: UserWarning: x\nrank 1 crashed\n",
        "process 1 terminated with signal SIGKILL\n",
        "my own debug print\n",
    ]
    assert all(pattern.search(text) for text in harmless)
    assert not any(pattern.search(text) for text in harmful)


# -- fast: leaks, redaction, samples ---------------------------------------------------------------------------


def _clean_copy(source: Path, out: Path) -> None:
    """A student copy made by hand the way nbgrader makes one (solutions stubbed, hidden tests gone)."""
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        lines, skip = [], False
        for line in cell.source.splitlines():
            if "BEGIN SOLUTION" in line:
                lines += [line[: len(line) - len(line.lstrip())] + "# YOUR CODE HERE",
                          line[: len(line) - len(line.lstrip())] + "raise NotImplementedError()"]
                skip = True
            elif "BEGIN HIDDEN TESTS" in line:
                skip = True
            elif "END SOLUTION" in line or "END HIDDEN TESTS" in line:
                skip = False
            elif not skip:
                lines.append(line)
        cell.source = "\n".join(lines)
    nbformat.write(nb, out)


def test_release_leak_check(tmp_path):
    source = TINY / "ex0-tiny" / "tiny.ipynb"
    clean = tmp_path / "clean.ipynb"
    _clean_copy(source, clean)
    assert student_copy_leaks(source, clean) == []

    leaky = tmp_path / "leaky.ipynb"
    edited(clean, leaky, "raise NotImplementedError()", "return 2 * x")
    assert any("solution line left in: 'return 2 * x'" in p for p in student_copy_leaks(source, leaky))

    hidden = tmp_path / "hidden.ipynb"
    edited(clean, hidden, "assert double(3) == 6", 'assert double(3) == 6\nassert double(-5) == -10, "secret: double(-5) should be -10"')
    assert any(p.startswith("hidden test line left in") for p in student_copy_leaks(source, hidden))

    marker = tmp_path / "marker.ipynb"
    edited(clean, marker, "assert double(3) == 6", "assert double(3) == 6\n### BEGIN HIDDEN TESTS")
    assert any("region marker" in p for p in student_copy_leaks(source, marker))

    with_output = nbformat.read(clean, as_version=4)
    with_output.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="4\n")]
    nbformat.write(with_output, tmp_path / "output.ipynb")
    assert any("output" in p for p in student_copy_leaks(source, tmp_path / "output.ipynb"))


def test_secrets_ignore_lines_students_see_anyway():
    secrets = secrets_of(TINY / "ex0-tiny" / "tiny.ipynb")
    assert "return 2 * x" in secrets.solution
    assert secrets.hidden_tests == {'assert double(-5) == -10, "secret: double(-5) should be -10"'}
    assert "assert double(3) == 6" not in secrets.all  # visible in the same cell


def test_redaction_keeps_scores_and_messages_but_not_hidden_source():
    from course.instructor.redact import RedactHiddenTests

    source = "assert double(3) == 6\n### BEGIN HIDDEN TESTS\nassert double(-5) == -10, 'no'\n### END HIDDEN TESTS"
    cell = nbformat.v4.new_code_cell(source, metadata={"nbgrader": {"grade": True, "grade_id": "t", "points": 1}})
    cell.outputs = [nbformat.v4.new_output(
        "error", ename="AssertionError", evalue="no",
        traceback=["\x1b[0;31mAssertionError\x1b[0m   Traceback",
                   "Cell In[5], line 3\n      1 assert double(3) == 6\n----> 3 \x1b[38;5;28massert\x1b[39m double(-5) == -10, 'no'",
                   "\x1b[0;31mAssertionError\x1b[0m: no"])]
    nb = nbformat.v4.new_notebook(cells=[cell])
    out, _ = RedactHiddenTests().preprocess(nb, {})
    text = plain_text(json.dumps(out))
    assert "double(-5)" not in text and "HIDDEN TESTS" not in text
    assert "assert double(3) == 6" in out.cells[0].source  # the visible part stays
    assert out.cells[0].outputs[0].traceback[-1].endswith("no")  # the failure message stays
    assert out.cells[0].metadata["nbgrader"]["points"] == 1


def test_samples_are_made_from_the_source(tmp_path):
    source = TINY / "ex0-tiny" / "tiny.ipynb"
    release = tmp_path / "release.ipynb"
    _clean_copy(source, release)
    reference, _ = make_sample("reference", source, release)
    text = "\n".join(c.source for c in reference.cells)
    assert "return 2 * x" in text and "NotImplementedError" not in text and "BEGIN SOLUTION" not in text
    assert "double(-5)" not in text  # hidden tests are not part of a submission
    untouched, _ = make_sample("untouched", source, release)
    assert [c.source for c in untouched.cells] == [c.source for c in nbformat.read(release, as_version=4).cells]
    partial, _ = make_sample("partial", source, release)
    assert "\n".join(c.source for c in partial.cells).count("NotImplementedError") == 1
    hang, note = make_sample("hang", source, release)
    assert "rank 1 stalls in answer_rank_sum" in note
    stalled = next(c.source for c in hang.cells if "def rank_sum" in c.source)
    compile(stalled, "answer", "exec")
    assert stalled.index("time.sleep") < stalled.index("dist.all_reduce")
    assert stall_rank_one("%%writefile train.py\nimport torch.distributed as dist\ndef main():\n    dist.barrier()\n")
    assert solution_text("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION") == "def f():\n    return 1"


def test_feedback_redacts_even_with_an_old_config(tmp_path):
    from nbgrader.converters import GenerateFeedback

    from course.instructor.feedback import ensure_redaction
    from course.instructor.redact import RedactHiddenTests

    (tmp_path / "nbgrader_config.py").write_text('c = get_config()\nc.CourseDirectory.course_id = "old"\n')
    course = Course.open(tmp_path)
    ensure_redaction(course.api.config)
    assert RedactHiddenTests in GenerateFeedback(coursedir=course.coursedir, parent=course.api).preprocessors


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_template_gradebook_for_non_sqlite_databases(tmp_path):
    """What a worker gets when the real gradebook is not a SQLite file (PostgreSQL): assignments, cells, extensions."""
    from datetime import datetime, timedelta

    from nbgrader.api import Gradebook

    from course.instructor.gradebook import copy_assignments, sqlite_url

    real = sqlite_url(tmp_path / "real.db")
    with Gradebook(real, "cs") as gb:
        gb.add_assignment("a1", duedate=datetime(2030, 1, 1))
        gb.add_notebook("nb", "a1", kernelspec='{"name": "python3"}')
        gb.add_grade_cell("t1", "nb", "a1", max_score=2, cell_type="code")
        gb.add_solution_cell("s1", "nb", "a1")
        gb.add_source_cell("t1", "nb", "a1", cell_type="code", locked=True, source="check(f)", checksum="abc")
        gb.add_source_cell("s1", "nb", "a1", cell_type="code", source="def f(): ...", checksum="def")
        gb.add_student("alice")
        gb.add_submission("a1", "alice", extension=timedelta(days=2))
    copy_assignments(real, "cs", ["a1"], tmp_path / "copy.db", [("a1", "alice"), ("a1", "bob")])
    with Gradebook(sqlite_url(tmp_path / "copy.db"), "cs") as gb:
        assignment = gb.find_assignment("a1")
        assert assignment.duedate == datetime(2030, 1, 1)
        notebook = gb.find_notebook("nb", "a1")
        assert notebook.kernelspec == '{"name": "python3"}'
        assert [(c.name, c.max_score) for c in notebook.grade_cells] == [("t1", 2.0)]
        assert [c.name for c in notebook.solution_cells] == ["s1"]
        assert {c.name: (c.source, c.checksum, c.locked) for c in notebook.source_cells} == {
            "t1": ("check(f)", "abc", True), "s1": ("def f(): ...", "def", False)}
        assert gb.find_submission("a1", "alice").extension == timedelta(days=2)
        assert [s.id for s in gb.students] == ["alice"]


def test_collect_files_a_zip_and_reports_the_rest(tmp_path):
    init_course(tmp_path / "course", exercises=TINY)
    course = Course(tmp_path / "course")
    nb = nbformat.writes(nbformat.v4.new_notebook()).encode()
    archive = tmp_path / "lms.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(zipfile.ZipInfo("alice_111_222_tiny.ipynb", (2024, 1, 1, 10, 0, 0)), nb)
        zf.writestr(zipfile.ZipInfo("alice_111_333_tiny-1.ipynb", (2024, 1, 2, 10, 0, 0)), nb + b" ")
        zf.writestr("bob/tiny.ipynb", nb)
        zf.writestr("carol_essay.ipynb", nb)
        zf.writestr("dan_tiny.ipynb", b"{not json")
        zf.writestr("__MACOSX/._alice_tiny.ipynb", b"junk")
        zf.writestr("../evil_tiny.ipynb", nb)
    from course.instructor.collect import collect

    report = collect(course, archive)
    filed = {(p.student, p.assignment): (rel, status) for rel, p, status in report.filed}
    assert filed == {("alice", "ex0-tiny"): ("alice_111_333_tiny-1.ipynb", "new"),
                     ("bob", "ex0-tiny"): ("bob/tiny.ipynb", "new")}
    problems = dict(report.problems)
    assert "older copy" in problems["alice_111_222_tiny.ipynb"] and "alice_111_333_tiny-1.ipynb" in problems[
        "alice_111_222_tiny.ipynb"]
    assert "no notebook name" in problems["carol_essay.ipynb"]
    assert "not a readable notebook" in problems["dan_tiny.ipynb"]
    assert "unsafe path" in problems["../evil_tiny.ipynb"]
    assert not (tmp_path / "evil_tiny.ipynb").exists() and not list(tmp_path.rglob("evil*"))
    assert "system file" in dict(report.skipped)["__MACOSX/._alice_tiny.ipynb"]
    assert (tmp_path / "course/submitted/alice/ex0-tiny/tiny.ipynb").read_bytes() == nb + b" "
    # the submission's time is the newest filed copy's (the zip's date, local time), in nbgrader's own file
    stamp = course.coursedir.get_existing_timestamp(str(tmp_path / "course/submitted/alice/ex0-tiny"))
    assert stamp.replace(tzinfo=timezone.utc).astimezone().replace(tzinfo=None) == datetime(2024, 1, 2, 10, 0, 0)
    with course.gradebook() as gb:
        assert sorted(s.id for s in gb.students) == ["alice", "bob"]
    again = collect(course, archive)
    assert {status for _, _, status in again.filed} == {"unchanged"}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.filterwarnings("ignore:Duplicate name")  # the zip holds one name twice on purpose
def test_collect_lists_every_entry_it_does_not_file_and_guesses_no_tie(tmp_path):
    from click.testing import CliRunner

    from course.cli import main

    init_course(tmp_path / "course", exercises=TINY)
    course = Course(tmp_path / "course")
    nb = nbformat.v4.new_notebook()
    one, other = nbformat.writes(nb).encode(), nbformat.writes(nb).encode() + b"\n"
    noon = (2024, 3, 1, 12, 0, 0)
    archive = tmp_path / "lms.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(zipfile.ZipInfo("../../mallory_tiny.ipynb", noon), one)
        zf.writestr(zipfile.ZipInfo("/abs/oscar_tiny.ipynb", noon), one)
        zf.writestr(zipfile.ZipInfo("henry_tiny.ipynb", noon), one)
        zf.writestr(zipfile.ZipInfo("henry_tiny.ipynb", noon), other)  # the same name twice: the later entry wins
        zf.writestr(zipfile.ZipInfo("ivy/tiny.ipynb", noon), one)
        zf.writestr(zipfile.ZipInfo("ivy_tiny.ipynb", noon), other)  # a folder and a flat copy, same time, different
        zf.writestr(zipfile.ZipInfo("judy/tiny.ipynb", noon), one)
        zf.writestr(zipfile.ZipInfo("judy_tiny.ipynb", noon), one)  # the same bytes twice: one copy
    runner = CliRunner()
    result = runner.invoke(main, ["collect", str(archive), "-C", str(course.root)])
    assert result.exit_code == 2, result.output  # done in part
    out = " ".join(result.output.split())
    assert "5 file(s) not filed" in out and "filed 2 notebook(s)" in out
    report_again = collect_report(course, archive)
    filed = {p.student: rel for rel, p, _ in report_again.filed}
    assert filed == {"henry": "henry_tiny.ipynb", "judy": "judy_tiny.ipynb"}  # of two identical copies, the later
    assert (course.root / "submitted/henry/ex0-tiny/tiny.ipynb").read_bytes() == other
    problems = {}
    for rel, why in report_again.problems:
        problems.setdefault(rel, []).append(why)
    assert "unsafe path" in problems["../../mallory_tiny.ipynb"][0] and "unsafe path" in problems["/abs/oscar_tiny.ipynb"][0]
    assert any("older copy" in why for why in problems["henry_tiny.ipynb"])  # the earlier entry, named
    assert "same time: not filed" in problems["ivy/tiny.ipynb"][0] and "same time" in problems["ivy_tiny.ipynb"][0]
    assert not (course.root / "submitted/ivy").exists()
    assert any("identical copy" in why for _, why in report_again.skipped)

    # a damaged zip: one line, exit 1, nothing in the course changed
    before = _snapshot(course.root)
    broken = tmp_path / "broken.zip"
    data = archive.read_bytes()
    broken.write_bytes(data[: len(data) // 2] + b"\0" * 64 + data[len(data) // 2 + 64:])
    result = runner.invoke(main, ["collect", str(broken), "-C", str(course.root)])
    assert result.exit_code == 1 and "damaged" in result.output and "nothing was filed" in result.output, result.output
    assert "Traceback" not in result.output
    assert _snapshot(course.root) == before


def collect_report(course, given):
    from course.instructor.collect import collect

    return collect(course, given)


def test_unknown_names_and_bad_jobs_are_input_errors(tmp_path):
    from click.testing import CliRunner

    from course.cli import main

    init_course(tmp_path / "course", exercises=TINY)
    course = Course(tmp_path / "course")
    incoming = tmp_path / "in"
    incoming.mkdir()
    for student in ("alice", "bobby"):
        nbformat.write(nbformat.v4.new_notebook(), incoming / f"{student}_tiny.ipynb")
    runner = CliRunner()
    assert runner.invoke(main, ["collect", str(incoming), "-C", str(course.root)]).exit_code == 0
    before = _snapshot(course.root)
    for verb in ("autograde", "feedback"):
        result = runner.invoke(main, [verb, "--student", "bob", "-C", str(course.root)])
        assert result.exit_code == 1, result.output
        assert "unknown student(s): bob (did you mean bobby?); known: alice, bobby" in result.output
    result = runner.invoke(main, ["autograde", "ex0-tinny", "-C", str(course.root)])
    assert result.exit_code == 1 and "did you mean ex0-tiny?" in result.output, result.output
    for jobs in ("0", "-1", "two"):
        result = runner.invoke(main, ["autograde", "--jobs", jobs, "-C", str(course.root)])
        assert result.exit_code == 1 and "--jobs" in result.output, result.output
    assert runner.invoke(main, ["no-such-verb"]).exit_code == 1
    assert _snapshot(course.root) == before


def test_export_says_in_one_line_why_it_cannot_write(tmp_path):
    from click.testing import CliRunner

    from course.cli import main

    init_course(tmp_path / "course", exercises=TINY)
    runner = CliRunner()
    for out, why in ((tmp_path / "nowhere" / "dir" / "grades.csv", "does not exist"),
                     (Path("/proc/grades.csv"), "cannot write /proc/grades.csv")):
        result = runner.invoke(main, ["export", "--out", str(out), "-C", str(tmp_path / "course")])
        assert result.exit_code == 1 and why in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "nowhere").exists()
    folder = runner.invoke(main, ["export", "--out", str(tmp_path), "-C", str(tmp_path / "course")])
    assert folder.exit_code == 1 and "is a directory" in folder.output  # click's own check, a usage error
    result = runner.invoke(main, ["export", "--out", str(tmp_path / "g.csv"), "-C", str(tmp_path / "course")])
    assert result.exit_code == 0, result.output
    assert next(csv.reader(open(tmp_path / "g.csv")))[-1] == "status"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_release_fails_loudly_when_nbgrader_leaves_hidden_tests_in(tmp_path):
    course_dir = tmp_path / "course"
    init_course(course_dir, exercises=TINY)
    clean = cli("release", cwd=course_dir)
    assert "no solutions, no hidden tests" in clean.stdout
    # an instructor's config with other markers: nbgrader no longer sees the notebook's hidden tests
    with open(course_dir / "nbgrader_config.py", "a") as fh:
        fh.write('c.ClearHiddenTests.begin_test_delimeter = "BEGIN SECRET TESTS"\n'
                 'c.ClearHiddenTests.end_test_delimeter = "END SECRET TESTS"\n')
    leaky = cli("release", cwd=course_dir, check=False)
    assert leaky.returncode != 0
    assert "hidden test line left in" in leaky.stderr and "double(-5)" in leaky.stderr, leaky.stderr
    assert not (course_dir / "release" / "ex0-tiny").exists()  # nothing unsafe left to hand out


# -- slow: end to end on the tiny assignment --------------------------------------------------------------


def graded_records(course_dir: Path) -> dict[str, dict]:
    """{"student/assignment": record} for every submission autograde recorded as graded."""
    records = {}
    for path in (course_dir / ".ddp-course" / "autograde").glob("*/*.json"):
        record = json.loads(path.read_text())
        if record["status"] == "graded":
            records[f"{path.stem}/{path.parent.name}"] = record
    return records


def assert_check_says_what_feedback_says(course_dir: Path, students: list[str], assignment: str, notebook: str,
                                         exercises: Path) -> None:
    """``ddp-course check`` on each student's submitted copy gives each test cell the score and message its
    autograded notebook (what the feedback page shows) has, and counts the hidden variants."""
    from course.grading.scoring import score_cell
    from course.student.check import check_notebook, report_lines
    from course.student.workspace import hidden_variants

    hidden = hidden_variants(nbformat.read(exercises / assignment / f"{notebook}.ipynb", as_version=4))
    assert hidden
    for student in students:
        graded = nbformat.read(course_dir / "autograded" / student / assignment / f"{notebook}.ipynb", as_version=4)
        feedback = {}
        for cell in graded.cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade") and not meta.get("solution"):
                result = score_cell(cell, float(meta["points"]), cell.get("execution_count") is not None)
                feedback[result.id] = (result.score, result.message)
        report = check_notebook(course_dir / "submitted" / student / assignment / f"{notebook}.ipynb",
                                exercises=exercises)
        assert {t.id: (t.score, t.message) for t in report.tests} == feedback, student
        assert {t.id: t.hidden for t in report.tests if t.hidden} == hidden
        lines = "\n".join(report_lines(report))
        assert "1 hidden variant is graded too" in lines and "BEGIN HIDDEN" not in lines


def autograded_mtimes(course_dir: Path) -> dict[str, float]:
    return {str(p.relative_to(course_dir)): p.stat().st_mtime for p in (course_dir / "autograded").glob("*/*/*.ipynb")}


def _as_from_a_terminal() -> None:
    """In the child before exec: Ctrl-C and SIGTERM delivered and handled by default, as in a terminal, whatever
    this test process inherited (an ignored SIGINT is inherited through exec, and Python then keeps ignoring it)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def interrupt_after_first(course_dir: Path, args: list[str], sig: int, deadline: float = 400, env: dict | None = None):
    """Start ``ddp-course autograde ARGS`` (``env`` added to its environment), send ``sig`` once a first submission
    is graded; (rc, output, descendants)."""
    log = course_dir.parent / f"autograde-{sig}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["ddp-course", "autograde", *args], cwd=course_dir, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_as_from_a_terminal, env={**os.environ, **(env or {})})
        try:
            end = time.monotonic() + deadline
            while not graded_records(course_dir):
                assert proc.poll() is None, f"autograde ended before grading anything:\n{log.read_text()}"
                assert time.monotonic() < end, f"nothing graded within {deadline} s:\n{log.read_text()}"
                time.sleep(0.2)
            descendants = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(sig)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    return rc, log.read_text(), descendants


def assert_all_gone(procs: list[psutil.Process], within: float = 20.0) -> None:
    """Every process in ``procs`` (workers, kernels, ranks) has exited."""
    _, alive = psutil.wait_procs(procs, timeout=within)
    assert not alive, f"still running after the run was stopped: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_course_end_to_end(tmp_path):
    course_dir = tmp_path / "course"
    cli("init", str(course_dir), "--exercises", str(TINY), cwd=tmp_path)
    cli("release", cwd=course_dir)
    incoming = tmp_path / "incoming"
    # an untouched copy (0) and a partial one are graded, exported and `check`ed against their feedback on a real
    # exercise in test_course_exercises_end_to_end (cy, bob): here the reference and two wrong answers
    write_samples(course_dir, {"alice": "reference"}, "ex0-tiny", "tiny", incoming)
    # passes the visible tests, fails the hidden one: its traceback quotes the hidden line
    edited(incoming / "alice_tiny.ipynb", incoming / "frank" / "tiny.ipynb", "return 2 * x", "return 2 * abs(x)")
    # fails visible tests: `ddp-course check` must say what its feedback says
    edited(incoming / "alice_tiny.ipynb", incoming / "gil" / "tiny.ipynb", "return 2 * x", "return x + 1")
    collected = cli("collect", str(incoming), cwd=course_dir)
    assert collected.stdout.count(" new ") == 3

    # Ctrl-C once the first submission is graded: it stays graded, the rest is left for the rerun
    rc, output, descendants = interrupt_after_first(course_dir, ["--jobs", "1"], signal.SIGINT)
    assert rc == 130, output
    assert "interrupted" in output
    assert_all_gone(descendants)
    first = graded_records(course_dir)
    before = autograded_mtimes(course_dir)
    assert 1 <= len(first) < 3 and len(before) == len(first)

    rerun = cli("autograde", "--jobs", "2", cwd=course_dir)
    assert rerun.stdout.count("already graded") == len(first), rerun.stdout
    after = autograded_mtimes(course_dir)
    assert {k: after[k] for k in before} == before  # not graded again
    assert len(after) == 3
    assert_check_says_what_feedback_says(course_dir, ["alice", "gil"], "ex0-tiny", "tiny", TINY)

    # a submission that ignores interrupts and never ends is stopped at --timeout, with its whole process tree
    hang = tmp_path / "hang"
    edited(incoming / "alice_tiny.ipynb", hang / "henry_tiny.ipynb", "return 2 * x",
           "import signal, time\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(10000)")
    cli("collect", str(hang), cwd=course_dir)
    started = time.monotonic()
    # 25 s: henry's kernel is in the endless cell within a tiny notebook's grading time (9-18 s on a loaded machine)
    stuck = cli("autograde", "--timeout", "25", cwd=course_dir, check=False)
    assert time.monotonic() - started < 150
    assert stuck.returncode == 2 and "1 of 4 submission(s) could not be graded" in stuck.stderr, stuck  # done in part
    assert re.search(r"henry.*timeout", stuck.stdout), stuck.stdout
    leftovers = [p for p in psutil.process_iter(["cwd"]) if str(course_dir) in (p.info["cwd"] or "")]
    assert_all_gone(leftovers, within=10)
    status = cli("status", cwd=course_dir).stdout
    assert re.search(r"henry\s+│\s+timeout", status), status

    cli("feedback", cwd=course_dir)
    secret = 'assert double(-5) == -10, "secret: double(-5) should be -10"'
    assert hidden_lines(TINY / "ex0-tiny" / "tiny.ipynb") == {secret}
    pages = sorted((course_dir / "feedback").glob("*/ex0-tiny/tiny.html"))
    assert [p.parent.parent.name for p in pages] == ["alice", "frank", "gil"]
    for page in pages:
        text = plain_text(page.read_text())
        assert "double(-5) == -10" not in text and "HIDDEN TESTS" not in text, page
        assert "Score: " in text
        html = page.read_text()  # long message lines wrap (once), before the page's own styles end
        assert html.count('id="ddp-course-wrap"') == 1 and html.index("ddp-course-wrap") < html.index("</head>")
    frank = plain_text(pages[-2].read_text())
    assert "secret: double(-5) should be -10" in frank  # the failure message is shown, its source is not
    assert re.search(r"test_double_hidden\s+Score: 0\.0 / 1\.0", frank)

    cli("export", "--out", str(tmp_path / "grades.csv"), cwd=course_dir)
    grades = read_csv(tmp_path / "grades.csv")
    scores = {student: float(grades[(student, "ex0-tiny")]["score"]) for student, _ in grades}
    assert scores == {"alice": 4.0, "frank": 3.0, "gil": 1.0, "henry": 0.0}
    assert grades[("henry", "ex0-tiny")]["timestamp"] == ""  # never graded


# -- slow: a run stopped while it grades ------------------------------------------------------------------

#: seconds sam's submission sleeps when its answer cell runs: longer than it takes to see that it runs and stop the run
SAM_SLEEPS = 15


def course_with_a_slow_submission(tmp_path: Path, db_url: str | None = None) -> Path:
    """The tiny course with two submissions: alice's reference, and sam's, the reference that sleeps
    :data:`SAM_SLEEPS` s in its first answer cell (once: its checks then pass); its gradebook at ``db_url`` (else
    the default SQLite file)."""
    course_dir = tmp_path / "course"
    cli("init", str(course_dir), "--exercises", str(TINY), *(["--db", db_url] if db_url else []), cwd=tmp_path)
    cli("release", cwd=course_dir)
    incoming = tmp_path / "incoming"
    write_samples(course_dir, {"alice": "reference"}, "ex0-tiny", "tiny", incoming)
    edited(incoming / "alice_tiny.ipynb", incoming / "sam" / "tiny.ipynb", "def double(x):",
           f"import time\ntime.sleep({SAM_SLEEPS})\n\ndef double(x):")
    cli("collect", str(incoming), cwd=course_dir)
    return course_dir


@pytest.fixture(scope="module")
def slow_course(tmp_path_factory) -> Path:
    """:func:`course_with_a_slow_submission`, made once per module (per xdist worker): nothing in it names its
    folder, so each stopped-run test grades a copy of it (init, release and collect are not what they test)."""
    return course_with_a_slow_submission(tmp_path_factory.mktemp("slow-course"))


def grading_runs(run: psutil.Process, course_dir: Path, student: str) -> bool:
    """Whether ``student``'s notebook is being executed: a process of the run works in its scratch course's
    autograded/ folder (the sandboxed kernel's, not the worker's)."""
    folder = str(course_dir / ".ddp-course" / "scratch" / f"ex0-tiny--{student}" / "autograded")
    for child in run.children(recursive=True):
        try:
            if child.cwd().startswith(folder):
                return True
        except psutil.Error:
            pass
    return False


def stop_while_grading(course_dir: Path, args: list[str], how: str, deadline: float = 240):
    """Start ``ddp-course autograde ARGS`` in a process group of its own, as a shell starts it in a terminal, and
    stop it while sam's notebook runs: ``how`` is "ctrl-c" (SIGINT to the process group, as the terminal sends it),
    "sigterm" (SIGTERM to the main process) or "workers" (SIGINT to the workers alone: ``pkill -INT -f 'ddp-course
    autograde'``, a service manager or ``scancel`` signal every process of the run, and a worker dies of it before
    its parent handles its own, if it gets one). Returns (exit status, output, descendants)."""
    log = course_dir.parent / f"autograde-{how.replace(' ', '-')}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["ddp-course", "autograde", *args], cwd=course_dir, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_as_from_a_terminal, process_group=0, env={**os.environ, "COLUMNS": "200"})
        try:
            run, end = psutil.Process(proc.pid), time.monotonic() + deadline
            while not grading_runs(run, course_dir, "sam"):
                assert proc.poll() is None, f"autograde ended before it graded sam:\n{log.read_text()}"
                assert time.monotonic() < end, f"sam's notebook not running within {deadline} s:\n{log.read_text()}"
                time.sleep(0.2)
            descendants = run.children(recursive=True)
            if how == "ctrl-c":
                os.killpg(proc.pid, signal.SIGINT)
            elif how == "sigterm":
                proc.send_signal(signal.SIGTERM)
            else:
                workers = [p for p in run.children() if p.cmdline() == run.cmdline()]  # forked: the same command
                assert workers, [p.pid for p in run.children()]
                for worker in workers:
                    worker.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return rc, log.read_text(), descendants


def sam_row(text: str) -> str:
    """The last line that names sam (in a table: sam's row)."""
    return ([line for line in text.splitlines() if re.search(r"\bsam\b", line)] or [f"no line of sam's in:\n{text}"])[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how, jobs", [("ctrl-c", "1"), ("sigterm", "2"), ("workers", "2")])
def test_a_stopped_run_leaves_the_submission_it_was_grading_not_graded_and_not_failed(tmp_path, slow_course, how,
                                                                                     jobs):
    """Whether Ctrl-C, SIGTERM or a SIGINT to its worker stopped the grading, sam's submission was not graded:
    its record, status, status --student, report and export say so (interrupted), none calls it failed or a score,
    and the next run grades it."""
    course_dir = tmp_path / "course"
    shutil.copytree(slow_course, course_dir, symlinks=True)  # copy2: the submissions' times are kept
    rc, output, descendants = stop_while_grading(course_dir, ["--jobs", jobs], how)
    assert_all_gone(descendants)
    assert rc == (2 if how == "workers" else 130), output  # workers: the run went on, and ended with those not graded
    assert "interrupted" in sam_row(output) and "failed" not in output, output
    record = json.loads((course_dir / ".ddp-course" / "autograde" / "ex0-tiny" / "sam.json").read_text())
    assert record["status"] == "interrupted", record

    wide = {"COLUMNS": "250"}
    status = cli("status", cwd=course_dir, env=wide).stdout
    assert "not graded (interrupted)" in sam_row(status) and "failed" not in status, status
    assert "not graded (interrupted)" in cli("status", "--student", "sam", cwd=course_dir, env=wide).stdout
    report = cli("report", "--html", str(tmp_path / "report.html"), cwd=course_dir, env=wide).stdout
    assert "interrupted" in sam_row(report.split("students")[-1]) and "failed" not in report, report
    assert "not graded (interrupted)" in (tmp_path / "report.html").read_text()
    cli("export", "--out", str(tmp_path / "grades.csv"), cwd=course_dir)
    grades = read_csv(tmp_path / "grades.csv")
    assert grades[("sam", "ex0-tiny")]["status"] == "not graded (interrupted)"
    assert grades[("sam", "ex0-tiny")]["late"] == ""  # nothing graded: no score of sam's was earned
    if how != "ctrl-c":
        return

    assert graded_records(course_dir).keys() == {"alice/ex0-tiny"}  # graded before the Ctrl-C: kept
    rerun = cli("autograde", "--jobs", "1", cwd=course_dir, env=wide).stdout
    assert re.search(r"graded\s+sam · ex0-tiny 4/4", rerun) and re.search(r"alice.*already graded", rerun), rerun
    assert graded_records(course_dir).keys() == {"alice/ex0-tiny", "sam/ex0-tiny"}
    assert "interrupted" not in cli("status", cwd=course_dir, env=wide).stdout
    cli("export", "--out", str(tmp_path / "grades.csv"), cwd=course_dir)
    assert read_csv(tmp_path / "grades.csv")[("sam", "ex0-tiny")]["status"] == "graded"


# -- slow: end to end on the course's four exercises ------------------------------------------------------

#: who hands in what (CLASS): every kind at least once, exercise 4 (torchrun jobs) once, and a
#: deadlock where it costs least (ex1: one check waits for its deadline, :data:`CHECK_TIMEOUT`). The reference
#: student hands in every notebook of :data:`WHOLE`, the others its main one (REAL) only. Bob's partial ex1 and ex2
#: give scores between 0 and full marks to export, feedback, `check` and plain nbgrader's regrade; exercise 3's
#: wrong answers are graded in tests/test_graders_ex3.py::test_wrong_submissions_lose_exactly_their_tests
#:
#: the assignment of several notebooks ada hands in whole: exercise 1's three are the quickest to grade (exercise 3's
#: five are each graded on their own in tests/test_graders_ex3*.py and by the demo)
WHOLE = "ex1-parallelism"
#: exercise 4's notebook ada hands in: its four hanging scripts run under torchrun like the others, in half the
#: time of torchrun.ipynb's three launches (tests/test_docker.py and test_graders_ex4.py grade that one)
EX4_HANDED_IN = "find_the_hang"
CLASS = {
    "ada": {a: "reference" for a in REAL},
    "bob": {"ex1-parallelism": "partial", "ex2-ddp-basics": "partial"},
    "cy": {"ex1-parallelism": "untouched", "ex2-ddp-basics": "untouched", "ex3-syncbn-sharding": "untouched"},
    "dee": {"ex1-parallelism": "hang"},
}


#: each check's job deadline in this test's autograde runs (DDP_COURSE_CHECK_TIMEOUT; the default is 60 s): dee's
#: deadlock waits for it. The checks with a shorter limit of their own keep it (ex4's hang drill: 20 s; ex2's
#: checkpoint hold: 4 s); every reference job of the four exercises ends well within it
CHECK_TIMEOUT = {"DDP_COURSE_CHECK_TIMEOUT": "30"}


class Phases:
    """Wall time of each phase of a long test, printed at the end (``pytest -s`` shows it)."""

    def __init__(self):
        self.marks = [("start", time.monotonic())]

    def __call__(self, name: str) -> None:
        self.marks.append((name, time.monotonic()))

    def report(self) -> str:
        steps = [f"{name} {t - prev:.0f}s" for (_, prev), (name, t) in zip(self.marks, self.marks[1:])]
        return ", ".join(steps) + f"; total {self.marks[-1][1] - self.marks[0][1]:.0f}s"


def max_points(source: Path) -> float:
    return sum(float(c.metadata["nbgrader"].get("points", 0)) for c in nbformat.read(source, as_version=4).cells
               if c.metadata.get("nbgrader", {}).get("grade"))


def autograded_scores(course_dir: Path) -> dict[tuple[str, str], float]:
    """Each autograded submission's score as nbgrader's own rule reads it off the executed notebook."""
    from nbgrader.utils import determine_grade

    scores = {}
    for path in (course_dir / "autograded").glob("*/*/*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
        key = (path.parent.parent.name, path.parent.name)  # an assignment's notebooks add up
        scores[key] = scores.get(key, 0) + sum(determine_grade(c)[0] or 0 for c in cells)
    return scores


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not all((EXERCISES / a / f"{n}.ipynb").is_file() for a, n in REAL.items()),
                    reason="the four exercises are not in exercises/ yet")
def test_course_exercises_end_to_end(tmp_path):
    phase = Phases()
    course_dir = tmp_path / "course"
    cli("init", str(course_dir), cwd=tmp_path)
    released = cli("release", cwd=course_dir).stdout
    assert released.count("no solutions, no hidden tests") == 4
    phase("init+release")

    incoming = tmp_path / "incoming"
    notebooks = {a: sorted(p.stem for p in (EXERCISES / a).glob("*.ipynb")) for a in REAL}
    # ada hands in every notebook of WHOLE (export adds them up) and the main one of the
    # others: every reference notebook is graded in a sandbox elsewhere (tests/test_docker.py), and grade and
    # autograde agree cell by cell (tests/test_pipeline.py)
    handed_in = {a: notebooks[a] if a == WHOLE else [EX4_HANDED_IN if a == "ex4-torchrun" else REAL[a]] for a in REAL}
    for student, work in CLASS.items():
        for assignment, kind in work.items():
            for notebook in handed_in[assignment] if kind == "reference" else [REAL[assignment]]:
                write_samples(course_dir, {student: kind}, assignment, notebook, incoming)
    cli("collect", str(incoming), cwd=course_dir)
    jobs = sum(len(w) for w in CLASS.values())
    files = len(list(incoming.glob("*.ipynb")))
    phase("samples+collect")

    # killed (SIGKILL, no cleanup of its own) once the first submission is graded
    rc, output, descendants = interrupt_after_first(course_dir, ["--jobs", "2"], signal.SIGKILL, deadline=600,
                                                    env=CHECK_TIMEOUT)
    assert rc == -signal.SIGKILL
    assert_all_gone(descendants)
    first = graded_records(course_dir)
    before = autograded_mtimes(course_dir)
    assert 1 <= len(first) < jobs
    phase("killed autograde")

    rerun = cli("autograde", "--jobs", "2", cwd=course_dir, timeout=900, env=CHECK_TIMEOUT)
    phase("autograde rerun")
    assert rerun.stdout.count("already graded") == len(first), rerun.stdout
    after = autograded_mtimes(course_dir)
    assert {k: after[k] for k in before} == before  # not graded again
    records = graded_records(course_dir)
    assert len(records) == jobs and len(after) == files, rerun.stdout
    # a partial and an untouched copy: test cells that pass and fail, each kind of message (the reference's check
    # is the tiny course's alice; grade and autograde agree cell by cell on ex1's reference: tests/test_pipeline.py)
    assert_check_says_what_feedback_says(course_dir, ["bob", "cy"], "ex1-parallelism", "parallelism", EXERCISES)
    phase("check ex1")

    # two workers really graded at the same time
    spans = sorted((time.mktime(time.strptime(r["finished"][:19], "%Y-%m-%dT%H:%M:%S")) - r["elapsed"],
                    time.mktime(time.strptime(r["finished"][:19], "%Y-%m-%dT%H:%M:%S"))) for r in records.values())
    assert any(b_start < a_end - 2 for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans

    cli("export", "--out", str(tmp_path / "grades.csv"), cwd=course_dir)
    grades = read_csv(tmp_path / "grades.csv")
    assert len(grades) == len(CLASS) * len(REAL)  # every student and assignment, submitted or not
    score = {key: float(row["score"]) for key, row in grades.items()}
    top = {a: sum(max_points(EXERCISES / a / f"{n}.ipynb") for n in notebooks[a]) for a in REAL}
    for assignment in REAL:
        handed = sum(max_points(EXERCISES / assignment / f"{n}.ipynb") for n in handed_in[assignment])
        assert score[("ada", assignment)] == handed > 0, assignment
        assert float(grades[("ada", assignment)]["max_score"]) == top[assignment]  # every notebook's points
    assert len(handed_in[WHOLE]) > 1 and score[("ada", WHOLE)] == top[WHOLE]
    for assignment in CLASS["bob"]:
        assert 0 < score[("bob", assignment)] < top[assignment], assignment
        assert score[("cy", assignment)] == 0, assignment
    assert score[("dee", "ex1-parallelism")] < top["ex1-parallelism"]
    for assignment in ("ex2-ddp-basics", "ex3-syncbn-sharding", "ex4-torchrun"):
        assert grades[("dee", assignment)]["timestamp"] == "" and score[("dee", assignment)] == 0
        assert grades[("dee", assignment)]["status"] == "not submitted"
    assert {grades[("cy", a)]["status"] for a in CLASS["cy"]} == {"graded"}  # a graded 0 is not "not submitted"
    # the gradebook holds what the autograded notebooks show
    assert autograded_scores(course_dir) == {k: float(grades[k]["raw_score"]) for k in autograded_scores(course_dir)}

    phase("export")
    cli("feedback", cwd=course_dir)
    phase("feedback")
    pages = sorted((course_dir / "feedback").glob("*/*/*.html"))
    assert len(pages) == files
    redacted = 0
    for page in pages:
        text = plain_text(page.read_text())
        secrets = hidden_lines(EXERCISES / page.parent.name / f"{page.stem}.ipynb")
        assert not [s for s in secrets if s in text], page
        redacted += bool(secrets)  # (a notebook whose every test is visible has nothing to hide)
        assert "Score: " in text
    assert redacted >= len(pages) // 2, (redacted, len(pages))  # most pages had hidden tests to take out
    bob = plain_text((course_dir / "feedback/bob/ex1-parallelism/parallelism.html").read_text())
    assert "FAILED" in bob or "Error" in bob  # the failing check says why
    raw = (course_dir / "feedback/bob/ex1-parallelism/parallelism.html").read_text()
    assert ">Test cell<" not in raw  # every contents link names its check (the instructions may say "test cell")
    assert "ex1_test_shards: Every row of the global batch is on exactly one rank" in bob
    assert "ddp-course-wrap" in (course_dir / "feedback/bob/ex1-parallelism/parallelism.html").read_text()

    status = cli("status", cwd=course_dir).stdout
    assert "not graded" in status and not re.search(r"│\s*(failed|timeout)\s*│", status), status

    # plain nbgrader in the same folder: sees everything as graded, and regrading agrees with ddp-course
    phase("status")
    skipped = nbgrader("autograde", "ex1-parallelism", cwd=course_dir)
    assert "Skipping existing assignment" in skipped.stdout + skipped.stderr
    assert autograded_mtimes(course_dir) == after
    nbgrader("autograde", "ex2-ddp-basics", "--force", "--student", "bob", cwd=course_dir)  # a partial score
    nbgrader("export", "--to", str(tmp_path / "plain.csv"), cwd=course_dir)
    phase("plain nbgrader")
    print(f"\nphases: {phase.report()}")
    plain = read_csv(tmp_path / "plain.csv")
    columns = ("raw_score", "score", "max_score")
    assert {k: [r[c] for c in columns] for k, r in plain.items()} == {k: [r[c] for c in columns] for k, r in grades.items()}
