"""A prediction asked of the student's function in a rank of its own, where the grader's reference refuses to run.

A prediction check gives the student's function the cases it asks, in one rank, after
:func:`course.checks.refuse` has made the grader's own reference code (and any copy of it) raise there: the answer
has to be worked out, not called. What comes back is converted in the rank (a number, a pair, ...) so that no
object of the student's reaches the check's process; a value the converter cannot read comes back as its repr.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from course import checks


def number(value):
    """An int when the value is a whole number, else a float; ``repr`` text when it is not a number."""
    try:
        as_float = float(value)
        return int(as_float) if as_float.is_integer() else as_float
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:200]


def _harness(rank, predict, asked, refused, message, convert):
    checks.refuse(refused, message)
    out = []
    for case in asked:
        value = predict(*case)
        try:
            out.append(convert(value))
        except (TypeError, ValueError, RuntimeError, OverflowError):
            out.append(repr(value)[:200])
    return out


def ask(check: str, predict: Callable, asked: Iterable[tuple], *, refused: list[Callable], message: str,
        expected: str, convert: Callable = number) -> list:
    """``predict(*case)`` for every case of ``asked``, run in one rank with ``refused`` refusing to run there
    (``message`` is what a call of them raises); each answer as ``convert`` reads it."""
    job = checks.run(check, _harness, 1, args=(predict, list(asked), list(refused), message, convert),
                     expected=expected)
    return job.values[0]
