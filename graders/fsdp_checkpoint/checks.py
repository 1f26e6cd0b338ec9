"""Checks for exercise 3's second notebook, FSDP2 and distributed checkpoints
(exercises/ex3-syncbn-sharding/fsdp_checkpoint.ipynb).

The student writes five small functions; each check runs them on real ranks (gloo, CPU) on a model
of the grader's (:class:`Net`: ``embed``, ``blocks``, an ``nn.ModuleList`` of :class:`Block`, and
``head``) and judges what happened, never what the student's process says about itself:

* ``shard_model(model)``: units of at most two consecutive blocks (the memory budget), then the root
  (:func:`check_shard`: every parameter is a DTensor whose rows are split across all ranks; torch's flight
  recorder shows the all-gathers of one forward: one of the root's own parameters, then the fewest the budget
  allows, ceil(depth / 2), none of more than two blocks, each block's parameters whole when it starts);
* ``make_optimizer(model, lr, weight_decay, shard)``: shard the model, THEN build SGD over its parameters, with
  weight decay on the weight matrices only (:func:`check_training`: after a few steps of the given training step
  (MSE, zero_grad, backward, step) the gathered weights equal single-process SGD on the global batch with those
  groups; the check passes its own correct ``shard``, so this part is graded on its own);
* ``save_checkpoint(model, optimizer, path)`` / ``load_checkpoint(model, optimizer, path)``: a
  torch.distributed.checkpoint (DCP) round trip (:func:`check_checkpoint`: one job trains and saves,
  every rank's shard must be in the folder; the grader reads the folder with DCP itself, whole on one
  rank and sharded on the saved world size (:mod:`graders.fsdp_checkpoint.dcp`): it must hold the trained weights
  and momentum, each rank's rows a piece of their own (.metadata) in a file that rank wrote (the save job
  records every rank's writes): nothing gathered before the save; a last job loads what the grader read, every
  tensor moved by a random nudge only the grader knows, written again by DCP on one rank, into a fresh sharded
  model and optimizer: the weights and momentum must be the nudged ones (a replayed training cannot give them),
  and one more step SGD's from them; the load harness observes with references bound before the student's code
  runs, so reloading or re-executing the grader's module changes nothing it sees);
* ``export_weights(model, path)``: the full state dict, gathered on every rank, saved by rank 0
  alone (:func:`check_export`: the file loads into a plain :class:`Net` with ``strict=True`` and
  holds the trained weights; no other rank wrote; a gather on rank 0 only is named as such, within
  the process-group timeout).

The model, the ranks' data, the single-process reference and the harnesses (which take torch's
functions before the student's objects are unpickled) are in :mod:`graders.fsdp_checkpoint.harness`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import torch
from torch.distributed.tensor import DTensor

from course import checks
from course.checks import CheckFailed, Mistake, expect, passed, rank_list, stranded
from course.costmodel import fsdp_padded_numel, fsdp_shard_rows
from graders.fsdp_checkpoint.dcp import _pieces_verdict, _read_harness, _read_verdict, nudge
from graders.fsdp_checkpoint.harness import (  # Net: the notebook imports it from here
    LR,
    MOMENTUM,
    Net,  # noqa: F401
    _export_harness,
    _full,
    _load_harness,
    _max_diff,
    _save_harness,
    _shard_harness,
    _shard_of,
    _step_reference,
    _training_harness,
    _training_reference,
    make_net,
)

FR_ENV = {"TORCH_FR_BUFFER_SIZE": "4000"}  # torch's flight recorder: the collectives each rank ran

STEPS = 3
ATOL = 1e-5

#: how many blocks' parameters may be whole at once (part 1's memory budget)
BUDGET_BLOCKS = 2
SHARD_HINT = (f"make units of consecutive blocks, at most {BUDGET_BLOCKS} blocks each (fully_shard accepts a list of "
              "modules: they become one unit, all-gathered once, just before the first of them runs), then "
              "fully_shard(model) last: the root unit holds what is left (embed, head)")

# --------------------------------------------------------------------------- running jobs


def _job_env(world_size: int, extra: dict | None = None) -> dict:
    """The ranks' extra environment. A gloo job (no GPU per rank) hides the GPUs: fully_shard's default mesh is
    the accelerator's whenever one is visible, and the model and data of a gloo job are on the CPU."""
    env = dict(extra or {})
    if checks.resolve_backend("auto", world_size) != "nccl":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _where(world_size: int) -> str:
    return f"{world_size}-rank job"


