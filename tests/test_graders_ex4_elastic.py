"""Exercise 4's elastic part (elastic.ipynb): one elastic torchrun launch per script, read by both checks.

A launch costs about 20 s here (three agents, three rounds of workers), so every submission is graded
once, as a notebook, and each test asserts on both of its cells: the reference at full marks, each
realistic mistake losing exactly the checks it breaks with a message naming it, right scripts in other
styles (both batch rules) at full marks. Graded as a notebook, the cells run with their hidden arguments:
the hidden story (nodes 1, 2, 1: world sizes 3, 1, 2); one test runs the visible story (3, 2, 3) on the
reference. The fast tests keep the grader's copy of the given code, the rule it reads, its stories and
its replay honest.
"""

from __future__ import annotations

import ast
import re
import time

import pytest
import submissions
import torch

import graders.elastic.checks as ex4e

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
    for name in ("EPOCHS", "SAMPLES", "GLOBAL_BATCH", "PER_RANK_BATCH", "LR", "MOMENTUM"):
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


@pytest.mark.timeout(60)
def test_the_replay_takes_each_steps_learning_rate_as_sgd_does_after_a_change_of_lr():
    """A job that changes the lr between steps (the per-rank rule at a new world size): torch's SGD keeps the
    momentum buffer free of the lr, and so does the replay."""
    steps, lrs = [[[0, 1], [2, 3], [4, 5]], [[6, 7]], [[8, 9], [10, 11]]], [0.05, 0.05 / 3, 0.05 * 2 / 3]
    x, y = ex4e.make_dataset().tensors
    model = ex4e.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex4e.LR, momentum=ex4e.MOMENTUM)
    for per_rank, lr in zip(steps, lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = sum(torch.nn.functional.mse_loss(model(x[p]), y[p]) for p in per_rank) / len(per_rank)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    replay = ex4e._replay(steps, lrs)
    assert all(torch.allclose(replay[k], v, atol=1e-7) for k, v in model.state_dict().items())
    assert not torch.allclose(ex4e._replay(steps)["0.weight"], replay["0.weight"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line, rule", [('BATCH_RULE = "global"', "global"), ("BATCH_RULE = 'per_rank'", "per_rank"),
                                        ('BATCH_RULE: str = "per_rank"  # mine', "per_rank")])
def test_the_stated_rule_is_read_from_the_scripts_text(line, rule):
    assert ex4e.stated_rule("c", given() + line + "\n\ndef main(args):\n    pass\n" + given_entry()).name == rule


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body, words", [
    ("", ["does not state its batch rule", 'BATCH_RULE = "global"']),
    ('BATCH_RULE = "fixed"\n', ["states its batch rule as 'fixed'", "per_rank"]),
    ('BATCH_RULE = "global"\nBATCH_RULE = "per_rank"\n', ["'global', 'per_rank'", "assigned once"]),
    ('BATCH_RULE = "per" + "_rank"\n', ["'per' + '_rank'", "one string"]),
    ('def main(args):\n    BATCH_RULE = "global"\n', ["does not state its batch rule"]),
], ids=["missing", "unknown", "twice", "computed", "inside-main"])
def test_a_rule_not_stated_plainly_fails_both_checks_before_any_launch(tmp_path, body, words):
    script = tmp_path / "elastic.py"
    script.write_text(given() + body + "\n\ndef main(args):\n    pass\n" + given_entry())
    start = time.monotonic()
    for check in (ex4e.check_elastic_shrink, ex4e.check_elastic_grow):
        submissions.fails(check, str(script), *words)
    assert time.monotonic() - start < 5  # read from the text: nothing launched


@pytest.mark.timeout(60)
def test_the_stories_keep_every_step_of_both_rules_inside_an_epoch():
    visible, hidden = ex4e.plan((2, 1, 1), 2), ex4e.plan(ex4e.HIDDEN_NODES, ex4e.HIDDEN_LEAVE_STEP)
    assert visible.sizes == (3, 2, 3) and hidden.sizes == (3, 1, 2)
    with pytest.raises(ValueError, match="cross an epoch"):
        ex4e.plan((1, 1, 1), 2)  # per-rank: 2 steps of 4 + 3 of 2 = 14 samples, then steps of 4 cross 24
    with pytest.raises(ValueError, match="divide GLOBAL_BATCH"):
        ex4e.plan((2, 2, 1), 1)  # world size 4


