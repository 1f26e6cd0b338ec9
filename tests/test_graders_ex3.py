"""Exercise 3's checks (syncbn_sharding): each catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with correct and wrong code directly: the reference, answers written in other
styles (torch's own all_gather recipe, two passes of all_reduce, float64 sums), and realistic mistakes, each
failing with a message that names it. Wrong submissions are the source notebook with one answer edited,
graded in this process; each must lose exactly the intended test cells' points.
"""

from __future__ import annotations

import heapq
import linecache
import os
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

import graders.syncbn_sharding.checks as ex3
import graders.syncbn_sharding.harness as ex3_model
import graders.syncbn_sharding.memory as mem

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

A = "ex3-syncbn-sharding"
fails = submissions.fails


# --- part 1: CPUSyncBatchNorm, right and wrong -----------------------------------------------------

def reference_answer(cell: str) -> str:
    """The reference answer of ``cell``, as the notebook holds it (without nbgrader's markers)."""
    return "\n".join(line for line in submissions.answer(submissions.load(A), cell).splitlines()
                     if "### " not in line) + "\n"


def run_answer(source: str, edits) -> dict:
    """The namespace of ``source`` run with ``(old, new)`` text edits (each ``old`` must occur once), its source in
    linecache as IPython keeps a cell's; kept alive for the test session."""
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"nn": nn, "F": F, "torch": torch, "dist": dist, "dist_fn": dist_fn, "__name__": "student"}
    name = f"<student-{len(_CLASSES)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), namespace)
    _CLASSES.append(namespace)
    return namespace


BN_SOURCE = reference_answer("ex3_cpu_sync_batchnorm")


def bn_class(source: str = BN_SOURCE, *edits: tuple[str, str]):
    """A CPUSyncBatchNorm class from ``source`` with ``(old, new)`` text edits."""
    return run_answer(source, edits)["CPUSyncBatchNorm"]


_CLASSES: list[dict] = []  # every answer's namespace, alive while the ranks pickle its objects

_EVAL = '''class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    def forward(self, x):
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
'''

#: torch's own recipe (nn.SyncBatchNorm on gloo): all_gather every rank's (mean, var, count), drop empty ranks
GATHER_SOURCE = _EVAL + '''        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // c
        if n:
            mean = x.mean(dims)
            var = ((x - mean.view([1, c] + [1] * (x.dim() - 2))) ** 2).mean(dims)
        else:
            mean = var = x.sum(dims)
        stats = torch.stack(dist_fn.all_gather(torch.cat([mean, var, x.new_tensor([float(n)])])))
        stats = stats[stats[:, -1] > 0]
        m, v, k = stats[:, :c], stats[:, c:2 * c], stats[:, -1:]
        N = k.sum()
        mean = (k * m).sum(0) / N
        var = (k * (v + (m - mean) ** 2)).sum(0) / N
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * N / (N - 1))
        shape = [1, c] + [1] * (x.dim() - 2)
        return (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * self.weight.view(shape) \\
            + self.bias.view(shape)
'''

#: two passes: all_reduce (sum, count) for the mean, then the sum of squared deviations from it
TWO_PASS_SOURCE = _EVAL + '''        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        first = dist_fn.all_reduce(torch.cat([x.sum(dims), x.new_tensor([x.numel() / c])]))
        n = first[-1]
        mean = first[:c] / n
        var = dist_fn.all_reduce(((x - mean.view(shape)) ** 2).sum(dims)) / n
        with torch.no_grad():
            self.running_mean.copy_((1 - self.momentum) * self.running_mean + self.momentum * mean)
            self.running_var.copy_((1 - self.momentum) * self.running_var + self.momentum * var * n / (n - 1))
        return (x - mean.view(shape)) / (var.view(shape) + self.eps).sqrt() * self.weight.view(shape) \\
            + self.bias.view(shape)
'''

#: lesson 3's recipe: float32 sums of x and x^2, one all_reduce
SUMS_SOURCE = _EVAL + '''        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_tensor([x.numel() / c])])
        total = dist_fn.all_reduce(local)
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        return (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps) * self.weight.view(shape) \\
            + self.bias.view(shape)
'''

#: torch's own autograd Function (nn/modules/_functions.py), by hand: plain collectives in forward, its own backward
#: all-reducing (sum dy, sum dy * (x - mean)); on a rank with no samples it returns None for the weight and bias
#: gradients, which torch documents as "interpreted as zeros"
FUNCTION_SOURCE = """class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count):
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count = count
        return (x - mean.view(shape)) * (invstd * weight).view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        xmu = x - mean.view(shape)
        sums = torch.cat([dy.sum(dims), (dy * xmu).sum(dims)])
        dist.all_reduce(sums)
        sum_dy, sum_dy_xmu = sums[:c] / ctx.count, sums[c:] / ctx.count
        dx = (dy - sum_dy.view(shape) - xmu * (invstd ** 2 * sum_dy_xmu).view(shape)) * (invstd * weight).view(shape)
        if x.numel() == 0:
            return dx, None, None, None, None, None
        return dx, (dy * xmu * invstd.view(shape)).sum(dims), dy.sum(dims), None, None, None


""" + _EVAL + """        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // c
        local = torch.zeros(2 * c + 1)
        if n:
            local = torch.cat([x.detach().mean(dims), x.detach().var(dims, unbiased=False), x.new_tensor([n])])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        stats = torch.stack(gathered)
        stats = stats[stats[:, -1] > 0]
        k = stats[:, -1:]
        count = k.sum()
        mean = (k * stats[:, :c]).sum(0) / count
        var = (k * (stats[:, c:2 * c] + (stats[:, :c] - mean) ** 2)).sum(0) / count
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * count / (count - 1))
        return _SyncBN.apply(x, self.weight, self.bias, mean, torch.rsqrt(var + self.eps), count)
"""

SyncBN = bn_class()
BN_GATHER = bn_class(GATHER_SOURCE)
BN_FUNCTION = bn_class(FUNCTION_SOURCE)
BN_TWO_PASS = bn_class(TWO_PASS_SOURCE)
BN_SUMS_FLOAT64 = bn_class(SUMS_SOURCE.replace("x.sum(dims), (x * x).sum(dims)", "x.double().sum(dims), x.double().square().sum(dims)")
                           .replace("x.new_tensor([x.numel() / c])", "x.new_tensor([x.numel() / c], dtype=torch.float64)")
                           .replace("var = total[c:2 * c] / n - mean * mean", "var = (total[c:2 * c] / n - mean * mean).float()\n        mean = mean.float()\n        n = n.float()"))
