"""The check API: what an exercise's checks are written with.

A *check* is a plain function that a one-line nbgrader test cell calls with the
student's objects, e.g. ``graders.ddp_basics.check_training(train)``. It

1. makes sure the answer is written (:func:`require_written`: nbgrader's untouched
   stub fails at once with "not written yet", no job started);
2. runs a *harness* (a function of yours, ``harness(rank, *args)``) on N real ranks
   with :func:`run`: the harness joins the job (:func:`join_job`), calls the student's
   code, and returns what it observed (:func:`to_cpu` for tensors);
3. compares the ranks' observations with what is right and either returns (the
   cell passes; :func:`passed` prints the one line it shows) or raises
   :class:`CheckFailed`, whose text names the check, the ranks, what was expected,
   what happened and (hint level 3, when asked) what to try.

What every exercise needs is here, so an exercise module holds only its checks and their data:

* known mistakes: :func:`run` takes ``hints`` (text -> advice) and :class:`Mistake` s (a failure recognised by its
  text becomes that mistake's own message); :func:`stranded` tells a rank left alone in a collective (the one
  lost-peer list is :data:`course.errors.LOST_PEER`, the advice texts every check shares are in :mod:`course.errors`);
* :func:`on_every_rank` judges each rank's observation and names every rank that failed the same way;
* :func:`memo` runs one job for the checks that read the same observations; :func:`reference`
  computes a single-process reference once per arguments;
* :data:`REAL`, the captured-torch guard: torch's functions taken before any student code runs, for
  harnesses that must act or observe with torch's own;
* :func:`record_writes` (every file a rank writes, however the student's code reached the writing
  function) and :class:`Hold` (rank 0's write held until the other ranks wait for it: synchronisation
  judged by order, not by a race).

The same check runs in the student's notebook (a visible self-check) and in the trusted verifier
(:mod:`course.grading.verifier`) that produces the score. There the student's objects are stand-ins that can be
shipped to ranks and called, but not looked into: a check must observe through its ranks, never by reading a
student object's attributes in its own process. A crash or a hang on any rank becomes a ``CheckFailed`` that
leads with the first rank that failed. A hook a harness puts on a student's module: :func:`grader_hook`.

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
import copy
import functools
import hashlib
import os
import re
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import cloudpickle

from course.checks.backends import PLAIN_ALIAS, backend_alias, check_policy, gloo_for_cpu, prepare_alias
from course.checks.hooks import grader_hook
from course.checks.sealing import refuse, seal
from course.envnames import BACKEND_ENV, GRADING_ENV
from course.errors import (
    MISMATCH_ADVICE,
    SAME_COLLECTIVES,
    WAITS_FOREVER,
    CheckFailed,
    LaunchError,
    RankStallError,
    RankTimeoutError,
    explain,
    lost_peer,
    rank_list,
)
from course.grading.cells import CHECK_TIMEOUT, TIMEOUT_ENV, check_timeout, note_ran_on
from course.grading.student import answer_source, describe
from course.launcher.hold import Hold
from course.launcher.job import JobResult, backend, launch, resolve_backend
from course.launcher.rank import waiting_in_collective
from course.launcher.writes import paused as grader_writes
from course.launcher.writes import recording as record_writes

__all__ = [
    "CHECK_TIMEOUT", "TIMEOUT_ENV",
    "CheckFailed",
    "Hold",
    "did_not_wait",
    "Mistake",
    "REAL",
    "answer_source",
    "backend", "backend_alias", "gloo_for_cpu", "prepare_alias", "PLAIN_ALIAS", "BACKEND_ENV",
    "collectives",
    "describe",
    "check_timeout",
    "device",
    "expect",
    "grader_hook",
    "grader_writes",
    "grading",
    "join_job",
    "launch",
    "memo",
    "on_every_rank",
    "passed",
    "record_writes",
    "recorder",
    "reference", "refuse",
    "rank_list",
    "require_written",
    "require_written_source",
    "resolve_backend",
    "run",
    "seal",
    "stranded",
    "to_cpu",
    "unwritten",
    "waiting_in_collective",
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


class Mistake(NamedTuple):
    """A mistake students make, recognised in a failed job: :func:`run` then reports it in these words.

    ``seen(rank, text)``: whether the failure is this mistake (``rank``: the first rank that failed,
    or the first left waiting in a deadlock; ``text``: the failure's problem and detail);
    ``problem`` may name ``{rank}`` and ``{ws}`` (the world size). With ``expected``, the message
    also shows it, and as "got" the failure's first line (or what ``got`` finds in its text)."""

    seen: Callable[[int | None, str], bool]
    problem: str
    hint: str
    expected: str | None = None
    got: str | None = None  # a regular expression


def stranded(text: str) -> bool:
    """Whether a failure's text is that of a rank left alone in a collective: it lost its peers, the job
    did not finish in time, or it deadlocked (:func:`course.errors.lost_peer`, and :func:`run`'s words)."""
    return lost_peer(text) or "did not finish within" in text or "deadlocked" in text


def run(
    check: str,
    harness: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    hints: Iterable[tuple[str, str]] = (),
    mistakes: Iterable[Mistake] = (),
    expected: str | None = None,
    timeout: float | None = None,
    env: dict | None = None,
    stall_window: float | None = None,
    backend: str = "gloo",
) -> JobResult:
    """Run ``harness(rank, *args)`` on ``world_size`` real ranks for ``check``; their results are ``.values``.

    ``backend``: the check's backend policy. ``"gloo"`` (the default): gloo with the GPUs hidden from the ranks,
    so a submission is judged the same on every grader, with or without GPUs, at any world size; ``"auto"``: nccl
    when the machine has a GPU per rank (for a check that is about the GPU), else gloo.

    A rank that raises, dies or hangs (past ``timeout``, default :func:`check_timeout`)
    becomes a :class:`CheckFailed` that leads with the first rank that failed and shows
    its traceback (the student's frames) or where each stuck rank waited.
    A deadlock (every rank waiting in collectives that cannot complete) is reported as soon as
    it is certain, with each rank's collective and source line (:mod:`course.launcher.stall`).
    ``hints``: (text, advice) pairs; when the failure's report contains ``text`` (or,
    for ``"timeout"``, when the job hung or deadlocked), ``advice`` replaces the generic hint.
    ``mistakes``: known :class:`Mistake` s, tried in order; the first seen is the failure's message.
    ``expected``: what the check expected of the student's function, shown with any failure of the job.
    ``stall_window``: see :func:`~course.launcher.job.launch` (only for a job the check knows will hang).
    """
    backend = check_policy(backend)  # benchmarks/gpu_check.py: every check on auto
    env = {**(env or {}), "CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else env
    note_ran_on(resolve_backend(backend, world_size), hidden=backend == "gloo")  # the grade report shows it
    try:
        return launch(harness, world_size, args=args, timeout=timeout or check_timeout(), echo=False, env=env,
                      stall_window=stall_window, backend=backend)
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
    _raise_known(check, world_size, problem, ranks, detail, mistakes)
    failure = CheckFailed(check, problem, ranks=ranks, hint=hint, detail=detail, expected=expected)
    failure.hung = hung  # a check that judges what happened before the end can still do so
    raise failure


def _raise_known(check: str, world_size: int, problem: str, ranks: list[int], detail: str | None,
                 mistakes: Iterable[Mistake]) -> None:
    """Raise the first of ``mistakes`` the failure shows, in its own words."""
    text = f"{problem}\n{detail or ''}"
    waiting = sorted({int(r) for r in re.findall(r"rank (\d+) waits in", problem)})
    ranks = waiting or ranks  # a deadlock: the ranks left waiting, not those that returned
    rank = ranks[0] if ranks else None
    for mistake in mistakes:
        if not mistake.seen(rank, text):
            continue
        got = None
        if mistake.expected is not None:
            first = problem.splitlines()[0]
            found = re.search(mistake.got, text) if mistake.got else None
            got = found.group(0).rstrip(".") if found else first[:300] + (" ..." if len(first) > 300 else "")
        raise CheckFailed(check, mistake.problem.format(rank=rank, ws=world_size), ranks=ranks,
                          expected=mistake.expected, got=got, hint=mistake.hint, detail=detail)


def on_every_rank(values: list, verdict: Callable[[int, Any], None]) -> None:
    """``verdict(rank, obs)`` on every rank's observation; the first failure is raised, naming every rank
    that failed the same way."""
    failures = []
    for rank, obs in enumerate(values):
        try:
            verdict(rank, obs)
        except CheckFailed as err:
            failures.append((rank, err))
    if failures:
        first = failures[0][1]
        ranks = [rank for rank, err in failures if err.problem == first.problem]
        raise CheckFailed(first.check, first.problem, ranks=ranks, expected=first.expected, got=first.got,
                          hint=first.hint, detail=first.detail)


_MEMO: dict[str, tuple[str, Any]] = {}


def memo(check: str, key: tuple, job: Callable[[], Any]) -> Any:
    """``job()``, run once per key: checks that read the same observations share one job.

    The key holds the student's code (pickled by value), so editing and re-running a cell starts a
    new job; a failure is remembered too and re-raised under the asking check's name.
    """
    digest = hashlib.sha256(cloudpickle.dumps(key)).hexdigest()
    if digest not in _MEMO:
        if len(_MEMO) > 64:
            _MEMO.clear()
        try:
            _MEMO[digest] = ("ok", job())
        except CheckFailed as err:
            _MEMO[digest] = ("failed", err)
    kind, value = _MEMO[digest]
    if kind == "failed":
        raise CheckFailed(check, value.problem, ranks=value.ranks, expected=value.expected, got=value.got,
                          hint=value.hint, detail=value.detail) from None
    return value


def reference(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: a reference result (what a right answer computes, in one process) is computed once per
    arguments; each call gets its own copy, so a check may change what it is given."""
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return copy.deepcopy(cached(*args, **kwargs))

    wrapper.cache_clear = cached.cache_clear
    return wrapper


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
                f"{WAITS_FOREVER} that another rank never reached, e.g. a collective inside `if rank == 0:`, "
                f"or a loop that never ends; {SAME_COLLECTIVES}",
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
        hint = MISMATCH_ADVICE
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
            # a stack dump (after its header) starts with the innermost frame, the student's line: keep its start
            heads = [i for i, line in enumerate(lines) if line.startswith("Stack (most recent call first)")]
            shown = lines[heads[-1] + 1:][:8] if heads else lines[-8:]
            parts.append(f"rank {rank} was at:\n" + textwrap.indent("\n".join(shown), "    "))
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

# In __all__, the graders' one door into the engine: ``backend()`` (this job's backend, in a rank),
# ``resolve_backend(backend, world_size)`` (what "auto" becomes), ``launch`` (a job of a harness, as :func:`run`
# without the check's failure handling), ``waiting_in_collective(stack)`` (the one rule of "is this thread in a
# collective": torch's collective code on its stack, not a rendezvous); :mod:`course.checks.torchrun` for scripts.


def grading() -> bool:
    """Whether this process runs inside a grading run (the verifier's checks, or a sandboxed kernel)."""
    return os.environ.get(GRADING_ENV) == "1"


def device():
    """This rank's device: its GPU under nccl, else the CPU."""
    import torch

    if backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _joiner() -> Callable[[], Any]:
    """:func:`join_job`, with torch's functions it calls taken now: in a rank, as the harness's module imports this
    one, before any student object is unpickled (:func:`course.launcher.rank.load_payload`)."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    init, set_device, where = c10d.init_process_group, torch.cuda.set_device, device

    def join_job():
        """In a harness: join the job as the grader (not the student) and return this rank's device."""
        dev = where()
        if dev.type == "cuda":  # as the lessons teach: select the GPU first, then bind the group to it
            set_device(dev)
        init(backend(), **({"device_id": dev} if dev.type == "cuda" else {}))
        return dev

    return join_job


join_job = _joiner()


def _flight_recorder() -> Callable[[], list[dict]]:
    """:func:`collectives`, with the recorder's reader (torch's dump functions, ``pickle.loads``) taken now.

    ``course.checks`` is imported in a rank before any student object is unpickled, so code the student runs later
    cannot swap what this closure calls (``_dump_fr_trace``, ``pickle.loads``, this module's globals)."""
    from course.launcher.recorder import bind, entry_of

    recorded = bind()

    def collectives() -> list[dict]:
        """In a harness: the collectives this rank has issued so far, oldest first, as torch's flight recorder saw them.

        Each is ``{"op": "all_reduce", "seq": 5, "group": "default_pg", "sizes": [[49]], "dtypes": ["Float"],
        "p2p": False}``, DDP's own (bucket all-reduces, buffer broadcasts) and the student's alike;
        to count what a student's step issued, take ``collectives()[-1]["seq"]`` before it and keep
        the entries with a higher sequence number afterwards. The launcher turns the recorder on
        (``TORCH_FR_BUFFER_SIZE``); what it records cannot be faked by patching ``torch.distributed``
        (it is written by the process group itself), only by really communicating. Every backend's
        recorder is read (:mod:`course.launcher.recorder`: gloo's and nccl's, merged). On gloo the
        entries stay "scheduled": they say what was issued, not when it completed. A torch without
        the flight recorder raises RuntimeError. The references it uses are taken when this module is
        imported (:func:`_flight_recorder`).
        """
        if recorded is None:
            raise RuntimeError("this torch has no flight recorder (torch._C._distributed_c10d._dump_fr_trace)")
        return [entry_of(e) for e in recorded()]

    return collectives


collectives = _flight_recorder()


def recorder(stacks: bool = True) -> Callable[[], list[dict]] | None:
    """In a harness module, at import (before student code): a reader of this rank's raw flight-recorder entries
    (torch's dicts, every backend's recorder; ``stacks=False`` without stack traces), or None in a torch without
    one. :func:`collectives` is the same record in the course's shape."""
    from course.launcher.recorder import bind

    return bind(stacks)


@dataclass(frozen=True)
class RealTorch:
    """torch's own functions a harness observes and acts with, taken before any student code runs.

    :data:`REAL` is made when this module is imported: in a rank, after the harness's module and before the student's
    objects are unpickled (:func:`course.launcher.rank.load_payload`), so even code that runs as they are unpickled
    cannot swap what it holds (patching ``torch.distributed.all_reduce`` fools the student's own code only)."""

    init: Callable
    all_gather: Callable
    all_reduce: Callable
    get_backend: Callable
    get_world_size: Callable
    destroy: Callable
    save: Callable
    serialization_save: Callable
    cuda_device: Callable
    collectives: Callable[[], list[dict]]


def _real_torch() -> RealTorch:
    import torch
    from torch.distributed import distributed_c10d as c10d

    return RealTorch(init=c10d.init_process_group, all_gather=c10d.all_gather, all_reduce=c10d.all_reduce,
                     get_backend=c10d.get_backend, get_world_size=c10d.get_world_size,
                     destroy=c10d.destroy_process_group, save=torch.save,
                     serialization_save=torch.serialization.save, cuda_device=torch.cuda.current_device,
                     collectives=collectives)


#: the captured-torch guard: see :class:`RealTorch`
REAL = _real_torch()


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


def did_not_wait(check: str, hold: dict, what: str, *, returned: str, expected: str, hint: str) -> None:
    """Fail ``check`` when the :class:`Hold` of rank 0's write (its ``result``) found ranks that, for its whole
    limit, neither waited in a collective nor ``returned``; the message names the line each was running."""
    late = hold.get("neither") or []
    if not late:
        return
    sites = hold.get("sites") or {}
    site = sites.get(late[0]) or sites.get(str(late[0]))
    at = f", at line {site['line']}" + (f": {site['code']}" if site.get("code") else "") if site else ""
    raise CheckFailed(check, f"{rank_list(late)} did not wait for rank 0's {what}: for {hold['limit']:g} s after "
                      f"rank 0 began to save, {'it' if len(late) == 1 else 'they'} neither waited in a collective "
                      f"nor {returned}", ranks=late, expected=expected,
                      got=f"rank {late[0]} was still running its own code{at}", hint=hint)