# =========================================================================== part 1: shard_model


def _shard_verdict(check: str, values: list[dict], spec: tuple, ws: int) -> None:
    width, depth, _ = spec
    where = _where(ws)
    reference = make_net(spec)
    names = [name for name, _ in reference.named_parameters()]
    shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    root_own = [n for n in names if not n.startswith("blocks.")]
    odd = [r for r, obs in enumerate(values) if obs["returned"] is not None]
    expect(not odd, check, f"shard_model returned {values[odd[0]]['returned'] if odd else ''}, not the model ({where})",
           ranks=odd, hint="fully_shard works in place: shard the model, then `return model`")
    for rank, obs in enumerate(values):
        params = obs["params"]
        missing = [n for n in names if n not in params]
        expect(not missing, check, f"the sharded model lost parameters: {', '.join(missing[:4])} ({where})",
               ranks=[rank], hint="keep the model's modules; only call fully_shard on them: " + SHARD_HINT)
    plain = sorted({n for obs in values for n in names if not obs["params"][n]["dtensor"]}, key=names.index)
    if plain:
        ranks = [r for r, obs in enumerate(values) if any(not obs["params"][n]["dtensor"] for n in names)]
        total = sum(reference.state_dict()[n].numel() for n in names)
        if len(plain) == len(names):
            problem = (f"nothing is sharded: every rank holds all {total} values of the model's {len(names)} "
                       f"parameters as plain tensors ({where})")
            hint = SHARD_HINT
        elif set(plain) <= set(root_own):
            problem = (f"the root's own parameters are not sharded: {', '.join(plain)} are plain tensors, whole on "
                       f"every rank, while the blocks are sharded ({where})")
            hint = ("after sharding the blocks, call fully_shard(model) too: the root unit takes the parameters no "
                    "block holds (embed, head), and it is what runs the forward and backward hooks of the whole model")
        else:
            problem = (f"{len(plain)} of {len(names)} parameters are not sharded, e.g. {', '.join(plain[:4])} ({where})")
            hint = SHARD_HINT
        raise CheckFailed(check, problem, ranks=ranks, expected="every parameter a DTensor sharded across all ranks",
                          got="plain tensors: " + ", ".join(plain[:6]) + (" ..." if len(plain) > 6 else ""), hint=hint)

    def sharded_by_rows(rank, obs):
        for name in names:
            p = obs["params"][name]
            want = [fsdp_shard_rows(shapes[name][0], ws, rank), *shapes[name][1:]]
            if p["mesh"] != ws or not p["rows"] or p["local"] != want:
                raise CheckFailed(
                    check, f"{name} is a DTensor but not sharded by rows across all {ws} ranks ({where})",
                    ranks=[rank], expected=f"placements [Shard(dim=0)] on a mesh of {ws} ranks; this rank holds "
                    f"{tuple(want)} of {shapes[name]}",
                    got=f"placements {p['placements']} on a mesh of {p['mesh']}; this rank holds {tuple(p['local'])}",
                    hint="call fully_shard(module) with its defaults (or a 1-D mesh of all ranks: "
                    "init_device_mesh('cpu', (world_size,))): " + SHARD_HINT)

    checks.on_every_rank(values, sharded_by_rows)
    _units_verdict(check, values, spec, ws, names, shapes, root_own)


