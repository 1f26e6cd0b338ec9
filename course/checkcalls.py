"""Read a test cell as the check calls it makes: ``graders.ex2.check_sampler(make_loader)``.

A test cell the grader can re-run on its own is a sequence of calls to
``graders.<module>.check_<name>(...)`` whose arguments are names of the
notebook's objects or literals (plus comments and ``import graders...``
lines). Anything else returns None: such a cell can only be graded from the
notebook's own output. Parsing never runs the cell.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

#: an argument: ("name", "make_loader") or ("value", 3)
Arg = tuple[str, object]


@dataclass(frozen=True)
class CheckCall:
    module: str  # "graders.ex2"
    function: str  # "check_sampler"
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, Arg], ...]

    @property
    def names(self) -> list[str]:
        """The notebook names this call passes, in order, without repeats."""
        found: list[str] = []
        for kind, value in [*self.args, *(a for _, a in self.kwargs)]:
            if kind == "name" and value not in found:
                found.append(value)
        return found

    @property
    def strings(self) -> list[str]:
        """String literals passed (file names such as "train.py" among them)."""
        return [v for kind, v in [*self.args, *(a for _, a in self.kwargs)] if kind == "value" and isinstance(v, str)]

    def __str__(self) -> str:
        show = lambda a: a[1] if a[0] == "name" else repr(a[1])  # noqa: E731
        parts = [show(a) for a in self.args] + [f"{k}={show(a)}" for k, a in self.kwargs]
        return f"{self.module}.{self.function}({', '.join(parts)})"


def _arg(node: ast.expr) -> Arg | None:
    if isinstance(node, ast.Name):
        return ("name", node.id)
    try:
        return ("value", ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _call(node: ast.expr) -> CheckCall | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
            and isinstance(func.value.value, ast.Name) and func.value.value.id == "graders"
            and func.attr.startswith("check_") and not func.value.attr.startswith("_")):
        return None
    args = [_arg(a) for a in node.args]
    if any(a is None for a in args) or any(isinstance(a, ast.Starred) for a in node.args):
        return None
    kwargs = []
    for kw in node.keywords:
        value = _arg(kw.value)
        if kw.arg is None or value is None:
            return None
        kwargs.append((kw.arg, value))
    return CheckCall(f"graders.{func.value.attr}", func.attr, tuple(args), tuple(kwargs))


def parse(source: str) -> list[CheckCall] | None:
    """The check calls of a test cell, or None when the cell is anything else."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    calls = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import) and all(a.name.split(".")[0] == "graders" and a.asname is None
                                                for a in stmt.names):
            continue
        if not isinstance(stmt, ast.Expr):
            return None
        call = _call(stmt.value)
        if call is None:
            return None
        calls.append(call)
    return calls or None
