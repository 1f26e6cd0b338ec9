"""The blocks of exercise 3's activation-memory notebook, held by the grader (:mod:`graders.common.held`), which
counts the activations it keeps for their backward, and the single-process reference the checks compare with.

Block ``i`` is ``x + Linear(h_i, d)(GELU(Linear(d, h_i)(LayerNorm(d)(x))))`` with weights only the check's process
knows. A rank runs it through :class:`Blocks` (``blocks[i](x)``, differentiable), and the grader does the work:

* a call with gradients enabled runs the block in the grader, which **keeps** what its backward needs (the saved
  tensors, counted in bytes with ``saved_tensors_hooks``, parameters excluded) until that call's backward, or until
  the rank's autograd graph lets go of the call: each call saves a small *ticket* tensor in the rank's graph, and
  when torch frees it (the backward ran, the graph was dropped, or a checkpoint's hooks discarded it), the rank
  tells the grader, which frees that call's activations. So what the grader holds is what the rank's graph holds,
  whatever way of checkpointing the rank uses (``torch.utils.checkpoint`` reentrant or not, a Function of its own);
* a call under ``torch.no_grad()`` runs the block and keeps nothing;
* every forward is counted (a recomputation is a block's second forward in one step), and the bytes the grader
  holds are sampled between the rank's calls: the peak is the most it held at once.

The weights' gradients accumulate in the grader, so the only way to them is a backward the grader ran.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np
import torch
import torch.nn as nn

from graders.common.held import Held, HeldServer, Refused, as_int, private_seed


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def make_blocks(d: int, hiddens, seed: int) -> list[Block]:
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for h in hiddens:
        block = Block(d, h)
        with torch.no_grad():
            for name, p in block.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if name == "norm.weight" else 0.1 * noise if p.dim() == 1
                        else noise / p.shape[1] ** 0.5)
        blocks.append(block)
    return blocks


def saved_bytes(block: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Run ``block`` on ``x`` with gradients: (bytes of the tensors it saved for backward, parameters excluded, each
    storage once; the input leaf; the output)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    leaf = x.detach().clone().requires_grad_(True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(leaf)
    return sum(seen.values()), leaf, out


def cost(rows: int, d: int, h: int) -> int:
    """A block's forward: its two matrix products' multiply-adds."""
    return 2 * rows * d * h


class BlockServer(HeldServer):
    """The blocks of one job, served to rank 0 (see the module's text). A context manager."""

    OPS = (b"F", b"N", b"B", b"X")

    def __init__(self, d: int, hiddens, rows: int):
        super().__init__([], [[]])
        self.d, self.hiddens, self.rows = d, list(hiddens), rows
        self.seed = private_seed()
        self.blocks = make_blocks(d, self.hiddens, self.seed)
        self.held: dict[int, tuple[int, torch.Tensor, torch.Tensor, int]] = {}  # key -> (block, leaf, out, bytes)
        self.forwards = [0] * len(self.hiddens)
        self.backwards = [0] * len(self.hiddens)
        self.journal: list[tuple] = []  # (op, block, bytes held before it)
        self.peak, self.peak_at = 0, None

    def _now(self) -> int:
        return sum(b for _, _, _, b in self.held.values())

    def handle(self, owner: int, op: bytes, index: int, key: int, values: torch.Tensor) -> torch.Tensor:
        if op == b"X":  # the rank's graph let go of these calls
            for k in values[0].tolist():
                self.held.pop(int(k), None)
            return torch.zeros(1, 1)
        held = self._now()  # between the rank's calls: what the grader holds for it
        self.journal.append((op.decode(), index, held))
        if held > self.peak:
            self.peak, self.peak_at = held, len(self.journal) - 1
        if not 0 <= index < len(self.blocks):
            raise Refused(f"there is no block {index}: there are {len(self.blocks)} (0 to {len(self.blocks) - 1})")
        block = self.blocks[index]
        if op in (b"F", b"N"):
            if tuple(values.shape) != (self.rows, self.d):
                raise Refused(f"block {index} takes a ({self.rows}, {self.d}) input; got {tuple(values.shape)}")
            self.forwards[index] += 1
            if op == b"N":
                with torch.no_grad():
                    return block(values)
            if key in self.held:
                raise Refused(f"call {key} is already held")
            nbytes, leaf, out = saved_bytes(block, values)
            self.held[key] = (index, leaf, out, nbytes)
            return out.detach()
        if key in self.held and self.held[key][0] != index:
            raise Refused(f"a call of block {self.held[key][0]} came in its place: the recomputation ran block "
                          f"{self.held[key][0]} where block {index}'s forward was, as a loop's "
                          "lambda does when it reads the loop's variable late (bind the block when the function is "
                          "made: a default argument, functools.partial, or the block itself)")
        if key not in self.held:
            raise Refused(f"the backward of a call of block {index} whose activations the grader no longer holds: "
                          "its forward ran without gradients, or its graph was dropped before this backward")
        _, leaf, out, _ = self.held.pop(key)
        if tuple(values.shape) != tuple(out.shape):
            raise Refused(f"block {index}'s backward got a gradient of shape {tuple(values.shape)}")
        torch.autograd.backward(out, values)
        self.backwards[index] += 1
        return leaf.grad

    def record(self) -> dict:
        with self.lock:
            held = self._now()
            if held > self.peak:
                self.peak, self.peak_at = held, len(self.journal)
            return {"journal": list(self.journal), "forwards": list(self.forwards), "backwards": list(self.backwards),
                    "peak": self.peak, "peak_at": self.peak_at, "refused": [t for _, t in self.refused],
                    "pids": [list(p) for p in self.pids],
                    "grads": [{k: None if p.grad is None else p.grad.detach().clone() for k, p in b.named_parameters()}
                              for b in self.blocks]}


class _Call(torch.autograd.Function):
    """One call of a held block, with gradients: the grader keeps its activations while this node's ticket lives."""

    @staticmethod
    def forward(ctx, anchor, x, blocks, index):
        key = next(blocks._keys)
        out = blocks._ask(b"F", index, key, x)
        ctx.save_for_backward(blocks._ticket(key))
        ctx.blocks, ctx.index = blocks, index
        return out

    @staticmethod
    def backward(ctx, grad):
        (ticket,) = ctx.saved_tensors  # under a checkpoint's hooks: the recomputed call's ticket
        key = int(ticket.item())
        return None, ctx.blocks._ask(b"B", ctx.index, key, grad), None, None


class HeldBlock:
    """Block ``index`` of the model, held by the grader: call it on a (rows, d) tensor."""

    def __init__(self, blocks: Blocks, index: int):
        self._blocks, self.index = blocks, index
        self.d, self.h = blocks.d, blocks.hiddens[index]

    def __repr__(self) -> str:
        return (f"<block {self.index}, held by the grader: x + Linear({self.h}, {self.d})(GELU(Linear({self.d}, "
                f"{self.h})(LayerNorm({self.d})(x))))>")

    def __reduce__(self):
        raise TypeError("a held block cannot be pickled or sent: it is this rank's connection to the grader")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b = self._blocks
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (b.rows, b.d):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"block {self.index} takes a ({b.rows}, {b.d}) tensor; got {shape}")
        if not torch.is_grad_enabled():
            return b._ask(b"N", self.index, 0, x)
        return _Call.apply(b._anchor, x, b, self.index)


