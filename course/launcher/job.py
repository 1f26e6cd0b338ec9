"""Run a Python function as N real ranks of a torch.distributed job.

``run_ranks(fn, world_size)`` calls ``fn(rank, *args)`` in ``world_size``
processes with the torchrun environment set (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``dist.init_process_group(backend)``
works with no other arguments. The backend chosen for the job is in the
``DDP_COURSE_BACKEND`` environment variable (see :func:`course.backend`).

How (DESIGN.md has the measurements behind each choice):

* ranks are forked from a multiprocessing *forkserver* with torch,
  torch.distributed and torch._dynamo preloaded (:mod:`course.launcher.forkserver`),
  through ``torch.multiprocessing.start_processes``: fork speed after the first job,
  safe when the caller has initialised CUDA or runs threads (a Jupyter kernel);
* the function and its arguments travel by value with cloudpickle, so
  functions, classes and globals defined in a notebook work;
* the ranks meet through a FileStore in the job's private folder (no port to
  race for, no socket: each TCPStore connection costs a reverse DNS lookup,
  5 s where the resolver drops it); MASTER_ADDR:MASTER_PORT is still a real
  TCPStore, hosted by the launching process as torchrun's agent hosts one;
* each rank runs in its own session; on a failure or at the deadline the whole
  session (rank and any children) is killed, and the error says which ranks
  returned, which failed and which were stuck, with their last output.
"""

from __future__ import annotations

import functools
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
import types
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from course.envnames import BACKEND_ENV, CPUS_ENV, GRADING_ENV, STALLS_ENV
from course.errors import (
    LOST_PEER_ADVICE,
    SAME_COLLECTIVES,
    RankFailedError,
    RankFailure,
    RankStallError,
    RankTimeoutError,
    connection_lost,
    describe_exit,
    explain,
    lost_peer,
    rank_list,
    were,
)
from course.launcher import forkserver
from course.launcher.output import RankOutput
from course.launcher.settings import SETTINGS
from course.launcher.spec import job_specs
from course.launcher.stall import IDLE_WINDOW, StallWatch
from course.proc import kill_group

DEFAULT_TIMEOUT = 120.0
_GRACE = 1.0  # seconds other ranks get to report their own error after the first failure


def _code_reduce(code):
    """cloudpickle's code reducer, keeping the real file name (it writes "<dynamic-code>"),
    so tracebacks from the ranks can show the student's notebook lines."""
    ctor, args = cloudpickle.cloudpickle._code_reduce(code)
    return ctor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
    """Pickle ``obj`` by value where needed (notebook functions, classes, globals)."""
    with io.BytesIO() as buf:
        try:
            _Pickler(buf).dump(obj)
        except AttributeError:  # cloudpickle internals moved: lose only the file names
            return cloudpickle.dumps(obj)
        return buf.getvalue()


def dumps_payload(fn, args: tuple) -> bytes:
    """A job's payload: ``fn``, then ``args``, two pickles of one pickler (an object both hold stays one object).

    The rank reads them in two stages (:func:`course.launcher.rank.load_payload`): the harness and the modules it
    binds at import first, the arguments (the student's objects) after."""
    for kind in (_Pickler, cloudpickle.Pickler):
        with io.BytesIO() as buf:
            pickler = kind(buf)
            try:
                pickler.dump(fn)
                pickler.dump(tuple(args))
            except AttributeError:
                if kind is _Pickler:
                    continue  # cloudpickle internals moved: lose only the file names
                raise
            return buf.getvalue()
    raise AssertionError("unreachable")


