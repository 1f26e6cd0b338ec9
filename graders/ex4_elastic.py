"""Checks for exercise 4's elastic part: a script that goes on when a node leaves and when one joins.

Both checks read one launch of the student's ``elastic.py`` (:mod:`course.launcher.torchrun.elastic`, cached
by the script's content): nodes A (2 workers) and B (1) start a 3-worker job; B leaves after its
:data:`~course.launcher.torchrun.elastic.LEAVE_STEP`-th optimizer step, in the middle of epoch 0; A goes on
alone (world size 2) for one step; node C (1 worker) joins and the job ends at world size 3.

What they judge is what happened, as the probe saw it in every worker: which samples reached the model at
each optimizer step (the rows the model's first layer received, matched against the dataset), which
checkpoint file each worker of a new round loaded (its sha256) and which commit of rank 0 wrote it (after
how many steps of its round), and the final weights. From those the check rebuilds the steps that led to the
final weights: the steps of the last round, after the steps of the round whose checkpoint it loaded, up to
that commit, and so on back. The rule is the specification's: every step trains on GLOBAL_BATCH samples
whatever the world size, each sample once per epoch, at the learning rate LR.

* ``check_elastic_shrink`` (3 -> 2): the 2-worker job loaded the checkpoint the 3-worker job wrote at its last
  step before B left, each of its steps carried GLOBAL_BATCH samples split over its 2 workers, and none of
  them had been trained on already in that epoch.
* ``check_elastic_grow`` (2 -> 3): every worker of the grown job, the new node's included, loaded the checkpoint
  the 2-worker job wrote; its steps are right in the same way; every epoch holds every sample exactly once;
  and the final weights equal a replay of those steps in one process (DDP's average of each rank's mean
  loss, SGD with momentum) within :data:`ATOL`.

A mistake in the resume logic that both changes of size use (never loading, restarting the epoch) loses both
checks; one that only a smaller world size shows (a hard-coded world size, a per-rank batch that stays
fixed) loses the shrink check, and one that only a joining node shows (loading only when
TORCHELASTIC_RESTART_COUNT > 0) the grow check. An epoch that the shrink check already failed for its batch
sizes is not judged again for completeness by the grow check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from course import checks
from course.checks import CheckFailed, expect, passed
from course.errors import rank_list
from course.launcher import torchrun
from course.launcher.torchrun import elastic
from graders.ex4 import _compare, _top_level_stub, make_model

# The script's given parts (the notebook's elastic.py): tests keep the two in step.
EPOCHS = 2
SAMPLES = 24
GLOBAL_BATCH = 6
LR = 0.05
MOMENTUM = 0.9
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH

ATOL = 1e-5


def make_dataset() -> torch.utils.data.TensorDataset:
    """SAMPLES samples (x, y), the same in every process."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SAMPLES, 4, generator=g)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


@functools.cache
def _index() -> dict[tuple, int]:
    x = make_dataset().tensors[0]
    return {tuple(row): i for i, row in enumerate(x.tolist())}


# --------------------------------------------------------------------------- what the run did


@dataclass
class Round:
    """One rendezvous round of the job: its workers, their steps and the checkpoint they loaded."""

    number: int
    workers: list[torchrun.Worker]
    batches: list[list[list[int]]]  # per step, per rank: the sample indices that reached the model
    loaded: dict[int, str | None]  # rank -> sha256 of the checkpoint it loaded (None: it loaded none)
    commits: list[tuple[str, int]]  # rank 0's checkpoint writes: (sha256, steps of this round done by then)
    starts: dict[int, list[list]]  # rank -> per step (one more if it began another): the first layer's
    # [weight, bias] its forward met, flattened

    @property
    def world_size(self) -> int:
        return self.workers[0].world_size

    @property
    def nodes(self) -> str:
        return "+".join(sorted({elastic.node(w) for w in self.workers}))

    def name(self) -> str:
        return f"the {self.world_size}-worker job (round {self.number}, nodes {self.nodes})"


@dataclass
class Story:
    """The elastic run as the checks read it."""

    run: torchrun.Run
    rounds: list[Round]
    departed: Round | None = None  # the round node B left
    shrunk: Round | None = None  # the 2-worker round after it
    grown: Round | None = None  # the 3-worker round after that
    origin: dict[int, tuple[int, int] | None] = field(default_factory=dict)  # round -> (round, steps) it resumed from


