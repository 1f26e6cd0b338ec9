"""The optimizer of exercise 3's sharded-optimizer notebook, held by the grader (:mod:`graders.common.held`), the
data each rank is given, and the single-process reference the checks compare with.

The optimizer is Adam over the model's parameters flattened into one vector of ``n`` elements, in the order of
``model.parameters()``, with a learning rate per element drawn in the check's process from the OS's randomness:
no rank knows another rank's learning rates, so the only way to the new value of an element is to ask the
grader for its update, and the only way to another rank's elements is to receive them from that rank. Its state
(each element's gradient sum, first and second moments, step count) lives in the grader, **per rank**: what
rank r added to and stepped is rank r's state, and the grader writes down every request (rank, op, elements,
values) in order. A rank reaches it through :class:`ShardedAdam`:

* ``optimizer.add_grad(offset, grad)`` adds the 1-D ``grad`` to rank r's gradient of elements ``offset`` to
  ``offset + len(grad) - 1``;
* ``optimizer.step(offset, params)`` updates those elements from the gradient rank r added to them since their
  last step (then zeroed), given their values ``params``, and returns their new values.

The data never travels in the job's arguments (which every rank receives): rank r's harness asks the grader for
rank r's micro-batches over its own connection, so no rank's process holds another rank's data.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from graders.common.held import Held, HeldServer, Refused, as_int, private_seed

BETAS = (0.9, 0.999)
EPS = 1e-8
STEPS = 3  # optimizer steps a job runs


def make_model(widths: tuple[int, int, int], seed: int) -> nn.Module:
    """``Linear(a, b) -> Tanh -> Linear(b, c)``, the same on every rank (a public seed: its weights start equal)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(widths[0], widths[1]), nn.Tanh(), nn.Linear(widths[1], widths[2]))


def numel(widths: tuple[int, int, int]) -> int:
    a, b, c = widths
    return a * b + b + b * c + c


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def draw(world_size: int, widths, n_micro: int, rows: int, seed: int) -> dict:
    """Private draws of one job: every rank's micro-batches of every step (``data[r]``: a (STEPS * n_micro * rows,
    a + c) tensor, inputs then targets) and the learning rate of each element, from the OS's randomness mixed with
    ``seed`` (a hidden test's data differs from the visible one's, and from any run's before)."""
    gen = torch.Generator().manual_seed(private_seed() ^ seed)
    a, _, c = widths
    data = []
    for _ in range(world_size):
        x = torch.randn(STEPS * n_micro * rows, a, generator=gen)
        y = torch.randn(STEPS * n_micro * rows, c, generator=gen)
        data.append(torch.cat([x, y], 1))
    lr = 10 ** (-3 + torch.rand(numel(widths), generator=gen))  # 1e-3 to 1e-2, per element
    return {"data": data, "lr": lr}


def micro_batches(data: torch.Tensor, widths, n_micro: int, rows: int, step: int) -> list[tuple]:
    """A rank's ``(x, y)`` micro-batches of optimizer step ``step`` from its drawn ``data``."""
    a = widths[0]
    out = []
    for k in range(n_micro):
        chunk = data[(step * n_micro + k) * rows:(step * n_micro + k + 1) * rows]
        out.append((chunk[:, :a].clone(), chunk[:, a:].clone()))
    return out


def adam_update(p, g, m, v, t, lr):
    """Adam's update of elements with values ``p``, gradient ``g``, moments ``m``, ``v`` (updated in place) and step
    counts ``t`` (after this step): the new values."""
    b1, b2 = BETAS
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    m_hat = m / (1 - b1 ** t)
    v_hat = v / (1 - b2 ** t)
    return p - lr * m_hat / (v_hat.sqrt() + EPS)


class AdamServer(HeldServer):
    """The grader's Adam, its state per rank, served to the ranks of one job (see the module's text)."""

    OPS = (b"D", b"G", b"S")

    def __init__(self, world_size: int, n: int, draws: dict):
        super().__init__([], [[] for _ in range(world_size)])
        self.n, self.lr, self.data = n, draws["lr"], draws["data"]
        self.grad = [torch.zeros(n) for _ in range(world_size)]
        self.m = [torch.zeros(n) for _ in range(world_size)]
        self.v = [torch.zeros(n) for _ in range(world_size)]
        self.t = [torch.zeros(n, dtype=torch.long) for _ in range(world_size)]
        self.requests: list[tuple] = []  # (rank, "G" or "S", offset, values, the new values a step returned)

    def handle(self, owner: int, op: bytes, index: int, key: int, values: torch.Tensor) -> torch.Tensor:
        if op == b"D":
            return self.data[owner]
        offset, length = index, values.shape[1]
        what = "add_grad" if op == b"G" else "step"
        if values.shape[0] != 1:
            raise Refused(f"optimizer.{what} takes a 1-D tensor")
        if offset < 0 or offset + length > self.n:
            raise Refused(f"optimizer.{what}({offset}, a tensor of {length}): elements {offset} to "
                          f"{offset + length - 1} are not all in the model, whose parameters have {self.n} elements "
                          f"(0 to {self.n - 1})")
        row = values[0]
        span = slice(offset, offset + length)
        if op == b"G":
            self.requests.append((owner, "G", offset, row.clone(), None))
            self.grad[owner][span] += row
            return torch.zeros(1, 1)
        self.t[owner][span] += 1
        new = adam_update(row, self.grad[owner][span], self.m[owner][span], self.v[owner][span],
                          self.t[owner][span].float(), self.lr[span])
        self.grad[owner][span] = 0
        self.requests.append((owner, "S", offset, row.clone(), new.clone()))
        return new[None]

    def record(self) -> dict:
        """What the ranks asked, in order, what was refused, and which processes connected."""
        found = self.report()
        with self.lock:
            return {"requests": list(self.requests), "refused": found["refused"], "refused_by": found["refused_by"],
                    "pids": found["pids"]}


