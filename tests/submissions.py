"""Build student copies of the exercises for tests, and grade them.

A wrong submission is the source notebook with one answer cell changed, written
where a student's copy would be, under its source's file name (nbgrader matches
copies by name)::

    nb = submissions.patch_answer(submissions.load("ex2-ddp-basics"), "ex2_train",
                                  "loader.sampler.set_epoch(epoch)", "pass")
    path = submissions.write(nb, tmp_path, "ex2-ddp-basics")
    report = submissions.grade(path)          # in this process: fast, shares the warm rank pool
    assert submissions.scores(report) == {...}

:func:`release` makes the student copy with nbgrader's own ``generate_assignment``.
An assignment with several notebooks (ex2 has ``ddp_basics`` and ``ddp_in_practice``) is named
with ``notebook=`` (the file stem) wherever a function takes it; without it, the assignment's main
notebook is meant: its only one, or the one named after the assignment (``ex2-ddp-basics`` ->
``ddp_basics.ipynb``)::

    nb = submissions.load("ex2-ddp-basics", notebook="ddp_in_practice")
    path = submissions.write(nb, tmp_path, "ex2-ddp-basics", notebook="ddp_in_practice")

Everything here is stable API for every exercise's tests.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"


def notebooks(assignment: str) -> list[str]:
    """The notebook names (file stems) of ``assignment``'s sources, sorted."""
    return sorted(p.stem for p in (EXERCISES / assignment).glob("*.ipynb"))


def source_path(assignment: str, notebook: str | None = None) -> Path:
    """The source notebook ``exercises/<assignment>/<notebook>.ipynb``.

    Without ``notebook``: the assignment's only notebook, or, when it has several, the one named
    after the assignment (its name without the ``exN-`` prefix, ``-`` as ``_``)."""
    folder = EXERCISES / assignment
    names = notebooks(assignment)
    if notebook is None:
        main = re.sub(r"^ex\d+-", "", assignment).replace("-", "_")
        if len(names) == 1:
            notebook = names[0]
        elif main in names:
            notebook = main
        else:
            raise FileNotFoundError(f"{folder} has {len(names)} notebooks ({', '.join(names) or 'none'}) and none "
                                    f"named {main}.ipynb: say which with notebook=")
    if notebook not in names:
        raise FileNotFoundError(f"no notebook {notebook}.ipynb in {folder} (found: {', '.join(names) or 'none'})")
    return folder / f"{notebook}.ipynb"


def load(assignment: str, notebook: str | None = None) -> NotebookNode:
    """A fresh in-memory copy of a source notebook of ``assignment`` (solutions and hidden tests included)."""
    return nbformat.read(str(source_path(assignment, notebook)), as_version=4)


def _cell(nb: NotebookNode, grade_id: str) -> NotebookNode:
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id:
            return cell
    raise KeyError(f"no cell with grade_id {grade_id!r}")


def answer_ids(nb: NotebookNode) -> list[str]:
    """The grade_ids of the answer (solution) cells, in order."""
    return [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]


def answer(nb: NotebookNode, grade_id: str) -> str:
    """The text of an answer cell."""
    return _cell(nb, grade_id).source


def answer_function(assignment: str, notebook: str, grade_id: str, function: str, name: str, namespace: dict,
                    *edits: tuple[str, str]):
    """The function ``function`` of the notebook's answer cell ``grade_id``, with ``edits`` (old, new) applied to the
    cell's text, defined in ``namespace`` (the names the notebook's first cell imports, and the calling module's
    ``__name__``, so that cloudpickle sends it by value to the ranks) and renamed ``name``."""
    text = answer(load(assignment, notebook), grade_id)
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    namespace = dict(namespace)
    exec(compile(text, f"<{name}>", "exec"), namespace)  # noqa: S102 - the course's own reference
    fn = namespace[function]
    fn.__name__ = fn.__qualname__ = name
    return fn


def replace_answer(nb: NotebookNode, grade_id: str, text: str) -> NotebookNode:
    """A copy of ``nb`` whose answer cell ``grade_id`` holds ``text`` (the whole cell)."""
    nb = copy.deepcopy(nb)
    cell = _cell(nb, grade_id)
    if not cell.metadata["nbgrader"].get("solution"):
        raise ValueError(f"{grade_id!r} is not an answer cell")
    cell.source = text.strip("\n")
    return nb


def patch_answer(nb: NotebookNode, grade_id: str, old: str, new: str, count: int = 1) -> NotebookNode:
    """A copy of ``nb`` with ``old`` replaced by ``new`` in answer cell ``grade_id``.

    ``old`` must occur exactly ``count`` times (so a test breaks loudly when the solution changes).
    """
    text = answer(nb, grade_id)
    found = text.count(old)
    if found != count:
        raise ValueError(f"{old!r} occurs {found} times in answer {grade_id!r}, expected {count}:\n{text}")
    return replace_answer(nb, grade_id, text.replace(old, new))


