"""What the checks of exercise 2's practice notebook run and compare with, apart from their verdicts
(:mod:`graders.ddp_in_practice.checks`): the models and data, the harnesses that run on the ranks, the
single-process references, and the serialization package that tags and watches checkpoint tensors.

The harnesses act with torch's own functions (:data:`course.checks.REAL`, taken before the student's
code runs) and build the student's objects (spies) themselves.
"""

from __future__ import annotations

import math
import numbers
import os
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from course import checks
from graders.common import comm_spy
from graders.common.ddp_model import make_net

CLASSES = 3
SAVED_FROM = "cuda:0"  # where the checkpoint's tensors say they were saved (rank 0's GPU)
_REAL = checks.REAL  # torch's own functions, taken before any student code runs (the captured-torch guard)


def _wrap(model: nn.Module, dev: torch.device, **options) -> DDP:
    return DDP(model, device_ids=[dev.index], **options) if dev.type == "cuda" else DDP(model, **options)


def make_accum_net(seed: int) -> nn.Sequential:
    """check_accumulation's model (4 inputs, 2 outputs): make_net's with a BatchNorm layer after the first linear.

    BatchNorm normalises each forward's batch with that batch's own statistics, so a micro-batch's gradient
    depends on which samples share its forward: the micro-batches run one by one give the reference's step,
    and their samples put through the model as one big batch give another (as they do in real accumulation,
    where the big batch is what does not fit)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def _parameters(model: nn.Module) -> dict:
    """The model's parameters by name, detached CPU copies (its BatchNorm's running statistics left out: each rank's
    are its own, and a training step does not read them)."""
    return {name: p.detach().to("cpu").clone() for name, p in model.named_parameters()}


def _number(value):
    """A returned accuracy or epoch as a float, or a description of what it was instead."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().cpu().reshape(()).item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # Python's numbers, numpy's scalars
        return float(value)
    return f"<{type(value).__name__}>"


_SEEN: list[torch.Tensor] = []  # the inputs of every forward of a Classifier in this process


class Classifier(nn.Module):
    """The model check_hardest gives the student: 4 inputs, 3 class scores.

    Its forward records its input (in this process's list, whatever wraps or copies the model),
    so the harness knows which samples each rank's model really evaluated."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(1000 + seed)
        self.linear = nn.Linear(4, CLASSES)

    def forward(self, x):
        _SEEN.append(x.detach().to("cpu", torch.float32).reshape(-1, 4).clone())
        return self.linear(x)


def micro_count(k: int, step: int) -> int:
    """How many micro-batches call ``step`` of check_accumulation gets: k, then k + 1, ... (the count varies)."""
    return k + step % 2


def micro_sizes(seed: int, rank: int, step: int, k: int, size: int) -> list[int]:
    """The sizes of rank ``rank``'s micro-batches in call ``step``: micro_count(k, step) of them, unequal, adding
    up to micro_count x size on every rank (so every rank holds as many samples, split differently), at least 2
    each (the model's BatchNorm needs two samples in a training forward)."""
    if size < 3:
        raise ValueError(f"size={size}: micro-batches of unequal sizes, at least 2 each, need size >= 3")
    count = micro_count(k, step)
    gen = torch.Generator().manual_seed(40_000 + 1000 * seed + 100 * rank + step)
    sizes = [size] * count
    for _ in range(3 * count):
        i, j = torch.randint(count, (2,), generator=gen).tolist()
        if i != j and sizes[i] > 2:
            sizes[i] -= 1
            sizes[j] += 1
    if len(set(sizes)) == 1:  # never equal: dividing each loss by the count must give another step
        sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] - 1
    return sizes


def _micro_batches(seed: int, rank: int, step: int, k: int, size: int):
    gen = torch.Generator().manual_seed(10_000 * seed + 100 * rank + step)
    return [(torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen))
            for n in micro_sizes(seed, rank, step, k, size)]


