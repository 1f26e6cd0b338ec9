"""The student's objects, on both sides of the trust boundary.

In the student's kernel, :func:`describe` says what an object is (callable, its type,
its source) for the snapshot the verifier reads (:mod:`course.grading.snapshot`). In the
trusted verifier, a :class:`StudentObject` stands in for each object: it can travel to
ranks (it pickles as the student's own bytes) and be called (as a 1-rank sandboxed job),
but nothing can look inside it in the grader's process.
"""

from __future__ import annotations

import ast
import inspect
import pickle
from typing import Any

from course.grading.cells import check_timeout


def describe(obj: Any) -> tuple[bool, str, str | None]:
    """(callable, type name, source) of a student object; for a verifier stand-in, what the notebook
    recorded of it."""
    if isinstance(obj, StudentObject):
        return obj.student_callable, obj.student_kind, obj.student_source
    return callable(obj), type(obj).__name__, answer_source(obj)


def answer_source(obj: Any) -> str | None:
    """The source of a function or class the student defined (in a notebook cell or a file), or None.

    For a class defined in a notebook, ``inspect.getsource`` fails on Python < 3.13 (the
    notebook's ``__main__`` has no file); the class is then found in the cell that defined
    one of its methods.
    """
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        try:
            return inspect.getsource(obj)
        except (OSError, TypeError):
            return None
    if not inspect.isclass(obj):
        return None
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        pass
    import linecache

    for member in vars(obj).values():
        code = getattr(member, "__code__", None)
        if code is None:
            continue
        text = "".join(linecache.getlines(code.co_filename))
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == obj.__name__ and node.lineno <= code.co_firstlineno:
                segment = ast.get_source_segment(text, node)
                if segment:
                    return segment
    return None


class StudentObjectUsed(AttributeError):
    """A check tried to look inside a student object in the trusted process."""


def _load_student(blob: bytes):
    """Rank side: the student's object from its pickle (only ever called inside the sandbox)."""
    return pickle.loads(blob)


def _call_student(rank: int, obj, args: tuple, kwargs: dict):
    return obj(*args, **kwargs)


class StudentObject:
    """Stands in the verifier for one object of the student's notebook.

    It can travel to ranks (it pickles as the student's own bytes, unpickled
    there, inside the sandbox) and be called (as a 1-rank sandboxed job whose
    result is decoded weights-only). Anything else, such as reading an
    attribute, raises :class:`StudentObjectUsed`: a check must not look inside
    student objects in the grader's process.
    """

    _SAFE = {"__name__", "__qualname__"}

    def __init__(self, name: str, blob: bytes, *, kind: str = "", is_callable: bool = True, source: str | None = None):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_blob", blob)
        object.__setattr__(self, "misuse", [])
        # what the notebook said of the object (see course.grading.snapshot): only ever read as text
        object.__setattr__(self, "student_kind", kind or "object")
        object.__setattr__(self, "student_callable", bool(is_callable))
        object.__setattr__(self, "student_source", source)

    def __reduce__(self):
        return (_load_student, (self._blob,))

    def __call__(self, *args, **kwargs):
        from course.launcher.job import launch

        job = launch(_call_student, 1, args=(self, args, kwargs), echo=False, timeout=check_timeout(), safe_results=True)
        return job.values[0]

    def __getattr__(self, attr: str):
        if attr in self._SAFE:
            return self._name
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # protocol probes (inspect, copy, pickle): "no such attribute"
        self.misuse.append(attr)
        raise StudentObjectUsed(
            f"the check read `{self._name}.{attr}` in the grader's own process, where student code never runs")

    def __setattr__(self, attr, value):
        self.misuse.append(attr)
        raise StudentObjectUsed(f"the check set `{self._name}.{attr}` in the grader's own process")

    def __repr__(self) -> str:
        return f"<student object {self._name}>"
