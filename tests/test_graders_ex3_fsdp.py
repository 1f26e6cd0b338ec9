"""Exercise 3's second notebook (fsdp_checkpoint): each check catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with right and wrong functions directly: the reference, right answers in other
styles (the FSDP2 tutorial's ``full_tensor`` export, the DCP tutorial's ``Stateful`` app state, plain
``model.state_dict()`` with DCP), realistic mistakes (each with the message that names it) and forgeries that
reassign torch attributes. Wrong submissions are the source notebook with one answer edited, graded in this
process; each must lose exactly the intended test cell's points.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graders.fsdp_checkpoint.checks as fsdp
import graders.fsdp_checkpoint.harness as fsdp_model

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

A = "ex3-syncbn-sharding"
NB = "fsdp_checkpoint"

fails = submissions.fails


# --- what the checks rely on --------------------------------------------------------------------------


def test_the_training_data_tells_the_mistakes_apart():
    """Not training at all ends far from the right weights, and so does weight decay on every parameter or on none
    (the visible and the hidden decay)."""
    for spec, ws, steps, wd in (((8, 3, 0), 2, 3, 0.1), ((8, 3, 1), 3, 4, 0.03), ((10, 3, 1), 3, 3, 0.1)):
        right = fsdp_model._training_reference(spec, ws, steps, wd)
        untrained = {n: p.detach() for n, p in fsdp_model.make_net(spec).named_parameters()}
        assert fsdp_model._max_diff(right, untrained) > 100 * fsdp.ATOL
        no_decay = fsdp_model._training_reference(spec, ws, steps, 0.0)
        assert fsdp_model._max_diff(right, no_decay) > 10 * fsdp.ATOL


def test_a_gloo_job_hides_the_gpus(monkeypatch):
    """fully_shard's default mesh is the accelerator's whenever one is visible: a gloo job must not see it."""
    monkeypatch.setattr(fsdp.checks, "resolve_backend", lambda name, world_size: "gloo")  # what _job_env asks
    assert fsdp._job_env(2, fsdp.FR_ENV) == {**fsdp.FR_ENV, "CUDA_VISIBLE_DEVICES": ""}
    monkeypatch.setattr(fsdp.checks, "resolve_backend", lambda name, world_size: "nccl")
    assert fsdp._job_env(2) == {}


# --- part 1: shard_model ---------------------------------------------------------------------------


def shard_model(model):
    blocks = list(model.blocks)
    for i in range(0, len(blocks), 2):
        fully_shard(blocks[i:i + 2])  # two consecutive blocks: one all-gather
    fully_shard(model)
    return model


def shard_with_a_mesh(model):
    """Right, another style: an explicit 1-D mesh, the pairs zipped, nothing returned (fully_shard works in place)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = list(model.blocks)
    for pair in zip(blocks[::2], blocks[1::2]):
        fully_shard(list(pair), mesh=mesh, reshard_after_forward=True)
    if len(blocks) % 2:
        fully_shard(blocks[-1], mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_keep_unsharded(model):
    """Right, another style: the units keep their gathered weights from forward to backward (ZeRO-2 like)."""
    for i in range(0, len(model.blocks), 2):
        fully_shard([model.blocks[j] for j in range(i, min(i + 2, len(model.blocks)))], reshard_after_forward=False)
    fully_shard(model)
    return model


def shard_lone_first(model):
    """Right, another grouping with as few all-gathers: an odd depth's lone block first, then pairs."""
    blocks = list(model.blocks)
    start = len(blocks) % 2
    if start:
        fully_shard(blocks[0])
    for i in range(start, len(blocks), 2):
        fully_shard(blocks[i:i + 2])
    return fully_shard(model)


def shard_per_block(model):
    """Lesson 3's choice: every block its own unit (one all-gather per block)."""
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def shard_triples(model):
    """Over the budget: three blocks per unit."""
    blocks = list(model.blocks)
    for i in range(0, len(blocks), 3):
        fully_shard(blocks[i:i + 3])
    fully_shard(model)
    return model


def shard_root_only(model):
    fully_shard(model)
    return model


def shard_blocks_only(model):
    blocks = list(model.blocks)
    for i in range(0, len(blocks), 2):
        fully_shard(blocks[i:i + 2])
    return model


def shard_nothing(model):
    return model


def shard_root_first(model):
    fully_shard(model)
    blocks = list(model.blocks)
    for i in range(0, len(blocks), 2):
        fully_shard(blocks[i:i + 2])
    return model


def shard_every_linear(model):
    """Lesson 3's demo applied blindly: every Linear a unit, the blocks themselves not."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module)
    fully_shard(model)
    return model


def shard_forged(model):
    """A forgery: make plain parameters look like DTensors and fake the flight recorder's record."""
    import pickle

    import torch.distributed.tensor as dt

    dt.DTensor = torch.nn.Parameter
    torch.distributed.tensor.DTensor = torch.nn.Parameter
    torch._C._distributed_c10d._dump_fr_trace = lambda: pickle.dumps({"entries": []})
    return model


def shard_stub(model):
    """As nbgrader releases it."""
    # YOUR CODE HERE
    raise NotImplementedError()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_shard():
    fsdp.check_shard(shard_model)
    fsdp.check_shard(shard_model, world_size=3, width=10, depth=4, seed=1)
    fsdp.check_shard(shard_with_a_mesh)
    fsdp.check_shard(shard_with_a_mesh, world_size=3, depth=4)
    fsdp.check_shard(shard_lone_first, world_size=3)
    fsdp.check_shard(shard_keep_unsharded)
    fails(fsdp.check_shard, shard_per_block, "ran 3 all-gathers for the 3 blocks where 2 fit the memory budget",
          "[37, 140, 140, 140]", "lesson 3's choice", "fully_shard accepts a list")
    fails(fsdp.check_shard, shard_triples, "more than 2 blocks' parameters whole at once", "420 > 280", depth=4)
    fails(fsdp.check_shard, shard_root_only, "the whole model is ONE FSDP unit", "ONE all-gather of 457 values",
          "over the memory budget")
    fails(fsdp.check_shard, shard_root_only, "ONE FSDP unit", world_size=3, depth=4)
    fails(fsdp.check_shard, shard_blocks_only, "the root's own parameters are not sharded", "embed.weight",
          "fully_shard(model) too")
    fails(fsdp.check_shard, shard_nothing, "nothing is sharded", "[ranks 0, 1]")
    fails(fsdp.check_shard, shard_root_first, "the blocks' units FIRST")
    fails(fsdp.check_shard, shard_every_linear, "model.blocks[0] is not in a unit of whole blocks")
    fails(fsdp.check_shard, shard_forged, "nothing is sharded")
    fails(fsdp.check_shard, shard_stub, "not written yet")


# --- part 2: training ------------------------------------------------------------------------------


def make_optimizer(model, lr, weight_decay, shard):
    shard(model)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    biases = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.SGD([{"params": matrices, "weight_decay": weight_decay}, {"params": biases, "weight_decay": 0.0}],
                           lr=lr, momentum=0.9)


def make_optimizer_from_the_result(model, lr, weight_decay, shard):
    """Right, another style: the parameters taken from what shard returns, the decay set for the whole optimizer
    and undone in the biases' group."""
    sharded = shard(model)
    decay = [p for p in sharded.parameters() if len(p.shape) > 1]
    rest = [p for p in sharded.parameters() if len(p.shape) == 1]
    return torch.optim.SGD([{"params": decay}, {"params": rest, "weight_decay": 0}], lr=lr, momentum=0.9,
                           weight_decay=weight_decay)


def make_optimizer_groups_for_loop(model, lr, weight_decay, shard):
    """Right, another style (the nanoGPT/minGPT habit): weights and biases told apart by name after sharding, SGD's
    for-loop implementation (foreach=False) over the DTensors."""
    shard(model)
    named = list(model.named_parameters())
    weights = [p for name, p in named if name.endswith("weight")]
    others = [p for name, p in named if not name.endswith("weight")]
    return torch.optim.SGD([{"params": weights, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}],
                           lr=lr, momentum=0.9, foreach=False)


def make_optimizer_per_parameter(model, lr, weight_decay, shard):
    """Right, another style: one param group per parameter, in a generator."""
    shard(model)
    return torch.optim.SGD(({"params": [p], "weight_decay": weight_decay if p.dim() >= 2 else 0.0}
                            for p in model.parameters()), lr=lr, momentum=0.9)


def make_optimizer_first(model, lr, weight_decay, shard):
    optimizer = make_optimizer(model, lr, weight_decay, lambda m: m)  # the groups, before sharding
    shard(model)
    return optimizer


def make_optimizer_unsharded(model, lr, weight_decay, shard):
    return make_optimizer(model, lr, weight_decay, lambda m: m)


def make_adam(model, lr, weight_decay, shard):
    shard(model)
    return torch.optim.Adam(model.parameters(), lr=lr)


def make_optimizer_no_momentum(model, lr, weight_decay, shard):
    shard(model)
    return torch.optim.SGD(model.parameters(), lr=lr)


def make_optimizer_decay_everywhere(model, lr, weight_decay, shard):
    """Wrong, the common slip: weight_decay for the whole optimizer, the biases decayed too."""
    shard(model)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)


