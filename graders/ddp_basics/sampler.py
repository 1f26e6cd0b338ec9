"""Checks for exercise 2, part 2 (exercises/ex2-ddp-basics/ddp_basics.ipynb): a distributed sampler of the
student's own, ``ShardSampler(dataset, num_replicas, rank, seed=0, drop_last=False)`` with ``__iter__``,
``__len__`` and ``set_epoch``, judged against the contract of ``torch.utils.data.DistributedSampler``:

* :func:`check_sampler_shards`: in each epoch the ranks' shares have equal length and, with
  ``drop_last=False``, cover the dataset with only the padding repeated; with ``drop_last=True`` they are
  ``n // num_replicas`` distinct indices each, nothing repeated;
* :func:`check_sampler_order`: the order is shuffled, changes with ``set_epoch``, and depends on the seed
  and the epoch only (a new sampler, later, in a process whose random state is its own, yields the same; and
  the sampler's calls run no collective, as torch's flight recorder shows: an order drawn on one rank and
  broadcast, kept per seed and epoch, would pass the rest and still differ from job to job);
* :func:`check_sampler_training`: in a real DDP training run with the sampler in a ``DataLoader``, every
  rank takes the same number of steps, ``len(loader)`` is that number, and every epoch trains on every sample.

Every job runs on real ranks whose global random states (torch, ``random``, numpy) differ, as in a job that
seeds its augmentations with ``base + rank``: a sampler whose order comes from the process's random state,
not from its seed and epoch, splits the data differently on each rank, as it would in a real job. The
sampler must be the student's own: torch's ``DistributedSampler`` code running during its calls (a
subclass, a wrapped instance) fails every check (seen by a profile hook on code objects, whatever name
the student's code reached the class by). Undoing the grader's watch does not hide it: the profile hook
knows torch's methods by their bytecode (a copy of torch's source executed under another file name
runs the same bytecode), and after the sampler's calls the harness looks through every function alive
in the rank for a copy of torch's ``__init__`` or ``__iter__`` that is not torch's own (a reloaded
``torch.utils.data.distributed``, an ``exec`` of its source), which a profile hook removed by the
student's code does not hide. Nor does calling torch's originals behind the counting wrappers: each is held by a
generator only (no attribute, closure or default of the grader hands it out), every call through it is counted in
the rank since it began, and an audit hook counts the ways left to reach it (a generator's frame, the garbage
collector's object lists, rewriting the class or a wrapper). What the harness watches with is bound when this
module is imported, before any student code runs in a rank (:func:`_watch_torch_sampler`).
"""

from __future__ import annotations

import functools
import gc
import math
import os
import random
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from course import checks
from course.checks import CheckFailed, Mistake, passed
from graders.common.ddp_model import IndexDataset, RegressionDataset, make_net

_REAL = checks.REAL
_TORCH_SAMPLER_FILE = os.path.join("torch", "utils", "data", "distributed.py")
#: (dataset size, seed, drop_last) of the visible tests: sizes that do not divide by 2 or 3
CASES = ((10, 0, False), (7, 3, False), (11, 5, True))
#: epochs after the first two read with drop_last (6 in all): the same left-over indices in every one of them is a
#: dataset cut before its shuffle (a shuffled order leaves the same ones out 6 times with odds below 1e-5 here)
LEFTOVER_EPOCHS = 4
_SIGNATURE = "ShardSampler(dataset, num_replicas=..., rank=..., seed=..., drop_last=...)"


# --- on the ranks ----------------------------------------------------------------------------------------


def _own_random_state(rank: int) -> None:
    """Give this rank a global random state of its own (torch, random, numpy), as a real job's ranks have."""
    seed = int.from_bytes(os.urandom(4), "little") + rank
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy ships with torch's CPU wheels
        pass


_METHODS = ("__init__", "__iter__", "__len__", "set_epoch")
#: audit events through which torch's original methods could be reached behind the watch (see :func:`_audit`)
_WATCHED_EVENTS = frozenset({"object.__getattr__", "object.__setattr__", "gc.get_objects", "gc.get_referrers",
                             "gc.get_referents"})


def _fingerprint(code) -> tuple:
    return code.co_code, code.co_names


