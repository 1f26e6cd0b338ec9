"""Exercise 1's expert-parallel notebook (graders.expert_parallel): each check catches its class of mistake.

The checks are called directly with the notebook's reference, right answers in other styles (torch's functional
collectives with autograd; a class that gathers the count table with an all-reduce and cats per-destination
lists), realistic mistakes and a forgery; then the notebook is graded with mistakes packed together.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.distributed.nn.functional
import torch.nn.functional as F

import graders.expert_parallel.checks as ep
from graders.expert_parallel.layer import Experts, ExpertServer, kept, reference, routing

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex1-parallelism", "expert_parallel"
HIDDEN = [dict(world_size=2, per_rank=3, tokens=10, capacity=3, seed=1),
          dict(world_size=4, per_rank=1, tokens=6, capacity=5, seed=2)]
CHECKS = (ep.check_moe_outputs, ep.check_moe_gradients, ep.check_moe_dispatch)
fails = submissions.fails


def _answer(name: str, *edits: tuple[str, str]):
    return submissions.answer_function(A, NB, "ep_moe_layer", "moe_layer", name,
                                       {"torch": torch, "dist": dist, "F": F, "__name__": __name__}, *edits)


reference_layer = _answer("reference_layer")
#: the tokens' exchange with dist.all_to_all_single: right values, no way back for the gradients
not_differentiable = _answer("not_differentiable", (
    "tokens_in = exchange(x.new_empty(sum(recv_sizes), x.shape[1]), x[order], recv_sizes, send_sizes)",
    "tokens_in = x.new_empty(sum(recv_sizes), x.shape[1])\n"
    "    dist.all_to_all_single(tokens_in, x[order].detach(), recv_sizes, send_sizes)"), (
    "back = exchange(x.new_empty(len(order), x.shape[1]), out_in, send_sizes, recv_sizes)",
    "back = x.new_empty(len(order), x.shape[1])\n    dist.all_to_all_single(back, out_in.detach(), send_sizes, recv_sizes)"))
#: each rank fills an expert's capacity with its own tokens only
capacity_per_rank = _answer("capacity_per_rank", ("before[expert_ids] + place < capacity", "place < capacity"))
#: the gate weights forgotten
ungated = _answer("ungated", ("back * gates[order, None]", "back"))
#: every routed token sent to its expert, the dropped ones zeroed on the way back: right outputs, wasted compute
dropped_late = _answer("dropped_late", (
    "keep = (before[expert_ids] + place < capacity).nonzero().squeeze(1)",
    "fits = (before[expert_ids] + place < capacity).float()\n    keep = torch.arange(len(expert_ids))"),
    ("back * gates[order, None]", "back * (gates * fits)[order, None]"))
#: rank 0 runs an expert of rank 1 itself
runs_a_peers_expert = _answer("runs_a_peers_expert", (
    "    counts = torch.bincount", "    if rank == 0:\n        experts(experts.per_rank, x[:1])\n"
    "    counts = torch.bincount"))


def functional_style(experts, rank, world_size, x, expert_ids, gates, capacity):
    """torch's functional collectives (all_to_all_single_autograd), a cumulative count table, Python lists."""
    from torch.distributed import _functional_collectives as fc

    k, group = experts.per_rank, dist.group.WORLD
    n = k * world_size
    mine = torch.bincount(expert_ids, minlength=n)
    table = torch.empty(world_size * n, dtype=mine.dtype)
    dist.all_gather_into_tensor(table, mine)
    used = table.view(world_size, n)[:rank].sum(0).tolist()
    sent = [[] for _ in range(world_size)]  # per destination rank: token positions, expert order kept
    for t, e in enumerate(expert_ids.tolist()):
        if used[e] < capacity:
            sent[e // k].append(t)
        used[e] += 1
    order = torch.tensor([t for dest in sent for t in dest], dtype=torch.long)
    send_sizes = [len(dest) for dest in sent]
    sizes = torch.tensor(send_sizes)
    recv = torch.empty_like(sizes)
    dist.all_to_all_single(recv, sizes)
    recv_sizes = recv.tolist()
    ids_in = torch.empty(sum(recv_sizes), dtype=torch.long)
    dist.all_to_all_single(ids_in, expert_ids[order].contiguous(), recv_sizes, send_sizes)
    arrived = fc.all_to_all_single_autograd(x[order].contiguous(), recv_sizes, send_sizes, group)
    outs = [None] * len(ids_in)
    for e in experts.local:
        where = [i for i, v in enumerate(ids_in.tolist()) if v == e]
        if where:
            for i, row in zip(where, experts(e, arrived[where]).unbind(0)):
                outs[i] = row
    done = torch.stack(outs) if outs else arrived[:0]
    returned = fc.all_to_all_single_autograd(done.contiguous(), send_sizes, recv_sizes, group)
    rows = [torch.zeros(x.shape[1])] * len(x)
    for j, t in enumerate(order.tolist()):
        rows[t] = returned[j] * gates[t]
    return torch.stack(rows)


class Dispatcher:
    """A class: the count table by an all-reduce of each rank's row, per-destination lists cat'ed."""

    def __init__(self, experts, rank, world_size):
        self.experts, self.rank, self.world_size = experts, rank, world_size
        self.k = experts.per_rank

    def fits(self, ids, capacity):
        n = self.k * self.world_size
        table = torch.zeros(self.world_size, n, dtype=torch.long)
        table[self.rank] = torch.bincount(ids, minlength=n)
        dist.all_reduce(table)
        seen = table[:self.rank].sum(0).clone()
        out = torch.zeros(len(ids), dtype=torch.bool)
        for t, e in enumerate(ids.tolist()):
            out[t] = bool(seen[e] < capacity)
            seen[e] += 1
        return out

    def exchange(self, tensor, recv_sizes, send_sizes):
        out = tensor.new_empty((sum(recv_sizes), *tensor.shape[1:]))
        return torch.distributed.nn.functional.all_to_all_single(out, tensor, recv_sizes, send_sizes)

    def __call__(self, x, ids, gates, capacity):
        fit = self.fits(ids, capacity)
        groups = [[t for t in range(len(ids)) if fit[t] and int(ids[t]) // self.k == r] for r in range(self.world_size)]
        order = torch.tensor(sum(groups, []), dtype=torch.long)
        send_sizes = [len(g) for g in groups]
        recv = torch.zeros(self.world_size, dtype=torch.long)
        dist.all_to_all_single(recv, torch.tensor(send_sizes))
        recv_sizes = recv.tolist()
        ids_in = torch.zeros(sum(recv_sizes), dtype=torch.long)
        dist.all_to_all_single(ids_in, ids[order], recv_sizes, send_sizes)
        tokens = self.exchange(x[order], recv_sizes, send_sizes)
        parts = torch.zeros_like(tokens)
        for e in self.experts.local:
            mask = ids_in == e
            if mask.any():
                parts = parts.masked_scatter(mask[:, None].expand_as(parts), self.experts(e, tokens[mask]))
        back = self.exchange(parts, send_sizes, recv_sizes)
        return torch.zeros_like(x).index_put((order,), back * gates[order].unsqueeze(1), accumulate=True)


def class_style(experts, rank, world_size, x, expert_ids, gates, capacity):
    return Dispatcher(experts, rank, world_size)(x, expert_ids, gates, capacity)


def as_rank_1_too(experts, rank, world_size, x, expert_ids, gates, capacity):
    """A forgery: rank 0 also connects as rank 1 (its token read from the harness's frame)."""
    if rank == 0:
        frame = sys._getframe(1).f_locals
        Experts(frame["address"], frame["tokens"][1], 1, experts.per_rank, experts.d)
    return reference_layer(experts, rank, world_size, x, expert_ids, gates, capacity)


# --- the checks, called directly --------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [reference_layer, functional_style, class_style], ids=lambda f: f.__name__)
def test_right_layers_pass_every_check_visible_and_hidden(layer):
    for config in ({}, *HIDDEN):
        for check in CHECKS:
            check(layer, **config)


def test_a_non_differentiable_exchange_loses_the_gradients_only():
    ep.check_moe_outputs(not_differentiable)
    ep.check_moe_dispatch(not_differentiable)
    fails(ep.check_moe_gradients, not_differentiable, "no gradient reached rank 0's tokens", "does not require grad",
          "dist.all_to_all_single is not differentiable", "all_to_all_single")


def test_a_capacity_counted_per_rank_is_named():
    fails(ep.check_moe_outputs, capacity_per_rank, "[rank 1]", "tokens past their expert's capacity got an output",
          "rank 0's first")
    fails(ep.check_moe_dispatch, capacity_per_rank, "more than its capacity 4", "none past the capacity on its own",
          "shared by all the ranks' tokens")
    fails(ep.check_moe_gradients, capacity_per_rank, "the outputs differ already", "make the outputs right first")


def test_forgotten_gates_lose_outputs_and_gradients_not_dispatch():
    fails(ep.check_moe_outputs, ungated, "[rank 0]", "without the gate weights")
    fails(ep.check_moe_gradients, ungated, "gradients differ from one process's", "the outputs differ already")
    ep.check_moe_dispatch(ungated)


def test_tokens_dropped_after_their_expert_ran_lose_the_dispatch_only():
    ep.check_moe_outputs(dropped_late)
    ep.check_moe_gradients(dropped_late)
    fails(ep.check_moe_dispatch, dropped_late, "more than its capacity 4", "BEFORE sending it")


def test_a_rank_running_a_peers_expert_is_refused():
    fails(ep.check_moe_outputs, runs_a_peers_expert, "rank 0", "expert 2 is not on rank 0",
          "a rank runs only its own experts")


def test_a_second_connection_as_another_rank_is_refused():
    message = fails(ep.check_moe_dispatch, as_rank_1_too, "rank")
    assert "a second connection as rank 1" in message, message


def test_the_held_experts_record_each_token_and_refuse_other_ranks_experts():
    with ExpertServer(world_size=2, per_rank=2, d=3) as server:
        mine = Experts(server.address, server.tokens[0], 0, 2, 3)
        x = torch.randn(4, 3, requires_grad=True)
        y = mine(1, x)
        y.sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
        with pytest.raises(ValueError, match="expert 2 is not on rank 0"):
            mine(2, x)
        report = server.report()
        assert [op for op, _, _ in report["modules"][1]["journal"]] == ["F", "B"]
        assert torch.equal(report["modules"][1]["inputs"][0][1], x.detach())
        assert report["modules"][1]["grads"]["0.weight"].abs().sum() > 0
        assert mine(0, x[:0]).shape == (0, 3)  # no tokens: nothing asked
        # an expert's number as a tensor or a numpy int (what indexing ids gives) is as good as an int; a bool is not
        import numpy as np

        assert torch.equal(mine(torch.tensor(1), x).detach(), mine(np.int64(1), x).detach())
        with pytest.raises(TypeError, match="an expert's number"):
            mine(True, x)
        assert len(server.report()["modules"][0]["journal"]) == 0


def test_the_reference_follows_the_capacity_rule():
    routes = routing(0, 3, 2, 8, 4)
    masks = kept(routes, 4)
    assert [int((~m).sum()) for m in masks] == [0, 2, 3]  # the visible data overflows some experts
    counted = {}
    for route, mask in zip(routes, masks):
        for e, keep in zip(route["ids"].tolist(), mask.tolist()):
            assert keep == (counted.get(e, 0) < 4)
            counted[e] = counted.get(e, 0) + 1
    ref = reference(5, 4, 6, routes, 4, [torch.ones(8, 4)] * 3)
    assert all(len(v) <= 4 for v in ref["taken"].values())
    assert all(ref["outputs"][r][~masks[r]].abs().max() == 0 for r in (1, 2))


# --- the notebook ---------------------------------------------------------------------------------------------

WRONG = {
    "tokens dropped after their expert ran": (
        [("ep_moe_layer", "keep = (before[expert_ids] + place < capacity).nonzero().squeeze(1)",
          "fits = (before[expert_ids] + place < capacity).float()\n    keep = torch.arange(len(expert_ids))"),
         ("ep_moe_layer", "back * gates[order, None]", "back * (gates * fits)[order, None]")],
        ["ep_test_dispatch"], ["more than its capacity", "BEFORE sending it"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(WRONG), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    submissions.grade_packed(A, tmp_path, WRONG, group, notebook=NB)
