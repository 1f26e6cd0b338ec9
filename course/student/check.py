"""``ddp-course check NOTEBOOK``: run a notebook's visible checks as the grader runs them, and say what it will say.

The notebook goes through the grading pipeline (:func:`course.grading.grade.grade_against`:
a fresh sandboxed kernel, then the trusted verifier re-runs every test cell's checks), with
its locked cells restored from the student copy of the exercise (made from the installed
course as ``release`` makes it), so an edited or deleted test cell changes nothing here
either. Each test cell's message is the one its feedback shows. The hidden tests are not run
(a student's machine must not need them): where a test cell has some, the count recorded
in the workspace's manifest (or read from the course's source) says "N hidden variants are
graded too". A failed check shows level 1 of its message (what is wrong); ``--hint check_x`` shows the next
level of that check's failure and records the request beside the notebook (:mod:`course.grading.hints`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from course.grading.cells import Timeouts
from course.grading.options import notebook_run_options


@dataclass
class CheckedCell:
    """One test cell as the self-check saw it."""

    id: str
    score: float
    max_score: float
    #: what the feedback shows for it: the failure message ("" when it passed)
    message: str = ""
    #: what the checks printed when it passed ("passed check_x ...")
    printed: str = ""
    #: how many hidden variants of it the grader runs too
    hidden: int = 0
    #: the check that failed ("" when it passed, or when the cell failed for another reason)
    check: str = ""

    @property
    def passed(self) -> bool:
        return self.score >= self.max_score


@dataclass
class CheckReport:
    notebook: str
    score: float
    max_score: float
    tests: list[CheckedCell] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the failed check of each test cell, by grade id: its package and its message at every hint level (not
    #: in the JSON: a level is given when asked for, and the asking recorded)
    hints: dict[str, dict] = field(default_factory=dict, repr=False)

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("hints")
        return json.dumps(data)


def student_original(path: Path, exercises: Path | None):
    """(the student copy of the exercise ``path`` belongs to, its file in the installed course)."""
    from course.grading.notebook import read
    from course.grading.restore import find_source
    from course.student.workspace import is_source_notebook, release_notebook

    source_path = find_source(path, exercises)
    original = read(source_path)
    if is_source_notebook(original):
        original = release_notebook(original, source_path.parent.name, source_path.stem)
    return original, source_path


def hidden_counts(path: Path, source_path: Path) -> dict[str, int]:
    """Test cell id -> hidden variants: from the workspace's manifest, else from the course's own notebook."""
    from course.grading.notebook import read
    from course.student.workspace import find_workspace, hidden_variants, is_source_notebook, read_manifest

    for notebook in (path, source_path):
        ws = find_workspace(notebook)
        if ws is not None:
            entry = read_manifest(ws).get("files", {}).get(notebook.resolve().relative_to(ws).as_posix())
            if entry is not None:
                return {str(k): int(v) for k, v in entry.get("hidden", {}).items()}
    source = read(source_path)
    return hidden_variants(source) if is_source_notebook(source) else {}


def check_notebook(path: str | Path, *, exercises: str | Path | None = None, timeouts: Timeouts = Timeouts(),
                   in_process: bool = False) -> CheckReport:
    """Run ``path``'s visible checks through the grading pipeline; raises NotebookError for an unreadable notebook."""
    from course.grading.grade import grade_against
    from course.grading.notebook import read

    path = Path(path)
    student = read(path)
    original, source_path = student_original(path, Path(exercises) if exercises else None)
    report, run = grade_against(path, student, original, hide=[str(source_path.resolve().parent.parent)],
                                timeouts=timeouts, in_process=in_process)
    hidden = hidden_counts(path, source_path)
    printed = {}
    if run is not None:
        for cell in run.nb.cells:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            printed.setdefault(gid, "".join(o.get("text", "") for o in cell.get("outputs", [])
                                            if o.get("output_type") == "stream" and o.get("name") == "stdout"))
    found = run.hints if run is not None else {}
    tests = [CheckedCell(t.id, t.score, t.max_score, t.message, printed.get(t.id, "") if t.score >= t.max_score
                         else "", hidden.get(t.id, 0), found[t.id]["check"] if t.id in found and t.score < t.max_score
                         else "") for t in report.tests]
    return CheckReport(str(path), report.score, report.max_score, tests, list(report.notes),
                       {gid: found[gid] for gid in found if any(t.id == gid and t.check for t in tests)})