class Blocks:
    """The model's blocks, held by the grader: ``blocks[i](x)``; ``len(blocks)``; ``blocks.d``, ``blocks.rows``,
    ``blocks.hiddens`` (block i's hidden width)."""

    def __init__(self, address: str, token: str, d: int, hiddens, rows: int):
        self.d, self.hiddens, self.rows = d, list(hiddens), rows
        self._held = Held(address, token)
        self._keys = itertools.count(1)
        self._freed: list[int] = []
        self._anchor = torch.zeros((), requires_grad=True)  # the blocks' weights need gradients even if x does not
        self._items = [HeldBlock(self, i) for i in range(len(self.hiddens))]

    def __repr__(self) -> str:
        return f"<{len(self)} blocks held by the grader, d={self.d}, hidden widths {self.hiddens}>"

    def __reduce__(self):
        raise TypeError("the blocks cannot be pickled or sent: they are this rank's connection to the grader")

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._items[i]
        return self._items[as_int(i, "blocks[i]: i, a block's number,")]

    def __iter__(self):
        return iter(self._items)

    def _ticket(self, key: int) -> torch.Tensor:
        """A tensor whose memory, once torch frees it, tells the grader that call ``key`` is let go."""
        array = np.array([key], dtype=np.float64)
        weakref.finalize(array, self._freed.append, key)
        return torch.from_numpy(array)

    def _ask(self, op: bytes, index: int, key: int, x: torch.Tensor) -> torch.Tensor:
        freed = []
        while self._freed:  # one pop at a time: a ticket freed meanwhile (by the garbage collector) is not lost
            freed.append(self._freed.pop())
        if freed:
            self._held.ask(b"X", 0, 0, torch.tensor([freed], dtype=torch.float32), "the blocks' bookkeeping")
        what = f"block {index}" if op != b"B" else f"the backward of block {index}"
        try:
            return self._held.ask(op, index, key, x, what)
        except RuntimeError as exc:
            raise RuntimeError(f"{what}: {exc}") from None

    def close(self) -> None:
        self._held.close()


def reference(blocks: list[Block], x: torch.Tensor, w: torch.Tensor) -> dict:
    """One process, no checkpointing: the gradients of sum(out * w) for every block's weights and for x, and each
    block's saved bytes."""
    for b in blocks:  # the rank's job ran first: its gradients are in the record already
        b.zero_grad(set_to_none=True)
    h = x.clone().requires_grad_(True)
    out, nbytes = h, []
    for block in blocks:
        nbytes.append(saved_bytes(block, out.detach())[0])
        out = block(out)
    (out * w).sum().backward()
    grads = [{k: p.grad.detach().clone() for k, p in b.named_parameters()} for b in blocks]
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return {"grads": grads, "x_grad": h.grad.detach().clone(), "out": out.detach(), "bytes": nbytes}


def peak(nbytes: list[int], plan: set[int]) -> int:
    """The most the grader holds at once when the blocks in ``plan`` are checkpointed: every other block's after the
    forward, and during the backward each checkpointed block's recomputed activations on top of the blocks before it
    that were kept."""
    kept = [0 if i in plan else b for i, b in enumerate(nbytes)]
    during = [sum(kept[:i]) + nbytes[i] for i in plan]
    return max([sum(kept)] + during)


def best_plans(nbytes: list[int], costs: list[int], budget: int) -> tuple[int | None, list[set[int]]]:
    """The least recomputation of any plan whose peak fits ``budget``, and every plan that achieves it."""
    n, best, plans = len(nbytes), None, []
    for mask in range(1 << n):
        plan = {i for i in range(n) if mask >> i & 1}
        if peak(nbytes, plan) > budget:
            continue
        c = sum(costs[i] for i in plan)
        if best is None or c < best:
            best, plans = c, [plan]
        elif c == best:
            plans.append(plan)
    return best, plans
