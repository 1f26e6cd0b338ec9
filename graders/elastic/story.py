"""Exercise 4's elastic.py as the checks know it: its given parts, the two batch rules a script may state, the
stories of an elastic run (which node leaves and joins when), and what a run did, round by round: the samples and
learning rate of each step, and the chain of steps that led to each round's weights (for the replay)."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field

import torch

from course.checks import CheckFailed, torchrun

# The script's given parts (the notebook's elastic.py): tests keep the two in step.
EPOCHS = 2
SAMPLES = 24
GLOBAL_BATCH = 6
PER_RANK_BATCH = 2
LR = 0.05
MOMENTUM = 0.9
INPUT_FEATURES = 4  # the given model's first layer: the probe logs the rows it receives (which samples a step used)
HOLD_STEPS = 3  # steps of the smaller job before C joins: with both rules every step stays inside an epoch


@dataclass(frozen=True)
class Rule:
    """The batch rule a script states: ``"global"`` (a fixed global batch) or ``"per_rank"`` (a fixed per-rank
    batch, the learning rate scaled with the global batch)."""

    name: str

    def step_samples(self, world_size: int) -> int:
        """Samples one optimizer step trains on at ``world_size``."""
        return GLOBAL_BATCH if self.name == "global" else world_size * PER_RANK_BATCH

    def rank_samples(self, world_size: int) -> int:
        return self.step_samples(world_size) // world_size

    def lr(self, world_size: int) -> float:
        """The learning rate of a step at ``world_size``: LR for GLOBAL_BATCH samples, linearly scaled."""
        return LR * self.step_samples(world_size) / GLOBAL_BATCH

    def statement(self) -> str:
        return f'BATCH_RULE = "{self.name}"'

    def says(self, world_size: int) -> str:
        """What the rule asks of a step at ``world_size``, in words."""
        if self.name == "global":
            return (f"{GLOBAL_BATCH} samples per step at every world size ({GLOBAL_BATCH // world_size} per rank at "
                    f"world size {world_size}), learning rate LR = {LR:g}")
        return (f"PER_RANK_BATCH = {PER_RANK_BATCH} samples per rank, {self.step_samples(world_size)} per step at "
                f"world size {world_size}, learning rate LR * {self.step_samples(world_size)} / {GLOBAL_BATCH} = "
                f"{self.lr(world_size):.6g}")


RULES = {name: Rule(name) for name in ("global", "per_rank")}
RULE_HINT = ('state your rule on a line of its own below `# ---- yours ----`: BATCH_RULE = "global" (every step '
             'GLOBAL_BATCH samples split over the ranks, learning rate LR) or BATCH_RULE = "per_rank" (every rank '
             'PER_RANK_BATCH samples a step, learning rate LR * world_size * PER_RANK_BATCH / GLOBAL_BATCH)')


def stated_rule(check: str, source: str) -> Rule:
    """The rule the script's text states: one top-level ``BATCH_RULE = "global"`` or ``"per_rank"``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        raise CheckFailed(check, "elastic.py is not valid Python", hint="run the script's cell and fix what "
                          "Python reports") from None
    values = []
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        if any(isinstance(t, ast.Name) and t.id == "BATCH_RULE" for t in targets):
            values.append(node.value)
    if not values:
        raise CheckFailed(check, "elastic.py does not state its batch rule: it has no top-level BATCH_RULE",
                          expected='BATCH_RULE = "global" or BATCH_RULE = "per_rank"', hint=RULE_HINT)
    said = {v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None for v in values}
    if len(values) > 1 or None in said or not said <= set(RULES):
        got = ", ".join(ast.unparse(v) for v in values)
        raise CheckFailed(check, f"elastic.py states its batch rule as {got}: the grader reads one string, "
                          '"global" or "per_rank", assigned once at the top level', got=f"BATCH_RULE = {got}",
                          expected='BATCH_RULE = "global" or BATCH_RULE = "per_rank"', hint=RULE_HINT)
    return RULES[said.pop()]