class ShardedAdam:
    """This rank's connection to the grader's Adam (see the module's text): ``add_grad(offset, grad)``,
    ``step(offset, params)``; ``numel``, the number of elements of the model's parameters."""

    def __init__(self, address: str, token: str, n: int):
        self.numel = n
        self._held = Held(address, token)

    def __repr__(self) -> str:
        return (f"<the grader's Adam over the {self.numel} elements of the model's parameters, flattened in the order "
                "of model.parameters(): add_grad(offset, grad), step(offset, params)>")

    def __reduce__(self):
        raise TypeError("the optimizer cannot be pickled or sent: it is this rank's connection to the grader")

    def _values(self, what: str, offset, tensor) -> tuple[int, torch.Tensor | None]:
        offset = as_int(offset, f"optimizer.{what}: offset, the first element's place in the flattened parameters")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"optimizer.{what}(offset, values) takes a tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1:
            raise ValueError(f"optimizer.{what}(offset, values) takes a 1-D tensor (a run of elements of the "
                             f"flattened parameters); got shape {tuple(tensor.shape)}")
        return offset, tensor

    def _ask(self, op: bytes, what: str, offset: int, tensor: torch.Tensor) -> torch.Tensor:
        try:
            return self._held.ask(op, offset, 0, tensor[None], f"optimizer.{what}")[0]
        except RuntimeError as exc:
            raise RuntimeError(f"optimizer.{what}: {exc}") from None

    def add_grad(self, offset, grad) -> None:
        """Add ``grad`` to this rank's gradient of elements ``offset`` to ``offset + len(grad) - 1``."""
        offset, grad = self._values("add_grad", offset, grad)
        if grad.numel():
            self._ask(b"G", "add_grad", offset, grad)

    def step(self, offset, params) -> torch.Tensor:
        """The new values of elements ``offset`` to ``offset + len(params) - 1``, whose values are ``params``, after
        one Adam step with the gradient this rank added to them since their last step."""
        offset, params = self._values("step", offset, params)
        if not params.numel():
            return params.detach().clone()
        return self._ask(b"S", "step", offset, params).to(params.dtype)

    def close(self) -> None:
        self._held.close()


def fetch_data(optimizer: ShardedAdam) -> torch.Tensor:
    """This rank's drawn data, asked of the grader over the rank's own connection."""
    return optimizer._held.ask(b"D", 0, 0, torch.zeros(1, 1), "the harness's data")


# --- the reference ----------------------------------------------------------------------------------------------


def _grad(model: nn.Module, loss_fn, x, y) -> torch.Tensor:
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def gradients_at(widths, params: torch.Tensor, draws: dict, step: int, world_size: int, n_micro: int, rows: int,
                 loss_fn) -> dict:
    """At ``params`` (flattened), on step ``step``'s micro-batches: the step's gradient (``full``: the mean loss over
    every micro-batch of every rank), each micro-batch's gradient averaged over the ranks and divided by ``n_micro``
    (``per_micro[k]``), and each rank's own gradient (``local[r]``: its micro-batches' mean, not averaged over the
    ranks; ``local_micro[r][k]``: its micro-batch k's, divided by ``n_micro``)."""
    model = make_model(widths, 0)
    torch.nn.utils.vector_to_parameters(params.clone(), model.parameters())
    batches = [micro_batches(draws["data"][r], widths, n_micro, rows, step) for r in range(world_size)]
    grads = [[_grad(model, loss_fn, x, y) for x, y in batches[r]] for r in range(world_size)]
    per_micro = [sum(grads[r][k] for r in range(world_size)) / (world_size * n_micro) for k in range(n_micro)]
    return {"full": sum(per_micro), "per_micro": per_micro, "local": [sum(g) / n_micro for g in grads],
            "local_micro": [[g / n_micro for g in grads[r]] for r in range(world_size)]}


def reference(widths, init_seed: int, draws: dict, world_size: int, n_micro: int, rows: int, loss_fn) -> dict:
    """One process, every rank's data, the same Adam: ``start``, the parameters before the first step, and
    ``params[t]``, after step t."""
    model = make_model(widths, init_seed)
    n = numel(widths)
    m, v, t = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    out = {"start": flat(model), "params": []}
    for step in range(STEPS):
        full = gradients_at(widths, flat(model), draws, step, world_size, n_micro, rows, loss_fn)["full"]
        t += 1
        new = adam_update(flat(model), full, m, v, t, draws["lr"])
        torch.nn.utils.vector_to_parameters(new, model.parameters())
        out["params"].append(flat(model))
    return out


def partition_bound(n: int, world_size: int) -> int:
    """The most elements one rank's partition may hold: an even share, rounded up."""
    return math.ceil(n / world_size)
