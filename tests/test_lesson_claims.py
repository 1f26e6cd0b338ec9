"""The lessons' claims about torch's internals, checked against the installed torch and against the lessons' text.

Each claim is checked twice: live (a real 2-rank gloo job, or the function torch itself calls) and in the
lesson's prose (the corrected statement is there, the old wrong one is not). A torch release that changes
the behaviour fails the first kind; an edit that brings an old statement back fails the second.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import course

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
LAYER_BYTES = (256 * 256 + 256) * 4  # one nn.Linear(256, 256): its weight and bias gradients, float32


def prose(key: str) -> str:
    """A lesson's markdown, whitespace collapsed (line breaks in a sentence do not matter)."""
    [path] = LESSONS.glob(f"{key}-*.ipynb")
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())


def code(key: str) -> str:
    [path] = LESSONS.glob(f"{key}-*.ipynb")
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


# --- what runs on the ranks (module level: shipped by reference) -------------------------------------------


def _no_op_hook(sizes):
    """A DDP communication hook that notes each bucket's bytes (per step: sizes[-1]) and returns it unreduced."""

    def hook(state, bucket):
        sizes[-1].append(bucket.buffer().numel() * bucket.buffer().element_size())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    return hook


def bucket_bytes_per_step(rank, bucket_cap_mb, steps=3):
    """Six Linear(256, 256) layers under DDP: the bytes of every bucket DDP hands its hook, per step."""
    dist.init_process_group(course.backend())
    torch.manual_seed(0)
    options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp_model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]), **options)
    sizes = []
    ddp_model.register_comm_hook(None, _no_op_hook(sizes))
    x = torch.randn(8, 256)
    for _ in range(steps):
        sizes.append([])
        ddp_model(x).sum().backward()
    del ddp_model
    dist.destroy_process_group()
    return sizes


