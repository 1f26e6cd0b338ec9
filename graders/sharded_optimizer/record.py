"""What the grader's Adam wrote down, read per rank and element (:mod:`graders.sharded_optimizer.adam`).

``ledger(requests, world_size, n)``: for each rank ``r`` and element ``i``, ``adds[r][i]``, the values rank r added to
element i between its steps (one list per step, and a last one after the last step), and ``steps[r][i]``, each
step of element i by rank r as (the value it was given, the new value it returned). A rank's state is its own: the
grader keeps each rank's apart, so each rank's requests are read alone.
"""

from __future__ import annotations

import torch

EXACT = 1e-6  # values that only travelled (float32 through a socket and collectives) compare this close


def ledger(requests, world_size: int, n: int) -> dict:
    adds = [[[[]] for _ in range(n)] for _ in range(world_size)]
    steps = [[[] for _ in range(n)] for _ in range(world_size)]
    for rank, op, offset, values, new in requests:
        for j, value in enumerate(values.tolist()):
            if op == "G":
                adds[rank][offset + j][-1].append(value)
            else:
                adds[rank][offset + j].append([])
                steps[rank][offset + j].append((value, float(new[j])))
    return {"adds": adds, "steps": steps}


def stepped(led: dict, r: int, i: int) -> int:
    """How many times rank r stepped element i."""
    return len(led["steps"][r][i])


def owners(led: dict) -> list[set]:
    """Per element, the ranks that stepped it."""
    world_size, n = len(led["steps"]), len(led["steps"][0])
    return [{r for r in range(world_size) if led["steps"][r][i]} for i in range(n)]


def consensus(led: dict, steps: int) -> list[torch.Tensor | None]:
    """Per step t, the new value of every element as the grader's Adam returned it at its t-th step (every rank that
    stepped it agreeing), or None where some element was not stepped t + 1 times or the ranks' steps disagree."""
    world_size, n = len(led["steps"]), len(led["steps"][0])
    out = []
    for t in range(steps):
        values = []
        for i in range(n):
            new = [led["steps"][r][i][t][1] for r in range(world_size) if len(led["steps"][r][i]) > t]
            if not new or max(new) - min(new) > EXACT:
                values = None
                break
            values.append(new[0])
        out.append(None if values is None else torch.tensor(values))
    return out
