"""Part 3 of exercise 3's FSDP notebook: one sharded checkpoint, two uses (:func:`check_checkpoint`).

``save_checkpoint(model, optimizer, path)`` writes a torch.distributed.checkpoint (DCP) folder of the trained sharded
model and its SGD: one job trains and saves, and every rank's shard must be in the folder. The grader reads the folder
with DCP itself, whole on one rank and sharded on the saved world size (:mod:`graders.fsdp_checkpoint.dcp`): it must
hold the trained weights and momentum (found by value, under the student's keys), each rank's rows a piece of their
own (.metadata) in a file that rank wrote: nothing gathered before the save.

``load_for_finetune(model, path)`` starts a new task from it: ``model`` is a freshly built sharded model whose head has
another number of outputs than the saved one. A last job (possibly at another world size: the hidden test) gives it
the grader's copy of the checkpoint, every tensor moved by a random nudge only the grader knows and written again by
DCP on one rank; afterwards every parameter but the head's must hold the copy's values (a replayed training cannot
give them) and the head its initial ones, on every rank. The harness observes with references bound before the
student's code runs, so reloading or re-executing the grader's module changes nothing it sees.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import torch

from course import checks
from course.checks import CheckFailed, Mistake, passed, rank_list, stranded
from graders.fsdp_checkpoint.checks import _job_env, _where
from graders.fsdp_checkpoint.dcp import _pieces_verdict, _read_harness, _read_verdict, _same, nudge
from graders.fsdp_checkpoint.harness import (
    OUTPUTS,
    _finetune_harness,
    _full,
    _save_harness,
    _shard_of,
    finetune_spec,
    make_net,
)

#: the new task's head: this many outputs where the saved model's head has OUTPUTS
NEW_OUTPUTS = 3


def _is_head(name: str) -> bool:
    return name.split(".")[0] == "head"


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

_SIZE_MISMATCH = (r"Size mismatch between saved torch\.Size\(\[[^\]]*\]\) and current: torch\.Size\(\[[^\]]*\]\) "
                  r"for [\w.]+")  # DCP's own words, with the key


def _mismatched_key(text: str) -> str | None:
    """The key of DCP's size mismatch in a failure's text (None: no size mismatch)."""
    found = re.search(r"Size mismatch between saved .*? for ([\w.]+)", text)
    return found.group(1) if found else None


def _optimizer_key(key: str | None) -> bool:
    return key is not None and bool(re.search(r"momentum|optim|(^|\.)state\.", key))


_FINETUNE_MISTAKES = [
    _collective_on_some("dcp.load", "checkpoint", "call dcp.load(...) on EVERY rank, with the same keys: each rank "
                        "reads its own rows"),
    Mistake(lambda rank, text: _optimizer_key(_mismatched_key(text)),
            "load_for_finetune asked the checkpoint for the saved optimizer's state, into an optimizer of the new "
            "model ({ws}-rank job): its head's momentum does not fit, and the new task has no optimizer to resume: "
            "it starts a fresh one after the load",
            "load the model's state alone (no optimizer: get_model_state_dict, not get_state_dict), without the "
            "head's keys", expected="only the saved model's parameters, head excluded, read from the checkpoint",
            got=_SIZE_MISMATCH),
    Mistake(lambda rank, text: "head" in (_mismatched_key(text) or "").split("."),
            "load_for_finetune loaded the saved head too ({ws}-rank job): the head belongs to the new task, it has "
            f"another number of outputs ({NEW_OUTPUTS} instead of {OUTPUTS}), and its weights must stay as the new "
            "model was built", "leave the head's keys (head.weight, head.bias) out of the dict you give dcp.load; "
            "everything else it fills from the checkpoint",
            expected="every saved parameter but the head's loaded; the head left as built", got=_SIZE_MISMATCH),
    Mistake(lambda rank, text: "Missing key(s)" in text and "head." in text,
            "after leaving the head out of the load (rightly), load_for_finetune set the loaded state strictly, which "
            "asks for every key of the model, the head's too ({ws}-rank job)",
            "the loaded dict lacks the head on purpose: set it without strictness (set_model_state_dict's "
            "StateDictOptions has strict; load_state_dict has strict=), or load in place: dcp.load fills the "
            "sharded tensors you give it", expected="the saved parameters but the head's set; the head kept",
            got=r"Missing key\(s\) in state_dict: [^\n]*"),
    Mistake(lambda rank, text: "optim" in text and any(e in text for e in ("TypeError", "NameError", "AttributeError")),
            "load_for_finetune reached for an optimizer ({ws}-rank job): it is given none, and fine-tuning needs none "
            "of the saved one's state (the new task starts a fresh optimizer after the load)",
            "load the model's state alone: get_model_state_dict (not get_state_dict, which wants an optimizer), "
            "head's keys left out, into dcp.load", expected="load_for_finetune(model, path) loads the model only"),
    Mistake(lambda rank, text: "Missing key in checkpoint" in text,
            "load_for_finetune asked the checkpoint for state that save_checkpoint did not save ({ws}-rank job)",
            expected="the keys save_checkpoint saved the model's weights under",
            hint="load under the same keys as the save wrote (the same dict shape: e.g. the model's state under the "
            "same top-level key)",
            got=r"(?<=Error: )Missing key in checkpoint state_dict: [^\s{]+"),  # DCP's own words, the key it lacks
    Mistake(lambda rank, text: "FileNotFoundError" in text or "IsADirectoryError" in text,
            "load_for_finetune looked for a file DCP does not write ({ws}-rank job): it was given the checkpoint as DCP "
            "itself writes it (the grader's copy of what it read in your folder, saved again with dcp.save on 1 rank)",
            expected="load_for_finetune reads the folder with dcp.load, whatever the world size that saved it",
            hint="read with dcp.load(state, checkpoint_id=path) into the model's own sharded state dict: .metadata "
            "tells every rank where its rows are, also at another world size"),
    Mistake(lambda rank, text: "Unsupported global" in text or "weights_only" in text,
            "load_for_finetune could not torch.load the checkpoint ({ws}-rank job): it holds DTensor shards, not a "
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
            got="a single file: one rank's writing, where every rank writes its own shard into a folder (a whole "
            "state gathered for it went through one rank; a rank's own state dict holds only its shards)",
            ranks=list(range(ws)), hint="use torch.distributed.checkpoint, on every rank: " + hint)
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




def _finetune_verdict(check: str, loaded: list[dict], expected: dict[str, list[torch.Tensor]],
                      saved: dict[str, torch.Tensor], built: dict[str, torch.Tensor], ws: int) -> None:
    """``expected``: the full tensors of the copy load_for_finetune was given (the saved ones, nudged), head excluded,
    one per key of the checkpoint that held the tensor; ``built``: the new model's initial full tensors, built again here
    from the spec (never what the rank reports of them);
    ``saved``: the full weights the save job held (what a replayed training gives)."""
    where = f"{_where(ws)}, the new task's model: its head {NEW_OUTPUTS} outputs wide, the saved one {OUTPUTS}"
    hint = ("on every rank: the new model's own sharded state dict without the head's keys, filled by dcp.load from "
            "`path` (it reads each rank's rows, at any world size); the head stays as it was built")

    def judged(rank, obs):
        body = [n for n in obs["params"] if not _is_head(n)]
        wrong = [n for n in body if not any(_same(obs["params"][n], _shard_of(e, ws, rank)) for e in expected[n])]
        if wrong:
            fresh = [n for n in wrong if _same(obs["params"][n], _shard_of(built[n], ws, rank))]
            replayed = [n for n in wrong if _same(obs["params"][n], _shard_of(saved[n], ws, rank))]
            if len(fresh) == len(body):
                problem, got = ("after load_for_finetune the model holds none of the checkpoint's weights",
                                f"the new model's initial weights in all {len(body)} parameters: nothing was loaded")
            elif fresh == wrong:
                problem, got = (f"load_for_finetune loaded only some of the saved parameters: {len(fresh)} of "
                                f"{len(body)} still hold the new model's initial weights",
                                "initial weights in " + ", ".join(fresh[:4]) + (" ..." if len(fresh) > 4 else ""))
            elif replayed == wrong:
                problem, got = ("after load_for_finetune the model holds the weights of the training that was saved, "
                                "without the copy's changes: they did not come from the checkpoint it was given "
                                "(the training replayed?)", f"{len(wrong)} parameters, e.g. {wrong[0]}")
            else:
                problem, got = ("after load_for_finetune the model does not hold the checkpoint's weights",
                                f"other values in {len(wrong)} parameters, e.g. {wrong[0]}")
            raise CheckFailed(check, f"{problem} ({where})", ranks=[rank],
                              expected="every parameter but the head's: the checkpoint's values (the grader's copy of "
                              "your checkpoint, every value moved a little: only reading it gives them)",
                              got=got, hint=hint)
        head = [n for n in obs["params"] if _is_head(n)]
        changed = [n for n in head if not _same(obs["params"][n], _shard_of(built[n], ws, rank))]
        if changed:
            raise CheckFailed(check, f"after load_for_finetune the head is not as the new model was built: "
                              f"{', '.join(changed)} changed ({where})", ranks=[rank],
                              expected="the head's initial values (the new task's head: nothing saved fits it)",
                              got=f"other values in {', '.join(changed)}",
                              hint="touch only the parameters you load from the checkpoint: " + hint)

    checks.on_every_rank(loaded, judged)


def check_checkpoint(save_checkpoint, load_for_finetune, world_size: int = 2, seed: int = 0, width: int = 8,
                     depth: int = 3, steps: int = 2, load_world_size: int | None = None) -> None:
    """save_checkpoint writes a DCP checkpoint, every rank its own shard, that DCP reads back (by the grader, whole
    and sharded) as the trained weights and momentum; load_for_finetune fills a new task's freshly built sharded
    model (its head NEW_OUTPUTS wide) from a copy DCP wrote at world size 1, on ``load_world_size`` ranks (the save's
    by default): every parameter but the head's holds the copy's values, the head its initial ones."""
    check = "check_checkpoint"
    checks.require_written(check, save_checkpoint=save_checkpoint, load_for_finetune=load_for_finetune)
    spec = (width, depth, seed)
    load_ws = load_world_size or world_size
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
        weights = _full([obs["params"] for obs in saved])
        expected = {name: [weights[name] + nudge(key, shapes[name], nonce) for key in candidates]
                    for name, candidates in keys["params"].items() if not _is_head(name)}
        loaded = checks.run(check, _finetune_harness, load_ws, args=(load_for_finetune, copy, spec, NEW_OUTPUTS),
                            mistakes=_FINETUNE_MISTAKES, env=_job_env(load_ws)).values
        built = {name: p.detach() for name, p in make_net(finetune_spec(spec), outputs=NEW_OUTPUTS).named_parameters()}
        _finetune_verdict(check, loaded, expected, weights, built, load_ws)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    passed(check)