def loss_weights(sizes: list[int], mode: str) -> list[float]:
    """What each micro-batch's mean loss is multiplied by: ``share`` (its size / the rank's samples: right),
    ``count`` (1 / the number of micro-batches: right only for equal sizes), ``none`` (the sum)."""
    total = sum(sizes)
    return [n / total if mode == "share" else 1 / len(sizes) if mode == "count" else 1.0 for n in sizes]


def _accumulate_harness(rank, accumulate_grads, k, size, steps, lr, seed, _real=_REAL):
    """Run ``steps`` calls of accumulate_grads, each followed by the given optimizer step and zero_grad; record,
    per call, when DDP synced and what the collectives carried.

    The grader registers the DDP model's communication hook (DDP allows one): it does what DDP does
    by default (average the bucket over the ranks, with torch's own all_reduce, taken before the
    student's code runs) and notes, for each synchronised backward, how many forwards the call had
    run by then. torch's flight recorder (checks.collectives) counts the all-reduces of the gradient
    bucket the call really issued, whatever the student's code does to the hook; a spy on the
    collectives (graders.common.comm_spy) keeps what each collective of the call sent, and the weights the
    call started with let the checker recompute the gradients. A forward pre-hook counts forwards."""
    real = _real  # bound at import, before any student object is unpickled
    dev = checks.join_job()
    world_size = real.get_world_size()
    model = make_accum_net(seed + 17 * rank).to(dev)  # different on purpose: DDP starts every rank from rank 0's
    ddp_model = _wrap(model, dev, broadcast_buffers=False)  # each rank's running statistics are its own
    forwards, synced = [0], []
    weights_at: list[dict] = []  # the weights at each forward of a call: what each backward differentiated at

    held: dict = {}  # what .grad held at a call's first forward: what its backward passes add to

    def on_forward(module, args):
        forwards[0] += 1
        if not weights_at:
            held.update({n: None if p.grad is None else p.grad.detach().to("cpu", torch.float32).clone()
                         for n, p in model.named_parameters()})
        weights_at.append(checks.to_cpu(model.state_dict()))

    def average(state, bucket):
        if bucket.index() == 0:  # one backward's all-reduce, whatever the number of buckets
            synced.append(forwards[0])
        grads = bucket.buffer().div_(world_size)
        return real.all_reduce(grads, async_op=True).get_future().then(lambda fut: fut.value()[0])

    model.register_forward_pre_hook(checks.grader_hook(on_forward))
    ddp_model.register_comm_hook(None, average)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    numel = sum(p.numel() for p in model.parameters())  # a tiny model: one bucket holds every gradient

    def issued():
        """The collectives this rank has issued so far (None: this torch has no flight recorder)."""
        try:
            return real.collectives()
        except RuntimeError:
            return None

    calls = []
    for step in range(steps):
        batches = [(x.to(dev), y.to(dev)) for x, y in _micro_batches(seed, rank, step, k, size)]
        forwards[0] = 0
        synced.clear()
        weights_at.clear()
        held.clear()
        before = issued()
        spy, carried = comm_spy.spy()  # what each collective of the call sent (DDP's and the student's)
        with spy:
            accumulate_grads(ddp_model, batches)
        after = issued()
        optimizer.step()  # the exercise's given code: one step with what .grad holds, then the gradients zeroed
        optimizer.zero_grad()
        reduced = None
        if before is not None and after is not None:
            last = max([e["seq"] or 0 for e in before], default=0)
            reduced = sum(1 for e in after if (e["seq"] or 0) > last and e["op"] == "all_reduce"
                          and sum(math.prod(shape) for shape in e["sizes"] or []) == numel)
        calls.append({"synced_at": list(synced), "forwards": forwards[0],
                      "all_reduces": reduced, "weights_at": list(weights_at), "held": dict(held), "carried": carried})
    return {"state": _parameters(model), "calls": calls}


