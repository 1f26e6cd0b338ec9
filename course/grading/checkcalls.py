"""Read a test cell as the check calls it makes: ``graders.ddp_basics.check_training(train)``.

A test cell the grader can re-run on its own is a sequence of calls to
``graders.<module>.check_<name>(...)`` (or another package of :func:`check_packages`)
whose arguments are names of the notebook's objects or literals (plus comments and
``import graders...`` lines). Anything else returns None: such a cell can only be graded from the
notebook's own output. Parsing never runs the cell.

The student's kernel runs no check at all: for a test cell made of check calls,
:func:`kernel_source` is one comment naming the notebook objects and files the
checks use, so the kernel's snapshot hook records them (see :mod:`course.grading.snapshot`)
and the trusted verifier runs the whole cell, hidden tests included, once. Hidden
tests never reach the kernel, and no check runs twice.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass

from course.envnames import CHECK_PACKAGES_ENV
from course.grading.cells import HIDDEN_BEGIN, HIDDEN_END

#: an argument: ("name", "train") or ("value", 3)
Arg = tuple[str, object]




def check_packages() -> tuple[str, ...]:
    """The packages whose ``<package>.<module>.check_<name>(...)`` calls the grader runs as checks: the course's
    ``graders`` and those named in ``DDP_COURSE_CHECK_PACKAGES`` (comma-separated), e.g. an instructor's own."""
    extra = [name.strip() for name in os.environ.get(CHECK_PACKAGES_ENV, "").split(",")]
    return ("graders", *[n for n in extra if n.isidentifier() and n != "graders"])


#: the comment the kernel runs in place of a test cell of check calls (followed by what they use, as JSON)
USES_PREFIX = "# (the grader runs this cell's checks itself; they use: "


@dataclass(frozen=True)
class CheckCall:
    module: str  # "graders.ddp_basics"
    function: str  # "check_training"
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
            and isinstance(func.value.value, ast.Name) and func.value.value.id in check_packages()
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
    return CheckCall(f"{func.value.value.id}.{func.value.attr}", func.attr, tuple(args), tuple(kwargs))


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
        if isinstance(stmt, ast.Import) and all(a.name.split(".")[0] in check_packages() and a.asname is None
                                                for a in stmt.names):
            continue
        if not isinstance(stmt, ast.Expr):
            return None
        call = _call(stmt.value)
        if call is None:
            return None
        if any(line in hidden for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)):
            # a hidden call, or a visible call with hidden arguments: its literals stay out of the kernel too
            call = CheckCall(call.module, call.function, call.args, call.kwargs, hidden=True)
        calls.append(call)
    return calls or None


def kernel_source(source: str) -> str:
    """What the student's kernel runs for a test cell: for check calls, a comment naming what they use.

    The verifier re-runs check calls in a trusted process and its verdicts replace
    the cell's outputs, so running them in the kernel too would only double the
    grading time. The comment lists the notebook names the calls pass and the file
    names among their string literals (for hidden calls, only plain relative file
    names: no hidden source, arguments or other literals). Any other cell is
    returned unchanged: it can only be graded by running it in the kernel.
    """
    calls = parse(source)
    if not calls:
        return source
    names: list[str] = []
    files: list[str] = []
    for call in calls:
        names += [n for n in call.names if n not in names]
        files += [s for s in call.strings if (_plain_file(s) or not call.hidden) and s not in files]
    return USES_PREFIX + json.dumps({"names": names, "files": files}) + ")"


def _plain_file(text: str) -> bool:
    """Looks like a relative file name (what a hidden call's literal may reveal to the kernel)."""
    return (bool(text) and len(text) < 200 and not any(ch.isspace() for ch in text) and not text.startswith("/")
            and ".." not in text)


def uses(source: str) -> tuple[list[str], list[str]]:
    """(notebook names, file names) the snapshot hook must record for a cell the kernel runs: those the
    comment of :func:`kernel_source` lists (the kernel runs no check call itself)."""
    names: list[str] = []
    strings: list[str] = []
    for line in source.splitlines():
        if not (line.startswith(USES_PREFIX) and line.endswith(")")):
            continue
        try:
            listed = json.loads(line[len(USES_PREFIX):-1])
        except ValueError:
            continue
        if not isinstance(listed, dict):
            continue
        names += [n for n in listed.get("names") or [] if isinstance(n, str) and n.isidentifier() and n not in names]
        strings += [s for s in listed.get("files") or [] if isinstance(s, str) and s not in strings]
    return names, strings
