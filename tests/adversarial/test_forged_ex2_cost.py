"""Forgeries of ddp_from_scratch part 3 (what a step costs, :mod:`graders.ddp_from_scratch.cost`; issue 37): a student who
read the public graders/ source and "predicts" by measuring or by calling the grader's own model.

* the course's cost model bound at the notebook's top level (the grader replaced the module's attributes,
  not the functions a student's global already held), or reloaded (``importlib.reload``) or re-executed from
  its file to undo the grader's patch;
* the cost model copied so that the copy travels by value: every function rebuilt with ``types.FunctionType`` at
  the notebook's top level (a function the module does not hold is pickled by value, so the rank's patch of the
  module never touched it), the module registered with ``cloudpickle.register_pickle_by_value``, its code
  objects carried and made into functions in the rank, its source read at the top level and exec'd in the rank
  (no file opened there);
* a plan measured by running the steps in torch's fake process group (in-process, no peer needed);
* a plan measured by running the grader's own job (``graders.ddp_from_scratch.cost.measured``: ranks forked from the
  launcher, i.e. new processes).

Each must score 0 on the cell it targets (check_step_plan or check_step_cost); the other keeps its points.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import submissions

import graders.ddp_from_scratch.cost as cost
from course.costmodel import Link as _Link
from course.costmodel import step_collectives as _bound_plan
from course.costmodel import step_cost as _bound_cost

cloudpickle.register_pickle_by_value(sys.modules[__name__])
import course.costmodel as _BY_VALUE  # noqa: E402 - a module global the by-value forgery reaches

fails = submissions.fails


def plan_bound(layers, world_size, strategy, bucket_cap_mb):
    return _bound_plan(layers, world_size, strategy, bucket_cap_mb)


def cost_bound(plan, world_size, alpha, bandwidth):
    c = _bound_cost(plan, world_size, _Link(alpha, bandwidth))
    return c.bytes_sent, c.seconds


def cost_reloaded(plan, world_size, alpha, bandwidth):
    import importlib

    import course.costmodel as cm

    cm = importlib.reload(cm)
    c = cm.step_cost(plan, world_size, cm.Link(alpha, bandwidth))
    return c.bytes_sent, c.seconds


def plan_exec_source(layers, world_size, strategy, bucket_cap_mb):
    import course.costmodel as cm

    space = {"__name__": "cm_copy"}
    with open(cm.__file__) as f:
        exec(compile(f.read(), "cm_copy.py", "exec"), space)
    return space["step_collectives"](layers, world_size, strategy, bucket_cap_mb)


def _copied_model() -> dict:
    """course.costmodel's functions rebuilt from their code objects, here (the notebook's top level)."""
    import types

    import course.costmodel as cm

    space = dict(vars(cm))
    space.update({k: types.FunctionType(v.__code__, space, k, v.__defaults__)
                  for k, v in vars(cm).items() if isinstance(v, types.FunctionType)})
    return space


_COPY = _copied_model()


def plan_by_value(layers, world_size, strategy, bucket_cap_mb):
    return _COPY["step_collectives"](layers, world_size, strategy, bucket_cap_mb)


def cost_by_value(plan, world_size, alpha, bandwidth):
    c = _COPY["step_cost"](plan, world_size, _COPY["Link"](alpha, bandwidth))
    return c.bytes_sent, c.seconds


_CODES = {k: v.__code__ for k, v in _copied_model().items() if hasattr(v, "__code__") and k[0] != "_"}


def plan_from_code(layers, world_size, strategy, bucket_cap_mb):
    """The model's code objects travel as data; functions are made of them in the rank."""
    import math
    import types

    space = {"math": math}
    space.update({k: types.FunctionType(code, space, k) for k, code in _CODES.items()})
    return space["step_collectives"](layers, world_size, strategy, bucket_cap_mb)


def _source() -> str:
    import course.costmodel as cm

    with open(cm.__file__) as f:
        return f.read()


_SOURCE = _source()


def plan_source_carried(layers, world_size, strategy, bucket_cap_mb):
    """The model's source read here, exec'd in the rank (no file opened there)."""
    space = {"__name__": "cm_copy"}
    exec(compile(_SOURCE, "cm_copy.py", "exec"), space)
    return space["step_collectives"](layers, world_size, strategy, bucket_cap_mb)


def plan_module_by_value(layers, world_size, strategy, bucket_cap_mb):
    return _BY_VALUE.step_collectives(layers, world_size, strategy, bucket_cap_mb)