@dataclass
class JobResult:
    """Everything a finished job reports, rank by rank (index = rank)."""

    #: what ``fn`` returned on each rank
    values: list[Any]
    #: each rank's printed output (stdout and stderr interleaved), possibly truncated at the front
    outputs: list[str]
    #: whether the default process group was still initialised when ``fn`` returned
    pg_initialized: list[bool]
    #: whether ``fn`` called ``dist.destroy_process_group()``
    destroy_called: list[bool]
    backend: str = "gloo"
    port: int = 0
    elapsed: float = 0.0


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    echo: bool = True,
    env: dict | None = None,
    detect_stalls: bool | None = None,
) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` ranks and return their results in rank order.

    Each rank has the torchrun environment, so inside ``fn``::

        dist.init_process_group(course.backend())   # gloo on CPU, nccl on GPUs

    works with no other arguments. See :func:`launch` for the errors raised.
    """
    return launch(fn, world_size, args=args, backend=backend, timeout=timeout, echo=echo, env=env,
                  detect_stalls=detect_stalls).values


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    echo: bool = True,
    env: dict | None = None,
    num_threads: int | None = None,
    safe_results: bool = False,
    detect_stalls: bool | None = None,
    stall_window: float | None = None,
) -> JobResult:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks; return a :class:`JobResult`.

    Raises :class:`~course.errors.RankFailedError` if a rank raised or died and
    :class:`~course.errors.RankTimeoutError` if the job passed ``timeout`` seconds, or
    :class:`~course.errors.RankStallError` (a RankTimeoutError) as soon as the ranks are
    deadlocked: all idle, waiting in collectives that can never complete (another op, other
    shapes, or a peer that returned); see :mod:`course.launcher.stall`. ``detect_stalls=False``
    (or ``DDP_COURSE_DETECT_STALLS=0`` in the environment) leaves every hang to the deadline;
    ``stall_window`` shortens the seconds of idleness before the ranks are asked (default
    :data:`~course.launcher.stall.IDLE_WINDOW`; for a job known to hang, such as a grader's own run of a broken
    script: a verdict still needs two identical answers with no CPU activity between them). With ``echo`` each line a rank prints is shown on the caller's stdout as
    ``[rank r] ...`` (never on its stderr). ``env`` adds variables for the ranks.

    ``safe_results``: the caller does not trust the code on the ranks (a grader
    running a submission): results travel as ``torch.save`` data and are read with
    ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples,
    dicts only), so a rank cannot make the caller run code by what it returns;
    exception objects are not sent back, only their type name, text and traceback.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"run_ranks needs a function to run on each rank, got {type(fn).__name__}")
    backend_name = resolve_backend(backend, world_size)
    safe_results = safe_results or SETTINGS.safe_results
    try:
        payload = dumps_payload(fn, tuple(args))
    except Exception as exc:
        raise TypeError(
            f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: {exc}. "
            "Everything the function uses must be picklable (no open files, locks or live process groups)."
        ) from exc
    if num_threads is None:
        num_threads = max(1, cpus() // world_size)

    forkserver.ensure_running()
    port = _agent_store().port
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddp-course-job-") as jobdir:
        os.chmod(jobdir, 0o700)
        specs = job_specs(payload, world_size, port, backend_name, env, jobdir, num_threads, safe_results, timeout)
        tails = [RankOutput(rank, spec.log_path, echo) for rank, spec in enumerate(specs)]
        context = forkserver.start(_rank_entry(), (specs,), world_size)
        processes = context.processes
        try:
            if detect_stalls is None:
                detect_stalls = os.environ.get(STALLS_ENV, "1") != "0"
            watch = StallWatch([p.pid for p in processes], [s.probe_path for s in specs],
                               [s.result_path for s in specs],
                               IDLE_WINDOW if stall_window is None else float(stall_window)) if detect_stalls else None
            outcome = _wait(processes, tails, started + timeout, watch, [s.error_path for s in specs])
        finally:
            for process in processes:
                kill_group(process.pid)
            for process in processes:
                process.join(timeout=5)
            for process in processes:
                kill_group(process.pid)  # children that outlived their rank
            for tail in tails:
                tail.pump(final=True)
            for path in context.error_files:
                _remove(path)
        elapsed = time.monotonic() - started
        return _report(outcome, processes, specs, tails, world_size, timeout, backend_name, port, elapsed, safe_results)


def backend(world_size: int | None = None) -> str:
    """The backend for this job: the launcher's choice inside ``run_ranks``, else detected.

    Detection (under torchrun or anywhere else): ``nccl`` when CUDA is available
    with at least ``world_size`` GPUs (one GPU cannot host two NCCL ranks), else ``gloo``.
    """
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        return chosen
    if world_size is None:
        world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return resolve_backend("auto", world_size)


def resolve_backend(name: str, world_size: int) -> str:
    """``auto``: nccl with a GPU per rank, else gloo; a named backend is checked, not second-guessed.

    ``nccl`` asked for without a GPU per rank fails here, before any rank starts,
    with what to change: NCCL refuses two ranks on one GPU, and without CUDA every
    rank would fail in ``init_process_group`` with a less helpful message.
    """
    if name not in ("auto", "gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ValueError(f"unknown backend {name!r}: use 'auto', 'gloo' or 'nccl'")
    if name not in ("auto", "nccl"):
        return name
    from course.launcher.gpus import gpu_count

    gpus = gpu_count()  # never torch.cuda.is_available(): it initialises CUDA in a process that forks ranks
    if name == "nccl" and gpus == 0:
        raise ValueError(
            "backend 'nccl' needs CUDA GPUs, one per rank, but torch sees none. "
            "Use backend='auto' (gloo here) or backend='gloo'."
        )
    if name == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank: {world_size} ranks asked for, but this machine has "
            f"{gpus} GPU{'s' if gpus > 1 else ''} (NCCL cannot put two ranks on one GPU). Use at most {gpus} "
            "ranks, backend='gloo', or backend='auto' (nccl when there is a GPU per rank, else gloo)."
        )
    return "nccl" if gpus >= world_size else "gloo"


def cpus() -> int:
    """The cores this process's jobs share: ``DDP_COURSE_CPUS`` when set (autograde running several
    submissions at once gives each its part of the machine), else the machine's."""
    try:
        return max(1, int(os.environ[CPUS_ENV]))
    except (KeyError, ValueError):
        return os.cpu_count() or 1


def warm_up() -> None:
    """Start the forkserver now (torch preloaded) so the first job is fast too.

    Does nothing in a sandboxed grading kernel (``DDP_COURSE_GRADING=1``): no check runs
    there (the verifier runs them), so a forkserver would only cost ~2 s of CPU per submission.
    """
    if os.environ.get(GRADING_ENV) == "1":
        return
    forkserver.ensure_running()


def _load(path: str, safe: bool) -> dict | None:
    try:
        with open(path, "rb") as fh:
            if safe:
                import torch

                # on the CPU: a rank's GPU tensors must not initialise CUDA in the process that forks ranks
                obj = torch.load(fh, map_location="cpu", weights_only=True)
                return obj if isinstance(obj, dict) else None
            return cloudpickle.loads(fh.read())
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a half-written or unloadable report
        return {"traceback": "", "type": type(exc).__name__, "message": f"(report unreadable: {type(exc).__name__})"}


@functools.cache
def _agent_store():
    """The TCPStore this process hosts at MASTER_ADDR:MASTER_PORT, as torchrun's agent does (the cache
    keeps it alive).

    The ranks' own rendezvous goes through a file store in the job folder (see
    ``rank._rendezvous_through_file``); this store keeps MASTER_PORT a real
    store for code that connects to it, and is made once because each TCPStore
    connection can cost a slow reverse DNS lookup.
    """
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def _rank_entry():
    from course.launcher import rank

    return rank.rank_main


def _remove(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def _wait(processes, tails, deadline: float, watch: StallWatch | None = None, error_paths=()) -> dict:
    """Wait for all ranks, the first failure (plus a short grace), a deadlock (``watch``) or the deadline.

    At the deadline, a rank that had already written its error report (``error_paths``) but had not yet
    exited is a rank that raised, not one still running; the others are ``running``. What they report after
    that (a peer the launcher killed first makes them raise "connection closed") is not theirs."""
    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    failed_at: dict[int, float] = {}
    grace_end = None
    stall = None
    while pending:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if watch is not None and not failed_at and stall is None:
            stall = watch.poll(sorted(pending.values()), now)
        if now >= deadline or stall is not None:
            if failed_at:
                break
            running = [r for r in sorted(pending.values())
                       if not (r < len(error_paths) and os.path.exists(error_paths[r]))]
            for tail in tails:
                tail.pump()
                tail.echo = False  # the stack dumps go into the error, not the live output
            for rank in running:  # ask each stuck rank where it is (faulthandler)
                try:
                    os.kill(processes[rank].pid, signal.SIGUSR1)
                except (ProcessLookupError, TypeError):
                    pass
            time.sleep(0.3)
            return {"timeout": True, "running": running, "failed_at": failed_at, "stall": stall}
        limit = min(0.05, deadline - now)
        ready = multiprocessing.connection.wait(list(pending), timeout=max(limit, 0))
        for tail in tails:
            tail.pump()
        for sentinel in ready:
            rank = pending.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                failed_at[rank] = time.monotonic()
                if grace_end is None:
                    grace_end = time.monotonic() + _GRACE
    return {"timeout": False, "running": sorted(pending.values()), "failed_at": failed_at}


def _report(outcome, processes, specs, tails, world_size, timeout, backend_name, port, elapsed, safe) -> JobResult:
    values: list[Any] = [None] * world_size
    meta: list[dict] = [{} for _ in range(world_size)]
    returned: list[int] = []
    failures: dict[int, RankFailure] = {}
    for rank, spec in enumerate(specs):
        result = _load(spec.result_path, safe)
        error = _load(spec.error_path, safe)
        last = tails[rank].last()
        # A rank that returned may still have been killed while it waited for its peers.
        if result is not None and "value" in result:
            values[rank] = result["value"]
            meta[rank] = result
            returned.append(rank)
        elif result is not None and processes[rank].exitcode == 0:  # returned, but unreadable
            failures[rank] = RankFailure(
                rank, "raised", "", "TypeError",
                f"rank {rank} returned a value the launcher cannot read {result.get('message', '')}: "
                "return only tensors, numbers, strings, lists, tuples and dicts",
                0, last,
            )
            outcome["failed_at"].setdefault(rank, time.monotonic())
        elif outcome["timeout"] and rank in outcome["running"]:  # running at the deadline, whatever it wrote after
            failures[rank] = RankFailure(rank, "timeout", exitcode=None,
                                         last_output=_user_frames(last, specs[rank].cell_names,
                                                                  specs[rank].grader_dirs))
        elif error is not None:
            exc = None
            if error.get("exception") and not safe:
                try:
                    exc = cloudpickle.loads(error["exception"])
                except Exception:
                    exc = None
            failures[rank] = RankFailure(
                rank, "raised", str(error.get("traceback", "")), str(error.get("type", "")),
                str(error.get("message", "")), processes[rank].exitcode, last, exc,
            )
        elif rank in outcome["failed_at"]:
            code = processes[rank].exitcode
            failures[rank] = RankFailure(rank, "exited", exitcode=code, last_output=last,
                                         message=describe_exit(code))
        else:
            failures[rank] = RankFailure(rank, "stopped", exitcode=processes[rank].exitcode, last_output=last)

    if not failures:
        return JobResult(
            values=values,
            outputs=[t.text() for t in tails],
            pg_initialized=[bool(m.get("pg_initialized")) for m in meta],
            destroy_called=[bool(m.get("destroy_called")) for m in meta],
            backend=backend_name,
            port=port,
            elapsed=elapsed,
        )
    if outcome.get("stall") is not None:
        verdict = outcome["stall"]
        summary = (f"the job ({world_size} ranks) is deadlocked, stopped after {elapsed:.1f} s: {verdict.summary}. "
                   f"{verdict.hint[:1].upper()}{verdict.hint[1:]}.")
        raise RankStallError(summary, failures, returned, world_size, timeout, verdict=verdict)
    if outcome["timeout"]:
        running = [r for r, f in failures.items() if f.kind == "timeout"]
        summary = (
            f"the job ({world_size} ranks) did not finish within {timeout:g} s: "
            f"{were(running)} still running and killed"
            + (f"; {rank_list(returned)} had returned" if returned else "; no rank had returned")
            + ". A rank stuck here usually waits in a collective (all_reduce, barrier, a DDP "
            f"backward) that another rank never called, or loops forever: {SAME_COLLECTIVES}. "
            "The last output of each stuck rank shows where it was."
        )
        raise RankTimeoutError(summary, failures, returned, world_size, timeout)
    order = _same_errors_by_rank(sorted(outcome["failed_at"], key=lambda r: _failure_key(r, failures, specs, outcome)),
                                 failures)
    first = order[0] if order else min(failures)
    summary = _failure_summary(first, failures, returned, order, world_size)
    raise RankFailedError(summary, failures, returned, world_size, order)


_MACHINERY = ("multiprocessing/", "course/launcher/rank.py", "torch/multiprocessing/", 'File "<string>"', "c10d_logger.py")


def _user_frames(lines: list[str], cell_names: dict[str, str] | None = None, hidden=()) -> list[str]:
    """Drop the launcher's own frames from a faulthandler stack dump, and those of the engine and the check packages
    (``hidden`` folders: a grader's frames are no student's business, nor its paths); name a notebook cell's file
    as IPython does (``File "/tmp/ipykernel_1/2.py", line 5 in step`` -> ``Cell In[3], line 5 in step``)."""
    engine = tuple(f'File "{d.rstrip(os.sep)}{os.sep}' for d in hidden)
    kept = [line for line in lines if not any(m in line for m in _MACHINERY)
            and not line.lstrip().startswith(engine + ('File "<frozen ',))]
    for path, label in (cell_names or {}).items():
        kept = [line.replace(f'File "{path}", line', f"{label}, line") for line in kept]
    return kept


def _same_errors_by_rank(order: list[int], failures) -> list[int]:
    """Ranks that raised the same error on their own did so in no meaningful order (which wrote first is a race):
    those come lowest rank first, so the same job reads the same every time; the rest keep their order."""
    def error(rank):
        f = failures.get(rank)
        return (f.exc_type, f.message) if f is not None and f.kind == "raised" and not lost_peer(f.message) else None

    if not order or error(order[0]) is None:
        return order
    same = [r for r in order if error(r) == error(order[0])]
    return sorted(same) + [r for r in order if r not in same]


def _failure_key(rank, failures, specs, outcome):
    """Root causes first: a rank that lost a peer's connection failed *because* of another rank;
    then by when the rank wrote its report (more exact than when the launcher noticed)."""
    failure = failures.get(rank)
    # a timed-out rank may have waited for a peer alive elsewhere: only a closed connection is a consequence
    secondary = failure is not None and connection_lost(failure.message)
    try:
        written = os.stat(specs[rank].error_path).st_mtime_ns
    except OSError:
        written = float("inf")
    return (secondary, written, outcome["failed_at"][rank])


def _failure_summary(first, failures, returned, order, world_size) -> str:
    f = failures[first]
    if f.kind == "raised":
        what = f"rank {first} raised {f.exc_type}: {f.message}".rstrip(": ")
    else:
        what = f"rank {first} {f.message}"
    lines = [f"{what}  ({world_size}-rank job)"]
    later = [r for r in order[1:] if r in failures and failures[r].kind != "stopped"]
    # a rank that lost its peer failed because of the first; one that raised something else failed on its own
    consequences = [r for r in later if failures[r].kind == "raised" and lost_peer(failures[r].message)]
    if consequences:
        lines.append(f"then {rank_list(consequences)} failed too, as a consequence: a peer of a failed rank cannot "
                     "finish its collectives")
    for r in (r for r in later if r not in consequences):
        other = failures[r]
        if other.kind != "raised":
            lines.append(f"then rank {r} {other.message}")
        elif (other.exc_type, other.message) == (f.exc_type, f.message):
            lines.append(f"rank {r} raised the same error on its own (not because of rank {first})")
        else:
            lines.append(f"rank {r} raised {other.exc_type}: {other.message} on its own (not because of rank {first})"
                         .replace(":  on", " on"))
    stopped = [r for r, x in failures.items() if x.kind == "stopped"]
    if stopped:
        lines.append(f"{were(stopped)} stopped by the launcher")
    if returned:
        lines.append(f"{rank_list(returned)} returned normally")
    known = explain(f"{f.message}\n{f.traceback}") if f.kind == "raised" else None
    if known:
        lines.append(f"hint: {known}")
    elif f.kind == "raised" and connection_lost(f.message):
        lines.append(f"hint: {LOST_PEER_ADVICE}")
    return "\n".join(lines)