def make_optimizer_no_decay(model, lr, weight_decay, shard):
    """Wrong: the decay left out."""
    shard(model)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def make_optimizer_decay_halved(model, lr, weight_decay, shard):
    """Wrong: a decay of its own, not the one given."""
    return make_optimizer(model, lr, weight_decay / 2, shard)


def make_optimizer_local_shape(model, lr, weight_decay, shard):
    """Wrong: the decay chosen by the shape of this rank's piece (to_local()), whose rows can be none."""
    shard(model)
    params = list(model.parameters())
    return torch.optim.SGD([{"params": [p for p in params if p.to_local().numel() > 16], "weight_decay": weight_decay},
                            {"params": [p for p in params if p.to_local().numel() <= 16], "weight_decay": 0.0}],
                           lr=lr, momentum=0.9)


def make_optimizer_forged(model, lr, weight_decay, shard):
    """A forgery: an SGD whose step does nothing, and DTensor.to_local patched to hide it."""
    from torch.distributed.tensor import DTensor

    shard(model)
    optimizer = make_optimizer(model, lr, weight_decay, lambda m: m)
    optimizer.step = lambda *args, **kwargs: None
    DTensor.to_local = lambda self, **kwargs: torch.zeros(1)
    torch.nn.Module.named_parameters = lambda self, *a, **k: iter(())
    return optimizer


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_training():
    fsdp.check_training(make_optimizer)
    fsdp.check_training(make_optimizer, world_size=3, seed=1, steps=4, weight_decay=0.03)
    fsdp.check_training(make_optimizer_from_the_result)
    fsdp.check_training(make_optimizer_groups_for_loop, world_size=3, seed=2)
    fsdp.check_training(make_optimizer_per_parameter, weight_decay=0.03)
    fails(fsdp.check_training, make_optimizer_decay_everywhere, "weight decay 0.1 on", "bias", "[ranks 0, 1]")
    fails(fsdp.check_training, make_optimizer_no_decay, "no weight decay on the weight matrix", "weight_decay=0.1")
    fails(fsdp.check_training, make_optimizer_local_shape, "weight decay", "[rank")
    fails(fsdp.check_training, make_optimizer_decay_halved, "weight decay 0.05 on the weight matrix", "not the 0.1 given")
    fails(fsdp.check_training, make_optimizer_first, "built before shard(model)", "never changed", "[ranks 0, 1]")
    fails(fsdp.check_training, make_optimizer_unsharded, "parameters are not sharded", "call shard(model)")
    fails(fsdp.check_training, make_adam, "not SGD", "Adam", "[ranks 0, 1]")
    fails(fsdp.check_training, make_optimizer_no_momentum, "not SGD")
    fails(fsdp.check_training, make_optimizer_forged, "never changed")


