"""Match a student's copy of an exercise with its source notebook, and put the locked cells back.

nbgrader's autograde does not trust a submission's test cells: it restores every
locked cell (visible and hidden tests, instructions, imports) from the source
and keeps only the students' answers. :func:`restore` does the same from the
source notebook itself (no gradebook needed), so that ``ddp-course grade`` scores
a copy exactly as autograde would, and a deleted, edited or duplicated test cell
cannot change the score.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from nbformat import NotebookNode
from nbgrader.utils import is_grade, is_locked, is_solution

from course.grading.notebook import NotebookError, read


@dataclass(frozen=True)
class GradedCell:
    """One autograded test cell of the source: its nbgrader grade_id and points."""

    grade_id: str
    points: float


def default_exercises_dir() -> Path:
    """The course's ``exercises/`` folder (a checkout, or $DDP_COURSE_ROOT/exercises)."""
    from course.paths import course_root

    return course_root() / "exercises"


def _grade_id(cell: NotebookNode) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def find_source(path: str | Path, exercises: str | Path | None = None) -> Path:
    """The source notebook ``exercises/<assignment>/<name>.ipynb`` that the notebook at ``path`` is a copy of.

    Matched by file name (as nbgrader does), preferring the assignment named by the
    copy's folder (``release/<assignment>/``, ``submitted/<student>/<assignment>/``);
    a renamed copy is matched by its cells' grade_ids when exactly one source shares most of them.
    Raises :class:`NotebookError` for a notebook that belongs to no exercise.
    """
    path = Path(path).resolve()
    exercises = Path(exercises) if exercises is not None else default_exercises_dir()
    sources = sorted(exercises.glob("*/*.ipynb"))
    by_folder = exercises / path.parent.name / path.name
    if by_folder.is_file():
        return by_folder
    named = [s for s in sources if s.name == path.name]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        raise NotebookError(f"{path}: several exercises have a notebook named {path.name} "
                            f"({', '.join(s.parent.name for s in named)}); put it in a folder named after its assignment")
    ids = {_grade_id(c) for c in read(path).cells} - {None}
    overlap = sorted(((len(ids & {_grade_id(c) for c in read(s).cells}), s) for s in sources), reverse=True)
    if overlap and overlap[0][0] > 0 and (len(overlap) == 1 or overlap[1][0] < overlap[0][0]):
        return overlap[0][1]
    raise NotebookError(f"{path}: not a copy of any exercise in {exercises} (no notebook named {path.name})")


def graded_cells(source: NotebookNode) -> list[GradedCell]:
    """The source's autograded cells, in order: what the score is made of."""
    return [GradedCell(_grade_id(c), float(c.metadata["nbgrader"].get("points", 0)))
            for c in source.cells if is_grade(c) and _grade_id(c)]


def has_answer_cells(student: NotebookNode, source: NotebookNode) -> bool:
    """Whether ``student`` holds at least one of ``source``'s answer cells (by grade_id), or ``source`` has none."""
    answers = {_grade_id(c) for c in source.cells if is_solution(c) and _grade_id(c)}
    return not answers or bool(answers & {_grade_id(c) for c in student.cells})


def released(cell: NotebookNode) -> NotebookNode:
    """The student-copy version of a source cell: solution regions replaced by nbgrader's stub."""
    from nbgrader.preprocessors import ClearSolutions

    cell = copy.deepcopy(cell)
    if is_solution(cell):
        ClearSolutions().preprocess_cell(cell, {"language": "python"}, 0)
    return cell


def _fresh(cell: NotebookNode) -> NotebookNode:
    cell = copy.deepcopy(cell)
    if cell.cell_type == "code":
        cell.outputs = []
        cell.execution_count = None
    return cell


def restore(student: NotebookNode, source: NotebookNode) -> NotebookNode:
    """The notebook to grade: ``student``'s answers with every locked cell of ``source``.

    * a cell whose grade_id is in the source: locked cells (tests, hidden tests, instructions)
      come back from the source verbatim; answer cells keep the student's text (and get the
      source's metadata); the first cell with a given grade_id counts, later copies lose their
      nbgrader metadata (as nbgrader's DeduplicateIds does);
    * a cell with an unknown grade_id loses its nbgrader metadata; cells without metadata
      (the student's own) stay as they are;
    * a source cell missing from the copy is put back after the cell that precedes it in the
      source: locked cells as in the source, answer cells as released (the stub).
    """
    by_id = {_grade_id(c): c for c in source.cells if _grade_id(c)}
    order = [_grade_id(c) for c in source.cells if _grade_id(c)]
    nb = copy.deepcopy(student)
    cells, placed = [], {}
    for cell in nb.cells:
        gid = _grade_id(cell)
        if gid is None:
            cells.append(_fresh(cell))
            continue
        if gid not in by_id or gid in placed:
            cell = _fresh(cell)
            del cell.metadata["nbgrader"]
            cells.append(cell)
            continue
        src = by_id[gid]
        if is_locked(src):
            cell = _fresh(src)
        else:  # an answer: the student's text, the source's cell type and metadata
            answer = cell.source if cell.cell_type == src.cell_type else released(src).source
            cell = _fresh(src)
            cell.source = answer
        placed[gid] = cell
        cells.append(cell)
    for i, gid in enumerate(order):
        if gid in placed:
            continue
        cell = _fresh(released(by_id[gid]))
        before = next((placed[g] for g in reversed(order[:i]) if g in placed), None)
        position = next(k for k, c in enumerate(cells) if c is before) + 1 if before is not None else 0
        cells.insert(position, cell)
        placed[gid] = cell
    seen_ids = set()
    for k, cell in enumerate(cells):  # copies of source cells can repeat a cell id
        if cell.get("id") in seen_ids:
            cell["id"] = f"restored-{k}"
        seen_ids.add(cell.get("id"))
    nb.cells = cells
    return nb
