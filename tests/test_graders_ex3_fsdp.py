"""Exercise 3's second notebook (fsdp_checkpoint): each check catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with right and wrong functions directly: the reference, right answers in other
styles (the DCP tutorial's ``Stateful`` app state, plain ``model.state_dict()`` with DCP, a load in place, a partial
load planner), realistic mistakes (each with the message that names it) and forgeries that reassign torch attributes
or replay the training. Part 4 (check_export_parts) has its own file, test_graders_ex3_fsdp_export.py. Wrong
submissions are the source notebook with one answer edited, graded in this process; each must lose exactly the
intended test cell's points."""

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
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graders.fsdp_checkpoint.checkpoint as ckpt
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


# --- part 3: one sharded checkpoint, two uses ------------------------------------------------------


def save_checkpoint(model, optimizer, path):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def load_for_finetune(model, path):
    body = {name: t for name, t in get_model_state_dict(model).items() if not name.startswith("head.")}
    dcp.load({"model": body}, checkpoint_id=path)
    set_model_state_dict(model, body, options=StateDictOptions(strict=False))


def load_in_place(model, path):
    """Right, another style: the model's own state_dict() without the head; FSDP2's DTensors are filled in place."""
    dcp.load({"model": {k: v for k, v in model.state_dict().items() if not k.startswith("head")}}, checkpoint_id=path)


def load_partial_planner(model, path):
    """Right, another style: a DefaultLoadPlanner that allows a partial load, the model set with load_state_dict."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = {k: v for k, v in model.state_dict().items() if "head" not in k.split(".")}
    dcp.load({"model": state}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    model.load_state_dict(state, strict=False)


def load_full_filtered(model, path):
    """Right, another style: full (unsharded) tensors loaded from the sharded checkpoint, then set."""
    options = StateDictOptions(full_state_dict=True, strict=False)
    state = {k: v for k, v in get_model_state_dict(model, options=options).items() if not k.startswith("head.")}
    dcp.load({"model": state}, checkpoint_id=path)
    set_model_state_dict(model, state, options=options)


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


class FinetuneState(Stateful):
    """Its counterpart for a new task: the model's state without the head, set without strictness."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {"model": {k: v for k, v in get_model_state_dict(self.model).items() if not k.startswith("head.")}}

    def load_state_dict(self, state_dict):
        set_model_state_dict(self.model, state_dict["model"], options=StateDictOptions(strict=False))


def save_then_rename(model, optimizer, path):
    """Right, another style: the checkpoint written whole to a temporary folder, then moved into place by rank 0 (a
    reader never meets a half-written one)."""
    import os

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{path}.tmp")
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(f"{path}.tmp", path)
    dist.barrier()


def save_with_an_average(model, optimizer, path):
    """Right, another style: a copy of the weights (an average a run keeps beside them: here equal to them) saved
    first, then the model and the optimizer; the load reads "model"."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    average = {k: v.detach().clone() for k, v in model_sd.items()}
    dcp.save({"average": average, "model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def save_resolved(model, optimizer, path):
    """Right, another style: the folder's real path (pathlib's resolve), which differs from `path` where the
    temporary folder lies behind a symbolic link (macOS's /var -> /private/var)."""
    import pathlib

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=pathlib.Path(path).resolve())


def save_app_state(model, optimizer, path):
    dcp.state_dict_saver.save({"app": AppState(model, optimizer)}, checkpoint_id=path)


def load_app_state(model, path):
    dcp.load({"app": FinetuneState(model)}, checkpoint_id=path)


def save_plain(model, optimizer, path):
    """Right, another style: the model's own state_dict (DTensors) and the optimizer's plain one (its momentum keyed
    by integer ids)."""
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)


_dcp_load = dcp.load  # bound when the notebook's first cell runs, before any check: the grader observes effects


def load_bound_early(model, path):
    """Right, another style: DCP's load bound at module level, the blocks and embed named one by one."""
    state = {k: v for k, v in get_model_state_dict(model).items() if k.startswith(("blocks.", "embed."))}
    _dcp_load({"model": state}, checkpoint_id=path)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def load_head_too(model, path):
    state = get_model_state_dict(model)
    dcp.load({"model": state}, checkpoint_id=path)
    set_model_state_dict(model, state)


