"""Pieces the exercise checks share, on both sides of a job.

Checker side (the notebook's process): :func:`require_written` turns an untouched
answer cell into a clean "not written yet" failure without starting a job, and
:func:`run` is :func:`graders.core.run_job` with the check timeout and
exercise-specific hints for known failure texts. Rank side (inside a harness):
:func:`join_job` joins the process group the way the exercises expect and
:func:`to_cpu` makes observations safe to send back.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from graders.core import CheckFailed, run_job

#: seconds a check's job may run before its ranks are killed (a deadlock or an endless loop)
DEFAULT_CHECK_TIMEOUT = 60.0
TIMEOUT_ENV = "DDP_COURSE_CHECK_TIMEOUT"


def check_timeout() -> float:
    """The per-job deadline for checks: DDP_COURSE_CHECK_TIMEOUT seconds, else 60."""
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_CHECK_TIMEOUT))
    except ValueError:
        return DEFAULT_CHECK_TIMEOUT


def _is_stub(fn: Callable) -> bool:
    """True when ``fn``'s body is only nbgrader's ``raise NotImplementedError()`` (plus a docstring or pass)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return False
    defs = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(defs) != 1:
        return False
    body = [
        node
        for node in defs[0].body
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))  # docstring
        and not isinstance(node, ast.Pass)
    ]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    name = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(name, ast.Name) and name.id == "NotImplementedError"


def require_written(check: str, **functions: Any) -> None:
    """Fail ``check`` cleanly if an answer is missing: not a function, or still nbgrader's stub."""
    for name, fn in functions.items():
        if not callable(fn):
            raise CheckFailed(
                check,
                f"`{name}` is not a function (got {type(fn).__name__})",
                expected=f"the function `{name}` from the answer cell",
                hint=f"run the answer cell that defines `{name}`, then this cell again",
            )
        if _is_stub(fn):
            raise CheckFailed(
                check,
                f"`{name}` is not written yet: it only raises NotImplementedError",
                hint=f"replace `raise NotImplementedError()` in `{name}` with your code, run that cell, then this one",
            )


def run(
    check: str,
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    hints: Iterable[tuple[str, str]] = (),
    timeout: float | None = None,
):
    """:func:`graders.core.run_job` with the check timeout; ``hints`` are (text, advice) pairs:
    when a failure's report contains ``text`` (or says "timeout" for a hang), ``advice`` replaces the generic hint."""
    try:
        return run_job(check, fn, world_size, args=args, timeout=timeout or check_timeout())
    except CheckFailed as err:
        report = f"{err.problem}\n{err.detail or ''}"
        hung = "did not finish within" in err.problem
        for text, advice in hints:
            if (text == "timeout" and hung) or (text != "timeout" and text in report):
                raise CheckFailed(
                    check, err.problem, ranks=err.ranks, expected=err.expected, got=err.got,
                    hint=advice, detail=err.detail,
                ) from None
        raise


# --- rank side ---------------------------------------------------------------------------------


def device():
    """This rank's device: its GPU under nccl, else the CPU."""
    import torch

    import course

    if course.backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def join_job():
    """Join the job as the grader (not the student) and return this rank's device."""
    import torch
    import torch.distributed as dist

    import course

    dist.init_process_group(course.backend())
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def finish(value: Any) -> Any:
    """Return ``value``: a harness's last step, kept so harnesses say where the student's part ends.

    Ranks must not exit while a peer still talks to them (a peer connecting in
    init_process_group would fail with "Connection closed by peer"); the launcher
    now holds every rank that returned until all have, through its store, never a
    collective, so nothing pairs up with a collective the student left unmatched.
    """
    return value


def to_cpu(obj: Any) -> Any:
    """Detached CPU copies of every tensor in ``obj`` (lists, tuples and dicts followed)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rank_list(ranks: Iterable[int]) -> str:
    """'rank 1' or 'ranks 1, 2' for messages."""
    ranks = sorted(set(ranks))
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
