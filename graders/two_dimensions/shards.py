"""The model of exercise 3's two-dimensional notebook, its tensor-parallel shards held by the grader
(:mod:`graders.common.held`), each rank's data, and the single-process reference the checks compare with.

The model is ``Linear(d_in, h) -> Tanh -> Linear(h, d_out, bias=False)``, trained with SGD on a (dp, tp) mesh of
ranks, rank ``r`` at ``(r // tp, r % tp)``. Shard ``t`` is the first layer's output features ``t * h / tp`` to
``(t + 1) * h / tp - 1`` (its weight's rows, its bias) and the second layer's matching input features (its weight's
columns): ``shard_t(x)`` is the shard's *partial* output, and the model's output is the sum of the ``tp`` partial
outputs. The grader holds one copy of shard ``t`` for each data-parallel replica, with weights only it knows,
and the rank at ``(d, t)`` drives copy ``d`` of shard ``t`` through :class:`Shard`:

* ``shard(x)``: the partial output, differentiable (its backward asks the grader, where the copy's gradients
  accumulate);
* ``shard.grad()``: the gradients accumulated in the copy, flattened (weight 1, bias 1, weight 2);
* ``shard.step(grad)``: one SGD step of the copy with the flattened ``grad`` (the grader writes it down), then the
  copy's accumulated gradients are zeroed.

Replica ``d``'s batches reach its ranks over their own connections (op ``D``), never in the job's arguments, so no
rank's process holds another replica's data. The grader sees every gradient a step was given and every copy's
weights: which ranks' gradients were combined is judged by what the values are, since each copy's gradient
exists in that copy's rank alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from graders.common.held import Held, HeldServer, Module, Refused, private_seed

LR = 0.1
STEPS = 3


def make_model(d_in: int, h: int, d_out: int, seed: int) -> nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.Linear(h, d_out, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 3))
    return model


def make_shard(model: nn.Sequential, t: int, tp: int) -> nn.Sequential:
    """Shard ``t`` of ``tp``: a copy of the model's slices (see the module's text)."""
    up, down = model[0], model[2]
    h = up.out_features
    rows = slice(t * h // tp, (t + 1) * h // tp)
    shard = nn.Sequential(nn.Linear(up.in_features, h // tp), nn.Tanh(), nn.Linear(h // tp, down.out_features, bias=False))
    with torch.no_grad():
        shard[0].weight.copy_(up.weight[rows])
        shard[0].bias.copy_(up.bias[rows])
        shard[2].weight.copy_(down.weight[:, rows])
    return shard


def flat(module: nn.Module, grads: bool = False) -> torch.Tensor:
    tensors = [(p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p.detach()
               for p in module.parameters()]
    return torch.cat([t.reshape(-1) for t in tensors]).clone()


def draw(dp: int, d_in: int, d_out: int, rows: int, seed: int) -> list[torch.Tensor]:
    """Each replica's batches of every step: a (STEPS * rows, d_in + d_out) tensor, inputs then targets, drawn
    from the OS's randomness mixed with ``seed``."""
    gen = torch.Generator().manual_seed(private_seed() ^ seed)
    return [torch.cat([torch.randn(STEPS * rows, d_in, generator=gen), torch.randn(STEPS * rows, d_out, generator=gen)],
                      1) for _ in range(dp)]


