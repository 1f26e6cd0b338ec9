"""``ddp-course grade``: restoring a student's copy, scoring by nbgrader's rules, the CLI.

The CLI runs as a subprocess with a real kernel (once per exercise and session,
shared by the tests below); everything else grades in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
import submissions
from nbformat.v4 import new_code_cell, new_output

from course.grading.notebook import NotebookError, Timeouts
from course.grading.restore import find_source, graded_cells, restore
from course.grading.scoring import score_cell

EXERCISES = ["ex1-parallelism", "ex2-ddp-basics"]
#: seconds an answer cell may run (--timeout) in the tests whose answer cell never ends: an endless loop spins that
#: long (CPU); answer cells only define functions, and the course's own cells get the test cells' limit
ANSWER_TIMEOUT = 5


def cli(*args, timeout=600):
    """Run ``ddp-course`` in a subprocess; return (returncode, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "course.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


@pytest.fixture(scope="session")
def graded_sources():
    """``ddp-course grade --json`` on every source notebook, run once (in parallel) per session."""
    with ThreadPoolExecutor(len(EXERCISES)) as pool:
        runs = dict(zip(EXERCISES, pool.map(lambda a: cli("grade", "--json", submissions.source_path(a)), EXERCISES)))
    for assignment, (_, _, _, seconds) in runs.items():
        print(f"ddp-course grade {assignment} (source, fresh kernel): {seconds:.1f} s")
    return runs


@pytest.fixture(scope="session")
def released(tmp_path_factory):
    """{assignment: the student copy nbgrader's generate_assignment makes}, made once per session."""
    # one course folder per assignment, so the nbgrader runs (and their gradebooks) can go in parallel
    with ThreadPoolExecutor(len(EXERCISES)) as pool:
        paths = pool.map(lambda a: submissions.release(a, tmp_path_factory.mktemp(f"course-{a}")), EXERCISES)
        return dict(zip(EXERCISES, paths))


# --- the CLI on the source notebooks ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("assignment", EXERCISES)
def test_source_notebook_scores_full_marks_through_the_cli(graded_sources, assignment):
    code, stdout, stderr, _ = graded_sources[assignment]
    assert code == 0, stderr
    report = json.loads(stdout)  # the whole of stdout is one JSON object
    assert set(report) == {"notebook", "score", "max_score", "tests", "notes", "ran_on", "hints"} and not report["hints"]
    # every job the checks started ran as the check API's policy says: on gloo with the GPUs hidden (a cell whose
    # check reuses another cell's job, checks.memo, starts none and is not listed)
    assert report["ran_on"] and set(report["ran_on"]) <= {t["id"] for t in report["tests"]}, report["ran_on"]
    assert all(set(ran) == {"gloo, GPUs hidden"} for ran in report["ran_on"].values()), report["ran_on"]
    # how the notebook was isolated, and no disagreement between the notebook and the verifier
    assert len(report["notes"]) == 1 and report["notes"][0].startswith("sandbox: "), report["notes"]
    assert report["notebook"].endswith(submissions.source_path(assignment).name)
    expected = submissions.full_marks(assignment)
    assert [t["id"] for t in report["tests"]] == list(expected)
    for t in report["tests"]:
        assert set(t) == {"id", "score", "max_score", "message"}
        assert (t["score"], t["max_score"], t["message"]) == (expected[t["id"]], expected[t["id"]], ""), t
    assert report["score"] == report["max_score"] == sum(expected.values())


@pytest.mark.timeout(300)
def test_cli_rejects_missing_unreadable_and_unknown_notebooks_in_one_line(tmp_path):
    unreadable = tmp_path / "ex1-parallelism" / "parallelism.ipynb"
    unreadable.parent.mkdir()
    unreadable.write_text("{ not json")
    unknown = tmp_path / "homework.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[new_code_cell("1 + 1")]), str(unknown))
    cases = {tmp_path / "nope.ipynb": "no such notebook", unreadable: "not a readable notebook",
             unknown: "not a copy of any exercise"}
    with ThreadPoolExecutor(len(cases)) as pool:  # three interpreters start at once: saves CI time
        runs = dict(zip(cases, pool.map(lambda p: cli("grade", "--json", p, timeout=240), cases)))
    for path, (code, stdout, stderr, _) in runs.items():
        assert code != 0 and stdout == "", (path, stdout, stderr)
        assert len(stderr.strip().splitlines()) == 1 and cases[path] in stderr and "Traceback" not in stderr, stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_interrupts_a_cell_past_its_timeout_and_grades_the_rest(tmp_path):
    """A cell that never ends is interrupted at --timeout; the kernel goes on with the next cells."""
    nb = submissions.load("ex1-parallelism")
    nb = submissions.replace_answer(nb, "ex1_shard_batch", submissions.answer(nb, "ex1_shard_batch")
                                    + "\n\nwhile True:  # never ends\n    pass\n")
    path = submissions.write(nb, tmp_path, "ex1-parallelism")
    # the loop spins until --timeout, which only answer cells get: the first cell's cold `import torch` gets the test
    # cells' limit (test_the_courses_own_code_cells_get_the_test_cells_limit), so a short one is safe
    code, stdout, stderr, seconds = cli("grade", "--json", "--timeout", ANSWER_TIMEOUT, path)
    assert code == 0, stderr
    # the function was defined before the loop, so every check still passes
    report = json.loads(stdout)
    assert submissions.scores(report) == submissions.full_marks("ex1-parallelism"), submissions.messages(report)
    assert seconds < ANSWER_TIMEOUT + 120, f"grading took {seconds:.0f} s"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zygote", ["1", "0"])
def test_cli_forks_its_kernel_from_one_zygote_unless_zygotes_are_off(tmp_path, zygote):
    """`ddp-course grade` starts one zygote (torch and the check API imported once) and forks its kernel and
    verifier from it, as an autograde worker does: the kernel's process is named by the zygote that ran it in place.
    It was not, once: what grading sets in the environment (PYTHONWARNINGS, TORCH_CPP_LOG_LEVEL) was set after the
    zygote started, so every process differed from it in what imports read and was exec'd, the zygote's imports
    paid on top. With DDP_COURSE_ZYGOTE=0 both are exec'd: a fresh Python."""
    exercises = Path(__file__).parent / "files" / "verify"
    nb = nbformat.read(str(exercises / "ex0-verify" / "parallelism.ipynb"), as_version=4)
    nb.cells.append(new_code_cell("print('kernel process:', open('/proc/self/comm').read().strip())"))
    path = tmp_path / "ex0-verify" / "parallelism.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, str(path))
    graded = tmp_path / "graded.ipynb"
    env = {**os.environ, "DDP_COURSE_ZYGOTE": zygote}
    proc = subprocess.run([sys.executable, "-m", "course.cli", "grade", "--json", "--exercises", str(exercises),
                           "-o", str(graded), str(path)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sum(t["score"] for t in json.loads(proc.stdout)["tests"]) == 3, proc.stdout  # the reference, graded
    out = "".join(o.get("text", "") for o in nbformat.read(str(graded), as_version=4).cells[-1].get("outputs", []))
    name = re.search(r"kernel process: (\S+)", out)
    assert name, out
    if zygote == "1":
        assert name.group(1) == "ipykernel_launc", out  # the module the zygote ran in place (15 characters kept)
    else:
        assert name.group(1).startswith("python"), out


def test_cli_says_why_a_kernel_died_before_it_started(tmp_path):
    """A kernel that cannot start (a broken Python environment) is reported in one line with its error."""
    broken = tmp_path / "broken-site"
    broken.mkdir()
    (broken / "ipykernel_launcher.py").write_text("raise ImportError('broken on purpose')\n")
    path = submissions.write(submissions.load("ex1-parallelism"), tmp_path / "work", "ex1-parallelism")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(broken), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "course.cli", "grade", str(path)], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"Error: {path}: grading did not run (RuntimeError: the sandboxed kernel died before it started: "
        "ImportError: broken on purpose)"], proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_scores_cells_after_a_dead_kernel_zero(tmp_path):
    """The kernel dies in an answer cell: the tests after it never ran, so they score 0, not full marks."""
    nb = submissions.load("ex1-parallelism")
    nb = submissions.replace_answer(nb, "ex1_average_gradients", submissions.answer(nb, "ex1_average_gradients")
                                    + "\n\nimport os\nos._exit(1)\n")
    code, stdout, stderr, _ = cli("grade", "--json", submissions.write(nb, tmp_path, "ex1-parallelism"))
    assert code == 0, stderr
    report = json.loads(stdout)
    assert submissions.scores(report) == submissions.losing("ex1-parallelism", "ex1_test_average_gradients",
                                                           "ex1_test_two_stage", "ex1_test_tensor_parallel",
                                                           "ex1_test_tensor_parallel_collectives")
    index = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells].index("ex1_average_gradients")
    assert submissions.messages(report)["ex1_test_two_stage"].startswith(
        f"not run: the kernel died while running cell {index} (ex1_average_gradients)")