def _worker_batches(w: torchrun.Worker) -> list[list[int]]:
    index, batches, current = _index(), [], []
    for e in w.events:
        if e["event"] == "input":
            current += [index.get(tuple(row), -1) for row in e.get("rows") or []]
        elif e["event"] == "step":
            batches.append(current)
            current = []
    return batches


def _worker_starts(w: torchrun.Worker) -> list[list]:
    """The first layer's [weight, bias] at the first forward after each optimizer step (and before the first)."""
    starts, fresh = [], True
    for e in w.events:
        if e["event"] == "input" and fresh:
            starts.append(e.get("weights") or [])
            fresh = False
        elif e["event"] == "step":
            fresh = True
    return starts


def _round(number: int, workers: list[torchrun.Worker], ckpt: str) -> Round:
    per_rank = [_worker_batches(w) for w in workers]
    starts = {w.rank: _worker_starts(w) for w in workers}
    steps = min((len(b) for b in per_rank), default=0)
    loaded = {}
    for w in workers:
        loads = [e for e in w.of("load") if e.get("path") == ckpt]
        loaded[w.rank] = loads[0].get("sha") if loads else None
    commits = []
    for w in workers:
        if w.rank != 0:
            continue
        done = 0
        for e in w.events:
            if e["event"] == "step":
                done += 1
            elif (e["event"] == "rename" and e.get("dst") == ckpt) or (e["event"] == "saved" and e.get("path") == ckpt):
                if e.get("sha"):
                    commits.append((e["sha"], done))
    return Round(number, workers, [[b[i] for b in per_rank] for i in range(steps)], loaded, commits, starts)


def _story(run: torchrun.Run) -> Story:
    rounds = [_round(n, ws, run.ckpt_path) for n, ws in enumerate(elastic.rounds(run))]
    story = Story(run, rounds)
    for r in rounds:
        if story.departed is None and any(w.of("leave") for w in r.workers):
            story.departed = r
        elif story.departed and story.shrunk is None and r.world_size == 2:
            story.shrunk = r
        elif story.shrunk and story.grown is None and r.world_size == 3:
            story.grown = r
    written = {sha: (r.number, done) for r in rounds for sha, done in r.commits}
    for r in rounds:
        shas = set(r.loaded.values())
        story.origin[r.number] = written.get(shas.pop()) if len(shas) == 1 and None not in shas else None
    return story


def chain(story: Story, r: Round) -> list[list[list[int]]]:
    """The steps (per rank: sample indices) that led to round ``r``'s weights: the steps before it, then its own."""
    return _before(story, r) + r.batches


def _before(story: Story, r: Round) -> list[list[list[int]]]:
    origin = story.origin.get(r.number)
    if origin is None:
        return []
    earlier = story.rounds[origin[0]]
    return _before(story, earlier) + earlier.batches[:origin[1]]


def _vet(check: str):
    def vet(source: str) -> None:
        checks.require_written_source(check, source, "elastic.py", names=("main",))
        if _top_level_stub(source):
            raise CheckFailed(check, "elastic.py is not written yet: the script still runs nbgrader's "
                              "`raise NotImplementedError()`",
                              hint="write the script below `# ---- yours ----` to the specification (replace "
                              "`raise NotImplementedError()`), run that cell, then this one")
    return vet


def _launch(check: str, script: str) -> Story:
    run = elastic.run_elastic(script, check, vet=_vet(check))
    return _story(run)


def _table(story: Story) -> str:
    """What each round did, one line a worker (the student's view of the run)."""
    lines = []
    for r in story.rounds:
        origin = story.origin.get(r.number)
        came = (f"resumed from round {origin[0]}'s checkpoint after its step {origin[1]}" if origin else
                "started from scratch" if not any(r.loaded.values()) else "loaded different checkpoints")
        lines.append(f"round {r.number}: world size {r.world_size}, nodes {r.nodes}, {came}:")
        for w in r.workers:
            steps = len(w.of("step"))
            why = (" (node B left here)" if w.of("leave") else " (held for node C)" if w.of("hold") else "")
            lines.append(f"  rank {w.rank} (node {elastic.node(w)}, TORCHELASTIC_RESTART_COUNT="
                         f"{w.of('start')[0]['env'].get('TORCHELASTIC_RESTART_COUNT')}): "
                         f"{'loaded the checkpoint' if r.loaded.get(w.rank) else 'no checkpoint loaded'}, "
                         f"{steps} optimizer step(s){why}")
    return "\n".join(lines)