def _ledger(originals: frozenset, fingerprints: frozenset, _objects=gc.get_objects, _function=type(_fingerprint),
            _print=_fingerprint, _getpid=os.getpid):
    """The watch's record, kept in a generator's frame: no attribute, closure or global of the grader holds it, and
    the frame is reached only through ``gi_frame`` or the garbage collector, which the audit hook sees.

    Commands (``send((command, arg))``): ``("tick", kind)`` counts a call of torch's methods (``"torch"``), a reach
    behind the watch (``"tamper"``) or torch's code seen by the profile hook (``"profiled"``); ``("read", None)``
    returns the counts since this process began; ``("forked", None)`` starts them again in a forked process (once:
    a process's own counts are never reset); ``("scan", None)``: whether a function alive in this process runs
    torch's ``__init__`` or ``__iter__`` bytecode without being torch's own (a reloaded module's, an exec of its
    source under another name, a function made from the original code)."""
    counts, born, reply = {"torch": 0, "tamper": 0, "profiled": 0}, _getpid(), None
    while True:
        command, arg = yield reply
        reply = None
        if command == "tick" and arg in counts:
            counts[arg] += 1
        elif command == "read":
            reply = dict(counts)
        elif command == "forked" and _getpid() != born:
            counts, born = {k: 0 for k in counts}, _getpid()
        elif command == "scan":
            reply = any(type(obj) is _function and id(obj) not in originals and _print(obj.__code__) in fingerprints
                        for obj in _objects())


