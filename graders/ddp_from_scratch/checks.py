"""Checks for exercise 2's third notebook, DDP from scratch (exercises/ex2-ddp-basics/ddp_from_scratch.ipynb).

The student writes data parallelism without ``DistributedDataParallel``: two wrapper classes with
the same interface, ``Wrapper(module, ...)``, ``wrapper(x)`` (the module's forward) and
``wrapper.finish_gradient_synchronization()`` (called after ``backward()``, before ``step()``):

* ``NaiveDDP(module)``: rank 0's parameters broadcast at construction; after backward, one
  all-reduce per gradient, averaged;
* ``BucketedDDP(module, bucket_size_mb)``: the gradients grouped in buckets by DDP's rule (in reverse
  order of ``module.parameters()``, a bucket closing once it reaches or exceeds ``bucket_size_mb`` MiB,
  the parameter that crosses the limit in it), each bucket all-reduced as one flat tensor, asynchronously, from a gradient hook as soon as all its gradients are ready;
  ``finish_gradient_synchronization`` launches what never filled and waits for every bucket.

Each check runs the class on real ranks, in a harness that builds the model, the data and the
optimizer, and judges what happened, never what the student's objects say:

* :func:`check_broadcast`: ranks seeded differently hold rank 0's weights once the wrapper exists (each
  rank's seed drawn in the rank from ``os.urandom``: rank 0's weights exist nowhere else, so no rank can
  rebuild them from a seed read in the harness's frames, as a forgery did with the public seed before);
* :func:`check_naive` and :func:`check_bucketed`: the gradients the optimizer saw at every step
  (its own step pre-hook, registered by the grader) are the ranks' average of what each rank's backward
  computed from the weights the step started with (what torch's DDP computes), as the collectives
  delivered it, and the weights after it are one SGD step with them; on three models: a plain MLP, one
  with a parameter that forward never uses, one with tied weights. "As the collectives delivered it"
  (issue 37): the harness's marker (:func:`graders.common.comm_spy.marker`) adds to every value an
  all-reduce, all-gather or send carries a number each rank draws from ``os.urandom``, so the result of
  the step's k-th collective holds the sum of every rank's k-th number on top of the gradients; the
  grader, which gets every rank's numbers, requires each parameter's gradient to be the average moved by
  one such sum (or the sum over the world size). An average made any other way (right values sent in
  decoy all-reduces whose results are dropped, with the gradients sent through the job's store, or every
  rank's batch read from the harness's frames and the average recomputed locally) carries no such sum;
* :func:`check_buckets`: what each step communicated: every collective the flight recorder lists
  (written by the process group itself; any kind, any size) is one all-reduce per bucket DDP's rule
  gives (:func:`graders.ddp_from_scratch.harness.buckets_of`, held to torch's own bucket assignment by
  the tests), and what each carried (the harness's spy on the collectives' dispatcher ops) is
  that bucket's gradients, as this rank's backward computed them (the grader recomputes them from
  the weights the step started with and the rank's batch); padding, decoys (zeros, an old copy) and
  other collectives (all_gather, send/recv, ...) fail it;
* :func:`check_overlap`: backward goes on while buckets travel. At each step one rank (chosen at
  random, another each step) waits before its backward until the others' backward has reached the
  first layer (at most ``LATE`` seconds); on every other rank, a collective carrying
  this step's gradients must have been launched before backward reached the model's first layer,
  and backward must have reached it before the late rank even started its backward: no all-reduce
  could have completed by then, so a rank that blocks in a hook (a plain ``dist.all_reduce``), or
  launched only a decoy in time, fails.

How the harness observes (and what torch's flight recorder gives and does not give) is in
:mod:`graders.ddp_from_scratch.harness`. Everything it calls to observe (the flight recorder, the
collectives' ops, the clock, the marker's random source) is taken when that module is imported, and the spy
and the marker are made when the harness starts, before any of the student's code runs in it (a wrapper whose
``__init__`` patched ``graders.common.comm_spy._CLOCK`` to date its after-backward all-reduces before backward scored
full marks on check_overlap before).
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from course import checks
from course.checks import CheckFailed, passed
from graders.common import comm_spy
from graders.ddp_from_scratch.harness import (  # noqa: F401  (make_model, buckets_of, reference: the tests' vocabulary)
    LR,
    MiB,
    buckets_of,
    local_grads,
    make_batches,
    make_model,
    reference,
    train_harness,
)

ATOL = 1e-5  # float32 sums in another order (flat buckets, a ring) differ by ~1e-7
STEPS = 3
JOB_TIMEOUT = 30.0  # seconds: a rank that waits for a bucket that never fills fails by then
KINDS = ("mlp", "unused", "tied")
LATE = 3.0  # seconds check_overlap holds a rank back at most, until the others' backward reached the first layer
# (a right answer's ~1 ms backward lets it go at once; only an answer whose backward blocks waits it out)


def _run(check, wrapper_cls, kwargs, world_size, kinds, width, seed, same_seed, steps, hint, watch=None, mark=False):
    timeout = min(checks.check_timeout(), JOB_TIMEOUT)
    job = checks.run(check, train_harness, world_size,
                     args=(wrapper_cls, kwargs, tuple(kinds), width, seed, same_seed, steps, watch, mark),
                     hints=[("timeout", hint), ("NoneType", _NONE_HINT), ("did not match the collective", _ORDER_HINT)],
                     timeout=timeout)
    return job.values


_NONE_HINT = (
    "a parameter that forward never uses (the test's model has one, `spare`) has no gradient: its `.grad` is None "
    "after backward, on every rank. Skip it in the naive version; in a bucket, use zeros in its place "
    "(`torch.zeros_like(p)`) so the bucket's flat tensor has the same length on every rank"
)

_ORDER_HINT = (
    "the ranks all-reduced tensors of different sizes at the same point: they formed different buckets, or launched "
    "them in another order. Build the buckets from `module.parameters()` in a fixed order (reversed), the same on "
    "every rank (not from a set, or anything ordered per process), and launch unfilled ones in bucket order"
)

_HANG_HINT = (
    "a rank waited for an all-reduce that never completes. If finish_gradient_synchronization waits for every "
    "bucket to fill, one holding a parameter that got no gradient (unused in forward) never does: launch the "
    "all-reduce of every bucket not launched yet (its missing gradients as zeros) before waiting. If the ranks "
    "formed different buckets (another order, a set or dict ordered per process), their all-reduces do not "
    "match: build the buckets from `module.parameters()` in a fixed order, the same on every rank"
)


# --- judging ------------------------------------------------------------------------------------


def _close(a, b, offsets=None) -> bool:
    """Whether gradient ``a`` is ``b`` (None: zeros); with ``offsets``, ``b`` plus one number of ``offsets`` on
    every value (``"any"``: any one number)."""
    if a is None or b is None:  # an unused parameter: None, or zeros (moved as its bucket was), leave SGD's weight alone
        if a is None:
            return b is None or not b.abs().max().item() > 0
        if b is None:
            b = torch.zeros_like(a)
    if a.shape != b.shape:
        return False
    diff = a.float() - b.float()
    if offsets is None:
        return diff.abs().max().item() <= ATOL
    if (diff - diff.reshape(-1)[0]).abs().max().item() > ATOL:
        return False
    return offsets == "any" or any(abs(diff.reshape(-1)[0].item() - o) <= ATOL for o in offsets)


def _max_diff(a: dict, b: dict) -> float:
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in b if a.get(k) is not None
                and b[k] is not None and a[k].shape == b[k].shape), default=0.0)


_MODEL = {"mlp": "a 3-layer MLP", "unused": "an MLP with a layer forward never uses (`spare`)",
          "tied": "a language model whose output layer shares the embedding's weight"}


def _marked_sums(obs: list[dict], kind: str, step: int, world_size: int, rank: int) -> list[float]:
    """What the k-th marked collective of the step can have added on top of rank ``rank``'s gradients, for each k:
    the sum of every rank's k-th number (a result used as it came), or that sum over the world size (averaged
    after); for gradients sent point to point (a rank's own part never crosses), the other ranks' numbers only."""
    numbers = [o[kind]["steps"][step]["marks"] for o in obs]
    count = min(len(n) for n in numbers)
    sums = [sum(n[k] for n in numbers) for k in range(count)]
    others = [sums[k] - numbers[rank][k] for k in range(count)]
    return [t / d for t in sums + others for d in (1, world_size)]


def _judge_steps(check, obs: list[dict], kind, world_size, width, seed, steps, kwargs):
    """Per step and rank, the gradients the optimizer used must be the ranks' average of the gradients each rank's
    backward computed from the weights its step started with, plus what the step's collectives delivered of the
    ranks' secret numbers (:func:`graders.common.comm_spy.marker`): each parameter's average moved by the sum
    of the numbers of one collective (or that sum / world size). An average made without the collectives'
    results (sent another way, recomputed locally) carries no such sum."""
    model = _MODEL[kind]
    batches = make_batches(kind, seed, world_size, steps)
    initial = make_model(kind, seed, width).state_dict()
    for step in range(steps):
        for rank, o in enumerate(obs):
            sums = _marked_sums(obs, kind, step, world_size, rank)
            mine = o[kind]["steps"][step]
            start = mine["start"]
            before = initial if step == 0 else o[kind]["steps"][step - 1]["state"]
            if _max_diff(start, before) > ATOL:
                raise CheckFailed(check, f"the weights changed between steps {step} and {step + 1} ({model})",
                                  ranks=[rank], expected="the weights optimizer.step() left, unchanged until the "
                                  "next step's backward", got=f"max difference {_max_diff(start, before):.3g}",
                                  hint="the wrapper must not change the weights itself after construction; only "
                                  "the gradients, before optimizer.step()")
            # each rank's backward, from the weights that rank started the step with (the same on every rank, unless
            # the marker's numbers reached the ranks unevenly, as with point-to-point sends)
            local = [local_grads(kind, {"start": obs[r][kind]["steps"][step]["start"]}, width, batches[step][r],
                                 held=False) for r in range(world_size)]
            want = {"grads": {n: None if all(loc[n] is None for loc in local) else
                              sum(loc[n] for loc in local) / world_size for n in local[0]}, "local": local}
            grads = mine["grads"]
            if grads is None:
                raise CheckFailed(check, f"the optimizer did not step at step {step + 1} ({model})", ranks=[rank],
                                  expected="finish_gradient_synchronization() returns, then the grader's optimizer.step()",
                                  hint="do not call optimizer methods from the wrapper")
            wrong = [n for n in want["grads"] if not _close(grads.get(n), want["grads"][n], sums)]
            if wrong:
                raise CheckFailed(check, f"the gradients the optimizer used at step {step + 1} are not the ranks' average "
                                  f"({model}, {world_size} ranks)", ranks=[rank],
                                  expected="every gradient averaged over the ranks (what DDP gives) by the collectives "
                                  "when optimizer.step() runs",
                                  got=_what_grads(want, wrong),
                                  hint=_grads_hint(grads, want, wrong, rank, world_size, kind, kwargs, width))
            given = [n for n, w in want["grads"].items() if w is None and grads.get(n) is not None]
            if given and "bucket_size_mb" not in kwargs:  # NaiveDDP: no bucket moves an unused parameter's zeros
                raise CheckFailed(check, f"a parameter forward never used has a gradient when the optimizer steps "
                                  f"(step {step + 1}, {model})", ranks=[rank],
                                  expected=f"`{given[0]}`.grad still None, as each rank's backward left it",
                                  got=f"`{given[0]}`.grad is a tensor (zeros made for it, or what a collective "
                                  "returned for it)"
                                  + (f" (and {len(given) - 1} more)" if len(given) > 1 else ""),
                                  hint="leave a parameter whose .grad is None alone: no zeros made for it and no "
                                  "collective for it (a zero gradient still moves a weight under weight decay or "
                                  "momentum, and an all-reduce of it makes the ranks wait for nothing)")
            after = _stepped(kind, width, start, grads)
            if _max_diff(mine["state"], after) > ATOL:
                raise CheckFailed(check, f"the weights after step {step + 1} differ from DDP's ({model})", ranks=[rank],
                                  expected="the weights one SGD step with the averaged gradients gives",
                                  got=f"max difference {_max_diff(mine['state'], after):.3g}",
                                  hint="the wrapper must not change the weights itself after construction; only "
                                  "the gradients, before optimizer.step()")


def _stepped(kind, width, start: dict, grads: dict) -> dict:
    """The weights one plain SGD step from ``start`` with ``grads`` gives (tied weights: one parameter)."""
    twin = make_model(kind, 0, width)
    twin.load_state_dict(start)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if grads.get(n) is not None:
                p -= LR * grads[n]
    return twin.state_dict()


def _what_grads(want, wrong) -> str:
    shown = ", ".join(f"`{n}`" for n in wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    return f"{len(wrong)} of {len(want['grads'])} parameters differ: {shown}"


def _grads_hint(grads, want, wrong, rank, world_size, kind, kwargs, width) -> str:
    def all_like(target, offsets="any") -> bool:
        return all(_close(grads.get(n), target[n], offsets) for n in wrong)

    if all_like(want["grads"], None):
        return ("these are the ranks' average, but not the values your collectives delivered: the grader moves every "
                "value an all-reduce carries by a secret number of each rank's (the sum of them all comes out of the "
                "all-reduce), and these gradients carry none. Copy each bucket's all-reduced values (after "
                "`work.wait()`, divided by the world size) back into its parameters' `.grad`: no other way of "
                "averaging (the job's store, a file, a local computation) counts")
    if all_like({n: None if g is None else g * world_size for n, g in want["grads"].items()}):
        return (f"these gradients are the SUM over the {world_size} ranks: all_reduce adds; divide by the world size "
                "(after the all-reduce, or each gradient before it)")
    if kind == "unused" and "bucket_size_mb" in kwargs:
        unfilled = {n for b in buckets_of(make_model(kind, 0, width), kwargs["bucket_size_mb"])
                    if any(m.startswith("spare.") for m in b) for n in b}
        if set(wrong) <= unfilled:
            return ("the parameters that share a bucket with `spare` (a layer forward never uses: its gradient hooks "
                    "never fire) were not averaged: those buckets never filled. In finish_gradient_synchronization, "
                    "all-reduce every bucket not launched yet, with zeros for the gradients that are None, then wait")
    if all_like(want["local"][rank], None):
        return ("these are this rank's own gradients, not yet averaged: the optimizer stepped before the all-reduce's "
                "result was in `.grad`. finish_gradient_synchronization must wait on every handle (`work.wait()`) and "
                "copy the averaged values into each `.grad` before it returns")
    if kind == "tied":
        return ("`embed.weight` is used twice (it is also the output layer's weight): `module.parameters()` lists it "
                "once, and its hook fires once, after both uses have added to its gradient; make sure it is in one "
                "bucket only and its averaged gradient is copied back")
    return ("compare your bucket's flat tensor with the parameters it came from: the values must go back to the same "
            "parameters, in the same order, after `work.wait()`, divided by the world size")


def check_broadcast(wrapper_cls, *, bucket_size_mb=None, world_size=2, width=16, seed=0):
    """Ranks seeded differently hold rank 0's weights, bitwise, once the wrapper is made."""
    check = "check_broadcast"
    checks.require_written(check, **{"NaiveDDP" if bucket_size_mb is None else "BucketedDDP": wrapper_cls})
    kwargs = {} if bucket_size_mb is None else {"bucket_size_mb": bucket_size_mb}
    obs = _run(check, wrapper_cls, kwargs, world_size, KINDS, width, seed, False, 0,
               "a rank waited forever while the wrapper was made: every rank must call the same broadcasts, in the "
               "same order (one per parameter of `module.parameters()`, from rank 0)")
    for kind in KINDS:
        want = obs[0][kind]["before"]  # rank 0's weights, drawn in rank 0 from os.urandom: no other rank can make them
        for rank, o in enumerate(obs):
            got = o[kind]["after"]
            differ = [k for k in want if not torch.equal(got[k].float(), want[k].float())]
            if differ:
                same_as_own = all(torch.equal(got[k], o[kind]["before"][k]) for k in differ)
                raise CheckFailed(
                    check, f"rank {rank} does not hold rank 0's weights after the wrapper was made ({_MODEL[kind]}, "
                    f"{world_size} ranks seeded differently)", ranks=[rank],
                    expected="every parameter equal to rank 0's, bitwise",
                    got=(f"{len(differ)} parameters still hold this rank's own initial values"
                         if same_as_own else f"{len(differ)} parameters hold other values: "
                         + ", ".join(f"`{k}`" for k in differ[:4])),
                    hint=("in __init__, broadcast every parameter of the module from rank 0, in place on the parameter's "
                          "own tensor (the module must keep its own Parameter objects)"
                          if same_as_own else "copy rank 0's values, do not average or re-initialise them: a "
                          "broadcast from rank 0 of each parameter, in place"))
    passed(check)


def check_naive(wrapper_cls, *, world_size=2, width=16, seed=0, steps=STEPS):
    """NaiveDDP's steps equal DDP's on three models: the gradients the optimizer used and the weights."""
    check = "check_naive"
    checks.require_written(check, NaiveDDP=wrapper_cls)
    _check_training(check, wrapper_cls, {}, world_size, width, seed, steps)
    passed(check)


def check_bucketed(wrapper_cls, *, bucket_size_mb=0.001, world_size=2, width=16, seed=0, steps=STEPS):
    """BucketedDDP's steps equal DDP's on three models (an unused parameter, tied weights)."""
    check = "check_bucketed"
    checks.require_written(check, BucketedDDP=wrapper_cls)
    _check_training(check, wrapper_cls, {"bucket_size_mb": bucket_size_mb}, world_size, width, seed, steps)
    passed(check)


def _check_training(check, cls, kwargs, world_size, width, seed, steps):
    if "bucket_size_mb" in kwargs:  # the test must hold a bucket that never fills by itself
        shared = [b for b in buckets_of(make_model("unused", 0, width), kwargs["bucket_size_mb"])
                  if any(n.startswith("spare.") for n in b) and not all(n.startswith("spare.") for n in b)]
        if not shared:
            raise ValueError(f"width={width}, bucket_size_mb={kwargs['bucket_size_mb']}: no bucket mixes `spare` with "
                             "used parameters; choose others")
    obs = _run(check, cls, kwargs, world_size, KINDS, width, seed, True, steps, _HANG_HINT, mark=True)
    for kind in KINDS:
        _judge_steps(check, obs, kind, world_size, width, seed, steps, kwargs)


# --- what each step communicated -------------------------------------------------------------------


_QUIET = ("barrier",)  # a collective that carries no values: not communication of the gradients


def _fr_kind(op: str) -> str:
    """The flight recorder's op name ("all_reduce", "allreduce_coalesced", ...) as the spy's kind."""
    return "all_reduce" if op.replace("_", "").startswith("allreduce") else op


def _all_reduces(step: dict) -> list[dict]:
    return [c for c in step["issued"] if _fr_kind(c["op"]) == "all_reduce"]


def _unseen(step: dict) -> list[int]:
    """The sizes of the all-reduces the flight recorder lists but the spy did not see carry anything."""
    seen = Counter(v.numel() for r in step["carried"] if r["op"] == "all_reduce" for v in r["values"])
    listed = Counter(n for c in _all_reduces(step) for n in c["numels"])
    return sorted((listed - seen).elements())


def _bucket_values(grads: dict, bucket: list[str], shapes: dict) -> torch.Tensor:
    """A bucket's gradients as one flat tensor, zeros for a gradient that is None."""
    return torch.cat([(grads[n] if grads[n] is not None else torch.zeros(shapes[n])).reshape(-1).float() for n in bucket])


def _what(values: torch.Tensor) -> str:
    return "only zeros" if not values.abs().max().item() > 0 else "other values than this rank's gradients"


def check_buckets(wrapper_cls, *, bucket_size_mb=0.001, world_size=2, width=16, seed=0, steps=2):
    """Each step communicates exactly one all-reduce per bucket of DDP's rule (:func:`buckets_of`), each carrying that
    bucket's gradients (as this rank's backward left them, or divided by the world size), and no other
    collective: judged from the flight recorder (every kind, every size) and from what each call carried."""
    check = "check_buckets"
    checks.require_written(check, BucketedDDP=wrapper_cls)
    obs = _run(check, wrapper_cls, {"bucket_size_mb": bucket_size_mb}, world_size, ("mlp",), width, seed, True, steps,
               _HANG_HINT, watch=(None, 0.0))
    model = make_model("mlp", seed, width)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    buckets = buckets_of(model, bucket_size_mb)
    want = sorted(sum(sizes[n] for n in b) for b in buckets)
    layout = "; ".join(f"[{', '.join(b)}] = {sum(sizes[n] for n in b)} values" for b in buckets)
    where = f"bucket_size_mb={bucket_size_mb:g}, {world_size} ranks"
    expected = f"{len(buckets)} all-reduces carrying {', '.join(map(str, want))} values (buckets: {layout})"
    batches = make_batches("mlp", seed, world_size, steps)
    for rank, o in enumerate(obs):
        for step, s in enumerate(o["mlp"]["steps"]):
            _judge_kinds(check, rank, step, s, where, expected)
            _judge_sizes(check, rank, step, s, where, expected, buckets, sizes, want, bucket_size_mb)
            grads = local_grads("mlp", s, width, batches[step][rank])
            _judge_content(check, rank, step, s, where, world_size, buckets, [_bucket_values(grads, b, shapes)
                                                                               for b in buckets])
    passed(check)


def _judge_kinds(check, rank, step, s, where, expected):
    # the flight recorder lists every collective but no send/recv on gloo, and a reduce_scatter there as an
    # all-reduce: each kind counts as often as the more telling of the two saw it
    listed = Counter(c["op"] for c in s["issued"] if _fr_kind(c["op"]) != "all_reduce" and c["op"] not in _QUIET)
    spied = Counter(r["op"] for r in s["carried"] if r["op"] != "all_reduce")
    other = Counter({op: max(listed[op], spied[op]) for op in {*listed, *spied}})
    if other:
        raise CheckFailed(
            check, f"step {step + 1} communicated with other collectives than all_reduce ({where})", ranks=[rank],
            expected=f"{expected}, and no other collective",
            got=", ".join(f"{n} x {op}" for op, n in other.items()) + f", and {len(_all_reduces(s))} all-reduces",
            hint="this exercise asks for each bucket to be summed over the ranks by one "
            "`dist.all_reduce(flat, async_op=True)`, as DDP does: another collective (all_gather then a local sum, "
            "reduce_scatter, broadcast, send/recv) moves other data and is not what the notebook asks for")


def _judge_sizes(check, rank, step, s, where, expected, buckets, sizes, want, bucket_size_mb):
    calls = _all_reduces(s)
    got = sorted(n for c in calls for n in c["numels"])
    if got == want and all(len(c["numels"]) == 1 for c in calls):
        return
    described = ", ".join(str(n) for n in [n for c in calls for n in c["numels"]]) or "none"
    if len(calls) == len(sizes) and got == sorted(sizes.values()):
        hint = ("that is one all-reduce per parameter: group the gradients in buckets, concatenate each bucket's "
                "gradients into one flat tensor (`torch.cat([g.flatten() for g in grads])`) and all-reduce that")
    elif len(calls) == 1 and len(buckets) > 1:
        hint = (f"that is every gradient in one all-reduce: the limit of {bucket_size_mb:g} MiB "
                f"({int(bucket_size_mb * MiB)} bytes, float32 = 4 bytes per value) makes {len(buckets)} buckets")
    elif not calls:
        hint = "no all-reduce ran in this step: launch each bucket's `dist.all_reduce(flat, async_op=True)`"
    elif got == sorted(_closed_before_the_limit(sizes, bucket_size_mb)):
        hint = ("these are buckets closed BEFORE the parameter that would take them past the limit, so none "
                "reaches it: that is not DDP's rule. DDP adds each parameter to the current bucket first and closes "
                "the bucket once its bytes reach or exceed the limit: the parameter that crosses the limit stays "
                "in the bucket it crossed it in (lesson 2, how DDP forms its buckets)")
    elif len(got) == len(want):
        hint = ("each all-reduce must carry exactly its bucket's values, nothing added (no padding, no extra "
                "values) and nothing left out; form the buckets in reverse order of `module.parameters()`, a "
                "bucket closing once its bytes reach or exceed the limit")
    else:
        hint = ("form the buckets in reverse order of `module.parameters()`: each parameter joins the current "
                "bucket, which closes once its bytes (numel * element_size()) reach or exceed the limit; "
                "all-reduce each bucket exactly once per step, and nothing else")
    raise CheckFailed(check, f"step {step + 1} did not all-reduce one flat tensor per bucket ({where})", ranks=[rank],
                      expected=expected, got=f"{len(calls)} all-reduces carrying {described} values", hint=hint)


def _closed_before_the_limit(sizes: dict, bucket_size_mb: float) -> list[int]:
    """The bucket sizes (values) of the rule DDP does not follow, a known mistake: a bucket takes the next
    float32 parameter only while it stays within the limit, else that parameter starts a new bucket."""
    limit, out, current = int(bucket_size_mb * MiB), [], 0
    for numel in reversed(list(sizes.values())):
        if current and (current + numel) * 4 > limit:
            out.append(current)
            current = 0
        current += numel
    return out + ([current] if current else [])


def _judge_content(check, rank, step, s, where, world_size, buckets, targets):
    unseen = _unseen(s)
    if unseen:
        raise CheckFailed(
            check, f"the grader could not see what {len(unseen)} all-reduce(s) of step {step + 1} carried ({where})",
            ranks=[rank], expected="every all-reduce issued through torch.distributed on the thread that runs "
            "backward (from the gradient hooks) or in finish_gradient_synchronization",
            got=f"the process group ran all-reduces of {', '.join(map(str, unseen))} values that went around the "
            "grader's view (another thread, or torch's dispatch switched off)",
            hint="launch each bucket's `dist.all_reduce(flat, async_op=True)` from the gradient hook itself")
    matched = set()
    for r in (r for r in s["carried"] if r["op"] == "all_reduce"):
        values = r["values"][0]
        found = [i for i, t in enumerate(targets) if comm_spy.holds(values, t, (1.0, 1 / world_size), exactly=True)]
        if found:
            matched.add(found[0])
            continue
        same = [i for i, t in enumerate(targets) if t.numel() == values.numel()]
        bucket = buckets[same[0]] if same else []
        raise CheckFailed(
            check, f"an all-reduce of step {step + 1} did not carry its bucket's gradients ({where})", ranks=[rank],
            expected=f"the {values.numel()} values of bucket [{', '.join(bucket)}]: this rank's gradients after "
            "backward (or divided by the world size), in any order",
            got=f"an all-reduce of {values.numel()} values carrying {_what(values)}",
            hint="all-reduce each bucket's own gradients, concatenated once every `p.grad` of the bucket is ready "
            "(zeros only for a gradient that is None): an all-reduce of zeros, of a copy taken before backward or of "
            "anything else synchronises nothing, whatever else sends the gradients")
    missing = [buckets[i] for i in range(len(buckets)) if i not in matched]
    if missing:
        raise CheckFailed(
            check, f"step {step + 1} carried no bucket's gradients for {len(missing)} bucket(s) ({where})",
            ranks=[rank], expected="each bucket's gradients in its own all-reduce",
            got="no all-reduce carried " + "; ".join(f"[{', '.join(b)}]" for b in missing),
            hint="each bucket's all-reduce carries that bucket's gradients, once per step")


def check_overlap(wrapper_cls, *, bucket_size_mb=0.001, world_size=2, width=16, seed=0, steps=2):
    """Backward goes on while the first buckets travel: on every rank, a collective carrying this step's
    gradients is launched before backward reaches the first layer, and backward reaches it while that
    collective cannot have completed yet: at each step another rank starts its backward only once the others'
    backward has reached the first layer (at most LATE seconds later), so it has not joined it."""
    check = "check_overlap"
    checks.require_written(check, BucketedDDP=wrapper_cls)
    model = make_model("mlp", seed, width)
    buckets = buckets_of(model, bucket_size_mb)
    first = "l1.weight"
    if len(buckets) < 2 or first in buckets[0]:
        raise ValueError(f"bucket_size_mb={bucket_size_mb} gives no bucket before the first layer's: nothing to overlap")
    offset = random.randrange(world_size)  # which rank is late at each step: nothing the answer can know
    obs = _run(check, wrapper_cls, {"bucket_size_mb": bucket_size_mb}, world_size, ("mlp",), width, seed, True, steps,
               _HANG_HINT, watch=(offset, LATE))
    batches = make_batches("mlp", seed, world_size, steps)
    for step in range(steps):
        late = (offset + step) % world_size
        late_at = obs[late]["mlp"]["steps"][step]["backward_at"]
        for rank, o in enumerate(obs):
            if rank != late:
                s = o["mlp"]["steps"][step]
                grads = local_grads("mlp", s, width, batches[step][rank])
                own = local_grads("mlp", s, width, batches[step][rank], held=False)[first]
                # backward's own call of the grader's hook is the last one with the true gradient: an entry added
                # to its record by hand, early (through the frames), cannot move it earlier
                first_at = max((t for t, g in s["first_calls"] if g.shape == own.shape
                                and (g - own).abs().max().item() <= ATOL), default=None)
                _judge_overlap(check, rank, step, s, first_at, late, late_at, grads, world_size, buckets, first)
    passed(check)


def _judge_overlap(check, rank, step, s, first_at, late, late_at, grads, world_size, buckets, first):
    if first_at is None:
        raise CheckFailed(check, f"backward did not compute `{first}`'s gradient (step {step + 1})", ranks=[rank],
                          expected=f"the grader's own hook on `{first}` runs in every backward, given this rank's "
                          "gradient",
                          hint="leave the model's parameters and their hooks as they are: wrap the module, do not "
                          "replace its parameters or remove hooks")
    early = [r for r in s["carried"] if r["t"] < first_at]
    mine = [g.reshape(-1) for g in grads.values() if g is not None]  # this step's gradients, as backward left them
    real = [r for r in early if r["op"] in comm_spy.SENDS and any(
        comm_spy.holds(v, g, (1.0, 1 / world_size), exactly=False) for v in r["values"] for g in mine)]
    if not real:
        unseen = _unseen(s)
        decoys = f" ({len(early)} before it carried none of this step's gradients)" if early else ""
        raise CheckFailed(
            check, f"no all-reduce carrying this step's gradients had started when backward reached the first layer "
            f"(step {step + 1})", ranks=[rank],
            expected=f"the all-reduce of the first bucket ({', '.join(buckets[0])}) launched while backward still "
            "computes the earlier layers' gradients",
            got=f"{len(early)} collectives launched before `{first}`'s gradient{decoys}; {len(s['carried']) - len(early)} "
            "after it" + (f"; {len(unseen)} more the grader could not see (another thread?)" if unseen else ""),
            hint="launch each bucket's all-reduce of its gradients from a gradient hook "
            "(`p.register_post_accumulate_grad_hook(hook)`) as soon as its last gradient is ready, with "
            "`async_op=True` so backward goes on; finish_gradient_synchronization only waits"
            + (". A collective launched before the gradients exist (in forward) or carrying anything else "
               "(zeros, an old copy) overlaps nothing" if early else ""))
    if first_at >= late_at:
        raise CheckFailed(
            check, f"backward waited for the communication: it reached the first layer only after its bucket's "
            f"all-reduce could complete (step {step + 1})", ranks=[rank],
            expected=f"rank {rank} computes `{first}`'s gradient while its first bucket is still in flight: rank "
            f"{late}, held back before its backward in this step until the other ranks' backward reached `{first}` "
            f"(at most {LATE:g} s), had not sent its part yet",
            got=f"rank {rank} reached `{first}`'s gradient {first_at - real[0]['t']:.2f} s after launching its first "
            f"bucket's collective, {first_at - late_at:.2f} s after rank {late} started its backward",
            hint="launch the all-reduce with `async_op=True` and keep the handle: a blocking `dist.all_reduce(flat)` "
            "(or `work.wait()`) inside the hook stops backward until every rank has sent its part; wait for the "
            "handles in finish_gradient_synchronization only")