def _units_verdict(check, values, spec, ws, names, shapes, root_own) -> None:
    width, depth, _ = spec
    where = _where(ws)
    block_values = sum(fsdp_padded_numel(shapes[n], ws) // ws for n in names if n.startswith("blocks.0."))
    root_values = sum(fsdp_padded_numel(shapes[n], ws) // ws for n in root_own)

    def units(rank, obs):
        if obs.get("blocks") is None:
            raise CheckFailed(check, f"the sharded model has no `blocks` ModuleList any more ({where})", ranks=[rank],
                              hint="shard the model in place and return it: " + SHARD_HINT)
        marks = obs["marks"]
        ran = [m["block"] for m in marks]
        expect(ran == list(range(depth)), check, f"the blocks did not each run once in the forward ({where})",
               ranks=[rank], expected=f"blocks {list(range(depth))} in order", got=ran, hint=SHARD_HINT)
        cold = [m["block"] for m in marks if not m["whole"]]
        if cold:
            raise CheckFailed(
                check, f"model.blocks[{cold[0]}] is not in a unit of whole blocks: its parameters were still sharded "
                f"when it started running ({where})", ranks=[rank],
                expected="each block's parameters all-gathered (whole) from the moment the block starts",
                got=f"blocks {cold} started with DTensor shards (only parts of them are units, e.g. each Linear)",
                hint=SHARD_HINT)
        if obs["gathers"] is None:
            return  # a torch without the flight recorder: the parameters' state alone decides
        gathers = obs["gathers"]
        budget = BUDGET_BLOCKS * block_values
        fewest = -(-depth // BUDGET_BLOCKS)
        plan = (f"one all-gather of the root's own parameters ({root_values} values per rank) first, then "
                f"{fewest} for the {depth} blocks, none of more than {BUDGET_BLOCKS} blocks ({budget} values per rank)")
        if len(gathers) == 1:
            raise CheckFailed(
                check, f"the whole model is ONE FSDP unit: all {depth} blocks are whole at once, over the memory "
                f"budget of {BUDGET_BLOCKS} blocks ({where}, seen in torch's flight recorder)", ranks=[rank],
                expected=plan, got=f"ONE all-gather of {gathers[0]} values per rank (every parameter) before "
                "model.blocks[0] ran: all the weights are whole on every rank during the whole forward",
                hint="the root alone makes one unit that gathers everything at once: " + SHARD_HINT)
        if gathers[0] != root_values:
            raise CheckFailed(
                check, f"the forward's first all-gather is not the root unit's own parameters, embed and head "
                f"({where}, seen in torch's flight recorder)", ranks=[rank], expected=plan,
                got=f"all-gathers of the forward: {gathers} values per rank",
                hint="embed and head belong to the root unit: " + SHARD_HINT)
        over = [g for g in gathers[1:] if g > budget]
        if over:
            raise CheckFailed(
                check, f"an all-gather made more than {BUDGET_BLOCKS} blocks' parameters whole at once, over the "
                f"memory budget ({where}, seen in torch's flight recorder)", ranks=[rank], expected=plan,
                got=f"all-gathers of the forward: {gathers} values per rank ({over[0]} > {budget})",
                hint=SHARD_HINT)
        total = root_values + depth * block_values
        if sum(gathers) != total or len(gathers) != 1 + fewest:
            per_block = len(gathers) == 1 + depth and sum(gathers) == total
            raise CheckFailed(
                check, f"one forward ran {len(gathers) - 1} all-gathers for the {depth} blocks where {fewest} fit the "
                f"memory budget ({where}, seen in torch's flight recorder)", ranks=[rank], expected=plan,
                got=f"all-gathers of the forward: {gathers} values per rank ({sum(gathers)} values)",
                hint=(f"every block is its own unit (lesson 3's choice): each all-gather pays a fixed latency, and "
                      f"the budget allows {BUDGET_BLOCKS} blocks per unit. " if per_block else "") + SHARD_HINT)

    checks.on_every_rank(values, units)


_SHARD_MISTAKES = [
    Mistake(lambda rank, text: "FSDP requires a single root module" in text,
            "the root's own parameters are not sharded: the units of blocks have no common root unit, and embed.weight, "
            "embed.bias, head.weight, head.bias stay plain tensors ({ws}-rank job)",
            expected="fully_shard on the units of blocks, then on the model",
            hint="after sharding the blocks, call fully_shard(model) too: the root unit takes the parameters no block "
            "holds (embed, head), and FSDP needs it as the one root above units of several modules"),
    Mistake(lambda rank, text: "Invariant encountered" in text or ("already" in text and "fully_shard" in text),
            "fully_shard failed on a block after the root was sharded ({ws}-rank job): the root's fully_shard "
            "already took every parameter, the blocks' too",
            expected="fully_shard on the units of blocks, then on the model",
            hint="shard bottom-up: the blocks' units FIRST, then fully_shard(model) last"),
]


def check_shard(shard_model, world_size: int = 2, width: int = 8, depth: int = 3, seed: int = 0) -> None:
    """Every parameter is a DTensor split by rows across all ranks; the root unit (embed, head) is gathered first;
    every block's parameters are whole when it starts; no all-gather holds more than BUDGET_BLOCKS blocks, and the
    forward runs the fewest all-gathers that budget allows (1 + ceil(depth / BUDGET_BLOCKS))."""
    check = "check_shard"
    checks.require_written(check, shard_model=shard_model)
    spec = (width, depth, seed)
    job = checks.run(check, _shard_harness, world_size, args=(shard_model, spec), mistakes=_SHARD_MISTAKES,
                     env=_job_env(world_size, FR_ENV))
    _shard_verdict(check, job.values, spec, world_size)
    passed(check)


# =========================================================================== part 2: training


TRAINING_HINT = (f"shard(model) first, then SGD (the lr given, momentum {MOMENTUM}) over every parameter of the "
                 "sharded model, in param groups: the weight_decay given on the weight matrices, 0 on the biases")


def _training_verdict(check: str, values: list[dict], spec: tuple, ws: int, steps: int, weight_decay: float) -> None:
    where = _where(ws)
    odd = [r for r, obs in enumerate(values) if obs["optimizer"] is not None]
    expect(not odd, check, f"make_optimizer returned {values[odd[0]]['optimizer'] if odd else ''}, not an optimizer "
           f"({where})", ranks=odd, hint=TRAINING_HINT)
    foreign = [r for r, obs in enumerate(values) if obs["foreign"]]
    if foreign:
        obs = values[foreign[0]]
        unchanged = _max_diff(_full([v["final"] for v in values]), _full([v["init"] for v in values])) == 0
        raise CheckFailed(
            check, f"the optimizer holds {obs['foreign']} of its {obs['held']} tensors that are not the model's "
            f"parameters: it was built before shard(model) ({where})", ranks=foreign,
            expected="an optimizer over the sharded model's parameters (the DTensors fully_shard put in)",
            got=f"after {steps} steps the weights " + ("never changed" if unchanged else "are not what SGD gives"),
            hint="fully_shard replaces every parameter with a new sharded one, and the old ones never get a gradient "
            "again: call shard(model) first, THEN build the optimizer over the model's parameters")
    plain = [r for r, obs in enumerate(values) if obs["plain"]]
    expect(not plain, check, f"after make_optimizer, parameters are not sharded: {', '.join(values[plain[0]]['plain'][:4]) if plain else ''} "
           f"({where})", ranks=plain, hint="call shard(model) (the function you are given) before building the optimizer")
    def settings(rank, obs):
        groups = obs["groups"]
        if not obs["sgd"] or any(abs(lr - LR) > 1e-12 or abs(m - MOMENTUM) > 1e-12 for lr, m in groups):
            shown = ", ".join(f"lr={lr:g}" + (f", momentum={m:g}" if m >= 0 else ", no momentum") for lr, m in groups)
            raise CheckFailed(
                check, f"the optimizer is not SGD(lr=lr, momentum={MOMENTUM}) ({where})", ranks=[rank],
                expected=f"torch.optim.SGD with lr={LR} (the lr given) and momentum={MOMENTUM}",
                got=f"{obs['type']} ({shown})",
                hint=TRAINING_HINT)

    def decay(rank, obs):
        wrong = [(name, wd, matrix) for wd, params in obs["decay"] for name, matrix in params
                 if abs(wd - (weight_decay if matrix else 0.0)) > 1e-12]
        if wrong:
            name, wd, matrix = next((w for w in wrong if w[2] and w[1] == 0.0), wrong[0])
            what = ("no weight decay on the weight matrix " + name if matrix and wd == 0.0 else
                    f"weight decay {wd:g} on the weight matrix {name}, not the {weight_decay:g} given" if matrix else
                    f"weight decay {wd:g} on {name}, a " + ("bias" if "bias" in name else "parameter of one dimension"))
            raise CheckFailed(
                check, what + f" ({where})", ranks=[rank],
                expected=f"weight_decay={weight_decay:g} (the value given) on every parameter of two or more "
                "dimensions (the Linear weights), 0 on the biases",
                got=", ".join(f"{n}: {w:g}" for n, w, _ in wrong[:4]) + (" ..." if len(wrong) > 4 else ""),
                hint="param groups: a list of dicts, each with its own params and weight_decay; a DTensor "
                "parameter reports the full tensor's dimensions (p.ndim), so choose by them after sharding")

    checks.on_every_rank(values, settings)
    checks.on_every_rank(values, decay)
    want = _training_reference(spec, ws, steps, weight_decay)
    got = _full([obs["final"] for obs in values])
    diff = _max_diff(got, want)
    if diff <= ATOL:
        return
    init = _full([obs["init"] for obs in values])
    wrong_ranks = [r for r, obs in enumerate(values)
                   if any(not torch.allclose(obs["final"][n], _shard_of(want[n], ws, r), atol=ATOL, rtol=0) for n in want)]
    if _max_diff(got, init) == 0:
        got_text, hint = (f"the weights never changed in {steps} steps of the given training step",
                          "return a plain torch.optim.SGD over the sharded model's parameters: its step() must "
                          "update them")
    else:
        got_text, hint = (f"max |diff| {diff:.3g}", TRAINING_HINT + ", and nothing else (no other optimizer or settings)")
    raise CheckFailed(
        check, f"after {steps} steps the gathered weights differ from single-process SGD on the global batch "
        f"({where})", ranks=wrong_ranks or list(range(ws)),
        expected=f"SGD(lr={LR}, momentum={MOMENTUM}, weight_decay={weight_decay:g} on the weight matrices, 0 on the "
        f"biases) on all ranks' batches together, within {ATOL:g}",
        got=got_text, hint=hint)


def check_training(make_optimizer, world_size: int = 2, steps: int = STEPS, seed: int = 0,
                   width: int = 8, depth: int = 3, weight_decay: float = 0.1) -> None:
    """With the optimizer built after sharding, k given training steps give the weights of single-process SGD
    whose weight decay ``weight_decay`` applies to the weight matrices only."""
    check = "check_training"
    checks.require_written(check, make_optimizer=make_optimizer)
    spec = (width, depth, seed)
    job = checks.run(check, _training_harness, world_size, args=(make_optimizer, spec, steps, weight_decay),
                     env=_job_env(world_size))
    _training_verdict(check, job.values, spec, world_size, steps, weight_decay)
    passed(check)


# =========================================================================== part 3: a DCP round trip


def _collective_on_some(what: str, name: str, fix: str) -> Mistake:
    """A known mistake: a collective that only some ranks called (seen as a deadlock, or as the process group's
    timeout in a traceback through ``name``)."""
    return Mistake(lambda rank, text: "deadlocked" in text or (name in text and stranded(text)),
                   f"rank {{rank}} waited in {what} for ranks that never joined it ({{ws}}-rank job): it is a "
                   "collective, every rank must call it", fix, expected=f"every rank calls {what}, with the same arguments")


_SAVE_MISTAKES = [
    _collective_on_some("dcp.save", "checkpoint", "call dcp.save(...) on EVERY rank (outside `if rank == 0:`): each "
                        "rank writes its own shard, and they agree on one .metadata file"),
]

_LOAD_MISTAKES = [
    _collective_on_some("dcp.load", "checkpoint", "call dcp.load(...) and set_state_dict(...) on EVERY rank: each "
                        "rank reads its own shard"),
    Mistake(lambda rank, text: "Missing key in checkpoint" in text,
            "load_checkpoint asked the checkpoint for state that save_checkpoint did not save ({ws}-rank job)",
            expected="a checkpoint with the model's and the optimizer's state, under the keys load_checkpoint asks for",
            hint="save the model's AND the optimizer's state dicts (both from get_state_dict) with dcp.save, "
            "under the same keys the load asks for",
            got=r"(?<=Error: )Missing key in checkpoint state_dict: [^\s{]+"),  # DCP's own words, the key it lacks
    Mistake(lambda rank, text: "FileNotFoundError" in text or "IsADirectoryError" in text,
            "load_checkpoint looked for a file DCP does not write ({ws}-rank job): it was given the checkpoint as DCP "
            "itself writes it (the grader's copy of what it read in your folder, saved again with dcp.save on 1 rank)",
            expected="load_checkpoint reads the folder with dcp.load, whatever the world size that saved it",
            hint="load with dcp.load(state, checkpoint_id=path) into get_state_dict(model, optimizer), then "
            "set_state_dict(...): .metadata tells every rank where its pieces are, also at another world size"),
    Mistake(lambda rank, text: "Unsupported global" in text or "weights_only" in text,
            "load_checkpoint could not torch.load the checkpoint ({ws}-rank job): it holds DTensor shards, not a "
            "plain state dict", expected="a DCP checkpoint folder, read with dcp.load on every rank",
            hint="save with dcp.save on every rank and load with dcp.load: a DTensor shard belongs to one rank"),
]


def _checkpoint_files(check: str, path: str, ws: int) -> None:
    """Every rank's shard is in the DCP folder: ``.metadata`` and one ``__<rank>_<n>.distcp`` per rank."""
    where = _where(ws)
    hint = ("save on every rank with dcp.save (the model's and the optimizer's state dicts from get_state_dict) into "
            "the folder it is given: each rank writes its own shard")
    if os.path.isfile(path):
        raise CheckFailed(
            check, f"save_checkpoint wrote ONE file at `path` (torch.save?), not a DCP checkpoint folder ({where})",
            expected=f"a folder with .metadata and one shard file per rank (__0_0.distcp ... __{ws - 1}_0.distcp)",
            got="a single file: what one rank held, its own shards of each tensor; the other ranks' shards are lost",
            ranks=list(range(1, ws)), hint="use torch.distributed.checkpoint, on every rank: " + hint)
    files = sorted(os.listdir(path)) if os.path.isdir(path) else []
    writers = {r for r in range(ws) for f in files if re.fullmatch(rf"__{r}_\d+\.distcp", f)}
    missing = [r for r in range(ws) if r not in writers]
    if ".metadata" in files and not missing:
        return
    if not files:
        problem, got = "save_checkpoint wrote nothing at `path`", "no folder" if not os.path.isdir(path) else "an empty folder"
    elif ".metadata" not in files and not writers:
        problem, got = "`path` holds no DCP checkpoint (no .metadata, no shard files)", f"files {files[:6]}"
    else:
        problem, got = f"{rank_list(missing)} wrote no shard into the checkpoint", f"files {files[:8]}"
    raise CheckFailed(check, f"{problem} ({where})", ranks=missing or list(range(ws)),
                      expected=f".metadata and one __<rank>_0.distcp file per rank (ranks 0..{ws - 1})", got=got,
                      hint="dcp.save writes every rank's own shard, so call it on every rank: " + hint)


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=0)


def _checkpoint_verdict(check: str, saved: list[dict], loaded: list[dict], spec: tuple, ws: int, steps: int,
                        expected: dict[str, dict[str, torch.Tensor]]) -> None:
    """``expected``: the full weights and momenta of the copy load_checkpoint was given (the saved ones, nudged)."""
    where = _where(ws)
    set_hint = ("dcp.load fills the tensors of the dict you give it, in place: load into get_state_dict(model, "
                "optimizer) (the model's and optimizer's own tensors), then set_state_dict(model, optimizer, "
                "model_state_dict=..., optim_state_dict=...) puts them in")

    def restored(rank, after):
        before = saved[rank]
        want = {kind: {n: _shard_of(t, ws, rank) for n, t in expected[kind].items()} for kind in expected}
        wrong = [n for n in before["params"] if not _same(after["params"][n], want["params"][n])]
        if wrong:
            fresh = all(_same(after["params"][n], after["fresh"][n]) for n in wrong)
            replayed = all(_same(after["params"][n], before["params"][n]) for n in wrong)
            raise CheckFailed(
                check, f"after load_checkpoint, the model does not hold the weights that were saved in the checkpoint it "
                f"was given ({where})", ranks=[rank],
                expected="the checkpoint's shard of every parameter, in the fresh sharded model (the grader's copy of "
                "your checkpoint, every value moved a little: only reading it gives them)",
                got=(f"the fresh model's weights, unchanged ({len(wrong)} parameters)" if fresh else
                     "the weights of the training that was saved, without the copy's changes: they did not come from "
                     "the checkpoint (the training replayed?)" if replayed else
                     f"other values in {len(wrong)} parameters, e.g. {wrong[0]}"),
                hint=set_hint if fresh else "load what the checkpoint at `path` holds, with dcp.load on every rank: "
                + set_hint)
        lost = [n for n, m in after["momentum"].items() if m is None]
        if lost:
            raise CheckFailed(
                check, f"after load_checkpoint, the optimizer has no state: the momentum of {len(lost)} of "
                f"{len(after['momentum'])} parameters was not restored ({where})", ranks=[rank],
                expected="SGD's momentum_buffer of every parameter, as saved", got="none",
                hint="load the optimizer too. A fresh optimizer's own state_dict() is empty, so dcp.load has nothing "
                "to fill: load into get_state_dict(model, optimizer), which creates the state, then "
                "set_state_dict(model, optimizer, ...)")
        off = [n for n in before["momentum"] if not _same(after["momentum"][n], want["momentum"][n])]
        if off:
            zeros = all(float(after["momentum"][n].abs().max()) == 0 if after["momentum"][n].numel() else True
                        for n in off)
            raise CheckFailed(
                check, f"after load_checkpoint, the optimizer's momentum differs from what was saved in {len(off)} "
                f"parameters ({where})", ranks=[rank], expected="SGD's momentum_buffer of every parameter, as saved",
                got="zeros: the fresh optimizer's state, never loaded" if zeros else f"other values, e.g. {off[0]}",
                hint="save and load the optimizer's state dict with the model's: " + set_hint)
        groups = after["groups"]
        if any(abs(lr - LR) > 1e-12 or abs(m - MOMENTUM) > 1e-12 for lr, m in groups):
            raise CheckFailed(check, f"after load_checkpoint the optimizer's settings changed ({where})", ranks=[rank],
                              expected=f"lr={LR}, momentum={MOMENTUM}", got=f"(lr, momentum) per group {groups}",
                              hint="load the saved optimizer state dict as it is: " + set_hint)

    checks.on_every_rank(loaded, restored)
    want = _step_reference(spec, ws, steps, expected["params"], expected["momentum"])
    bad = [r for r, obs in enumerate(loaded)
           if not all(torch.allclose(obs["next"][n], _shard_of(want[n], ws, r), atol=ATOL, rtol=0) for n in want)]
    expect(not bad, check, f"one more training step after load_checkpoint differs from SGD's from the checkpoint's "
           f"state ({where})",
           ranks=bad, expected=f"one SGD step (momentum) from the checkpoint's weights and momentum, within {ATOL:g}",
           got=f"max |diff| {_max_diff(_full([obs['next'] for obs in loaded]), want):.3g}",
           hint="load into the model and optimizer you are given (do not replace their parameters): " + set_hint)


def check_checkpoint(save_checkpoint, load_checkpoint, world_size: int = 2, seed: int = 0, width: int = 8,
                     depth: int = 3, steps: int = 2) -> None:
    """save_checkpoint writes a DCP checkpoint, every rank its own shard, that DCP reads back (by the grader, whole
    and sharded) as the trained weights and momentum; load_checkpoint restores them from a copy DCP wrote at world
    size 1 into a fresh sharded model and optimizer (another job): training goes on as if never stopped."""
    check = "check_checkpoint"
    checks.require_written(check, save_checkpoint=save_checkpoint, load_checkpoint=load_checkpoint)
    spec = (width, depth, seed)
    root = tempfile.mkdtemp(prefix="ddp-course-ex3-fsdp-")
    try:
        path = os.path.join(root, "checkpoint")
        saved = checks.run(check, _save_harness, world_size, args=(save_checkpoint, path, spec, steps),
                           mistakes=_SAVE_MISTAKES, env=_job_env(world_size)).values
        _checkpoint_files(check, path, world_size)
        copy = os.path.join(root, "copy")  # what the grader read, every tensor nudged, written again by DCP on 1 rank
        nonce = int.from_bytes(os.urandom(4), "little")  # the nudges: only the copy holds them
        read = checks.run(check, _read_harness, world_size, args=(path, copy, nonce), env=_job_env(world_size)).values
        keys = _read_verdict(check, read, saved, world_size)
        shapes = {name: tuple(p.shape) for name, p in make_net(spec).named_parameters()}
        _pieces_verdict(check, read[0]["chunks"], keys, saved, path, shapes, world_size)
        expected = {kind: {name: _full([obs[kind] for obs in saved])[name] + nudge(key, shapes[name], nonce)
                           for name, key in keys[kind].items()} for kind in ("params", "momentum")}
        loaded = checks.run(check, _load_harness, world_size, args=(load_checkpoint, copy, spec, steps),
                            mistakes=_LOAD_MISTAKES, env=_job_env(world_size)).values
        _checkpoint_verdict(check, saved, loaded, spec, world_size, steps, expected)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    passed(check)


# =========================================================================== part 4: a full state dict for export


_EXPORT_MISTAKES = [
    Mistake(lambda rank, text: ("deadlocked" in text and "all_gather" in text) or (
        stranded(text) and any(w in text for w in ("get_model_state_dict", "full_tensor", "get_state_dict", "_state_dict"))),
            "rank {rank} waited in the full-state gather for ranks that never joined it ({ws}-rank job): "
            "get_model_state_dict(full_state_dict=True) all-gathers every parameter, a collective, so it hangs when "
            "only rank 0 calls it", expected="every rank calls the gather; rank 0 alone saves",
            hint="call get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) "
            "on EVERY rank, outside `if rank == 0:`; then save on rank 0 only (with cpu_offload=True the others get an "
            "empty dict)"),
]


def _first_error(text: str) -> str:
    """load_state_dict's error without its header line, on one line, cut to 300 characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading"):
        lines = lines[1:]
    flat = " ".join(lines)
    return flat[:300] + (" ..." if len(flat) > 300 else "")


def _export_verdict(check: str, values: list[dict], paths: list[str], spec: tuple, ws: int) -> None:
    where = _where(ws)
    hint = ("on every rank: sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
            "cpu_offload=True)); then on rank 0 only: torch.save(sd, path)")
    written = {r: values[r]["writes"] + ([paths[r]] if os.path.exists(paths[r]) else []) for r in range(1, ws)}
    others = [r for r, found in written.items() if found]  # any file, under any name, anywhere
    expect(not others, check, f"{rank_list(others)} wrote a file too ({where})", ranks=others,
           expected="only rank 0 saves the exported weights", got=f"rank {others[0]} wrote {written[others[0]][0]}"
           if others else None, hint="guard the torch.save with `if rank == 0:` (dist.get_rank()); keep the gather "
           "outside it")
    expect(os.path.exists(paths[0]), check, f"rank 0 saved nothing at `path` ({where})", ranks=[0],
           expected="a file at `path`, written by rank 0 with torch.save", hint=hint)
    mesh_log = logging.getLogger("torch.distributed.device_mesh")  # a DTensor's mesh unpickled here warns
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:
        state = torch.load(paths[0], map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - shown to the student
        text = f"{type(exc).__name__}: {exc}"
        shards = "DTensor" in text or "distributed" in text
        raise CheckFailed(
            check, "the exported file " + ("holds DTensor shards (model.state_dict() of a sharded model), not plain "
                                           "tensors" if shards else "does not load with torch.load"),
            ranks=[0], expected="a dict of plain tensors that torch.load(path, weights_only=True) reads",
            got=text.splitlines()[0][:300],
            hint=("model.state_dict() gives each rank's DTensor shards, so rank 0 alone saves only its part of every "
                  "weight; instead, " if shards else "save a dict of tensors: ") + hint) from None
    finally:
        mesh_log.setLevel(level)
    expect(isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()), check,
           f"the exported file holds {type(state).__name__}, not a state dict of tensors", ranks=[0],
           expected="a dict of plain tensors, one per parameter", hint=hint)
    sharded = [k for k, v in state.items() if isinstance(v, DTensor)]
    expect(not sharded, check, f"the exported file holds DTensor shards ({len(sharded)} of {len(state)} tensors), "
           "not plain full tensors", ranks=[0], expected="plain full tensors, one per parameter",
           got="model.state_dict() of a sharded model: rank 0's part of each weight",
           hint="model.state_dict() gives each rank's DTensor shards, so rank 0 alone saves only its part of every "
           "weight; instead, " + hint)
    plain = make_net(spec)
    try:
        plain.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        text = str(exc)
        shards = "size mismatch" in text
        raise CheckFailed(
            check, "the exported weights do not load into a plain (unsharded) model with load_state_dict(strict=True)"
            + (": the tensors are shards (smaller than the parameters)" if shards else ""),
            ranks=[0], expected="the keys and full shapes of a plain Net's state_dict", got=_first_error(text),
            hint=("each rank holds only its rows of every parameter (to_local()): gather the full tensors; "
                  if shards else "save the model's own keys, without a prefix; ") + hint) from None
    want = _full([obs["params"] for obs in values])
    diff = _max_diff({k: v for k, v in plain.state_dict().items()}, want)
    expect(diff <= 1e-6, check, f"the exported weights differ from the trained model's by {diff:.3g} ({where})",
           ranks=[0], expected="the model's trained weights, gathered whole", hint=hint)


def check_export(export_weights, world_size: int = 2, seed: int = 0, width: int = 8, depth: int = 3,
                 steps: int = 2) -> None:
    """Rank 0 alone writes the full (gathered) weights, which a plain model loads with strict=True; every rank
    takes part in the gather (a gather on rank 0 only is reported within the process-group timeout)."""
    check = "check_export"
    checks.require_written(check, export_weights=export_weights)
    spec = (width, depth, seed)
    root = tempfile.mkdtemp(prefix="ddp-course-ex3-fsdp-")
    try:
        dirs = [os.path.join(root, f"rank{r}") for r in range(world_size)]
        for d in dirs:
            os.makedirs(d)
        paths = [os.path.join(d, "weights.pt") for d in dirs]
        values = checks.run(check, _export_harness, world_size, args=(export_weights, paths, spec, steps),
                            mistakes=_EXPORT_MISTAKES, env=_job_env(world_size)).values
        _export_verdict(check, values, paths, spec, world_size)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    passed(check)