@pytest.mark.timeout(60)
def test_the_notebooks_hidden_arguments_are_the_hidden_story():
    """Both test cells pass the hidden story in their hidden block, as arguments of the visible call (the
    autograder judges that launch instead of the visible one: one launch per grade)."""
    nb = submissions.load(A, NB)
    for grade_id in (SHRINK, GROW):
        source = next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
        hidden = source.split("### BEGIN HIDDEN TESTS", 1)[1].split("### END HIDDEN TESTS")[0]
        call = ast.parse(source).body[0].value
        assert {k.arg: ast.literal_eval(k.value) for k in call.keywords} == {
            "nodes": ex4e.HIDDEN_NODES, "leave_step": ex4e.HIDDEN_LEAVE_STEP}
        assert re.search(r"nodes=\(1, 2, 1\)", hidden) and "leave_step=1" in hidden
    # what a student's self-check says of them: one hidden variant a cell (one call with hidden arguments)
    from course.student.workspace import hidden_variants

    assert hidden_variants(nb) == {SHRINK: 1, GROW: 1}


# --- the notebook: reference, untouched release, wrong submissions, other styles --------------------


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_reference_solution_scores_full_marks():
    start = time.monotonic()
    report = submissions.assert_reference_full_marks(A, NB)
    assert report.max_score == 15
    print(f"graded the reference elastic notebook in {time.monotonic() - start:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_release_scores_zero_at_once_with_clean_messages(tmp_path):
    start = time.monotonic()
    submissions.assert_untouched_scores_zero(A, tmp_path, NB)
    assert time.monotonic() - start < 60  # no launch for a script that cannot run


#: Graded as a notebook, so on the hidden story (world sizes 3, then 1, then 2): a mistake that shows at every
#: size other than the first job's loses both cells there (on the visible story, 3 -> 2 -> 3, only the shrink).
WRONG = {
    # name: ((old, new) edits of elastic.py, the test cells that must fail, words the first one's message has)
    "world size hard-coded to the first round's 3": (
        [("    rank, world_size, device = join_job()", "    rank, world_size, device = join_job()\n    world_size = 3")],
        [SHRINK, GROW], ["carried 2 samples in all", 'not what your rule (BATCH_RULE = "global") makes at world size 1',
                         "6 samples per step at every world size", "a number fixed for the first job's size"]),
    "a fixed per-rank batch under the global rule: the global batch shrinks with the job": (
        [("    return batch.chunk(world_size)[rank]\n",
          "    per_rank = GLOBAL_BATCH // 3  # 2 samples a rank\n"
          "    start = step * GLOBAL_BATCH + rank * per_rank\n"
          "    return order[start:start + per_rank]\n")],
        [SHRINK, GROW], ["carried 2 samples in all", "global batch must not change with the world size",
                         'BATCH_RULE = "per_rank"']),
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
    # the joining node loads the weights and the position, not the optimizer state: its momentum starts afresh, its
    # weights drift from the others' after its first step, and the averaged gradients with them
    "the joining node keeps a fresh optimizer": (
        [('        optimizer.load_state_dict(saved["optimizer"])\n',
          '        if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":\n'
          '            optimizer.load_state_dict(saved["optimizer"])\n')],
        [GROW], ["the grown job", "node C", "not those of its steps from CKPT", "the optimizer state"]),
    "the per-rank rule stated over a fixed global batch": (
        [('BATCH_RULE = "global"', 'BATCH_RULE = "per_rank"')],
        [SHRINK, GROW], ["carried 6 samples in all", 'your rule (BATCH_RULE = "per_rank")',
                         "PER_RANK_BATCH = 2 samples per rank", 'state BATCH_RULE = "global"']),
}


#: each mistake alone: on the hidden story they fail both cells but one, which edits the same text as another
GRADED_TOGETHER = [(name,) for name in WRONG]


def could_share_a_grade(a: str, b: str) -> bool:
    """Whether two mistakes could be graded in one submission: they fail no common cell and edit different text."""
    (edits_a, cells_a, _), (edits_b, cells_b, _) = WRONG[a], WRONG[b]
    olds_a, olds_b = [old for old, _ in edits_a], [old for old, _ in edits_b]
    return not set(cells_a) & set(cells_b) and not any(x in y or y in x for x in olds_a for y in olds_b)


def test_each_mistake_is_graded_alone_because_no_two_could_share_a_grade():
    """Every mistake is graded once, and in a launch of its own only because no other could join it: a mistake
    that fails other cells than another, editing other text, must be graded with it (a launch saved)."""
    submissions.disjoint_mistakes(GRADED_TOGETHER, WRONG)
    alone = [group[0] for group in GRADED_TOGETHER if len(group) == 1]
    joinable = [(a, b) for i, a in enumerate(alone) for b in alone[i + 1:] if could_share_a_grade(a, b)]
    assert joinable == [], f"grade these together: {joinable}"
    assert could_share_a_grade("no resume at all", "the epoch resumed from its start") is False  # a common cell


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("group", GRADED_TOGETHER, ids=" + ".join)
def test_wrong_submission_loses_exactly_its_tests(tmp_path, group):
    submissions.grade_mistakes(A, tmp_path, SCRIPT_CELL, WRONG, group, notebook=NB)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_the_visible_story_gives_the_reference_full_marks(tmp_path):
    """The visible test cells' own launch (world sizes 3, 2, 3): the reference passes both checks there."""
    script = tmp_path / "elastic.py"
    script.write_text(script_source())
    ex4e.check_elastic_shrink(str(script))
    ex4e.check_elastic_grow(str(script))
    run = ex4e.try_elastic(str(script))
    assert run.ok and "nodes A (2 workers) and B (1 worker)" in run.command


#: pytorch/examples' style: a Trainer class, DistributedSampler(shuffle=True) with set_epoch (its shards of one
#: epoch's permutation make every step the same GLOBAL_BATCH samples at any world size dividing it), a
#: DataLoader over the shard that skips the steps already done, a checkpoint holding (epoch, step).
SAMPLER_TRAINER = '''
import os

BATCH_RULE = "global"

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

BATCH_RULE = 'global'  # a fixed global batch
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


#: The other rule: a fixed per-rank batch (PER_RANK_BATCH a worker), the learning rate scaled with the global batch
#: after the optimizer state is restored, an epoch counted in samples; DistributedSampler(shuffle=False) over the
#: epoch's remaining samples and a DataLoader of PER_RANK_BATCH give step j the next world_size * PER_RANK_BATCH;
#: a small state class.
PER_RANK_SAMPLER = '''
BATCH_RULE: str = "per_rank"

from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class Progress:
    """The epoch and the samples of it done: what a job of any size needs to go on."""

    def __init__(self, path):
        self.path, self.epoch, self.seen = path, 0, 0

    def restore(self, model, optimizer):
        if os.path.exists(self.path):
            blob = torch.load(self.path, map_location="cpu")
            model.load_state_dict(blob["model"])
            optimizer.load_state_dict(blob["optimizer"])
            self.epoch, self.seen = blob["epoch"], blob["seen"]

    def commit(self, model, optimizer):
        save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": self.epoch, "seen": self.seen}, self.path)


def main(args):
    rank, world_size, device = join_job()
    model, optimizer = make_model_and_optimizer(device)
    progress = Progress(args.ckpt)
    progress.restore(model, optimizer)
    for group in optimizer.param_groups:  # after the restore: the checkpoint holds the last job's lr
        group["lr"] = LR * world_size * PER_RANK_BATCH / GLOBAL_BATCH
    ddp_model = DistributedDataParallel(model)
    dataset = make_dataset()
    while progress.epoch < EPOCHS:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + progress.epoch)).tolist()
        rest = Subset(dataset, order[progress.seen:])
        sampler = DistributedSampler(rest, num_replicas=world_size, rank=rank, shuffle=False)
        for x, y in DataLoader(rest, batch_size=PER_RANK_BATCH, sampler=sampler):
            optimizer.zero_grad()
            loss_fn(ddp_model(x.to(device)), y.to(device)).backward()
            optimizer.step()
            progress.seen += world_size * PER_RANK_BATCH
            if progress.seen >= SAMPLES:
                progress.epoch, progress.seen = progress.epoch + 1, 0
            if rank == 0:
                progress.commit(model, optimizer)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()
