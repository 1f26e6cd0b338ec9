"""Rules every exercise notebook keeps (issue 13): no graded property is hidden from the student.

Every graded test cell runs at least one check in its visible part (what the student's copy keeps
after nbgrader removes the hidden block), and a hidden block only calls checks that the visible part
of the same cell calls too: hidden tests vary world sizes, data, seeds and timings, never what is judged.
(A hidden block may also hold arguments of a visible call: the autograder then runs that check on another
story in place of the visible one, as exercise 4's elastic part does.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from course.grading.cells import HIDDEN_BEGIN, HIDDEN_END

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "exercises").glob("*/*.ipynb"))


def _graded_cells(path: Path):
    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            yield meta["grade_id"], cell.source


def _split(source: str) -> tuple[str, str]:
    pattern = re.compile(rf"^[ \t]*#+[ \t]*{re.escape(HIDDEN_BEGIN)}.*?^[ \t]*#+[ \t]*{re.escape(HIDDEN_END)}[^\n]*\n?", re.S | re.M)
    hidden = "\n".join(m.group(0) for m in pattern.finditer(source))
    return pattern.sub("", source), hidden


def _checks_called(source: str) -> set[str]:
    lines = [line for line in source.splitlines() if not line.strip().startswith("###")]
    found = set()
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.rsplit(".", 1)[-1].startswith("check_"):
                found.add(name)
    return found


def test_there_are_exercise_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_graded_property_has_a_visible_check(path):
    cells = list(_graded_cells(path))
    assert cells, f"{path.name} has no graded test cell"
    for grade_id, source in cells:
        visible, _ = _split(source)
        shown = _checks_called(visible)
        assert shown, f"{path.name}:{grade_id} runs its checks only in hidden tests:\n{source}"
        # the whole cell as the autograder runs it: a hidden block may add calls or only arguments of a visible call
        secret = _checks_called(source) - shown
        assert not secret, f"{path.name}:{grade_id}: the hidden tests call {sorted(secret)}, the visible part never"


def test_the_rule_catches_a_hidden_only_cell():
    visible, hidden = _split(f"### {HIDDEN_BEGIN}\ngraders.parallelism.check_shard_sizes(shard_batch)\n### {HIDDEN_END}\n")
    assert not _checks_called(visible) and _checks_called(hidden) == {"graders.parallelism.check_shard_sizes"}
    visible, hidden = _split(f"graders.parallelism.check_shards(f)\n### {HIDDEN_BEGIN}\ngraders.parallelism.check_shard_sizes(f)\n"
                             f"### {HIDDEN_END}\n")
    assert _checks_called(hidden) - _checks_called(visible) == {"graders.parallelism.check_shard_sizes"}


# -- issue 27: an exercise asks for a result, it never shows the code of its answer ---------------------------

import importlib.util  # noqa: E402
import sys  # noqa: E402

_spec = importlib.util.spec_from_file_location("transcription", ROOT / "benchmarks" / "transcription.py")
transcription = sys.modules.setdefault("transcription", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(transcription)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name + "/" + p.name)
def test_the_instructions_give_no_line_of_the_solution(path):
    """No code span or code block of the notebook's markdown holds a substantial line of its reference
    solution, nor most of one (a call to copy): `python benchmarks/transcription.py -v` shows them."""
    given = transcription.measure(path).in_instructions
    assert not given, f"{path.name}: the instructions give away solution lines:\n" + "\n".join(
        f"  solution line {line!r} <- instructions `{span}`" for line, span in given)


def test_the_transcription_rule_catches_a_given_call():
    spans = [transcription.normalise("DistributedSampler(dataset, num_replicas=world_size, rank=rank)")]
    line = transcription.normalise("sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)")
    assert transcription.given_by(line, spans)
    assert not transcription.given_by(transcription.normalise("loader = DataLoader(dataset, sampler=sampler)"), spans)
    # a short span (a name the instructions must say) gives nothing away
    assert not transcription.given_by(line, [transcription.normalise("DistributedSampler")])
    # shape: local names, numbers and strings are placeholders, attributes are kept
    assert transcription.shape("dist.all_reduce(grad, op=dist.ReduceOp.SUM)") == transcription.shape(
        "dist.all_reduce(p, op=dist.ReduceOp.SUM)")
    assert transcription.shape("dist.all_reduce(p)") != transcription.shape("dist.broadcast(p)")
    # a docstring is prose: every lone string has one shape, so it would match any string of a lesson
    assert not transcription.substantial(transcription.normalise('"""Write it atomically: never half a file."""'))
    assert transcription.substantial(transcription.normalise('path = "checkpoints/final.pt"'))


#: the course-wide ceilings of issue 27 (the reviewer's measure: benchmarks/transcription.py): the share of the
#: reference solutions' substantial lines a student finds in a lesson or the instructions, as they are or with
#: other names
MAX_VERBATIM, MAX_SAME_SHAPE = 0.10, 0.30


def test_the_solutions_are_mostly_not_in_the_lessons():
    """At most 10% of all solution lines are verbatim in a lesson or the instructions, at most 30% verbatim or
    of the same shape: the exercises ask for what the lessons did not show."""
    lessons = transcription.lesson_code()
    lines = verbatim = same = 0
    for path in NOTEBOOKS:
        figures = transcription.measure(path, lessons)
        lines, verbatim, same = (lines + figures.lines, verbatim + len(figures.verbatim),
                                 same + len(figures.same_shape))
    assert lines > 200  # the measure reads the solutions
    assert verbatim <= MAX_VERBATIM * lines, f"{verbatim} of {lines} solution lines are verbatim in the lessons"
    assert verbatim + same <= MAX_SAME_SHAPE * lines, (
        f"{verbatim + same} of {lines} solution lines are in the lessons, as they are or with other names")


def _points(path: Path) -> float:
    nb = nbformat.read(str(path), as_version=4)
    return sum(c.metadata["nbgrader"].get("points", 0) for c in nb.cells
               if c.metadata.get("nbgrader", {}).get("grade") and not c.metadata["nbgrader"].get("solution"))


@pytest.mark.parametrize("folder", sorted({p.parent for p in NOTEBOOKS}), ids=lambda p: p.name)
def test_a_stated_exercise_total_is_the_sum_of_its_notebooks_points(folder):
    """A notebook that says "(exercise N: T points ...)" counts every graded cell of its exercise's notebooks."""
    total = sum(_points(p) for p in NOTEBOOKS if p.parent == folder)
    for path in (p for p in NOTEBOOKS if p.parent == folder):
        intro = nbformat.read(str(path), as_version=4).cells[0].source
        for stated in re.findall(r"\(exercise \d+: (\d+) points", intro):
            assert int(stated) == total, f"{path.name} says exercise total {stated}, its notebooks hold {total}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name + "/" + p.name)