def _accumulated(call: dict, seed: int, rank: int, step: int, k: int, size: int) -> tuple[dict, list[dict], list[int]]:
    """(held, grads, sizes): what `.grad` held at call ``step``'s first forward on this rank, grads[j][name], the
    gradient of micro-batch j's mean loss at the weights its forward saw (``call["weights_at"]``, read on the rank;
    the call's first weights for all when the forwards were not one per micro-batch), and the micro-batches' sizes.
    Each micro-batch through the model on its own, as the exercise asks (its BatchNorm normalises with that
    micro-batch's statistics)."""
    model = make_accum_net(0)
    weights = call["weights_at"]
    held = {n: torch.zeros_like(p) if call["held"].get(n) is None else call["held"][n] for n, p in model.named_parameters()}
    batches = _micro_batches(seed, rank, step, k, size)
    grads = []
    for j, (x, y) in enumerate(batches):
        if j == 0 or len(weights) == len(batches):
            model.load_state_dict(weights[j if len(weights) == len(batches) else 0])
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return held, grads, [len(x) for x, _ in batches]


def _accumulate_reference(world_size, k, size, steps, lr, seed, *, mode="share", last_only=False, whole=False):
    """One process: ``steps`` SGD steps, each on every rank's micro-batches, each micro-batch's mean loss weighted
    as ``mode`` says (:func:`loss_weights`) and averaged over the ranks as DDP does. ``share`` is the mean loss
    over all the samples of the step (every rank holds as many). ``last_only``: a mistake, the gradients zeroed
    before each micro-batch, so only the last one's (weighted) gradient reaches the step. Every micro-batch goes
    through the model on its own (its BatchNorm normalises with that micro-batch's statistics). ``whole``: a
    mistake (or a shortcut), each rank's micro-batches put through the model as one batch."""
    model = make_accum_net(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        loss = 0
        for rank in range(world_size):
            batches = _micro_batches(seed, rank, step, k, size)
            if whole:
                batches = [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))]
            weights = loss_weights([len(x) for x, _ in batches], mode)
            for j, (w, (x, y)) in enumerate(zip(weights, batches)):
                if not last_only or j == len(batches) - 1:
                    loss = loss + w * F.mse_loss(model(x), y)
        (loss / world_size).backward()
        optimizer.step()
    return _parameters(model)


def _uneven_batches(seed: int, rank: int, count: int, size: int):
    gen = torch.Generator().manual_seed(20_000 + 1000 * seed + rank)
    return [(torch.randn(size, 4, generator=gen), torch.randn(size, 2, generator=gen)) for _ in range(count)]


def train_steps(ddp_model, optimizer, batches):
    """The exercise's given training loop (part 3): for each (x, y) of ``batches``, one SGD step on the mean
    squared error of ``ddp_model(x)`` against ``y`` (zero_grad, backward, step)."""
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(ddp_model(x), y).backward()
        optimizer.step()


#: check_uneven's second run: each rank adds 1 to UNEVEN_EXTRA batches of its own drawing to counts[rank]
UNEVEN_EXTRA = 3


def _uneven_harness(rank, train_uneven, counts, size, lr, seed, private=False, _urandom=os.urandom):
    """Train with train_uneven on this rank's batches: counts[rank] of them, or (``private``, the second run) a few
    more, a number this rank draws from the OS's randomness and tells no one (returned as ``count``): the counts in
    the arguments, which the student's code can read in the caller's frame, are then no rank's."""
    dev = checks.join_job()
    count = counts[rank] + (1 + _urandom(1)[0] % UNEVEN_EXTRA if private else 0)
    model = make_net(seed + 17 * rank).to(dev)
    ddp_model = _wrap(model, dev)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    steps = [0]
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    batches = [(x.to(dev), y.to(dev)) for x, y in _uneven_batches(seed, rank, count, size)]
    train_uneven(ddp_model, optimizer, batches, train_steps)
    return {"state": checks.to_cpu(model.state_dict()), "steps": steps[0], "count": count}


