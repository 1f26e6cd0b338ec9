"""Nothing of a solution reaches a student: what the course declares student material, and every verb that copies
course material towards students (init + release, lab --make-only, the lab image's workspace step, feedback,
autograde's copy of source/) leaving out, naming and failing on everything else.

The planted course is the real one (every lesson and exercise) with, beside each source notebook, a file holding
one of its reference answers (no markers: code as a helper module or a draft would hold it), the scripts the ex4
notebooks' ``%%writefile`` cells write when run in place, a draft in a subfolder and a file loose in exercises/.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from click.testing import CliRunner

from course.cli import main
from course.instructor import material
from course.instructor.leaks import HIDDEN_TESTS, SOLUTION, is_meaningful, split_regions
from course.instructor.material import survey

pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")

ROOT = Path(__file__).resolve().parent.parent
EXERCISES, LESSONS = ROOT / "exercises", ROOT / "lessons"


def answer_regions(nb_path: Path) -> list[list[str]]:
    """Each solution region's code lines (markers and comments left out)."""
    regions = []
    for cell in nbformat.read(nb_path, as_version=4).cells:
        inside, _ = split_regions(cell.source, SOLUTION)
        body = [line for line in inside if not any(m in line for m in SOLUTION)]
        lines = [line for line in body if is_meaningful(line) and not line.strip().startswith("#")]
        if lines:
            regions.append(body)
    return regions


def visible_text(nb_path: Path) -> str:
    """What a student's copy of the notebook shows: every line outside the solution and hidden-test regions."""
    lines = []
    for cell in nbformat.read(nb_path, as_version=4).cells:
        _, outside = split_regions(cell.source, SOLUTION)
        lines += split_regions("\n".join(outside), HIDDEN_TESTS)[1]
    return "\n".join(lines)


def writefile_script(nb_path: Path) -> tuple[str, str]:
    """(file name, text) that the notebook's ``%%writefile`` cell writes when run."""
    for cell in nbformat.read(nb_path, as_version=4).cells:
        if cell.source.startswith("%%writefile "):
            first, _, body = cell.source.partition("\n")
            return first.split()[1], body + "\n"
    raise AssertionError(f"{nb_path} writes no file")


@pytest.fixture
def planted(tmp_path):
    """(course folder, {planted relative path: lines that must never reach a student})."""
    course = tmp_path / "planted"
    shutil.copytree(LESSONS, course / "lessons")
    shutil.copytree(EXERCISES, course / "exercises", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    secrets: dict[str, list[str]] = {}
    for nb in sorted((course / "exercises").glob("*/*.ipynb")):
        # the answer of each notebook most of whose lines a student sees nowhere, as a helper module would hold it
        given = "\n".join(p.read_text() for p in [*nb.parent.glob("*.py"), *LESSONS.glob("*.ipynb")]) + visible_text(nb)
        def unseen(body, given=given):
            return [line.strip() for line in body if len(line.strip()) > 20 and line.strip() not in given]
        body = max(answer_regions(nb), key=lambda body: len(unseen(body)))
        rel = f"exercises/{nb.parent.name}/{nb.stem}_helpers.py"
        (course / rel).write_text("\n".join(body) + "\n")
        secrets[rel] = unseen(body)[:3]
        assert secrets[rel], rel
    for name in ("torchrun", "elastic"):  # what running the ex4 source notebooks in place wrote
        filename, text = writefile_script(course / "exercises" / "ex4-torchrun" / f"{name}.ipynb")
        (course / "exercises" / "ex4-torchrun" / filename).write_text(text)
        secrets[f"exercises/ex4-torchrun/{filename}"] = ["### BEGIN SOLUTION"]
    draft = course / "exercises" / "ex1-parallelism" / "drafts" / "notes.md"
    draft.parent.mkdir()
    draft.write_text("my draft: " + secrets["exercises/ex1-parallelism/parallelism_helpers.py"][0] + "\n")
    secrets["exercises/ex1-parallelism/drafts/notes.md"] = ["my draft:"]
    (course / "exercises" / "answers.py").write_text("ANSWERS = 'loose'\n")
    secrets["exercises/answers.py"] = ["ANSWERS = 'loose'"]
    return course, secrets


def all_text(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "replace") for p in folder.rglob("*") if p.is_file())


def assert_none_reached(folder: Path, secrets: dict[str, list[str]]) -> None:
    text = all_text(folder)
    for rel, lines in secrets.items():
        name = rel.rsplit("/", 1)[-1]
        assert not list(folder.rglob(name)), f"{name} reached {folder}"
        for line in lines:
            assert line not in text, f"{rel}'s line {line!r} reached {folder}"