def _require_round(check: str, story: Story, r: Round | None, what: str) -> Round:
    if r is not None:
        return r
    run = story.run
    if not run.workers:
        raise torchrun.failure(check, run)
    if not run.ok:
        raise torchrun.failure(check, run, f"the job never {what}: ")
    raise CheckFailed(check, f"the job never {what}", detail=_table(story),
                      hint="train every step of every epoch with DDP, one optimizer step per global batch; "
                      "read the world size from WORLD_SIZE when the script starts")


# --------------------------------------------------------------------------- the judgements


def _require_resumed(check: str, story: Story, r: Round, previous: Round, who: str) -> None:
    """Every worker of ``r`` loaded the checkpoint ``previous`` wrote last (its round's last commit)."""
    table = _table(story)
    none = [rank for rank, sha in r.loaded.items() if sha is None]
    if not previous.commits:
        raise CheckFailed(
            check, f"{previous.name()} wrote no checkpoint in its {len(previous.batches)} step(s) before {who}",
            ranks=[0], expected="rank 0 writes CKPT after every optimizer step",
            hint="a node can leave or join in the middle of an epoch: save (model, optimizer, how many steps "
            "are done) after every step, so the next job loses no step", detail=table)
    if len(none) == len(r.loaded):
        raise CheckFailed(
            check, f"after {who}, {r.name()} did not resume: no worker loaded CKPT, it trained from the start",
            ranks=none, expected=f"every worker loads the checkpoint {previous.name()} wrote last",
            hint="at start-up, whenever CKPT exists (whatever TORCHELASTIC_RESTART_COUNT says), load it on every "
            "rank and continue after the steps it holds", detail=table)
    if none:
        fresh = [w for w in r.workers if w.rank in none
                 and (w.of("start")[0]["env"].get("TORCHELASTIC_RESTART_COUNT") or "0") == "0"]
        hint = ("the worker of a node that joins starts with TORCHELASTIC_RESTART_COUNT=0, while the others have "
                "restarted: resuming only when the restart count is > 0 leaves it at the start. Load CKPT "
                "whenever the file exists" if fresh else
                "every rank loads the checkpoint, not only rank 0 (the optimizer state and the position are "
                "each rank's too)")
        raise CheckFailed(
            check, f"after {who}, {rank_list(none)} of {r.name()} did not load the checkpoint while the others did",
            ranks=none, expected="every worker loads CKPT and continues from it", hint=hint, detail=table)
    last_sha, last_done = previous.commits[-1]
    origin = story.origin.get(r.number)
    expect(
        origin is not None and origin == (previous.number, last_done),
        check,
        f"after {who}, {r.name()} did not continue from the last checkpoint of {previous.name()}"
        + (f" (it loaded the one written after step {origin[1]} of round {origin[0]})" if origin else
           " (its workers loaded different files)"),
        ranks=sorted(r.loaded), expected=f"the checkpoint written after step {last_done} of round {previous.number}",
        hint="rank 0 replaces CKPT after every step (write a temporary file, then os.replace); every rank loads it",
        detail=table)


