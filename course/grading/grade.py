"""``ddp-course grade NOTEBOOK``: grade one exercise notebook as nbgrader's autograde would, without a gradebook.

:func:`grade_notebook` is the reusable entry point: it finds the source notebook of
a student's copy, restores the locked cells (hidden tests included) from it, runs
the grading pipeline on the result (:mod:`course.grading.pipeline`, the same steps
``ddp-course autograde`` runs on nbgrader: sandboxed kernel, trusted verifier) and
scores every test cell by nbgrader's rules, giving the reason for every lost point.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from course.errors import CourseError
from course.grading.notebook import Timeouts, clear_outputs, read
from course.grading.options import notebook_run_options
from course.grading.restore import find_source, graded_cells, has_answer_cells, restore
from course.grading.scoring import CellResult, GradeReport, score_notebook

#: every test's message when a notebook has none of the exercise's answer cells (all deleted, or a new notebook)
NO_ANSWERS = ("no answer cells found in {name}: it has none of the exercise's answer cells, so nothing was run "
              "(were they deleted?); start again from a fresh copy of the exercise and write your code in its "
              "answer cells")


def grade_notebook(
    path: str | Path,
    *,
    exercises: str | Path | None = None,
    timeouts: Timeouts = Timeouts(),
    in_process: bool = False,
    output: str | Path | None = None,
) -> GradeReport:
    """Grade the notebook at ``path`` (a source notebook, a released copy or a submission).

    ``exercises`` is the folder of source notebooks (default: the course's ``exercises/``).
    The notebook runs in a sandboxed kernel on a copy of its folder, and the scores come from
    the trusted verifier's run of the checks (``report.notes`` says how isolated the run was
    and which test cells the verifier could not re-run). ``in_process=True`` runs the cells in
    this process instead (fast, shares this process's warm rank pool, no sandbox and no
    verification: for trusted notebooks, e.g. tests). ``output``: where to write the graded
    notebook (test cells showing the verdicts), as nbgrader's autograded/ copy would be. Raises
    :class:`~course.errors.NotebookError` for a notebook that cannot be read or matched, or whose kernel died at start.
    """
    path = Path(path)
    student = read(path)
    source_path = find_source(path, exercises)
    report, run = grade_against(path, student, read(source_path), hide=[str(source_path.resolve().parent.parent)],
                                timeouts=timeouts, in_process=in_process)
    if output is not None and run is not None:
        import nbformat

        nbformat.write(run.nb, str(output))
    return report


def grade_against(path: Path, student, original, *, hide: list[str], timeouts: Timeouts = Timeouts(),
                  in_process: bool = False):
    """(report, execution) of ``student`` with its locked cells restored from ``original``: the grading steps
    ``grade`` (``original`` is the source, hidden tests included) and ``check`` (the student copy) share.

    A notebook without any of the original's answer cells is not run: every test says "no answer cells found"
    (the execution is then None).
    """
    graded = graded_cells(original)
    if not has_answer_cells(student, original):
        tests = [CellResult(g.grade_id, 0.0, g.points, NO_ANSWERS.format(name=path.name)) for g in graded]
        return GradeReport(str(path), 0.0, sum(g.points for g in graded), tests), None
    nb = restore(student, original)
    clear_outputs(nb)
    if in_process:
        from course.grading.causes import explain_failures
        from course.grading.inprocess import run_in_process

        run = run_in_process(nb, path.resolve().parent, timeouts)
        explain_failures(run.nb, run.ran)  # as the pipeline's VerifyTests does
    else:
        from traitlets.config import Config

        from course.grading import pipeline

        kernel = original.metadata.get("kernelspec", {}).get("name") or "python3"
        config = pipeline.configure(Config(), test_timeout=timeouts.test, other_timeout=timeouts.other,
                                    kernel_name=kernel, hide=hide)
        run = pipeline.run(nb, path.resolve().parent, config)
    report = score_notebook(run, graded, str(path))
    report.notes = list(run.notes)
    return report, run


def print_report(report: GradeReport) -> None:
    """The report as a table on stdout, then the full message of every failed test."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{report.notebook}: {report.score:g} / {report.max_score:g} points")
    table.add_column("test")
    table.add_column("points", justify="right")
    table.add_column("result")
    table.add_column("ran on")
    for t in report.tests:
        first = t.message.splitlines()[0] if t.message else ""
        result = "[green]passed[/green]" if t.score >= t.max_score else f"[red]{_escape(first)}[/red]"
        table.add_row(t.id, f"{t.score:g} / {t.max_score:g}", result, _escape("; ".join(report.ran_on.get(t.id, []))))
    console.print(table)
    for note in report.notes:
        console.print(_escape(note), highlight=False)
    for t in report.tests:
        if t.message and "\n" in t.message:
            console.rule(f"{t.id}")
            console.print(_escape(t.message), highlight=False)


@contextlib.contextmanager
def one_zygote():
    """Fork this grading's kernel and verifier from one zygote (:mod:`course.sandbox.zygote`), as an autograde
    worker forks its submissions': torch, torch._dynamo, ipykernel and the check API imported once for both
    instead of once in each. Started when the kernel is (a command that fails before pays nothing; and by then
    the grading's config has set the environment its processes get, which the zygote must import with, else they
    are exec'd), stopped at the end; nothing where zygotes are off (``DDP_COURSE_ZYGOTE=0``) or one is in use."""
    from course.grading.kernel import ZYGOTE_PRELOAD
    from course.sandbox import zygote

    with zygote.on_demand(ZYGOTE_PRELOAD):
        yield


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


@click.command()
@notebook_run_options(json_help="Print one JSON object (the scores) on stdout and nothing else.",
                      exercises_help="Folder of the source notebooks (default: the course's exercises/).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the graded notebook (every output, test cells showing the grader's verdicts) here.")
def command(notebook, as_json, exercises, test_timeout, timeout, output):
    """Grade one exercise NOTEBOOK: run it in a fresh kernel with the hidden tests restored.

    NOTEBOOK is a source notebook, a released copy or a student's submission; its
    locked cells (tests, hidden tests) come back from the matching notebook in
    exercises/. Exits 0 whenever grading ran, whatever the score.
    """
    try:
        with one_zygote():
            report = grade_notebook(notebook, exercises=exercises, timeouts=Timeouts(test=test_timeout, other=timeout),
                                    output=output)
    except CourseError as err:
        raise click.ClickException(str(err)) from None
    except Exception as err:  # noqa: BLE001 - e.g. no kernel: one line, not a traceback
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise click.ClickException(f"{notebook}: grading did not run ({type(err).__name__}: {first})") from None
    if as_json:
        click.echo(report.to_json())
    else:
        print_report(report)