def plan_fake_pg(layers, world_size, strategy, bucket_cap_mb):
    """Runs three steps of the strategy on torch's fake process group (rank 0 of world_size, no peers)
    and records the collectives with the grader's own spy."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from graders.common import comm_spy

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    dims = [layers[0][0][1]] + [layer[0][0] for layer in layers]
    seq = []
    for a, b in zip(dims, dims[1:]):
        seq += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*seq[:-1])
    x = torch.randn(4, dims[0])
    if strategy in ("ddp", "zero"):  # DDP's buckets, as its reducer forms them; ZeRO adds one broadcast a parameter
        numels = [p.numel() for p in model.parameters()]
        cap = int(bucket_cap_mb * 2**20)
        buckets, _ = dist._compute_bucket_assignment_by_size(
            [p for p in reversed(list(model.parameters()))], [cap])
        rev = numels[::-1]
        plan = [("all_reduce", sum(rev[i] for i in b)) for b in buckets]
        return plan + ([("broadcast", n) for n in numels] if strategy == "zero" else [])
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    wrapped = fully_shard(model)
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    for _ in range(3):
        mode, records = comm_spy.spy()
        with mode:
            wrapped(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return [(r["op"], sum(v.numel() for v in r["values"]) * (world_size if r["op"] == "all_gather" else 1))
            for r in records]


def plan_real_job(layers, world_size, strategy, bucket_cap_mb):
    """Runs the grader's own measuring job (real ranks, forked by the course's launcher)."""
    from graders.ddp_from_scratch import cost as ex2_cost

    dims = [layers[0][0][1]] + [layer[0][0] for layer in layers]
    return ex2_cost.measured("forged", tuple(dims), world_size, bucket_cap_mb)[strategy]


# --- the tests ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_grader_s_model_reloaded_or_bound_is_refused():
    fails(cost.check_step_cost, cost_bound, "step_cost raised RuntimeError", "the grader's model")
    fails(cost.check_step_cost, cost_reloaded, "step_cost raised PermissionError", "refused by the grader's sandbox")
    fails(cost.check_step_plan, plan_bound, "plan_step raised RuntimeError", "the grader's model")
    fails(cost.check_step_plan, plan_exec_source, "plan_step raised PermissionError",
          "refused by the grader's sandbox", "must predict, not measure")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_copy_of_the_graders_model_made_by_value_from_code_or_from_source_is_refused():
    """Copies that reach the rank as new objects (issue 37): each refuses there as the module's own functions do."""
    fails(cost.check_step_cost, cost_by_value, "step_cost raised RuntimeError", "the grader's model")
    fails(cost.check_step_plan, plan_by_value, "plan_step raised RuntimeError", "the grader's model")
    fails(cost.check_step_plan, plan_from_code, "plan_step raised RuntimeError", "the grader's model")
    fails(cost.check_step_plan, plan_source_carried, "plan_step raised RuntimeError", "the grader's model")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_graders_model_registered_to_travel_by_value_is_refused():
    import course.costmodel as cm

    cloudpickle.register_pickle_by_value(cm)
    try:
        fails(cost.check_step_plan, plan_module_by_value, "plan_step raised RuntimeError", "the grader's model")
    finally:
        cloudpickle.unregister_pickle_by_value(cm)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plan_measured_in_a_fake_process_group_or_a_real_job_fails():
    fails(cost.check_step_plan, plan_fake_pg, "plan_step raised", "can't allocate memory", "must predict, not measure")
    fails(cost.check_step_plan, plan_real_job, "plan_step raised PermissionError", "refused by the grader's sandbox")
    cost.check_step_cost(_right_cost)  # the other cell keeps its points


def _right_cost(plan, world_size, alpha, bandwidth):
    n, sent, seconds = world_size, 0.0, 0.0
    for op, numel in plan:
        size = 4 * numel
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        share = (2 if op == "all_reduce" else 1) * (n - 1) / n * size
        busiest = size if op == "broadcast" else share
        sent += share
        seconds += steps * alpha + busiest / bandwidth
    return sent, seconds


def test_giant_models_are_drawn_anew_and_cannot_be_built():
    a, b = cost.giant_models(), cost.giant_models()
    assert a != b
    for layers, world_size, _cap in a + b:
        assert 16 <= world_size < 130
        for (rows, cols), _bias in layers:
            assert rows * cols >= 10**10 and rows % world_size != 0