# --- the released copy ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("assignment", EXERCISES)
def test_release_has_no_solutions_and_no_hidden_tests(released, assignment):
    student = nbformat.read(str(released[assignment]), as_version=4)
    text = "\n".join(c.source for c in student.cells if c.cell_type == "code")  # the instructions may quote code
    source = submissions.load(assignment)
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in released[assignment].read_text()
    for cell in source.cells:
        if "### BEGIN" not in cell.source:
            continue
        inside = False
        for line in cell.source.splitlines():
            if "### BEGIN" in line:
                inside = True
            elif "### END" in line:
                inside = False
            elif inside and line.strip() and not line.strip().startswith("#"):
                assert line.strip() not in text, f"the release leaks {line.strip()!r}"
    ids = [c.metadata["nbgrader"]["grade_id"] for c in student.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert ids == list(submissions.full_marks(assignment))  # every test cell is there, hidden ones emptied
    # a student's workspace (ddp-course lab) gets this very copy, made without a gradebook
    from course.student.workspace import release_notebook

    workspace_copy = release_notebook(source, assignment, released[assignment].stem)
    assert json.loads(nbformat.writes(workspace_copy)) == json.loads(released[assignment].read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("assignment", EXERCISES)
def test_untouched_release_scores_zero_with_clean_messages(released, assignment):
    report = submissions.grade(released[assignment])
    assert report.max_score == sum(submissions.full_marks(assignment).values())
    assert report.score == 0
    for t in report.tests:  # hidden tests were restored and ran: they fail for the same clean reason
        assert t.score == 0
        assert "is not written yet" in t.message, t
        assert "Traceback" not in t.message and "graders/" not in t.message, t


# --- restoring locked cells -----------------------------------------------------------------


def _ids(nb):
    return [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]


def test_restore_brings_back_edited_deleted_and_hidden_test_cells():
    source = submissions.load("ex2-ddp-basics")
    student = submissions.load("ex2-ddp-basics")
    tests = [c for c in student.cells if c.metadata["nbgrader"].get("grade")]
    tests[0].source = "pass  # the student replaced the test"
    tests[0].metadata["nbgrader"]["points"] = 100
    student.cells.remove(tests[1])  # ... deleted one
    student.cells.append(nbformat.from_dict(nbformat.v4.new_code_cell("x = 1")))  # ... added their own
    restored = restore(student, source)
    by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in restored.cells}
    for cell in source.cells:
        if cell.metadata["nbgrader"].get("locked"):
            assert by_id[cell.metadata["nbgrader"]["grade_id"]].source == cell.source
            assert by_id[cell.metadata["nbgrader"]["grade_id"]].metadata["nbgrader"] == cell.metadata["nbgrader"]
    assert _ids(restored)[:-1] == _ids(source)  # deleted cell back in its place
    assert restored.cells[-1].source == "x = 1"  # the student's own cell kept


def test_restore_keeps_answers_counts_duplicates_once_and_stubs_missing_answers():
    source = submissions.load("ex1-parallelism")
    student = submissions.replace_answer(source, "ex1_average_gradients", "def average_gradients(m, w):\n    pass")
    test = next(c for c in student.cells if c.metadata["nbgrader"].get("grade_id") == "ex1_test_two_stage")
    student.cells.append(nbformat.from_dict(dict(test, id="copy")))  # a duplicated test cell
    student.cells = [c for c in student.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "ex1_shard_batch"]
    restored = restore(student, source)
    ids = _ids(restored)
    assert ids.count("ex1_test_two_stage") == 1 and ids[-1] is None  # the copy lost its grade_id
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in restored.cells if c.metadata.get("nbgrader")}
    assert answers["ex1_average_gradients"] == "def average_gradients(m, w):\n    pass"
    assert "raise NotImplementedError()" in answers["ex1_shard_batch"] and "divmod" not in answers["ex1_shard_batch"]
    assert ids.index("ex1_shard_batch") == _ids(source).index("ex1_shard_batch")
    assert [g.grade_id for g in graded_cells(source)] == list(submissions.full_marks("ex1-parallelism"))


