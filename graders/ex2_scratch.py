"""Checks for exercise 2's third notebook, DDP from scratch (exercises/ex2-ddp-basics/ddp_from_scratch.ipynb).

The student writes data parallelism without ``DistributedDataParallel``: two wrapper classes with
the same interface, ``Wrapper(module, ...)``, ``wrapper(x)`` (the module's forward) and
``wrapper.finish_gradient_synchronization()`` (called after ``backward()``, before ``step()``):

* ``NaiveDDP(module)``: rank 0's parameters broadcast at construction; after backward, one
  all-reduce per gradient, averaged;
* ``BucketedDDP(module, bucket_size_mb)``: the gradients grouped in buckets of at most
  ``bucket_size_mb`` MiB (in reverse order of ``module.parameters()``), each bucket all-reduced as
  one flat tensor, asynchronously, from a gradient hook as soon as all its gradients are ready;
  ``finish_gradient_synchronization`` launches what never filled and waits for every bucket.

Each check runs the class on real ranks, in a harness that builds the model, the data and the
optimizer, and judges what happened, never what the student's objects say:

* :func:`check_broadcast`: ranks seeded differently hold rank 0's weights once the wrapper exists;
* :func:`check_naive` and :func:`check_bucketed`: the gradients the optimizer saw at every step
  (its own step pre-hook, registered by the grader) and the weights after it equal one process's
  training on all ranks' batches together, which is what torch's DDP computes; on three models: a
  plain MLP, one with a parameter that forward never uses, one with tied weights;
* :func:`check_buckets`: the all-reduces each step issued, as torch's flight recorder saw them
  (written by the process group itself): one per bucket the size limit implies, each carrying one
  bucket's gradients;
* :func:`check_overlap`: when the gradient of the model's first layer (the last one backward
  computes) is produced, the flight recorder already holds an all-reduce of this step: the first
  buckets' communication was under way while backward went on.

Everything the harnesses call to observe (the flight recorder, torch.distributed's functions) is
taken when this module is imported, before any student code runs in the rank.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course import checks
from course.checks import CheckFailed, passed

ATOL = 1e-5  # float32 sums in another order (flat buckets, a ring) differ by ~1e-7
LR = 0.1
STEPS = 3
JOB_TIMEOUT = 30.0  # seconds: a rank that waits for a bucket that never fills fails by then
MiB = 2**20
KINDS = ("mlp", "unused", "tied")
VOCAB = 11


_REAL = checks.REAL  # torch's own functions, taken before any student code runs (the captured-torch guard)


# --- the models and the data --------------------------------------------------------------------


class MLP(nn.Module):
    """Three linear layers; ``unused=True`` adds one that forward never calls (its gradient stays None)."""

    def __init__(self, width: int = 16, unused: bool = False):
        super().__init__()
        self.l1 = nn.Linear(6, width)
        if unused:
            self.spare = nn.Linear(width, 2)  # registered between used layers: its buckets hold used ones too
        self.l2 = nn.Linear(width, width)
        self.l3 = nn.Linear(width, 3)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class TiedLM(nn.Module):
    """A tiny language model whose output layer shares its weight with the embedding (one Parameter, two uses)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def make_model(kind: str, seed: int, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "tied":
        return TiedLM(max(4, width // 2))
    return MLP(width, unused=kind == "unused")


def first_layer(model: nn.Module) -> nn.Parameter:
    """The parameter whose gradient backward computes last (the input layer's weight)."""
    return model.embed.weight if isinstance(model, TiedLM) else model.l1.weight


def make_batches(kind: str, seed: int, world_size: int, steps: int, batch: int = 4):
    """batches[step][rank] = (input, target), the same in every process."""
    gen = torch.Generator().manual_seed(7_000 + seed)
    out = []
    for _ in range(steps):
        if kind == "tied":
            out.append([(torch.randint(0, VOCAB, (batch, 5), generator=gen), torch.randint(0, VOCAB, (batch, 5), generator=gen))
                        for _ in range(world_size)])
        else:
            out.append([(torch.randn(batch, 6, generator=gen), torch.randn(batch, 3, generator=gen))
                        for _ in range(world_size)])
    return out


def loss_of(kind: str, output, target):
    if kind == "tied":
        return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
    return F.mse_loss(output, target)


def buckets_of(model: nn.Module, bucket_size_mb: float) -> list[list[str]]:
    """The buckets the notebook's rule gives: parameters in reverse order of ``model.parameters()``, a
    bucket takes the next one while its size stays within ``bucket_size_mb`` MiB; a parameter bigger
    than the limit has a bucket of its own."""
    limit = bucket_size_mb * MiB
    buckets, current, size = [], [], 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


# --- the harness (runs on every rank) -------------------------------------------------------------


def _since(entries: list[dict], mark: dict) -> list[dict]:
    """The collectives issued after ``mark`` (each group's last sequence number then; a group made since counts whole)."""
    return [e for e in entries if not e["p2p"] and (e["seq"] or 0) > mark.get(e["group"], 0)]


def _mark(real: checks.RealTorch) -> dict:
    mark: dict = {}
    for e in real.collectives():
        if not e["p2p"]:
            mark[e["group"]] = max(mark.get(e["group"], 0), e["seq"] or 0)
    return mark


def _issued(entries: list[dict]) -> list[dict]:
    """What each collective carried: op, and per tensor its shape and number of values."""
    return [{"op": e["op"], "shapes": [list(s) for s in e["sizes"] or []],
             "numels": [math.prod(s) for s in e["sizes"] or []]} for e in entries]


def _train_harness(rank, wrapper_cls, kwargs, kinds, width, seed, same_seed, steps):
    real = _REAL
    dev = checks.join_job()
    world_size = real.get_world_size()
    out = {}
    for kind in kinds:
        model = make_model(kind, seed + (0 if same_seed else 1 + rank), width).to(dev)
        before = checks.to_cpu(model.state_dict())
        wrapper = wrapper_cls(model, **kwargs)
        after = checks.to_cpu(model.state_dict())
        if steps == 0:
            out[kind] = {"before": before, "after": after}
            continue
        params = dict(model.named_parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        seen: list[dict] = []  # what the optimizer saw: each parameter's gradient at its step
        optimizer.register_step_pre_hook(lambda *_, seen=seen, params=params: seen.append(
            {n: None if p.grad is None else p.grad.detach().to("cpu", torch.float32).clone() for n, p in params.items()}))
        at_first: list[int | None] = []  # non-empty all-reduces of this step issued when the first layer's gradient appeared
        mark = [{}]
        first_layer(model).register_hook(lambda grad, at_first=at_first, mark=mark: at_first.append(
            sum(c["op"] == "all_reduce" and sum(c["numels"]) > 0 for c in _issued(_since(real.collectives(), mark[0]))))
            or grad)
        record = []
        for step, batches in enumerate(make_batches(kind, seed, world_size, steps)):
            x, y = (t.to(dev) for t in batches[rank])
            optimizer.zero_grad(set_to_none=True)
            mark[0] = _mark(real)
            del at_first[:]
            loss_of(kind, wrapper(x), y).backward()
            wrapper.finish_gradient_synchronization()
            optimizer.step()
            issued = _issued(_since(real.collectives(), mark[0]))
            record.append({"grads": seen[-1] if len(seen) > step else None,
                           "state": checks.to_cpu(model.state_dict()),
                           "issued": issued, "at_first_grad": at_first[0] if at_first else None})
        out[kind] = {"before": before, "after": after, "steps": record}
    return out


def _run(check, wrapper_cls, kwargs, world_size, kinds, width, seed, same_seed, steps, hint):
    timeout = min(checks.check_timeout(), JOB_TIMEOUT)
    job = checks.run(check, _train_harness, world_size,
                     args=(wrapper_cls, kwargs, tuple(kinds), width, seed, same_seed, steps),
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


# --- the reference: one process, all ranks' batches ------------------------------------------------


def reference(kind: str, world_size: int, width: int, seed: int, steps: int):
    """What torch's DDP computes: per step, the gradient of the mean over ranks of each rank's loss
    (each gradient averaged over the ranks), then SGD; also each rank's own gradient, for the hints."""
    model = make_model(kind, seed, width)
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for batches in make_batches(kind, seed, world_size, steps):
        local = []
        for x, y in batches:
            model.zero_grad(set_to_none=True)
            loss_of(kind, model(x), y).backward()
            local.append({n: None if p.grad is None else p.grad.clone() for n, p in params.items()})
        optimizer.zero_grad(set_to_none=True)
        (sum(loss_of(kind, model(x), y) for x, y in batches) / world_size).backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
        optimizer.step()
        out.append({"grads": grads, "local": local, "state": {k: v.clone() for k, v in model.state_dict().items()}})
    return out


def _close(a, b) -> bool:
    if a is None or b is None:  # an unused parameter: None, or zeros, both leave plain SGD's weight alone
        return (a is None or not a.abs().max().item() > 0) and (b is None or not b.abs().max().item() > 0)
    return a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= ATOL


def _max_diff(a: dict, b: dict) -> float:
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in b if a.get(k) is not None
                and b[k] is not None and a[k].shape == b[k].shape), default=0.0)


# --- judging ----------------------------------------------------------------------------------------


_MODEL = {"mlp": "a 3-layer MLP", "unused": "an MLP with a layer forward never uses (`spare`)",
          "tied": "a language model whose output layer shares the embedding's weight"}


def _judge_steps(check, obs: list[dict], kind, world_size, width, seed, steps, kwargs):
    ref = reference(kind, world_size, width, seed, steps)
    model = _MODEL[kind]
    for step in range(steps):
        for rank, o in enumerate(obs):
            mine = o[kind]["steps"][step]
            want = ref[step]
            grads = mine["grads"]
            if grads is None:
                raise CheckFailed(check, f"the optimizer did not step at step {step + 1} ({model})", ranks=[rank],
                                  expected="finish_gradient_synchronization() returns, then the grader's optimizer.step()",
                                  hint="do not call optimizer methods from the wrapper")
            wrong = [n for n in want["grads"] if not _close(grads.get(n), want["grads"][n])]
            if wrong:
                raise CheckFailed(check, f"the gradients the optimizer used at step {step + 1} are not the ranks' average "
                                  f"({model}, {world_size} ranks)", ranks=[rank],
                                  expected="every gradient averaged over the ranks (what DDP gives) when optimizer.step() runs",
                                  got=_what_grads(want, wrong),
                                  hint=_grads_hint(grads, want, wrong, rank, world_size, kind, kwargs, width))
            if _max_diff(mine["state"], want["state"]) > ATOL:
                raise CheckFailed(check, f"the weights after step {step + 1} differ from DDP's ({model})", ranks=[rank],
                                  expected="the weights one SGD step with the averaged gradients gives",
                                  got=f"max difference {_max_diff(mine['state'], want['state']):.3g}",
                                  hint="the wrapper must not change the weights itself after construction; only "
                                  "the gradients, before optimizer.step()")


def _what_grads(want, wrong) -> str:
    shown = ", ".join(f"`{n}`" for n in wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    return f"{len(wrong)} of {len(want['grads'])} parameters differ: {shown}"


def _grads_hint(grads, want, wrong, rank, world_size, kind, kwargs, width) -> str:
    def all_like(target) -> bool:
        return all(_close(grads.get(n), target[n]) for n in wrong)

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
    if all_like(want["local"][rank]):
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
        want = make_model(kind, seed + 1, width).state_dict()  # rank 0's weights
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
                    hint=("broadcast every parameter from rank 0 in __init__: `dist.broadcast(p.data, src=0)` for each "
                          "p in `module.parameters()` (in place: the module must keep its own Parameter objects)"
                          if same_as_own else "copy rank 0's values, do not average or re-initialise them: "
                          "`dist.broadcast(p.data, src=0)` for each parameter"))
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
    obs = _run(check, cls, kwargs, world_size, KINDS, width, seed, True, steps, _HANG_HINT)
    for kind in KINDS:
        _judge_steps(check, obs, kind, world_size, width, seed, steps, kwargs)


def _all_reduces(step: dict) -> list[dict]:
    return [c for c in step["issued"] if c["op"] == "all_reduce"]


def check_buckets(wrapper_cls, *, bucket_size_mb=0.001, world_size=2, width=16, seed=0, steps=2):
    """Each step all-reduces once per bucket the size limit implies, each call carrying one bucket."""
    check = "check_buckets"
    checks.require_written(check, BucketedDDP=wrapper_cls)
    obs = _run(check, wrapper_cls, {"bucket_size_mb": bucket_size_mb}, world_size, ("mlp",), width, seed, True, steps,
               _HANG_HINT)
    model = make_model("mlp", seed, width)
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    buckets = buckets_of(model, bucket_size_mb)
    want = sorted(sum(sizes[n] for n in b) for b in buckets)
    layout = "; ".join(f"[{', '.join(b)}] = {sum(sizes[n] for n in b)} values" for b in buckets)
    for rank, o in enumerate(obs):
        for step, s in enumerate(o["mlp"]["steps"]):
            calls = _all_reduces(s)
            got = sorted(n for c in calls for n in c["numels"])
            multi = [c for c in calls if len(c["numels"]) != 1]
            if got == want and not multi:
                continue
            described = ", ".join(str(n) for n in [n for c in calls for n in c["numels"]]) or "none"
            if len(calls) == len(sizes) and got == sorted(sizes.values()):
                hint = ("that is one all-reduce per parameter: group the gradients in buckets, concatenate each bucket's "
                        "gradients into one flat tensor (`torch.cat([g.flatten() for g in grads])`) and all-reduce that")
            elif len(calls) == 1 and len(buckets) > 1:
                hint = (f"that is every gradient in one all-reduce: the limit of {bucket_size_mb:g} MiB "
                        f"({int(bucket_size_mb * MiB)} bytes, float32 = 4 bytes per value) makes {len(buckets)} buckets")
            elif not calls:
                hint = "no all-reduce ran in this step: launch each bucket's `dist.all_reduce(flat, async_op=True)`"
            else:
                hint = ("form the buckets in reverse order of `module.parameters()`: a bucket takes the next parameter "
                        "while its size (numel * element_size()) stays within the limit, else a new bucket starts; "
                        "all-reduce each bucket exactly once per step")
            raise CheckFailed(
                check, f"step {step + 1} did not all-reduce one flat tensor per bucket (bucket_size_mb={bucket_size_mb:g}, "
                f"{world_size} ranks)", ranks=[rank],
                expected=f"{len(buckets)} all-reduces carrying {', '.join(map(str, want))} values (buckets: {layout})",
                got=f"{len(calls)} all-reduces carrying {described} values", hint=hint)
    passed(check)


def check_overlap(wrapper_cls, *, bucket_size_mb=0.001, world_size=2, width=16, seed=0, steps=2):
    """The first buckets' all-reduces are launched during backward, before the first layer's gradient exists."""
    check = "check_overlap"
    checks.require_written(check, BucketedDDP=wrapper_cls)
    model = make_model("mlp", seed, width)
    buckets = buckets_of(model, bucket_size_mb)
    first = "l1.weight"
    if len(buckets) < 2 or first in buckets[0]:
        raise ValueError(f"bucket_size_mb={bucket_size_mb} gives no bucket before the first layer's: nothing to overlap")
    obs = _run(check, wrapper_cls, {"bucket_size_mb": bucket_size_mb}, world_size, ("mlp",), width, seed, True, steps,
               _HANG_HINT)
    total = sum(p.numel() for p in model.parameters())
    for rank, o in enumerate(obs):
        for step, s in enumerate(o["mlp"]["steps"]):
            calls = _all_reduces(s)
            carried = sum(n for c in calls for n in c["numels"])
            early = s["at_first_grad"]
            if carried != total:
                raise CheckFailed(
                    check, f"step {step + 1}'s all-reduces did not carry every gradient value once", ranks=[rank],
                    expected=f"{total} values all-reduced in all (the model's parameters)",
                    got=f"{carried} values in {len(calls)} all-reduces",
                    hint="all-reduce each gradient exactly once per step (check_buckets says how to group them)")
            if not early:
                raise CheckFailed(
                    check, f"no all-reduce had started when backward reached the first layer (step {step + 1})",
                    ranks=[rank],
                    expected=f"the all-reduce of the first bucket ({', '.join(buckets[0])}) launched while backward "
                    "still computes the earlier layers' gradients",
                    got=f"0 all-reduces launched before `{first}`'s gradient; {len(calls)} after it",
                    hint="launch each bucket's all-reduce from a gradient hook "
                    "(`p.register_post_accumulate_grad_hook(hook)`) as soon as its last gradient is ready, with "
                    "`async_op=True` so backward goes on; finish_gradient_synchronization only waits")
    passed(check)
