"""Forgeries that reach what a check reads from the student's own process (issue 37, the residual holes):

* code that runs while the student's objects are unpickled in a rank (a default argument's ``__reduce__``), before
  the harness starts: it replaces a grader module's global (the captured torch functions a harness reads at its
  start) to hide a collective from the flight recorder's count. The rank unpickles the harness first and imports
  its modules and the check API (:func:`course.launcher.rank.load_payload`), and the harnesses act through
  references bound at import, so the swap reaches nothing the check reads;
* the mixed-precision step's clip (:mod:`graders.ddp_in_practice.precision`): a clip factor worked out before DDP's all-reduce
  from the other ranks' data recomputed locally, with the grader's record of what each rank sent rewritten to the
  unscaled values. Each rank's data is now its own secret, so the factor is another one than the synced
  gradient's, and the clipped weights show it;
* the sampler (:mod:`graders.ddp_basics.sampler`): torch's original methods reached behind the counting wrappers (an
  attribute, the wrapper's closure, the garbage collector) and called with the profile hook removed;
* the ZeRO save (:mod:`graders.syncbn_sharding.zero`): a save that gathers every rank's share and writes it all on every rank,
  hidden by a loader that takes each parameter from its owner's file.

Each is called on the checks directly (this process; the ranks are real) and must score 0 on its target, the
part's other checks keeping the reference's verdicts.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_forged_evidence import clip_factor_beforehand  # the clip factor forgery, before the rewrite

import graders.ddp_in_practice.precision as amp

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

fails = submissions.fails


# --- code run as the student's objects are unpickled ---------------------------------------------------


def _swap_the_graders_torch():
    """Replace the captured-torch object the mixed-precision harness reads (its module's ``_REAL``) by one whose
    flight-recorder reader leaves out every all_gather."""
    import graders.ddp_in_practice.precision_harness as harness_module

    real = harness_module._REAL

    class Filtered:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def collectives():
            return [e for e in real.collectives() if e["op"] != "all_gather"]

    harness_module._REAL = Filtered()
    return None


class _OnUnpickle:
    """A default argument whose unpickling runs :func:`_swap_the_graders_torch` (in the rank, before the harness)."""

    def __reduce__(self):
        return (_swap_the_graders_torch, ())


def _amp_right(ddp_model, optimizer, scaler, micro_batches, max_norm):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with torch.autocast(device_type=x.device.type, dtype=torch.float16):
                loss = F.mse_loss(ddp_model(x), y)
            scaler.scale(loss / k).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


def amp_gathering_hidden_at_unpickling(ddp_model, optimizer, scaler, micro_batches, max_norm, _hide=_OnUnpickle()):
    """The step, then every rank's gradients all-gathered (a collective the part excludes), hidden from the
    flight recorder's count by the grader module's global swapped while this function was unpickled."""
    _amp_right(ddp_model, optimizer, scaler, micro_batches, max_norm)
    flat = torch.cat([p.grad.reshape(-1) for p in ddp_model.parameters()])
    dist.all_gather([torch.empty_like(flat) for _ in range(dist.get_world_size())], flat)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_grader_global_swapped_while_unpickling_hides_nothing():
    """Before: check_amp_sync passed (the harness read the swapped _REAL at its start). Now: the harness's
    references are bound at import, which the rank does before the student's objects are unpickled."""
    fails(amp.check_amp_sync, amp_gathering_hidden_at_unpickling, "other collectives than DDP's all-reduce",
          "all_gather")
    amp.check_amp_step(amp_gathering_hidden_at_unpickling)
    amp.check_clip(amp_gathering_hidden_at_unpickling)


def _probe_order():
    """What a student's object sees as it is unpickled in a rank: whether the check API is bound already."""
    import sys as _sys

    return "course.checks" in _sys.modules


class _Probe:
    def __reduce__(self):
        return (_probe_order, ())


def _same_object(rank, a, b, seen):
    return [a is b, seen]


def test_the_check_api_is_bound_before_the_students_objects_and_shared_objects_stay_one():
    """The payload's two stages: the harness (and the modules it binds at import, the check API always), then the
    arguments; one unpickler reads both, so an object the function and its arguments share stays one object."""
    from course.launcher.job import launch

    shared = [1, 2]
    assert launch(_same_object, 2, args=(shared, shared, _Probe()), echo=False).values == [[True, True]] * 2


# --- the mixed-precision clip: a factor worked out beforehand, the grader's record rewritten --------------


def _comm_hook_records(ddp_model):
    """The lists the grader's DDP communication hook appends its records to (reached through the hook's closure)."""
    for hook, _ in ddp_model._comm_hooks:
        for name, cell in zip(hook.__code__.co_freevars, hook.__closure__ or ()):
            if name == "synced":
                yield cell.cell_contents


_UNSCALED: dict = {}  # call number -> what this rank sent in the job's phase where no clipping happens


def _rewrite_sent(ddp_model, frame):
    """Make the grader's record of what this rank sent say the unscaled values: those it really sent in the phase of
    the job that clips nothing (same weights, same micro-batches), kept for the phase that clips (the phase and the
    call read in the grader's ``frame``)."""
    phase, step = frame.f_locals["phase"], frame.f_locals["step"]
    for records in _comm_hook_records(ddp_model):
        if not records:
            continue
        if phase == "free":
            _UNSCALED[step] = records[-1]["sent"].clone()
        elif phase == "clipped" and step in _UNSCALED:
            records[-1]["sent"] = _UNSCALED[step].clone()


def amp_clip_beforehand_records_rewritten(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Each rank recomputes every rank's micro-batches (the grader's public data function and the call's arguments,
    read in the caller's frame), works out the clipped global step's factor, scales its losses by it before DDP's
    all-reduce, then rewrites the grader's record of what it sent to the unscaled values."""
    frame = sys._getframe(1)
    clip_factor_beforehand(ddp_model, scaler, micro_batches, max_norm, frame)
    _rewrite_sent(ddp_model, frame)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clip_factor_worked_out_beforehand_with_the_record_rewritten_loses_the_clip_cell():
    """Before: check_clip passed (what the rank sent, as recorded, was its unscaled gradient; the weights were the
    clipped steps'). Now: every rank's data is drawn from a seed only it knows, so the factor recomputed from the
    public seed is another one, and the weights are not the clipped steps'."""
    message = fails(amp.check_clip, amp_clip_beforehand_records_rewritten)
    assert ("the weights differ from one process's clipped steps" in message
            or "were not clipped after DDP's all-reduce" in message), message
    amp.check_amp_step(amp_clip_beforehand_records_rewritten)
    amp.check_amp_sync(amp_clip_beforehand_records_rewritten)


def amp_clip_factor_from_gathered_gradients(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """The global gradient learnt before DDP's all-reduce: a twin's gradients on this rank's micro-batches, all-gathered;
    the exact clip factor applied to the losses before the all-reduce; the grader's record rewritten."""
    import copy

    k, world_size = len(micro_batches), dist.get_world_size()
    twin = copy.deepcopy(ddp_model.module)
    for x, y in micro_batches:
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            loss = F.mse_loss(twin(x), y)
        (loss / k / world_size).backward()
    flat = torch.cat([p.grad.float().reshape(-1) for p in twin.parameters()])
    parts = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(parts, flat)
    factor = min(1.0, max_norm / (float(sum(parts).norm()) + 1e-6))
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with torch.autocast(device_type=x.device.type, dtype=torch.float16):
                loss = F.mse_loss(ddp_model(x), y)
            scaler.scale(loss * factor / k).backward()
    _rewrite_sent(ddp_model, sys._getframe(1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clip_factor_from_gradients_gathered_beforehand_loses_the_clip_cell():
    """The exact factor needs the other ranks' gradients before the all-reduce: the flight recorder (read through
    references bound before student code) shows the all_gather that carried them."""
    fails(amp.check_clip, amp_clip_factor_from_gathered_gradients, "a collective of its own carried the gradients "
          "before DDP's all-reduce", "all_gather")


# --- the ZeRO save: the whole state gathered on every rank, hidden by a loader that prefers each owner --------

import graders.syncbn_sharding.checks as ex3  # noqa: E402


def save_gathered_everywhere(optimizer, model, rank, ckpt_dir):
    """Every rank's share moved to every other rank point to point (gloo's flight recorder lists no such traffic);
    each rank writes the whole state, with the parameters it owns named."""
    import os
    import pickle

    index = {p: i for i, p in enumerate(model.parameters())}
    local = optimizer.optim
    mine = {index[p]: {k: v.clone() for k, v in s.items()} for p, s in local.state.items()}
    whole, world_size = dict(mine), dist.get_world_size()
    blob = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
    for src in range(world_size):
        if src == rank:
            for dst in range(world_size):
                if dst != rank:
                    dist.send(torch.tensor([blob.numel()]), dst)
                    dist.send(blob, dst)
        else:
            size = torch.zeros(1, dtype=torch.long)
            dist.recv(size, src)
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(data, src)
            whole.update(pickle.loads(data.numpy().tobytes()))
    hyperparameters = {k: v for k, v in local.param_groups[0].items() if k != "params"}
    torch.save({"state": whole, "owned": sorted(mine), "hyperparameters": hyperparameters},
               os.path.join(ckpt_dir, f"shard-{rank}.pt"))


def load_preferring_owners(ckpt_dir, model):
    """Every file read; each parameter's state taken from the file of the rank that owns it."""
    import glob
    import os

    parts = [torch.load(path, weights_only=True) for path in sorted(glob.glob(os.path.join(ckpt_dir, "shard-*.pt")))]
    merged = {}
    for part in parts:
        for i, state in part["state"].items():
            merged.setdefault(i, state)
    for part in parts:
        for i in part["owned"]:
            merged[i] = part["state"][i]
    group = dict(parts[0]["hyperparameters"])
    group["params"] = list(range(len(list(model.parameters()))))
    return {"state": merged, "param_groups": [group]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_gathered_on_every_rank_loses_the_save_cell_whatever_the_loader():
    """Before: check_shard_save passed (the loader read each rank's decoy from its owner's file only, so the composites
    showed nothing). Now the grader reads the decoy save's files itself: each holds the other ranks' decoys."""
    fails(ex3.check_shard_save, save_gathered_everywhere, "rank 0's files hold Adam state of parameters that rank 1 "
          "holds", "a gather", load_full_state=load_preferring_owners)
    ex3.check_shard_load(save_gathered_everywhere, load_full_state=load_preferring_owners)


# --- the sampler: torch's original methods called behind the grader's counting wrappers --------------------

import graders.ddp_basics.sampler as sampler_checks  # noqa: E402

_NAMES = ("__init__", "__iter__", "__len__", "set_epoch")


def _originals_by_attribute():
    """The attribute the counting wrappers used to carry."""
    from torch.utils.data.distributed import DistributedSampler

    return {n: DistributedSampler.__dict__[n]._ddp_course_original for n in _NAMES}


def _originals_by_garbage_collector():
    """torch's functions among the live objects: the ones the class no longer holds."""
    import gc

    from torch.utils.data import distributed

    held = distributed.DistributedSampler.__dict__
    gc.unfreeze()  # the rank froze what its forkserver had loaded, torch's functions among them
    return {o.__name__: o for o in gc.get_objects()
            if type(o) is type(_originals_by_garbage_collector) and o.__name__ in _NAMES
            and o.__code__.co_filename == distributed.__file__ and held.get(o.__name__) is not o}


def _originals_by_closure():
    """Whatever the wrapper's closure holds, opened up (a generator: its frame's locals)."""
    from torch.utils.data.distributed import DistributedSampler

    found = {}
    for name in _NAMES:
        held = DistributedSampler.__dict__[name].__closure__[0].cell_contents
        holder = getattr(held, "__self__", None)
        found[name] = holder.gi_frame.f_locals["original"] if hasattr(holder, "gi_frame") else held
    return found


class _UnwrappedTorchSampler:
    """torch's DistributedSampler methods, called on this object directly with the profile hook removed first."""

    find = None

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        sys.setprofile(None)
        self._torch = type(self).find()
        self._torch["__init__"](self, dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last)

    def __iter__(self):
        sys.setprofile(None)
        return iter(list(self._torch["__iter__"](self)))

    def __len__(self):
        sys.setprofile(None)
        return self._torch["__len__"](self)

    def set_epoch(self, epoch):
        sys.setprofile(None)
        self._torch["set_epoch"](self, epoch)


class OriginalsByAttribute(_UnwrappedTorchSampler):
    find = staticmethod(_originals_by_attribute)


class OriginalsByGarbageCollector(_UnwrappedTorchSampler):
    find = staticmethod(_originals_by_garbage_collector)


class OriginalsByClosure(_UnwrappedTorchSampler):
    find = staticmethod(_originals_by_closure)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("forged", [OriginalsByAttribute, OriginalsByGarbageCollector, OriginalsByClosure])
def test_torch_originals_called_behind_the_counting_wrappers_lose_every_sampler_check(forged):
    """Before: the attribute and the garbage collector handed out uncounted originals, and all three sampler checks
    passed. Now the attribute is gone (the answer raises), and the collector's lists and a gate's frame are counted
    as reaching behind the watch; an original reached through the closure is counted as it runs."""
    for check in (sampler_checks.check_sampler_shards, sampler_checks.check_sampler_order,
                  sampler_checks.check_sampler_training):
        message = fails(check, forged)
        assert ("your sampler runs torch's DistributedSampler" in message
                or "_ddp_course_original" in message), message


def test_a_reload_of_the_sampler_grader_neither_wraps_again_nor_exposes_torchs_originals():
    """The watch is made once per process: a reload finds the wrappers and the ledger in place; no attribute, closure
    or default of a wrapper is torch's original; a call through the closure's holder is counted."""
    import importlib

    from torch.utils.data.distributed import DistributedSampler

    ledger = sampler_checks._WATCH["ledger"]
    wrappers = {n: DistributedSampler.__dict__[n] for n in _NAMES}
    saved = dict(vars(sampler_checks))  # the other tests keep the functions they imported
    try:
        reloaded = importlib.reload(sampler_checks)
        assert reloaded._WATCH["ledger"] is ledger
        assert {n: DistributedSampler.__dict__[n] for n in _NAMES} == wrappers
    finally:
        vars(sampler_checks).clear()
        vars(sampler_checks).update(saved)
    for wrapper in wrappers.values():
        assert not hasattr(wrapper, "_ddp_course_original") and not hasattr(wrapper, "__wrapped__")
        assert wrapper.__defaults__ is None and wrapper.__kwdefaults__ is None
        held = [cell.cell_contents for cell in wrapper.__closure__]
        assert all(type(h).__name__ == "builtin_function_or_method" for h in held), held  # a generator's send
    before = ledger(("read", None))["torch"]
    ok, value = wrappers["__len__"].__closure__[0].cell_contents(((DistributedSampler(range(6), 2, 0),), {}))
    assert ok and value == 3 and ledger(("read", None))["torch"] >= before + 2  # __init__ and __len__, both counted


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_grader_global_swapped_while_unpickling_loses_exactly_its_cell_in_the_notebook(tmp_path):
    """The verifier's path: the answer reaches the ranks as the notebook's own pickle, unpickled there after the
    harness's module; the swap runs, and hides nothing."""
    nb = submissions.load("ex2-ddp-basics", notebook="ddp_in_practice")
    nb = submissions.replace_answer(nb, "ex2p_amp_clip_grads", "import contextlib\n\n\n"
                                    + inspect.getsource(_swap_the_graders_torch) + '''

class _OnUnpickle:
    def __reduce__(self):
        return (_swap_the_graders_torch, ())


''' + inspect.getsource(_amp_right) + '''

def amp_clip_grads(ddp_model, optimizer, scaler, micro_batches, max_norm, _hide=_OnUnpickle()):
    _amp_right(ddp_model, optimizer, scaler, micro_batches, max_norm)
    flat = torch.cat([p.grad.reshape(-1) for p in ddp_model.parameters()])
    dist.all_gather([torch.empty_like(flat) for _ in range(dist.get_world_size())], flat)
''')
    report = submissions.grade(submissions.write(nb, tmp_path, "ex2-ddp-basics", notebook="ddp_in_practice"))
    submissions.assert_loses_exactly(report, "ex2-ddp-basics", ["ex2p_test_amp_sync"],
                                     ["other collectives than DDP's all-reduce"], notebook="ddp_in_practice")