class MeshServer(HeldServer):
    """Every copy of every shard, served to the ranks of a (dp, tp) mesh. A context manager."""

    OPS = (b"F", b"B", b"G", b"S", b"D")

    def __init__(self, dp: int, tp: int, d_in: int, h: int, d_out: int, rows: int, data: list[torch.Tensor]):
        self.dp, self.tp, self.shape = dp, tp, (d_in, h, d_out)
        self.seed = private_seed()
        self.model = make_model(d_in, h, d_out, self.seed)
        self.rows, self.data = rows, data
        shards = [make_shard(self.model, r % tp, tp) for r in range(dp * tp)]
        super().__init__([Module(r, s) for r, s in enumerate(shards)], [[r] for r in range(dp * tp)])
        self.steps: list[list[torch.Tensor]] = [[] for _ in range(dp * tp)]  # per rank, the gradient of each step
        self.weights: list[list[torch.Tensor]] = [[] for _ in range(dp * tp)]  # per rank, its copy after each step

    def handle(self, owner: int, op: bytes, index: int, key: int, values: torch.Tensor) -> torch.Tensor:
        layer = self.modules[owner].layer
        if op in (b"F", b"B"):
            if op == b"F" and tuple(values.shape) != (self.rows, self.shape[0]):
                raise Refused(f"the shard takes a ({self.rows}, {self.shape[0]}) batch; got {tuple(values.shape)}")
            return super().handle(owner, op, owner, key, values)
        if op == b"D":
            return self.data[owner // self.tp]
        if op == b"G":
            return flat(layer, grads=True)[None]
        size = sum(p.numel() for p in layer.parameters())
        if tuple(values.shape) != (1, size):
            raise Refused(f"shard.step(grad) takes the shard's {size} gradient values, flattened; got "
                          f"{values.shape[1]}")
        grad = values[0].clone()
        self.steps[owner].append(grad)
        with torch.no_grad():
            at = 0
            for p in layer.parameters():
                p -= LR * grad[at:at + p.numel()].reshape(p.shape)
                at += p.numel()
                p.grad = None
        self.weights[owner].append(flat(layer))
        return torch.zeros(1, 1)

    def record(self) -> dict:
        found = self.report()
        with self.lock:
            return {"steps": [list(s) for s in self.steps], "weights": [list(w) for w in self.weights],
                    "journal": [m["journal"] for m in found["modules"]], "pids": found["pids"],
                    "refused": found["refused"], "refused_by": found["refused_by"]}


class _Call(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, x, shard, key):
        ctx.shard, ctx.key = shard, key
        return shard._held.ask(b"F", shard.rank, key, x, "shard(x)")

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.shard._held.ask(b"B", ctx.shard.rank, ctx.key, grad, "the backward of shard(x)"), None, None


class Shard:
    """This rank's shard of the model, held by the grader (see the module's text)."""

    def __init__(self, address: str, token: str, rank: int, dp: int, tp: int, shape):
        self.rank, self.dp, self.tp = rank, dp, tp
        d_in, h, d_out = shape
        self.in_features, self.hidden, self.out_features = d_in, h // tp, d_out
        self.numel = d_in * (h // tp) + h // tp + (h // tp) * d_out
        self._held = Held(address, token)
        self._calls = 0
        self._anchor = torch.zeros((), requires_grad=True)  # the shard's weights need gradients even if x does not

    def __repr__(self) -> str:
        return (f"<shard {self.rank % self.tp} of {self.tp} (data-parallel replica {self.rank // self.tp}), held by the "
                f"grader: Linear({self.in_features}, {self.hidden}) -> Tanh -> Linear({self.hidden}, "
                f"{self.out_features}, bias=False)>")

    def __reduce__(self):
        raise TypeError("a shard cannot be pickled or sent: it is this rank's connection to the grader")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        return _Call.apply(self._anchor, x, self, self._calls)

    def grad(self) -> torch.Tensor:
        """The gradients accumulated in this shard since its last step, flattened (weight 1, bias 1, weight 2)."""
        return self._held.ask(b"G", self.rank, 0, torch.zeros(1, 1), "shard.grad()")[0]

    def step(self, grad: torch.Tensor) -> None:
        """One SGD step (learning rate 0.1) of this shard with the flattened ``grad``; its gradients are zeroed."""
        if not isinstance(grad, torch.Tensor) or grad.dim() != 1:
            raise ValueError("shard.step(grad) takes a 1-D tensor: the shard's gradients, flattened like shard.grad()'s")
        try:
            self._held.ask(b"S", self.rank, 0, grad[None], "shard.step(grad)")
        except RuntimeError as exc:
            raise RuntimeError(f"shard.step: {exc}") from None

    def close(self) -> None:
        self._held.close()


def fetch_data(shard: Shard) -> torch.Tensor:
    return shard._held.ask(b"D", shard.rank, 0, torch.zeros(1, 1), "the harness's data")


def batches(data: torch.Tensor, d_in: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(data[s * rows:(s + 1) * rows, :d_in].clone(), data[s * rows:(s + 1) * rows, d_in:].clone())
            for s in range(STEPS)]


def reference(seed: int, shape, dp: int, tp: int, rows: int, data: list[torch.Tensor]) -> dict:
    """One process, every replica's batch at once, plain SGD: per step, each replica's loss, the whole model's
    gradient as shard t's flattened slices (``grads[step][t]``), each replica's own gradient of each shard
    (``replica[step][d][t]``) and the partial outputs (``partial[step][d][t]``); ``weights[step][t]``: shard t's
    slices after the step."""
    d_in, h, d_out = shape
    model = make_model(d_in, h, d_out, seed)
    per = [batches(data[d], d_in, rows) for d in range(dp)]
    out = {"losses": [], "grads": [], "replica": [], "weights": [], "partial": [], "targets": []}
    for step in range(STEPS):
        shards = [make_shard(model, t, tp) for t in range(tp)]
        losses, replica, partial, targets = [], [], [], []
        for d in range(dp):
            x, y = per[d][step]
            for s in shards:
                s.zero_grad()
            parts = [s(x) for s in shards]
            pred = sum(parts)
            loss = nn.functional.mse_loss(pred, y)
            loss.backward()
            losses.append(loss.item())
            targets.append(y)
            partial.append([p.detach() for p in parts])
            replica.append([flat(s, grads=True) for s in shards])
        grads = [sum(replica[d][t] for d in range(dp)) / dp for t in range(tp)]
        with torch.no_grad():  # the same step on the whole model, slice by slice
            for t, s in enumerate(shards):
                rows_ = slice(t * h // tp, (t + 1) * h // tp)
                g = grads[t]
                n1, n2 = s[0].weight.numel(), s[0].bias.numel()
                model[0].weight[rows_] -= LR * g[:n1].reshape(s[0].weight.shape)
                model[0].bias[rows_] -= LR * g[n1:n1 + n2]
                model[2].weight[:, rows_] -= LR * g[n1 + n2:].reshape(s[2].weight.shape)
        out["losses"].append(losses)
        out["partial"].append(partial)
        out["targets"].append(targets)
        out["replica"].append(replica)
        out["grads"].append(grads)
        out["weights"].append([flat(make_shard(model, t, tp)) for t in range(tp)])
    return out