def _gate(original, ledger):
    """Generator: the one holder of one of torch's original methods; every call through it is counted first."""
    args, kwargs = yield
    while True:
        ledger(("tick", "torch"))
        try:
            reply = (True, original(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, without the frames that hold `original`
            reply = (False, exc.with_traceback(None))
        args, kwargs = yield reply


def _counting(original, gate):
    @functools.wraps(original)
    def counted(*args, **kwargs):
        ok, value = gate((args, kwargs))
        if ok:
            return value
        raise value

    del counted.__wrapped__  # no handle on the original
    counted._ddp_course_counted = True  # a reload of this module does not wrap it again
    return counted


def _audit(ledger, gates: frozenset, protected: frozenset, ledger_code, _getframe=sys._getframe):
    """The audit hook (never removed): counts as a reach behind the watch reading a gate's frame, setting an attribute
    of torch's DistributedSampler or of a counting wrapper (restoring or rewriting a method), and any use of the
    garbage collector's object lists but the ledger's own scan (they hand out torch's original functions)."""

    def hook(event, args):
        if event not in _WATCHED_EVENTS:
            return
        try:
            if event == "object.__getattr__":
                tampered = id(args[0]) in gates
            elif event == "object.__setattr__":
                tampered = id(args[0]) in protected
            else:
                tampered = _getframe(1).f_code is not ledger_code
            if tampered:
                ledger(("tick", "tamper"))
        except Exception:  # noqa: BLE001 - never disturb the code being audited
            pass

    return hook


def _watch_torch_sampler() -> dict:
    """Count every call of torch's DistributedSampler methods in this process, whatever reached them.

    Run when this module is imported, which in a rank is before the student's objects are unpickled
    (:func:`course.launcher.rank.load_payload`): each method of the class is replaced by a counting wrapper whose
    original is held only by a generator (:func:`_gate`), so neither an attribute nor a closure nor a default hands
    out an uncounted original; the counts live in another generator (:func:`_ledger`); an audit hook counts the ways
    left to reach them (:func:`_audit`); a forked process counts anew. A reload of this module finds the wrappers and
    the watch in place and keeps them."""
    from torch.utils.data import distributed

    watch = globals().get("_WATCH")
    if watch is not None:
        return watch
    cls = distributed.DistributedSampler
    originals = {name: cls.__dict__[name] for name in _METHODS if name in cls.__dict__}
    if any(getattr(fn, "_ddp_course_counted", False) for fn in originals.values()):
        return {"ledger": None, "fingerprints": frozenset()}  # another copy of this module (an exec of its source)
    fingerprints = frozenset(_fingerprint(originals[n].__code__) for n in ("__init__", "__iter__") if n in originals)
    ledger_gen = _ledger(frozenset(id(fn) for fn in originals.values()), fingerprints)
    next(ledger_gen)
    ledger = ledger_gen.send
    gates, wrappers = [], []
    for name, original in originals.items():
        gate = _gate(original, ledger)
        next(gate)
        gates.append(gate)
        wrappers.append(_counting(original, gate.send))
        setattr(cls, name, wrappers[-1])
    del original, originals  # this frame ends anyway; nothing of this module keeps them
    protected = frozenset([id(cls), *(id(w) for w in wrappers)])
    # in every process that imports this module: a rank forked from one that had it imported inherits both
    sys.addaudithook(_audit(ledger, frozenset(id(g) for g in (*gates, ledger_gen)), protected, ledger_gen.gi_code))
    os.register_at_fork(after_in_child=lambda: ledger(("forked", None)))
    return {"ledger": ledger, "fingerprints": fingerprints}  # the gates stay alive through the wrappers


_WATCH = _watch_torch_sampler()


def _torch_sampler_used(_ledger=_WATCH["ledger"]) -> bool:
    """Whether torch's DistributedSampler ran in this process, or was reached behind the watch, or copied (the
    ledger's counts since the process began, and its scan)."""
    if _ledger is None:
        return False
    counts = _ledger(("read", None))
    return bool(counts["torch"] or counts["tamper"] or counts["profiled"] or _ledger(("scan", None)))


class _TorchSamplerSpy:
    """Whether torch's DistributedSampler ran while the student's sampler was used: the counting wrappers and the
    audit hook above (:func:`_watch_torch_sampler`), a profile hook on code objects (the file, or torch's bytecode,
    tells, whatever name the code was reached by, also after a reload of torch's module or an exec of its source),
    and, on leaving, a copy of torch's methods among the live functions (which removing the profile hook does not
    hide). What it concludes is read from the ledger, not from this object (which the student's code can reach)."""

    def __init__(self, _ledger=_WATCH["ledger"], _fingerprints=_WATCH["fingerprints"], _getprofile=sys.getprofile,
                 _setprofile=sys.setprofile, _used=_torch_sampler_used):
        self._ledger, self._getprofile, self._setprofile, self._used = _ledger, _getprofile, _setprofile, _used
        self._fingerprints = _fingerprints
        self._previous = None
        self.seen = False

    def _hook_for(self):
        ledger, known, fingerprints = self._ledger, {}, self._fingerprints

        def hook(frame, event, arg):
            if event != "call":
                return
            code = frame.f_code
            found = known.get(id(code))
            if found is None:  # each code object judged once (kept alive here, so its id is not reused)
                found = known[id(code)] = (code, code.co_filename.endswith(_TORCH_SAMPLER_FILE)
                                           or _fingerprint(code) in fingerprints)
            if found[1] and ledger is not None:
                ledger(("tick", "profiled"))

        return hook

    def __enter__(self):
        self._previous = self._getprofile()
        self._setprofile(self._hook_for())
        return self

    def __exit__(self, *exc):
        self._setprofile(self._previous)
        self.seen = self._used()
        return False


def _make(Sampler, dataset, world_size, rank, seed, drop_last):
    return Sampler(dataset, num_replicas=world_size, rank=rank, seed=seed, drop_last=drop_last)


def _length(sampler):
    """len(sampler) as an int, or what asking for it gave instead (a repr, an error's text)."""
    try:
        length = len(sampler)
        return int(length) if int(length) == length else repr(length)
    except Exception as exc:  # noqa: BLE001 - shown to the student
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def _indices(sampler) -> list:
    out = []
    for i in sampler:
        value = i.item() if isinstance(i, torch.Tensor) and i.numel() == 1 else i
        try:
            out.append(int(value) if int(value) == value else repr(i))
        except (TypeError, ValueError):
            out.append(repr(i))
    return out


def _issued(collectives) -> list[tuple]:
    """(sequence number, op) of each collective this rank's process group ran so far (torch's flight recorder)."""
    try:
        return [((e["p2p_seq"] if e["p2p"] else e["seq"]) or 0, e["p2p"], e["op"]) for e in collectives()]
    except RuntimeError:  # a torch without the flight recorder
        return []


def _contract_harness(rank, Sampler, cases, _spy=_TorchSamplerSpy, _collectives=_REAL.collectives,
                      _world_size=_REAL.get_world_size, _used=_torch_sampler_used):
    """Each case: this rank's indices in epochs 0 and 1 (set_epoch), epoch 1 again from a new sampler made
    after other random draws, and epoch 0 with another seed; and the collectives the sampler's calls ran (none
    is needed: the order is every rank's own function of seed and epoch)."""
    checks.join_job()
    world_size = _world_size()
    _own_random_state(rank)
    before = set(_issued(_collectives))
    out = []
    with _spy() as spy:
        for n, seed, drop_last in cases:
            dataset = IndexDataset(n)
            sampler = _make(Sampler, dataset, world_size, rank, seed, drop_last)
            epochs = []
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                epochs.append(_indices(sampler))
            more = []  # with drop_last, epochs enough to see whether the left-over indices change
            for epoch in range(2, 2 + LEFTOVER_EPOCHS if drop_last else 2):
                sampler.set_epoch(epoch)
                more.append(_indices(sampler))
            torch.rand(5), random.random()  # the process's random state moves on; the sampler's order must not
            again = _make(Sampler, dataset, world_size, rank, seed, drop_last)
            again.set_epoch(1)
            other = _make(Sampler, dataset, world_size, rank, seed + 1000, drop_last)
            other.set_epoch(0)
            out.append({"epochs": epochs, "again": _indices(again), "other_seed": _indices(other), "more": more})
    communicated = sorted({op for entry in _issued(_collectives) if entry not in before for op in entry[2:]})
    return {"cases": out, "torch_sampler": spy.seen or _used(), "communicated": communicated}


def _training_harness(rank, Sampler, n, batch_size, epochs, lr, seed, _spy=_TorchSamplerSpy,
                      _world_size=_REAL.get_world_size, _used=_torch_sampler_used):
    """Train a DDP model with the student's sampler in a DataLoader; note what reached the model every step."""
    dev = checks.join_job()
    world_size = _world_size()
    _own_random_state(rank)
    model = make_net(seed + 17 * rank).to(dev)
    dataset = RegressionDataset(n, seed)
    seen: list[list[int]] = []

    def on_forward(module, args):
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            seen.append(dataset.indices_of(args[0]))

    model.register_forward_pre_hook(checks.grader_hook(on_forward))
    ddp_model = DDP(model, device_ids=[dev.index]) if dev.type == "cuda" else DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    per_epoch, lengths = [], []
    with _spy() as spy:
        sampler = _make(Sampler, dataset, world_size, rank, seed, False)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            lengths.append(len(loader))
            seen.clear()
            for x, y in loader:
                optimizer.zero_grad()
                F.mse_loss(ddp_model(x.to(dev)), y.to(dev)).backward()
                optimizer.step()
            per_epoch.append([list(batch) for batch in seen])
        try:  # len() is asked with drop_last too (a sampler that cannot drop is check_sampler_shards' to fail)
            dropping = _make(Sampler, dataset, world_size, rank, seed, True)
            dropping.set_epoch(0)
            drop_last_len = (_length(dropping), len(_indices(dropping)))
        except Exception:  # noqa: BLE001
            drop_last_len = (None, None)
    return {"epochs": per_epoch, "lengths": lengths, "drop_last_len": drop_last_len,
            "torch_sampler": spy.seen or _used()}


# --- the verdicts ----------------------------------------------------------------------------------------


def _contract_job(check, Sampler, world_size, cases):
    checks.require_written(check, ShardSampler=Sampler)
    hints = [("unexpected keyword argument", f"keep the signature: the grader calls {_SIGNATURE}"),
             ("set_epoch", "give the sampler a set_epoch(epoch) method: the training loop calls it every epoch")]
    cases = tuple(tuple(c) for c in cases)
    return checks.memo(check, ("sampler contract", Sampler, world_size, cases), lambda: checks.run(
        check, _contract_harness, world_size, args=(Sampler, cases), hints=hints).values)


def _own(check, values) -> None:
    used = [r for r, v in enumerate(values) if v["torch_sampler"]]
    if used:
        raise CheckFailed(check, "your sampler runs torch's DistributedSampler", ranks=used,
                          expected="a sampler of your own (torch.utils.data.Sampler, or any class with __iter__, "
                          "__len__ and set_epoch)", got="code of torch/utils/data/distributed.py ran in its calls, or a copy of it was made, or "
                          "its original methods were reached behind the grader's watch",
                          hint="this part is about writing the split yourself: shuffle with a generator, pad or "
                          "drop, then take this rank's share")


def _where(n, seed, drop_last, world_size) -> str:
    return f"{n} samples, {world_size} ranks, seed={seed}, drop_last={drop_last}"


def _bad_values(check, shares, n, where) -> None:
    for rank, share in enumerate(shares):
        bad = [i for i in share if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise CheckFailed(check, f"rank {rank}'s sampler yielded something that is not an index of the dataset "
                              f"({where})", ranks=[rank], expected=f"integers 0 .. {n - 1}", got=f"{bad[:5]}",
                              hint="yield Python ints (int(i)), indices into the dataset")


def _judge_shards(check, shares, n, drop_last, world_size, where, epoch) -> None:
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    sizes = [len(s) for s in shares]
    if set(sizes) != {per_rank}:
        wrong = [r for r, k in enumerate(sizes) if k != per_rank]
        if not drop_last and len(set(sizes)) > 1:
            hint = ("pad: repeat the first indices of the epoch's order until the total divides by num_replicas, "
                    "so every rank gets the same number. With unequal shares the ranks take different numbers of "
                    "steps, and DDP waits forever in the all-reduce of the step only some ranks take")
        elif drop_last:
            hint = "with drop_last=True cut the order to n // num_replicas * num_replicas indices before splitting"
        else:
            hint = "every rank gets ceil(n / num_replicas) indices: its share of the padded order, not all of it"
        raise CheckFailed(check, f"the ranks' shares in epoch {epoch} do not have the contract's length ({where})",
                          ranks=wrong, expected=f"{per_rank} indices on every rank "
                          f"({'n // num_replicas' if drop_last else 'ceil(n / num_replicas)'})",
                          got=f"{sizes} indices per rank", hint=hint)
    everything = [i for s in shares for i in s]
    counts: dict[int, list[int]] = {}
    for rank, share in enumerate(shares):
        for i in share:
            counts.setdefault(i, []).append(rank)
    repeated = sorted(i for i, ranks in counts.items() if len(ranks) > 1)
    padding = 0 if drop_last else per_rank * world_size - n
    extra = len(everything) - len(counts)
    if extra > padding:
        same = len(shares) > 1 and all(s == shares[0] for s in shares)
        if same:
            problem, hint = (f"every rank got the same share in epoch {epoch} ({where})",
                             "take this rank's own part of the order (e.g. every num_replicas-th index from "
                             "position rank): the rank argument must change what a sampler yields")
        else:
            problem, hint = (f"the ranks' shares overlap in epoch {epoch} ({where})",
                             "every rank must shuffle with the same permutation (a generator seeded with seed + "
                             "epoch, never with the rank or the process's random state), then take a disjoint part")
        raise CheckFailed(check, problem, ranks=sorted({r for i in repeated for r in counts[i]}),
                          expected="each index on one rank" + (f" (only the {padding} padding indices repeat)"
                                                                if padding else ""),
                          got=f"{extra} extra repeats, e.g. indices {repeated[:8]} on several ranks", hint=hint)
    # with drop_last=False every index is on some rank now: the shares hold n + padding indices, all in 0 .. n-1
    # (_bad_values), at most `padding` of them repeats, so n distinct ones (a mutation run found the check of missing
    # indices that stood here unreachable)


def check_sampler_shards(ShardSampler, *, world_sizes=(2, 3), cases=CASES):
    """Each epoch the ranks' shares have equal length: with drop_last=False ceil(n / num_replicas) each,
    covering the dataset, only the padding repeated; with drop_last=True n // num_replicas distinct indices.
    ``cases``: (dataset size, seed, drop_last)."""
    check = "check_sampler_shards"
    for world_size in world_sizes:
        values = _contract_job(check, ShardSampler, world_size, cases)
        _own(check, values)
        for c, (n, seed, drop_last) in enumerate(cases):
            where = _where(n, seed, drop_last, world_size)
            for epoch in (0, 1):
                shares = [v["cases"][c]["epochs"][epoch] for v in values]
                _bad_values(check, shares, n, where)
                _judge_shards(check, shares, n, drop_last, world_size, where, epoch)
            if drop_last and n % world_size:
                _judge_leftovers(check, [v["cases"][c]["epochs"] + v["cases"][c]["more"] for v in values], n, where)
    passed(check)


def _judge_leftovers(check, epochs_per_rank, n, where) -> None:
    """With drop_last, the n % num_replicas indices left out must change from epoch to epoch (they wait for another
    epoch): the same ones every epoch is a dataset cut before its shuffle. Orders that never change are
    check_sampler_order's to fail, not this check's."""
    per_epoch = list(zip(*epochs_per_rank))  # each epoch: every rank's share
    if len({tuple(map(tuple, shares)) for shares in per_epoch}) == 1:
        return
    left = [frozenset(range(n)) - {i for share in shares for i in share if isinstance(i, int)} for shares in per_epoch]
    if len(set(left)) == 1:
        raise CheckFailed(check, f"the same indices are left out in every epoch ({where})",
                          ranks=range(len(epochs_per_rank)),
                          expected="the n % num_replicas left over change from epoch to epoch, so that every sample is "
                          "trained on in time", got=f"indices {sorted(left[0])} left out in each of {len(left)} epochs",
                          hint="shuffle all n indices first, then drop the end of that order: a dataset cut before "
                          "its shuffle never trains on the samples it cut")


def _unpadded_heads(values, cases, world_size) -> list[list]:
    """Each rank's share of each case and epoch without its last ``padding`` indices (with drop_last=False the
    order is padded with repeats of its first indices, which come last in a share: an order that is not shuffled
    is increasing before them)."""
    heads = []
    for c, (n, _seed, drop_last) in enumerate(cases):
        per_rank = n // world_size if drop_last else -(-n // world_size)
        padding = 0 if drop_last else per_rank * world_size - n
        for v in values:
            for share in v["cases"][c]["epochs"]:
                heads.append(share[:max(len(share) - padding, 0)])
    return heads


def _never_shuffled(heads: list[list]) -> bool:
    """Every head increasing, over enough pairs of neighbours (8) that a shuffled order cannot do it by chance;
    heads holding something other than indices are left to the check of the values."""
    heads = [h for h in heads if all(isinstance(i, int) for i in h)]
    pairs = sum(max(len(h) - 1, 0) for h in heads)
    return pairs >= 8 and all(h == sorted(h) for h in heads)


def check_sampler_order(ShardSampler, *, world_sizes=(2, 3), cases=CASES):
    """The order is shuffled, changes with set_epoch, and is a function of (seed, epoch) only: a new sampler with
    the same seed and epoch yields the same indices (later, whatever the process's random state), another
    seed another order."""
    check = "check_sampler_order"
    for world_size in world_sizes:
        values = _contract_job(check, ShardSampler, world_size, cases)
        _own(check, values)
        talked = [r for r, v in enumerate(values) if v.get("communicated")]
        if talked:
            raise CheckFailed(check, f"the sampler communicated: its order is not every rank's own function of the seed "
                              f"and the epoch ({world_size} ranks)", ranks=talked,
                              expected="no collective in the sampler's calls: each rank draws the same permutation "
                              "by itself, from seed + epoch, in any process and any job",
                              got=f"the process group ran {', '.join(values[talked[0]]['communicated'])} during rank "
                              f"{talked[0]}'s sampler calls",
                              hint="seed a torch.Generator with seed + epoch and draw the permutation on every rank: "
                              "an order drawn on one rank (from its own random state) and sent to the others is "
                              "another order in every job, which a resumed run or an evaluation cannot reproduce")
        heads = _unpadded_heads(values, cases, world_size)
        if _never_shuffled(heads):
            raise CheckFailed(check, f"the indices are not shuffled ({world_size} ranks)", ranks=range(world_size),
                              expected="a random order (a permutation drawn from seed + epoch)",
                              got=f"rank 0: {heads[0][:8]}, always in increasing order (the padding aside)",
                              hint="shuffle the indices with a torch.Generator seeded with seed + epoch "
                              "(torch.randperm(n, generator=g)) before splitting")
        for c, (n, seed, drop_last) in enumerate(cases):
            where = _where(n, seed, drop_last, world_size)
            obs = [v["cases"][c] for v in values]
            for o in obs:
                _bad_values(check, o["epochs"], n, where)
            first = [o["epochs"][0] for o in obs]
            same = [r for r, o in enumerate(obs) if o["epochs"][0] == o["epochs"][1]]
            if len(same) == world_size:
                raise CheckFailed(check, f"set_epoch(1) did not change the order ({where})", ranks=same,
                                  expected="a new order in every epoch", got=f"rank 0 both epochs: {first[0][:8]}",
                                  hint="draw the permutation from seed + epoch, with the epoch set_epoch stored, "
                                  "each time the sampler is iterated (not once in __init__)")
            moved = [r for r, o in enumerate(obs) if o["again"] != o["epochs"][1]]
            if moved:
                r = moved[0]
                raise CheckFailed(check, f"a new sampler with the same seed and epoch yielded other indices ({where})",
                                  ranks=moved, expected=f"rank {r}: {obs[r]['epochs'][1][:8]} (epoch 1, as before)",
                                  got=f"{obs[r]['again'][:8]}",
                                  hint="the order must depend on seed and epoch only: use your own "
                                  "torch.Generator().manual_seed(seed + epoch), not the global random state "
                                  "(torch.randperm without a generator, random.shuffle), which differs "
                                  "between processes and moves on with every draw")
            if all(o["other_seed"] == o["epochs"][0] for o in obs):
                raise CheckFailed(check, f"another seed gave the same order ({where})", ranks=range(world_size),
                                  expected="the seed argument chooses the permutation",
                                  got=f"rank 0 with seed {seed} and {seed + 1000}: {first[0][:8]}",
                                  hint="seed your generator with seed + epoch")
    passed(check)


def check_sampler_training(ShardSampler, *, world_sizes=(2,), n=9, batch_size=2, epochs=2, lr=0.1, seed=0):
    """In a real DDP run with the sampler in a DataLoader: every rank takes the same number of steps each epoch,
    len(loader) is that number, and every epoch trains on every sample."""
    check = "check_sampler_training"
    checks.require_written(check, ShardSampler=ShardSampler)
    mistakes = [Mistake(lambda rank, text: checks.stranded(text),
                        "the ranks took different numbers of steps: rank {rank} waited in DDP's all-reduce for a "
                        "step the others never took ({ws}-rank job, " + f"{n} samples, batch_size={batch_size})",
                        "every rank's share must have the same length (pad with drop_last=False): DDP all-reduces "
                        "the gradients of every step, so a rank with one more batch waits forever")]
    for world_size in world_sizes:
        values = checks.run(check, _training_harness, world_size,
                            args=(ShardSampler, n, batch_size, epochs, lr, seed), mistakes=mistakes).values
        _own(check, values)
        where = f"{world_size}-rank DDP run, {n} samples, batch_size={batch_size}"
        for epoch in range(epochs):
            # the ranks took the same number of steps: one more on some rank is a DDP all-reduce the others never
            # join, a hang the run's mistake above names (a mutation run found the check that stood here unreachable)
            steps = [len(v["epochs"][epoch]) for v in values]
            lengths = [v["lengths"][epoch] for v in values]
            wrong = [r for r in range(world_size) if lengths[r] != steps[r]]
            if wrong:
                r = wrong[0]
                raise CheckFailed(check, f"len(loader) is not the number of batches the loader gives ({where})",
                                  ranks=wrong, expected=f"{steps[r]} (the steps rank {r} took in epoch {epoch})",
                                  got=f"len(loader) = {lengths[r]}",
                                  hint="__len__ must return the number of indices this rank's sampler yields "
                                  "(ceil(n / num_replicas) with padding, n // num_replicas with drop_last): the "
                                  "DataLoader's len, learning-rate schedules and progress bars rely on it")
            dropping = [r for r, v in enumerate(values) if v["drop_last_len"][0] != v["drop_last_len"][1]]
            if dropping:
                r = dropping[0]
                raise CheckFailed(check, f"with drop_last=True, len() of the sampler is not the number of indices it "
                                  f"yields ({world_size} ranks, {n} samples)", ranks=dropping,
                                  expected=f"{values[r]['drop_last_len'][1]} (what rank {r}'s sampler yields: "
                                  f"{n} // {world_size})", got=f"len() = {values[r]['drop_last_len'][0]}",
                                  hint="__len__ must return the number of indices this rank's sampler yields: "
                                  "n // num_replicas with drop_last=True (the DataLoader's len and a loop's count of "
                                  "steps come from it)")
            trained = [i for v in values for batch in v["epochs"][epoch] for i in batch]
            missing = sorted(set(range(n)) - set(trained))
            if missing:
                raise CheckFailed(check, f"epoch {epoch} never trained on {len(missing)} of the {n} samples ({where})",
                                  ranks=range(world_size), expected="every sample on some rank, every epoch",
                                  got=f"missing {missing[:8]}",
                                  hint="every rank must draw the same permutation (seed + epoch, not the rank or "
                                  "the process's random state) and take its own disjoint part of it")
    passed(check)