def test_a_notebook_that_writes_files_leaves_the_sources_first(path):
    """Run in place (an instructor trying the reference), a cell that writes a file would leave a reference
    solution among the sources: a locked cell before the first such cell calls leave_the_sources()."""
    cells = nbformat.read(str(path), as_version=4).cells
    writes = [i for i, c in enumerate(cells) if c.cell_type == "code" and re.match(r"\s*%%writefile", c.source)]
    if not writes:
        return
    moves = [i for i, c in enumerate(cells[: writes[0]]) if c.cell_type == "code"
             and c.metadata.get("nbgrader", {}).get("locked") and re.search(r"^leave_the_sources\(\)", c.source, re.M)]
    assert moves, f"{path.name}: cell {writes[0] + 1} writes a file but no locked cell before it calls leave_the_sources()"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_check_a_test_cell_calls_is_defined_where_the_call_names_it(path):
    """The verifier re-runs only a check defined in the package the call names (``graders.ddp_basics``: in one of
    its own modules; a name imported there from elsewhere is refused: course/grading/verifier.py), so moving a check
    out of its notebook's package breaks its cell in grading."""
    import importlib

    from course.grading import checkcalls

    for cell in nbformat.read(str(path), as_version=4).cells:
        calls = checkcalls.parse(cell.source) if cell.cell_type == "code" else None
        for call in calls or []:
            fn = getattr(importlib.import_module(call.module), call.function, None)
            assert callable(fn) and fn.__module__.startswith(call.module + "."), f"{path.name}: {call.module}.{call.function}"


