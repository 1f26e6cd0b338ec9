"""Exercise 4's elastic part (elastic.ipynb): one elastic torchrun launch per script, read by both checks.

A launch costs about 20 s here (three agents, three rounds of workers), so every submission is graded
once, as a notebook, and each test asserts on both of its cells: the reference at full marks, each
realistic mistake losing exactly the checks it breaks with a message naming it, right scripts in other
styles at full marks. The fast tests keep the grader's copy of the given code and its replay honest.
"""

from __future__ import annotations

import time

import pytest
import submissions
import torch

import graders.ex4_elastic as ex4e

A = "ex4-torchrun"
NB = "elastic"
SCRIPT_CELL = "ex4e_elastic_script"
SHRINK, GROW = "ex4e_test_elastic_shrink", "ex4e_test_elastic_grow"
LAUNCH_TIMEOUT = 400  # one elastic launch on a loaded 2-core machine, with room to spare


def script_source() -> str:
    """elastic.py as the notebook's %%writefile cell writes it (solution included)."""
    text = submissions.answer(submissions.load(A, NB), SCRIPT_CELL)
    first, rest = text.split("\n", 1)
    assert first.strip() == "%%writefile elastic.py", first
    return "\n".join(line for line in rest.splitlines() if "### BEGIN SOLUTION" not in line
                     and "### END SOLUTION" not in line) + "\n"


def given() -> str:
    source = script_source()
    return source[:source.index("# ---- yours ----") + len("# ---- yours ----\n")]


def given_entry() -> str:
    """The given entry point after the student's part: it calls main(parse_args())."""
    source = script_source()
    return source[source.index("\n\n# ---- given: the entry point"):]


# --- fast: no launch ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_graders_copy_of_the_given_code_matches_the_notebook():
    namespace: dict = {}
    exec(compile(given(), "elastic.py", "exec"), namespace)
    for name in ("EPOCHS", "SAMPLES", "GLOBAL_BATCH", "LR", "MOMENTUM"):
        assert namespace[name] == getattr(ex4e, name), name
    mine, theirs = ex4e.make_model().state_dict(), namespace["make_model"]().state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(torch.equal(a, b) for a, b in zip(ex4e.make_dataset().tensors, namespace["make_dataset"]().tensors))
    optimizer = namespace["make_optimizer"](namespace["make_model"]())
    assert optimizer.defaults["lr"] == ex4e.LR and optimizer.defaults["momentum"] == ex4e.MOMENTUM
    assert ex4e.SAMPLES % ex4e.GLOBAL_BATCH == 0 and ex4e.GLOBAL_BATCH % 2 == 0 and ex4e.GLOBAL_BATCH % 3 == 0


@pytest.mark.timeout(60)
def test_the_replay_is_sgd_with_momentum_on_the_average_of_the_ranks_mean_losses():
    """_replay's hand-written update equals torch.optim.SGD on DDP's loss (the mean over ranks of each rank's
    mean loss), with unequal per-rank parts too."""
    steps = [[[0, 1, 2], [3, 4, 5]], [[6, 7], [8, 9], [10, 11]], [[12, 13, 14, 15], [16, 17]]]
    x, y = ex4e.make_dataset().tensors
    model = ex4e.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex4e.LR, momentum=ex4e.MOMENTUM)
    for per_rank in steps:
        loss = sum(torch.nn.functional.mse_loss(model(x[p]), y[p]) for p in per_rank) / len(per_rank)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    replay = ex4e._replay(steps)
    assert all(torch.allclose(replay[k], v, atol=1e-7) for k, v in model.state_dict().items())
    assert not torch.allclose(ex4e._replay(steps[:2])["0.weight"], replay["0.weight"])