def test_restore_drops_unknown_grade_ids():
    source = submissions.load("ex1-parallelism")
    student = submissions.load("ex1-parallelism")
    student.cells[1].metadata["nbgrader"]["grade_id"] = "made_up"
    restored = restore(student, source)
    assert "made_up" not in _ids(restored)
    assert "ex1_imports" in _ids(restored)  # put back from the source


def test_find_source_matches_by_folder_name_then_by_grade_ids(tmp_path):
    exercises = submissions.EXERCISES
    copy = submissions.write(submissions.load("ex2-ddp-basics"), tmp_path / "submitted" / "alice", "ex2-ddp-basics")
    assert find_source(copy, exercises) == submissions.source_path("ex2-ddp-basics")
    renamed = tmp_path / "ddp_basics-Copy1.ipynb"
    renamed.write_text(copy.read_text())
    assert find_source(renamed, exercises) == submissions.source_path("ex2-ddp-basics")
    stranger = tmp_path / "other.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), str(stranger))
    with pytest.raises(NotebookError, match="not a copy of any exercise"):
        find_source(stranger, exercises)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tampered_tests_cannot_raise_the_score(tmp_path):
    """A wrong answer whose test cells the student emptied, re-pointed and duplicated still loses those points."""
    nb = submissions.patch_answer(submissions.load("ex1-parallelism"), "ex1_average_gradients",
                                  "p.grad /= rows", "pass")
    for cell in nb.cells:
        if cell.metadata["nbgrader"].get("grade"):
            cell.source = "1.0  # full marks, please"
            cell.metadata["nbgrader"]["points"] = 50
    report = submissions.grade(submissions.write(nb, tmp_path, "ex1-parallelism"))
    assert submissions.scores(report) == submissions.losing("ex1-parallelism", "ex1_test_average_gradients")
    assert report.max_score == sum(submissions.full_marks("ex1-parallelism").values())