'''

#: realistic mistakes under the per-rank rule (edits of PER_RANK_SAMPLER): each loses both cells on the hidden story
#: (the smaller job and the grown one run at other world sizes than the first job, whose lr is LR)
PER_RANK_WRONG = {
    "the learning rate not scaled with the global batch": (
        [('    for group in optimizer.param_groups:  # after the restore: the checkpoint holds the last job\'s lr\n'
          '        group["lr"] = LR * world_size * PER_RANK_BATCH / GLOBAL_BATCH\n', "")],
        [SHRINK, GROW], ["ran at learning rate 0.05 (rank 0)", 'your rule (BATCH_RULE = "per_rank")',
                         "LR * 2 / 6 = 0.0166667", "set every param group's lr"]),
    "the scaled learning rate set before loading the optimizer state (the checkpoint's lr wins)": (
        [("    progress.restore(model, optimizer)\n", ""),
         ("    ddp_model = DistributedDataParallel(model)\n",
          "    progress.restore(model, optimizer)\n    ddp_model = DistributedDataParallel(model)\n")],
        [SHRINK, GROW], ["ran at learning rate 0.05 (rank 0)", "at world size 1",
                         "after loading the optimizer's state dict"]),
}


def other_style(body: str) -> str:
    return "%%writefile elastic.py\n" + given() + body.strip("\n") + "\n" + given_entry()


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("body", ["SAMPLER_TRAINER", "STRIDED_NUMPY", "PER_RANK_SAMPLER", "WRAPPED_LAYOUT"],
                         ids=["sampler-trainer", "strided-numpy", "per-rank-sampler", "wrapped-layout"])
def test_a_right_script_in_another_style_scores_full_marks(tmp_path, body):
    body = globals()[body]
    nb = submissions.replace_answer(submissions.load(A, NB), SCRIPT_CELL, other_style(body))
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    assert submissions.scores(report) == submissions.full_marks(A, NB), submissions.messages(report)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("name", list(PER_RANK_WRONG))
def test_a_per_rank_script_with_a_learning_rate_mistake_loses_exactly_its_tests(tmp_path, name):
    edits, failing, words = PER_RANK_WRONG[name]
    text = other_style(PER_RANK_SAMPLER)
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    nb = submissions.replace_answer(submissions.load(A, NB), SCRIPT_CELL, text)
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    submissions.assert_loses_exactly(report, A, failing, words, notebook=NB)


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


# --- forgeries (issue 37): a student who read graders/ forges what the probe in its own process records ----------

#: helpers every forgery below adds to its script: the probe's events file of this worker rewritten (it is named in
#: the worker's environment), and the job's weights recomputed by hand with no module call and no optimizer step
#: (nothing the probe sees), for the reference's global-batch order
FORGE_HELPERS = '''
import json as _json


