"""Checks for "what a step costs" (exercises/ex2-ddp-basics/ddp_from_scratch.ipynb, part 3; issue 28).

The student predicts, without running anything, what one training step communicates:

* ``plan_step(layers, world_size, strategy, bucket_cap_mb)`` -> the collectives one steady-state step
  runs under ``"ddp"`` (DistributedDataParallel), ``"zero"`` (ZeroRedundancyOptimizer with Adam, under
  DDP) or ``"fsdp"`` (``fully_shard`` on every layer, then the root), as ``(op, numel)`` pairs, ``numel``
  the values of the whole tensor (the gathered result of an all-gather, the input of a reduce-scatter).
  :func:`check_step_plan` compares them with what a real job of that model on that many ranks ran:
  the grader's own job, no student code in it, with :mod:`graders.common.comm_spy` recording every collective
  as torch ran it.
* ``step_cost(plan, world_size, alpha, bandwidth)`` -> ``(bytes each rank sends, seconds)`` under the
  ring alpha-beta model; :func:`check_step_cost` compares it with :mod:`course.costmodel` on the plans
  real jobs ran, for links of real machines.

The student's functions run in a rank of their own (they are the student's code), where the course's
own cost model refuses: the answer must be the student's arithmetic. A prediction must not measure, nor
use the grader's model (issue 37); what the rank does so that it cannot, all set up before the student's
first call:

* every function of :mod:`course.costmodel` refuses (:func:`course.checks.refuse`): the module's own, a reference
  the student's code bound earlier, a copy of it made by value (``cloudpickle.register_pickle_by_value``, a
  ``types.FunctionType`` of its code at the notebook's top level) or later (from its code object, or its source
  compiled anew);
* the student's calls run in a thread under a seccomp filter (the kernel's, irreversible, inherited by any
  thread it starts) that refuses to start processes (fork, vfork, execve, a clone that is not a thread),
  to open files (open, openat, openat2, creat: no ``importlib.reload`` or exec of a module's source, no
  import of a module not loaded yet) and to change resource limits; the process's address space is
  limited (:data:`MEMORY_LIMIT` above what it used): no job, no subprocess, no copy of the grader's model;
* ``check_step_plan`` also asks for models drawn at random in the grader's process (``os.urandom``), each
  with layers of 10^10 to 10^11 parameters on dozens of ranks: too large for any step to be run, in torch's
  fake process group or elsewhere, and for any table; only arithmetic gives their plans. They are judged
  against :func:`course.costmodel.step_collectives` (which ``tests/test_costmodel.py`` holds to real jobs).
"""

from __future__ import annotations

import math
import numbers
import os
import random
import tempfile
import threading
import types
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn

from course import checks, costmodel
from course.checks import CheckFailed, passed, seal
from graders.common import comm_spy

STRATEGIES = ("ddp", "zero", "fsdp")
RTOL = 1e-6  # float64 arithmetic of the same formulas differs by rounding only


def layer_shapes(widths) -> list[list[tuple[int, ...]]]:
    """The parameter shapes of ``Linear(widths[0], widths[1]), ..., Linear(widths[-2], widths[-1])``."""
    return [[(b, a), (b,)] for a, b in zip(widths, widths[1:])]