# --- scoring by nbgrader's rules ---------------------------------------------------------------


def _test_cell(*outputs, points=3):
    cell = new_code_cell("graders.exN.check_x(f)", metadata={"nbgrader": {
        "grade": True, "solution": False, "locked": True, "points": points, "grade_id": "t", "schema_version": 3}})
    cell.outputs = list(outputs)
    return cell


def test_scoring_follows_nbgrader_rules_with_a_reason_for_every_lost_point():
    ok = new_output("stream", name="stdout", text="passed check_x\n")
    assert vars(score_cell(_test_cell(ok), 3, True)) == {"id": "t", "score": 3.0, "max_score": 3, "message": ""}
    failed = new_output("error", ename="CheckFailed", evalue="FAILED check_x [rank 1]: bad", traceback=[])
    assert score_cell(_test_cell(ok, failed), 3, True).message == "FAILED check_x [rank 1]: bad"
    other = new_output("error", ename="NameError", evalue="name 'f' is not defined", traceback=[])
    assert (score_cell(_test_cell(other), 3, True).score, score_cell(_test_cell(other), 3, True).message) == \
        (0, "NameError: name 'f' is not defined")
    warning = new_output("stream", name="stderr", text="UserWarning: careful\n")
    result = score_cell(_test_cell(ok, warning), 3, True)
    assert (result.score, result.message) == (0, "wrote to stderr: UserWarning: careful")
    half = new_output("execute_result", data={"text/plain": "1.5"}, execution_count=1)
    assert score_cell(_test_cell(half), 3, True).score == 1.5
    too_much = new_output("execute_result", data={"text/plain": "7"}, execution_count=1)
    assert score_cell(_test_cell(too_much), 3, True).score == 3  # nbgrader itself would crash here
    assert score_cell(_test_cell(), 3, False, "the kernel died").message == "not run: the kernel died"
    assert score_cell(_test_cell(), 3, False).score == 0  # no output is full marks only if the cell ran