def plan(nodes: tuple[int, int, int], leave_step: int) -> torchrun.Plan:
    """The elastic story for these nodes (A, B, C workers) and B's departure, checked to keep every step of
    either rule inside one epoch (the epochs would not divide into whole steps otherwise)."""
    story = torchrun.Plan(tuple(int(n) for n in nodes), int(leave_step), HOLD_STEPS)  # type: ignore[arg-type]
    full, smaller, grown = story.sizes
    for rule in RULES.values():
        if any(GLOBAL_BATCH % size or rule.step_samples(size) % size for size in story.sizes):
            raise ValueError(f"{story}: world sizes {story.sizes} must divide GLOBAL_BATCH = {GLOBAL_BATCH}")
        before = [full] * story.leave_step + [smaller] * story.hold_steps
        if sum(map(rule.step_samples, before)) >= EPOCHS * SAMPLES:
            raise ValueError(f"{story}: the job would end before C joins under the {rule.name} rule")
        done = 0
        for size in before + [grown] * (EPOCHS * SAMPLES):
            n = rule.step_samples(size)
            if done // SAMPLES != (done + n - 1) // SAMPLES:
                raise ValueError(f"{story}: a step of the {rule.name} rule would cross an epoch's end")
            done += n
            if done >= EPOCHS * SAMPLES:
                break
    return story


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
    lrs: dict[int, list[list[float] | None]]  # rank -> per step: its optimizer's learning rates (per group)

    @property
    def world_size(self) -> int:
        return self.workers[0].world_size

    @property
    def nodes(self) -> str:
        return "+".join(sorted({torchrun.node(w) for w in self.workers}))

    def name(self) -> str:
        return f"the {self.world_size}-worker job (round {self.number}, nodes {self.nodes})"


@dataclass
class Story:
    """The elastic run as the checks read it: the rounds as the probe saw them (which samples, learning rates; the
    workers' own record, used as what a replay takes), and what the grader's process saw of CKPT (the evidence)."""

    run: torchrun.Run
    rule: Rule
    plan: torchrun.Plan
    rounds: list[Round]
    departed: Round | None = None  # the round node B left
    shrunk: Round | None = None  # the smaller round after it (A alone)
    grown: Round | None = None  # the round after that, A and C
    origin: dict[int, tuple[int, int] | None] = field(default_factory=dict)  # round -> (round, steps) it resumed from
    # the evidence, by round number: CKPT as the grader read (and shifted) it at the round's start, and the
    # snapshot after the round (the next round's start, or the job's end), the replay of the round's steps from
    # the state a load of the shifted CKPT gives (None: nothing to replay from), and after how many of its steps
    # that replay gives the weights the round left in CKPT
    start: dict[int, object] = field(default_factory=dict)
    end: dict[int, object] = field(default_factory=dict)
    replay: dict[int, list | None] = field(default_factory=dict)
    matched: dict[int, list[int]] = field(default_factory=dict)
    carried: dict[int, list | None] = field(default_factory=dict)  # the momentum the round before left (replayed)
    at_end: object = None  # CKPT when the job was over

    def verified(self, r: Round) -> bool:
        """Whether the weights ``r`` left in CKPT are a replay of its steps from where it started."""
        return bool(self.matched.get(r.number))


def _worker_batches(w: torchrun.Worker) -> list[list[int]]:
    index, batches, current = _index(), [], []
    for e in w.events:
        if e["event"] == "input":
            current += [index.get(tuple(row), -1) for row in e.get("rows") or []]
        elif e["event"] == "step":
            batches.append(current)
            current = []
    return batches


def worker_starts(w: torchrun.Worker) -> list[list]:
    """The first layer's [weight, bias] at the first forward after each optimizer step (and before the first)."""
    starts, fresh = [], True
    for e in w.events:
        if e["event"] == "input" and fresh:
            starts.append(e.get("weights") or [])
            fresh = False
        elif e["event"] == "step":
            fresh = True
    return starts


