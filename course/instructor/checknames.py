"""What each graded test cell checks, in a few words, for tables and feedback pages (not only its grade id).

The first that applies: the cell's own first comment line (``# every rank ...``, an instructor's words); the
docstring's first paragraph of the check the cell calls (``graders.ex1.check_shards(...)``, read from the grader's
source with :mod:`ast`, never imported); the message of the cell's first ``assert`` that has one; its first
``assert``; its first line. Hidden tests are never read.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from functools import cache
from pathlib import Path


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, stripped."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def describe_cell(source: str) -> str:
    """What a test cell checks, in a line (see :func:`check_descriptions`)."""
    from course.grading.checkcalls import hidden_lines, parse

    hidden = hidden_lines(source)
    visible = "\n".join(line for number, line in enumerate(source.splitlines(), 1) if number not in hidden)
    for line in visible.splitlines():
        text = line.strip()
        if text.startswith("#") and not text.startswith("###") and text.lstrip("# ").strip():
            return text.lstrip("# ").strip()
    for call in parse(visible) or []:
        doc = check_docstring(call.module, call.function)
        if doc:
            return doc
    try:
        tree = ast.parse(visible)
    except SyntaxError:
        tree = None
    asserts = [node for node in ast.walk(tree) if isinstance(node, ast.Assert)] if tree else []
    for node in asserts:
        if isinstance(node.msg, ast.Constant) and isinstance(node.msg.value, str):
            return node.msg.value
    if asserts:
        return first_line(ast.get_source_segment(visible, asserts[0]) or "") or first_line(visible)
    return first_line(visible)


@cache
def check_docstring(module: str, function: str) -> str:
    """The first sentence (first paragraph, one line) of ``module.function``'s docstring, read from its source."""
    try:
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text()) if spec and spec.origin else None
    except (ImportError, ValueError, OSError, SyntaxError):
        return ""
    for node in tree.body if tree else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            doc = ast.get_docstring(node) or ""
            paragraph = doc.split("\n\n")[0]
            return " ".join(paragraph.split())
    return ""


def describe_notebook(path: Path | str) -> dict[str, str]:
    """{grade_id: description} for every graded test cell of a notebook (unreadable: none)."""
    try:
        nb = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    found = {}
    for cell in nb.get("cells", []):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") == "code" and meta.get("grade") and meta.get("grade_id") and not meta.get("solution"):
            source = cell.get("source", "")
            found[meta["grade_id"]] = describe_cell("".join(source) if isinstance(source, list) else source)
    return found
