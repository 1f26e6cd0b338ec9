"""Every lesson executes top to bottom, is committed clean, and really runs multi-rank jobs.

Lessons are found by glob, so a new ``lessons/*.ipynb`` is picked up without editing this file.
Execution happens once per session (``executed_lesson`` in conftest.py); the time is printed and
summarised at the end of the run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from lesson_output import stdout_of, world_sizes

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
COMMITTED = LESSONS + sorted((ROOT / "exercises").glob("**/*.ipynb"))
LAUNCHERS = {"run_ranks", "launch"}


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_there_are_lessons():
    assert LESSONS, "no lessons/*.ipynb found"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", LESSONS, ids=_ids)
def test_lesson_executes_top_to_bottom(path, executed_lesson):
    nb = executed_lesson(path.stem)  # raises CellExecutionError (with the cell) if any cell fails
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "some code cells did not run"


@pytest.mark.parametrize("path", COMMITTED, ids=_ids)
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{_ids(path)}: code cells {dirty} carry outputs or execution counts; "
                       "strip them (nbstripout --keep-id) before committing")


def _calls_launcher(source: str) -> bool:
    """Whether the cell itself (not a function it defines) calls course.run_ranks / course.launch."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False

    class Finder(ast.NodeVisitor):
        found = False

        def visit_FunctionDef(self, node):  # a definition runs nothing
            pass

        visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_FunctionDef

        def visit_Call(self, node):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in LAUNCHERS
                    and isinstance(func.value, ast.Name) and func.value.id == "course"):
                self.found = True
            self.generic_visit(node)

    finder = Finder()
    finder.visit(tree)
    return finder.found


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", LESSONS, ids=_ids)
def test_every_demo_records_a_multi_rank_run(path, executed_lesson):
    nb = executed_lesson(path.stem)
    everything = "".join(stdout_of(c) for c in nb.cells if c.cell_type == "code")
    sizes = world_sizes(everything)
    assert sizes, f"{path.name} printed no 'ran on world_size=N (backend=...)' line: no demo recorded a multi-rank run"
    assert min(sizes) >= 2, f"{path.name} recorded world sizes {sizes}: every demo needs >= 2 ranks"
    demos = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and _calls_launcher(c.source)]
    for i, cell in demos:
        text = stdout_of(cell)
        sizes = world_sizes(text)
        assert sizes, (f"{path.name} cell {i} runs ranks but prints no 'ran on world_size=N (backend=...)' line:\n"
                       f"{cell.source[:300]}")
        assert min(sizes) >= 2, f"{path.name} cell {i} recorded world sizes {sizes}: a demo needs >= 2 ranks"
