"""What the checks of exercise 2's DDP-from-scratch notebook run and compare with, apart from their
verdicts (:mod:`graders.ddp_from_scratch.checks`): the models and data, the bucket rule, the single-process
references, and the harness that trains the student's wrapper on every rank and observes it.

How the harness observes communication (torch 2.13, gloo):

* torch's flight recorder (:data:`course.checks.REAL`'s ``collectives``, written by the process group
  itself) lists every collective a rank issued, of every kind and on every group: its op, its
  tensors' sizes and dtypes, its sequence number. It does not hold what the tensors carried, and on
  gloo its entries stay "scheduled": it says nothing of when a collective completed.
* so the harness also spies on the collectives (:func:`graders.common.comm_spy.spy`, a dispatch mode it enters
  around each step): for each collective, what this rank sent and when it was issued. A collective
  the spy did not see (issued from another thread, or with the mode popped) is still in the flight
  recorder, and the checks compare the two.
* ``watch`` holds one rank back before its backward at each step (a different rank each step) until
  every other rank's backward has reached the first layer (the grader's hook there says so through the
  job's store), or at most a few seconds: an all-reduce cannot complete before every rank has joined
  it, so a rank whose backward reaches the first layer before the late rank even started backward went
  on computing while its buckets were in flight; one that blocks in a hook cannot, and the late rank
  starts only when its wait runs out. Waiting for the others' progress, not a fixed time, keeps a
  right answer's step fast and its verdict the same on a loaded machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d

from course import checks
from graders.common import comm_spy

LR = 0.1
MiB = 2**20
VOCAB = 11

_REAL = checks.REAL  # torch's own functions, taken before any student code runs (the captured-torch guard)
_CLOCK = time.monotonic  # system-wide on Linux: the ranks' readings compare across processes
_SLEEP = time.sleep
_STORE = c10d._get_default_store  # the job's key-value store: the early ranks tell the late one they are through


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
    """The buckets of DDP's rule (torch's ``_compute_bucket_assignment_by_size``, on the parameters in reverse
    order of ``model.parameters()``, as DDP rebuilds them): each parameter joins the current bucket, which
    closes once its bytes reach or exceed ``bucket_size_mb`` MiB (rounded down to whole bytes, as DDP's
    ``int(bucket_cap_mb * 2**20)``): the parameter that crosses the limit stays in that bucket."""
    limit = int(bucket_size_mb * MiB)
    buckets, current, size = [], [], 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        current.append(name)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# --- the references: one process ------------------------------------------------------------------


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


def local_grads(kind: str, step: dict, width: int, batch, *, held: bool = True) -> dict:
    """What a rank's backward left in each ``.grad`` before any communication: the gradient of its own
    batch's loss at the weights it started the step with (``step["start"]``, read on the rank), added to
    what ``.grad`` held when backward began (``step["held"]``: None after the grader's zero_grad, unless
    the wrapper wrote there since); ``held=False``: backward's own part only."""
    model = make_model(kind, 0, width)
    model.load_state_dict(step["start"])
    x, y = batch
    loss_of(kind, model(x), y).backward()
    held = (step.get("held") if held else None) or {}
    return {n: None if p.grad is None and held.get(n) is None else
            (torch.zeros_like(p) if p.grad is None else p.grad.detach()) + (0 if held.get(n) is None else held[n])
            for n, p in model.named_parameters()}


# --- the flight recorder -------------------------------------------------------------------------------


def _key(entry: dict) -> tuple:
    return entry["group"], entry["p2p"]


def _number(entry: dict) -> int:
    return (entry["p2p_seq"] if entry["p2p"] else entry["seq"]) or 0


def _mark(real: checks.RealTorch) -> dict:
    """Each group's last sequence number (collectives and point-to-point apart) so far."""
    mark: dict = {}
    for e in real.collectives():
        mark[_key(e)] = max(mark.get(_key(e), 0), _number(e))
    return mark


def _since(entries: list[dict], mark: dict) -> list[dict]:
    """The collectives, of every kind, issued after ``mark`` (a group made since counts whole)."""
    return [e for e in entries if _number(e) > mark.get(_key(e), 0)]


def _issued(entries: list[dict]) -> list[dict]:
    """What the flight recorder says of each collective: op, and per tensor its shape and number of values."""
    return [{"op": e["op"], "p2p": e["p2p"], "shapes": [list(s) for s in e["sizes"] or []],
             "numels": [math.prod(s) for s in e["sizes"] or []]} for e in entries]