def _rewrite_events(rows_of_step=None, lr_now=None):
    """This worker's probe record, rewritten: each step's input rows as rows_of_step(k) gives, without the weights
    the layer had (so no start is judged); every step's learning rate lr_now."""
    path = os.path.join(os.environ["DDP_COURSE_PROBE_DIR"], f"events-{os.getpid()}.jsonl")
    with open(path) as fh:
        lines = fh.read().splitlines()
    out, k = [], 0
    for line in lines:
        try:
            e = _json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "input":
            e.pop("weights", None)
            if rows_of_step is not None and rows_of_step(k) is not None:
                e["rows"] = rows_of_step(k)
        elif e.get("event") == "step":
            if lr_now is not None:
                e["lr"] = [lr_now]
            k += 1
        out.append(_json.dumps(e))
    with open(path, "w") as fh:
        fh.write("\\n".join(out) + "\\n")


def _replayed(done, device):
    """The weights and SGD momentum after the job's first `done` steps, recomputed here by hand (functional)."""
    params = [p.detach().clone().requires_grad_() for p in make_model().parameters()]
    x, y = make_dataset().tensors
    bufs = [None] * len(params)
    for d in range(done):
        idx = samples_of(0, 1, d)
        w1, b1, w2, b2 = params
        out = torch.tanh(x[idx] @ w1.T + b1) @ w2.T + b2
        grads = torch.autograd.grad(((out - y[idx]) ** 2).mean(), params)
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                bufs[i] = g.clone() if bufs[i] is None else bufs[i].mul_(MOMENTUM).add_(g)
                p.sub_(LR * bufs[i])
    return [p.detach().to(device) for p in params], [b.to(device) for b in bufs]


