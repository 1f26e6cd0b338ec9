"""The check API: what an exercise's checks are written with.

A *check* is a plain function that a one-line nbgrader test cell calls with the
student's objects, e.g. ``graders.ex2.check_sampler(make_loader)``. It

1. makes sure the answer is written (:func:`require_written`: nbgrader's untouched
   stub fails at once with "not written yet", no job started);
2. runs a *harness* (a function of yours, ``harness(rank, *args)``) on N real ranks
   with :func:`run`: the harness joins the job (:func:`join_job`), calls the student's
   code, and returns what it observed (:func:`to_cpu` for tensors);
3. compares the ranks' observations with what is right and either returns (the
   cell passes; :func:`passed` prints the one line it shows) or raises
   :class:`CheckFailed`, whose text names the check, the ranks, what was expected,
   what happened and what to try.

The same check runs in the student's notebook (a visible self-check) and in the
trusted verifier (:mod:`course.grading.verifier`) that produces the score. There
the student's objects are stand-ins that can be shipped to ranks and called, but
not looked into: a check must observe through its ranks, never by reading a
student object's attributes in its own process. A crash or a hang on any rank
becomes a ``CheckFailed`` that leads with the first rank that failed.

A minimal check (the authoring guide, docs/writing-exercises.md, builds a whole
exercise around one)::

    from course import checks

    def _harness(rank, total):
        checks.join_job()
        return float(total(rank))          # the student's function, on this rank

    def check_total(total):
        check = "check_total"
        checks.require_written(check, total=total)
        job = checks.run(check, _harness, 3, args=(total,))
        bad = [r for r, v in enumerate(job.values) if v != 3.0]
        checks.expect(not bad, check, "ranks disagree on the sum", ranks=bad,
                      expected=3.0, got=job.values, hint="all_reduce the value on every rank")
        checks.passed(check)
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from course.errors import CheckFailed, LaunchError, RankStallError, RankTimeoutError, explain, rank_list
from course.grading.cells import CHECK_TIMEOUT, TIMEOUT_ENV, check_timeout
from course.grading.student import answer_source, describe
from course.launcher.job import JobResult, launch

__all__ = [
    "CHECK_TIMEOUT",
    "TIMEOUT_ENV",
    "CheckFailed",
    "answer_source",
    "collectives",
    "describe",
    "check_timeout",
    "device",
    "expect",
    "join_job",
    "passed",
    "rank_list",
    "require_written",
    "require_written_source",
    "run",
    "to_cpu",
    "unwritten",
]

# --------------------------------------------------------------------------- the checker side


def passed(check: str, points: float | None = None) -> None:
    """Print the one line a passing check shows (on stdout: nbgrader zeroes a cell with stderr)."""
    suffix = f" ({points:g} points)" if points is not None else ""
    print(f"passed {check}{suffix}")


def expect(condition: bool, check: str, problem: str, **kwargs) -> None:
    """Raise ``CheckFailed(check, problem, **kwargs)`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(check, problem, **kwargs)


def run(
    check: str,
    harness: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    hints: Iterable[tuple[str, str]] = (),
    timeout: float | None = None,
    env: dict | None = None,
) -> JobResult:
    """Run ``harness(rank, *args)`` on ``world_size`` real ranks for ``check``; their results are ``.values``.

    A rank that raises, dies or hangs (past ``timeout``, default :func:`check_timeout`)
    becomes a :class:`CheckFailed` that leads with the first rank that failed and shows
    its traceback (the student's frames) or where each stuck rank waited.
    A deadlock (every rank waiting in collectives that cannot complete) is reported as soon as
    it is certain, with each rank's collective and source line (:mod:`course.launcher.stall`).
    ``hints``: (text, advice) pairs; when the failure's report contains ``text`` (or,
    for ``"timeout"``, when the job hung or deadlocked), ``advice`` replaces the generic hint.
    """
    try:
        return launch(harness, world_size, args=args, timeout=timeout or check_timeout(), echo=False, env=env)
    except LaunchError as err:
        problem, ranks, hint, detail = _describe_failure(world_size, err)
        hung = isinstance(err, RankTimeoutError)
        found = err.verdict.hint if isinstance(err, RankStallError) and err.verdict is not None else None
    report = f"{problem}\n{detail or ''}"
    for text, advice in hints:
        if (text == "timeout" and hung) or (text != "timeout" and text in report):
            if found:  # the check's advice, and what the ranks' collectives showed
                detail = f"{detail}\nwhy: {found}"
            hint = advice
            break
    failure = CheckFailed(check, problem, ranks=ranks, hint=hint, detail=detail)
    failure.hung = hung  # a check that judges what happened before the end can still do so
    raise failure


def _describe_failure(world_size: int, err: LaunchError) -> tuple[str, list[int], str, str]:
    """(problem, ranks, hint, detail) of a failed job, the first rank that failed first."""
    if isinstance(err, RankStallError) and err.verdict is not None:
        v = err.verdict
        culprits = v.waiting if v.kind == "returned" else sorted(v.lines)  # a collective the others skipped
        return (f"the {world_size}-rank job deadlocked: {v.summary}", culprits, v.hint,
                f"where each rank was when the grader stopped the job:\n{textwrap.indent(v.lined_up, '    ')}")
    if isinstance(err, RankTimeoutError):
        return (f"the {world_size}-rank job did not finish within {err.timeout:g} s "
                f"({rank_list(err.running)} still running, {rank_list(err.returned)} returned)",
                err.running,
                "a rank that waits forever is usually in a collective (all_reduce, barrier, DDP backward) "
                "that another rank never reached, e.g. a collective inside `if rank == 0:`, or a loop that "
                "never ends; every rank must call the same collectives in the same order",
                _last_output(err))
    first = err.ranks[0] if err.ranks else None
    failure = err.failures.get(first) if first is not None else None
    hint = ("read the traceback below (it starts in your code); run the cell on its own with "
            "course.run_ranks to see every rank's output")
    if failure is not None and failure.kind == "raised" and failure.exc_type == "NotImplementedError":
        where = re.findall(r'File "[^"]*", line \d+, in (\w+)', failure.traceback)
        what = f"`{where[-1]}`" if where else "your code"
        problem = f"part of your answer is not written yet: {what} raised NotImplementedError"
        hint = "replace every `raise NotImplementedError()` of the answer cells with your code, run them, then this one"
        detail = failure.traceback
    elif failure is not None and failure.kind == "raised":
        problem = f"your code raised {failure.exc_type}: {failure.message}".rstrip(": ")
        hint = explain(f"{failure.message}\n{failure.traceback}") or hint
        detail = failure.traceback
    elif failure is not None and any("Received data size doesn't match expected size" in line
                                     or "gloo::EnforceNotMet" in line for line in failure.last_output):
        problem = (f"rank {first} was killed by gloo ({failure.message}): the data it received did not match the "
                   "collective it was in, i.e. the ranks called different collectives, or the same one with "
                   "tensors of different sizes")
        hint = ("every rank must call the same collectives in the same order, with tensors of the same shape and "
                "dtype: look for a collective inside `if rank == ...:` or tensors whose size depends on the rank")
        detail = "\n".join(failure.last_output)
    elif failure is not None:
        problem = f"a rank died: {failure.message}"
        detail = "\n".join(failure.last_output)
    else:
        problem, detail = "the job failed", str(err)
    return f"{problem} ({world_size}-rank job)", err.ranks, hint, detail


def _last_output(err: LaunchError) -> str:
    parts = []
    for rank in sorted(err.failures):
        lines = err.failures[rank].last_output
        if lines:
            parts.append(f"rank {rank} was at:\n" + textwrap.indent("\n".join(lines[-8:]), "    "))
    return "\n".join(parts)


# --------------------------------------------------------------------------- "not written yet"


def unwritten(source: str) -> list[str]:
    """Names of the functions and methods in ``source`` that are still nbgrader's stub.

    One rule for every kind of answer (a function, a class, a whole script): a function
    is unwritten when it always reaches nbgrader's bare ``raise NotImplementedError()``:
    its body ends with that line, and nothing before it can leave the function, except
    guard clauses (``if`` without ``else``, such as a given ``if not self.training:
    return ...``). A body that can return before the stub line (a ``return``, an
    ``if``/``else``, a loop or ``try`` that returns) is the student's work, even with a
    forgotten stub line after it; a ``raise NotImplementedError("...")`` with a message
    is the student's own. Unparseable source gives ``[]`` (the job then reports the error).
    """
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(node):
            found.append(node.name)
        elif isinstance(node, ast.ClassDef):
            found += [f"{node.name}.{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(item)]
    return found


def _is_stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = [node for node in fn.body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) and not isinstance(node, ast.Pass)]
    if not body or not _is_stub_raise(body[-1]):
        return False
    return all((isinstance(node, ast.If) and not node.orelse) or not _can_leave(node) for node in body[:-1])


def _can_leave(node: ast.stmt) -> bool:
    """Whether ``node`` holds a return, yield or raise of this function (nested functions and classes aside)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    todo = [node]
    while todo:
        current = todo.pop()
        if isinstance(current, nested):
            continue
        if isinstance(current, (ast.Return, ast.Raise, ast.Yield, ast.YieldFrom)):
            return True
        todo += list(ast.iter_child_nodes(current))
    return False


def _is_stub_raise(node: ast.stmt) -> bool:
    if not isinstance(node, ast.Raise) or node.exc is None:
        return False
    exc = node.exc
    if isinstance(exc, ast.Call):
        if exc.args or exc.keywords:
            return False  # raise NotImplementedError("only 2-D inputs"): the student's own
        exc = exc.func
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def require_written(check: str, **answers: Any) -> None:
    """Fail ``check`` at once, without a job, when an answer is not a function or class, or still the stub.

    Call it with the student's objects by name: ``require_written(check, train=train)``.
    """
    for name, obj in answers.items():
        is_callable, kind, source = describe(obj)
        if not is_callable:
            raise CheckFailed(
                check,
                f"`{name}` is not a function (got {kind})",
                expected=f"the function `{name}` from the answer cell",
                hint=f"run the answer cell that defines `{name}`, then this cell again",
            )
        stubs = unwritten(source) if source else []
        if stubs:
            methods = [s for s in stubs if "." in s]  # a class: say which of its methods
            where = f" ({', '.join(f'`{s}`' for s in methods)})" if methods else ""
            raise CheckFailed(
                check,
                f"`{name}` is not written yet{where}: it only raises NotImplementedError",
                hint=f"replace `raise NotImplementedError()` in `{name}` with your code, run that cell, then this one",
            )


def require_written_source(check: str, source: str, what: str, names: Iterable[str] | None = None) -> None:
    """:func:`require_written` for an answer given as source text (a script the student wrote with
    ``%%writefile``): a syntax error or a stub among ``names`` (default: any function) fails at once."""
    try:
        ast.parse(source)
    except SyntaxError as err:
        raise CheckFailed(check, f"{what} does not compile: {err.msg} (line {err.lineno})",
                          hint="fix the syntax error in the cell that writes it and run that cell again",
                          detail=(err.text or "").rstrip()) from None
    stubs = unwritten(source)
    if names is not None:
        stubs = [s for s in stubs if s.split(".")[0] in set(names)]
    if stubs:
        raise CheckFailed(check, f"{what} is not written yet: {', '.join(f'{s}()' for s in stubs)} still "
                          "raises NotImplementedError",
                          hint=f"write {stubs[0]}() (replace `raise NotImplementedError()`) in the cell that "
                          "writes it, run that cell, then this one")


# --------------------------------------------------------------------------- the rank side


def device():
    """This rank's device: its GPU under nccl, else the CPU."""
    import torch

    from course.launcher.job import backend

    if backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def join_job():
    """In a harness: join the job as the grader (not the student) and return this rank's device."""
    import torch
    import torch.distributed as dist

    from course.launcher.job import backend

    dev = device()
    if dev.type == "cuda":  # as the lessons teach: select the GPU first, then bind the group to it
        torch.cuda.set_device(dev)
        dist.init_process_group(backend(), device_id=dev)
    else:
        dist.init_process_group(backend())
    return dev


def _flight_recorder() -> Callable[[], list[dict]]:
    """:func:`collectives`, with torch's dump function, ``pickle.loads`` and the entry reader taken now.

    ``course.checks`` is imported in a rank (as a harness's import) before any student object is
    unpickled, so code the student runs later cannot swap what this closure calls: patching
    ``torch._C._distributed_c10d._dump_fr_trace``, ``pickle.loads`` or this module's globals changes
    nothing here."""
    import pickle

    from course.launcher.stall import entry_of

    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        _dump_fr_trace = None
    loads = pickle.loads

    def collectives() -> list[dict]:
        """In a harness: the collectives this rank has issued so far, oldest first, as torch's flight recorder saw them.

        Each is ``{"op": "all_reduce", "seq": 5, "group": "default_pg", "sizes": [[49]], "dtypes": ["Float"],
        "p2p": False}``, DDP's own (bucket all-reduces, buffer broadcasts) and the student's alike;
        to count what a student's step issued, take ``collectives()[-1]["seq"]`` before it and keep
        the entries with a higher sequence number afterwards. The launcher turns the recorder on
        (``TORCH_FR_BUFFER_SIZE``); what it records cannot be faked by patching ``torch.distributed``
        (it is written by the process group itself), only by really communicating. On gloo the
        entries stay "scheduled": they say what was issued, not when it completed. A torch without
        the flight recorder raises RuntimeError. The references it uses are taken when this module is
        imported (:func:`_flight_recorder`).
        """
        if _dump_fr_trace is None:
            raise RuntimeError("this torch has no flight recorder (torch._C._distributed_c10d._dump_fr_trace)")
        return [entry_of(e) for e in loads(_dump_fr_trace()).get("entries", [])]

    return collectives


collectives = _flight_recorder()


def to_cpu(obj: Any) -> Any:
    """Detached CPU copies of every tensor in ``obj`` (lists, tuples and dicts followed): safe to return."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
