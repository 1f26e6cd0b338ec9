"""``course.hint()``: the next level of a failed check's message, in the notebook (:mod:`course.grading.hints`)."""

from __future__ import annotations

import os

from course.errors import SHOWN, CheckFailed
from course.grading import hints


def last_failure(check: str | None = None) -> CheckFailed | None:
    """The last failure the notebook showed (of ``check``, when given)."""
    for err in reversed(SHOWN):
        if check is None or err.check == check:
            return err
    return None


def hint(check: str | None = None, *, folder: str | None = None) -> str:
    """Print the next level of the last failure of ``check`` (default: the last failed check), record the request in
    the notebook's folder (``folder``, default the kernel's working folder), and return what it printed."""
    err = last_failure(check)
    if err is None:
        which = f"`{check}`" if check else "any check"
        text = (f"no failure of {which} in this kernel yet: run its test cell, and ask again if it fails")
        print(text)
        return text
    hints.attach(err)
    failure = hints.fingerprint(err.package, err.check, err.render(1))
    folder = folder or os.getcwd()
    level = min(hints.next_level(hints.read_record(folder), err.check, failure), err.deepest)
    hints.record(folder, check=err.check, package=err.package, level=level, failure=failure, asked_in="notebook")
    last = " (the last)" if level >= err.deepest else ""
    text = f"hint level {level} of {err.deepest}{last} for {err.check}:\n{err.render(level)}"
    print(text)
    return text