def _load_by_hand(model, optimizer, done, device):
    params, bufs = _replayed(done, device)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    for p, buf in zip(model.parameters(), bufs):
        optimizer.state[p]["momentum_buffer"] = buf.clone()
'''

#: the reference's resume, as the forgeries below edit it
RESUME = '''        saved = torch.load(args.ckpt, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        done = saved["done"]
'''
SAVE = '''{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "done": done}'''
SAVE_WS = '''{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "done": done, "ws": world_size}'''


def forged(edits: list[tuple[str, str]], base: str | None = None) -> str:
    text = script_source() if base is None else base
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    at = text.index("\n\ndef main(args):")
    return text[:at] + "\n" + FORGE_HELPERS + text[at:]


#: name: (script, the check it targets, words its failure has). Each scored full marks on its target before the
#: checks judged the weights the launcher read (verified at the time: see the commit message); the other check
#: keeps the reference's points.
FORGERIES = {
    # the smaller job restarts its epoch (trains samples already trained) and rewrites its probe record to show the
    # epoch's remaining samples, without the layer's weights
    "smaller job restarts the epoch, its events rewritten to the right rows": (lambda: forged([
        (SAVE, SAVE_WS),
        ("        done = saved[\"done\"]\n", "        done = saved[\"done\"]\n"
         "        smaller = world_size < saved[\"ws\"]\n        first = done\n"),
        ("    done = 0  # optimizer steps", "    smaller, first = False, 0\n    done = 0  # optimizer steps"),
        ("    while done < EPOCHS * STEPS_PER_EPOCH:\n"
         "        train_step(ddp_model, optimizer, samples_of(rank, world_size, done), device)\n",
         "    right = []\n"
         "    x = make_dataset().tensors[0]\n"
         "    if smaller:\n"
         "        model.register_forward_hook(lambda *_: _rewrite_events(\n"
         "            lambda k: x[right[k]].tolist() if k < len(right) else None))\n"
         "    while done < EPOCHS * STEPS_PER_EPOCH:\n"
         "        right.append(samples_of(rank, world_size, done))\n"
         "        at = done - first % STEPS_PER_EPOCH if smaller else done  # the epoch from its start\n"
         "        train_step(ddp_model, optimizer, samples_of(rank, world_size, at), device)\n"),
    ]), SHRINK, ["the smaller", "weights"]),
    # the smaller job reads only the step count and recomputes the weights and momentum by hand
    "smaller job replays the steps by hand instead of loading": (lambda: forged([
        (SAVE, SAVE_WS),
        ("        model.load_state_dict(saved[\"model\"])\n        optimizer.load_state_dict(saved[\"optimizer\"])\n",
         "        if world_size < saved[\"ws\"]:\n"
         "            _load_by_hand(model, optimizer, saved[\"done\"], device)\n"
         "        else:\n"
         "            model.load_state_dict(saved[\"model\"])\n"
         "            optimizer.load_state_dict(saved[\"optimizer\"])\n"),
    ]), SHRINK, ["recomputed", "grader changed"]),
    # the joining node (its restart count is 0) recomputes the weights and momentum by hand
    "joining node replays the steps by hand instead of loading": (lambda: forged([
        ("        model.load_state_dict(saved[\"model\"])\n        optimizer.load_state_dict(saved[\"optimizer\"])\n",
         "        if os.environ[\"TORCHELASTIC_RESTART_COUNT\"] == \"0\":\n"
         "            _load_by_hand(model, optimizer, saved[\"done\"], device)\n"
         "        else:\n"
         "            model.load_state_dict(saved[\"model\"])\n"
         "            optimizer.load_state_dict(saved[\"optimizer\"])\n"),
    ]), GROW, ["node C", "weights"]),
}

FORGERIES["grown job one step behind, its events rewritten to the right rows"] = (
    # the grown job (a joining node's workers too) trains one step behind (its first step repeats the smaller job's
    # last samples, and the job's last samples are never trained) and rewrites its probe record to show the right
    # rows, without the layer's weights
    lambda: forged([
        (SAVE, SAVE_WS),
        ("        done = saved[\"done\"]\n", "        done = saved[\"done\"]\n"
         "        grown = world_size > saved[\"ws\"]\n        first = done\n"),
        ("    done = 0  # optimizer steps", "    grown, first = False, 0\n    done = 0  # optimizer steps"),
        ("    while done < EPOCHS * STEPS_PER_EPOCH:\n"
         "        train_step(ddp_model, optimizer, samples_of(rank, world_size, done), device)\n",
         "    right = []\n"
         "    x = make_dataset().tensors[0]\n"
         "    if grown:\n"
         "        model.register_forward_hook(lambda *_: _rewrite_events(\n"
         "            lambda k: x[right[k]].tolist() if k < len(right) else None))\n"
         "    while done < EPOCHS * STEPS_PER_EPOCH:\n"
         "        right.append(samples_of(rank, world_size, done))\n"
         "        at = done - 1 if grown else done  # one step behind: the smaller job's last samples again\n"
         "        train_step(ddp_model, optimizer, samples_of(rank, world_size, at), device)\n"),
    ]), GROW, ["grown job", "weights"])

FORGERIES["smaller job keeps the first job's learning rate, its events rewritten to the scaled one"] = (
    # the per-rank rule: the smaller job does not scale its learning rate, and rewrites every step's lr in its
    # probe record to the scaled one (and drops the layer's weights there)
    lambda: forged([
        ('            self.epoch, self.seen = blob["epoch"], blob["seen"]\n',
         '            self.epoch, self.seen = blob["epoch"], blob["seen"]\n            self.ws = blob["ws"]\n'),
        ('        self.path, self.epoch, self.seen = path, 0, 0\n',
         '        self.path, self.epoch, self.seen, self.ws = path, 0, 0, 0\n'),
        ('                         "epoch": self.epoch, "seen": self.seen}, self.path)\n',
         '                         "epoch": self.epoch, "seen": self.seen, "ws": self.world_size}, self.path)\n'),
        ("    progress = Progress(args.ckpt)\n", "    progress = Progress(args.ckpt)\n    progress.world_size = world_size\n"),
        ('    for group in optimizer.param_groups:  # after the restore: the checkpoint holds the last job\'s lr\n'
         '        group["lr"] = LR * world_size * PER_RANK_BATCH / GLOBAL_BATCH\n',
         '    scaled = LR * world_size * PER_RANK_BATCH / GLOBAL_BATCH\n'
         '    if world_size < progress.ws:\n'
         '        model.register_forward_hook(lambda *_: _rewrite_events(lr_now=scaled))\n'
         '    else:\n'
         '        for group in optimizer.param_groups:\n'
         '            group["lr"] = scaled\n'),
        ("            optimizer.step()\n",
         "            optimizer.step()\n            if world_size < progress.ws:\n"
         "                _rewrite_events(lr_now=scaled)\n"),
    ], base=given() + PER_RANK_SAMPLER.strip("\n") + "\n" + given_entry()),
    SHRINK, ["the smaller", "learning rate"])


def forgery_script(tmp_path, name: str) -> str:
    script = tmp_path / "elastic.py"
    script.write_text(FORGERIES[name][0]())
    return str(script)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forgery_of_what_the_probe_records_scores_zero_on_its_target(tmp_path, name):
    """Each forgery passed its target check when the checks judged the probe's record (verified then: the commit
    that added these tests says so); the grader's own snapshots of CKPT and its secret change to it fail it now,
    and the other check keeps its points (the forgery is right there). The hidden story, as the autograder runs."""
    _, target, words = FORGERIES[name]
    script = forgery_script(tmp_path, name)
    story = dict(nodes=ex4e.HIDDEN_NODES, leave_step=ex4e.HIDDEN_LEAVE_STEP)
    checks = {SHRINK: ex4e.check_elastic_shrink, GROW: ex4e.check_elastic_grow}
    submissions.fails(checks[target], script, *words, **story)
    for cell, check in checks.items():
        if cell != target:
            check(script, **story)


#: rank 0 saves only where the launch's settings (in every worker's environment) say the size will change: after
#: the step B leaves after, after the step the smaller job is held after, and after the last step
SAVES_ONLY_BEFORE_CHANGES = [
    ("    done = 0  # optimizer steps", "    leave = int(os.environ['DDP_COURSE_PROBE_LEAVE'].split(':')[1])\n"
     "    held_size, held_steps = map(int, os.environ['DDP_COURSE_PROBE_HOLD'].split(':'))\n"
     "    done = 0  # optimizer steps"),
    ("    ddp_model = DDP(", "    start = done\n    ddp_model = DDP("),
    ("        if rank == 0:\n            save_atomically(",
     "        if rank == 0 and (done == leave or (world_size == held_size and done - start == held_steps)\n"
     "                          or done == EPOCHS * STEPS_PER_EPOCH):\n            save_atomically("),
]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_script_that_saves_only_before_the_changes_it_reads_from_the_environment_loses_both_cells(tmp_path):
    """The launch's plan is in the workers' environment (the probe needs it); a script that reads it and saves only
    just before each change of size leaves the right weights wherever the grader looks, but not a checkpoint after
    every step: the kernel's count of CKPT's moves into place (the launcher watched its folder) fails both rounds'
    checks (issue 37)."""
    script = tmp_path / "elastic.py"
    script.write_text(forged(SAVES_ONLY_BEFORE_CHANGES))
    submissions.fails(ex4e.check_elastic_shrink, str(script), "put CKPT in place", "kernel's count")
    submissions.fails(ex4e.check_elastic_grow, str(script), "put CKPT in place", "kernel's count")


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_checkpoint_moved_in_from_another_folder_is_counted_from_rank_0s_record(tmp_path):
    """A right script whose temporary file is in /tmp: the kernel can keep two of its moves into CKPT as one (a
    moved_to with no moved_from the launcher saw: course.launcher.fswatch.lone_moves), so its count is not the
    judge of "saved after every step" there; rank 0's record is, and the script keeps both cells."""
    from graders.elastic.evidence import commits_by_round
    from graders.elastic.story import recorded_commits

    script = tmp_path / "elastic.py"
    script.write_text(forged([('    torch.save(obj, path + ".tmp")\n    os.replace(path + ".tmp", path)\n',
                               '    tmp = "/tmp/ddp-course-test-elastic-%d.tmp" % os.getpid()\n'
                               "    torch.save(obj, tmp)\n    os.replace(tmp, path)\n")]))
    ex4e.check_elastic_shrink(str(script))
    ex4e.check_elastic_grow(str(script))
    story = ex4e._launch_story("check_elastic_shrink", str(script), (2, 1, 1), 2)  # the same launch (memo)
    assert story.run.files is not None and commits_by_round(story) is None
    rounds = [r for r in (story.departed, story.shrunk, story.grown) if r is not None]
    ckpt = story.run.ckpt_path
    assert len(rounds) == 3 and all(recorded_commits(r, ckpt) >= len(r.batches) for r in rounds)
    assert not any(r.commits for r in rounds)  # no sha256 for a file the probe did not watch: counted all the same


#: Another checkpoint layout: the DDP wrapper's state dict ("module." names) and the optimizer's, in a list under
#: one key, the position as a small dict; the job's step count taken from it.
WRAPPED_LAYOUT = '''
BATCH_RULE = "global"

from torch.nn.parallel import DistributedDataParallel as DDP


def order_of(epoch):
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(7 * epoch + 1))