BN_SUMS = bn_class(SUMS_SOURCE)
BN_NO_COMMUNICATION = bn_class(BN_SOURCE, ("table = dist_fn.all_reduce(table)", "pass"))
BN_UNWEIGHTED = bn_class(GATHER_SOURCE, ("mean = (k * m).sum(0) / N\n        var = (k * (v + (m - mean) ** 2)).sum(0) / N",
                                         "mean = m.mean(0)\n        var = v.mean(0)"))
BN_WITHIN_ONLY = bn_class(BN_SOURCE, ("(variances + (means - mean) ** 2)", "variances"))
BN_EMPTY_NAN = bn_class(GATHER_SOURCE, ("        if n:\n", "        if True:\n"), ("        stats = stats[stats[:, -1] > 0]\n", ""))
BN_EMPTY_RETURNS_EARLY = bn_class(BN_SOURCE, ("        n = per_channel.shape[1]\n",
                                              "        n = per_channel.shape[1]\n        if n == 0:\n            return x * 1\n"))
#: the empty rank joins the forward's exchange and updates its statistics, then answers with fresh zeros: a right
#: forward whose output has no graph there, so that rank's backward never joins the others'
BN_EMPTY_FRESH_ZEROS = bn_class(BN_SOURCE, ("        view = [1, channels] + [1] * (x.dim() - 2)\n",
                                            "        if x.shape[0] == 0:\n            return torch.zeros_like(x)\n"
                                            "        view = [1, channels] + [1] * (x.dim() - 2)\n"))
BN_BIASED_RUNNING_VAR = bn_class(BN_SOURCE, ("var * total / (total - 1)", "var"))
BN_MOMENTUM_SWAPPED = bn_class(BN_SOURCE, ("buffer.mul_(1 - self.momentum).add_(self.momentum * batch_value)",
                                           "buffer.mul_(self.momentum).add_((1 - self.momentum) * batch_value)"))
BN_NOT_DIFFERENTIABLE = bn_class(BN_SOURCE, ("table = dist_fn.all_reduce(table)", "dist.all_reduce(table)"))
BN_RELEASED = bn_class(BN_SOURCE[:BN_SOURCE.index("        channels = x.shape[1]\n")]
                       + "        # YOUR CODE HERE\n        raise NotImplementedError()\n")

#: eps left out, and nn.BatchNorm's default written where self.eps belongs (the grader's layers take another)
BN_NO_EPS = bn_class(BN_SOURCE, ("torch.rsqrt(var.reshape(view) + self.eps)", "torch.rsqrt(var.reshape(view))"))
BN_EPS_HARD_CODED = bn_class(BN_SOURCE, ("torch.rsqrt(var.reshape(view) + self.eps)", "torch.rsqrt(var.reshape(view) + 1e-5)"))
BN_CHECKS = (ex3.check_syncbn_output, ex3.check_syncbn_running_stats, ex3.check_syncbn_backward,
             ex3.check_syncbn_accuracy)


# --- part 2: memory predictions, right and wrong ---------------------------------------------------


def predict_zero_bytes(model, world_size):
    """The reference's rule, written with a heap: largest parameter first, to the least loaded rank."""
    params = list(model.parameters())
    everything = sum(p.nbytes for p in params)
    ranks = [(0, r) for r in range(world_size)]
    state = [0] * world_size
    for p in sorted(params, key=lambda p: p.numel(), reverse=True):
        load, r = heapq.heappop(ranks)
        state[r] += sum(t.nbytes for t in (p, p, torch.tensor(0.0)))
        heapq.heappush(ranks, (load + p.numel(), r))
    return [{"params": everything, "grads": everything, "optimizer": s} for s in state]


def predict_fsdp_bytes(model, world_size):
    """Meta tensors chunked as FSDP2 chunks them: no arithmetic of one's own."""
    out = []
    for rank in range(world_size):
        shards = []
        for p in model.parameters():
            chunks = torch.empty(p.shape, dtype=p.dtype, device="meta").chunk(world_size)
            shards.append(chunks[rank] if rank < len(chunks) else torch.empty((0, *p.shape[1:]), device="meta"))
        local = sum(s.numel() * s.element_size() for s in shards)
        out.append({"params": local, "grads": local, "optimizer": 2 * local + 4 * len(shards)})
    return out


def _variant(kind: str, name: str, vocab: int, widths: tuple, seed: int, world_size: int):
    """A usual wrong model of the sharding, as the answer for the model the check measures (worked out here by the
    grader's own variant: the rank refuses the grader's code to a prediction; the check judges that model first)."""
    answer = (mem._zero_variant if kind == "zero" else mem._fsdp_variant)(mem._shapes(vocab, widths, seed),
                                                                           world_size, name)

    def predict(model, ws):
        return answer
    return predict


def predict_forged(model, world_size):
    """A forgery: make every tensor look empty to whatever counts bytes next, and predict zeros."""
    torch.Tensor.nbytes = property(lambda self: 0)
    return [{"params": 0, "grads": 0, "optimizer": 0} for _ in range(world_size)]


def predict_floats(model, world_size):
    """Right numbers as floats with a fraction: not whole bytes."""
    return [{k: v + 0.5 for k, v in d.items()} for d in predict_zero_bytes(model, world_size)]


def predict_stub(model, world_size):
    """As nbgrader releases it."""
    # YOUR CODE HERE
    raise NotImplementedError()


HIDDEN = {"world_size": 4, "vocab": 13, "widths": (10, 3, 9, 5), "seed": 1}


# --- part 3: a sharded checkpoint of ZeRO's state, right and wrong -------------------------------------

SHARD_SOURCE = reference_answer("ex3_shard_checkpoint")


def shard_functions(source: str = SHARD_SOURCE, *edits: tuple[str, str]):
    """(save_shard, load_full_state) from ``source`` with ``(old, new)`` text edits."""
    namespace = run_answer(source, edits)
    return namespace["save_shard"], namespace["load_full_state"]


def save_pickled_local_state_dict(optimizer, model, rank, ckpt_dir):
    """Another style: the local optimizer's own state_dict (indices local to the rank) with the global index of each
    of its parameters beside it, written with pickle, then a barrier so that no rank leaves before all are written."""
    import pickle

    position = {id(p): i for i, p in enumerate(model.parameters())}
    local = optimizer.optim.state_dict()
    owned = [position[id(p)] for group in optimizer.optim.param_groups for p in group["params"]]
    with open(os.path.join(ckpt_dir, f"rank{rank:03d}.pkl"), "wb") as fh:
        pickle.dump({"local": local, "global_index": owned}, fh)
    dist.barrier()


def load_pickled_local_state_dicts(ckpt_dir, model):
    import glob
    import pickle

    merged = {"state": {}, "param_groups": None}
    for path in sorted(glob.glob(os.path.join(ckpt_dir, "rank*.pkl"))):
        with open(path, "rb") as fh:
            part = pickle.load(fh)
        for local_index, state in part["local"]["state"].items():
            merged["state"][part["global_index"][local_index]] = state
        group = dict(part["local"]["param_groups"][0])
        group["params"] = [i for i, _ in enumerate(model.parameters())]
        merged["param_groups"] = [group]
    return merged