def _model(widths, seed):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _step_records(rank, widths, strategy, bucket_cap_mb, seed):
    """The collectives of the third step of ``strategy`` (the first two build DDP's buckets), measured."""
    model = _model(widths, seed)
    x = torch.randn(4, widths[0], generator=torch.Generator().manual_seed(seed + rank))
    if strategy in ("ddp", "zero"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb)
        opt = (ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
               if strategy == "zero" else torch.optim.SGD(wrapped.parameters(), lr=1e-3))
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        wrapped = fully_shard(model)
        opt = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    world_size = dist.get_world_size()
    for _ in range(3):  # the spy of the last step is kept
        mode, records = comm_spy.spy()
        with mode:
            wrapped(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    ran = []
    for r in records:
        numel = sum(v.numel() for v in r["values"])
        ran.append((r["op"], numel * world_size if r["op"] == "all_gather" else numel))
    return ran


def _measure_harness(rank, widths, bucket_cap_mb, seed):
    checks.join_job()
    return {s: _step_records(rank, widths, s, bucket_cap_mb, seed) for s in STRATEGIES}


def measured(check: str, widths, world_size: int, bucket_cap_mb: float, seed: int = 0) -> dict:
    """What each strategy's step ran on rank 0 of a real job: ``{strategy: [(op, numel), ...]}``."""
    key = ("ex2_cost.measured", tuple(widths), world_size, bucket_cap_mb, seed)
    job = checks.memo(check, key, lambda: checks.run(check, _measure_harness, world_size,
                                                     args=(list(widths), bucket_cap_mb, seed)))
    return job.values[0]


# --- the student's functions, run as student code -------------------------------------------------


#: what a call of the grader's model (or a copy of it) raises in the asking rank
REFUSED = "course.costmodel is the grader's model, refused to the answer: compute the cost from the formulas yourself"


MEMORY_LIMIT = 2 * 2**30  # bytes of address space the asking rank may add to what it holds before the calls
_SEALED = "refused by the grader's sandbox"  # in the error text of a call the filter refused


def _disarm_costmodel() -> int:
    """Every function of course.costmodel refuses in this rank, wherever a copy of it lives (the module's own, one
    the student's code bound or copied by value at the notebook's top level, one made later from its code or its
    source): :func:`course.checks.refuse`."""
    own = [fn for fn in vars(costmodel).values() if isinstance(fn, types.FunctionType)
           and fn.__module__ == costmodel.__name__]
    return checks.refuse(own, REFUSED)


def _limit_memory() -> None:
    import resource

    if not os.path.exists("/proc/self/statm"):  # not Linux: no cap, as no seal (course.checks.seal)
        return
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = used + MEMORY_LIMIT
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _ask_harness(rank, fn, calls):
    """Call the student's ``fn`` on each argument tuple, sealed (see the module's docstring); plain data back
    (or the error's text)."""
    _disarm_costmodel()
    tempfile.gettempdir()  # found now: sealed, a job's first file fails as the seal's refusal, not as "no temp folder"
    _limit_memory()
    box: dict = {}

    def ask():
        try:  # where the platform has no seccomp (a self-check on a Mac) the calls run unsealed (see seal)
            seal(files=True)
        except OSError as err:  # on Linux a filter that cannot be installed fails the check (it was tampered with)
            box["sandbox"] = str(err)
        answers = []
        for args in calls:
            try:
                answers.append(("ok", _plain(fn(*args))))
            except BaseException as err:  # noqa: BLE001 - the student's error is the answer to report
                text = f"{type(err).__name__}: {err}"
                if isinstance(err, (PermissionError, MemoryError)) or "Operation not permitted" in text \
                        or "can't allocate memory" in text:
                    text += f" ({_SEALED}: no process, no file, no more memory)"
                answers.append(("error", text))
        box["answers"] = answers

    thread = threading.Thread(target=ask, name="student")
    thread.start()
    thread.join()
    if box.get("sandbox"):
        raise RuntimeError(f"the grader could not seal the student's calls: {box['sandbox']}")
    return box["answers"]


def _plain(value):
    """The answer as plain data, made in the rank. Numbers of any library (numpy's integers and floats, 0-d
    tensors) are numbers: a plan counted with ``np.prod`` is a plan."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()  # a tensor, a numpy array or scalar: Python numbers and lists
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return repr(value)


def _ask(check, fn, calls):
    return checks.run(check, _ask_harness, 1, args=(fn, list(calls))).values[0]


# --- 1. the plan --------------------------------------------------------------------------------------


def _as_plan(answer) -> Counter | None:
    try:
        return Counter((str(op), int(n)) for op, n in answer if float(n) == int(n))
    except (TypeError, ValueError):
        return None


def _describe(counter: Counter) -> str:
    return ", ".join(f"{k} x {op} of {n}" if k > 1 else f"{op} of {n}" for (op, n), k in sorted(counter.items()))


def _plan_hint(strategy, want: Counter, got: Counter, world_size) -> str:
    ops = lambda c, op: sum(k for (o, _), k in c.items() if o == op)  # noqa: E731
    if strategy == "fsdp":
        layers = ops(want, "reduce_scatter")
        if ops(got, "all_gather") == layers:
            return ("FSDP2 gathers each layer twice per step: before its forward, and again before its backward "
                    "(it resharded the layer after forward to free the memory)")
        if sorted(n for (o, n), k in got.items() for _ in range(k) if o == "reduce_scatter") != sorted(
                n for (o, n), k in want.items() for _ in range(k) if o == "reduce_scatter"):
            return (f"FSDP2 splits each parameter on dim 0 into {world_size} equal pieces, padding dim 0 up to a "
                    f"multiple of {world_size}: a layer's collectives carry the padded size")
    if strategy == "zero" and not ops(got, "broadcast"):
        return "after its step, ZeRO sends every parameter from the rank that owns its optimizer state to the others"
    if strategy in ("ddp", "zero") and ops(got, "all_reduce") != ops(want, "all_reduce"):
        return ("DDP reduces buckets, not parameters: gradients in reverse parameter order, a bucket closes once "
                "it holds at least bucket_cap_mb MiB (the tensor that crosses the cap stays in it)")
    return "compare your plan with the collectives listed above, one strategy at a time"


def check_step_plan(plan_step, widths=(12, 32, 20, 6), world_size=2, bucket_cap_mb=0.002, seed=0):
    """``plan_step`` predicts exactly the collectives a real step of each strategy ran."""
    check = "check_step_plan"
    checks.require_written(check, plan_step=plan_step)
    layers = layer_shapes(widths)
    truth = measured(check, widths, world_size, bucket_cap_mb, seed)
    cases = [(layers, world_size, s, bucket_cap_mb, truth[s], False) for s in STRATEGIES]
    for big_layers, big_ws, big_cap in giant_models():
        cases += [(big_layers, big_ws, s, big_cap, costmodel.step_collectives(big_layers, big_ws, s, big_cap), True)
                  for s in STRATEGIES]
    answers = _ask(check, plan_step, [c[:4] for c in cases])
    for (layers, world_size, strategy, bucket_cap_mb, want, giant), (status, answer) in zip(cases, answers):
        _judge_plan(check, layers, world_size, strategy, bucket_cap_mb, want, giant, status, answer)
    passed(check)


GIANT_MODELS = 2  # models check_step_plan draws at random, too large to run: their plans are arithmetic


def giant_models(count: int = GIANT_MODELS) -> list[tuple]:
    """``count`` models drawn from os.urandom in the grader's process: (layer shapes, world size, bucket cap).
    Each layer has 10^10 to 10^11 parameters (40 to 400 GB of float32): no step of them can run anywhere
    the grader runs, in a real job or in torch's fake process group. Dim 0 is never a multiple of the world
    size: FSDP2's padding always shows."""
    rng = random.Random(os.urandom(16))
    out = []
    for _ in range(count):
        world_size = rng.randrange(16, 130)
        widths = [rng.randrange(100_000, 320_000) for _ in range(rng.randrange(3, 6))]
        widths = [w + 1 if w % world_size == 0 else w for w in widths]
        out.append((layer_shapes(widths), world_size, rng.choice((25.0, 50.0, 100.0, 250.0, 1000.0))))
    return out


def _judge_plan(check, layers, world_size, strategy, bucket_cap_mb, want, giant, status, answer):
    where = (f"for strategy={strategy!r}, world_size={world_size}, bucket_cap_mb={bucket_cap_mb}, "
             f"layers={layers}")
    ran = "a real" if not giant else "such a"
    if status == "error":
        raise CheckFailed(check, f"plan_step raised {answer} {where}", expected="a list of (op, numel) pairs",
                          got=answer, hint=(_GIANT_HINT if giant or _SEALED in answer else
                                            "run plan_step on this model by hand and read the traceback"))
    want, got = Counter(want), _as_plan(answer)
    if got is None:
        raise CheckFailed(check, f"plan_step did not return (op, numel) pairs {where}",
                          expected="a list like [('all_reduce', 1234), ...]", got=repr(answer)[:300],
                          hint="return one (op name, number of values) pair per collective")
    if got != want:
        missing, extra = want - got, got - want
        raise CheckFailed(
            check, f"the plan for {strategy} is not what {ran} {strategy} step runs {where}",
            expected=(f"what the job ran: {_describe(want)}" if not giant else
                      f"what such a step runs (a model too large to run: torch's behaviour, by arithmetic): "
                      f"{_describe(want)}"),
            got=f"your plan: {_describe(got)}" + (f"; never ran: {_describe(extra)}" if extra else "")
            + (f"; missing: {_describe(missing)}" if missing else ""),
            hint=_plan_hint(strategy, want, got, world_size))


_GIANT_HINT = (
    "plan_step must predict, not measure: it is also asked about models far too large to build or run (layers of "
    "10^10 parameters and more, on dozens of ranks), in a process that may not start processes, open files or use "
    "more memory, where the course's cost model refuses. Compute the plan from the shapes alone: DDP's buckets, "
    "ZeRO's broadcasts and FSDP2's padded sizes are arithmetic on the numbers of values")


# --- 2. the cost ------------------------------------------------------------------------------------------


def _close(a, b) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12)


