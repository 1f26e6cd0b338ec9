"""The experts of exercise 1's mixture-of-experts notebook, held by the grader (:mod:`graders.common.held`), the
routing the check gives each rank, and the single-process reference the checks compare with.

Expert ``e`` is ``Linear(d, d) -> Tanh`` with weights only the check's process knows; rank ``r`` holds experts
``r * k`` to ``r * k + k - 1``. A rank calls its experts through :class:`Experts` (``experts(e, tokens)``), whose
output is part of autograd's graph: its backward asks the grader for that call's backward, so the experts' weight
gradients accumulate with the grader, and every token an expert was given is in the grader's record.

The layer's rule (what :func:`reference` computes): token ``t`` of rank ``r`` goes to expert ``ids[t]`` with weight
``gates[t]``; expert ``e`` takes at most ``capacity`` tokens of the step, the first in the order of the ranks (rank
0's tokens first), each rank's tokens in their order; a token past its expert's capacity is dropped: its output is
zero, and it never reaches the expert. The output of a kept token is ``gates[t] * expert(x[t])``.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from graders.common.held import Held, HeldServer, Module, as_int, private_seed


def make_experts(n: int, d: int, seed: int) -> list[nn.Module]:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n):
        linear = nn.Linear(d, d)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(d, d, generator=gen) / d ** 0.5)
            linear.bias.copy_(torch.randn(d, generator=gen) * 0.1)
        layers.append(nn.Sequential(linear, nn.Tanh()))
    return layers


def routing(seed: int, world_size: int, per_rank: int, tokens: int, d: int) -> list[dict]:
    """Each rank's tokens, expert ids and gate weights (public): a router that favours some experts, so that some
    overflow their capacity while others get few tokens, and every rank keeps some tokens."""
    n = world_size * per_rank
    draw = random.Random(7919 * seed + 31 * world_size + per_rank)
    favour = [draw.random() ** 2 + 0.05 for _ in range(n)]
    out = []
    for r in range(world_size):
        gen = torch.Generator().manual_seed(1000 * seed + r)
        ids = torch.tensor(draw.choices(range(n), weights=favour, k=tokens), dtype=torch.long)
        out.append({"x": torch.randn(tokens, d, generator=gen), "ids": ids,
                    "gates": torch.rand(tokens, generator=gen) * 0.8 + 0.2})
    return out


def kept(routes: list[dict], capacity: int) -> list[torch.Tensor]:
    """Per rank, which tokens fit their expert's capacity (rank 0's first, each rank's in order)."""
    taken: dict[int, int] = {}
    out = []
    for route in routes:
        mask = []
        for e in route["ids"].tolist():
            mask.append(taken.get(e, 0) < capacity)
            taken[e] = taken.get(e, 0) + 1
        out.append(torch.tensor(mask, dtype=torch.bool))
    return out


def reference(seed: int, d: int, n: int, routes: list[dict], capacity: int, weights: list[torch.Tensor]) -> dict:
    """One process, every expert: each rank's output, the gradients of sum_r (y_r * w_r) for each rank's tokens
    and each expert's weights, and which tokens each of the ``n`` experts takes (rank, token)."""
    experts = make_experts(n, d, seed)
    masks = kept(routes, capacity)
    xs = [r["x"].clone().requires_grad_(True) for r in routes]
    ys, taken = [], {e: [] for e in range(n)}
    for r, (route, mask, x) in enumerate(zip(routes, masks, xs)):
        rows = [torch.zeros(d) if not keep else route["gates"][t] * experts[e](x[t:t + 1])[0]
                for t, (e, keep) in enumerate(zip(route["ids"].tolist(), mask.tolist()))]
        ys.append(torch.stack(rows))
        for t, (e, keep) in enumerate(zip(route["ids"].tolist(), mask.tolist())):
            if keep:
                taken[e].append((r, t))
    sum((y * w).sum() for y, w in zip(ys, weights)).backward()
    return {"outputs": [y.detach() for y in ys], "x_grads": [x.grad.detach() for x in xs],
            "expert_grads": [{k: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                              for k, p in e.named_parameters()} for e in experts],
            "taken": taken, "kept": masks}


class ExpertServer(HeldServer):
    """Every expert of the layer, held by the grader: rank r drives its own ``per_rank``. A context manager."""

    def __init__(self, world_size: int, per_rank: int, d: int):
        self.world_size, self.per_rank, self.d = world_size, per_rank, d
        self.seed = private_seed()  # the weights: known to this process only
        layers = make_experts(world_size * per_rank, d, self.seed)
        super().__init__([Module(e, layer) for e, layer in enumerate(layers)],
                         [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(world_size)])


class _Call(torch.autograd.Function):
    """One call of a held expert, in autograd's graph: backward asks the grader for the same call's backward."""

    @staticmethod
    def forward(ctx, x, held, e, key, what):
        ctx.held, ctx.e, ctx.key, ctx.what = held, e, key, what
        return held.ask(b"F", e, key, x, what)

    @staticmethod
    def backward(ctx, grad):
        return ctx.held.ask(b"B", ctx.e, ctx.key, grad, f"the backward of {ctx.what}"), None, None, None, None


class Experts:
    """This rank's experts, held by the grader: ``experts(e, tokens)`` runs expert ``e`` (one of this rank's:
    ``experts.local``) on a (n, d) tensor of tokens and returns its (n, d) output, differentiable;
    ``experts.per_rank``: how many experts each rank holds (rank r: experts r * per_rank to r * per_rank +
    per_rank - 1)."""

    def __init__(self, address: str, token: str, rank: int, per_rank: int, d: int):
        self.rank, self.per_rank, self.d = rank, per_rank, d
        self.local = list(range(rank * per_rank, (rank + 1) * per_rank))
        self._held = Held(address, token)
        self._calls = 0

    def __repr__(self) -> str:
        return f"<rank {self.rank}'s experts {self.local}, held by the grader (tokens of {self.d} features)>"

    def __reduce__(self):
        raise TypeError("the experts cannot be pickled or sent: they are this rank's connection to the grader")

    def __call__(self, e: int, tokens: torch.Tensor) -> torch.Tensor:
        e = as_int(e, "experts(e, tokens): e, an expert's number,")
        if e not in self.local:
            raise ValueError(f"expert {e} is not on rank {self.rank} (it holds {self.local}): send the tokens to "
                             f"the rank that holds expert {e}, rank {e // self.per_rank}")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] != self.d:
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"experts({e}, tokens) takes a (n, {self.d}) tensor of tokens; got {shape}")
        if tokens.shape[0] == 0:
            return tokens.new_zeros((0, self.d)) + 0 * tokens.sum()  # nothing to ask the grader
        self._calls += 1
        return _Call.apply(tokens, self._held, e, self._calls, f"experts({e}, tokens)")

    def close(self) -> None:
        self._held.close()