# --- the notebook: reference, untouched release, wrong submissions, other styles --------------------


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_reference_solution_scores_full_marks():
    start = time.monotonic()
    report = submissions.assert_reference_full_marks(A, NB)
    assert report.max_score == 4
    print(f"graded the reference elastic notebook in {time.monotonic() - start:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_release_scores_zero_at_once_with_clean_messages(tmp_path):
    start = time.monotonic()
    submissions.assert_untouched_scores_zero(A, tmp_path, NB)
    assert time.monotonic() - start < 60  # no launch for a script that cannot run


WRONG = {
    # name: ((old, new) edits of elastic.py, the test cells that must fail, words the first one's message has)
    "world size hard-coded to the first round's 3": (
        [("    rank, world_size, device = join_job()", "    rank, world_size, device = join_job()\n    world_size = 3")],
        [SHRINK], ["carried 4 samples in all", "not GLOBAL_BATCH = 6", "a number fixed for 3 workers"]),
    "a fixed per-rank batch: the global batch shrinks with the job": (
        [("    return batch.chunk(world_size)[rank]\n",
          "    per_rank = GLOBAL_BATCH // 3  # 2 samples a rank\n"
          "    start = step * GLOBAL_BATCH + rank * per_rank\n"
          "    return order[start:start + per_rank]\n")],
        [SHRINK], ["carried 4 samples in all", "global batch must not change with the world size"]),
    "the epoch resumed from its start": (
        [('        done = saved["done"]\n', '        done = saved["done"] // STEPS_PER_EPOCH * STEPS_PER_EPOCH\n')],
        [SHRINK, GROW], ["twice in epoch 0", "you resumed the epoch from its start"]),
    "no resume at all": (
        [("    if os.path.exists(args.ckpt):", "    if False:")],
        [SHRINK, GROW], ["did not resume: no worker loaded CKPT"]),
    "resume only when TORCHELASTIC_RESTART_COUNT > 0": (
        [("    if os.path.exists(args.ckpt):",
          '    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0 and os.path.exists(args.ckpt):')],
        [GROW], ["did not load the checkpoint while the others did", "TORCHELASTIC_RESTART_COUNT=0"]),
}


#: mistakes graded in one submission (each grade is an elastic launch of about a minute here): they edit
#: different lines and fail disjoint checks, so the submission loses exactly the union
GRADED_TOGETHER = [
    ("world size hard-coded to the first round's 3", "resume only when TORCHELASTIC_RESTART_COUNT > 0"),
    ("a fixed per-rank batch: the global batch shrinks with the job",),
    ("the epoch resumed from its start",),
    ("no resume at all",),
]


def test_the_mistakes_graded_together_are_independent():
    submissions.disjoint_mistakes(GRADED_TOGETHER, WRONG)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("group", GRADED_TOGETHER, ids=" + ".join)
def test_wrong_submission_loses_exactly_its_tests(tmp_path, group):
    submissions.grade_mistakes(A, tmp_path, SCRIPT_CELL, WRONG, group, notebook=NB)


#: pytorch/examples' style: a Trainer class, DistributedSampler(shuffle=True) with set_epoch (its shards of one
#: epoch's permutation make every step the same GLOBAL_BATCH samples at any world size dividing it), a
#: DataLoader over the shard that skips the steps already done, a checkpoint holding (epoch, step).
SAMPLER_TRAINER = '''
import os

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, out_dir, snapshot_path):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.out_dir, self.snapshot_path = out_dir, snapshot_path
        self.model = make_model()
        self.optimizer = make_optimizer(self.model)
        self.epoch, self.step = 0, 0
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, map_location="cpu")
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
            self.epoch, self.step = snapshot["EPOCH"], snapshot["STEP"]
        self.ddp = DDP(self.model)
        self.dataset = make_dataset()

    def _save_snapshot(self):
        snapshot = {"MODEL_STATE": self.model.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCH": self.epoch, "STEP": self.step}
        torch.save(snapshot, self.snapshot_path + ".part")
        os.replace(self.snapshot_path + ".part", self.snapshot_path)

    def train(self):
        per_rank = GLOBAL_BATCH // self.world_size
        steps = SAMPLES // GLOBAL_BATCH
        while self.epoch < EPOCHS:
            sampler = DistributedSampler(self.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True)
            sampler.set_epoch(self.epoch)
            shard = list(sampler)[self.step * per_rank:]
            for source, targets in DataLoader(Subset(self.dataset, shard), batch_size=per_rank):
                self.optimizer.zero_grad()
                loss_fn(self.ddp(source), targets).backward()
                self.optimizer.step()
                self.step += 1
                if self.step == steps:
                    self.epoch, self.step = self.epoch + 1, 0
                if self.rank == 0:
                    self._save_snapshot()
            if self.step:  # an epoch cut short cannot happen: the shard holds exactly the rest of it
                raise RuntimeError("epoch not finished")
        if self.rank == 0:
            torch.save(self.model.state_dict(), os.path.join(self.out_dir, "final.pt"))


def main(args):
    dist.init_process_group("gloo")
    Trainer(args.out, args.ckpt).train()
    dist.destroy_process_group()
'''

#: A functional style: pathlib, a NamedTemporaryFile in the checkpoint's folder, numpy's permutation of the epoch,
#: the position kept as samples seen in the epoch, strided per-rank parts, the device picked by local rank.
STRIDED_NUMPY = '''
import os
import pathlib
import tempfile

import numpy as np
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def load_state(path, model, optimizer):
    if not path.exists():
        return 0, 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return state["epoch"], state["seen"]


def store_state(path, model, optimizer, epoch, seen):
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as fh:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": epoch, "seen": seen}, fh)
    os.replace(fh.name, path)


def run(out, ckpt):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo")
    x, y = make_dataset().tensors
    model = make_model()
    optimizer = make_optimizer(model)
    epoch, seen = load_state(ckpt, model, optimizer)
    ddp_model = DistributedDataParallel(model)
    while epoch < EPOCHS:
        order = np.random.RandomState(100 + epoch).permutation(SAMPLES)
        while seen < SAMPLES:
            part = torch.as_tensor(order[seen:seen + GLOBAL_BATCH][rank::world_size])
            optimizer.zero_grad()
            loss_fn(ddp_model(x[part]), y[part]).backward()
            optimizer.step()
            seen += GLOBAL_BATCH
            if seen == SAMPLES:
                epoch, seen = epoch + 1, 0
                if rank == 0:
                    store_state(ckpt, model, optimizer, epoch, seen)
                break
            if rank == 0:
                store_state(ckpt, model, optimizer, epoch, seen)
    if rank == 0:
        torch.save(model.state_dict(), out / "final.pt")
    dist.destroy_process_group()


def main(args):
    run(pathlib.Path(args.out), pathlib.Path(args.ckpt))
'''


def other_style(body: str) -> str:
    return "%%writefile elastic.py\n" + given() + body.strip("\n") + "\n" + given_entry()


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("body", [SAMPLER_TRAINER, STRIDED_NUMPY], ids=["sampler-trainer", "strided-numpy"])
def test_a_right_script_in_another_style_scores_full_marks(tmp_path, body):
    nb = submissions.replace_answer(submissions.load(A, NB), SCRIPT_CELL, other_style(body))
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    assert submissions.scores(report) == submissions.full_marks(A, NB), submissions.messages(report)


@pytest.mark.timeout(60)
def test_the_probe_names_a_pathlib_path_whole_not_by_its_last_part(tmp_path):
    """A pathlib.Path has a .name (its last part): torch.save(state, Path(...)) must be logged at its full path."""
    import io
    import pathlib

    from course.launcher.torchrun.torchrun_probe import _path

    target = tmp_path / "ckpt" / "ckpt.pt"
    assert _path(pathlib.Path(target)) == str(target)
    assert _path(str(target).encode()) == str(target)
    with open(tmp_path / "f.bin", "wb") as fh:
        assert _path(fh) == str(tmp_path / "f.bin")
    assert _path(io.BytesIO()) is None