def _cost_hint(plan, world_size, link, got) -> str:
    n = world_size
    raw = costmodel.step_cost(plan, n, link)
    sizes = sum(numel * costmodel.FLOAT32 for _, numel in plan)
    if _close(got[0], raw.bytes_sent) and not _close(got[1], raw.seconds):
        without_alpha = sum(costmodel.collective_cost(op, k * 4, n, link._replace(alpha=0.0)).seconds
                            for op, k in plan)
        if _close(got[1], without_alpha):
            return "every step of a ring pays the latency alpha: 2 (N - 1) steps for an all-reduce, N - 1 otherwise"
        return ("the time of a collective is its steps x alpha + the bytes its busiest rank sends / bandwidth "
                "(a broadcast's root sends the whole tensor)")
    if _close(got[0], sizes) or _close(got[0], 2 * sizes):
        return ("a rank sends only (N - 1) / N of a tensor in a ring all-gather or reduce-scatter, 2 (N - 1) / N "
                "in an all-reduce: the rest it receives")
    return "bytes: 2 (N - 1) / N x n for an all-reduce, (N - 1) / N x n for the others (n: the whole tensor, 4 bytes a value)"


def check_step_cost(step_cost, widths=(12, 32, 20, 6), world_size=2, bucket_cap_mb=0.002,
                    machines=("DGX H100 (NVLink 4)", "Ethernet 10 Gb/s"), seed=0):
    """``step_cost`` gives the ring alpha-beta model's bytes and seconds for what real steps ran."""
    check = "check_step_cost"
    checks.require_written(check, step_cost=step_cost)
    truth = measured(check, widths, world_size, bucket_cap_mb, seed)
    calls, cases = [], []
    for name in machines:
        link = costmodel.MACHINES[name]
        for strategy in STRATEGIES:
            calls.append((list(truth[strategy]), world_size, link.alpha, link.bandwidth))
            cases.append((name, strategy, link))
    answers = _ask(check, step_cost, calls)
    for (name, strategy, link), (plan, *_), (status, answer) in zip(cases, calls, answers):
        want = costmodel.step_cost(plan, world_size, link)
        where = f"for the {strategy} step at world_size={world_size} on {name} (alpha={link.alpha:g} s, " \
                f"bandwidth={link.bandwidth:g} B/s)"
        if status == "error":
            raise CheckFailed(check, f"step_cost raised {answer} {where}", got=answer,
                              expected="(bytes each rank sends, seconds)", hint="run step_cost by hand on this plan")
        try:
            got = (float(answer[0]), float(answer[1]))
        except (TypeError, ValueError, IndexError):
            raise CheckFailed(check, f"step_cost did not return (bytes, seconds) {where}", got=repr(answer)[:200],
                              expected="a pair of numbers", hint="return (bytes each rank sends, seconds)") from None
        if not (_close(got[0], want.bytes_sent) and _close(got[1], want.seconds)):
            raise CheckFailed(check, f"step_cost's figures are not the ring model's {where}",
                              expected=f"{want.bytes_sent:.6g} bytes, {want.seconds:.6g} s (plan: {_describe(Counter(plan))})",
                              got=f"{got[0]:.6g} bytes, {got[1]:.6g} s", hint=_cost_hint(plan, world_size, link, got))
    passed(check)