def test_the_courses_own_code_cells_get_the_test_cells_limit():
    """A cold ``import torch`` in the locked imports cell once ran past an answer cell's limit on a busy
    CI machine, and every later cell of a right answer scored 0: the course's code gets the long limit."""
    limits = Timeouts(test=120, other=15)

    def cell(**meta):
        c = new_code_cell("import torch")
        c.metadata["nbgrader"] = {"grade_id": "x", "schema_version": 3, **meta}
        return c

    assert limits.for_cell(cell(locked=True, grade=False, solution=False)) == 120  # imports, setup
    assert limits.for_cell(cell(locked=True, grade=True, solution=False, points=1)) == 120  # a test
    assert limits.for_cell(cell(locked=False, grade=False, solution=True)) == 15  # an answer
    assert limits.for_cell(new_code_cell("while True: pass")) == 15  # a cell the student added
    markdown = nbformat.v4.new_markdown_cell("text")
    markdown.metadata["nbgrader"] = {"locked": True, "grade_id": "m"}
    assert limits.for_cell(markdown) == 15
    # every locked code cell of every exercise gets the long limit
    for path in sorted(submissions.EXERCISES.glob("*/*.ipynb")):
        for c in nbformat.read(str(path), as_version=4).cells:
            meta = c.metadata.get("nbgrader", {})
            if c.cell_type == "code" and meta.get("locked"):
                assert limits.for_cell(c) == 120, (path.name, meta.get("grade_id"))


@pytest.mark.timeout(120)
def test_in_process_execution_times_out_a_cell_and_goes_on(tmp_path):
    from course.grading.inprocess import run_in_process

    nb = nbformat.v4.new_notebook(cells=[new_code_cell("while True:\n    pass"), new_code_cell("x = 41\nx + 1")])
    start = time.monotonic()
    run = run_in_process(nb, tmp_path, Timeouts(test=10, other=1))
    assert time.monotonic() - start < 10
    assert nb.cells[0].outputs[-1]["evalue"] == "cell timed out after 1 s"
    assert nb.cells[1].outputs[-1]["data"]["text/plain"] == "42"
    assert run.ran == {0, 1}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "sandboxed-kernel-and-verifier"])
