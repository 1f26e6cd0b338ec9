"""A pipeline's stages, held by the grader: the ranks drive them, the grader's process does their work and sees it
(:mod:`graders.common.held`).

A pipeline schedule is an order of work (each stage's forwards and backwards of the micro-batches) and the
memory it costs (the micro-batches whose activations a stage holds at once): neither can be judged from what a
rank reports. So the stages are modules the grader holds: rank s drives stage s through a :class:`RemoteStage`
(``forward(i, x)``, ``backward(i, grad)``, ``i`` the micro-batch), and each stage's journal (its work in order, the
micro-batches held after each step), its weights' gradients and the process that drove it are the grader's record.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from graders.common.held import Held, HeldServer, Module, Refused, private_seed


def make_layers(widths: list[int], seed: int) -> list[nn.Module]:
    """Stage s: ``Linear(widths[s], widths[s+1])``, followed by Tanh except on the last stage."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for s in range(len(widths) - 1):
        linear = nn.Linear(widths[s], widths[s + 1])
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) / widths[s] ** 0.5)
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen) * 0.1)
        layers.append(linear if s == len(widths) - 2 else nn.Sequential(linear, nn.Tanh()))
    return layers


def _micro_batch_rules(rows: int, n_micro: int, in_features: int):
    def check(i: int, x: torch.Tensor) -> None:
        if not 0 <= i < n_micro:
            raise Refused(f"micro-batch {i} does not exist: there are {n_micro} (0 to {n_micro - 1})")
        if tuple(x.shape) != (rows, in_features):
            raise Refused(f"forward({i}, x) got x of shape {tuple(x.shape)}; this stage takes ({rows}, "
                          f"{in_features}), one micro-batch of its input")
    return check


class StageServer(HeldServer):
    """The stages of one pipeline, served to its ranks (rank s drives stage s). A context manager."""

    def __init__(self, widths: list[int], rows: int, n_micro: int):
        self.widths, self.rows, self.n_micro = list(widths), rows, n_micro
        self.seed = private_seed()  # the weights: known to this process only
        modules = [Module(s, layer, check_forward=_micro_batch_rules(rows, n_micro, widths[s]))
                   for s, layer in enumerate(make_layers(self.widths, self.seed))]
        super().__init__(modules, [[s] for s in range(len(modules))])

    def shapes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Each stage's (input, output) shape of one micro-batch."""
        return [((self.rows, self.widths[s]), (self.rows, self.widths[s + 1])) for s in range(len(self.widths) - 1)]

    def stages(self) -> list[dict]:
        """Per stage: its journal, the processes that connected as its rank, what was refused, its gradients."""
        found = self.report()
        return [{"journal": m["journal"], "pids": found["pids"][s], "grads": m["grads"],
                 "refused": found["refused_by"][s]} for s, m in enumerate(found["modules"])]


class RemoteStage:
    """This rank's stage of the pipeline, which the grader holds: ``forward(i, x)`` and ``backward(i, grad)``
    (see the module's text); ``in_shape`` and ``out_shape``: one micro-batch's input and output at this stage."""

    def __init__(self, address: str, token: str, index: int, in_shape, out_shape):
        self.index, self.in_shape, self.out_shape = index, tuple(in_shape), tuple(out_shape)
        self._held = Held(address, token)

    def __repr__(self) -> str:
        return f"<stage {self.index} of the pipeline, held by the grader: in {self.in_shape}, out {self.out_shape}>"

    def __call__(self, *args, **kwargs):
        raise TypeError("a stage is not called like a module: stage.forward(i, x) runs micro-batch i's forward, "
                        "stage.backward(i, grad) its backward")

    def __reduce__(self):
        raise TypeError("a pipeline stage cannot be pickled or sent: it is this rank's connection to its stage")

    def _ask(self, op: bytes, i: int, tensor, what: str) -> torch.Tensor:
        try:
            return self._held.ask(op, self.index, i, tensor, f"stage.{what}({i}, ...)")
        except RuntimeError as exc:
            raise RuntimeError(f"stage {self.index}: {exc}") from None

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``i``'s output of this stage (its activations stay with the grader until ``backward(i)``)."""
        return self._ask(b"F", i, x, "forward")

    def backward(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``i``'s backward through this stage, given the gradient of its output: the gradient of its
        input (this stage's weights' gradients accumulate with the grader)."""
        return self._ask(b"B", i, grad, "backward")

    def close(self) -> None:
        self._held.close()
