"""Checks for exercise 3's second notebook, FSDP2 and distributed checkpoints
(exercises/ex3-syncbn-sharding/fsdp_checkpoint.ipynb).

The student writes small functions; each check runs them on real ranks (gloo, CPU) on a model
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
* ``save_checkpoint(model, optimizer, path)`` / ``load_for_finetune(model, path)``: one sharded checkpoint, two uses
  (:func:`graders.fsdp_checkpoint.checkpoint.check_checkpoint`);
* ``export_parts(model, folder)``: every rank writes its own balanced share of the full weights
  (:func:`graders.fsdp_checkpoint.export.check_export_parts`);
* ``shard_mixed`` / ``clip_gradients``: :mod:`graders.fsdp_checkpoint.precision`.

The model, the ranks' data, the single-process reference and the harnesses (which take torch's
functions before the student's objects are unpickled) are in :mod:`graders.fsdp_checkpoint.harness`.
"""

from __future__ import annotations

import torch

from course import checks
from course.checks import CheckFailed, Mistake, expect, passed
from course.costmodel import fsdp_padded_numel, fsdp_shard_rows
from graders.fsdp_checkpoint.harness import (  # Net: the notebook imports it from here
    LR,
    MOMENTUM,
    Net,  # noqa: F401
    _full,
    _max_diff,
    _shard_harness,
    _shard_of,
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