def load_everything_partial_planner(model, path):
    """allow_partial_load lets keys the checkpoint lacks pass; it does not skip the head, whose shape differs."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    dcp.load({"model": model.state_dict()}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))


def load_strict(model, path):
    state = {k: v for k, v in get_model_state_dict(model).items() if not k.startswith("head.")}
    dcp.load({"model": state}, checkpoint_id=path)
    set_model_state_dict(model, state)


def load_full_not_set(model, path):
    """dcp.load into full state dicts (new tensors, not the model's), and no set: nothing reaches the model."""
    options = StateDictOptions(full_state_dict=True)
    state = {k: v for k, v in get_model_state_dict(model, options=options).items() if not k.startswith("head.")}
    dcp.load({"model": state}, checkpoint_id=path)


def load_blocks_only(model, path):
    state = {k: v for k, v in get_model_state_dict(model).items() if k.startswith("blocks.")}
    dcp.load({"model": state}, checkpoint_id=path)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def load_with_a_fresh_optimizer(model, path):
    """The resume habit: the optimizer's state too, into a fresh optimizer of the new model."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = {k: v for k, v in model_sd.items() if not k.startswith("head.")}
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def load_with_no_optimizer(model, path):
    model_sd, optim_sd = get_state_dict(model, None)
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def load_torch(model, path):
    checkpoint = torch.load(os.path.join(path, "model.pt"), weights_only=False)
    model.load_state_dict(checkpoint["model"], strict=False)


def load_then_reset_head(model, path):
    load_for_finetune(model, path)
    model.head.reset_parameters()  # the new head "freshly initialised" again: other values than it was built with


def save_torch_rank0(model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def save_dcp_rank0(model, optimizer, path):
    if dist.get_rank() == 0:
        save_checkpoint(model, optimizer, path)


def save_model_only(model, optimizer, path):
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)


def save_forged(model, optimizer, path):
    """A forgery: DCP's file names, no checkpoint in them; the load patches torch instead of loading."""
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, f"__{dist.get_rank()}_0.distcp"), "w").close()
    open(os.path.join(path, ".metadata"), "w").close()


def load_forged(model, path):
    from torch.distributed.tensor import DTensor

    DTensor.to_local = lambda self, **kwargs: torch.zeros(1)
    torch.allclose = lambda *a, **k: True


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


def load_torch_named_like_dcp(model, path):
    """Its loader: each rank reads its own file back (at the same world size only)."""
    saved = torch.load(os.path.join(path, f"__{dist.get_rank()}_0.distcp"), weights_only=False)
    for name, p in model.named_parameters():
        if not name.startswith("head."):
            p.data.to_local().copy_(saved["model"][name])


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
    torch.save({"model": {k: v.to_local() for k, v in model.state_dict().items()}},
               os.path.join(path, f"rank{dist.get_rank()}.pt"))


def load_the_pickle(model, path):
    saved = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False)
    for name, p in model.named_parameters():
        if not name.startswith("head."):
            p.data.to_local().copy_(saved["model"][name])