class PerParameterCheckpoint:
    """Another style: a helper class; one file per parameter (named by its index), hyperparameters from the local
    optimizer's defaults; the loader rebuilds the dict a fresh Adam's state_dict() has, then fills it."""

    @staticmethod
    def save(optimizer, model, rank, ckpt_dir):
        for i, p in enumerate(model.parameters()):
            if p in optimizer.optim.state:
                torch.save({"state": optimizer.optim.state[p], "defaults": optimizer.optim.defaults},
                           os.path.join(ckpt_dir, f"param-{i}.pt"))

    @staticmethod
    def load(ckpt_dir, model):
        template = torch.optim.Adam(model.parameters()).state_dict()
        for name in os.listdir(ckpt_dir):
            saved = torch.load(os.path.join(ckpt_dir, name), weights_only=False)
            template["state"][int(name[len("param-"):-len(".pt")])] = saved["state"]
            template["param_groups"][0].update(saved["defaults"])
        return template


def save_consolidated_on_rank0(optimizer, model, rank, ckpt_dir):
    """Lesson 3's way: gather everything on rank 0, which writes one file."""
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(optimizer.state_dict(), os.path.join(ckpt_dir, "optimizer.pt"))


def load_consolidated(ckpt_dir, model):
    return torch.load(os.path.join(ckpt_dir, "optimizer.pt"), weights_only=True)


def save_shard_through_a_temporary_file(optimizer, model, rank, ckpt_dir):
    """Right: the shard written to a temporary file of the system's folder, then moved into ckpt_dir."""
    import shutil
    import tempfile

    save, _ = shard_functions()
    folder = tempfile.mkdtemp(prefix="ddp-course-test-shard-")
    save(optimizer, model, rank, folder)
    for name in os.listdir(folder):
        shutil.move(os.path.join(folder, name), os.path.join(ckpt_dir, name))
    os.rmdir(folder)


def save_shard_with_dcp(optimizer, model, rank, ckpt_dir):
    """Right: torch.distributed.checkpoint writes each rank's share (its planning exchanges a few kilobytes of
    metadata, not the state)."""
    import torch.distributed.checkpoint as dcp

    index = {id(p): i for i, p in enumerate(model.parameters())}
    flat = {f"state.{index[id(p)]}.{k}": v for p, s in optimizer.optim.state.items() for k, v in s.items()}
    flat.update({f"hp.{rank}.{k}": v for k, v in optimizer.optim.param_groups[0].items() if k != "params"})
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(ckpt_dir))


def load_shard_with_dcp(ckpt_dir, model):
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tempfile.mkdtemp(prefix="ddp-course-test-dcp-"), "full.pt")
    dcp_to_torch_save(ckpt_dir, out)
    state, hyperparameters = {}, {}
    for key, value in torch.load(out, weights_only=False).items():
        kind, a, b = key.split(".", 2)
        if kind == "state":
            state.setdefault(int(a), {})[b] = value
        else:
            hyperparameters[b] = value
    return {"state": state, "param_groups": [{**hyperparameters, "params": list(range(len(list(model.parameters()))))}]}


def save_local_state_dict(optimizer, model, rank, ckpt_dir):
    torch.save(optimizer.optim.state_dict(), os.path.join(ckpt_dir, f"optim-{rank}.pt"))


def load_by_shape(ckpt_dir, model):
    """Wrong: each saved state given to the model's parameter of the same shape (the model has several)."""
    params = list(model.parameters())
    state, group = {}, None
    for name in sorted(os.listdir(ckpt_dir)):
        saved = torch.load(os.path.join(ckpt_dir, name), weights_only=True)
        group = saved["param_groups"][0]
        for s in saved["state"].values():
            state[next(i for i, p in enumerate(params) if p.shape == s["exp_avg"].shape)] = s
    return {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}


def save_shard_outside(optimizer, model, rank, ckpt_dir):
    """Each rank writes its shard in the system's temporary folder, not in ckpt_dir."""
    import tempfile

    save, _ = shard_functions()
    folder = tempfile.mkdtemp(prefix="ddp-course-test-shard-")
    save(optimizer, model, rank, folder)


# --- unit tests of the checks ---------------------------------------------------------------------

# --- unit tests of the checks ---------------------------------------------------------------------


ALL_BN_CASES = [*ex3._BN_CASES.values(), *ex3._BN_HIDDEN_CASES.values()]  # the visible tests' and the hidden ones'


@pytest.mark.timeout(60)
def test_the_data_tells_every_wrong_batchnorm_recipe_from_the_right_one():
    """Uneven, rank-dependent batches (one sample, none): every named wrong recipe differs from the right one."""
    every = [sizes for cases in ALL_BN_CASES for sizes, _, offset in cases if not offset]
    assert any(0 in sizes for sizes in every) and any(1 in sizes for sizes in every)  # a rank with none, with one
    for cases in ALL_BN_CASES:
        for sizes, tail, offset in cases:
            assert len(set(sizes)) > 1, "batch sizes must differ across ranks, or the count does not matter"
            if not offset:
                ex3._sanity(ex3._bn_reference(sizes, tail, 2))  # raises if a wrong recipe matched


@pytest.mark.timeout(60)
def test_the_right_recipe_is_what_nn_batchnorm_computes():
    for cases in ALL_BN_CASES:
        for sizes, tail, offset in cases:
            ref = ex3._bn_reference(sizes, tail, 1, offset)[0]
            running = (torch.tensor(ex3.RUNNING_MEAN), torch.tensor(ex3.RUNNING_VAR))
            for rank in range(len(sizes)):
                y, mean, var = ex3._bn_variant(ref["xs"], rank, running, "global")
                assert torch.allclose(y, ref["y"][rank], atol=1e-4) and torch.allclose(mean, ref["running_mean"])
                assert torch.allclose(var, ref["running_var"], rtol=1e-5)


