"""What each graded test cell checks, in a few words, for tables and feedback pages (not only its grade id).

The first that applies: the cell's own first comment line (``# every rank ...``, an instructor's words); the
docstring's first paragraph of the check the cell calls (``graders.parallelism.check_shards(...)``, read from the grader's
source with :mod:`ast`, never imported); the message of the cell's first ``assert`` that has one; its first
``assert``; its first line. Hidden tests are never read.

A description keeps its reST code spans (````code````, ```code```, ``:func:`name```) as written; each view renders
them (:func:`as_rich` for the terminal, :func:`as_html` for pages, :func:`as_plain`), so none shows raw backticks.
"""

from __future__ import annotations

import ast
import html
import importlib.util
import json
import re
from functools import cache
from pathlib import Path
from typing import NamedTuple


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
    for node in tree.body if tree else ():  # a notebook's package (graders.ddp_basics): EXPORTS names the module
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["EXPORTS"] \
                or isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "EXPORTS":
            try:
                home = ast.literal_eval(node.value).get(function)
            except (ValueError, TypeError, SyntaxError, AttributeError):
                return ""
            return check_docstring(f"{module}.{home}", function) if isinstance(home, str) and home.isidentifier() else ""
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


# -- code spans: rendered by each view ------------------------------------------------------------------------------

#: reST inline code: ``literal``, `default role`, :role:`target` (``:func:`~a.b``` shows ``b()``)
_INLINE = re.compile(r"``(?P<literal>[^`]+?)``"
                     r"|(?<!`)(?::(?P<role>[A-Za-z][\w.+-]*(?::[\w.+-]+)?):)?`(?P<code>[^`]+)`(?!`)")
#: Sphinx shows a function's or method's name with parentheses
_CALLABLE_ROLES = {"func", "meth", "py:func", "py:meth"}
#: the style of a code span on the terminal
CODE_STYLE = "bold cyan"


class Span(NamedTuple):
    """A piece of a description: ``raw`` as written, ``shown`` as a reader sees it, ``code`` for a code span."""

    raw: str
    shown: str
    code: bool


def inline_spans(text: str) -> list[Span]:
    """``text`` cut into plain text and code spans (an unpaired backtick stays plain text)."""
    spans, at = [], 0
    for match in _INLINE.finditer(text):
        if match.start() > at:
            spans.append(Span(text[at:match.start()], text[at:match.start()], False))
        if match["literal"] is not None:
            shown = match["literal"]
        else:
            shown, role = match["code"], match["role"]
            if role:  # `title <target>` shows its title; ~a.b.c shows c
                titled = re.fullmatch(r"(.+?)\s*<[^<>]+>", shown, re.S)
                shown = titled[1] if titled else shown.removeprefix("~").rsplit(".", 1)[-1] if shown.startswith(
                    "~") else shown
                if role in _CALLABLE_ROLES and not titled and not shown.endswith(")"):
                    shown += "()"
        spans.append(Span(match[0], shown, True))
        at = match.end()
    if at < len(text):
        spans.append(Span(text[at:], text[at:], False))
    return spans


def as_plain(text: str) -> str:
    """A description as plain text: code spans without their backticks."""
    return "".join(span.shown for span in inline_spans(text))


def as_rich(text: str) -> str:
    """A description as rich console markup: the text escaped, code spans in :data:`CODE_STYLE`."""
    from rich.markup import escape

    return "".join(f"[{CODE_STYLE}]{escape(s.shown)}[/{CODE_STYLE}]" if s.code else escape(s.shown)
                   for s in inline_spans(text))


def as_html(text: str) -> str:
    """A description as HTML: the text escaped, code spans in ``<code>``."""
    return "".join(f"<code>{html.escape(s.shown)}</code>" if s.code else html.escape(s.shown)
                   for s in inline_spans(text))


def shorten(text: str, limit: int = 100) -> str:
    """A description's first sentence, at most ``limit`` characters as shown: cut at a word, never inside a code
    span, with "…" where a sentence was cut. Returned as written (render its code spans with ``as_*``)."""
    out, length = [], 0
    for span in inline_spans(text):
        if span.code:
            if length + len(span.shown) > limit:
                return "".join(out).rstrip(" ,;:") + "…"
            out.append(span.raw)
            length += len(span.shown)
            continue
        end = re.search(r"[.!?](?=\s+[A-Z(])", span.raw)  # a full stop a capital letter follows
        piece = span.raw[:end.end()] if end else span.raw
        if length + len(piece) > limit:
            room = limit - length
            head = piece[:room] if piece[room] == " " else piece[:room].rpartition(" ")[0]
            if not head.strip() and not out:  # one long word: cut inside it
                head = piece[:room]
            return ("".join(out) + head).rstrip(" ,;:") + "…"
        out.append(piece)
        length += len(piece)
        if end:
            break
    return "".join(out)