# --- points follow the work (the authoring guide's rule; tests/effort.py) ------------------------------------------

import effort  # noqa: E402


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name + "/" + p.name)
def test_each_parts_points_follow_the_work_it_takes(path):
    """A part is worth its estimated minutes over 5, within a point (effort.py: reading, writing the reference's
    lines, running its checks, 5 minutes an idea, each named), and every test cell at least 1."""
    parts = effort.parts(path)
    assert len(parts) == len(effort.IDEAS.get(path.stem, [])), (
        f"{path.name}: name the ideas of each of its {len(parts)} parts in tests/effort.py's IDEAS")
    for part in parts:
        assert part.ideas and part.checks and part.lines, (path.name, part.title)
        assert all(points >= 1 for _, points in part.checks), (path.name, part.title)
        assert abs(part.points - part.minutes / effort.MINUTES_PER_POINT) <= 1, (
            f"{path.name} {part.title!r}: {part.points:g} points for about {part.minutes:.0f} minutes of work "
            f"(the rule: {part.rule_points})")


def _split_text(part) -> str:
    """A part's cells' points in order, as its heading and its row of the table write them: "3 + 2"."""
    return " + ".join(f"{p:g}" for _, p in part.checks)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name + "/" + p.name)
def test_a_notebook_states_its_points_and_minutes_as_its_cells_hold_them(path):
    """What a student reads before starting: each part's heading gives its cells' points in order and about how
    long it takes (within 5 minutes of the estimate); the introduction gives the notebook's total and minutes;
    its table of parts gives each part's points."""
    cells = nbformat.read(str(path), as_version=4).cells
    parts = effort.parts(path)
    for part in parts:
        if part.title.startswith("Part"):
            stated = re.search(r"\((.*), about (\d+) minutes\)$", part.title)
            assert stated, f"{path.name}: {part.title!r} does not say its points and minutes"
            words = _split_text(part) + (" point" if part.points == 1 else " points")
            assert stated.group(1) == words, (part.title, words)
            assert abs(int(stated.group(2)) - part.minutes) <= 5, (part.title, round(part.minutes))
    intro = cells[0].source
    total = sum(part.points for part in parts)
    assert re.search(rf"\*\*(Total: )?{total:g} points\b", intro), f"{path.name}: the introduction's total is not {total:g}"
    minutes = re.search(r"[Aa]bout (\d+) minutes", intro)
    assert minutes and abs(int(minutes.group(1)) - sum(p.minutes for p in parts)) <= 5 * len(parts), path.name
    rows = {int(m.group(1)): m.group(2) for c in cells if c.cell_type == "markdown"
            for m in re.finditer(r"^\| (\d) \|.*\| ([\d +]+) \|$", c.source, re.M)}
    for number, part in enumerate(parts, 1):
        if number in rows:
            assert rows[number] == _split_text(part), (path.name, number, rows[number])


def test_the_rules_fail_points_that_do_not_follow_the_work(tmp_path):
    """Both rules can fail: part 3 of exercise 1 given its old 3 points (about 35 minutes of work: 7)."""
    nb = nbformat.read(str(ROOT / "exercises/ex1-parallelism/parallelism.ipynb"), as_version=4)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "ex1_test_two_stage":
            cell.metadata["nbgrader"]["points"] = 3
    copy = tmp_path / "parallelism.ipynb"
    nbformat.write(nb, str(copy))
    with pytest.raises(AssertionError, match="3 points for about 3[45] minutes"):
        test_each_parts_points_follow_the_work_it_takes(copy)
    with pytest.raises(AssertionError):
        test_a_notebook_states_its_points_and_minutes_as_its_cells_hold_them(copy)
