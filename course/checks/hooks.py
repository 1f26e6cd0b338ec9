"""The grader's hooks on a student's module, safe to pickle with it.

A check that watches a model (which samples reached it, what a layer received) registers a hook, often a closure
over the grader's journal. A script that saves the whole module (``torch.save(model, path)``, an idiom the
tutorials warn against but students use) pickles its hooks too: a closure cannot be pickled, and the script
would fail with an error of the grader's making. :func:`grader_hook` wraps the hook so that, pickled, it becomes
a hook that does nothing: neither the grader's state nor its files go along.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _idle(*args: Any, **kwargs: Any) -> None:
    return None


class GraderHook:
    """A hook of the grader's: called, it is the function it wraps; pickled, it is a hook that does nothing."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (GraderHook, (_idle,))


def grader_hook(fn: Callable[..., Any]) -> GraderHook:
    """``fn`` as a hook to register on a student's module (see the module's text)."""
    return GraderHook(fn)