# --- part 3: a DCP round trip ----------------------------------------------------------------------


def save_checkpoint(model, optimizer, path):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def load_checkpoint(model, optimizer, path):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class AppState(Stateful):
    """The DCP tutorial's application state: dcp.save calls state_dict(), dcp.load calls load_state_dict()."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def save_app_state(model, optimizer, path):
    dcp.state_dict_saver.save({"app": AppState(model, optimizer)}, checkpoint_id=path)


def load_app_state(model, optimizer, path):
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path)


def save_plain_model(model, optimizer, path):
    """Right, another style: the model's own state_dict (DTensors), the optimizer's through the helper."""
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def load_plain_model(model, optimizer, path):
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optim"])


def load_full_and_set(model, optimizer, path):
    """Right, another style: full (unsharded) state dicts loaded from the sharded checkpoint, then set."""
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)


def save_torch_rank0(model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def load_torch(model, optimizer, path):
    checkpoint = torch.load(path, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])


def save_dcp_rank0(model, optimizer, path):
    if dist.get_rank() == 0:
        save_checkpoint(model, optimizer, path)


def load_model_only(model, optimizer, path):
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def load_full_not_set(model, optimizer, path):
    """dcp.load into full state dicts (new tensors, not the model's), and no set_state_dict."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def save_model_only(model, optimizer, path):
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)