class Reversed(nn.Module):
    """Three layers used in the reverse of the order they are registered in."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        return self.a(self.b(self.c(x)))


def ready_and_launched(rank):
    """One backward of Reversed under DDP with buckets in registration order (find_unused_parameters=True: capped
    from the first step, never rebuilt); the events in order: ("ready", param name) when a gradient is
    accumulated, ("launch", bucket index, its param names) when DDP hands the bucket to its hook."""
    dist.init_process_group(course.backend())
    torch.manual_seed(0)
    model = Reversed()
    ddp_model = DDP(model, bucket_cap_mb=0.3, find_unused_parameters=True)
    names = {id(p): n for n, p in model.named_parameters()}
    events = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("ready", name)))

    def hook(state, bucket):
        events.append(("launch", bucket.index(), [names[id(p)] for p in bucket.parameters()]))
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp_model.register_comm_hook(None, hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # find_unused_parameters=True found none: the point here is the buckets
        ddp_model(torch.randn(4, 256)).sum().backward()
    del ddp_model
    dist.destroy_process_group()
    return events


def _batch_norm_stats(x, eps):
    dims = [0] + list(range(2, x.dim()))
    return x.mean(dims), torch.rsqrt(x.var(dims, unbiased=False) + eps)


def _gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    counts = counts.view(-1, 1)
    n = counts.sum()
    mean = (counts * mean_all).sum(0) / n
    var = (counts * (invstd_all.pow(-2) - eps + (mean_all - mean).pow(2))).sum(0) / n
    return mean, torch.rsqrt(var + eps)


def _batch_norm_elemt(x, weight, bias, mean, invstd, eps):
    shape = [1, -1] + [1] * (x.dim() - 2)
    return (x - mean.view(shape)) * invstd.view(shape) * weight.view(shape) + bias.view(shape)


def syncbn_exchange(rank, inputs):
    """torch's SyncBatchNorm forward (the autograd function nn.SyncBatchNorm calls) on this rank's slice, on CPU:
    its three CUDA-only kernels replaced by plain torch, every collective spied. Returns what was sent and how."""
    dist.init_process_group(course.backend())
    torch.batch_norm_stats = _batch_norm_stats  # CUDA-only kernels in torch 2.13: CPU stand-ins
    torch.batch_norm_gather_stats_with_counts = _gather_stats_with_counts
    torch.batch_norm_elemt = _batch_norm_elemt
    sent = []
    for op in ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce", "broadcast"):
        real = getattr(dist, op)

        def spy(*args, op=op, real=real, **kwargs):
            tensor = args[1] if op != "all_reduce" and op != "broadcast" else args[0]
            sent.append((op, tensor.clone()))
            return real(*args, **kwargs)

        setattr(dist, op, spy)
    x = inputs[rank]
    channels = x.shape[1]
    out = torch.nn.modules._functions.SyncBatchNorm.apply(
        x, torch.ones(channels), torch.zeros(channels), torch.zeros(channels), torch.ones(channels), 1e-5, 0.1,
        dist.group.WORLD, dist.get_world_size())
    dist.destroy_process_group()
    return {"sent": sent, "out": out.detach()}


def deprecation_warnings(rank):
    """The warnings torch.distributed.nn.functional.all_reduce gives when it is called."""
    dist.init_process_group(course.backend())
    from torch.distributed.nn.functional import all_reduce

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        all_reduce(torch.ones(2, requires_grad=True))
    dist.destroy_process_group()
    return [(w.category.__name__, str(w.message)) for w in caught]


# --- claim 1: one bucket in the first step; capped buckets after the rebuild, the first at 1 MiB by default ---


def expected_rebuilt(tensor_bytes, first_cap, cap):
    """Buckets as the lessons describe them: tensors in arrival order; a bucket closes once it reaches its cap."""
    buckets, current = [], 0
    for size in tensor_bytes:
        current += size
        if current >= (first_cap if not buckets else cap):
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def arrival_order_bytes():
    """Gradient bytes of the six layers in the order backward produces them: last layer first, bias before weight."""
    return [256 * 4, 256 * 256 * 4] * 6


def test_first_step_one_bucket_then_rebuilt_with_a_1_mib_first_bucket():
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20  # "1 MiB", as lessons 1 and 2 say
    per_rank = course.run_ranks(bucket_bytes_per_step, 2, args=(None,), backend="gloo", echo=False, timeout=60)
    for sizes in per_rank:
        assert sizes[0] == [6 * LAYER_BYTES], sizes  # step 1: one bucket for every gradient
        rebuilt = expected_rebuilt(arrival_order_bytes(), dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20)
        assert sizes[1] == sizes[2] == rebuilt == [4 * LAYER_BYTES, 2 * LAYER_BYTES], sizes


def test_an_explicit_cap_caps_the_first_rebuilt_bucket_too():
    per_rank = course.run_ranks(bucket_bytes_per_step, 2, args=(0.3,), backend="gloo", echo=False, timeout=60)
    cap = int(0.3 * 2**20)
    for sizes in per_rank:
        assert sizes[0] == [6 * LAYER_BYTES], sizes
        assert sizes[1] == expected_rebuilt(arrival_order_bytes(), cap, cap) == [2 * LAYER_BYTES] * 3, sizes


def test_lessons_say_the_first_step_has_one_bucket():
    two, one = prose("02"), prose("01")
    assert "the **first step has one bucket for all the gradients**" in two
    assert "`dist._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB" in two
    assert "the first bucket takes layers until it reaches 1 MiB (the fourth layer crosses it and stays)" in two
    assert "how many there are depends on the torch version" not in two
    assert "Not in the first step: there every gradient goes in one bucket" in one
    assert "(25 MiB by default, the first one 1 MiB)" in one


# --- claim 2: a bucket closes once it reaches or exceeds its cap ----------------------------------------------


def test_a_bucket_closes_once_it_reaches_the_cap():
    five = [torch.empty(256) for _ in range(5)]  # 1 KiB each
    assert dist._compute_bucket_assignment_by_size(five, [2048])[0] == [[0, 1], [2, 3], [4]]  # reaches: closes
    assert dist._compute_bucket_assignment_by_size(five, [2047])[0] == [[0, 1], [2, 3], [4]]  # exceeds: closes
    assert dist._compute_bucket_assignment_by_size(five, [2049])[0] == [[0, 1, 2], [3, 4]]  # below: stays open


def test_ddp_closes_a_rebuilt_bucket_that_holds_exactly_its_cap():
    # 257/512 MiB is exactly two layers' gradients: closing on "exceeds" would make buckets of three layers
    cap_mb = 2 * LAYER_BYTES / 2**20
    assert cap_mb == 257 / 512
    per_rank = course.run_ranks(bucket_bytes_per_step, 2, args=(cap_mb,), backend="gloo", echo=False, timeout=60)
    for sizes in per_rank:
        assert sizes[1] == [2 * LAYER_BYTES] * 3, sizes


def test_lesson_2_says_reaches_or_exceeds():
    two = prose("02")
    assert "A bucket closes as soon as it *reaches or exceeds* the cap" in two
    assert "closes only once it *exceeds*" not in two
    assert "a bucket closes once it reaches its cap" in two  # the summary


# --- claim 3: buckets are launched in index order --------------------------------------------------------------


def test_a_ready_bucket_waits_for_the_buckets_before_it():
    [events, _] = course.run_ranks(ready_and_launched, 2, backend="gloo", echo=False, timeout=60)
    ready = [name for kind, name, *_ in events if kind == "ready"]
    launches = [(e[1], e[2], events.index(e)) for e in events if e[0] == "launch"]
    assert [index for index, _, _ in launches] == sorted(index for index, _, _ in launches), launches

    def ready_at(names):
        return max(events.index(("ready", name)) for name in names)

    for index, _names, at in launches:  # no bucket starts before every bucket up to it is ready
        assert at > max(ready_at(n) for i, n, _ in launches if i <= index), events
    # and one bucket was complete before bucket 0 yet waited for it: launched only after bucket 0's last gradient
    (_, first, first_at), *later = launches
    waited = [(names, at) for _, names, at in later if ready_at(names) < ready_at(first)]
    assert waited and all(at > first_at for _, at in waited), events
    assert len(ready) == 6


def test_lessons_say_buckets_launch_in_order():
    two, one = prose("02"), prose("01")
    assert "DDP launches the all-reduces **in bucket order**" in two
    assert '"Buckets are reduced in sequence"' in two
    assert 'as soon as a group ("bucket") of gradients is ready, DDP starts' not in two
    assert "When the last gradient of a bucket is ready, the hook launches that bucket's all-reduce" not in two
    assert "launches the buckets' all-reduces one after another, in bucket order" in one
    assert "launches each bucket's all-reduce during backward" not in one


# --- claim 4: casting the wrapped model keeps the Parameters, replaces their gradient accumulators -------------


def test_a_dtype_change_through_data_keeps_the_parameter_and_resets_its_accumulator():
    layer = nn.Linear(4, 2)
    params = list(layer.parameters())
    before = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
    layer.to(torch.bfloat16)
    assert all(p is q for p, q in zip(params, layer.parameters()))
    assert all(p.view_as(p).grad_fn.next_functions[0][0] is not a for p, a in zip(params, before))
    two = prose("02")
    assert "The `Parameter` objects stay the same" in two
    assert "resets each parameter's gradient accumulator" in two
    assert "the parameters get new bf16 tensors" not in two


# --- claim 5: which ZeRO sends what ------------------------------------------------------------------------------


def test_lesson_1_tells_torchs_zero_from_deepspeeds():
    one = prose("01")
    assert "ZeRO** as torch's `ZeroRedundancyOptimizer` does it" in one
    assert "ZeRO stages 1 and 2 as the ZeRO paper and DeepSpeed run them send no more than DDP" in one
    assert "ZeRO stages 1-2 as DeepSpeed runs them as much as DDP" in one
    assert "ZeRO as much as FSDP" not in one


# --- claim 6: the tree is a toy model ------------------------------------------------------------------------------


def test_lesson_1_labels_the_tree_a_toy_model():
    one = prose("01")
    assert "This is a **toy model**: NCCL's tree is a *double* binary tree" in one
    assert "toy alpha-beta model, unpipelined tree" in code("01")


# --- claim 7: SyncBatchNorm all-gathers (mean, invstd, count) ------------------------------------------------------


def test_syncbatchnorm_all_gathers_mean_invstd_and_count():
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(6, 3, 4, generator=g) * 2 + 5, torch.randn(10, 3, 4, generator=g) - 1]  # uneven counts
    per_rank = course.run_ranks(syncbn_exchange, 2, args=(inputs,), backend="gloo", echo=False, timeout=60)
    for x, result in zip(inputs, per_rank):
        [(op, sent)] = result["sent"]  # one collective in forward, and it is a gather
        assert op == "all_gather", result["sent"]
        dims = [0, 2]
        mean, var = x.mean(dims), x.var(dims, unbiased=False)
        want = torch.cat([mean, torch.rsqrt(var + 1e-5), torch.tensor([x.numel() / x.shape[1]])])
        torch.testing.assert_close(sent, want)
    whole = torch.cat(inputs)
    truth = nn.functional.batch_norm(whole, None, None, training=True)
    torch.testing.assert_close(torch.cat([r["out"] for r in per_rank]), truth, atol=1e-5, rtol=1e-5)


def test_lesson_3_says_what_syncbatchnorm_exchanges_and_why_a_gather():
    three = prose("03")
    assert "`all_gather` of these (mean, invstd, count) triples, not an `all_reduce`" in three
    assert "because the combination is not a plain sum" in three
    assert "since the counts may differ" not in three
    assert "all-gathers each rank's own (mean, invstd, count)" in three


# --- claim 8: bf16 needs no GradScaler anywhere ---------------------------------------------------------------------


def test_lesson_2_says_bf16_needs_no_grad_scaler_on_any_device():
    assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny  # float32's exponent range
    two = prose("02")
    assert "bf16 autocast needs no `GradScaler`, on a CPU or a GPU alike" in two
    assert "On a CPU, bf16 autocast needs no" not in two


# --- claim 8b: float16's range, and what a GradScaler starts from ---------------------------------------------------


def test_lesson_2_states_float16s_range_and_the_scalers_defaults():
    half = torch.finfo(torch.float16)
    assert half.max == 65504 and f"{half.smallest_normal:.1e}" == "6.1e-05" and f"{2.0**-24:.1e}" == "6.0e-08"
    assert torch.tensor(2.0**-26, dtype=torch.float16) == 0 and torch.tensor(2.0**-24, dtype=torch.float16) > 0
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.get_scale() == 2.0**16 and scaler.get_growth_interval() == 2000
    assert scaler.get_backoff_factor() == 0.5 and scaler.get_growth_factor() == 2.0
    two = prose("02")
    assert "Its largest value is 65504; its smallest normal one is 6.1e-5, and a value under half its smallest " \
           "subnormal (6.0e-8) rounds to zero" in two
    assert "(the *scale*, 2^16 to start)" in two and "doubles it again after 2000 steps without an overflow" in two
    assert "then halves the scale" in two


# --- claim 9: the functional collectives are deprecated, not "legacy" -----------------------------------------------


def test_functional_collectives_warn_deprecated():
    for caught in course.run_ranks(deprecation_warnings, 2, backend="gloo", echo=False, timeout=60):
        assert ("FutureWarning", "torch.distributed.nn.functional.all_reduce is deprecated, use "
                "torch.distributed._functional_collectives.all_reduce instead.") in caught, caught
    source = code("01")
    assert '# torch 2.13: "... is deprecated" (FutureWarning)' in source
    assert not re.search(r"legacy", source + prose("01"), re.I)