def main(args):
    rank, world_size, device = join_job()
    model, optimizer = make_model_and_optimizer(device)
    ddp_model = DDP(model)
    pos = {"epoch": 0, "step": 0}
    if os.path.exists(args.ckpt):
        blob = torch.load(args.ckpt, map_location="cpu", weights_only=True)
        ddp_model.load_state_dict(blob["states"][0])
        optimizer.load_state_dict(blob["states"][1])
        pos = blob["pos"]
    steps = SAMPLES // GLOBAL_BATCH
    while pos["epoch"] < EPOCHS:
        batch = order_of(pos["epoch"])[pos["step"] * GLOBAL_BATCH:(pos["step"] + 1) * GLOBAL_BATCH]
        train_step(ddp_model, optimizer, batch.tensor_split(world_size)[rank], device)
        pos["step"] += 1
        if pos["step"] == steps:
            pos = {"epoch": pos["epoch"] + 1, "step": 0}
        if rank == 0:
            save_atomically({"states": [ddp_model.state_dict(), optimizer.state_dict()], "pos": dict(pos)},
                            args.ckpt)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()
'''


@pytest.mark.timeout(60)
def test_the_grader_shifts_every_copy_of_the_weights_and_momentum_in_ckpt_and_keeps_what_was_there(tmp_path):
    """at_round, in the grader's process: the model's weights ("module." names too) and SGD's momentum found in
    CKPT before the change, every copy moved by the secret seed's shift, written back whole; a state loaded from
    the snapshot with the shift equals the file as the grader left it."""
    from graders.elastic import evidence as ev

    model = ex4e.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex4e.LR, momentum=ex4e.MOMENTUM)
    x, y = ex4e.make_dataset().tensors
    torch.nn.functional.mse_loss(model(x[:6]), y[:6]).backward()
    optimizer.step()
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"states": [wrapped, optimizer.state_dict()], "copy": model.state_dict(), "done": 1}, path)
    snap = ev.at_round(str(path), True)
    assert snap.exists and not snap.problem and snap.seed is not None and snap.momentum_shifted
    assert all(torch.equal(snap.weights[k], v) for k, v in model.state_dict().items())
    after = torch.load(path, weights_only=True)
    weights, momentum = ev.loaded(snap, None)
    for k in weights:
        assert torch.allclose(after["states"][0][f"module.{k}"], weights[k]) and torch.allclose(after["copy"][k],
                                                                                                 weights[k])
        assert not torch.allclose(after["copy"][k], model.state_dict()[k], atol=1e-3)
    bufs = [after["states"][1]["state"][i]["momentum_buffer"] for i in range(4)]
    assert all(torch.allclose(b, m) for b, m in zip(bufs, momentum)) and after["done"] == 1
    assert ev.at_round(str(tmp_path / "none.pt"), True).exists is False
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert "plain data" in ev.at_round(str(tmp_path / "junk.pt"), True).problem
    torch.save({"w": torch.zeros(3)}, tmp_path / "other.pt")
    assert "no copy of the model's state dict" in ev.at_round(str(tmp_path / "other.pt"), True).problem
    end = ev.at_round(str(path), False)  # at the end: read, not changed
    assert end.seed is None and torch.load(path, weights_only=True)["done"] == 1 and end.sha == ev.at_round(
        str(path), False).sha


@pytest.mark.timeout(60)
def test_the_launcher_runs_on_round_once_per_new_round_before_letting_its_workers_go(tmp_path):
    """The elastic launch's gate: the first worker of each round (its key read from the probe's start event; a rank
    met again under the same key opens a new round) makes the launcher call on_round before any go file of that
    round exists; every waiting worker is let go once."""
    import json

    from course.launcher.torchrun.elastic import _Gates

    calls = []

    def on_round(path, starting):
        calls.append((path, starting, sorted(p.name for p in tmp_path.glob("gate-*.go"))))
        return len(calls)

    def worker(pid, rank, size, port):
        env = {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_PORT": str(port)}
        (tmp_path / f"events-{pid}.jsonl").write_text(json.dumps({"event": "start", "pid": pid, "env": env}) + "\n")
        (tmp_path / f"gate-{pid}.ready").touch()

    gates = _Gates(str(tmp_path), "/ckpt.pt", on_round)
    worker(1, 0, 2, 500)
    worker(2, 1, 2, 500)
    gates.tick()
    worker(3, 0, 1, 501)  # the next round: another size and port
    gates.tick()
    worker(4, 0, 1, 501)  # rank 0 again under the same key: a new round
    (tmp_path / "gate-5.ready").touch()  # no start event yet: waits
    gates.tick()
    assert calls == [("/ckpt.pt", True, []), ("/ckpt.pt", True, ["gate-1.go", "gate-2.go"]),
                     ("/ckpt.pt", True, ["gate-1.go", "gate-2.go", "gate-3.go"])]
    assert [note for _, note in gates.notes] == [1, 2, 3] and not (tmp_path / "gate-5.go").exists()
    assert all((tmp_path / f"gate-{pid}.go").exists() for pid in (1, 2, 3, 4))
