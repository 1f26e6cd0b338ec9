"""Sample submissions, made at run time from an assignment's source and student copies.

For ``ddp-course demo`` and the tests: a student copy (from release/) with
some answers filled in from the source notebook's solutions. Nothing here holds
a solution; it only reads the instructor's source notebook, which is never part
of what students get.

Kinds:

* ``reference``: every answer is the source's solution;
* ``untouched``: the student copy as released;
* ``partial``: the first half of the answers solved, the rest left as released;
* ``mistakes``: the reference with typical DDP mistakes typed in (see :data:`MISTAKES`),
  wherever the solution has the line they change; ``partial`` when none applies;
* ``hang``: the reference, but rank 1 stalls forever in the first answer function that
  runs on ranks, so the other ranks wait in a collective: a deadlock.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course.instructor.leaks import SOLUTION

KINDS = ("reference", "untouched", "partial", "mistakes", "hang")
#: code that shows a function runs on ranks (it joins or uses a process group)
_RANK_CODE = re.compile(r"\bdist\.|init_process_group|DistributedDataParallel|\bDDP\(|torchrun")
_STALL = (
    "import os, time  # sample mistake: rank 1 never reaches the collective the others wait in\n"
    "if os.environ.get('RANK') == '1':\n"
    "    time.sleep(24 * 3600)\n"
)


@dataclass(frozen=True)
class Mistake:
    """A typical mistake as a line edit: lines matching ``pattern`` become ``replacement``; with ``block``, only a
    line whose indented block (the lines under it) matches ``block``, so the sample does what its name says."""

    name: str
    pattern: str
    replacement: str
    block: str | None = None

    def apply(self, text: str) -> str:
        if self.block is None:
            return re.sub(self.pattern, self.replacement, text, flags=re.MULTILINE)
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if not re.match(self.pattern, line.rstrip("\n")):
                continue
            indent = len(line) - len(line.lstrip())
            body = []
            for below in lines[i + 1:]:
                if below.strip() and len(below) - len(below.lstrip()) <= indent:
                    break
                body.append(below)
            if re.search(self.block, "".join(body)):
                lines[i] = re.sub(self.pattern, self.replacement, line.rstrip("\n")) + line[len(line.rstrip("\n")):]
        return "".join(lines)


MISTAKES = (
    Mistake("forgets sampler.set_epoch(epoch)", r"^(\s*)\S.*\.set_epoch\(.*$", r"\1pass  # (forgot set_epoch)"),
    Mistake("saves on every rank", r"^(\s*)if (?:rank|dist\.get_rank\(\)) == 0:[ \t]*(?:#.*)?$",
            r"\1if True:  # (every rank)", block=r"\bsave\w*\(|\.write|open\("),
    Mistake("saves the DDP wrapper's state dict", r"\.module\.state_dict\(\)", ".state_dict()"),
    Mistake("sums gradients without averaging", r"\s*/\s*(?:world_size|dist\.get_world_size\(\))\b", ""),
    Mistake("skips the barrier", r"^(\s*)dist\.barrier\(\)\s*$", r"\1pass  # (no barrier)"),
)


def solution_text(source: str) -> str:
    """A source cell's text with nbgrader's solution markers removed (the answer a perfect student types)."""
    begin, end = SOLUTION
    return "\n".join(line for line in source.splitlines() if begin not in line and end not in line)


def _answers(source_nb) -> dict[str, str]:
    return {
        cell.metadata["nbgrader"]["grade_id"]: solution_text(cell.source)
        for cell in source_nb.cells
        if cell.metadata.get("nbgrader", {}).get("solution")
    }


def _answer_cells(nb) -> list:
    return [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]


def _fill(release_nb, answers: dict[str, str], only: set[str] | None = None):
    nb = copy.deepcopy(release_nb)
    for cell in _answer_cells(nb):
        grade_id = cell.metadata["nbgrader"]["grade_id"]
        if grade_id in answers and (only is None or grade_id in only):
            cell.source = answers[grade_id]
    return nb


def apply_mistakes(text: str) -> tuple[str, list[str]]:
    """``text`` with every applicable mistake typed in; also the names of those applied."""
    applied = []
    for mistake in MISTAKES:
        new = mistake.apply(text)
        if new != text:
            applied.append(mistake.name)
            text = new
    return text, applied


def stall_rank_one(source: str) -> str | None:
    """``source`` with rank 1 stalling at the start of its first function that runs on ranks; None if none does."""
    lines = source.splitlines()
    magic = lines[:1] if lines and lines[0].startswith("%%") else []
    try:
        tree = ast.parse("\n".join(lines[len(magic):]))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _RANK_CODE.search(ast.unparse(node)):
            first = node.body[0]
            at = first.lineno - 1 + len(magic)
            indent = " " * first.col_offset
            stall = [indent + line for line in _STALL.splitlines()]
            return "\n".join(lines[:at] + stall + lines[at:])
    return None


def make_sample(kind: str, source_path: Path, release_path: Path):
    """A submission of ``kind`` (see the module doc) for one notebook; also a note on what it does."""
    source_nb = nbformat.read(str(source_path), as_version=4)
    release_nb = nbformat.read(str(release_path), as_version=4)
    answers = _answers(source_nb)
    ids = [c.metadata["nbgrader"]["grade_id"] for c in _answer_cells(release_nb)]
    if kind == "reference":
        return _fill(release_nb, answers), "the reference solution"
    if kind == "untouched":
        return copy.deepcopy(release_nb), "the student copy, unanswered"
    if kind == "partial":
        return _fill(release_nb, answers, set(ids[: (len(ids) + 1) // 2])), "first half of the answers only"
    if kind == "mistakes":
        edited, applied = {}, []
        for grade_id, text in answers.items():
            edited[grade_id], names = apply_mistakes(text)
            applied += [n for n in names if n not in applied]
        if applied:
            return _fill(release_nb, edited), "; ".join(applied)
        return _fill(release_nb, answers, set(ids[: (len(ids) + 1) // 2])), "first half of the answers only"
    if kind == "hang":
        for grade_id in ids:
            stalled = stall_rank_one(answers.get(grade_id, ""))
            if stalled is not None:
                return _fill(release_nb, {**answers, grade_id: stalled}), f"rank 1 stalls in {grade_id} (deadlock)"
        raise ValueError(f"{source_path.name}: no answer function runs on ranks, so it cannot deadlock")
    raise ValueError(f"unknown sample kind {kind!r}; one of {', '.join(KINDS)}")


def write_samples(course, students: dict[str, str], assignments: list[str], folder: Path) -> dict[tuple[str, str], str]:
    """Write ``<student>_<notebook>.ipynb`` into ``folder`` for each student (name -> kind) and assignment.

    Returns {(student, assignment): what the sample does} (for an assignment of several notebooks,
    what each does, by notebook). Collect files them like any LMS download.
    """
    folder.mkdir(parents=True, exist_ok=True)
    notes: dict[tuple[str, str], str] = {}
    for assignment in assignments:
        notebooks = course.notebooks(assignment)
        for notebook in notebooks:
            source = course.folder("source", assignment=assignment) / f"{notebook}.ipynb"
            release = course.folder("release", assignment=assignment) / f"{notebook}.ipynb"
            for student, kind in students.items():
                nb, note = make_sample(kind, source, release)
                nbformat.write(nb, str(folder / f"{student}_{notebook}.ipynb"))
                if len(notebooks) > 1:
                    note = "; ".join(filter(None, [notes.get((student, assignment)), f"{notebook}: {note}"]))
                notes[(student, assignment)] = note
    return notes
