"""What a rank's collectives carried: a spy on torch's collective ops, and comparisons of what they sent
with the gradients a check expects.

torch's flight recorder (:func:`course.checks.collectives`) lists the collectives a rank issued: op,
input and output sizes and dtypes, sequence number, the issuing thread and when it was created. What
it does not give (measured, torch 2.13 on gloo): what a collective *carried* (no content); when it
started or completed (each entry stays "scheduled", its discovered times None); point-to-point
send/recv (not listed at all); and a reduce_scatter shows up as an all_reduce of the whole input. Every
``torch.distributed`` collective (``dist.all_reduce``, ``all_gather``, ``send``, the coalesced and the
functional ones, DDP's own) reaches the process group through one of the dispatcher ops
``c10d::*`` / ``_c10d_functional::*``; :func:`spy` is a dispatch mode that sees those calls, on the
thread that enters it (and autograd's hooks that thread runs), and records what this rank sent (a copy
of the op's input tensors, taken before the op runs) and when (a clock taken at import).

It records only the real ops, recognised by identity (taken when this module is imported, in a rank
before any student object is unpickled), and it records by running them: a record cannot be made
without communicating what it shows. A collective issued where the spy does not look (another thread,
the mode popped) is still in the flight recorder: checks compare the two.
"""

from __future__ import annotations

import os
import random
import time

import torch

ATOL = 1e-5  # float32 sums in another order (flat buckets, a ring) differ by ~1e-7

_CLOCK = time.monotonic  # system-wide on Linux: the ranks' readings compare across processes


def _collective_ops() -> dict[int, tuple]:
    """id(op) -> (op, kind, index of the argument that holds what this rank sends) for torch's
    collective ops; the kinds that sum over the ranks are all "all_reduce"."""
    table = {
        "c10d": [("allreduce_", "all_reduce", 0), ("allreduce_coalesced_", "all_reduce", 0),
                 ("broadcast_", "broadcast", 0), ("reduce_", "reduce", 0), ("send", "send", 0),
                 ("recv_", "recv", 0), ("recv_any_source_", "recv", 0),
                 ("allgather_", "all_gather", 1), ("_allgather_base_", "all_gather", 1),
                 ("allgather_coalesced_", "all_gather", 1), ("allgather_into_tensor_coalesced_", "all_gather", 1),
                 ("reduce_scatter_", "reduce_scatter", 1), ("_reduce_scatter_base_", "reduce_scatter", 1),
                 ("reduce_scatter_tensor_coalesced_", "reduce_scatter", 1), ("alltoall_", "all_to_all", 1),
                 ("alltoall_base_", "all_to_all", 1), ("gather_", "gather", 1), ("scatter_", "scatter", 1)],
        "_c10d_functional": [("all_reduce", "all_reduce", 0), ("all_reduce_", "all_reduce", 0),
                             ("all_reduce_coalesced", "all_reduce", 0), ("all_reduce_coalesced_", "all_reduce", 0),
                             ("all_gather_into_tensor", "all_gather", 0), ("reduce_scatter_tensor", "reduce_scatter", 0),
                             ("all_to_all_single", "all_to_all", 0), ("broadcast", "broadcast", 0),
                             ("broadcast_", "broadcast", 0)],
    }
    found = {}
    for namespace, ops in table.items():
        space = getattr(torch.ops, namespace)
        for op, kind, arg in ops:
            try:
                overload = getattr(space, op).default
            except (AttributeError, RuntimeError):
                continue  # not in this torch
            found[id(overload)] = (overload, kind, arg)
    return found