def give_hint(report: CheckReport, check: str, folder: Path) -> tuple[str, int] | None:
    """(the text, the level) of the next hint for ``check``'s failure in ``report``, the request recorded in
    ``folder``; None when ``check`` did not fail."""
    from course.grading import hints

    for t in report.tests:
        if t.check == check and t.id in report.hints:
            found = report.hints[t.id]
            levels = found["levels"]
            failure = hints.fingerprint(found["package"] or None, check, levels[0])
            level = hints.next_level(hints.read_record(folder), check, failure)
            level = min(level, len(dict.fromkeys(levels)))  # the last level that adds something
            hints.record(folder, check=check, package=found["package"] or None, level=level, failure=failure,
                         asked_in="check")
            return levels[level - 1], level
    return None


def hidden_line(n: int) -> str:
    return f"{n} hidden variant is graded too" if n == 1 else f"{n} hidden variants are graded too"


def report_lines(report: CheckReport, hint: tuple[str, str, int] | None = None) -> list[str]:
    """The report as the student reads it: each test cell, its points, the feedback's message (level 1 of a failed
    check's; ``hint``: (check, text, level) shown in its place), its hidden count."""
    lines = [f"{report.notebook}: the visible checks, run as the grader runs them"]
    from course.grading.grade import NO_ANSWERS

    nothing = NO_ANSWERS.format(name=Path(report.notebook).name)
    if report.tests and all(t.message == nothing for t in report.tests):
        return [f"{report.notebook}: {nothing}"]
    width = max((len(t.id) for t in report.tests), default=0)
    for t in report.tests:
        verdict = "passed" if t.passed else "FAILED"
        lines.append(f"  {t.id:<{width}}  {t.score:g}/{t.max_score:g}  {verdict}")
        body = t.printed.rstrip("\n") if t.passed else t.message
        if hint is not None and not t.passed and t.check == hint[0]:
            body = f"hint level {hint[2]} for {t.check}:\n{hint[1]}"
        lines += [f"      {line}" for line in body.splitlines() if line.strip()]
        if t.hidden:
            lines.append(f"      ({hidden_line(t.hidden)})")
    lines += [f"  note: {note}" for note in report.notes]
    total = sum(t.hidden for t in report.tests)
    lines.append(f"visible checks: {report.score:g} / {report.max_score:g} points"
                 + (f"; the grader also runs {total} hidden variant(s), so your grade can be lower" if total else ""))
    return lines


@click.command()
@notebook_run_options(json_help="Print one JSON object on stdout and nothing else.",
                      exercises_help="Folder of the course's exercises (default: the installed course's exercises/).")
@click.option("--hint", "hint_check", metavar="CHECK", default=None,
              help="Show the next hint level of CHECK's failure (2: the idea and the lesson section that teaches "
                   "it; 3: where your code breaks it) and record that you asked.")
def command(notebook, as_json, exercises, test_timeout, timeout, hint_check):
    """Run NOTEBOOK's visible checks as the grader will, and print what its feedback will say.

    The notebook runs in a fresh kernel (save it first); its test cells come back as the exercise has
    them. Hidden tests are not run: each test cell that has some says how many. A failed check says what is
    wrong; --hint CHECK asks for more, one level each time. Exits 0 whenever the checks ran, whatever they found.
    """
    from course.errors import CourseError

    if not notebook.is_file():
        raise CourseError(f"{notebook}: no such notebook")
    from course.grading.grade import one_zygote

    try:
        with one_zygote():  # its kernel and verifier forked from one zygote, as `ddp-course grade` does
            report = check_notebook(notebook, exercises=exercises, timeouts=Timeouts(test=test_timeout, other=timeout))
    except CourseError:
        raise
    except Exception as err:  # noqa: BLE001 - e.g. no kernel: one line, not a traceback
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CourseError(f"{notebook}: the checks did not run ({type(err).__name__}: {first})") from None
    hint = None
    if hint_check:
        given = give_hint(report, hint_check, notebook.resolve().parent)
        if given is None:
            report.notes.append(f"no hint for {hint_check}: it did not fail in this run")
        else:
            hint = (hint_check, *given)
    if as_json:
        click.echo(report.to_json() if hint is None else json.dumps({**json.loads(report.to_json()), "hint": {
            "check": hint[0], "level": hint[2], "text": hint[1]}}))
    else:
        click.echo("\n".join(report_lines(report, hint)))