def _require_steps(check: str, story: Story, r: Round) -> None:
    """Each of ``r``'s steps carried GLOBAL_BATCH dataset samples, split over its ranks, none trained already
    in that epoch."""
    table = _table(story)
    before = _before(story, r)
    for i, per_rank in enumerate(r.batches):
        flat = [s for part in per_rank for s in part]
        if -1 in flat:
            raise CheckFailed(check, f"at step {i + 1} of {r.name()} the model received rows that are not samples "
                              "of make_dataset()", hint="train on the given dataset's samples, unchanged",
                              detail=table)
        if len(flat) != GLOBAL_BATCH:
            raise CheckFailed(
                check, f"each step of {r.name()} carried {len(flat)} samples in all "
                f"({' + '.join(str(len(p)) for p in per_rank)} on its ranks), not GLOBAL_BATCH = {GLOBAL_BATCH}",
                ranks=[w.rank for w in r.workers],
                expected=f"{GLOBAL_BATCH} samples per step at every world size: "
                f"{GLOBAL_BATCH // r.world_size} per rank at world size {r.world_size}",
                got=f"{len(flat)} per step",
                hint="the global batch must not change with the world size: per-rank batch = GLOBAL_BATCH // "
                "world_size, with world_size read from WORLD_SIZE at start-up (a number fixed for 3 workers, or "
                "a per-rank batch that stays the same, changes the global batch when the job shrinks)",
                detail=table)
        if len(set(flat)) != len(flat):
            raise CheckFailed(
                check, f"at step {i + 1} of {r.name()} several ranks trained on the same samples",
                ranks=[w.rank for w in r.workers], expected="each rank its own part of the step's samples",
                hint="split each global batch by rank: rank r of world_size takes its own GLOBAL_BATCH // "
                "world_size samples", detail=table)
    steps = before + r.batches
    for n in range(len(before), len(steps)):
        epoch, start = divmod(n, STEPS_PER_EPOCH)
        seen = {s for step in steps[n - start:n] for part in step for s in part}
        again = sorted(seen & {s for part in steps[n] for s in part})
        if again:
            epoch_start = {s for part in steps[n - start] for s in part} if start else set()
            restarted = start and {s for part in steps[n] for s in part} == epoch_start
            raise CheckFailed(
                check, f"{r.name()} trained samples {again} twice in epoch {epoch}: its step {n - len(before) + 1} "
                f"repeats samples that steps before the change of size had already trained",
                ranks=[w.rank for w in r.workers],
                expected=f"the epoch's remaining samples: the checkpoint held {len(before)} steps "
                f"({start} of epoch {epoch})",
                hint=("you resumed the epoch from its start: the checkpoint must hold how far into the epoch the job "
                      "was (the number of steps done), and the new job skips the samples already trained"
                      if restarted else
                      "continue the epoch where the checkpoint left it: the same order of samples in every job of "
                      "that epoch (an order that depends on the epoch only), starting after the steps done"),
                detail=table)
    states = _replay_states(before + r.batches)
    for rank, starts in sorted(r.starts.items()):
        for i, got in enumerate(starts[:len(r.batches) + 1]):
            want = states[len(before) + i]
            diff = _diff_first_layer(got, want)
            if diff is None or diff <= ATOL:
                continue
            first = i == 0
            raise CheckFailed(
                check, (f"{r.name()} started from weights that are not the checkpoint's" if first else
                        f"step {i + 1} of {r.name()} started from other weights than the steps before it lead to")
                + f" (rank {rank}, first layer, max |diff| {diff:.3g})",
                ranks=[rank], expected=f"the weights of a replay of the {len(before) + i} steps before it, within {ATOL:g}",
                got=f"max |diff| = {diff:.3g}",
                hint=("restore the model's state dict from CKPT on every rank before wrapping it in DDP" if first else
                      "restore the optimizer's state dict too (SGD's momentum lives there) on every rank, and keep "
                      "the learning rate LR at every world size"),
                detail=table)


def _launch_story(check: str, script: str) -> Story:
    return checks.memo(check, ("ex4_elastic", script, _content(script)), lambda: _launch(check, script))