def save_plain(model, optimizer, path):
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)


def load_plain(model, optimizer, path):
    """A fresh optimizer's own state_dict() has no state: dcp.load has nothing of the optimizer's to fill."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def save_forged(model, optimizer, path):
    """A forgery: DCP's file names, no checkpoint in them; the load patches torch instead of loading."""
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, f"__{dist.get_rank()}_0.distcp"), "w").close()
    open(os.path.join(path, ".metadata"), "w").close()


def load_forged(model, optimizer, path):
    from torch.distributed.tensor import DTensor

    DTensor.to_local = lambda self, **kwargs: torch.zeros(1)
    torch.allclose = lambda *a, **k: True


_dcp_load = dcp.load  # bound when the notebook's first cell runs, before any check: the grader observes effects


def load_bound_early(model, optimizer, path):
    """Right, another style: DCP's load bound at module level, the model and optimizer set one by one."""
    model_sd, optim_sd = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    _dcp_load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"])


def save_torch_named_like_dcp(model, optimizer, path):
    """A forgery: DCP's file names, each rank's torch.save inside; rank 0's .metadata a torch.save too."""
    import io

    os.makedirs(path, exist_ok=True)
    rank = dist.get_rank()
    local = {k: v.to_local() for k, v in model.state_dict().items()}
    torch.save({"model": local, "optimizer": optimizer.state_dict()}, os.path.join(path, f"__{rank}_0.distcp"))
    if rank == 0:
        index = io.BytesIO()  # torch.save refuses a file name that starts with a dot
        torch.save({"world_size": dist.get_world_size()}, index)
        with open(os.path.join(path, ".metadata"), "wb") as file:
            file.write(index.getvalue())
    dist.barrier()


def load_torch_named_like_dcp(model, optimizer, path):
    """Its loader: each rank reads its own file back (at the same world size only)."""
    saved = torch.load(os.path.join(path, f"__{dist.get_rank()}_0.distcp"), weights_only=False)
    for name, p in model.named_parameters():
        p.data.to_local().copy_(saved["model"][name])
    optimizer.load_state_dict(saved["optimizer"])


def save_with_copied_metadata(model, optimizer, path):
    """A forgery: the .metadata of a real DCP checkpoint (of the untrained model) beside torch.save shards."""
    import shutil

    fresh = fsdp_model.reference_shard(fsdp_model.make_net((8, 3, 7)))
    elsewhere = f"{path}-elsewhere"
    dcp.save({"model": get_model_state_dict(fresh)}, checkpoint_id=elsewhere)
    save_torch_named_like_dcp(model, optimizer, path)
    if dist.get_rank() == 0:
        shutil.copy(os.path.join(elsewhere, ".metadata"), os.path.join(path, ".metadata"))
        shutil.rmtree(elsewhere, ignore_errors=True)
    dist.barrier()


def save_beside_a_pickle(model, optimizer, path):
    """Right save, plus each rank's own pickle in the folder, which the loader below reads instead of DCP's."""
    save_checkpoint(model, optimizer, path)
    torch.save({"model": {k: v.to_local() for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict()},
               os.path.join(path, f"rank{dist.get_rank()}.pt"))


def load_the_pickle(model, optimizer, path):
    saved = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False)
    for name, p in model.named_parameters():
        p.data.to_local().copy_(saved["model"][name])
    optimizer.load_state_dict(saved["optimizer"])