_OPS = _collective_ops()
#: the kinds in which every rank sends what it passes (a broadcast's or scatter's receivers, a recv, do not)
SENDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce", "gather", "send")


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def spy():
    """(a dispatch mode, the list it fills): each collective dispatched while the mode is on, as
    ``{"op": "all_reduce", "t": issued, "values": [what this rank sent, flat float32 copies],
    "dtypes": [the dtype each of those tensors had, e.g. "torch.bfloat16"]}``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops, clock, records = _OPS, _CLOCK, []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            found = ops.get(id(func))
            if found is not None and found[0] is func:
                _, kind, at = found
                sent = args[at] if len(args) > at else kwargs.get(func._schema.arguments[at].name)
                tensors = _tensors(sent)
                records.append({"op": kind, "t": clock(), "dtypes": [str(t.dtype) for t in tensors],
                                "values": [t.detach().reshape(-1).to("cpu", torch.float32).clone()
                                           for t in tensors]})
            return func(*args, **kwargs)

    return Spy(), records


# --- the marker: a secret number on what a collective carries ---------------------------------------------

#: the collectives whose every sent value :func:`marker` moves by default (each rank sends what it passes)
MARKED = ("all_reduce", "all_gather", "send")
try:  # a Work that completes with a future: how an in-place all-reduce's moved result reaches its caller
    from torch._C._distributed_c10d import Work as _WORK
    from torch._C._distributed_c10d import _create_work_from_future as _FROM_FUTURE
except ImportError:  # pragma: no cover - another torch: the number is added in place (the rank can read it)
    _WORK = _FROM_FUTURE = None


def marker(kinds: tuple = MARKED, *, with_kind: bool = False, _ops=_OPS, _tensors=_tensors, _random=random.Random,
           _urandom=os.urandom, _no_grad=torch.no_grad, _work=_WORK, _from_future=_FROM_FUTURE, _mode=None):
    """(a dispatch mode, the list it fills): each collective of ``kinds`` dispatched while the mode is on sends every
    value its caller passed plus a number drawn on this rank from ``os.urandom`` (``[0.5, 1)``), and the number is
    appended to the list (``with_kind``: as ``(kind, number)``, e.g. ``("all_gather", 0.73)``). The k-th
    collective therefore delivers the sum of every rank's k-th number on top of what was sent: the ranks' numbers
    are secret to each other, so only a result that came out of the collective carries their sum, and the grader,
    which gets every rank's numbers, checks for it. Values sent another way (the job's store, a file, point to
    point from another thread) or recomputed locally carry none. The caller's own tensor never shows its number:
    the collective runs on a moved copy (an in-place all-reduce's result is copied into the caller's tensor as the
    collective completes, before the caller's ``work.wait()`` returns), so a rank cannot read its number and send
    it along another way. Every reference it uses is a default argument, bound when this module was first imported
    (in a rank, before any student object is unpickled): a reload of this module, or a patch of its globals, from
    the student's code changes nothing a running harness holds."""
    if _mode is None:
        from torch.utils._python_dispatch import TorchDispatchMode as _mode

    draw, marked = _random(_urandom(16)).random, []

    def moved(value, number):
        if isinstance(value, torch.Tensor):
            return value + number if value.is_floating_point() else value
        return type(value)(moved(v, number) for v in value)

    class Marker(_mode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            found = _ops.get(id(func))
            if found is None or found[0] is not func or found[1] not in kinds:
                return func(*args, **kwargs)
            _, kind, at = found
            sent = args[at] if len(args) > at else kwargs.get(func._schema.arguments[at].name)
            floats = [t for t in _tensors(sent) if t.is_floating_point()]  # values (DDP's counts and flags: left)
            if not floats:
                return func(*args, **kwargs)
            number = 0.5 + draw() / 2
            marked.append((kind, number) if with_kind else number)
            in_place = func._schema.name.startswith("c10d::") and kind == "all_reduce"
            if len(args) <= at or (in_place and _from_future is None) or (
                    func._schema.name.startswith("_c10d_functional::") and func._schema.name.endswith("_")):
                with _no_grad():  # no other way: moved in place
                    for t in floats:
                        t.add_(number)
                return func(*args, **kwargs)
            with _no_grad():
                copy = moved(sent, number)
            result = func(*args[:at], copy, *args[at + 1:], **kwargs)
            if not in_place:
                return result
            work = result[1] if isinstance(result, tuple) else result
            pairs = list(zip(_tensors(sent), _tensors(copy)))

            def deliver(fut, pairs=pairs):
                with _no_grad():
                    for mine, theirs in pairs:
                        if mine is not theirs:
                            mine.copy_(theirs)
                return [mine for mine, _ in pairs]

            chained = _from_future(_work.unbox(work).get_future().then(deliver)).boxed()
            return (sent, chained) if isinstance(result, tuple) else chained

    return Marker(), marked


# --- what they carried ------------------------------------------------------------------------------


def _contains(a: list, b: list) -> bool:
    """Whether sorted ``a`` holds every value of sorted ``b``, each once, within ATOL."""
    i = 0
    for v in b:
        while i < len(a) and a[i] < v - ATOL:
            i += 1
        if i == len(a) or a[i] > v + ATOL:
            return False
        i += 1
    return True


def holds(values: torch.Tensor, target: torch.Tensor, scales=(1.0,), *, exactly: bool) -> bool:
    """Whether ``values`` holds every value of ``target`` times one of ``scales``, in any order;
    ``exactly``: and nothing else."""
    if target.numel() == 0 or values.numel() < target.numel() or (exactly and values.numel() != target.numel()):
        return False
    a = values.float().sort().values
    for scale in scales:
        b = (target.float() * scale).sort().values
        if (a - b).abs().max().item() <= ATOL if exactly else _contains(a.tolist(), b.tolist()):
            return True
    return False
