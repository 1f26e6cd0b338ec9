"""``ddp-course init DIR``: an nbgrader course directory whose source/ is the course's exercises.

It writes an ``nbgrader_config.py`` fit for grading DDP code (see
:func:`render_config`) and copies each exercise's student material into ``source/``: its notebooks and
the files they declare (:mod:`course.instructor.material`); any other file beside them is named and left out. Running it
again changes nothing; an instructor's edits (to the config or to a source
notebook) are kept unless ``--force`` is given.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from course.errors import CourseError, PartlyDone
from course.grading.cells import OTHER_CELL_TIMEOUT, TEST_CELL_TIMEOUT
from course.instructor.coursedir import CONFIG_FILE
from course.instructor.material import survey

DEFAULT_COURSE_ID = "ddp-course"
DEFAULT_TEST_TIMEOUT = int(TEST_CELL_TIMEOUT)
DEFAULT_CELL_TIMEOUT = int(OTHER_CELL_TIMEOUT)
_IGNORED = {".ipynb_checkpoints", "__pycache__"}

CONFIG_TEMPLATE = '''\
"""nbgrader settings for a ddp-course class (written by `ddp-course init`).

Plain `nbgrader` commands run in this folder read this file too, so they grade
exactly as `ddp-course autograde` does. Edit freely: `ddp-course init` keeps
your changes unless it is run with --force.
"""

from nbconvert.preprocessors import ClearMetadataPreprocessor, CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import AssignLatePenalties, CheckCellMetadata, GetGrades, SaveAutoGrades

from course.grading.pipeline import GRADING_STEPS, configure
from course.instructor.redact import RedactHiddenTests

c = get_config()  # noqa: F821 (nbgrader provides it)

c.CourseDirectory.course_id = {course_id!r}
{db_line}

# Per-cell time limits, in seconds. Test cells run real multi-rank jobs (exercise 4
# starts torchrun, ~15 s per job here); a hung check is also stopped by its own
# deadline. Other cells only define functions, so a stuck one is cut short.
TEST_CELL_TIMEOUT = {test_timeout}
OTHER_CELL_TIMEOUT = {cell_timeout}

# The grading pipeline `ddp-course grade` runs too (course/grading/pipeline.py): every
# notebook runs on the course's kernel in a sandbox (its own uid and folder, no network,
# exercise sources, course folder and gradebook out of sight, memory and process limits;
# less when not root: `ddp-course autograde` says which) with bounded cells and without
# the hidden tests; then a trusted process re-runs every check, hidden tests included,
# and writes its verdicts into the test cells, so nothing a notebook does to the graders,
# the launcher or its own outputs can raise its score. A stderr output made only of
# warnings does not zero a cell; any other stderr still does (nbgrader's rule).
configure(c, test_timeout=TEST_CELL_TIMEOUT, other_timeout=OTHER_CELL_TIMEOUT, kernel_name={kernel!r})
c.Autograde.autograde_preprocessors = [*GRADING_STEPS, ClearMetadataPreprocessor, SaveAutoGrades,
                                       AssignLatePenalties, CheckCellMetadata]
# Each check stops a job of the student's ranks after DDP_COURSE_CHECK_TIMEOUT seconds (default 60):
# import os; os.environ.setdefault("DDP_COURSE_CHECK_TIMEOUT", "60")

# Feedback shows each check's score and failure message but never hidden test
# source (nbgrader issue #917).
c.GenerateFeedback.preprocessors = [GetGrades, RedactHiddenTests, CSSHTMLHeaderPreprocessor]

# Late work: due dates and extensions live in the gradebook (ddp-course duedate); autograde's
# AssignLatePenalties asks the plugin below for each late notebook's penalty.
{late_block}'''

DB_DEFAULT_LINE = """\
# The gradebook: SQLite (gradebook.db in this folder) unless set here. PostgreSQL works
# the same way (pip install 'ddp-course[postgres]'; the database must exist and be UTF8):
# c.CourseDirectory.db_url = "postgresql+psycopg://user:password@dbhost:5432/ddp_course\""""


def default_exercises() -> Path:
    from course.paths import course_root

    return course_root() / "exercises"