def test_a_rank_traceback_shows_the_students_cells_and_lines_not_the_graders(tmp_path, in_process):
    """The student's error two calls deep: the message shows their cell and lines as IPython names them
    ("Cell In[N], line L" and the source line), and no frame of the grader's harness (graders/parallelism/checks.py)."""
    nb = submissions.patch_answer(submissions.load("ex1-parallelism"), "ex1_average_gradients",
                                  "            p.grad /= rows", "            p.grad /= rows\n"
                                  "            helper(p)")
    nb = submissions.patch_answer(nb, "ex1_average_gradients", "def average_gradients(model, n_local):",
                                  "def helper(p):\n    raise ValueError('boom: ' + str(tuple(p.shape)))\n\n\n"
                                  "def average_gradients(model, n_local):")
    report = submissions.grade(submissions.write(nb, tmp_path, "ex1-parallelism"), in_process=in_process)
    message = submissions.messages(report)["ex1_test_average_gradients"]
    assert "your code raised ValueError: boom: (7, 5)" in message, message
    assert re.search(r"Cell In\[\d+\], line 17, in average_gradients\n\s*\|\s+helper\(p\)", message), message
    assert re.search(r"Cell In\[\d+\], line 2, in helper\n\s*\|\s+raise ValueError", message), message
    assert "graders" not in message and "_average_harness" not in message and "ipykernel_" not in message, message
    assert submissions.scores(report)["ex1_test_shards"] == 2.0


# --- the cause first: an earlier cell that timed out or raised ----------------------------------------


def _cell_index(nb, grade_id: str) -> int:
    return [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells].index(grade_id)


def _code(source: str, *outputs, grade_id: str | None = None, **meta):
    cell = new_code_cell(source, execution_count=1)
    if grade_id:
        cell.metadata["nbgrader"] = {"grade_id": grade_id, "schema_version": 3, "locked": False, "grade": False,
                                     "solution": False, **meta}
    cell.outputs = list(outputs)
    return cell


def _error(ename: str, evalue: str):
    return new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def _check_failed(text: str):
    return new_output("error", ename="CheckFailed", evalue=text, traceback=text.splitlines())


