"""Exercise 3's checks: each catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with correct and wrong functions directly. Wrong
submissions are the source notebook with one answer edited, graded in this
process; each must lose exactly the intended test cells' points.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

import graders.ex3 as ex3
import graders.ex3_model as ex3_model

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

A = "ex3-syncbn-sharding"


# --- student code, right and wrong ----------------------------------------------------------------


def convert_model(model):
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def convert_nothing(model):
    return model


def convert_forged(model):
    """A forgery: make every BatchNorm look converted by renaming torch's classes, convert nothing."""
    nn.SyncBatchNorm = nn.modules.batchnorm._BatchNorm
    torch.nn.modules.batchnorm.SyncBatchNorm = nn.modules.batchnorm._BatchNorm
    return model


def convert_ignoring_result(model):
    nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def convert_2d_only(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
        else:
            convert_2d_only(child)
    return model


def convert_fresh_layers(model):
    """Replaces every BatchNorm by a new SyncBatchNorm: right settings, weights and statistics lost."""
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return nn.SyncBatchNorm(model.num_features, model.eps, model.momentum, model.affine)
    for name, child in model.named_children():
        setattr(model, name, convert_fresh_layers(child))
    return model


def convert_default_settings(model):
    """Copies weights and statistics into SyncBatchNorm layers made with default eps and momentum."""
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        layer = nn.SyncBatchNorm(model.num_features, affine=model.affine)
        layer.load_state_dict(model.state_dict())
        return layer
    for name, child in model.named_children():
        setattr(model, name, convert_default_settings(child))
    return model


def convert_returns_none(model):
    nn.SyncBatchNorm.convert_sync_batchnorm(model)


def convert_stub(model):
    """As nbgrader releases it."""
    # YOUR CODE HERE
    raise NotImplementedError()


BN_SOURCE = '''
class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    def forward(self, x):
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        count = torch.full((1,), x.numel() / channels, dtype=x.dtype)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = dist_fn.all_reduce(stats)
        total, squares, n = stats[:channels], stats[channels:2 * channels], stats[2 * channels]
        mean = total / n
        var = squares / n - mean * mean
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)
'''


def bn_class(*edits: tuple[str, str]):
    """CPUSyncBatchNorm with ``(old, new)`` text edits applied (each ``old`` must occur once)."""
    source = BN_SOURCE
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"nn": nn, "F": F, "torch": torch, "dist": dist, "dist_fn": dist_fn, "__name__": "student"}
    name = f"<student-{len(_CELLS)}>"  # a cell's source is in linecache, as IPython keeps it
    _CELLS.append(name)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), namespace)
    return namespace["CPUSyncBatchNorm"]


_CELLS: list[str] = []


SyncBN = bn_class()
BN_NO_ALL_REDUCE = bn_class(("stats = dist_fn.all_reduce(stats)", "pass"))
BN_LOCAL_COUNT = bn_class(("n = stats[:channels], stats[channels:2 * channels], stats[2 * channels]",
                           "n = stats[:channels], stats[channels:2 * channels], count[0]"))
BN_BIASED_RUNNING_VAR = bn_class(("var * n / (n - 1)", "var"))
BN_UNBIASED_NORMALISATION = bn_class(("y = (x - mean.view(shape)) / torch.sqrt(var.view(shape)",
                                      "y = (x - mean.view(shape)) / torch.sqrt((var * n / (n - 1)).view(shape)"))
BN_MOMENTUM_SWAPPED = bn_class(("self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)",
                                "self.running_mean.mul_(self.momentum).add_((1 - self.momentum) * mean)"))
BN_NO_RUNNING_UPDATE = bn_class(("        with torch.no_grad():\n            self.running_mean", "        if False:\n            self.running_mean"))
BN_NOT_DIFFERENTIABLE = bn_class(("stats = dist_fn.all_reduce(stats)", "dist.all_reduce(stats)"))
BN_DETACHED = bn_class(("stats = dist_fn.all_reduce(stats)", "stats = dist_fn.all_reduce(stats.detach())"))
BN_STUB = bn_class(("        channels = x.shape[1]\n", "        raise NotImplementedError()\n"))
#: the released stub: the given eval branch, then nbgrader's stub line
BN_RELEASED = bn_class((BN_SOURCE[BN_SOURCE.index("        channels = x.shape[1]\n"):], "        # YOUR CODE HERE\n"
                        "        raise NotImplementedError()\n"))