def _commit(e: dict, ckpt: str) -> bool:
    """Whether a probe event put CKPT in place (a move into it, or a save in place)."""
    return (e["event"] == "rename" and e.get("dst") == ckpt) or (e["event"] == "saved" and e.get("path") == ckpt)


def recorded_commits(r: Round, ckpt: str) -> int:
    """How many times rank 0's record says it put CKPT in place in round ``r``, from wherever (a move from a folder
    the probe does not watch has no sha256, and is not in ``r.commits``)."""
    return sum(_commit(e, ckpt) for w in r.workers if w.rank == 0 for e in w.events)


def _round(number: int, workers: list[torchrun.Worker], ckpt: str) -> Round:
    per_rank = [_worker_batches(w) for w in workers]
    starts = {w.rank: worker_starts(w) for w in workers}
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
            elif _commit(e, ckpt):
                if e.get("sha"):
                    commits.append((e["sha"], done))
    lrs = {w.rank: [e.get("lr") for e in w.of("step")] for w in workers}
    return Round(number, workers, [[b[i] for b in per_rank] for i in range(steps)], loaded, commits, starts, lrs)


def story_of(run: torchrun.Run, rule: Rule, story_plan: torchrun.Plan) -> Story:
    rounds = [_round(n, ws, run.ckpt_path) for n, ws in enumerate(torchrun.rounds(run))]
    story = Story(run, rule, story_plan, rounds)
    _, smaller, grown = story_plan.sizes
    for r in rounds:
        if story.departed is None and any(w.of("leave") for w in r.workers):
            story.departed = r
        elif story.departed and story.shrunk is None and r.world_size == smaller:
            story.shrunk = r
        elif story.shrunk and story.grown is None and r.world_size == grown:
            story.grown = r
    return story


def _refs_before(story: Story, r: Round) -> list[tuple[Round, int]]:
    """(round, step index) of each step that led to the weights round ``r`` started from, in order."""
    origin = story.origin.get(r.number)
    if origin is None:
        return []
    earlier = story.rounds[origin[0]]
    return _refs_before(story, earlier) + [(earlier, i) for i in range(min(origin[1], len(earlier.batches)))]


def refs_of(story: Story, r: Round) -> list[tuple[Round, int]]:
    """(round, step index) of each step that led to round ``r``'s weights, its own included, in order."""
    return _refs_before(story, r) + [(r, i) for i in range(len(r.batches))]


def chain(story: Story, r: Round) -> list[list[list[int]]]:
    """The steps (per rank: sample indices) that led to round ``r``'s weights: the steps before it, then its own."""
    return [rr.batches[i] for rr, i in refs_of(story, r)]


def steps_before(story: Story, r: Round) -> list[list[list[int]]]:
    return [rr.batches[i] for rr, i in _refs_before(story, r)]


def step_lr(story: Story, r: Round, i: int) -> float:
    """The learning rate step ``i`` of round ``r`` ran at (rank 0's first param group; the rule's if unread)."""
    lrs = r.lrs.get(min(r.lrs), []) if r.lrs else []
    got = lrs[i] if i < len(lrs) else None
    return float(got[0]) if got else story.rule.lr(r.world_size)


def chain_lrs(story: Story, r: Round) -> list[float]:
    """The learning rate of each step of :func:`chain`, as it ran."""
    return [step_lr(story, rr, i) for rr, i in refs_of(story, r)]


def epochs_of(story: Story, steps: list[list[list[int]]]) -> list[int]:
    """The epoch each step belongs to, counting the samples the stated rule gives a step at its world size
    (a step of the wrong size does not move the epochs after it)."""
    done, epochs = 0, []
    for per_rank in steps:
        epochs.append(done // SAMPLES)
        done += story.rule.step_samples(len(per_rank))
    return epochs


def rule_samples(story: Story, steps: list[list[list[int]]]) -> int:
    return sum(story.rule.step_samples(len(per_rank)) for per_rank in steps)