def _uneven_reference(counts, size, lr, seed, mode):
    """One process's weights after the ranks' training, for each way of handling uneven inputs right.

    ``join``: DDP's Join (divide_by_initial_world_size=True): in step i the ranks that still have a
    batch contribute its gradient, the others zeros, averaged over all ranks. ``join-active``: Join with
    divide_by_initial_world_size=False (averaged over the ranks still training). ``fewest``: every rank
    trains on its first min(counts) batches (the loop equalised to the fewest). ``recycled``: a mistake,
    ranks that run out start over from their first batch."""
    world_size = len(counts)
    data = [_uneven_batches(seed, r, n, size) for r, n in enumerate(counts)]
    model = make_net(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    steps = min(counts) if mode == "fewest" else max(counts)
    for i in range(steps):
        if mode == "recycled":
            batches = [d[i % len(d)] for d in data]
        else:
            batches = [d[i] for d in data if i < len(d)]
        optimizer.zero_grad()
        loss = sum(F.mse_loss(model(x), y) for x, y in batches)
        (loss / (len(batches) if mode == "join-active" else world_size)).backward()
        optimizer.step()
    return model.state_dict()


_TAG = threading.local()  # while _TAG.device is set, torch.save tags tensors as saved from that device
_RESTORED: list[str] = []  # while _WATCH is set: each location torch's restore step was asked to put a tensor
_WATCH = threading.Event()
_PRIORITY = -271  # before torch's own packages (cpu is 10, cuda 20)


def _tag(storage):
    return getattr(_TAG, "device", None)  # None: torch's own taggers say where the tensor is


def _spy(storage, location):
    if _WATCH.is_set():
        _RESTORED.append(str(location))
    return None  # torch's own deserializers then restore it


# One package in torch.serialization's registry, consulted before torch's own: on save it tags
# tensors only while save_from_gpu asks it to; on load it only watches, and only while a harness
# asks it to. Registered at import (in a rank, before the student's objects are unpickled), once
# per process: two packages of one priority would make the registry's sort compare functions.
if not any(entry[0] == _PRIORITY for entry in torch.serialization._package_registry):
    torch.serialization.register_package(_PRIORITY, _tag, _spy)


def save_from_gpu(obj, path, device: str = SAVED_FROM) -> None:
    """torch.save(obj, path) with every tensor tagged as saved from ``device`` (as rank 0's GPU save would be).

    The tag goes through torch.serialization's own package registry (a tagger consulted before torch's),
    for this thread only: the file is exactly what torch.save writes on that device."""
    _TAG.device = device
    try:
        torch.save(obj, path)
    finally:
        _TAG.device = None


def _checkpoint_case(seed: int):
    """The saved weights and epoch of check_load_checkpoint."""
    return checks.to_cpu(make_net(seed + 500).state_dict()), 3 + 4 * seed + 2


def _load_harness(rank, load_checkpoint, ckpt_path, seed):
    dev = checks.join_job()
    model = make_net(seed + 17 * rank).to(dev)
    ddp_model = _wrap(model, dev)
    _RESTORED.clear()
    _WATCH.set()
    error = None
    try:
        returned = load_checkpoint(ckpt_path, ddp_model, dev)
    except RuntimeError as exc:  # torch.load put a tensor on a GPU this rank does not have
        if "Attempting to deserialize object on" not in str(exc):
            raise
        error, returned = str(exc).splitlines()[0][:300], None
    finally:
        _WATCH.clear()
    registry = getattr(torch.serialization, "_package_registry", None)
    watched = bool(registry) and registry[0][2] is _spy  # still the first deserializer torch consults
    on = sorted({str(t.device) for t in [*model.parameters(), *model.buffers()]})
    return {"restored": sorted(set(_RESTORED)), "watched": watched, "error": error, "epoch": _number(returned), "device": str(dev),
            "on": on, "state": checks.to_cpu(model.state_dict()) if on == [str(dev)] else None}
