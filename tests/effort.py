"""The work each part of an exercise notebook takes, estimated, and the points it is worth (the authoring guide's rule).

A part is a notebook's ``## Part N: ...`` section (or ``## The specification ...``; a notebook with neither is one
part: its introduction). Its minutes are a walk-through of the reference solution, done the same way for every part:

* reading its instructions: the words of its section at 100 words a minute;
* writing the answer: 1.5 minutes a line of the reference solution (non-blank, not a comment; where the student
  fixes given code, the lines the reference changes or adds);
* running its visible checks: a minute a test cell (a check run, its message read);
* understanding: 5 minutes for each idea the part needs that the student has not used in an earlier part
  (:data:`IDEAS`, named, so that a reviewer can disagree with one).

Its points: the minutes over 5, rounded (at least 1), spread over its test cells by what each judges. The checks
hold a part to the rule within a point, and its heading's "about N minutes" within 5 minutes, so that an edit of a
sentence does not move points.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 100
MINUTES_PER_LINE = 1.5
MINUTES_PER_CHECK = 1
MINUTES_PER_IDEA = 5
MINUTES_PER_POINT = 5

#: per notebook, per part in order: the ideas it needs that no earlier part of the notebook used
IDEAS: dict[str, list[list[str]]] = {
    "parallelism": [
        ["a rank's slice of a batch that does not divide evenly"],
        ["all-reducing gradients", "weighting each rank's mean by its share of the samples"],
        ["activations sent forward to the next stage", "their gradients sent back"],
        ["a column-split first layer and a row-split second", "one all-reduce of the partial outputs",
         "the gradients of split weights"],
    ],
    "pipeline": [
        ["micro-batches whose losses add up to the batch's", "a schedule as each stage's list of forwards and "
         "backwards", "the last stage's gradient of the loss for its output", "sends that do not wait for their "
         "receive (gloo's send waits)"],
        ["idle stage-steps: the bubble", "activations held from a forward to its backward"],
    ],
    "expert_parallel": [
        ["a capacity shared by every rank's tokens (the other ranks' counts)", "all-to-all with split sizes the "
         "ranks agree on", "collectives that carry gradients back", "tokens grouped by destination and put back in "
         "place"],
    ],
    "ddp_basics": [
        ["joining the job from rank and world size", "pinning this rank's device",
         "a second group with a backend of its own"],
        ["equal shares by padding", "a seeded shuffle per epoch that every rank shares"],
        ["the DDP wrap", "a summed objective under DDP's averaged gradients", "a new order every epoch (set_epoch)"],
        ["saving on rank 0 only", "a barrier so that no rank reads early",
         "every rank's generator state gathered to rank 0"],
    ],
    "ddp_from_scratch": [
        ["rank 0's weights everywhere", "averaging each gradient over the ranks after backward"],
        ["buckets by size in reverse parameter order", "a hook when a gradient is ready",
         "asynchronous all-reduces waited on before the step", "communication overlapped with backward"],
        ["the collectives of a step of DDP, ZeRO and FSDP2", "a ring's latency and bandwidth terms",
         "links within and across nodes"],
    ],
    "ddp_in_practice": [
        ["a result that is no sum: every rank's candidates gathered to every rank", "every sample evaluated once",
         "a share's positions mapped back to dataset indices"],
        ["no gradient sync until the last micro-batch", "weighting micro-batches of unequal sizes"],
        ["ranks with different numbers of batches (Join)", "what the shadow all-reduces do to the average"],
        ["loading onto this rank's device", "loading only after rank 0's save is done"],
        ["float16 autocast around the forward", "a loss scaled by a GradScaler, and a step it skips on every rank",
         "clipping the unscaled global gradient after the all-reduce", "no_sync with accumulation under autocast"],
    ],
    "debug_training": [
        ["a new shuffle every epoch", "a metric reduced over the ranks", "one writer saving the module's weights",
         "a barrier every rank reaches"],
    ],
    "sharded_optimizer": [
        ["the parameters flattened into one vector, in one order", "an even partition whose last share is shorter "
         "(padding to a common size)", "a reduction where each rank receives only its own share", "every rank's "
         "share gathered back into the whole vector", "micro-batch losses that add up to the step's",
         "a reduction per micro-batch, each rank keeping only its share"],
        ["the bytes per parameter of mixed-precision Adam", "which pieces each stage shards"],
    ],
    "activation_memory": [
        ["what each operation keeps for its backward", "a tensor saved twice counted once"],
        ["what is held at each moment of a backward with recomputation", "the cheapest choice of blocks that fits",
         "a checkpoint around a block"],
    ],
    "two_dimensions": [
        ["a group for every row and every column of the grid, made by every rank", "partial outputs summed along the "
         "tensor-parallel row, with the loss's gradient counted once", "gradients averaged along the data-parallel "
         "column"],
        ["a placement per mesh dimension: a replica or a slice of one dimension", "the elements each all-reduce "
         "carries"],
    ],
    "fsdp_checkpoint": [
        ["fully_shard per block, then the root", "units chosen for a memory budget"],
        ["an optimizer built after sharding", "param groups chosen by what a sharded parameter reports"],
        ["DCP's save and load of sharded state", "get_state_dict and set_state_dict",
         "a partial load: only the saved tensors that fit a changed model"],
        ["a full tensor gathered by a collective every rank calls", "work split among the ranks by bytes (a greedy "
         "balance)"],
        ["a mixed-precision policy", "clipping sharded gradients by the global norm"],
    ],
    "syncbn_sharding": [
        ["each rank's count, mean and variance", "combining them over the ranks",
         "running statistics with the unbiased variance", "the backward through the combined statistics"],
        ["what ZeRO shards", "FSDP2's padding and units", "bytes per dtype and state"],
        ["each rank saving its own partition", "putting the partitions together in one process"],
    ],
    "elastic": [
        ["joining a job of any size", "resuming from the checkpoint with the steps done",
         "the batch rule at a new world size", "the learning rate scaled with the global batch"],
    ],
    "find_the_hang": [
        ["a stall report read: which rank waits where", "a collective every rank must reach"],
        ["a collective skipped by the ranks with less data"],
        ["rank 0 reading what the others have not written yet"],
        ["collectives with tensors of different shapes"],
    ],
    "torchrun": [
        ["torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE)", "joining and leaving the process group",
         "the DDP wrap in a script", "an atomic checkpoint on rank 0", "resuming after a restart"],
    ],
}

#: notebooks whose answer is given code fixed: their lines are those the reference changes or adds
GIVEN_CODE = {"debug_training": ROOT / "exercises/ex2-ddp-basics/buggy_training.py"}

_SOLUTION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


@dataclass
class Part:
    title: str
    heading_cell: int  # index of the markdown cell with its heading (the first cell for a one-part notebook)
    words: int = 0
    solution: list[str] = field(default_factory=list)
    checks: list[tuple[str, float]] = field(default_factory=list)  # (grade_id, points) of its test cells
    ideas: list[str] = field(default_factory=list)
    lines: int = 0

    @property
    def minutes(self) -> float:
        return (self.words / WORDS_PER_MINUTE + MINUTES_PER_LINE * self.lines + MINUTES_PER_CHECK * len(self.checks)
                + MINUTES_PER_IDEA * len(self.ideas))

    @property
    def points(self) -> float:
        return sum(p for _, p in self.checks)

    @property
    def rule_points(self) -> int:
        return max(1, round(self.minutes / MINUTES_PER_POINT))


def _written(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not line.strip().startswith("#")]


def parts(path: Path) -> list[Part]:
    """The parts of the exercise notebook at ``path``, with what the estimate reads of each."""
    cells = nbformat.read(str(path), as_version=4).cells
    found: list[Part] = []
    current: Part | None = None
    headed = any(c.cell_type == "markdown" and re.search(r"^## (Part \d|The specification)", c.source, re.M)
                 for c in cells)
    if not headed:
        current = Part(title=cells[0].source.splitlines()[0].lstrip("# "), heading_cell=0)
        found.append(current)
    for index, cell in enumerate(cells):
        grading = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "markdown":
            heading = next((line for line in cell.source.splitlines() if line.startswith("## ")), None)
            if heading and re.match(r"## (Part \d|The specification)", heading):
                current = Part(title=heading[3:], heading_cell=index)
                found.append(current)
            elif heading:
                current = None  # "Before you submit" and the like: nobody's part
            if current is not None:
                current.words += len(re.findall(r"\w+", cell.source))
        elif current is not None:
            if grading.get("solution"):
                current.solution += [line for block in _SOLUTION.findall(cell.source) for line in block.splitlines()]
            if grading.get("grade") and not grading.get("solution"):
                current.checks.append((grading["grade_id"], float(grading["points"])))
    name = path.stem
    given = GIVEN_CODE.get(name)
    for part, ideas in zip(found, IDEAS.get(name, []), strict=False):
        part.ideas = ideas
    for part in found:
        written = _written(part.solution)
        if given is not None:
            diff = difflib.unified_diff(given.read_text().splitlines(), part.solution, lineterm="", n=0)
            written = _written([line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")])
        part.lines = len(written)
    return found

