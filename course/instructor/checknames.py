"""What each graded test cell checks, in a few words, for tables and feedback pages (not only its grade id).

A test cell of the course calls a check, ``graders.ex2.check_sampler(make_loader)``: its description is the
first sentence of that check's docstring, read from the source with :mod:`ast` (nothing is imported or run).
Another test cell (an instructor's own ``assert``) is described by its first comment line, else its first line.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import nbformat

from course.instructor.leaks import HIDDEN_TESTS

_CHECK_CALL = re.compile(r"^\s*(graders\.\w+)\.(check_\w+)\s*\(", re.MULTILINE)


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    match = re.search(r"(?<=[.!?])\s(?=[A-Z`(])", paragraph)
    return paragraph[: match.start()] if match else paragraph


@cache
def _docstrings(module: str) -> dict[str, str]:
    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / f"{module.split('.', 1)[1]}.py"
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text())
    return {n.name: ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.FunctionDef)}


def describe_cell(source: str) -> str:
    """A short description of a test cell (its visible part: hidden tests are never read)."""
    begin, _ = HIDDEN_TESTS
    visible = source.split(begin)[0]
    call = _CHECK_CALL.search(visible)
    if call:
        doc = _docstrings(call.group(1)).get(call.group(2))
        if doc:
            return first_sentence(doc)
    lines = [line.strip() for line in visible.splitlines() if line.strip()]
    comments = [line.lstrip("# ").strip() for line in lines if line.startswith("#") and line.lstrip("# ").strip()]
    return comments[0] if comments else (lines[0] if lines else "")


def describe_notebook(path: Path | str) -> dict[str, str]:
    """{grade_id: description} for every graded test cell of a notebook."""
    nb = nbformat.read(str(path), as_version=4)
    found = {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution") and cell.cell_type == "code":
            found[meta["grade_id"]] = describe_cell(cell.source)
    return found