def exercise_assignments(exercises: Path) -> list[Path]:
    """Assignment folders (holding at least one notebook) in an exercises folder."""
    if not exercises.is_dir():
        return []
    return sorted(p for p in exercises.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def course_kernel(assignments: list[Path]) -> str:
    """The kernel the exercise notebooks name (python3 when they name none)."""
    for folder in assignments:
        for path in sorted(folder.glob("*.ipynb")):
            name = json.loads(path.read_text()).get("metadata", {}).get("kernelspec", {}).get("name")
            if name:
                return name
    return "python3"


def render_config(
    course_id: str = DEFAULT_COURSE_ID,
    db_url: str | None = None,
    kernel: str = "python3",
    test_timeout: int = DEFAULT_TEST_TIMEOUT,
    cell_timeout: int = DEFAULT_CELL_TIMEOUT,
) -> str:
    """The text of a course's nbgrader_config.py."""
    from course.instructor.late import policy_block

    db_line = f"c.CourseDirectory.db_url = {db_url!r}" if db_url else DB_DEFAULT_LINE
    return CONFIG_TEMPLATE.format(
        late_block=policy_block(),
        course_id=course_id,
        db_line=db_line,
        kernel=kernel,
        test_timeout=int(test_timeout),
        cell_timeout=int(cell_timeout),
    )


def _files(folder: Path, only: list[Path] | None = None) -> dict[str, bytes]:
    paths = only if only is not None else [p for p in sorted(folder.rglob("*")) if p.is_file()]
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in paths
        if not _IGNORED.intersection(p.relative_to(folder).parts)
    }


def _place(target: Path, write, same: bool, force: bool) -> str:
    """Create ``target`` with ``write()`` unless it exists; replace it only with force. Returns what happened."""
    if not target.exists():
        write()
        return "created"
    if same:
        return "unchanged"
    if not force:
        return "kept"
    write()
    return "replaced"


def init_course(
    root: Path,
    *,
    exercises: Path | None = None,
    force: bool = False,
    course_id: str = DEFAULT_COURSE_ID,
    db_url: str | None = None,
    test_timeout: int = DEFAULT_TEST_TIMEOUT,
    cell_timeout: int = DEFAULT_CELL_TIMEOUT,
) -> list[tuple[str, str]]:
    """Create or update the course directory at ``root``; returns (path, what happened) for each item."""
    exercises = Path(exercises) if exercises else default_exercises()
    assignments = exercise_assignments(exercises)
    if not assignments:
        raise CourseError(f"no exercises found in {exercises} (expected <assignment>/<notebook>.ipynb)")
    root = Path(root)
    (root / "source").mkdir(parents=True, exist_ok=True)
    report = []

    config = render_config(course_id, db_url, course_kernel(assignments), test_timeout, cell_timeout)
    config_path = root / CONFIG_FILE
    same = config_path.is_file() and config_path.read_text() == config
    report.append((CONFIG_FILE, _place(config_path, lambda: config_path.write_text(config), same, force)))

    for folder in assignments:
        target = root / "source" / folder.name
        material = survey(folder)
        wanted = _files(folder, material.notebooks + material.files)

        def copy(target=target, wanted=wanted):
            if target.exists():
                shutil.rmtree(target)
            for rel, data in wanted.items():
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                (target / rel).write_bytes(data)

        same = target.is_dir() and _files(target) == wanted
        report.append((f"source/{folder.name}", _place(target, copy, same, force)))
        report += [(f"{folder.name}/{r.path}", f"refused: {r.reason}") for r in material.refused]
    return report


@click.command()
@click.argument("root", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace a config or source notebook that differs from the course's.")
@click.option("--course-id", default=DEFAULT_COURSE_ID, show_default=True, help="nbgrader course id.")
@click.option("--db", "db_url", default=None, help="Gradebook database URL (default: sqlite in DIR/gradebook.db).")
@click.option("--exercises", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Folder of <assignment>/<notebook>.ipynb source notebooks (default: the course's exercises).")
@click.option("--test-timeout", default=DEFAULT_TEST_TIMEOUT, show_default=True, help="Seconds a test cell may run.")
@click.option("--cell-timeout", default=DEFAULT_CELL_TIMEOUT, show_default=True, help="Seconds an answer cell or a cell the student added may run (the course's own code cells get --test-timeout).")
def command(root, force, course_id, db_url, exercises, test_timeout, cell_timeout):
    """Create (or update) an nbgrader course directory DIR for the course's exercises."""
    report = init_course(root, exercises=exercises, force=force, course_id=course_id, db_url=db_url,
                         test_timeout=test_timeout, cell_timeout=cell_timeout)
    refused = [(path, what) for path, what in report if what.startswith("refused: ")]
    for path, what in report:
        if (path, what) in refused:
            continue
        note = " (yours differs from the course's; --force replaces it)" if what == "kept" else ""
        click.echo(f"{what:>9}  {path}{note}")
    for path, what in refused:
        click.echo(f"not copied  {path}: {what.removeprefix('refused: ')}", err=True)
    if refused:
        raise PartlyDone(f"{len(refused)} file(s) beside the exercises were not copied into source/ (listed above): "
                         "only the notebooks and the files they declare reach students; remove the others, or "
                         "declare a file a student needs in its notebook's metadata (docs/writing-exercises.md)")
    click.echo(f"\nnext: cd {root} && ddp-course release")
