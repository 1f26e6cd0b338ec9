"""ddp_from_scratch part 3, what a step costs (graders/ddp_from_scratch/cost.py; issue 28): the plan is judged against
what real DDP, ZeRO and FSDP2 steps ran, the cost against the ring alpha-beta model.

Right answers in several styles get full marks; each realistic mistake loses its check with a message
that names it; an answer that calls the course's own cost model is refused. The notebook itself is
graded at the end (reference: full marks; wrong answers: exactly their cells).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

import cloudpickle
import pytest
import submissions

import graders.ddp_from_scratch.cost as cost
from course import costmodel

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex2-ddp-basics", "ddp_from_scratch"
HIDDEN = {"widths": (9, 25, 14, 11, 3), "world_size": 3, "bucket_cap_mb": 0.0007, "seed": 2}
fails = submissions.fails


# --- right answers ---------------------------------------------------------------------------------------


def plan_step(layers, world_size, strategy, bucket_cap_mb):
    """The notebook's reference, in plain loops."""
    numels = [math.prod(shape) for layer in layers for shape in layer]
    plan = []
    if strategy in ("ddp", "zero"):
        bucket = 0
        for numel in reversed(numels):
            bucket += numel
            if bucket * 4 >= bucket_cap_mb * 2**20:
                plan.append(("all_reduce", bucket))
                bucket = 0
        if bucket:
            plan.append(("all_reduce", bucket))
        if strategy == "zero":
            plan += [("broadcast", numel) for numel in numels]
        return plan
    for layer in layers:
        padded = sum(-(-shape[0] // world_size) * world_size * math.prod(shape[1:]) for shape in layer)
        plan += [("all_gather", padded), ("all_gather", padded), ("reduce_scatter", padded)]
    return plan


class Planner:
    """Another style: a helper class, sizes from torch tensors, the FSDP unit's shards summed per rank."""

    def __init__(self, world_size):
        self.n = world_size

    def shard(self, shape):
        import torch

        rows = torch.empty(shape).tensor_split(self.n)[0].shape[0] if shape[0] % self.n == 0 else -(-shape[0] // self.n)
        return rows * int(torch.Size(shape[1:]).numel())

    def __call__(self, layers, strategy, cap_mb):
        import torch

        grads = [int(torch.Size(s).numel()) for layer in layers for s in layer][::-1]
        if strategy == "fsdp":
            sizes = [self.n * sum(self.shard(s) for s in layer) for layer in layers]
            return [(op, s) for s in sizes for op in ("all_gather", "reduce_scatter", "all_gather")]
        cap, buckets, acc = cap_mb * 1024 * 1024 / 4, [], []
        for g in grads:
            acc.append(g)
            if sum(acc) >= cap:
                buckets.append(sum(acc))
                acc = []
        buckets += [sum(acc)] if acc else []
        out = [("all_reduce", b) for b in buckets]
        return out + ([("broadcast", g) for g in grads] if strategy == "zero" else [])


def plan_by_class(layers, world_size, strategy, bucket_cap_mb):
    return tuple(Planner(world_size)(layers, strategy, bucket_cap_mb))


def plan_in_numpy(layers, world_size, strategy, bucket_cap_mb):
    """Right: the reference's plan with every count a numpy integer (sizes counted with np.prod)."""
    import numpy as np

    return [(op, np.int64(np.prod([numel]))) for op, numel in plan_step(layers, world_size, strategy, bucket_cap_mb)]


def step_cost(plan, world_size, alpha, bandwidth):
    """The notebook's reference."""
    n, sent, seconds = world_size, 0.0, 0.0
    for op, numel in plan:
        size = 4 * numel
        if op == "all_reduce":
            steps, share, busiest = 2 * (n - 1), 2 * (n - 1) / n * size, 2 * (n - 1) / n * size
        elif op == "broadcast":
            steps, share, busiest = n - 1, (n - 1) / n * size, size
        else:
            steps, share, busiest = n - 1, (n - 1) / n * size, (n - 1) / n * size
        sent += share
        seconds += steps * alpha + busiest / bandwidth
    return sent, seconds


def cost_by_table(plan, world_size, alpha, bandwidth):
    """Another style: a table of (steps, share, busiest) factors, numpy sums."""
    import numpy as np

    n = world_size
    factors = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n, 2 * (n - 1) / n), "broadcast": (n - 1, (n - 1) / n, 1.0),
               "all_gather": (n - 1, (n - 1) / n, (n - 1) / n), "reduce_scatter": (n - 1, (n - 1) / n, (n - 1) / n)}
    rows = np.array([(factors[op][0], factors[op][1] * 4 * k, factors[op][2] * 4 * k) for op, k in plan])
    return float(rows[:, 1].sum()), float((rows[:, 0] * alpha).sum() + (rows[:, 2] / bandwidth).sum())


# --- wrong answers ---------------------------------------------------------------------------------------


def plan_fsdp_gathers_once(layers, world_size, strategy, bucket_cap_mb):
    plan = plan_step(layers, world_size, strategy, bucket_cap_mb)
    if strategy != "fsdp":
        return plan
    seen, out = set(), []
    for op, k in plan:
        if op == "all_gather" and (op, k) in seen:
            continue
        seen.add((op, k))
        out.append((op, k))
    return out


def plan_fsdp_unpadded(layers, world_size, strategy, bucket_cap_mb):
    if strategy != "fsdp":
        return plan_step(layers, world_size, strategy, bucket_cap_mb)
    sizes = [sum(math.prod(s) for s in layer) for layer in layers]
    return [(op, s) for s in sizes for op in ("all_gather", "all_gather", "reduce_scatter")]


def plan_zero_without_broadcast(layers, world_size, strategy, bucket_cap_mb):
    plan = plan_step(layers, world_size, strategy, bucket_cap_mb)
    return [p for p in plan if p[0] != "broadcast"]


def plan_one_all_reduce_per_parameter(layers, world_size, strategy, bucket_cap_mb):
    if strategy == "fsdp":
        return plan_step(layers, world_size, strategy, bucket_cap_mb)
    numels = [math.prod(s) for layer in layers for s in layer]
    return [("all_reduce", k) for k in numels] + ([("broadcast", k) for k in numels] if strategy == "zero" else [])


def cost_whole_tensor(plan, world_size, alpha, bandwidth):
    """Every rank sends the whole tensor (forgets that a ring rank sends only its share)."""
    steps = {"all_reduce": 2 * (world_size - 1)}
    sent = sum(4 * k * (2 if op == "all_reduce" else 1) for op, k in plan)
    return sent, sum(steps.get(op, world_size - 1) * alpha for op, _ in plan) + sent / bandwidth


def cost_without_latency(plan, world_size, alpha, bandwidth):
    return step_cost(plan, world_size, 0.0, bandwidth)


def cost_broadcast_as_share(plan, world_size, alpha, bandwidth):
    """Times a broadcast by the mean bytes a rank sends, not by what its root sends."""
    n = world_size
    sent, seconds = step_cost(plan, world_size, alpha, bandwidth)
    extra = sum(4 * k * (1 - (n - 1) / n) for op, k in plan if op == "broadcast")
    return sent, seconds - extra / bandwidth


def cost_by_course_model(plan, world_size, alpha, bandwidth):
    from course import costmodel as cm

    c = cm.step_cost(plan, world_size, cm.Link(alpha, bandwidth))
    return c.bytes_sent, c.seconds


# --- the cost model itself ------------------------------------------------------------------------------


def test_the_model_s_figures_by_hand():
    link = costmodel.Link(alpha=1e-5, bandwidth=1e9)
    # 1 MB on 4 ranks: ring all-reduce sends 2 * 3/4 MB in 6 steps
    c = costmodel.collective_cost("all_reduce", 1e6, 4, link)
    assert c.bytes_sent == pytest.approx(1.5e6) and c.seconds == pytest.approx(6e-5 + 1.5e-3)
    c = costmodel.collective_cost("all_gather", 1e6, 4, link)
    assert c.bytes_sent == pytest.approx(0.75e6) and c.seconds == pytest.approx(3e-5 + 0.75e-3)
    c = costmodel.collective_cost("broadcast", 1e6, 4, link)
    assert c.bytes_sent == pytest.approx(0.75e6) and c.seconds == pytest.approx(3e-5 + 1e-3)
    c = costmodel.collective_cost("all_reduce", 1e6, 8, link, algorithm="tree")
    assert c.seconds == pytest.approx(6 * (1e-5 + 1e-3))
    assert costmodel.collective_cost("all_reduce", 1e6, 1, link) == (0.0, 0.0)


def test_small_messages_favour_the_tree_large_ones_the_ring():
    link = costmodel.MACHINES["InfiniBand NDR 400 Gb/s"]
    tree = lambda b: costmodel.collective_cost("all_reduce", b, 64, link, "tree").seconds  # noqa: E731
    ring = lambda b: costmodel.collective_cost("all_reduce", b, 64, link).seconds  # noqa: E731
    assert tree(1e3) < ring(1e3) and ring(1e8) < tree(1e8)


def test_fsdp_pads_dim0_and_ddp_buckets_keep_the_crossing_tensor():
    assert costmodel.fsdp_padded_numel((5, 20), 3) == 6 * 20 and costmodel.fsdp_padded_numel((6,), 3) == 6
    assert costmodel.ddp_buckets([300, 30, 600, 20, 100, 5], 0.001) == [725, 330]
    assert costmodel.ddp_buckets([300, 30, 600, 20, 100, 5], 0.0001) == [105, 620, 30, 300]


@pytest.mark.parametrize("world_size,widths,cap", [(2, (12, 32, 20, 6), 0.002), (3, (7, 13, 5), 0.0001)])
def test_the_model_s_plan_is_what_torch_ran(world_size, widths, cap):
    """course.costmodel.step_collectives against real DDP, ZeRO and FSDP2 steps of torch 2.13 on gloo."""
    truth = cost.measured("test", widths, world_size, cap)
    for strategy in cost.STRATEGIES:
        want = costmodel.step_collectives(cost.layer_shapes(widths), world_size, strategy, cap)
        assert sorted(truth[strategy]) == sorted(want), strategy


# --- the checks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [plan_step, plan_by_class, plan_in_numpy])
def test_right_plans_pass_visible_and_hidden(answer):
    cost.check_step_plan(answer)
    cost.check_step_plan(answer, **HIDDEN)


@pytest.mark.parametrize("answer", [step_cost, cost_by_table])
def test_right_costs_pass_visible_and_hidden(answer):
    cost.check_step_cost(answer)
    cost.check_step_cost(answer, **HIDDEN, machines=("InfiniBand NDR 400 Gb/s", "PCIe 4.0 x16"))


@pytest.mark.parametrize("answer,words", [
    (plan_fsdp_gathers_once, ["the plan for fsdp", "gathers each layer twice", "before its backward"]),
    (plan_fsdp_unpadded, ["the plan for fsdp", "padding dim 0"]),
    (plan_zero_without_broadcast, ["the plan for zero", "owns its optimizer state"]),
    (plan_one_all_reduce_per_parameter, ["the plan for ddp", "DDP reduces buckets"]),
])
def test_wrong_plans_fail_naming_the_mistake(answer, words):
    kwargs = HIDDEN if answer is plan_fsdp_unpadded else {}  # the visible model divides evenly at 2 ranks
    fails(cost.check_step_plan, answer, *words, **kwargs)
    cost.check_step_cost(step_cost, **kwargs)  # the other check is untouched


@pytest.mark.parametrize("answer,words", [
    (cost_whole_tensor, ["not the ring model's", "(N - 1) / N"]),
    (cost_without_latency, ["not the ring model's", "pays the latency alpha"]),
    (cost_broadcast_as_share, ["not the ring model's", "broadcast's root sends the whole tensor"]),
    (cost_by_course_model, ["step_cost raised", "the grader's model"]),
])
def test_wrong_costs_fail_naming_the_mistake(answer, words):
    fails(cost.check_step_cost, answer, *words)


def test_plans_and_costs_that_are_not_data_are_reported():
    fails(cost.check_step_plan, lambda layers, n, s, c: 42, "did not return (op, numel) pairs")
    fails(cost.check_step_plan, lambda layers, n, s, c: 1 / 0, "plan_step raised ZeroDivisionError")
    fails(cost.check_step_cost, lambda plan, n, a, b: "fast", "did not return (bytes, seconds)")


def test_an_unwritten_answer_is_not_written_yet():
    def plan_step(layers, world_size, strategy, bucket_cap_mb):
        raise NotImplementedError()

    fails(cost.check_step_plan, plan_step, "not written yet")


# --- the notebook ----------------------------------------------------------------------------------------


def _cells(nb, prefix):
    return [c.metadata.nbgrader["grade_id"] for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("grade_id", "").startswith(prefix)]


def test_the_notebook_s_cost_part_is_graded_by_these_checks():
    nb = submissions.load(A, NB)
    tests = defaultdict(str)
    for c in nb.cells:
        meta = c.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            tests[meta["grade_id"]] = c.source
    assert "graders.ddp_from_scratch.check_step_plan(plan_step)" in tests["ex2s_test_step_plan"]
    assert "graders.ddp_from_scratch.check_step_cost(step_cost)" in tests["ex2s_test_step_cost"]


def test_a_wrong_plan_in_the_notebook_loses_exactly_its_cell(tmp_path):
    """Graded as a notebook: FSDP gathered once per layer loses ex2s_test_step_plan and nothing else."""
    report = submissions.grade_edited(
        A, tmp_path, ("ex2s_step_cost", 'plan += [("all_gather", padded), ("all_gather", padded), ("reduce_scatter", padded)]',
                      'plan += [("all_gather", padded), ("reduce_scatter", padded)]'), notebook=NB)
    submissions.assert_loses_exactly(report, A, ["ex2s_test_step_plan"], ["the plan for fsdp", "before its backward"],
                                     notebook=NB)
