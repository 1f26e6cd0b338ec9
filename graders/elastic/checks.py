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

What they judge rests on what the student's processes cannot write. The launch holds every new worker at the
probe's gate until the grader's own process has read CKPT (the old round's workers all gone) and changed it: every
copy of the model's weights and of SGD's momentum in it moves by a secret seed's amount
(:mod:`graders.elastic.evidence`). The weights a round leaves (CKPT as the grader reads it when the next
round starts, or final.pt) must equal a replay, in the grader's process, of the round's steps from that changed
state: only workers that really loaded CKPT (the model and the optimizer state, on every rank: a worker that
drifts moves the averaged gradients) carry the change; a job that recomputes the weights by hand, or loads
nothing, does not. Which samples and learning rate each step took is read from the probe in the workers (the rows
the model's first layer received, each step's param groups): that record can be forged, but a replay of forged
steps does not give the weights the round wrote, so it is used as the replay's input and to name the mistake
(which rank loaded nothing, which step left the replay), never alone for a verdict.

* ``check_elastic_shrink``: CKPT when B had left holds the weights of every step the first job made; the weights
  the smaller job left are a replay of its steps from CKPT as the grader changed it; each of its steps followed
  the stated rule (samples per rank and per step, learning rate) and none of its samples had been trained on
  already in that epoch.
* ``check_elastic_grow``: CKPT when C joined holds the weights of every step of the smaller job (where those are a
  replay at all: else the shrink check failed); the final weights are a replay of the grown job's steps from CKPT
  as the grader changed it, within :data:`ATOL`; its steps are right in the same way; every epoch holds every
  sample exactly once.

A mistake in the resume logic that both changes of size use (never loading, restarting the epoch) loses both
checks; one that only the smaller world size shows (a world size hard-coded to the first job's, where the
grown job has that size again) loses the shrink check, and one that only a joining node shows (loading only
when TORCHELASTIC_RESTART_COUNT > 0) the grow check. Each check replays its own round from CKPT as the grader
left it, with each step's batches and learning rate as they ran, so a step already failed for them is not failed
again through the weights, and a round the shrink check failed does not fail the grow check (an epoch the shrink
check failed is not judged again for completeness).
"""

from __future__ import annotations

import math

import torch

from course import checks
from course.checks import CheckFailed, expect, passed, torchrun
from course.errors import rank_list
from graders.common.torchrun_model import make_model, top_level_stub  # noqa: F401 - make_model: as tests name it here
from graders.elastic.evidence import (
    ATOL,
    Snapshot,
    at_round,
    commits_by_round,
    distance,
    fresh,
    loaded,
    replay,
    weigh,
)
from graders.elastic.story import (  # noqa: F401 - the given parts and the stories, as tests name them here
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
    recorded_commits,
    refs_of,
    rule_samples,
    stated_rule,
    steps_before,
    story_of,
    worker_starts,
)

LR_RTOL = 1e-6  # a learning rate computed in another order (LR * 2 / 3, LR / 3 * 2) rounds differently

#: the hidden tests' story (the notebook's hidden arguments: a test keeps the two in step)
HIDDEN_NODES, HIDDEN_LEAVE_STEP = (1, 2, 1), 1


def _unwrapped(final):
    """final.pt's weights under the model's own names (a DDP wrapper's 'module.' prefix taken off: this part judges
    what was trained, not how the file names it)."""
    return {k.removeprefix("module."): v for k, v in final.items()} if isinstance(final, dict) else final


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
    run = torchrun.run_elastic(check, script, plan=story_plan, input_features=INPUT_FEATURES, vet=_vet(check),
                               on_round=at_round)
    story = story_of(run, stated_rule(check, content.decode("utf-8", "replace")), story_plan)
    weigh(story)
    return story


def _table(story: Story) -> str:
    """What each round did: where it started (CKPT as the grader read it), whether the weights it left are a replay
    of its steps from there, and each worker as its probe saw it (the student's view of the run)."""
    lines = []
    for r in story.rounds:
        snap, origin = story.start.get(r.number), story.origin.get(r.number)
        if not isinstance(snap, Snapshot) or not snap.exists:
            came = "started from the given model (no CKPT at its start)"
        elif snap.problem:
            came = f"CKPT at its start: {snap.problem}"
        else:
            came = (f"CKPT at its start held round {origin[0]}'s weights after its step {origin[1]}" if origin and
                    story.verified(story.rounds[origin[0]]) else "CKPT at its start held weights of no replay")
            came += "; the grader changed it by a secret amount" if snap.seed is not None else ""
        matched = story.matched.get(r.number) or []
        left = ("none of its steps" if not r.batches and matched else
                f"a replay of its {len(r.batches)} step(s) from there" if len(r.batches) in matched else
                f"a replay of its first {matched[-1]} step(s)" if matched else "no replay of its steps from there")
        lines.append(f"round {r.number}: world size {r.world_size}, nodes {r.nodes}, {came}; the weights it left "
                     f"in CKPT: {left}:")
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


def _require_checkpoint(check: str, story: Story, r: Round, previous: Round, who: str) -> Snapshot:
    """CKPT as the grader's process read it when ``r`` started (before its shift): there, plain data, the model's."""
    snap, table = story.start.get(r.number), _table(story)
    if not isinstance(snap, Snapshot):
        raise CheckFailed(check, f"the grader could not read CKPT when {who}" + (f" ({snap})" if snap else ""),
                          hint="run the script again; if it happens again, report it", detail=table)
    if not snap.exists:
        raise CheckFailed(
            check, f"{previous.name()} wrote no checkpoint in its {len(previous.batches)} step(s) before {who}",
            ranks=[0], expected="rank 0 writes CKPT after every optimizer step",
            hint="a node can leave or join in the middle of an epoch: save (model, optimizer, how many steps "
            "are done) after every step, so the next job loses no step", detail=table)
    if snap.problem:
        raise CheckFailed(
            check, f"when {who}, {snap.problem}", ranks=[0],
            expected="CKPT holds the model's and the optimizer's state dicts as plain data (tensors, numbers, "
            "strings, lists, dicts): the grader reads it, and changes it, while the job is down",
            hint="save {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), ...} with plain numbers "
            "for the position (no objects of your own classes, no numpy values)", detail=table)
    return snap


def _require_continued(check: str, story: Story, previous: Round, r: Round, who: str) -> None:
    """The weights CKPT held when ``r`` started are those of every step of ``previous`` (its last commit)."""
    steps, matched, table = len(previous.batches), story.matched.get(previous.number) or [], _table(story)
    if steps in matched:
        return
    if matched:
        raise CheckFailed(
            check, f"after {who}, {r.name()} did not continue from the last step of {previous.name()}: when the "
            f"grader read CKPT at the new job's start, it held the weights after step {matched[-1]} of {steps}",
            ranks=[0], expected=f"the weights after its step {steps}: its last step",
            hint="rank 0 replaces CKPT after every optimizer step, after optimizer.step() (write a temporary file, "
            "then os.replace)", detail=table)
    states = story.replay.get(previous.number)
    diff = distance(states, story.end[previous.number].weights, steps) if states else None
    raise CheckFailed(
        check, f"the weights {previous.name()} left in CKPT (as the grader read them when {who}) are not those of "
        f"its steps" + (f" (max |diff| {diff:.3g} to their replay)" if diff is not None else ""), ranks=[0],
        expected=f"the weights of a replay of its {steps} step(s) from where it started (the samples and learning "
        f"rates the probe saw in its workers), within {ATOL:g}",
        got=f"max |diff| = {diff:.3g}" if diff is not None else None,
        hint="train each step with DDP on its own samples only (the model is called only on training batches); "
        "rank 0 saves the model's and the optimizer's state after every optimizer step", detail=table)


def _diverged(r: Round, states: list) -> tuple | None:
    """(step index, rank, worker, diff): the earliest step a worker's first layer, as its probe saw it, left the replay."""
    found = []
    for w in r.workers:
        for i, got in enumerate(worker_starts(w)[:len(states)]):
            ref = states[i][0]
            want = [ref["0.weight"].reshape(-1), ref["0.bias"].reshape(-1)]
            if len(got) != 2 or any(len(g) != t.numel() for g, t in zip(got, want)):
                break
            diff = max(float((torch.tensor(g) - t).abs().max()) for g, t in zip(got, want))
            if diff > ATOL:
                found.append((i, w.rank, w, diff))
                break
    return min(found, key=lambda f: f[:2]) if found else None


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def _require_loads(check: str, story: Story, r: Round, name: str, who: str, evidence: str) -> None:
    """Explain a failure ``evidence`` shows (weights, or a job that did not finish) by the ranks whose probe saw no
    load of CKPT, where some loaded it and some did not."""
    none = [rank for rank, sha in r.loaded.items() if sha is None]
    if not none or len(none) == len(r.loaded):
        return
    fresh_workers = [w for w in r.workers if w.rank in none
                     and (w.of("start")[0]["env"].get("TORCHELASTIC_RESTART_COUNT") or "0") == "0"]
    raise CheckFailed(
        check, f"after {who}, {rank_list(none)} of {name} did not load the checkpoint while the others did: "
        f"{evidence}", ranks=none, expected="every worker loads CKPT and continues from it", detail=_table(story),
        hint=("the worker of a node that joins starts with TORCHELASTIC_RESTART_COUNT=0, while the others "
              "have restarted: resuming only when the restart count is > 0 leaves it at the start. Load CKPT "
              "whenever the file exists" if fresh_workers else
              "every rank loads the checkpoint, not only rank 0 (the optimizer state and the position are each "
              "rank's too)"))


def _require_carried(check: str, story: Story, r: Round, role: str, who: str, end: dict | None, where: str) -> None:
    """The weights ``r`` left (``end``, read from ``where``) are a replay of its steps from CKPT as the grader left
    it at its start: only a job whose every worker loaded it (model and optimizer) carries the secret shift."""
    states, steps, table = story.replay[r.number], len(r.batches), _table(story)
    diff = distance(states, end, steps)
    if diff is not None and diff <= ATOL:
        return
    snap = story.start[r.number]
    lrs = chain_lrs(story, r)[-steps:] if steps else []
    name = f"{role} ({_workers(r.world_size)}, round {r.number}, nodes {r.nodes})"
    if diff is None:
        raise CheckFailed(check, f"{where} does not hold this model's weights", ranks=[0],
                          expected=sorted(states[0][0]), got=sorted(end) if end else end,
                          hint="save the model's state_dict (without DDP's module.)", detail=table)
    recomputed = replay(loaded(snap, story.carried.get(r.number), shifted=False), r.batches, lrs)
    scratch = replay(fresh(), r.batches, lrs)
    none = [rank for rank, sha in r.loaded.items() if sha is None]
    load_hint = ("at start-up, whenever CKPT exists (whatever TORCHELASTIC_RESTART_COUNT says), load it on every "
                 "rank and continue after the steps it holds")
    if snap.seed is not None and (distance(recomputed, end, steps) or 1) <= ATOL:
        raise CheckFailed(
            check, f"after {who}, {name} did not load CKPT's weights: the weights it left in {where} are those of "
            "its steps from the checkpoint's weights before the grader changed them, recomputed (or kept) instead "
            "of loaded", ranks=[w.rank for w in r.workers],
            expected="a job that loads CKPT as it is when the job starts carries the grader's change to the end",
            got=f"max |diff| = {diff:.3g} to a replay from CKPT as the grader left it; within {ATOL:g} of one from "
            "CKPT before the grader's change", detail=table,
            hint="load the model's and the optimizer's state dicts from CKPT on every rank and train on from there: "
            "never recompute the steps before it (the grader changed the weights and momentum in CKPT, by a secret "
            "amount, while the job was down)")
    if (distance(scratch, end, steps) or 1) <= ATOL or len(none) == len(r.loaded):
        raise CheckFailed(
            check, f"after {who}, {name} did not resume: "
            + ("no worker loaded CKPT, it trained from the start" if len(none) == len(r.loaded) else
               f"the weights it left in {where} are those of its steps from a fresh model"),
            ranks=sorted(r.loaded), expected="every worker loads the checkpoint the job before it wrote last",
            got=f"max |diff| = {diff:.3g} to a replay from CKPT", hint=load_hint, detail=table)
    _require_loads(check, story, r, name, who, f"the weights it left in {where} differ from a replay from CKPT "
                   f"by {diff:.3g}")
    off = _diverged(r, states)
    seen = ""
    if off is not None:
        step, rank, w, d = off
        seen = (f"; the probe saw rank {rank} (node {torchrun.node(w)}) start its step {step + 1} from other "
                f"weights than the replay (first layer, max |diff| {d:.3g})")
    raise CheckFailed(
        check, f"after {who}, the weights {name} left in {where} are not those of its steps from CKPT as the "
        f"grader left it (max |diff| {diff:.3g}){seen}", ranks=sorted(r.loaded),
        expected=f"a replay of its {steps} step(s) (the samples and learning rates its workers ran) from CKPT as "
        f"it was when the job started, within {ATOL:g}", got=f"max |diff| = {diff:.3g}", detail=table,
        hint="every rank loads the model and the optimizer state (SGD's momentum) from CKPT and trains each step on "
        "its own samples, through DDP; a worker that recomputes the weights or the momentum instead of loading "
        "them (the grader changed both in CKPT while the job was down), or that keeps a fresh optimizer, drifts "
        "from the others")


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


def _require_saved_every_step(check: str, story: Story, rounds: list[Round]) -> None:
    """Rank 0 put CKPT in place after every optimizer step of ``rounds``: at least one commit a step in the kernel's
    account (:func:`commits_by_round`), whatever the job knew of when its size would change; in rank 0's record of
    its writes where CKPT was moved in from a folder the launcher did not watch (the kernel's count can be short)."""
    commits, whose = commits_by_round(story), "the kernel's count, read by the grader's launcher"
    if commits is None and story.run.files is not None:  # moved in from elsewhere: rank 0's record says how often
        commits = {r.number: recorded_commits(r, story.run.ckpt_path) for r in rounds}
        whose = "rank 0's own record: CKPT was moved in from a folder the grader's launcher does not watch"
    for r in rounds if commits is not None else ():
        steps = len(r.batches)
        expect(commits.get(r.number, 0) >= steps, check,
               f"{r.name()} put CKPT in place {commits.get(r.number, 0)} time(s) in its {steps} optimizer step(s) "
               f"({whose})", ranks=[0],
               expected=f"a checkpoint after every optimizer step: at least {steps} moves into place",
               hint="rank 0 replaces CKPT after every optimizer step (a temporary file, then os.replace): a node can "
               "leave at any step, and the job can only continue from what CKPT holds then")


def _require_steps(check: str, story: Story, r: Round) -> None:
    """Each of ``r``'s steps followed the stated rule (dataset samples, as many per rank and per step as it says,
    at its learning rate), none trained already in that epoch (the steps as the probe saw them: the weights the
    round left, judged before, are a replay of these steps)."""
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
    _require_checkpoint(check, story, shrunk, departed, "node B left")
    _require_continued(check, story, departed, shrunk, "node B left")
    end = story.end.get(shrunk.number)
    _require_carried(check, story, shrunk, "the smaller job", "node B left", getattr(end, "weights", None),
                     "CKPT (as the grader read it when node C joined)" if story.grown is not None else
                     "CKPT (as the grader read it when the job was over)")
    _require_steps(check, story, shrunk)
    _require_saved_every_step(check, story, [departed, shrunk])
    passed(check)


def _replay_states(steps: list[list[list[int]]], lrs: list[float]) -> list[dict]:
    """The weights before each of ``steps`` and after the last, from the given model, in one process: per step DDP's
    average of each rank's mean loss, SGD with momentum at that step's learning rate (``lrs``)."""
    return [weights for weights, _ in replay(fresh(), steps, lrs)]


def _replay(steps: list[list[list[int]]], lrs: list[float] | None = None) -> dict:
    """The weights after ``steps`` (see :func:`_replay_states`; every step at LR unless ``lrs`` says)."""
    return _replay_states(steps, [LR] * len(steps) if lrs is None else lrs)[-1]


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
    _require_checkpoint(check, story, grown, shrunk, "node C joined")
    if story.verified(shrunk):  # else the shrink check failed it: the weights it left are no replay of its steps
        _require_continued(check, story, shrunk, grown, "node C joined")
    if not story.run.ok:
        _require_loads(check, story, grown, f"the grown job ({_workers(grown.world_size)}, round {grown.number}, "
                       f"nodes {grown.nodes})", "node C joined", "then the job did not finish")
    torchrun.require_ok(check, story.run)
    final = _unwrapped(story.run.final)
    if not isinstance(final, dict):
        raise CheckFailed(check, "rank 0 did not write the final weights to OUT/final.pt"
                          + (f" ({final})" if final else ""), ranks=[0],
                          hint="at the end, on rank 0: torch.save(model.state_dict(), os.path.join(args.out, 'final.pt'))")
    _require_carried(check, story, grown, "the grown job", "node C joined", final, "final.pt")
    _require_steps(check, story, grown)
    _require_saved_every_step(check, story, [grown])
    rule, table = story.rule, _table(story)
    refs = refs_of(story, grown)
    steps = [rr.batches[i] for rr, i in refs]
    epochs = epochs_of(story, steps)
    short = {epochs[n] for n in range(len(steps) - len(grown.batches))
             if sum(len(p) for p in steps[n]) != rule.step_samples(len(steps[n]))}  # failed by the shrink check
    unweighed = {epochs[n] for n, (rr, _) in enumerate(refs) if rr is not grown and not story.verified(rr)}
    for epoch in range(EPOCHS):
        if epoch in short or epoch in unweighed:
            continue  # the shrink check failed it: steps of the wrong size, or weights that are no replay of them
        got = sorted(s for n, step in enumerate(steps) if epochs[n] == epoch for part in step for s in part)
        missing = sorted(set(range(SAMPLES)) - set(got))
        expect(not missing and len(got) == SAMPLES, check,
               f"epoch {epoch} of the steps that led to the final weights did not train every sample once"
               + (f": samples {missing} never reached the model" if missing else ""),
               expected=f"each of the {SAMPLES} samples once per epoch (your rule, {rule.statement()}: "
               f"{rule.says(grown.world_size)})", got=f"{len(got)} samples",
               hint="continue each epoch where the checkpoint left it, in an order that depends on the epoch only; "
               "train every epoch to its end", detail=table)
    trained = rule_samples(story, steps)
    expect(trained == EPOCHS * SAMPLES, check,
           f"the final weights come from {len(steps)} optimizer steps, {trained} samples by your rule "
           f"({rule.statement()}), not {EPOCHS} epochs of {SAMPLES}",
           hint=f"train {EPOCHS} epochs of {SAMPLES} samples, whatever the world size and however often it changed",
           detail=table)
    passed(check)


def try_elastic(script: str = "elastic.py", nodes: tuple[int, int, int] = (2, 1, 1),
                leave_step: int = 2) -> torchrun.Run:
    """Run the grader's elastic launch (the one both checks read) and print what each round of the job did."""
    story = _launch_story("try_elastic", script, nodes, leave_step)
    run = story.run
    print(f"{run.command}: {'finished' if run.ok else 'FAILED'} in {run.elapsed:.1f} s")
    print(f"your batch rule: {story.rule.statement()}")
    print(_table(story))
    grown = story.grown
    if isinstance(run.final, dict) and grown is not None and story.replay.get(grown.number):
        diff = distance(story.replay[grown.number], _unwrapped(run.final), len(grown.batches))
        print("final.pt: " + ("not this model's keys and shapes" if diff is None else
                               f"max |diff| {diff:.3g} to a replay of the grown job's {len(grown.batches)} step(s) "
                               "from CKPT as the grader left it"))
    if not run.ok:
        print(torchrun.failure("try_elastic", run))
    return run