def make_zero_optimizer(params, lr):
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr)


def plain_adam(params, lr):
    return torch.optim.Adam(params, lr=lr)


def zero_sgd(params, lr):
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=lr)


def zero_default_lr(params, lr):
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam)


def save_optimizer(optimizer, rank, ckpt_path):
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(optimizer.state_dict(), ckpt_path)


def save_unconsolidated(optimizer, rank, ckpt_path):
    if rank == 0:
        torch.save(optimizer.state_dict(), ckpt_path)


def save_on_every_rank(optimizer, rank, ckpt_path):
    optimizer.consolidate_state_dict(to=0)
    torch.save(optimizer.state_dict(), ckpt_path)


def save_local_shard(optimizer, rank, ckpt_path):
    if rank == 0:
        torch.save(optimizer.optim.state_dict(), ckpt_path)


def save_every_rank_its_shard(optimizer, rank, ckpt_path):
    torch.save(optimizer.optim.state_dict(), ckpt_path)


def save_other_ranks_elsewhere(optimizer, rank, ckpt_path):
    """Rank 1 writes its shard under another name, in a shared temporary folder: still a write of rank 1's."""
    import tempfile

    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(optimizer.state_dict(), ckpt_path)
    else:
        torch.save(optimizer.optim.state_dict(), os.path.join(tempfile.gettempdir(), f"ddp-course-test-shard-{os.getpid()}.pt"))


fails = submissions.fails


# --- unit tests of the checks ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_data_tells_every_wrong_batchnorm_recipe_from_the_right_one():
    """Uneven, rank-dependent batches: local statistics, a local count or a biased variance all differ."""
    for cases in ex3._BN_CASES.values():
        for sizes, tail in cases:
            assert len(set(sizes)) > 1, "batch sizes must differ across ranks, or the count does not matter"
            ex3._sanity(ex3._bn_reference(sizes, tail, steps=2))  # raises if a wrong recipe matched


