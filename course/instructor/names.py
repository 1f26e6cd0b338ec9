"""Whose notebook is this? Student and assignment from a submitted file's path.

Accepted, for a notebook named ``parallelism`` (assignment ``ex1-parallelism``):

* a folder per student: ``alice/parallelism.ipynb``, ``alice/ex1-parallelism/parallelism.ipynb``
  (the student is the folder above the assignment folder, else the innermost folder);
* the name in the file name: ``alice_parallelism.ipynb``, ``parallelism_alice.ipynb``
  (``-`` works as well as ``_``; case does not matter for the notebook part);
* LMS downloads: Canvas ``alice_12345_67890_parallelism.ipynb``, ``alice_LATE_12345_67890_parallelism-1.ipynb``;
  Moodle ``Alice Smith_12345_assignsubmission_file_parallelism.ipynb``. Numeric ids, ``LATE`` and
  Moodle's ``assignsubmission_file`` are dropped, spaces become ``_``: the student ids are
  ``alice`` and ``Alice_Smith``.

Anything else is reported, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

_STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]*$")
_LMS_NOISE = re.compile(r"(?:[_-](?:\d+|LATE|late|assignsubmission_file|onlinetext))+[_-]?$")
_COPY_COUNTER = re.compile(r"-\d+$")  # Canvas: a resubmitted file.ipynb arrives as file-1.ipynb
_SEPARATORS = "_-"


@dataclass(frozen=True)
class Placement:
    """Where one submitted file belongs: ``submitted/<student>/<assignment>/<notebook>.ipynb``."""

    student: str
    assignment: str
    notebook: str


class Unplaced(ValueError):
    """A file that could not be matched to a student and an assignment; ``str()`` says why."""


def student_id(raw: str) -> str:
    """A clean nbgrader student id from the student part of a name (LMS ids and flags dropped)."""
    text = raw.strip()
    cleaned = _LMS_NOISE.sub("", text)
    if cleaned and not cleaned.isdigit():  # a purely numeric name is an id: keep it
        text = cleaned
    text = re.sub(r"\s+", "_", text.strip(_SEPARATORS + " "))
    if not _STUDENT_ID.match(text):
        raise Unplaced(f"cannot make a student id from {raw!r} (letters, digits and . _ @ + - only)")
    return text


def place(path: PurePosixPath | str, notebooks: dict[str, str]) -> Placement:
    """The placement of a submitted file at relative ``path``; ``notebooks`` maps notebook name -> assignment."""
    path = PurePosixPath(path)
    if path.suffix.lower() != ".ipynb":
        raise Unplaced("not a notebook (.ipynb)")
    by_lower = {name.lower(): name for name in notebooks}
    folders = list(path.parts[:-1])
    stem = path.stem

    # a folder per student: the file keeps the notebook's own name
    for candidate in (stem, _COPY_COUNTER.sub("", stem)):
        notebook = by_lower.get(candidate.lower())
        if notebook is not None and folders:
            assignment = notebooks[notebook]
            if assignment in folders:
                above = folders[: folders.index(assignment)]
                if not above:
                    raise Unplaced(f"no student folder above {assignment}/")
                return Placement(student_id(above[-1]), assignment, notebook)
            return Placement(student_id(folders[-1]), assignment, notebook)
        if notebook is not None:
            raise Unplaced(f"the file name is just the notebook's ({path.name}): put it in a folder named after the student")

    # the student's name in the file name, before or after the notebook's
    for candidate in (stem, _COPY_COUNTER.sub("", stem)):
        lower = candidate.lower()
        for name in sorted(by_lower, key=len, reverse=True):
            for sep in _SEPARATORS:
                if lower.endswith(sep + name) and len(lower) > len(name) + 1:
                    notebook = by_lower[name]
                    return Placement(student_id(candidate[: -len(name) - 1]), notebooks[notebook], notebook)
                if lower.startswith(name + sep) and len(lower) > len(name) + 1:
                    notebook = by_lower[name]
                    return Placement(student_id(candidate[len(name) + 1 :]), notebooks[notebook], notebook)
    known = ", ".join(sorted(notebooks))
    raise Unplaced(f"no notebook name ({known}) in {path.name!r}")