def test_a_failing_test_names_the_earlier_cells_that_timed_out_or_raised_first():
    """Each earlier non-test cell that timed out (with its limit) or raised (type, first line) is named by
    position and grade_id or what it defines, before what the test missed; nothing else changes."""
    from course.grading.causes import explain_failures

    def test(grade_id, *outputs, ran=True):
        cell = _code("graders.parallelism.check_x(f)", *outputs, grade_id=grade_id, grade=True, locked=True, points=2)
        cell.execution_count = 1 if ran else None
        return cell

    nb = nbformat.v4.new_notebook(cells=[
        _code("import torch", grade_id="imports", locked=True),
        nbformat.v4.new_markdown_cell("## Part 1"),
        _code("while True:\n    pass\n\ndef f(x):\n    return x", _error("KeyboardInterrupt", ""),
              _error("CellTimeoutError", "cell timed out after 60 s"), grade_id="answer_f", solution=True),
        test("t_missing", _check_failed("FAILED check_x: `f` was not defined when this test ran")),
        test("t_passes", new_output("stream", name="stdout", text="passed check_x\n")),
        _code("helper = 1 / 0\nclass Model:\n    pass", _error("ZeroDivisionError", "division by zero\nmore")),
        test("t_stderr", new_output("stream", name="stderr", text="boom\n")),
        test("t_not_run", _error("NotRun", "not run: the kernel died"), ran=False),
    ])
    untouched = nbformat.v4.new_notebook(cells=[
        _code("def g():\n    # YOUR CODE HERE\n    raise NotImplementedError()", grade_id="answer_g", solution=True),
        _code("# YOUR CODE HERE\nraise NotImplementedError()", _error("NotImplementedError", ""),
              grade_id="answer_h", solution=True),
        test("t_g", _check_failed("FAILED check_x: `g` is not written yet: it only raises NotImplementedError")),
    ])
    before = json.loads(nbformat.writes(untouched))
    explain_failures(nb)
    explain_failures(untouched)
    timed_out = "before this test, cell 2 (answer_f, which defines `f`) timed out after 60 s (its time limit)"
    raised = "before this test, cell 5 (which defines `helper`, `Model`) raised ZeroDivisionError: division by zero"
    got = {c.metadata["nbgrader"]["grade_id"]: score_cell(c, 2, c.execution_count is not None)
           for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
    assert got["t_missing"].message == (f"{timed_out}\nthen this test failed: "
                                        "FAILED check_x: `f` was not defined when this test ran")
    assert got["t_passes"].score == 2 and got["t_passes"].message == ""
    assert got["t_stderr"].score == 0
    assert got["t_stderr"].message == f"{timed_out}\n{raised}\nthen this test failed: wrote to stderr: boom"
    assert [(o.ename, o.evalue) for o in nb.cells[7].outputs] == [("NotRun", "not run: the kernel died")]
    # the message is one output a check's failure would have: feedback shows it, nbgrader scores it 0
    assert [o.output_type for o in nb.cells[3].outputs] == ["error"] and nb.cells[3].outputs[0].ename == "CheckFailed"
    assert [o.get("name") for o in nb.cells[6].outputs] == ["stderr", None]  # the stderr output stays
    # "not written yet", from a stub in a function or at the top of a cell, is no exception to report
    assert json.loads(nbformat.writes(untouched)) == before
    explain_failures(nb)  # a second pass adds nothing
    assert score_cell(nb.cells[3], 2, True).message == got["t_missing"].message


@pytest.mark.timeout(240)
@pytest.mark.parametrize("top, what", [
    ("while True:\n    pass", "timed out after 3 s (its time limit)"),
    ("1 / 0", "raised ZeroDivisionError: division by zero"),
], ids=["timed-out", "raised"])
def test_tests_after_an_answer_cell_that_timed_out_or_raised_say_so_first(tmp_path, top, what):
    """``while True: pass`` (or ``1 / 0``) above ``def shard_batch``: its tests say first that the answer cell
    timed out (raised), then what they missed; the tests of other answers still pass."""
    nb = submissions.load("ex1-parallelism")
    nb = submissions.replace_answer(nb, "ex1_shard_batch", f"{top}\n\n{submissions.answer(nb, 'ex1_shard_batch')}")
    report = submissions.grade(submissions.write(nb, tmp_path, "ex1-parallelism"), timeout=3)
    assert submissions.scores(report) == submissions.losing("ex1-parallelism", "ex1_test_shards",
                                                           "ex1_test_shard_sizes")
    cause = (f"before this test, cell {_cell_index(nb, 'ex1_shard_batch')} (ex1_shard_batch, which defines "
             f"`shard_batch`) {what}")
    for gid in ("ex1_test_shards", "ex1_test_shard_sizes"):
        message = submissions.messages(report)[gid]
        assert message.splitlines()[0] == cause, message
        assert message.splitlines()[1:] == ["then this test failed: NameError: name 'shard_batch' is not defined"]


@pytest.mark.timeout(120)
def test_an_untouched_copy_still_says_not_written_yet_and_no_cause(tmp_path):
    """The untouched student copy's answers raise NotImplementedError in their stubs: its tests keep "not written
    yet", with no earlier cell reported."""
    from course.student.workspace import release_notebook

    source = submissions.source_path("ex1-parallelism")
    copy = release_notebook(submissions.load("ex1-parallelism"), "ex1-parallelism", source.stem)
    report = submissions.grade(submissions.write(copy, tmp_path, "ex1-parallelism"))
    assert report.score == 0
    for t in report.tests:
        assert t.message.startswith("FAILED check_") and "is not written yet" in t.message, t
        assert "before this test" not in t.message and "then this test failed" not in t.message, t


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grade_check_and_the_graded_notebook_name_the_cell_that_timed_out_or_raised_first(tmp_path, monkeypatch,
                                                                                         capsys):
    """In a real kernel, through the verifier: an endless loop above ``def shard_batch`` and ``1 / 0`` above
    ``def two_stage_step``. ``grade`` (JSON and table), the graded notebook's test cells (what autograde records
    and feedback shows) and ``check`` say first which cell timed out (its limit) or raised, then what was missed."""
    from course.grading.grade import print_report
    from course.grading.scoring import CellResult, GradeReport

    nb = submissions.load("ex1-parallelism")
    nb = submissions.replace_answer(nb, "ex1_shard_batch", "while True:  # never ends\n    pass\n\n"
                                    + submissions.answer(nb, "ex1_shard_batch"))
    nb = submissions.replace_answer(nb, "ex1_two_stage_step", "1 / 0\n\n" + submissions.answer(nb, "ex1_two_stage_step"))
    path = submissions.write(nb, tmp_path, "ex1-parallelism")
    graded = tmp_path / "graded.ipynb"
    runs = [("grade", "--json", "--timeout", ANSWER_TIMEOUT, "-o", graded, path),
            ("check", "--json", "--timeout", ANSWER_TIMEOUT, path)]
    with ThreadPoolExecutor(len(runs)) as pool:
        (g_code, g_out, g_err, seconds), (c_code, c_out, c_err, _) = pool.map(lambda a: cli(*a, timeout=300), runs)
    assert g_code == 0 and c_code == 0, g_err + c_err
    report = json.loads(g_out)
    assert submissions.scores(report) == submissions.losing("ex1-parallelism", "ex1_test_shards", "ex1_test_shard_sizes",
                                                           "ex1_test_two_stage"), submissions.messages(report)
    loop = (f"before this test, cell {_cell_index(nb, 'ex1_shard_batch')} (ex1_shard_batch, which defines "
            f"`shard_batch`) timed out after {ANSWER_TIMEOUT} s (its time limit)")
    zero = (f"before this test, cell {_cell_index(nb, 'ex1_two_stage_step')} (ex1_two_stage_step, which defines "
            "`two_stage_step`) raised ZeroDivisionError: division by zero")
    expected = {
        "ex1_test_shards": f"{loop}\nthen this test failed: FAILED check_shards: `shard_batch` was not defined "
                           "when this test ran",
        "ex1_test_shard_sizes": f"{loop}\nthen this test failed: FAILED check_shard_sizes: `shard_batch` was not "
                                "defined when this test ran",
        "ex1_test_two_stage": f"{loop}\n{zero}\nthen this test failed: FAILED check_two_stage: `two_stage_step` was "
                              "not defined when this test ran",
    }
    assert {gid: m for gid, m in submissions.messages(report).items() if m} == expected
    # the graded notebook: each failing test cell holds that message as its one error output (what autograde records)
    out = nbformat.read(str(graded), as_version=4)
    for gid, message in expected.items():
        cell = out.cells[_cell_index(out, gid)]
        assert [(o.output_type, o.get("ename"), o.get("evalue")) for o in cell.outputs] == [
            ("error", "CheckFailed", message)]
        assert score_cell(cell, 2, True).message == message
    # check: the student's self-check says the same of the visible checks
    assert {t["id"]: t["message"] for t in json.loads(c_out)["tests"] if t["message"]} == expected
    # the table: each failed test's first line is the cause
    monkeypatch.setenv("COLUMNS", "400")
    print_report(GradeReport(report["notebook"], report["score"], report["max_score"],
                             [CellResult(**t) for t in report["tests"]]))
    rows = [line for line in capsys.readouterr().out.splitlines() if "ex1_test_" in line and "│" in line]
    assert sum(loop in row for row in rows) == 3 and not any(zero in row for row in rows), rows
    assert seconds < ANSWER_TIMEOUT + 150, f"grading took {seconds:.0f} s"