@pytest.mark.timeout(60)
def test_the_right_recipe_is_what_nn_batchnorm_computes():
    for cases in ex3._BN_CASES.values():
        for sizes, tail in cases:
            ref = ex3._bn_reference(sizes, tail, steps=1)[0]
            running = (torch.tensor(ex3.RUNNING_MEAN), torch.tensor(ex3.RUNNING_VAR))
            for rank in range(len(sizes)):
                y, mean, var = ex3._bn_variant(ref["xs"], rank, running, "global")
                assert ex3._close(y, ref["y"][rank])
                assert ex3._close(mean, ref["running_mean"]) and ex3._close(var, ref["running_var"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_convert():
    ex3.check_convert(convert_model)
    fails(ex3.check_convert, convert_nothing, "3 of 3 BatchNorm layers were not converted", "3.branch.1")
    fails(ex3.check_convert, convert_fresh_layers, "does not keep the trained weights", "running_mean")
    fails(ex3.check_convert, convert_returns_none, "returned NoneType, not a model")
    fails(ex3.check_convert, convert_forged, "3 of 3 BatchNorm layers were not converted")
    fails(ex3.check_convert, convert_stub, "not written yet")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_convert_any_batchnorm():
    ex3.check_convert_any_batchnorm(convert_model)
    fails(ex3.check_convert_any_batchnorm, convert_ignoring_result, "top-level", "returns a NEW module")
    fails(ex3.check_convert_any_batchnorm, convert_2d_only, "BatchNorm1d", "BatchNorm3d")
    fails(ex3.check_convert_any_batchnorm, convert_default_settings, "changed their settings", "momentum")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_syncbn_output():
    ex3.check_syncbn_output(SyncBN)
    fails(ex3.check_syncbn_output, BN_NO_ALL_REDUCE, "never all-reduced", "[rank 0]")
    fails(ex3.check_syncbn_output, BN_LOCAL_COUNT, "own count", "all-reduce the count too")
    fails(ex3.check_syncbn_output, BN_UNBIASED_NORMALISATION, "normalise with the biased one")
    fails(ex3.check_syncbn_output, BN_STUB, "not written yet", "`forward` raised NotImplementedError")
    started = time.monotonic()  # the released stub fails at once, without a job
    fails(ex3.check_syncbn_output, BN_RELEASED, "`CPUSyncBatchNorm` is not written yet (`CPUSyncBatchNorm.forward`)")
    assert time.monotonic() - started < 2
    ex3.check_syncbn_output(BN_BIASED_RUNNING_VAR)  # running statistics are check_syncbn_running_stats' job
    ex3.check_syncbn_output(BN_NOT_DIFFERENTIABLE)  # gradients are check_syncbn_backward's job


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_syncbn_running_stats():
    ex3.check_syncbn_running_stats(SyncBN)
    fails(ex3.check_syncbn_running_stats, BN_BIASED_RUNNING_VAR, "running_var", "unbiased one", "GLOBAL count")
    fails(ex3.check_syncbn_running_stats, BN_MOMENTUM_SWAPPED, "wrong way round")
    fails(ex3.check_syncbn_running_stats, BN_NO_RUNNING_UPDATE, "not updated at all")
    fails(ex3.check_syncbn_running_stats, BN_NO_ALL_REDUCE, "never all-reduced")
    fails(ex3.check_syncbn_running_stats, BN_LOCAL_COUNT, "own count")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_syncbn_backward():
    ex3.check_syncbn_backward(SyncBN)
    for wrong in (BN_NOT_DIFFERENTIABLE, BN_DETACHED):
        fails(ex3.check_syncbn_backward, wrong, "input gradient differs",
              "torch.distributed.nn.functional.all_reduce")
    fails(ex3.check_syncbn_backward, BN_NO_ALL_REDUCE, "make check_syncbn_output pass first")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_zero_sharded_and_matches_adam():
    ex3.check_zero_sharded(make_zero_optimizer)
    ex3.check_zero_matches_adam(make_zero_optimizer)
    for check in (ex3.check_zero_sharded, ex3.check_zero_matches_adam):
        fails(check, plain_adam, "returned Adam, not a ZeroRedundancyOptimizer", "all 6 parameters")
        fails(check, zero_sgd, "is SGD, not Adam")
    ex3.check_zero_sharded(zero_default_lr)  # sharded all right; the learning rate is the next check's
    fails(ex3.check_zero_matches_adam, zero_default_lr, "differs from single-process Adam", "[rank 0]")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_zero_save():
    ex3.check_zero_save(save_optimizer)
    ex3.check_zero_save(save_optimizer, world_size=3)
    fails(ex3.check_zero_save, save_unconsolidated, "before the state was consolidated", "[rank 0]",
          "consolidate_state_dict(to=0) on EVERY rank")
    fails(ex3.check_zero_save, save_on_every_rank, "[rank 1]", "saving on every rank", "if rank == 0")
    fails(ex3.check_zero_save, save_local_shard, "does not load into torch.optim.Adam", "one shard")
    fails(ex3.check_zero_save, save_every_rank_its_shard, "saved a file too", "[rank 1]")
    message = fails(ex3.check_zero_save, save_other_ranks_elsewhere, "saved a file too", "[rank 1]", "if rank == 0:")
    leftover = re.search(r"rank 1 wrote (\S+\.pt)", message)
    assert leftover, message
    os.unlink(leftover.group(1))
    # consolidating inside `if rank == 0:` (a hang) is graded as a notebook below


# --- the notebook: reference, untouched release, wrong submissions --------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    report = submissions.grade(submissions.source_path(A))
    assert submissions.scores(report) == submissions.full_marks(A), submissions.messages(report)
    assert report.max_score == 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_release_scores_zero_with_clean_messages(tmp_path):
    student = submissions.untouched_student_copy(A, tmp_path)  # checked: no solution, no hidden test
    report = submissions.grade(student)
    assert set(submissions.scores(report).values()) == {0.0}
    for gid, message in submissions.messages(report).items():
        assert message.startswith("FAILED check_"), (gid, message)
        assert "not written yet" in message, (gid, message)
        assert "Traceback" not in message, (gid, message)


def _edit(cell: str, old: str, new: str):
    return cell, old, new


WRONG = {
    # name: ((answer cell, old text, new text), the test cells that must fail, words their messages must contain)
    "BatchNorm not converted": (
        _edit("ex3_convert_model", "return nn.SyncBatchNorm.convert_sync_batchnorm(model)", "return model"),
        ["ex3_test_convert", "ex3_test_convert_any_batchnorm"], ["not converted"]),
    "convert_sync_batchnorm's result ignored": (
        _edit("ex3_convert_model", "return nn.SyncBatchNorm.convert_sync_batchnorm(model)",
              "nn.SyncBatchNorm.convert_sync_batchnorm(model)\n    return model"),
        ["ex3_test_convert_any_batchnorm"], ["returns a NEW module"]),
    "sums not all-reduced": (
        _edit("ex3_cpu_sync_batchnorm", "stats = dist_fn.all_reduce(stats)", "pass"),
        ["ex3_test_syncbn_output", "ex3_test_syncbn_running_stats", "ex3_test_syncbn_backward"],
        ["never all-reduced"]),
    "divided by the local count": (
        _edit("ex3_cpu_sync_batchnorm", "mean = total / n\n        var = squares / n - mean * mean",
              "mean = total / count\n        var = squares / count - mean * mean"),
        ["ex3_test_syncbn_output", "ex3_test_syncbn_running_stats", "ex3_test_syncbn_backward"],
        ["own count"]),
    "biased running variance": (
        _edit("ex3_cpu_sync_batchnorm", "self.momentum * var * n / (n - 1)", "self.momentum * var"),
        ["ex3_test_syncbn_running_stats"], ["unbiased one"]),
    "non-differentiable all_reduce": (
        _edit("ex3_cpu_sync_batchnorm", "stats = dist_fn.all_reduce(stats)", "dist.all_reduce(stats)"),
        ["ex3_test_syncbn_backward"], ["torch.distributed.nn.functional.all_reduce"]),
    "plain Adam, not sharded": (
        _edit("ex3_make_zero_optimizer",
              "return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr)",
              "return torch.optim.Adam(params, lr=lr)"),
        ["ex3_test_zero_sharded", "ex3_test_zero_matches_adam"], ["not a ZeroRedundancyOptimizer"]),
    "no consolidation": (
        _edit("ex3_save_optimizer", "    optimizer.consolidate_state_dict(to=0)  # a collective: every rank sends its shard\n", ""),
        ["ex3_test_zero_save", "ex3_test_zero_save_3_ranks"], ["before the state was consolidated"]),
    "saved on every rank": (
        _edit("ex3_save_optimizer", "    if rank == 0:\n        torch.save(", "    if True:\n        torch.save("),
        ["ex3_test_zero_save", "ex3_test_zero_save_3_ranks"], ["saving on every rank"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_submission_loses_exactly_its_tests(tmp_path, name):
    edit, failing, words = WRONG[name]
    submissions.assert_loses_exactly(submissions.grade_edited(A, tmp_path, edit), A, failing, words)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank0_only_consolidation_is_graded_within_the_timeout(tmp_path):
    """consolidate_state_dict inside `if rank == 0:` hangs rank 0: both save tests lose, naming rank 0."""
    nb = submissions.patch_answer(submissions.load(A), "ex3_save_optimizer",
                                  "    optimizer.consolidate_state_dict(to=0)  # a collective: every rank sends its shard\n"
                                  "    if rank == 0:\n",
                                  "    if rank == 0:\n        optimizer.consolidate_state_dict(to=0)\n")
    start = time.monotonic()
    report = submissions.grade(submissions.write(nb, tmp_path, A))
    seconds = time.monotonic() - start
    failing = ["ex3_test_zero_save", "ex3_test_zero_save_3_ranks"]
    assert submissions.scores(report) == submissions.losing(A, *failing)
    for gid in failing:
        message = submissions.messages(report)[gid]
        assert "[rank 0]" in message and "every rank must call it" in message, message
    assert seconds < 2 * (ex3_model.PG_TIMEOUT.total_seconds() + 30), f"grading took {seconds:.0f} s"