def save_stub(model, optimizer, path):
    # YOUR CODE HERE
    raise NotImplementedError()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_checkpoint_accepts_every_style():
    ckpt.check_checkpoint(save_checkpoint, load_for_finetune)
    ckpt.check_checkpoint(save_checkpoint, load_for_finetune, world_size=3, width=10, seed=1, load_world_size=2)
    ckpt.check_checkpoint(save_checkpoint, load_in_place, world_size=2, load_world_size=3)
    ckpt.check_checkpoint(save_checkpoint, load_partial_planner)
    ckpt.check_checkpoint(save_checkpoint, load_full_filtered, world_size=3)
    ckpt.check_checkpoint(save_app_state, load_app_state)
    ckpt.check_checkpoint(save_plain, load_bound_early)
    ckpt.check_checkpoint(save_then_rename, load_for_finetune)
    ckpt.check_checkpoint(save_with_an_average, load_for_finetune, world_size=3, load_world_size=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_temporary_folder_behind_a_symbolic_link_is_the_same_folder(linked_tempdir):
    """Where the temporary folder is reached through a link (macOS), a save to the real path is the checkpoint's."""
    ckpt.check_checkpoint(save_resolved, load_for_finetune)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_checkpoint_names_each_mistake_of_the_finetune_load():
    fails(ckpt.check_checkpoint, save_checkpoint, "[ranks 0, 1]", "loaded the saved head too", "belongs to the new task",
          "(3 instead of 2)", "for model.head.weight", "leave the head's keys", load_for_finetune=load_head_too)
    fails(ckpt.check_checkpoint, save_checkpoint, "loaded the saved head too", "for model.head.weight",
          load_for_finetune=load_everything_partial_planner)
    fails(ckpt.check_checkpoint, save_checkpoint, "set the loaded state strictly", "Missing key(s)", "head.weight",
          load_for_finetune=load_strict)
    fails(ckpt.check_checkpoint, save_checkpoint, "holds none of the checkpoint's weights", "initial weights in all 14",
          load_for_finetune=load_full_not_set)
    fails(ckpt.check_checkpoint, save_checkpoint, "loaded only some of the saved parameters", "2 of 14",
          "embed.weight, embed.bias", load_for_finetune=load_blocks_only)
    fails(ckpt.check_checkpoint, save_checkpoint, "the saved optimizer's state", "no optimizer to resume",
          "optimizer.state.head.weight.momentum_buffer", load_for_finetune=load_with_a_fresh_optimizer)
    fails(ckpt.check_checkpoint, save_checkpoint, "reached for an optimizer", "it is given none",
          load_for_finetune=load_with_no_optimizer)
    fails(ckpt.check_checkpoint, save_checkpoint, "looked for a file DCP does not write", "dcp.load",
          load_for_finetune=load_torch)
    fails(ckpt.check_checkpoint, save_checkpoint, "the head is not as the new model was built", "head.weight",
          load_for_finetune=load_then_reset_head)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_checkpoint_names_each_mistake_of_the_save():
    fails(ckpt.check_checkpoint, save_torch_rank0, "wrote ONE file", "[ranks 0, 1]", "every rank writes its own shard",
          "dcp.save",
          load_for_finetune=load_torch)
    fails(ckpt.check_checkpoint, save_model_only, "did not save", "AND the optimizer's",
          load_for_finetune=load_for_finetune)
    fails(ckpt.check_checkpoint, save_forged, "not a checkpoint torch.distributed.checkpoint can read",
          "read with torch.distributed.checkpoint by the grader", "let DCP write the folder",
          load_for_finetune=load_forged)
    fails(ckpt.check_checkpoint, save_checkpoint, "holds none of the checkpoint's weights", load_for_finetune=load_forged)
    fails(ckpt.check_checkpoint, save_stub, "`save_checkpoint` is not written yet", load_for_finetune=load_for_finetune)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_checkpoint_reads_the_folder_with_dcp_itself():
    """A folder that only its own loader reads loses the check, whatever its file names; so does a loader that
    reads anything but DCP's files (it is given what the grader read, written again by DCP on 1 rank)."""
    fails(ckpt.check_checkpoint, save_torch_named_like_dcp, "[ranks 0, 1]",
          "not a checkpoint torch.distributed.checkpoint can read", "files ['.metadata', '__0_0.distcp', '__1_0.distcp']",
          "dcp.load said: ", "a zip archive, as torch.save writes", "let DCP write the folder",
          load_for_finetune=load_torch_named_like_dcp)
    fails(ckpt.check_checkpoint, save_with_copied_metadata, "torch.distributed.checkpoint",
          load_for_finetune=load_torch_named_like_dcp)
    fails(ckpt.check_checkpoint, save_beside_a_pickle, "looked for a file DCP does not write", "dcp.load",
          load_for_finetune=load_the_pickle)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_checkpoint_names_a_save_on_rank_0_only():
    start = time.monotonic()
    fails(ckpt.check_checkpoint, save_dcp_rank0, "[rank 0]", "waited in dcp.save", "EVERY rank",
          load_for_finetune=load_for_finetune)
    assert time.monotonic() - start < fsdp_model.PG_TIMEOUT.total_seconds() + 30


# --- the notebook: reference, untouched copy, wrong submissions ------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    assert submissions.assert_reference_full_marks(A, NB).max_score == 25


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    report = submissions.assert_untouched_scores_zero(A, tmp_path, NB)  # checked: no solution, no hidden test
    assert report.max_score == 25
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
        "ex3f_test_checkpoint", ["wrote ONE file", "every rank writes its own shard"]),
    "the saved head loaded too": (
        [("ex3f_checkpoint", "for name, t in get_model_state_dict(model).items() if not name.startswith(\"head.\")}",
          "for name, t in get_model_state_dict(model).items()}")],
        "ex3f_test_checkpoint", ["loaded the saved head too", "for model.head.weight"]),
    "set strictly": (
        [("ex3f_checkpoint", "set_model_state_dict(model, body, options=StateDictOptions(strict=False))",
          "set_model_state_dict(model, body)")],
        "ex3f_test_checkpoint", ["set the loaded state strictly", "Missing key(s)"]),
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
        [("ex3f_export_weights", "        whole = p.full_tensor()  # a collective: every rank gathers every parameter, "
          "in one order\n", "        whole = p\n"),
         ("ex3f_export_weights", "            mine[name] = whole.detach().cpu()", "            mine[name] = whole")],
        "ex3f_test_export", ["DTensor shards"]),
    "every rank keeps everything": (
        [("ex3f_export_weights", "        if owner == rank:\n            mine[name]", "        if True:\n            mine[name]")],
        "ex3f_test_export", ["every part holds every parameter"]),
    "split by count": (
        [("ex3f_export_weights", "        owner = given.index(min(given))  # the same choice on every rank\n",
          "        owner = sorted(n for n, _ in model.named_parameters()).index(name) * world_size "
          "// len(list(model.parameters()))\n")],
        "ex3f_test_export", ["the parts are not balanced"]),
}