def write(nb: NotebookNode, folder: str | Path, assignment: str, notebook: str | None = None) -> Path:
    """Write ``nb`` as ``folder/<assignment>/<source file name>`` (a student's copy) and return the path."""
    path = Path(folder) / assignment / source_path(assignment, notebook).name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def release(assignment: str, course_dir: str | Path, notebook: str | None = None) -> Path:
    """The student copy made by ``nbgrader generate_assignment`` in ``course_dir`` (created as needed).

    Copies the source into ``course_dir/source/<assignment>/``, runs nbgrader there (it releases
    every notebook of the assignment) and returns ``course_dir/release/<assignment>/<notebook>``.
    Takes ~5-10 s (nbgrader's startup).
    """
    course_dir = Path(course_dir)
    target = course_dir / "source" / assignment
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(EXERCISES / assignment, target)
    proc = subprocess.run(
        [sys.executable, "-m", "nbgrader", "generate_assignment", assignment, "--force"],
        cwd=course_dir, capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nbgrader generate_assignment {assignment} failed:\n{proc.stdout}\n{proc.stderr}")
    return course_dir / "release" / assignment / source_path(assignment, notebook).name


def grade(path: str | Path, *, in_process: bool = True, test_timeout: float = 300, timeout: float = 60):
    """Grade the notebook at ``path`` with :func:`course.grading.grade.grade_notebook` (in this process by default)."""
    from course.grading.grade import grade_notebook
    from course.grading.notebook import Timeouts

    return grade_notebook(path, exercises=EXERCISES, in_process=in_process,
                          timeouts=Timeouts(test=test_timeout, other=timeout))


def scores(report) -> dict[str, float]:
    """{grade_id: score} of a GradeReport (or of its JSON as a dict)."""
    tests = report["tests"] if isinstance(report, dict) else [vars(t) for t in report.tests]
    return {t["id"]: t["score"] for t in tests}


def messages(report) -> dict[str, str]:
    """{grade_id: message} of a GradeReport (or of its JSON as a dict): what the test cell shows (a failed check's
    level 1), then the check's message at its last hint level (the idea, the lesson section and what to try), so a
    test can name any word of the diagnosis; tests/test_hints.py holds what each level shows."""
    tests = report["tests"] if isinstance(report, dict) else [vars(t) for t in report.tests]
    levels = report.get("hints", {}) if isinstance(report, dict) else report.hints
    return {t["id"]: t["message"] + (f"\n{levels[t['id']][-1]}" if levels.get(t["id"]) else "") for t in tests}


def full_marks(assignment: str, notebook: str | None = None) -> dict[str, float]:
    """{grade_id: points} of every test cell of ``assignment``'s source (its ``notebook``)."""
    return {c.metadata["nbgrader"]["grade_id"]: float(c.metadata["nbgrader"]["points"])
            for c in load(assignment, notebook).cells if c.metadata.get("nbgrader", {}).get("grade")}


def losing(assignment: str, *grade_ids: str, notebook: str | None = None) -> dict[str, float]:
    """The scores expected when exactly the test cells ``grade_ids`` fail: 0 there, full marks elsewhere."""
    expected = full_marks(assignment, notebook)
    for gid in grade_ids:
        if gid not in expected:
            raise KeyError(f"{assignment} has no test cell {gid!r}")
        expected[gid] = 0.0
    return expected


def fails(check, subject, *words, **kwargs) -> str:
    """Run ``check(subject, **kwargs)``; assert it fails naming the check and each of ``words``; the message."""
    import pytest

    from course.checks import CheckFailed

    with pytest.raises(CheckFailed) as info:
        check(subject, **kwargs)
    message = str(info.value)
    assert message.startswith(f"FAILED {check.__name__}"), message
    for word in words:
        assert word in message, f"{word!r} not in:\n{message}"
    return message


def grade_edited(assignment: str, folder: str | Path, *edits: tuple[str, str, str], notebook: str | None = None):
    """Grade the source notebook with each ``(answer grade_id, old text, new text[, count])`` edit applied."""
    nb = load(assignment, notebook)
    for grade_id, old, new, *count in edits:
        nb = patch_answer(nb, grade_id, old, new, *count)
    return grade(write(nb, folder, assignment, notebook))


def assert_loses_exactly(report, assignment: str, failing: list[str], words: list[str],
                         notebook: str | None = None) -> None:
    """Exactly the test cells ``failing`` lost their points, each with a FAILED message; the first
    names every one of ``words`` (later ones may defer to it)."""
    assert_mistakes_lose_exactly(report, assignment, [(failing, words)], notebook)


def assert_mistakes_lose_exactly(report, assignment: str, mistakes: list[tuple[list[str], list[str]]],
                                 notebook: str | None = None) -> None:
    """One submission holding several independent mistakes, each ``(failing test cells, words)``: exactly the
    union of their cells lost its points, each with a FAILED message, and each mistake's first cell names its
    words. The mistakes must fail disjoint cells (:func:`disjoint_mistakes`), so no message can stand for another's."""
    got = messages(report)
    union = [gid for failing, _ in mistakes for gid in failing]
    assert scores(report) == losing(assignment, *union, notebook=notebook), got
    assert all(got[gid].startswith("FAILED check_") for gid in union), got
    for failing, words in mistakes:
        for word in words:
            assert word in got[failing[0]], f"{word!r} not in the message of {failing[0]}:\n{got[failing[0]]}"


def grade_mistakes(assignment: str, folder: str | Path, cell: str, wrong: dict, group, notebook: str | None = None):
    """Grade the source with every mistake of ``group`` (names in ``wrong``: name -> (edits of the answer cell
    ``cell``, failing cells, words)) applied, and assert it loses exactly their cells, each naming its words."""
    in_cell = {name: ([(cell, old, new) for old, new in wrong[name][0]], *wrong[name][1:]) for name in group}
    grade_packed(assignment, folder, in_cell, group, notebook)


def pack(mistakes: dict) -> list[tuple[str, ...]]:
    """Mistakes (name: (edits, failing test cells, words), each edit ``(answer cell, old, new[, count])``) packed
    into submissions graded together: a group never holds two mistakes in the same answer cell (no two wrong
    pieces of one function, which could mask or add to each other) nor two that fail the same test cell, so
    each grade judges several mistakes and each must still lose exactly its own cells. Greedy, in order."""
    groups: list[list[str]] = []
    for name, (edits, failing, _) in mistakes.items():
        cells = {edit[0] for edit in edits}
        for group in groups:
            if not any(cells & {e[0] for e in mistakes[other][0]} or set(failing) & set(mistakes[other][1])
                       for other in group):
                group.append(name)
                break
        else:
            groups.append([name])
    return [tuple(group) for group in groups]


def grade_packed(assignment: str, folder: str | Path, mistakes: dict, group, notebook: str | None = None) -> None:
    """Grade the source with every mistake of ``group`` (see :func:`pack`) applied, and assert it loses exactly
    their cells, each naming its words."""
    report = grade_edited(assignment, folder, *(edit for name in group for edit in mistakes[name][0]), notebook=notebook)
    assert_mistakes_lose_exactly(report, assignment, [mistakes[name][1:] for name in group], notebook)


def disjoint_mistakes(groups, wrong: dict) -> None:
    """Every mistake of ``wrong`` (name: (edits, failing cells, words)) is in exactly one group of ``groups``,
    and the mistakes of a group fail disjoint test cells and edit different text."""
    named = [name for group in groups for name in group]
    assert sorted(named) == sorted(wrong), "every wrong submission graded exactly once"
    for group in groups:
        cells = [gid for name in group for gid in wrong[name][1]]
        assert len(cells) == len(set(cells)), f"{group}: two mistakes fail the same test cell"
        olds = [old for name in group for old, _ in wrong[name][0]]
        assert not any(a in b for a in olds for b in olds if a is not b), f"{group}: two mistakes edit the same text"


def untouched_student_copy(assignment: str, folder: str | Path, notebook: str | None = None) -> Path:
    """Release ``assignment`` (asserting the copy leaks no solution or hidden test) and hand in its
    ``notebook`` unanswered."""
    from course.instructor.leaks import student_copy_leaks

    folder = Path(folder)
    released = release(assignment, folder / "course", notebook)
    assert student_copy_leaks(source_path(assignment, notebook), released) == []
    student = folder / "student" / assignment / released.name
    student.parent.mkdir(parents=True)
    student.write_bytes(released.read_bytes())
    return student


def assert_reference_full_marks(assignment: str, notebook: str | None = None):
    """Grade the source notebook (the reference solution, hidden tests included): every test cell at full marks.
    The report."""
    report = grade(source_path(assignment, notebook))
    assert scores(report) == full_marks(assignment, notebook), messages(report)
    return report


def assert_untouched_scores_zero(assignment: str, folder: str | Path, notebook: str | None = None):
    """Grade the released copy handed in unanswered: 0 of the full points, every test cell saying "is not
    written yet", with no traceback and no grader path. The report."""
    report = grade(untouched_student_copy(assignment, folder, notebook))
    assert report.score == 0 and report.max_score == sum(full_marks(assignment, notebook).values())
    for t in report.tests:
        assert "is not written yet" in t.message, t
        assert "Traceback" not in t.message and "graders/" not in t.message, t
    return report
