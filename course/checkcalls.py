"""Read a test cell as the check calls it makes: ``graders.ex2.check_sampler(make_loader)``.

A test cell the grader can re-run on its own is a sequence of calls to
``graders.<module>.check_<name>(...)`` whose arguments are names of the
notebook's objects or literals (plus comments and ``import graders...``
lines). Anything else returns None: such a cell can only be graded from the
notebook's own output. Parsing never runs the cell.

Hidden tests never reach the student's kernel: :func:`kernel_source` is what the
kernel runs instead of such a test cell (the hidden regions replaced by one
comment naming the notebook objects they use, so the kernel's snapshot hook
still records them, see :mod:`course.snapshot`); the verifier runs the full cell.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

#: an argument: ("name", "make_loader") or ("value", 3)
Arg = tuple[str, object]


HIDDEN_BEGIN, HIDDEN_END = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
#: the comment that stands for a cell's hidden tests in the kernel (followed by what they use)
USES_PREFIX = "# (hidden tests: the grader runs them itself; they use: "


@dataclass(frozen=True)
class CheckCall:
    module: str  # "graders.ex2"
    function: str  # "check_sampler"
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, Arg], ...]
    #: the call sits inside a ``### BEGIN HIDDEN TESTS`` region
    hidden: bool = False

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


def hidden_lines(source: str) -> set[int]:
    """Line numbers (from 1) inside hidden-test regions, markers included (nbgrader's rule: a line
    containing the marker text)."""
    inside, depth = set(), 0
    for number, line in enumerate(source.splitlines(), 1):
        if HIDDEN_BEGIN in line:
            depth += 1
            inside.add(number)
        elif HIDDEN_END in line and depth:
            depth -= 1
            inside.add(number)
        elif depth:
            inside.add(number)
    return inside


def parse(source: str) -> list[CheckCall] | None:
    """The check calls of a test cell, or None when the cell is anything else."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    hidden = hidden_lines(source)
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
        if stmt.lineno in hidden:
            call = CheckCall(call.module, call.function, call.args, call.kwargs, hidden=True)
        calls.append(call)
    return calls or None


def kernel_source(source: str) -> str:
    """What the student's kernel runs for a test cell: the cell without its hidden tests.

    Only for cells the verifier can re-run (check calls); any other cell is returned
    unchanged, since its hidden part can only be graded by running it in the kernel.
    The hidden regions become one comment listing the notebook names and the file
    names they pass (see :func:`uses`): no hidden source, arguments or literals.
    """
    calls = parse(source)
    hidden = hidden_lines(source)
    if not calls or not hidden:
        return source
    names: list[str] = []
    for call in calls:
        if call.hidden:
            names += [n for n in call.names if n not in names]
            names += [repr(s) for s in call.strings if _plain_file(s) and repr(s) not in names]
    kept = [line for number, line in enumerate(source.splitlines(), 1) if number not in hidden]
    return "\n".join([*kept, USES_PREFIX + ", ".join(names) + ")"])


def _plain_file(text: str) -> bool:
    return bool(text) and len(text) < 200 and "\n" not in text and not text.startswith("/") and ".." not in text


def uses(source: str) -> tuple[list[str], list[str]]:
    """(notebook names, string literals) the snapshot hook must record for a cell the kernel runs:
    those of its check calls plus those the hidden-tests comment of :func:`kernel_source` lists."""
    names: list[str] = []
    strings: list[str] = []
    for call in parse(source) or []:
        names += [n for n in call.names if n not in names]
        strings += [s for s in call.strings if s not in strings]
    for line in source.splitlines():
        if line.startswith(USES_PREFIX) and line.endswith(")"):
            for token in line[len(USES_PREFIX):-1].split(", "):
                if token.isidentifier() and token not in names:
                    names.append(token)
                elif token[:1] in "'\"":
                    try:
                        value = ast.literal_eval(token)
                    except (ValueError, SyntaxError):
                        continue
                    if isinstance(value, str) and value not in strings:
                        strings.append(value)
    return names, strings