def save_stub(model, optimizer, path):
    # YOUR CODE HERE
    raise NotImplementedError()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_checkpoint_accepts_every_style():
    fsdp.check_checkpoint(save_checkpoint, load_checkpoint)
    fsdp.check_checkpoint(save_checkpoint, load_checkpoint, world_size=3, seed=1)
    fsdp.check_checkpoint(save_app_state, load_app_state)
    fsdp.check_checkpoint(save_plain_model, load_plain_model)
    fsdp.check_checkpoint(save_checkpoint, load_full_and_set)
    fsdp.check_checkpoint(save_checkpoint, load_bound_early, world_size=3)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_checkpoint_names_each_mistake():
    fails(fsdp.check_checkpoint, save_torch_rank0, "wrote ONE file", "other ranks' shards are lost", "dcp.save",
          load_checkpoint=load_torch)
    fails(fsdp.check_checkpoint, save_checkpoint, "the optimizer has no state", "[ranks 0, 1]",
          load_checkpoint=load_model_only)
    fails(fsdp.check_checkpoint, save_checkpoint, "does not hold the weights that were saved", "fresh model's weights",
          "set_state_dict", load_checkpoint=load_full_not_set)
    fails(fsdp.check_checkpoint, save_model_only, "did not save", "AND the optimizer's", load_checkpoint=load_checkpoint)
    fails(fsdp.check_checkpoint, save_plain, "the optimizer has no state", "state_dict() is empty",
          load_checkpoint=load_plain)
    fails(fsdp.check_checkpoint, save_forged, "not a checkpoint torch.distributed.checkpoint can read",
          "read with torch.distributed.checkpoint by the grader", "let DCP write the folder", load_checkpoint=load_forged)
    fails(fsdp.check_checkpoint, save_checkpoint, "does not hold the weights that were saved", load_checkpoint=load_forged)
    fails(fsdp.check_checkpoint, save_stub, "`save_checkpoint` is not written yet", load_checkpoint=load_checkpoint)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_checkpoint_reads_the_folder_with_dcp_itself():
    """A folder that only its own loader reads loses the check, whatever its file names; so does a loader that
    reads anything but DCP's files (it is given what the grader read, written again by DCP on 1 rank)."""
    fails(fsdp.check_checkpoint, save_torch_named_like_dcp, "[ranks 0, 1]",
          "not a checkpoint torch.distributed.checkpoint can read", "files ['.metadata', '__0_0.distcp', '__1_0.distcp']",
          "dcp.load said: ", "a zip archive, as torch.save writes", "let DCP write the folder",
          load_checkpoint=load_torch_named_like_dcp)
    fails(fsdp.check_checkpoint, save_with_copied_metadata, "torch.distributed.checkpoint",
          load_checkpoint=load_torch_named_like_dcp)
    fails(fsdp.check_checkpoint, save_beside_a_pickle, "looked for a file DCP does not write", "dcp.load",
          load_checkpoint=load_the_pickle)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_checkpoint_names_a_save_on_rank_0_only():
    start = time.monotonic()
    fails(fsdp.check_checkpoint, save_dcp_rank0, "[rank 0]", "waited in dcp.save", "EVERY rank",
          load_checkpoint=load_checkpoint)
    assert time.monotonic() - start < fsdp_model.PG_TIMEOUT.total_seconds() + 30


# --- part 4: export ----------------------------------------------------------------------------------


def export_weights(model, path):
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(state, path)


def export_full_tensor(model, path):
    """Right, another style: the FSDP2 tutorial's loop, DTensor.full_tensor() on every rank."""
    full = {}
    for name, tensor in model.state_dict().items():
        whole = tensor.full_tensor()
        if dist.get_rank() == 0:
            full[name] = whole.cpu()
    if dist.get_rank() == 0:
        torch.save(full, path)


def export_full_everywhere(model, path):
    """Right, another style: every rank gets the full dict (no cpu_offload); rank 0 saves it."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, path)


def export_sharded(model, path):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)


def export_local_shards(model, path):
    if dist.get_rank() == 0:
        torch.save({k: v.to_local() for k, v in model.state_dict().items()}, path)


def export_on_every_rank(model, path):
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.save(state, path)


def export_rank1_beside(model, path):
    """Rank 1 also writes, under another name in rank 0's folder: any file it writes counts."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save(state, path)
    else:
        with open(path.replace("rank1", "rank0") + ".rank1", "wb") as fh:
            torch.save(state, fh)


def export_gather_on_rank0(model, path):
    if dist.get_rank() == 0:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        torch.save(state, path)