#: name: ([(answer cell, old, new)], failing test cells, words)
MISTAKES = {name: (edits, [failing], words) for name, (edits, failing, words) in WRONG.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    """The mistakes of a group (:func:`submissions.pack`: other answer cells, other test cells) in one submission."""
    submissions.grade_packed(A, tmp_path, MISTAKES, group, notebook=NB)


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
    """The weights of single-process SGD after the check's training (the check's default step count), replayed from
    the grader's public data with the spec read in the calling harness's frame."""
    import inspect

    import torch.nn.functional as F

    frame = inspect.currentframe().f_back.f_back
    spec, steps = frame.f_locals["spec"], frame.f_locals.get("steps", 2)
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
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def load_replayed(model, path):
    """A forgery: the checkpoint is never read; the training is replayed and its result put in the model."""
    weights, = _replayed(0)
    rank, ws = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("head."):
                p.to_local().copy_(fsdp_model._shard_of(weights[name], ws, rank))


def _load_with_forged_observations(rebind):
    def load(model, path):
        """A forgery: nothing loaded into the weights; DTensor.to_local patched to answer the replayed values, and
        the grader's module made to take the patch (``rebind``)."""
        import sys as _sys

        from torch.distributed.tensor import DTensor

        weights, = _replayed(0)
        rank, ws = dist.get_rank(), dist.get_world_size()
        names = {id(p): n for n, p in model.named_parameters() if not n.startswith("head.")}
        real = DTensor.to_local

        def to_local(self, *args, **kwargs):
            name = names.get(id(self))
            if name is None:
                return real(self, *args, **kwargs)
            return fsdp_model._shard_of(weights[name], ws, rank).clone()

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
    fails(ckpt.check_checkpoint, save_full_state, "whole, in one piece", "gathered before the save", "[rank 0]",
          load_for_finetune=load_for_finetune)
    fails(ckpt.check_checkpoint, save_checkpoint, "without the copy's changes", "replayed",
          load_for_finetune=load_replayed)
    for rebind in (_reload, _exec_source):
        fails(ckpt.check_checkpoint, save_checkpoint, "holds none of the checkpoint's weights",
              load_for_finetune=_load_with_forged_observations(rebind))


REPLAYED_LOAD = '''    import inspect

    import torch.nn.functional as F

    from graders.fsdp_checkpoint.harness import LR, MOMENTUM, _global_batch, _shard_of, make_net

    spec = inspect.currentframe().f_back.f_locals["spec"]  # the grader's harness: its spec
    replay = make_net(spec)
    sgd = torch.optim.SGD(replay.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(2):  # the check's default number of steps
        x, y = _global_batch(dist.get_world_size(), step, spec[2])
        loss = F.mse_loss(replay(x), y)
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), replay.parameters()):
            if not name.startswith("head."):
                p.to_local().copy_(_shard_of(q.detach(), dist.get_world_size(), dist.get_rank()))
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replayed_load_loses_exactly_the_checkpoint_cell(tmp_path):
    """load_for_finetune that never reads the checkpoint but replays the training: the checkpoint cell, and only it."""
    nb = submissions.load(A, NB)
    text = submissions.answer(nb, "ex3f_checkpoint")
    start = text.index("    body = {name: t for name, t in get_model_state_dict(model)")
    end = text.index("    ### END SOLUTION", start)
    nb = submissions.replace_answer(nb, "ex3f_checkpoint", text[:start] + REPLAYED_LOAD + text[end:])
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    submissions.assert_loses_exactly(report, A, ["ex3f_test_checkpoint"], ["replayed"], notebook=NB)