# --- the harness (runs on every rank) -------------------------------------------------------------


_URANDOM = os.urandom
marker = comm_spy.marker  # every all-reduce, all-gather and send of a marked step carries a secret number


def train_harness(rank, wrapper_cls, kwargs, kinds, width, seed, same_seed, steps, watch=None, marked_step=False):
    """Wrap each kind of model in the student's class and train ``steps`` steps; per step, what the
    optimizer saw, the weights after it and the collectives the flight recorder lists.

    ``watch = (offset, wait)``: also spy on the collectives (:func:`graders.common.comm_spy.spy`), keep the weights
    each step started from and the times backward started and reached the first layer; with an ``offset``,
    at step s rank (offset + s) % world_size is late: between its forward and its backward it waits until
    every other rank's backward has reached the first layer, at most ``wait`` seconds.

    ``marked_step``: each step runs under :func:`marker` (every value an all-reduce, all-gather or send carries is moved
    by a number of this rank's own); the step's record holds the numbers and the weights it started from."""
    real = _REAL
    dev = checks.join_job()
    world_size = real.get_world_size()
    store = _STORE()
    out = {}
    # the observers are made here, before any of the student's code runs in this harness (a wrapper's __init__
    # that patches graders.common.comm_spy's clock or ops, or this module's random source, changes nothing they hold)
    spy, carried = comm_spy.spy() if watch else (contextlib.nullcontext(), [])
    marks, numbers = marker() if marked_step else (contextlib.nullcontext(), [])
    clock, sleep, urandom = _CLOCK, _SLEEP, _URANDOM
    for kind in kinds:
        # ranks seeded differently draw their seed here, from os.urandom: rank 0's weights are nowhere but in rank 0
        model = make_model(kind, seed if same_seed else int.from_bytes(urandom(8), "little"), width).to(dev)
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
        at_first: list[tuple] = []  # when the first layer's hook ran, with the gradient it was given (watched)
        signal: list = [None]  # the store key that tells the late rank so, in a watched step

        def on_first(grad, at_first=at_first, signal=signal):
            # the checker takes the last call whose gradient is the true one: backward's own comes after any made
            # by hand before it
            at_first.append((clock(), grad.detach().to("cpu", torch.float32).clone() if watch else None))
            if signal[0] is not None:
                store.set(signal[0], "1")
            return grad

        first_layer(model).register_hook(on_first)
        record = []
        for step, batches in enumerate(make_batches(kind, seed, world_size, steps)):
            x, y = (t.to(dev) for t in batches[rank])
            optimizer.zero_grad(set_to_none=True)
            start = checks.to_cpu(model.state_dict()) if watch or marked_step else None
            marked = len(numbers)
            mark = _mark(real)
            del at_first[:]
            first = len(carried)
            late = watch is not None and watch[0] is not None and rank == (watch[0] + step) % world_size
            keys = [f"ex2s/{kind}/{step}/{r}" for r in range(world_size)]
            signal[0] = keys[rank] if watch is not None and watch[0] is not None and not late else None
            with marks, spy:  # the spy, innermost, copies what was sent before the marker moves it
                loss = loss_of(kind, wrapper(x), y)
                if late:
                    _wait_for(store, [k for r, k in enumerate(keys) if r != rank], watch[1], clock, sleep)
                held = {n: None if p.grad is None else p.grad.detach().to("cpu", torch.float32).clone()
                        for n, p in params.items()} if watch else None  # what backward will add to
                backward_at = clock()
                loss.backward()
                wrapper.finish_gradient_synchronization()
                optimizer.step()
            record.append({"grads": seen[-1] if len(seen) > step else None,
                           "state": checks.to_cpu(model.state_dict()),
                           "issued": _issued(_since(real.collectives(), mark)), "start": start, "held": held,
                           "carried": carried[first:], "backward_at": backward_at,
                           "first_calls": list(at_first), "marks": numbers[marked:]})
        out[kind] = {"before": before, "after": after, "steps": record}
    return out


def _wait_for(store, keys: list[str], wait: float, clock, sleep) -> None:
    """Until every key is in the store, at most ``wait`` seconds."""
    deadline = clock() + wait
    while clock() < deadline and not store.check(keys):
        sleep(0.002)