def export_forged(model, path):
    """A forgery: torch.load and load_state_dict patched on the ranks (the check loads in its own process)."""
    torch.load = lambda *a, **k: {}
    torch.nn.Module.load_state_dict = lambda self, *a, **k: None
    if dist.get_rank() == 0:
        torch.save({}, path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_export_accepts_every_style():
    fsdp.check_export(export_weights)
    fsdp.check_export(export_weights, world_size=3, seed=1)
    fsdp.check_export(export_full_tensor)
    fsdp.check_export(export_full_everywhere, world_size=3)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_export_names_each_mistake():
    fails(fsdp.check_export, export_sharded, "DTensor shards", "[rank 0]", "full_state_dict=True")
    fails(fsdp.check_export, export_local_shards, "the tensors are shards", "size mismatch")
    fails(fsdp.check_export, export_on_every_rank, "[rank 1]", "wrote a file too", "if rank == 0:")
    fails(fsdp.check_export, export_rank1_beside, "[rank 1]", "wrote a file too", "rank0/weights.pt.rank1")
    fails(fsdp.check_export, export_forged, "do not load into a plain", "Missing key(s)")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_export_names_a_gather_on_rank_0_only():
    start = time.monotonic()
    fails(fsdp.check_export, export_gather_on_rank0, "[rank 0]", "waited in the full-state gather", "EVERY rank")
    assert time.monotonic() - start < fsdp_model.PG_TIMEOUT.total_seconds() + 30


# --- the notebook: reference, untouched copy, wrong submissions ------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    assert submissions.assert_reference_full_marks(A, NB).max_score == 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    report = submissions.assert_untouched_scores_zero(A, tmp_path, NB)  # checked: no solution, no hidden test
    assert report.max_score == 20
    assert all(t.message.startswith("FAILED check_") for t in report.tests), report.tests


WRONG = {
    # name: ((answer cell, old text, new text), ...), the test cell that must fail, words its message must contain
    "only the root sharded": (
        [("ex3f_shard_model", "    for i in range(0, len(blocks), 2):\n        fully_shard(blocks[i:i + 2])  # two "
          "consecutive blocks: one all-gather just before the first runs\n", "")],
        "ex3f_test_shard", ["the whole model is ONE FSDP unit"]),
    "every block its own unit (lesson 3's choice)": (
        [("ex3f_shard_model", "range(0, len(blocks), 2)", "range(len(blocks))"),
         ("ex3f_shard_model", "fully_shard(blocks[i:i + 2])", "fully_shard(blocks[i])")],
        "ex3f_test_shard", ["where 2 fit the memory budget", "lesson 3's choice"]),
    "the root not sharded": (
        [("ex3f_shard_model", "    fully_shard(model)  # the root unit: embed and head\n", "")],
        "ex3f_test_shard", ["the root's own parameters are not sharded", "embed.weight"]),
    "the optimizer built before sharding": (
        [("ex3f_training", "    shard(model)  # first: fully_shard replaces the parameters\n", ""),
         ("ex3f_training", "    return torch.optim.SGD(groups, lr=lr, momentum=0.9)",
          "    optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9)\n    shard(model)\n    return optimizer")],
        "ex3f_test_training", ["built before shard(model)", "never changed"]),
    "SGD without momentum": (
        [("ex3f_training", "lr=lr, momentum=0.9)", "lr=lr)")],
        "ex3f_test_training", ["not SGD", "momentum=0)"]),
    "weight decay on every parameter": (
        [("ex3f_training", "    return torch.optim.SGD(groups, lr=lr, momentum=0.9)",
          "    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)")],
        "ex3f_test_training", ["weight decay 0.1 on", "bias"]),
    "torch.save on rank 0": (
        [("ex3f_checkpoint", "    model_sd, optim_sd = get_state_dict(model, optimizer)\n"
          "    dcp.save({\"model\": model_sd, \"optimizer\": optim_sd}, checkpoint_id=path)",
          "    if dist.get_rank() == 0:\n"
          "        torch.save({\"model\": model.state_dict(), \"optimizer\": optimizer.state_dict()}, path)")],
        "ex3f_test_checkpoint", ["wrote ONE file", "shards are lost"]),
    "only the model loaded": (
        [("ex3f_checkpoint", "    state = {\"model\": model_sd, \"optimizer\": optim_sd}\n", "    state = {\"model\": model_sd}\n"),
         ("ex3f_checkpoint", "    set_state_dict(model, optimizer, model_state_dict=state[\"model\"], "
          "optim_state_dict=state[\"optimizer\"])", "    model.load_state_dict(state[\"model\"])")],
        "ex3f_test_checkpoint", ["momentum differs from what was saved", "zeros"]),
    "a full state dict loaded, never set": (
        [("ex3f_checkpoint", "    set_state_dict(model, optimizer, model_state_dict=state[\"model\"], "
          "optim_state_dict=state[\"optimizer\"])\n", ""),
         ("ex3f_checkpoint", "    model_sd, optim_sd = get_state_dict(model, optimizer)\n    state = {",
          "    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))\n"
          "    state = {")],
        "ex3f_test_checkpoint", ["fresh model's weights", "set_state_dict"]),
    "torch.save under DCP's file names": (
        [("ex3f_checkpoint", "    model_sd, optim_sd = get_state_dict(model, optimizer)\n"
          "    dcp.save({\"model\": model_sd, \"optimizer\": optim_sd}, checkpoint_id=path)",
          "    import io, os\n    os.makedirs(path, exist_ok=True)\n"
          "    torch.save({k: v.to_local() for k, v in model.state_dict().items()}, "
          "os.path.join(path, f\"__{dist.get_rank()}_0.distcp\"))\n"
          "    if dist.get_rank() == 0:\n        index = io.BytesIO()\n"
          "        torch.save({\"world_size\": dist.get_world_size()}, index)\n"
          "        open(os.path.join(path, \".metadata\"), \"wb\").write(index.getvalue())\n"
          "    dist.barrier()")],
        "ex3f_test_checkpoint", ["not a checkpoint torch.distributed.checkpoint can read", "zip archive"]),
    "model.state_dict() exported": (
        [("ex3f_export_weights", "    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
          "cpu_offload=True))\n", "    full = model.state_dict()\n")],
        "ex3f_test_export", ["DTensor shards"]),
    "exported on every rank": (
        [("ex3f_export_weights", "    if dist.get_rank() == 0:\n        torch.save(full, path)",
          "    torch.save(full, path)")],
        "ex3f_test_export", ["wrote a file too"]),
}


#: name: ([(answer cell, old, new)], failing test cells, words)
MISTAKES = {name: (edits, [failing], words) for name, (edits, failing, words) in WRONG.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    """The mistakes of a group (:func:`submissions.pack`: other answer cells, other test cells) in one submission."""
    submissions.grade_packed(A, tmp_path, MISTAKES, group, notebook=NB)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_gather_on_rank_0_only_is_graded_within_the_timeout(tmp_path):
    """get_model_state_dict inside `if rank == 0:` hangs rank 0: the export test loses, naming the gather."""
    nb = submissions.patch_answer(submissions.load(A, NB), "ex3f_export_weights",
                                  "    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
                                  "cpu_offload=True))\n    if dist.get_rank() == 0:\n",
                                  "    if dist.get_rank() == 0:\n        full = get_model_state_dict(model, "
                                  "options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n")
    start = time.monotonic()
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    seconds = time.monotonic() - start
    assert submissions.scores(report) == submissions.losing(A, "ex3f_test_export", notebook=NB)
    message = submissions.messages(report)["ex3f_test_export"]
    assert "[rank 0]" in message and "waited in the full-state gather" in message, message
    assert seconds < 2 * (fsdp_model.PG_TIMEOUT.total_seconds() + 30), f"grading took {seconds:.0f} s"


def test_the_metadata_reader_takes_enum_members_pickled_by_getattr_and_nothing_else_so(tmp_path):
    """Python 3.11.2 (Debian 12, the grader image) pickles an enum member as getattr(EnumClass, name): DCP's own
    .metadata then holds builtins.getattr, which the reader must accept for DCP's enums only."""
    import enum
    import io
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from graders.fsdp_checkpoint.dcp import _MetadataUnpickler

    class ByGetattr(pickle.Pickler):
        def reducer_override(self, obj):
            return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(3, 4), "lr": 0.1}, checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # what this Python wrote; then the same, written as Python 3.11.2 writes it
    buffer = io.BytesIO()
    ByGetattr(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)
    assert b"getattr" in buffer.getvalue()
    buffer.seek(0)
    assert sorted(_MetadataUnpickler(buffer).load().state_dict_metadata) == ["lr", "w"]

    class Sneaky:
        def __reduce__(self):
            return (getattr, (torch.Size, "count"))  # a class the reader builds, but not one of DCP's enums

    buffer = io.BytesIO()
    pickle.dump(Sneaky(), buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        _MetadataUnpickler(buffer).load()


# --- issue 37: forgeries of a student who read graders/ (each scored full marks on check_checkpoint before) -----


def save_full_state(model, optimizer, path):
    """A forgery: the full state gathered on every rank (full_state_dict=True), then a DCP save of it: DCP's own
    files, read back right, but nothing was saved where it lives."""
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def _replayed(steps_after: int):
    """The weights and momenta of single-process SGD after the check's training, replayed from the grader's public
    data with the spec read in the calling harness's frame."""
    import inspect

    import torch.nn.functional as F

    frame = inspect.currentframe().f_back.f_back
    spec, steps = frame.f_locals["spec"], frame.f_locals["steps"]
    model = fsdp_model.make_net(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=fsdp_model.LR, momentum=fsdp_model.MOMENTUM)
    out = []
    for step in range(steps + steps_after):
        x, y = fsdp_model._global_batch(dist.get_world_size(), step, spec[2])
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= steps - 1:
            out.append(({n: p.detach().clone() for n, p in model.named_parameters()},
                        {n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}))
    return out


def load_replayed(model, optimizer, path):
    """A forgery: the checkpoint is never read; the training is replayed and its result put in the model."""
    from torch.distributed.tensor import distribute_tensor

    (weights, momenta), = _replayed(0)
    rank, ws = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(fsdp_model._shard_of(weights[name], ws, rank))
            optimizer.state[p]["momentum_buffer"] = distribute_tensor(momenta[name], p.device_mesh, p.placements)


def _load_with_forged_observations(rebind):
    def load(model, optimizer, path):
        """A forgery: nothing loaded into the weights; DTensor.to_local patched to answer the replayed values (after
        loading, then after one more step), and the grader's module made to take the patch (``rebind``)."""
        import sys as _sys

        from torch.distributed.tensor import DTensor, distribute_tensor

        (weights, momenta), (after, _) = _replayed(1)
        rank, ws = dist.get_rank(), dist.get_world_size()
        names = {id(p): n for n, p in model.named_parameters()}
        seen: dict[int, int] = {}
        real = DTensor.to_local

        def to_local(self, *args, **kwargs):
            name = names.get(id(self))
            if name is None:
                return real(self, *args, **kwargs)
            seen[id(self)] = seen.get(id(self), 0) + 1
            values = weights if seen[id(self)] == 1 else after
            return fsdp_model._shard_of(values[name], ws, rank).clone()

        for name, p in model.named_parameters():
            optimizer.state[p]["momentum_buffer"] = distribute_tensor(momenta[name], p.device_mesh, p.placements)
        DTensor.to_local = to_local
        rebind(_sys.modules["graders.fsdp_checkpoint.harness"])
    return load


def _reload(module):
    import importlib

    importlib.reload(module)


def _exec_source(module):
    with open(module.__file__) as fh:
        exec(compile(fh.read(), module.__file__, "exec"), module.__dict__)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint_judges_where_the_state_came_from():
    """A full state gathered before DCP's save (one piece per tensor in .metadata); a load that replays the training
    (the copy it is given holds other values); a load that patches torch and reloads (or re-executes) the grader's
    module so that its observations report replayed values (the harness observes with references bound before)."""
    fails(fsdp.check_checkpoint, save_full_state, "whole, in one piece", "gathered before the save", "[rank 0]",
          load_checkpoint=load_checkpoint)
    fails(fsdp.check_checkpoint, save_checkpoint, "does not hold the weights that were saved", "replayed",
          load_checkpoint=load_replayed)
    for rebind in (_reload, _exec_source):
        fails(fsdp.check_checkpoint, save_checkpoint, "does not hold the weights that were saved",
              "fresh model's weights", load_checkpoint=_load_with_forged_observations(rebind))


REPLAYED_LOAD = '''    import inspect

    import torch.nn.functional as F
    from torch.distributed.tensor import distribute_tensor

    from graders.fsdp_checkpoint.harness import LR, MOMENTUM, _global_batch, _shard_of, make_net

    caller = inspect.currentframe().f_back.f_locals  # the grader's harness: its spec and step count
    spec, steps = caller["spec"], caller["steps"]
    replay = make_net(spec)
    sgd = torch.optim.SGD(replay.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = _global_batch(dist.get_world_size(), step, spec[2])
        loss = F.mse_loss(replay(x), y)
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), replay.parameters()):
            p.to_local().copy_(_shard_of(q.detach(), dist.get_world_size(), dist.get_rank()))
            optimizer.state[p]["momentum_buffer"] = distribute_tensor(sgd.state[q]["momentum_buffer"], p.device_mesh,
                                                                      p.placements)
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replayed_load_loses_exactly_the_checkpoint_cell(tmp_path):
    """load_checkpoint that never reads the checkpoint but replays the training: the checkpoint cell, and only it."""
    nb = submissions.load(A, NB)
    text = submissions.answer(nb, "ex3f_checkpoint")
    start = text.index("    model_sd, optim_sd = get_state_dict(model, optimizer)\n    state = {")
    end = text.index("    ### END SOLUTION", start)
    nb = submissions.replace_answer(nb, "ex3f_checkpoint", text[:start] + REPLAYED_LOAD + text[end:])
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    submissions.assert_loses_exactly(report, A, ["ex3f_test_checkpoint"], ["replayed"], notebook=NB)
