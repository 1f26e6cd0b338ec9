"""Hints that escalate, as a tutor gives them: the levels of a failed check, and the record of what a student asked.

A failed check shows level 1 (what is wrong: :meth:`course.errors.CheckFailed.render`); a student who asks
(``course.hint("check_x")`` in the notebook, ``ddp-course check NOTEBOOK --hint check_x``) gets the next level of
that failure: 2, the idea and the lesson section that teaches it (:data:`CONCEPTS_MODULE`, :func:`attach`), then
3, where in their own code it breaks. Both ways of asking share one record in the notebook's folder
(:data:`RECORD`), so asking again goes on from the level last given for the same failure.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from course.errors import HINT_LEVELS, CheckFailed

#: what a student asked for, one entry per request, in the folder of the notebook it was asked from
RECORD = ".ddp-course-hints.json"


#: where the check packages keep every check's level 2, under their root (``graders.common.concepts``): a dict
#: ``CONCEPTS[notebook package][check] = (idea, lesson, section)``
CONCEPTS_MODULE = "common.concepts"


def concept_of(package: str | None, check: str) -> tuple[str, str, str] | None:
    """(idea, lesson, section) of ``check`` in the check package ``package`` (``graders.ddp_basics``), from
    :data:`CONCEPTS_MODULE`; None when it has none."""
    if not package or "." not in package:
        return None
    root, _, short = package.partition(".")
    try:
        concepts = importlib.import_module(f"{root}.{CONCEPTS_MODULE}").CONCEPTS  # the engine names no exercise
    except (ImportError, AttributeError):
        return None
    found = concepts.get(short, {}).get(check)
    return tuple(found) if found else None


def lesson_text(lesson: str, section: str) -> str:
    """'lesson 2 (lessons/02-ddp-basics.ipynb), section "8. `sampler.set_epoch(epoch)`"'."""
    number = lesson.split("-")[0].lstrip("0") or lesson
    return f'lesson {number} (lessons/{lesson}.ipynb), section "{section}"'


def attach(err: CheckFailed, package: str | None = None) -> CheckFailed:
    """Fill in ``err``'s level 2 (its concept and lesson section) from its package (or ``package``, the one the
    test cell called); returns ``err``."""
    err.package = err.package or package
    found = concept_of(err.package, err.check)
    if found is not None:
        idea, lesson, section = found
        err.concept, err.lesson = idea, lesson_text(lesson, section)
    return err


def levels(err: CheckFailed) -> list[str]:
    """The message at every level, level 1 first (``err`` attached)."""
    return [err.render(level) for level in range(1, HINT_LEVELS + 1)]


def fingerprint(package: str | None, check: str, message: str) -> str:
    """The same failure of a check, run after run: its FAILED line with the numbers left out."""
    first = message.splitlines()[0] if message else ""
    text = f"{package or ''}:{check}:{re.sub(r'[0-9]+(?:[.][0-9]+)?(?:e[+-]?[0-9]+)?', '#', first)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_record(folder: str | Path) -> list[dict[str, Any]]:
    """The requests recorded in ``folder``, oldest first ([] when none, or when the file is not ours)."""
    try:
        data = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return []
    requests = data.get("requests") if isinstance(data, dict) else None
    return [r for r in requests if isinstance(r, dict)] if isinstance(requests, list) else []


def next_level(requests: list[dict[str, Any]], check: str, failure: str) -> int:
    """The level to give now: one past the last one given for this failure, level 2 at first, at most the last."""
    given = [int(r.get("level", 1)) for r in requests if r.get("check") == check and r.get("failure") == failure]
    return min(max(given, default=1) + 1, HINT_LEVELS)


def record(folder: str | Path, *, check: str, package: str | None, level: int, failure: str,
           asked_in: str) -> None:
    """Add one request to ``folder``'s record: which check, which level, when, from where ("notebook", "check").
    A folder that cannot be written loses the record, never the hint."""
    folder = Path(folder)
    entry = {"check": check, "package": package,
             "notebook": f"{package.rpartition('.')[2]}.ipynb" if package else None, "level": level,
             "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "asked_in": asked_in, "failure": failure}
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ddp-course-hints.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": 1, "requests": [*read_record(folder), entry]}, fh, indent=1)
        os.replace(tmp, folder / RECORD)
    except OSError:
        pass
    from course.progress import note_hint  # on a class server, the student's progress notes it too

    note_hint(folder, check, level)