def assert_each_named(output: str, secrets: dict[str, list[str]]) -> None:
    for rel in secrets:
        name = rel.removeprefix("exercises/").split("/", 1)[-1] if rel.count("/") > 1 else rel
        assert name in output and "not student material" in output, f"{rel} not named as refused:\n{output}"


#: the ddp-course command of this Python (the Dockerfile's step calls it by name, from PATH)
BIN = Path(sys.executable).parent


def cli(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ddp-course"), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def course_env(course: Path) -> dict:
    import os

    return {**os.environ, "DDP_COURSE_ROOT": str(course), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


# -- the rules --------------------------------------------------------------------------------------------------


def test_the_course_declares_its_given_scripts_and_nothing_is_refused():
    for folder in [LESSONS, *sorted(p for p in EXERCISES.iterdir() if p.is_dir())]:
        found = survey(folder)
        assert found.refused == [], found.refused
    assert [p.name for p in survey(EXERCISES / "ex2-ddp-basics").files] == ["buggy_training.py"]
    assert len(survey(EXERCISES / "ex4-torchrun").files) == 4


def test_a_declared_file_may_share_lines_with_its_fix_but_not_hold_a_whole_answer(tmp_path):
    folder = tmp_path / "ex2"
    shutil.copytree(EXERCISES / "ex2-ddp-basics", folder)
    assert [p.name for p in survey(folder).files] == ["buggy_training.py"]  # most of the fix's lines: given
    answers = answer_regions(folder / "debug_training.ipynb")
    with open(folder / "buggy_training.py", "a") as fh:  # the fixed function pasted into the given script
        fh.write("\n\n" + "\n".join(max(answers, key=len)) + "\n")
    refused = survey(folder).refused
    assert [r.path for r in refused] == ["buggy_training.py"]
    assert "debug_training.ipynb's answer in its solution cell" in refused[0].reason


def test_a_declared_file_holding_another_notebooks_answer_or_hidden_tests_is_refused(tmp_path):
    folder = tmp_path / "ex2"
    shutil.copytree(EXERCISES / "ex2-ddp-basics", folder)
    given = folder / "buggy_training.py"
    original = given.read_text()
    given.write_text(original + "\n" + "\n".join(max(answer_regions(folder / "ddp_basics.ipynb"), key=len)) + "\n")
    assert "ddp_basics.ipynb's answer" in survey(folder).refused[0].reason
    given.write_text(original + "\n# ### BEGIN HIDDEN TESTS\n")
    assert "region marker" in survey(folder).refused[0].reason


def test_a_malformed_or_missing_declaration_is_named(tmp_path):
    folder = tmp_path / "ex4"
    shutil.copytree(EXERCISES / "ex4-torchrun", folder)
    (folder / "hang_early.py").unlink()
    assert [str(r) for r in survey(folder).refused] == ["hang_early.py: declared by find_the_hang.ipynb but missing"]
    nb = json.loads((folder / "find_the_hang.ipynb").read_text())
    for bad in ("hang_early.py", ["../elsewhere.py"], ["/etc/passwd"], ["other.ipynb"]):
        nb["metadata"][material.KEY][material.FILES] = bad
        (folder / "find_the_hang.ipynb").write_text(json.dumps(nb))
        refused = survey(folder).refused
        assert refused and refused[0].path == "find_the_hang.ipynb" and "student_files" in refused[0].reason, bad


# -- every verb, on the planted course ---------------------------------------------------------------------------


@pytest.mark.slow
def test_init_release_lab_and_the_lab_image_step_give_nothing_planted(planted, tmp_path):
    course, secrets = planted
    env = course_env(course)

    # init: only the notebooks and their declared files go into source/; each other file named; exit 2
    grading = tmp_path / "grading"
    init = cli("init", grading, "--exercises", course / "exercises", cwd=tmp_path, env=env)
    assert init.returncode == 2, init
    assert_each_named(init.stderr, {k: v for k, v in secrets.items() if k != "exercises/answers.py"})
    assert "buggy_training.py" not in init.stderr and "hang_early.py" not in init.stderr
    assert "helpers.py: not student material" in init.stderr and "reference solution" in init.stderr
    planted_names = {rel.rsplit("/", 1)[-1] for rel in secrets}  # source/ holds the solutions: only the files
    assert not [p for p in (grading / "source").rglob("*") if p.name in planted_names]
    assert (grading / "source" / "ex2-ddp-basics" / "buggy_training.py").is_file()

    release = cli("release", cwd=grading, env=env)
    assert release.returncode == 0, release
    assert "every file checked" in release.stdout
    assert_none_reached(grading / "release", secrets)
    assert sorted(p.name for p in (grading / "release" / "ex4-torchrun").iterdir()) == [
        "elastic.ipynb", "find_the_hang.ipynb", "hang_early.py", "hang_metric.py", "hang_shapes.py",
        "hang_uneven.py", "torchrun.ipynb"]

    # a file dropped into source/ by hand: release deletes the release, names it and fails
    shutil.copy(course / "exercises" / "ex4-torchrun" / "train.py", grading / "source" / "ex4-torchrun")
    again = cli("release", "ex4-torchrun", cwd=grading, env=env)
    assert again.returncode != 0 and "train.py" in again.stderr and "not student material" in again.stderr, again
    assert "region marker" in again.stderr
    assert not (grading / "release" / "ex4-torchrun").exists()

    # lab --make-only: nothing planted in the workspace, each planted file named, exit 2
    ws = tmp_path / "ws"
    made = cli("lab", "--dir", ws, "--make-only", cwd=tmp_path, env=env)
    assert made.returncode == 2, made
    assert_each_named(made.stdout, secrets)
    assert_none_reached(ws, secrets)
    assert (ws / "exercises" / "ex4-torchrun" / "hang_metric.py").is_file()

    # the lab image's workspace step, exactly as docker/Dockerfile runs it (COPY lessons/ exercises/ to /src)
    step = re.search(r"^RUN (DDP_COURSE_ROOT=/src ddp-course lab --dir /build/course --make-only)$",
                     (ROOT / "docker" / "Dockerfile").read_text(), re.M)
    assert step, "the Dockerfile's workspace step changed: update this test"
    src, build = tmp_path / "src", tmp_path / "build" / "course"
    shutil.copytree(course / "lessons", src / "lessons")
    shutil.copytree(course / "exercises", src / "exercises")
    image = subprocess.run(step.group(1).replace("/src", str(src)).replace("/build/course", str(build)), shell=True,
                           capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert image.returncode == 2, image  # a docker build stops here
    assert_each_named(image.stdout, secrets)
    assert_none_reached(build, secrets)


def test_the_lab_image_course_of_student_copies_keeps_its_declared_files_and_refuses_others(tmp_path):
    """The lab image installs a workspace made from the student edition: its notebooks are student copies (no
    solutions to check against), whose metadata still declares the given scripts."""
    edition = tmp_path / "edition"
    assert CliRunner().invoke(main, ["lab", "--dir", str(edition), "--make-only"],
                              env={"DDP_COURSE_ROOT": str(ROOT)}).exit_code == 0
    ws = tmp_path / "student"
    first = CliRunner().invoke(main, ["lab", "--dir", str(ws), "--make-only"], env={"DDP_COURSE_ROOT": str(edition)})
    assert first.exit_code == 0, first.output
    assert (ws / "exercises" / "ex2-ddp-basics" / "buggy_training.py").is_file()
    (edition / "exercises" / "ex4-torchrun" / "train.py").write_text("# ### BEGIN SOLUTION\nx = 1\n")
    second = CliRunner().invoke(main, ["lab", "--dir", str(ws), "--make-only"], env={"DDP_COURSE_ROOT": str(edition)})
    assert second.exit_code == 2 and "exercises/ex4-torchrun/train.py: not student material" in second.output
    assert not (ws / "exercises" / "ex4-torchrun" / "train.py").exists()


def test_a_real_lab_start_refuses_to_start_over_a_planted_file(tmp_path):
    course = tmp_path / "course"
    shutil.copytree(EXERCISES / "ex2-ddp-basics", course / "exercises" / "ex2-ddp-basics")
    (course / "exercises" / "ex2-ddp-basics" / "solution.py").write_text("print('answer')\n")
    result = CliRunner().invoke(main, ["lab", "--dir", str(tmp_path / "ws"), "--no-browser", "--allow-root"],
                                env={"DDP_COURSE_ROOT": str(course)})
    assert result.exit_code == 2, result.output
    assert "solution.py: not student material" in result.output and "JupyterLab was not started" in result.output


def test_a_corrupt_lesson_is_named_by_make_only(tmp_path):
    course = tmp_path / "course"
    (course / "lessons").mkdir(parents=True)
    (course / "lessons" / "01-broken.ipynb").write_text("{not json")
    result = CliRunner().invoke(main, ["lab", "--dir", str(tmp_path / "ws"), "--make-only"],
                                env={"DDP_COURSE_ROOT": str(course)})
    assert result.exit_code == 2 and "lessons/01-broken.ipynb: not a notebook" in result.output, result.output
    assert not (tmp_path / "ws" / "lessons" / "01-broken.ipynb").exists()


def test_feedback_hands_back_pages_the_students_own_files_and_declared_ones_only(tmp_path):
    from course.instructor.coursedir import Course
    from course.instructor.feedback import stray_files
    from course.instructor.init import init_course

    init_course(tmp_path / "c", exercises=EXERCISES)
    course = Course(tmp_path / "c")
    feedback = course.folder("feedback", "ann", "ex4-torchrun")
    submitted = course.folder("submitted", "ann", "ex4-torchrun")
    feedback.mkdir(parents=True)
    submitted.mkdir(parents=True)
    (feedback / "torchrun.html").write_text("<html>page</html>")
    shutil.copy(EXERCISES / "ex4-torchrun" / "hang_early.py", feedback)  # declared: kept
    for folder in (feedback, submitted):
        (folder / "mine.py").write_text("print('the student wrote this')\n")  # her own: kept
    name, text = writefile_script(EXERCISES / "ex4-torchrun" / "torchrun.ipynb")
    (submitted / name).write_text("her own train.py\n")
    (feedback / name).write_text(text)  # autograde's copy of a source/ file over hers: deleted
    (feedback / "notes").mkdir()
    (feedback / "notes" / "key.txt").write_text("answers\n")  # deleted
    refused = stray_files(course, "ex4-torchrun", "ann")
    assert sorted(r.split(":")[0].rsplit("/", 1)[-1] for r in refused) == ["key.txt", "train.py"]
    assert sorted(p.relative_to(feedback).as_posix() for p in feedback.rglob("*") if p.is_file()) == [
        "hang_early.py", "mine.py", "torchrun.html"]


def test_autograde_refuses_a_source_folder_that_holds_a_solution_file(tmp_path):
    from course.errors import CourseError
    from course.instructor.autograde.run import check_sources
    from course.instructor.coursedir import Course
    from course.instructor.init import init_course

    init_course(tmp_path / "c", exercises=EXERCISES)
    course = Course(tmp_path / "c")
    check_sources(course, ["ex4-torchrun"])  # clean
    name, text = writefile_script(EXERCISES / "ex4-torchrun" / "elastic.ipynb")
    (course.folder("source", assignment="ex4-torchrun") / name).write_text(text)
    with pytest.raises(CourseError, match=r"source/ex4-torchrun/elastic.py: not student material"):
        check_sources(course, ["ex4-torchrun"])


# -- a source notebook run in place leaves nothing among the sources ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("notebook", ["torchrun", "elastic"])
def test_running_a_source_notebook_in_place_writes_its_script_elsewhere(notebook, tmp_path):
    """The cells up to the script's ``%%writefile``, run in a kernel whose folder is the course's own
    exercises/ex4-torchrun: the script lands in a scratch folder, none beside the sources."""
    from nbclient import NotebookClient

    folder = EXERCISES / "ex4-torchrun"
    before = sorted(p.name for p in folder.iterdir())
    nb = nbformat.read(folder / f"{notebook}.ipynb", as_version=4)
    upto = next(i for i, c in enumerate(nb.cells) if c.source.startswith("%%writefile"))
    nb.cells = nb.cells[: upto + 1] + [nbformat.v4.new_code_cell("import os; print('CWD=' + os.getcwd())")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    assert sorted(p.name for p in folder.iterdir()) == before
    cwd = nb.cells[-1].outputs[0]["text"].split("CWD=")[1].strip()
    assert Path(cwd).resolve() != folder.resolve() and "ddp-course-ex4-torchrun-" in cwd
    said = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "run in place" in said and cwd in said


def test_a_students_copy_stays_where_it_is(tmp_path, monkeypatch):
    from course.paths import is_course_source, leave_the_sources

    monkeypatch.chdir(tmp_path)
    assert leave_the_sources() is None and Path.cwd() == tmp_path
    assert is_course_source(EXERCISES / "ex4-torchrun")
    nbgrader_source = tmp_path / "c" / "source" / "ex4-torchrun"
    nbgrader_source.mkdir(parents=True)
    assert not is_course_source(nbgrader_source)  # no nbgrader_config.py beside source/: not a course
    (tmp_path / "c" / "nbgrader_config.py").write_text("")
    assert is_course_source(nbgrader_source)
