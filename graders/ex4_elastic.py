"""Checks for exercise 4's elastic part: a script that goes on when a node leaves and when one joins.

Both checks read one launch of the student's ``elastic.py`` (:func:`course.checks.torchrun.run_elastic`, cached
by the script's content and the story): nodes A and B start the job; B leaves after its ``leave_step``-th
optimizer step, in the middle of epoch 0; A goes on alone (a smaller world size) for
:class:`~course.launcher.torchrun.elastic.Plan` ``hold_steps`` steps; node C joins and the job ends at A + C
workers. The visible story is A 2, B 1, C 1 workers (world sizes 3, 2, 3), B leaving after step 2; the hidden
tests tell both checks another (A 1, B 2, C 1: world sizes 3, 1, 2, B leaving after step 1), and the autograder
judges that launch instead of the visible one, so a notebook still grades in one launch.

The student chooses the batch rule and states it in the script (``BATCH_RULE = "global"`` or ``"per_rank"``,
read from the file's text before anything runs): a fixed global batch (every step GLOBAL_BATCH samples split
over the ranks, at the learning rate LR) or a fixed per-rank batch (every rank PER_RANK_BATCH samples a step, the
learning rate scaled with the step's samples: LR * world_size * PER_RANK_BATCH / GLOBAL_BATCH, the linear
scaling rule). Either way an epoch trains on every sample once; the checks count epochs in samples, by the
stated rule's step sizes (the stories keep every step inside one epoch under both rules).

What they judge is what happened, as the probe saw it in every worker: which samples reached the model at
each optimizer step (the rows the model's first layer received, matched against the dataset), the learning
rate of each step, which checkpoint file each worker of a new round loaded (its sha256) and which commit of
rank 0 wrote it (after how many steps of its round), and the final weights. From those the check rebuilds the
steps that led to the final weights: the steps of the last round, after the steps of the round whose checkpoint
it loaded, up to that commit, and so on back.

* ``check_elastic_shrink``: the smaller job loaded the checkpoint the first job wrote at its last step before B
  left, each of its steps followed the stated rule (samples per rank and per step, learning rate), none of its
  samples had been trained on already in that epoch, and each step started from the weights a replay of the
  steps before it gives.
* ``check_elastic_grow``: every worker of the grown job, the new node's included, loaded the checkpoint the
  smaller job wrote; its steps are right in the same way; every epoch holds every sample exactly once; and the
  final weights equal a replay of those steps in one process (DDP's average of each rank's mean loss, SGD with
  momentum at each step's learning rate) within :data:`ATOL`.

A mistake in the resume logic that both changes of size use (never loading, restarting the epoch) loses both
checks; one that only the smaller world size shows (a world size hard-coded to the first job's, where the
grown job has that size again) loses the shrink check, and one that only a joining node shows (loading only
when TORCHELASTIC_RESTART_COUNT > 0) the grow check. The replay takes each step's batches and learning rate as
they ran, so a step already failed for them is not failed again through the weights; an epoch that the shrink
check already failed for its batch sizes is not judged again for completeness by the grow check.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from course import checks
from course.checks import CheckFailed, expect, passed, torchrun
from course.errors import rank_list
from graders.ex4_elastic_model import (  # noqa: F401 - the given parts and the stories, as tests name them here
    EPOCHS,
    GLOBAL_BATCH,
    HOLD_STEPS,
    INPUT_FEATURES,
    LR,
    MOMENTUM,
    PER_RANK_BATCH,
    RULES,
    SAMPLES,
    Round,
    Rule,
    Story,
    chain,
    chain_lrs,
    epochs_of,
    make_dataset,
    plan,
    rule_samples,
    stated_rule,
    steps_before,
    story_of,
)
from graders.ex4_model import compare_weights, make_model, top_level_stub

ATOL = 1e-5
LR_RTOL = 1e-6  # a learning rate computed in another order (LR * 2 / 3, LR / 3 * 2) rounds differently

#: the hidden tests' story (the notebook's hidden arguments: a test keeps the two in step)
HIDDEN_NODES, HIDDEN_LEAVE_STEP = (1, 2, 1), 1


def _vet(check: str):
    def vet(source: str) -> None:
        checks.require_written_source(check, source, "elastic.py", names=("main",))
        if top_level_stub(source):
            raise CheckFailed(check, "elastic.py is not written yet: the script still runs nbgrader's "
                              "`raise NotImplementedError()`",
                              hint="write the script below `# ---- yours ----` to the specification (replace "
                              "`raise NotImplementedError()`), run that cell, then this one")
        stated_rule(check, source)  # before a launch: without a rule there is nothing to judge the run by
    return vet


def _launch(check: str, script: str, content: bytes, story_plan: torchrun.Plan) -> Story:
    """The launch of ``script`` (whose ``content`` keys the memo), judged by the rule that content states."""
    run = torchrun.run_elastic(check, script, plan=story_plan, input_features=INPUT_FEATURES, vet=_vet(check))
    return story_of(run, stated_rule(check, content.decode("utf-8", "replace")), story_plan)


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
            lines.append(f"  rank {w.rank} (node {torchrun.node(w)}, TORCHELASTIC_RESTART_COUNT="
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
                      hint="train every step of every epoch with DDP, one optimizer step per step of your batch "
                      "rule; read the world size from WORLD_SIZE when the script starts")


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


def _size_hint(rule: Rule) -> str:
    if rule.name == "global":
        return ("the global batch must not change with the world size: per-rank batch = GLOBAL_BATCH // "
                "world_size, with world_size read from WORLD_SIZE at start-up (a number fixed for the first job's "
                "size, or a per-rank batch that stays the same, changes the global batch when the size changes; "
                'a fixed per-rank batch is the other rule, BATCH_RULE = "per_rank", with its learning rate)')
    return ("with a fixed per-rank batch every rank trains on PER_RANK_BATCH samples a step, whatever the world "
            "size: the step's samples are world_size * PER_RANK_BATCH, with world_size read from WORLD_SIZE at "
            'start-up (if your global batch stays GLOBAL_BATCH, state BATCH_RULE = "global")')


def _lr_hint(rule: Rule) -> str:
    if rule.name == "global":
        return ("keep the optimizer's learning rate LR at every world size (the global batch does not change, so "
                'neither does the step size); scaling it belongs to the other rule, BATCH_RULE = "per_rank"')
    return ("set every param group's lr to LR * world_size * PER_RANK_BATCH / GLOBAL_BATCH at start-up, after "
            "loading the optimizer's state dict (load_state_dict restores the lr the previous job saved, for its "
            "own world size)")


def _require_steps(check: str, story: Story, r: Round) -> None:
    """Each of ``r``'s steps followed the stated rule (dataset samples, as many per rank and per step as it says,
    at its learning rate), none trained already in that epoch, each from the weights the steps before lead to."""
    table, rule, size = _table(story), story.rule, r.world_size
    before = steps_before(story, r)
    for i, per_rank in enumerate(r.batches):
        flat = [s for part in per_rank for s in part]
        if -1 in flat:
            raise CheckFailed(check, f"at step {i + 1} of {r.name()} the model received rows that are not samples "
                              "of make_dataset()", hint="train on the given dataset's samples, unchanged",
                              detail=table)
        sizes = [len(p) for p in per_rank]
        wrong = (len(flat) != rule.step_samples(size) if rule.name == "global" else
                 any(n != rule.rank_samples(size) for n in sizes))
        if wrong:
            raise CheckFailed(
                check, f"step {i + 1} of {r.name()} carried {len(flat)} samples in all "
                f"({' + '.join(map(str, sizes))} on its ranks), not what your rule ({rule.statement()}) makes "
                f"at world size {size}",
                ranks=[w.rank for w in r.workers], expected=rule.says(size),
                got=f"{len(flat)} samples per step: {' + '.join(map(str, sizes))}",
                hint=_size_hint(rule), detail=table)
        if len(set(flat)) != len(flat):
            raise CheckFailed(
                check, f"at step {i + 1} of {r.name()} several ranks trained on the same samples",
                ranks=[w.rank for w in r.workers], expected="each rank its own part of the step's samples",
                hint="split each step's samples by rank: rank r of world_size takes its own part", detail=table)
    want_lr = rule.lr(size)
    for rank, lrs in sorted(r.lrs.items()):
        for i, got in enumerate(lrs[:len(r.batches)]):
            if got is None or all(math.isclose(lr, want_lr, rel_tol=LR_RTOL) for lr in got):
                continue
            raise CheckFailed(
                check, f"step {i + 1} of {r.name()} ran at learning rate {', '.join(f'{lr:.6g}' for lr in got)} "
                f"(rank {rank}), not what your rule ({rule.statement()}) gives at world size {size}",
                ranks=[rank], expected=rule.says(size), got=f"lr = {', '.join(f'{lr:.6g}' for lr in got)}",
                hint=_lr_hint(rule), detail=table)
    steps = before + r.batches
    epochs = epochs_of(story, steps)
    for n in range(len(before), len(steps)):
        epoch = epochs[n]
        first = epochs.index(epoch)
        seen = {s for step in steps[first:n] for part in step for s in part}
        again = sorted(seen & {s for part in steps[n] for s in part})
        if again:
            epoch_start = {s for part in steps[first] for s in part} if n > first else set()
            restarted = n > first and {s for part in steps[n] for s in part} == epoch_start
            raise CheckFailed(
                check, f"{r.name()} trained samples {again} twice in epoch {epoch}: its step {n - len(before) + 1} "
                f"repeats samples that steps before the change of size had already trained",
                ranks=[w.rank for w in r.workers],
                expected=f"the epoch's remaining samples: the checkpoint held {len(before)} steps "
                f"({n - first} of epoch {epoch})",
                hint=("you resumed the epoch from its start: the checkpoint must hold how far into the epoch the job "
                      "was (the steps or samples done), and the new job skips the samples already trained"
                      if restarted else
                      "continue the epoch where the checkpoint left it: the same order of samples in every job of "
                      "that epoch (an order that depends on the epoch only), starting after the samples done"),
                detail=table)
    states = _replay_states(steps, chain_lrs(story, r))
    for rank, starts in sorted(r.starts.items()):
        for i, got in enumerate(starts[:len(r.batches) + 1]):
            want = states[len(before) + i]
            diff = _diff_first_layer(got, want)
            if diff is None or diff <= ATOL:
                continue
            first_start = i == 0
            raise CheckFailed(
                check, (f"{r.name()} started from weights that are not the checkpoint's" if first_start else
                        f"step {i + 1} of {r.name()} started from other weights than the steps before it lead to")
                + f" (rank {rank}, first layer, max |diff| {diff:.3g})",
                ranks=[rank], expected=f"the weights of a replay of the {len(before) + i} steps before it (their "
                f"samples and learning rates as they ran), within {ATOL:g}",
                got=f"max |diff| = {diff:.3g}",
                hint=("restore the model's state dict from CKPT on every rank before wrapping it in DDP"
                      if first_start else
                      "restore the optimizer's state dict too (SGD's momentum lives there) on every rank, and "
                      "train each step on the loss of its own samples only"),
                detail=table)


def _launch_story(check: str, script: str, nodes: tuple[int, int, int], leave_step: int) -> Story:
    story_plan = plan(nodes, leave_step)
    content = _content(script)
    return checks.memo(check, ("ex4_elastic", script, content, story_plan),
                       lambda: _launch(check, script, content, story_plan))


def _content(script: str) -> bytes:
    try:
        with open(script, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def check_elastic_shrink(script: str = "elastic.py", nodes: tuple[int, int, int] = (2, 1, 1),
                         leave_step: int = 2) -> None:
    """Node B leaves mid-epoch: the smaller job resumes from the last checkpoint and follows the stated rule.

    ``nodes``: the workers of nodes A, B and C; ``leave_step``: the optimizer step after which B leaves (the
    hidden tests pass another story)."""
    check = "check_elastic_shrink"
    story = _launch_story(check, script, nodes, leave_step)
    departed = _require_round(check, story, story.departed, f"ran with {story.plan.sizes[0]} workers until node B "
                              "left")
    shrunk = _require_round(check, story, story.shrunk, f"went on with {story.plan.sizes[1]} worker(s) after node "
                            "B left")
    _require_resumed(check, story, shrunk, departed, "node B left")
    _require_steps(check, story, shrunk)
    passed(check)


def _replay_states(steps: list[list[list[int]]], lrs: list[float]) -> list[dict]:
    """The weights before each of ``steps`` and after the last, in one process: per step DDP's average of each
    rank's mean loss, SGD with momentum at that step's learning rate (``lrs``)."""
    x, y = make_dataset().tensors
    model = make_model()
    params = list(model.parameters())
    momentum = [None] * len(params)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for per_rank, lr in zip(steps, lrs, strict=True):
        parts = [p for p in per_rank if p]
        loss = sum(nn.functional.mse_loss(model(x[p]), y[p]) for p in parts) / len(per_rank)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():  # torch.optim.SGD's update, written out: the buffer does not hold the lr
            for i, (p, g) in enumerate(zip(params, grads)):
                momentum[i] = g.clone() if momentum[i] is None else momentum[i].mul_(MOMENTUM).add_(g)
                p.sub_(lr * momentum[i])
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def _replay(steps: list[list[list[int]]], lrs: list[float] | None = None) -> dict:
    """The weights after ``steps`` (see :func:`_replay_states`; every step at LR unless ``lrs`` says)."""
    return _replay_states(steps, [LR] * len(steps) if lrs is None else lrs)[-1]


def _diff_first_layer(got: list, want: dict) -> float | None:
    """Max |diff| between the first layer's [weight, bias] a forward met and a replay's state; None: other shapes."""
    ref = [want["0.weight"].reshape(-1), want["0.bias"].reshape(-1)]
    if len(got) != 2 or any(len(g) != r.numel() for g, r in zip(got, ref)):
        return None
    return max(float((torch.tensor(g) - r).abs().max()) for g, r in zip(got, ref))


def check_elastic_grow(script: str = "elastic.py", nodes: tuple[int, int, int] = (2, 1, 1),
                       leave_step: int = 2) -> None:
    """Node C joins: every worker of the grown job resumes from the smaller job's checkpoint; every epoch holds
    every sample once; the final weights equal a replay of the steps that led to them (arguments: as
    :func:`check_elastic_shrink`)."""
    check = "check_elastic_grow"
    story = _launch_story(check, script, nodes, leave_step)
    full, smaller, grown_size = story.plan.sizes
    _require_round(check, story, story.departed, f"ran with {full} workers until node B left")
    shrunk = _require_round(check, story, story.shrunk, f"went on with {smaller} worker(s) after node B left")
    grown = _require_round(check, story, story.grown, f"grew to {grown_size} workers when node C joined")
    _require_resumed(check, story, grown, shrunk, "node C joined")
    _require_steps(check, story, grown)
    rule, steps, table = story.rule, chain(story, grown), _table(story)
    epochs = epochs_of(story, steps)
    short = {epochs[n] for n in range(len(steps) - len(grown.batches))
             if sum(len(p) for p in steps[n]) != rule.step_samples(len(steps[n]))}  # failed by the shrink check
    for epoch in range(EPOCHS):
        if epoch in short:
            continue
        got = sorted(s for n, step in enumerate(steps) if epochs[n] == epoch for part in step for s in part)
        missing = sorted(set(range(SAMPLES)) - set(got))
        expect(not missing and len(got) == SAMPLES, check,
               f"epoch {epoch} of the steps that led to the final weights did not train every sample once"
               + (f": samples {missing} never reached the model" if missing else ""),
               expected=f"each of the {SAMPLES} samples once per epoch (your rule, {rule.statement()}: "
               f"{rule.says(grown_size)})", got=f"{len(got)} samples",
               hint="continue each epoch where the checkpoint left it, in an order that depends on the epoch only; "
               "train every epoch to its end", detail=table)
    trained = rule_samples(story, steps)
    expect(trained == EPOCHS * SAMPLES, check,
           f"the final weights come from {len(steps)} optimizer steps, {trained} samples by your rule "
           f"({rule.statement()}), not {EPOCHS} epochs of {SAMPLES}",
           hint=f"train {EPOCHS} epochs of {SAMPLES} samples, whatever the world size and however often it changed",
           detail=table)
    torchrun.require_ok(check, story.run)
    final = story.run.final
    if not isinstance(final, dict):
        raise CheckFailed(check, "rank 0 did not write the final weights to OUT/final.pt"
                          + (f" ({final})" if final else ""), ranks=[0],
                          hint="at the end, on rank 0: torch.save(model.state_dict(), os.path.join(args.out, 'final.pt'))")
    reference = _replay(steps, chain_lrs(story, grown))
    diff = compare_weights(final, reference)
    if diff is None:
        raise CheckFailed(check, "final.pt does not hold this model's weights", expected=sorted(reference),
                          got=sorted(final), ranks=[0], hint="save the model's state_dict (without DDP's module.)")
    expect(diff <= ATOL, check,
           f"the final weights differ from a replay of the steps that led to them (max |diff| {diff:.3g})",
           ranks=[0], expected=f"equal within {ATOL:g}: DDP's average of the ranks' mean losses, SGD with momentum "
           "at each step's learning rate", got=f"max |diff| = {diff:.3g}",
           hint="restore the optimizer state (SGD momentum) with the model on every rank, and save the checkpoint "
           "after the optimizer step", detail=table)
    passed(check)


def try_elastic(script: str = "elastic.py", nodes: tuple[int, int, int] = (2, 1, 1),
                leave_step: int = 2) -> torchrun.Run:
    """Run the grader's elastic launch (the one both checks read) and print what each round of the job did."""
    story = _launch_story("try_elastic", script, nodes, leave_step)
    run = story.run
    print(f"{run.command}: {'finished' if run.ok else 'FAILED'} in {run.elapsed:.1f} s")
    print(f"your batch rule: {story.rule.statement()}")
    print(_table(story))
    if isinstance(run.final, dict) and story.grown is not None:
        steps = chain(story, story.grown)
        diff = compare_weights(run.final, _replay(steps, chain_lrs(story, story.grown)))
        print(f"final.pt: from {len(steps)} steps; " + ("not this model's keys and shapes" if diff is None else
                                                       f"max |diff| to their replay {diff:.3g}"))
    if not run.ok:
        print(torchrun.failure("try_elastic", run))
    return run