def _content(script: str) -> bytes:
    try:
        with open(script, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def check_elastic_shrink(script: str = "elastic.py") -> None:
    """Node B leaves mid-epoch: the 2-worker job resumes from the last checkpoint with the same global batch."""
    check = "check_elastic_shrink"
    story = _launch_story(check, script)
    departed = _require_round(check, story, story.departed, "ran with 3 workers until node B left")
    shrunk = _require_round(check, story, story.shrunk, "went on with 2 workers after node B left")
    _require_resumed(check, story, shrunk, departed, "node B left")
    _require_steps(check, story, shrunk)
    passed(check)


def _replay_states(steps: list[list[list[int]]]) -> list[dict]:
    """The weights before each of ``steps`` and after the last, in one process: per step DDP's average of each
    rank's mean loss, SGD with momentum."""
    x, y = make_dataset().tensors
    model = make_model()
    params = list(model.parameters())
    momentum = [None] * len(params)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for per_rank in steps:
        parts = [p for p in per_rank if p]
        loss = sum(nn.functional.mse_loss(model(x[p]), y[p]) for p in parts) / len(per_rank)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():  # torch.optim.SGD's update, written out
            for i, (p, g) in enumerate(zip(params, grads)):
                momentum[i] = g.clone() if momentum[i] is None else momentum[i].mul_(MOMENTUM).add_(g)
                p.sub_(LR * momentum[i])
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def _replay(steps: list[list[list[int]]]) -> dict:
    """The weights after ``steps`` (see :func:`_replay_states`)."""
    return _replay_states(steps)[-1]


def _diff_first_layer(got: list, want: dict) -> float | None:
    """Max |diff| between the first layer's [weight, bias] a forward met and a replay's state; None: other shapes."""
    ref = [want["0.weight"].reshape(-1), want["0.bias"].reshape(-1)]
    if len(got) != 2 or any(len(g) != r.numel() for g, r in zip(got, ref)):
        return None
    return max(float((torch.tensor(g) - r).abs().max()) for g, r in zip(got, ref))


def check_elastic_grow(script: str = "elastic.py") -> None:
    """Node C joins: every worker of the grown job resumes from the 2-worker job's checkpoint; every epoch holds
    every sample once; the final weights equal a replay of the steps that led to them."""
    check = "check_elastic_grow"
    story = _launch_story(check, script)
    _require_round(check, story, story.departed, "ran with 3 workers until node B left")
    shrunk = _require_round(check, story, story.shrunk, "went on with 2 workers after node B left")
    grown = _require_round(check, story, story.grown, "grew back to 3 workers when node C joined")
    _require_resumed(check, story, grown, shrunk, "node C joined")
    _require_steps(check, story, grown)
    steps, table = chain(story, grown), _table(story)
    short = {n // STEPS_PER_EPOCH for n in range(len(steps) - len(grown.batches))
             if sum(len(p) for p in steps[n]) != GLOBAL_BATCH}  # the shrink check's failure, not judged again
    for epoch in range(EPOCHS):
        if epoch in short:
            continue
        got = sorted(s for step in steps[epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH]
                     for part in step for s in part)
        missing = sorted(set(range(SAMPLES)) - set(got))
        expect(not missing and len(got) == SAMPLES, check,
               f"epoch {epoch} of the steps that led to the final weights did not train every sample once"
               + (f": samples {missing} never reached the model" if missing else ""),
               expected=f"{STEPS_PER_EPOCH} steps of {GLOBAL_BATCH} samples per epoch, each of the {SAMPLES} "
               "samples once", got=f"{len(got)} samples",
               hint="continue each epoch where the checkpoint left it, in an order that depends on the epoch only; "
               "train every epoch to its end", detail=table)
    expect(len(steps) == EPOCHS * STEPS_PER_EPOCH, check,
           f"the final weights come from {len(steps)} optimizer steps, not {EPOCHS * STEPS_PER_EPOCH}",
           hint=f"{EPOCHS} epochs of {STEPS_PER_EPOCH} steps, whatever the world size", detail=table)
    torchrun.require_ok(check, story.run)
    final = story.run.final
    if not isinstance(final, dict):
        raise CheckFailed(check, "rank 0 did not write the final weights to OUT/final.pt"
                          + (f" ({final})" if final else ""), ranks=[0],
                          hint="at the end, on rank 0: torch.save(model.state_dict(), os.path.join(args.out, 'final.pt'))")
    reference = _replay(steps)
    diff = _compare(final, reference)
    if diff is None:
        raise CheckFailed(check, "final.pt does not hold this model's weights", expected=sorted(reference),
                          got=sorted(final), ranks=[0], hint="save the model's state_dict (without DDP's module.)")
    expect(diff <= ATOL, check,
           f"the final weights differ from a replay of the steps that led to them (max |diff| {diff:.3g})",
           ranks=[0], expected=f"equal within {ATOL:g}: DDP's average of the ranks' mean losses, SGD with momentum "
           f"at LR = {LR}", got=f"max |diff| = {diff:.3g}",
           hint="restore the optimizer state (SGD momentum) with the model on every rank, keep LR unchanged, and "
           "save the checkpoint after the optimizer step", detail=table)
    passed(check)


def try_elastic(script: str = "elastic.py") -> torchrun.Run:
    """Run the grader's elastic launch (the one both checks read) and print what each round of the job did."""
    story = _launch_story("try_elastic", script)
    run = story.run
    print(f"{run.command}: {'finished' if run.ok else 'FAILED'} in {run.elapsed:.1f} s")
    print(_table(story))
    if isinstance(run.final, dict) and story.grown is not None:
        steps = chain(story, story.grown)
        diff = _compare(run.final, _replay(steps))
        print(f"final.pt: from {len(steps)} steps; " + ("not this model's keys and shapes" if diff is None else
                                                       f"max |diff| to their replay {diff:.3g}"))
    if not run.ok:
        print(torchrun.failure("try_elastic", run))
    return run
