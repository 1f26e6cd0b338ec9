"""What must never reach students: solution code and hidden tests, and finding it in what they get.

A *secret line* is a line inside a ``### BEGIN SOLUTION`` / ``### BEGIN HIDDEN
TESTS`` region of a source notebook that appears nowhere outside such regions
(so ``import torch`` in a solution is not a secret when the visible code has it
too, nor is a line the instructions quote on purpose). A student copy or a feedback page that contains a secret line, or a
region marker, leaks.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course.grading.cells import HIDDEN_MARKERS

SOLUTION = ("BEGIN SOLUTION", "END SOLUTION")
HIDDEN_TESTS = HIDDEN_MARKERS
#: what nbgrader writes in place of a solution (ClearSolutions' stubs): never a secret
_STUB_LINES = {"# YOUR CODE HERE", "raise NotImplementedError()", "YOUR ANSWER HERE"}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TAG = re.compile(r"<[^>]+>")


def _is_marker(line: str, marker: str) -> bool:
    return marker in line  # nbgrader's own rule (ClearSolutions, ClearHiddenTests)


def split_regions(source: str, markers: tuple[str, str]) -> tuple[list[str], list[str]]:
    """(lines inside the marked regions, markers included; lines outside) of one cell's source."""
    begin, end = markers
    inside, outside, depth = [], [], 0
    for line in source.splitlines():
        if _is_marker(line, begin):
            depth += 1
            inside.append(line)
        elif _is_marker(line, end) and depth:
            depth -= 1
            inside.append(line)
        else:
            (inside if depth else outside).append(line)
    return inside, outside


def is_meaningful(line: str) -> bool:
    text = line.strip()
    return len(text) >= 4 and any(ch.isalnum() for ch in text) and text not in _STUB_LINES


@dataclass
class Secrets:
    """The secret lines of one source notebook, by kind."""

    solution: set[str]
    hidden_tests: set[str]

    @property
    def all(self) -> set[str]:
        return self.solution | self.hidden_tests


def secrets_of(source_nb) -> Secrets:
    """Secret lines (stripped) of a source notebook (a NotebookNode or a path)."""
    if not hasattr(source_nb, "cells"):
        source_nb = nbformat.read(str(source_nb), as_version=4)
    solution, hidden, public = set(), set(), set()
    for cell in source_nb.cells:
        sol_in, rest = split_regions(cell.source, SOLUTION)
        hid_in, rest = split_regions("\n".join(rest), HIDDEN_TESTS)
        # a hidden-test region inside a solution region is still hidden; count it once
        hid_in_sol, sol_only = split_regions("\n".join(sol_in), HIDDEN_TESTS)
        solution.update(line.strip() for line in sol_only)
        hidden.update(line.strip() for line in hid_in + hid_in_sol)
        public.update(line.strip() for line in rest)
    markers = (*SOLUTION, *HIDDEN_TESTS)  # reported on their own by markers_in

    public_text = "\n".join(public)  # a line quoted in visible text (a hint in markdown) is no secret

    def keep(lines):
        return {line for line in lines if is_meaningful(line) and line not in public_text
                and not any(m in line for m in markers)}

    return Secrets(solution=keep(solution), hidden_tests=keep(hidden))


def plain_text(text: str) -> str:
    """``text`` without ANSI colour codes, HTML tags and entities (what a reader of it sees)."""
    return html.unescape(_TAG.sub("", _ANSI.sub("", text)))


def find_in_text(text: str, secrets: set[str]) -> list[str]:
    """The secret lines that occur in ``text`` (checked line by line, after :func:`plain_text`)."""
    lines = [line.strip() for line in plain_text(text).splitlines()]
    found = {s for s in secrets for line in lines if s in line}
    return sorted(found)


def markers_in(text: str) -> list[str]:
    """Region markers (``BEGIN SOLUTION``, ``END HIDDEN TESTS``, ...) present in ``text``."""
    text = plain_text(text)
    return [m for m in (*SOLUTION, *HIDDEN_TESTS) if m in text]


def notebook_text(nb) -> str:
    """Every character a student sees in a notebook: cell sources and outputs."""
    parts = []
    for cell in nb.cells:
        parts.append(cell.source)
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.extend("\n".join(v) if isinstance(v, list) else str(v) for v in output.get("data", {}).values())
            parts.extend(output.get("traceback", []))
    return "\n".join(parts)


def student_copy_leaks(source_path: Path, student_path: Path) -> list[str]:
    """Problems that make a generated student copy unsafe to hand out; empty when it is clean."""
    return notebook_leaks(secrets_of(source_path), nbformat.read(str(student_path), as_version=4))


def notebook_leaks(secrets: Secrets, student) -> list[str]:
    """Problems of a student copy (a NotebookNode) given its source's :class:`Secrets`; empty when it is clean."""
    text = notebook_text(student)
    problems = [f"region marker {m!r} left in" for m in markers_in(text)]
    problems += [f"solution line left in: {line!r}" for line in find_in_text(text, secrets.solution)]
    problems += [f"hidden test line left in: {line!r}" for line in find_in_text(text, secrets.hidden_tests)]
    outputs = sum(len(cell.get("outputs", [])) for cell in student.cells)
    if outputs:
        problems.append(f"{outputs} cell output(s) left in (they can show solution results)")
    return problems