@pytest.mark.timeout(60)
def test_the_accuracy_cases_fail_the_sums_recipe_and_pass_float32_batchnorm():
    """The property judged is accuracy: at the check's offset, the float32 sums recipe misses the tolerance by
    at least 5x on some rank of every case, while one process's float32 F.batch_norm meets it on every rank."""
    cases = [(sizes, tail, offset) for cs in ALL_BN_CASES for sizes, tail, offset in cs if offset]
    assert len(cases) >= 2
    for sizes, tail, offset in cases:
        for step in ex3._bn_reference(sizes, tail, ex3_model.BN_STEPS, offset):
            errors = [ex3._sums_error(step["xs"], r) for r in range(len(sizes)) if step["xs"][r].numel()]
            assert max(errors) > 5 * ex3.ACCURACY_ATOL["y"], (sizes, errors)
        x = torch.cat([ex3_model._bn_input(r, sizes, tail, 0, offset) for r in range(len(sizes))])
        y = F.batch_norm(x, None, None, torch.tensor(ex3.WEIGHT), torch.tensor(ex3.BIAS), True, 0.0, ex3.EPS)
        truth = torch.cat(ex3._bn_reference(sizes, tail, 1, offset)[0]["y"])
        assert float((y - truth).abs().max()) < ex3.ACCURACY_ATOL["y"] / 4


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_correct_batchnorms_in_every_style_get_full_marks():
    """The reference, torch's all_gather recipe, torch's own autograd Function (None for the weight and bias
    gradients on a rank with no samples), two all_reduce passes, sums in float64: every check passes."""
    for bn in (SyncBN, BN_GATHER, BN_FUNCTION, BN_TWO_PASS, BN_SUMS_FLOAT64):
        for check in BN_CHECKS:
            check(bn)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_layer_without_its_own_eps_loses_the_output():
    for bn in (BN_NO_EPS, BN_EPS_HARD_CODED):
        fails(ex3.check_syncbn_output, bn, "the output differs", "normalised without the layer's eps", "self.eps")
    for check in BN_CHECKS[1:2]:  # the running statistics are not the output's (the backward waits for a right output)
        check(BN_EPS_HARD_CODED)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_lessons_sums_recipe_loses_exactly_the_accuracy_check():
    for check in BN_CHECKS[:3]:
        check(BN_SUMS)
    fails(ex3.check_syncbn_accuracy, BN_SUMS, "values around 1000", "E[x^2] - E[x]^2", "check_syncbn_output passes")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_hidden_cases_judge_the_same_way():
    """hidden=True: four ranks, other sizes and shapes; right answers pass, the same mistakes fail the same checks."""
    for check in BN_CHECKS:
        check(SyncBN, hidden=True)
        check(BN_GATHER, hidden=True)
    fails(ex3.check_syncbn_accuracy, BN_SUMS, "4 ranks", "values around 1000", hidden=True)
    fails(ex3.check_syncbn_output, BN_UNWEIGHTED, "4 ranks", "plain average", hidden=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wrong_combinations_are_named():
    for check in BN_CHECKS[:2]:
        fails(check, BN_NO_COMMUNICATION, "own batch only", "never combined")
        fails(check, BN_UNWEIGHTED, "plain average", "in proportion to its count")
    fails(ex3.check_syncbn_output, BN_WITHIN_ONLY, "spread of the ranks' means")
    fails(ex3.check_syncbn_output, BN_EMPTY_NAN, "NaN", "no samples", "count 0")
    message = fails(ex3.check_syncbn_output, BN_EMPTY_RETURNS_EARLY, "even one with an empty batch")
    assert "lost its peers" in message or "met a collective the others were not in" in message, message
    # a right forward whose empty rank's output has no graph: the backward's check alone, naming that rank
    for check in (ex3.check_syncbn_output, ex3.check_syncbn_running_stats):
        check(BN_EMPTY_FRESH_ZEROS)
    fails(ex3.check_syncbn_backward, BN_EMPTY_FRESH_ZEROS, "[rank 1]", "output has no autograd graph",
          "a fresh torch.zeros_like(x) has no graph")
    fails(ex3.check_syncbn_backward, BN_NO_COMMUNICATION, "make check_syncbn_output pass first")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_running_statistics_and_gradient_mistakes_lose_only_their_check():
    fails(ex3.check_syncbn_running_stats, BN_BIASED_RUNNING_VAR, "running_var", "unbiased one", "GLOBAL count")
    fails(ex3.check_syncbn_running_stats, BN_MOMENTUM_SWAPPED, "wrong way round")
    fails(ex3.check_syncbn_backward, BN_NOT_DIFFERENTIABLE, "input gradient differs", "torch.distributed.nn.functional")
    for bn in (BN_BIASED_RUNNING_VAR, BN_MOMENTUM_SWAPPED, BN_NOT_DIFFERENTIABLE):
        for check in (ex3.check_syncbn_output, ex3.check_syncbn_accuracy):
            if not (bn is not BN_NOT_DIFFERENTIABLE and check is ex3.check_syncbn_accuracy):
                check(bn)
    ex3.check_syncbn_backward(BN_BIASED_RUNNING_VAR)
    ex3.check_syncbn_running_stats(BN_NOT_DIFFERENTIABLE)
    for bn in (BN_BIASED_RUNNING_VAR, BN_MOMENTUM_SWAPPED):  # off far from zero as near it: no loss of precision
        fails(ex3.check_syncbn_accuracy, bn, "and on data near zero too: not a loss of precision",
              "check_syncbn_running_stats names how")
    started = time.monotonic()  # the released stub fails at once, without a job
    fails(ex3.check_syncbn_output, BN_RELEASED, "`CPUSyncBatchNorm` is not written yet (`CPUSyncBatchNorm.forward`)")
    assert time.monotonic() - started < 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_memory_predictions():
    """Right predictions in two styles for the visible and the hidden model; each usual wrong model of the
    sharding is named; a forgery that zeroes nbytes after the measurement changes nothing."""
    for kwargs in ({}, HIDDEN):
        mem.check_zero_memory(predict_zero_bytes, **kwargs)
        mem.check_fsdp_memory(predict_fsdp_bytes, **kwargs)
    shapes = [tuple(p.shape) for p in mem.memory_model(**{k: v for k, v in HIDDEN.items() if k != "world_size"}).parameters()]
    assert mem._zero_variant(shapes, 4, "greedy") != mem._zero_variant(shapes, 4, "in_order")
    for name, words in (("even", ["never splits a tensor"]), ("no_step", ["step counter"]),
                        ("round_robin", ["largest first"]), ("sharded_params", ["only the optimizer state"])):
        fails(mem.check_zero_memory, _variant("zero", name, **HIDDEN), *words, **HIDDEN)
    for name, words in (("even", ["torch.chunk", "LAST ranks"]), ("padded", ["pads only inside its all-gather"]),
                        ("no_step", ["step counter"]), ("full_grads", ["reduce-scatters the gradients"])):
        fails(mem.check_fsdp_memory, _variant("fsdp", name, **HIDDEN), *words, **HIDDEN)
    fails(mem.check_zero_memory, predict_forged, "differ from what", "[ranks 0, 1, 2]")
    fails(mem.check_fsdp_memory, predict_floats, "whole byte counts")
    fails(mem.check_zero_memory, predict_stub, "not written yet")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_check_shard_save_and_load():
    save, load = shard_functions()
    for check in (ex3.check_shard_save, ex3.check_shard_load):
        check(save, load_full_state=load)
        check(save_pickled_local_state_dict, load_full_state=load_pickled_local_state_dicts, world_size=2, seed=4)
        check(PerParameterCheckpoint.save, load_full_state=PerParameterCheckpoint.load, world_size=4, seed=5)
    # lesson 3's gather: the checkpoint is right, the save is not sharded
    ex3.check_shard_load(save_consolidated_on_rank0, load_full_state=load_consolidated)
    message = fails(ex3.check_shard_save, save_consolidated_on_rank0, "a gather", "moved", "[ranks 0, 1, 2]",
                    "do not consolidate")
    assert "rank 0's collectives (broadcast" in message, message
    # every rank writes the same file: the last one overwrites the others' shares
    same = shard_functions(SHARD_SOURCE, ('f"shard-{rank}.pt"', '"shard.pt"'))
    fails(ex3.check_shard_save, same[0], "wrote the same file", "[ranks 0, 1, 2]", "put the rank in the file's name",
          load_full_state=same[1])
    fails(ex3.check_shard_load, same[0], "wrote the same file", "[ranks 0, 1, 2]", load_full_state=same[1])
    # the local optimizer's indices taken for the model's
    local = shard_functions(SHARD_SOURCE, ("{index[p]: state for p, state in local.state.items()}",
                                           "dict(enumerate(local.state.values()))"))
    ex3.check_shard_save(local[0], load_full_state=local[1])
    fails(ex3.check_shard_load, local[0], "not single-process Adam's", "numbers its own parameters from 0",
          load_full_state=local[1])
    # only rank 0 saves, as for an ordinary checkpoint
    rank0 = shard_functions(SHARD_SOURCE, ("    torch.save(shard,", "    if rank == 0:\n        torch.save(shard,"))
    fails(ex3.check_shard_save, rank0[0], "wrote no file", "[ranks 1, 2]", "every rank must save its own",
          load_full_state=rank0[1])
    # the hyperparameters forgotten: Adam loads the state but its group has no learning rate
    bare = shard_functions(SHARD_SOURCE, ('[{**hyperparameters, "params": indices}]', '[{"params": indices}]'))
    fails(ex3.check_shard_load, bare[0], "param_groups: lr is None", load_full_state=bare[1])
    fails(ex3.check_shard_save, save_shard_outside, "left files outside ckpt_dir", "[ranks 0, 1, 2]", "os.path.join",
          load_full_state=load)
    ex3.check_shard_save(save_shard_through_a_temporary_file, load_full_state=load)  # nothing left outside: right
    for check in (ex3.check_shard_save, ex3.check_shard_load):  # DCP's metadata is no gather
        check(save_shard_with_dcp, load_full_state=load_shard_with_dcp)
    # the state matched to parameters by shape: the model has two 128 x 128 weights and three 128-long biases
    ex3.check_shard_save(save_local_state_dict, load_full_state=load_by_shape)
    fails(ex3.check_shard_load, save_local_state_dict, "not single-process Adam's", load_full_state=load_by_shape)
    # a right save read back by a broken loader (found by a mutation run: no test reached these): the save is judged
    # through the loader, so both cells fail, the save's message saying the loader failed and to fix it first
    misnamed = shard_functions(SHARD_SOURCE, ("os.path.join(ckpt_dir, name)", 'os.path.join(ckpt_dir, name + ".pt")'))
    fails(ex3.check_shard_save, misnamed[0], "reading it back with load_full_state, which failed",
          "make check_shard_load pass first", load_full_state=misnamed[1])
    fails(ex3.check_shard_load, misnamed[0], "FileNotFoundError", load_full_state=misnamed[1])
    bare_state = shard_functions(SHARD_SOURCE, ('    return {"state": state, "param_groups": [{**hyperparameters, '
                                                '"params": indices}]}', "    return state"))
    fails(ex3.check_shard_save, bare_state[0], "a plain Adam refused what it returned",
          "torch.optim.Adam(model.parameters()).state_dict()", load_full_state=bare_state[1])
    fails(ex3.check_shard_load, bare_state[0], "refused what load_full_state returned", load_full_state=bare_state[1])


# --- the notebook: reference, untouched release, wrong submissions --------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    report = submissions.grade(submissions.source_path(A))
    assert submissions.scores(report) == submissions.full_marks(A), submissions.messages(report)
    assert report.max_score == 29


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


_BN = "ex3_cpu_sync_batchnorm"
WRONG = {
    # name: ((answer cell, old text, new text), the test cells that must fail, words their messages must contain)
    "the lesson's float32 sums": (
        _edit(_BN, "var = (counts * (variances + (means - mean) ** 2)).sum(dim=0) / total",
              "var = (counts * (variances + means ** 2)).sum(dim=0) / total - mean ** 2"),
        ["ex3_test_syncbn_accuracy"], ["E[x^2] - E[x]^2"]),
    "means and variances averaged, counts ignored": (
        _edit(_BN, "mean = (counts * means).sum(dim=0) / total\n        var = (counts * (variances + (means - mean) ** 2)).sum(dim=0) / total",
              "mean = means.mean(dim=0)\n        var = variances.mean(dim=0)"),
        ["ex3_test_syncbn_output", "ex3_test_syncbn_running_stats", "ex3_test_syncbn_backward",
         "ex3_test_syncbn_accuracy"], ["plain average"]),
    "non-differentiable all_reduce": (
        _edit(_BN, "table = dist_fn.all_reduce(table)", "dist.all_reduce(table)"),
        ["ex3_test_syncbn_backward"], ["torch.distributed.nn.functional"]),
    "ZeRO's state split evenly": (
        _edit("ex3_predict_memory", "return [{\"params\": everything, \"grads\": everything, \"optimizer\": s} for s in state]",
              "return [{\"params\": everything, \"grads\": everything, \"optimizer\": sum(state) // world_size} for s in state]"),
        ["ex3_test_zero_memory"], ["never splits a tensor"]),
    "FSDP2 shards counted padded": (
        _edit("ex3_predict_memory", "mine = min(per_rank, max(rows - rank * per_rank, 0))", "mine = per_rank"),
        ["ex3_test_fsdp_memory"], ["pads only inside its all-gather"]),
    "the state gathered before the shards are written": (
        _edit("ex3_shard_checkpoint", "    local = optimizer.optim", "    optimizer.consolidate_state_dict(to=0)\n    local = optimizer.optim"),
        ["ex3_test_shard_save"], ["a gather"]),
    "the local optimizer's indices taken for the model's": (
        _edit("ex3_shard_checkpoint", "{index[p]: state for p, state in local.state.items()}",
              "dict(enumerate(local.state.values()))"),
        ["ex3_test_shard_load"], ["not single-process Adam's"]),
    "every rank writes the same file": (
        _edit("ex3_shard_checkpoint", 'f"shard-{rank}.pt"', '"shard.pt"'),
        ["ex3_test_shard_save", "ex3_test_shard_load"], ["wrote the same file"]),
}


#: name: ([(answer cell, old, new)], failing test cells, words)
MISTAKES = {name: ([edit], failing, words) for name, (edit, failing, words) in WRONG.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    """The mistakes of a group (:func:`submissions.pack`: other answer cells, other test cells) in one submission."""
    submissions.grade_packed(A, tmp_path, MISTAKES, group)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_collective_only_rank0_calls_is_graded_within_the_timeout(tmp_path):
    """A barrier inside `if rank == 0:` hangs rank 0: both part 3 tests lose, naming rank 0."""
    nb = submissions.patch_answer(submissions.load(A), "ex3_shard_checkpoint", "    torch.save(shard,",
                                  "    if rank == 0:\n        dist.barrier()\n    torch.save(shard,")
    start = time.monotonic()
    report = submissions.grade(submissions.write(nb, tmp_path, A))
    seconds = time.monotonic() - start
    failing = ["ex3_test_shard_save", "ex3_test_shard_load"]
    assert submissions.scores(report) == submissions.losing(A, *failing)
    for gid in failing:
        message = submissions.messages(report)[gid]
        assert "[rank 0]" in message and "never joined" in message, message
    assert seconds < 2 * (ex3_model.PG_TIMEOUT.total_seconds() + 30), f"grading took {seconds:.0f} s"


# --- issue 37: forgeries of a student who read graders/ (each scored full marks on its cell before) ----------

#: running statistics computed right but kept in new tensors: the layer's own buffers never change
BN_REPLACED_BUFFERS = bn_class(BN_SOURCE, (
    "                buffer.mul_(1 - self.momentum).add_(self.momentum * batch_value)  # running_var: unbiased, global count",
    "                pass\n"
    "            self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * mean\n"
    "            self.running_var = (1 - self.momentum) * self.running_var + self.momentum * var * total / (total - 1)"))
#: running statistics updated in place but with gradient: the buffers join the autograd graph
BN_RUNNING_IN_GRAPH = bn_class(BN_SOURCE, ("        with torch.no_grad():\n            for buffer", "        if True:\n            for buffer"))

#: the values themselves gathered (padded to the largest rank), then one process's float32 BatchNorm on all of
#: them: an exchange the part's recipe does not make, numerically right; the part now states that the checks
#: judge what the layer computes, and this passes them (as two passes and float64 sums do)
GATHER_VALUES_SOURCE = _EVAL + '''        c = x.shape[1]
        flat = x.transpose(0, 1).reshape(c, -1)
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, torch.tensor([flat.shape[1]]))
        top = max(int(k) for k in counts)
        padded = torch.cat([flat, flat.new_zeros(c, top - flat.shape[1])], dim=1)
        every = torch.cat([t[:, :int(k)] for t, k in zip(dist_fn.all_gather(padded), counts)], dim=1)
        var, mean = torch.var_mean(every, dim=1, correction=0)
        n = every.shape[1]
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        shape = [1, c] + [1] * (x.dim() - 2)
        return (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * self.weight.view(shape) \\
            + self.bias.view(shape)
'''
BN_GATHER_VALUES = bn_class(GATHER_VALUES_SOURCE)

#: no communication at all: every other rank's batch rebuilt from the grader's public data generator (the case read
#: in the harness's frame), this rank's own as it came, then one process's BatchNorm on them all
REPLAYED_SOURCE = _EVAL + '''        import sys

        from graders.syncbn_sharding.harness import _bn_input

        frame = sys._getframe(1)
        while "sizes" not in frame.f_locals or "step" not in frame.f_locals:
            frame = frame.f_back
        case = frame.f_locals
        rank = dist.get_rank()
        parts = [x if r == rank else _bn_input(r, case["sizes"], case["tail"], case["step"], case["offset"])
                 for r in range(len(case["sizes"]))]
        every = torch.cat([p.detach().transpose(0, 1).reshape(x.shape[1], -1) for p in parts], dim=1)
        var, mean = torch.var_mean(every, dim=1, correction=0)
        n = every.shape[1]
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        return (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * self.weight.view(shape) \\
            + self.bias.view(shape)
'''
BN_REPLAYED = bn_class(REPLAYED_SOURCE)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_running_statistics_are_judged_in_the_layers_own_buffers():
    """Right values in new tensors, or right values in the buffers with gradient: only the running-statistics check
    fails, naming what happened; the other checks keep passing."""
    fails(ex3.check_syncbn_running_stats, BN_REPLACED_BUFFERS, "replaced by a new tensor", "in place", "[rank 0]")
    fails(ex3.check_syncbn_running_stats, BN_RUNNING_IN_GRAPH, "part of the autograd graph", "torch.no_grad()")
    for bn in (BN_REPLACED_BUFFERS, BN_RUNNING_IN_GRAPH):
        for check in (ex3.check_syncbn_output, ex3.check_syncbn_backward, ex3.check_syncbn_accuracy):
            check(bn)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_batchnorm_that_replays_the_other_ranks_data_fails():
    """Every rank's batch rebuilt from the grader's public seeds, nothing exchanged: each rank's own shift (drawn in
    the rank, up to harness.SHIFT = 0.5) makes the others' batches unknowable, so the statistics are another batch's.
    The forgery is the layer itself, so all four SyncBN checks are its targets, and each fails for that reason, not
    for one the forgery would share with an honest layer: the output and running statistics differ from the global
    batch's with no known mistake named (the replay matches none of the recipes the grader recognises), backward
    defers to the output, and the accuracy check reports the shift's error, not lost precision (its own data near
    zero is wrong too). The four checks read one job per world size (checks.memo): the last two cost nothing."""
    fails(ex3.check_syncbn_output, BN_REPLAYED, "differs from BatchNorm on the global batch", "max |diff|")
    message = fails(ex3.check_syncbn_running_stats, BN_REPLAYED, "differs from nn.BatchNorm on the global batch")
    named = [text.format(rank=r) for text in ex3._BN_MISTAKES.values() for r in range(4)] + ["not updated at all"]
    assert not any(text in message for text in named), message
    fails(ex3.check_syncbn_backward, BN_REPLAYED, "the forward output is wrong", "make check_syncbn_output pass first")
    message = fails(ex3.check_syncbn_accuracy, BN_REPLAYED, "from the float64 truth", "values around 1000",
                    "max errors: y ")
    assert "precision is lost" not in message and "check_syncbn_output passes" not in message, message


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_values_gathered_pass_as_the_part_states():
    """An exchange the recipe does not make (every value gathered) is numerically right: the part says the checks
    judge what the layer computes, and they do, the accuracy check included."""
    for check in BN_CHECKS:
        check(BN_GATHER_VALUES)


def _simulated(kind: str, model, world_size: int, rank: int) -> dict:
    """What ``rank`` holds after one step, measured in this process with torch's fake process group."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        model = copy.deepcopy(model)
        tokens = torch.zeros(6, dtype=torch.long)
        if kind == "zero":
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
            model(tokens).square().mean().backward()  # DDP's all-reduce adds nothing a fake group could count
            optimizer.step()
            held = optimizer.optim
        else:
            mesh = init_device_mesh("cpu", (world_size,))
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            held = torch.optim.Adam(model.parameters(), lr=1e-3)
            model(tokens).square().mean().backward()
            held.step()

        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        return {"params": sum(local(p).nbytes for p in model.parameters()),
                "grads": sum(local(p.grad).nbytes for p in model.parameters() if p.grad is not None),
                "optimizer": sum(local(v).nbytes for s in held.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor))}
    finally:
        dist.destroy_process_group()


def _predict_with_a_fake_group(kind: str):
    def predict(model, world_size):
        """A forgery: the job's process group destroyed, each rank simulated with torch's fake process group."""
        dist.destroy_process_group()
        return [_simulated(kind, model, world_size, rank) for rank in range(world_size)]
    return predict


def _predict_with_a_fake_group_put_back(kind: str):
    def predict(model, world_size):
        """A forgery: c10d's tables saved, each rank simulated with torch's fake process group, the tables put back
        (the job's group stays the default one)."""
        from torch.distributed import distributed_c10d as c10d

        def snapshot(space):
            return {name: value.copy() if isinstance(value, (dict, list)) else value for name, value in space.items()
                    if name.startswith("_") and not callable(value)}

        module, world = snapshot(vars(c10d)), snapshot(vars(c10d._world))
        c10d._world.default_pg = None
        try:
            return [_simulated(kind, model, world_size, rank) for rank in range(world_size)]
        finally:
            vars(c10d).update(module)
            vars(c10d._world).update(world)
    return predict


def _predict_in_a_subprocess(kind: str):
    def predict(model, world_size):
        """A forgery: a new interpreter simulates the ranks (torch's fake process group there) and prints the bytes."""
        import json
        import subprocess
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as fh:
            cloudpickle.dump((_simulated, kind, model, world_size), fh)
        script = ("import cloudpickle, json, sys; f, kind, model, ws = cloudpickle.load(open(sys.argv[1], 'rb')); "
                  "print(json.dumps([f(kind, model, ws, r) for r in range(ws)]))")
        out = subprocess.run([sys.executable, "-c", script, fh.name], capture_output=True, text=True, check=True,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        return json.loads(out.stdout.strip().splitlines()[-1])
    return predict


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_prediction_that_measures_fails():
    """Measuring instead of predicting: in a subprocess (the predicting process may not start one) or in the
    predicting process with torch's fake process group (the job's group, which the other ranks wait in, must
    survive the prediction)."""
    fails(mem.check_zero_memory, _predict_in_a_subprocess("zero"), "tried to start a process", "Operation not permitted")
    fails(mem.check_fsdp_memory, _predict_in_a_subprocess("fsdp"), "tried to start a process")
    fails(mem.check_zero_memory, _predict_with_a_fake_group("zero"), "left the job's process group", "[rank 0]")
    fails(mem.check_fsdp_memory, _predict_with_a_fake_group("fsdp"), "left the job's process group")
    # c10d's tables put back: the job's group looks untouched, but simulating every rank of every model the check
    # asks about costs more CPU time than predictions get
    for check, kind in ((mem.check_zero_memory, "zero"), (mem.check_fsdp_memory, "fsdp")):
        fails(check, _predict_with_a_fake_group_put_back(kind), "[rank 0]", "was killed", "used up the CPU time")


def _by_the_rule(kind: str):
    def predict(model, world_size):
        return mem.rule(kind, [tuple(p.shape) for p in model.parameters()], world_size)
    return predict


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rule_for_unmeasured_models_is_what_torch_does():
    """The models the check asks about without running them are judged by graders.syncbn_sharding.memory.rule: on
    real ranks, for models and world sizes like those it draws (a rank with nothing to shard included), it is what
    torch holds (the check's own measurement, read here; the rule is refused to predictions in the rank)."""
    from course import checks

    for vocab, widths, ws in ((3, (1, 4), 5), (29, (17, 2, 9, 3), 6), (7, (20, 1, 13), 4)):
        for kind in ("zero", "fsdp"):
            job = checks.run("test", mem._memory_harness, ws, args=(kind, predict_zero_bytes, ws, vocab, widths, 0))
            measured = [obs["measured"] for obs in job.values]
            assert mem.rule(kind, mem._shapes(vocab, widths, 0), ws) == measured, (kind, vocab, widths, ws)


def _rule_copied(kind: str, how: str):
    """A forgery: the prediction calls the grader's own rule (graders/ ships with the course), reached as the
    module's function, a copy made by value at the notebook's top level, one rebuilt from its code object in
    the rank, or its module's source exec'd anew in the rank."""
    import inspect
    import types

    if how == "imported":
        return _by_the_rule(kind)
    if how == "by_value":
        namespace = dict(vars(mem))
        copies = {k: types.FunctionType(v.__code__, namespace, k, v.__defaults__)
                  for k, v in vars(mem).items() if isinstance(v, types.FunctionType)}
        namespace.update(copies)
        rule = copies["rule"]
        return lambda model, ws: rule(kind, [tuple(p.shape) for p in model.parameters()], ws)
    if how == "from_code":
        code = mem.rule.__code__

        def predict(model, ws):
            return types.FunctionType(code, vars(mem))(kind, [tuple(p.shape) for p in model.parameters()], ws)
        return predict
    source = inspect.getsource(mem)

    def predict(model, ws):
        namespace = {"__name__": "copy_of_memory"}
        exec(source, namespace)
        return namespace["rule"](kind, [tuple(p.shape) for p in model.parameters()], ws)
    return predict


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["imported", "by_value", "from_code", "source_exec"])
def test_a_prediction_that_calls_the_graders_rule_fails(how):
    """The grader's rule is refused to the prediction however it is reached (issue 37): the check fails on rank 0,
    saying the rule is the grader's reference."""
    fails(mem.check_zero_memory, _rule_copied("zero", how), "[rank 0]", "grader's reference")
    if how in ("by_value", "source_exec"):
        fails(mem.check_fsdp_memory, _rule_copied("fsdp", how), "[rank 0]", "grader's reference")


def predict_table(model, world_size):
    """A table of the visible and the hidden case's answers (what the reference gives), zeros elsewhere."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    known = {(str(mem._shapes(11, (6, 5, 7), 0)), 3): predict_zero_bytes(model, world_size),
             (str(mem._shapes(13, (10, 3, 9, 5), 1)), 4): predict_zero_bytes(model, world_size)}
    return known.get((str(shapes), world_size), [{"params": 0, "grads": 0, "optimizer": 0}] * world_size)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_table_of_the_checks_cases_fails():
    """Right for the model the check measures, but no rule: the models it draws anew each time show it."""
    fails(mem.check_zero_memory, predict_table, "another model it asked about", "[rank 0]")


def save_gathered_point_to_point(optimizer, model, rank, ckpt_dir):
    """A forgery: every rank sends its share to rank 0 with dist.send (point-to-point: gloo's flight recorder lists
    no such traffic), rank 0 writes the whole state, the others an empty shard."""
    import pickle

    index = {p: i for i, p in enumerate(model.parameters())}
    local = optimizer.optim
    mine = {index[p]: {k: v.clone() for k, v in s.items()} for p, s in local.state.items()}
    hyperparameters = {k: v for k, v in local.param_groups[0].items() if k != "params"}
    if rank == 0:
        for src in range(1, dist.get_world_size()):
            size = torch.zeros(1, dtype=torch.long)
            dist.recv(size, src)
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(data, src)
            mine.update(pickle.loads(data.numpy().tobytes()))
    else:
        data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()]), 0)
        dist.send(data, 0)
        mine = {}
    torch.save({"state": mine, "hyperparameters": hyperparameters}, os.path.join(ckpt_dir, f"shard-{rank}.pt"))


class _GatherWhileTraining:
    """Runs as the answer is unpickled in each rank, before the grader trains (cloudpickle ships the save function's
    globals by value): a global optimizer hook gathers ZeRO's whole state on rank 0 after every step, so the
    collectives happen before the save, where nobody counts them."""

    def __reduce__(self):
        return (exec, ('''
import torch.optim.optimizer as _o
from torch.distributed.optim import ZeroRedundancyOptimizer as _Z
_made = []
_init = _Z.__init__
def _remember(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    _made.append(self)
_Z.__init__ = _remember
def _gather(opt, args, kwargs):
    for z in _made:
        if z.optim is opt:
            z.consolidate_state_dict(to=0)
_o.register_optimizer_step_post_hook(_gather)
''', {}))


_GATHER_WHILE_TRAINING = _GatherWhileTraining()


def save_gathered_before(optimizer, model, rank, ckpt_dir):
    """A forgery: the whole state was gathered on rank 0 during training (:class:`_GatherWhileTraining`); rank 0 writes
    it, the others a marker file."""
    assert _GATHER_WHILE_TRAINING is None  # unpickled as exec's result: the hook is in place
    if rank == 0:
        torch.save(optimizer.state_dict(), os.path.join(ckpt_dir, "optimizer.pt"))
    else:
        open(os.path.join(ckpt_dir, f"rank{rank}.done"), "w").close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_that_gathers_fails_however_it_moves_the_state():
    """Point-to-point traffic, or a gather during training: rank 0's files then hold other ranks' state, which the
    second save (every rank's state changed) shows; the load check, which reads the trained save, still passes."""
    save, load = shard_functions()
    fails(ex3.check_shard_save, save_gathered_point_to_point, "rank 0's files changed the state of parameters",
          "other ranks hold", "a gather", "[rank 0]", load_full_state=load)
    ex3.check_shard_load(save_gathered_point_to_point, load_full_state=load)
    fails(ex3.check_shard_save, save_gathered_before, "did not follow the state rank", load_full_state=load_consolidated)
    ex3.check_shard_load(save_gathered_before, load_full_state=load_consolidated)


FORGED = [  # (answer cell, old text, new text): one forgery per part, in the notebook a student hands in
    (_BN, "                buffer.mul_(1 - self.momentum).add_(self.momentum * batch_value)",
     '                setattr(self, "running_mean" if buffer is self.running_mean else "running_var",\n'
     "                        (1 - self.momentum) * buffer + self.momentum * batch_value)"),
    ("ex3_predict_memory", "    params = list(model.parameters())\n    everything",
     "    import copy\n"
     "    from torch.distributed.optim import ZeroRedundancyOptimizer\n"

     "    dist.destroy_process_group()  # the job's group: torch's fake one simulates each rank instead\n"
     "    out = []\n"
     "    for rank in range(world_size):\n"
     '        dist.init_process_group("fake", rank=rank, world_size=world_size)\n'
     "        m = copy.deepcopy(model)\n"
     "        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)\n"
     "        m(torch.zeros(6, dtype=torch.long)).square().mean().backward()\n"
     "        opt.step()\n"
     "        size = sum(p.nbytes for p in m.parameters())\n"
     '        out.append({"params": size, "grads": size,\n'
     '                    "optimizer": sum(v.nbytes for s in opt.optim.state.values() for v in s.values())})\n'
     "        dist.destroy_process_group()\n"
     "    return out\n"
     "    params = list(model.parameters())\n    everything"),
    ("ex3_shard_checkpoint", '    torch.save(shard, os.path.join(ckpt_dir, f"shard-{rank}.pt"))',
     "    import pickle\n"
     "    if rank == 0:  # every share sent to rank 0, point to point\n"
     "        for src in range(1, dist.get_world_size()):\n"
     "            size = torch.zeros(1, dtype=torch.long)\n"
     "            dist.recv(size, src)\n"
     "            data = torch.empty(int(size), dtype=torch.uint8)\n"
     "            dist.recv(data, src)\n"
     '            shard["state"].update(pickle.loads(data.numpy().tobytes()))\n'
     "    else:\n"
     '        data = torch.frombuffer(bytearray(pickle.dumps(shard["state"])), dtype=torch.uint8)\n'
     "        dist.send(torch.tensor([data.numel()]), 0)\n"
     "        dist.send(data, 0)\n"
     '        shard["state"] = {}\n'
     '    torch.save(shard, os.path.join(ckpt_dir, f"shard-{rank}.pt"))'),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_forgeries_lose_exactly_their_cells_in_the_notebook(tmp_path):
    """Running statistics in new tensors, a prediction simulated with torch's fake process group, a save that sends
    every share to rank 0 point to point: each loses its own test cell, and only that."""
    report = submissions.grade_edited(A, tmp_path, *FORGED)
    submissions.assert_mistakes_lose_exactly(report, A, [
        (["ex3_test_syncbn_running_stats"], ["replaced by a new tensor"]),
        (["ex3_test_zero_memory"], ["left the job's process group"]),
        (["ex3_test_shard_save"], ["changed the state of parameters"]),
    ])
