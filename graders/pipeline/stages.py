"""A pipeline's stages, held by the grader: the ranks drive them, the grader's process does their work and sees it.

A pipeline schedule is an order of work (each stage's forwards and backwards of the micro-batches) and the
memory it costs (the micro-batches whose activations a stage holds at once). Neither can be judged from what a
rank reports, since a rank runs the student's code, which can write anything its process holds. So the stages are
not in the ranks at all: :class:`StageServer` lives in the check's process (the trusted verifier when grading, the
student's kernel for a self-check) and holds every stage's layer, with weights drawn there from the OS's randomness
(no rank, and no public seed, knows them). A rank reaches its stage through a :class:`RemoteStage`, connected by the
grader's harness before the student's code is called, over a Unix socket whose peer the kernel names
(``SO_PEERCRED``):

* ``stage.forward(i, x)`` sends micro-batch ``i``'s input to the grader, which runs the layer, keeps what backward
  needs, and sends the output back; ``stage.backward(i, grad)`` sends the output's gradient, the grader runs the
  backward of that micro-batch (its weights' gradients accumulate there) and sends back the input's gradient;
* the grader writes down each stage's work in the order it came (its journal), how many micro-batches' activations
  the stage held after each step, and the process that drove it (one connection per stage, its harness's; a
  second one is refused and written down).

So the only way to a stage's output is to ask the grader for it, and the only way to its gradients is a backward
the grader ran: what the checks judge is what the grader did, in its own process. Messages are fixed-size headers
and raw float32 (never pickles): nothing a rank sends can run code in the grader.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading

import torch
import torch.nn as nn

_HELLO = 16  # bytes of a stage's token
_REQUEST = struct.Struct("<ciii")  # op (b"F" or b"B"), micro-batch, rows, columns; then rows x columns float32
_REPLY = struct.Struct("<cii")  # b"\0" + rows, columns, then the float32 values; b"\1" + length, 0, then UTF-8 text
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_URANDOM, _FROM_BYTES = os.urandom, int.from_bytes  # bound at import


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


class Stage:
    """One stage as the grader holds it: its layer, the micro-batches in flight, and its journal."""

    def __init__(self, index: int, layer: nn.Module, rows: int, n_micro: int):
        self.index, self.layer, self.rows, self.n_micro = index, layer, rows, n_micro
        self.in_features = next(layer.parameters()).shape[1]
        self.out_features = [p for p in layer.parameters()][-1].shape[0]
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.journal: list[tuple[str, int, int]] = []  # (op, micro-batch, micro-batches held after it)
        self.pids: list[int] = []  # the process of each connection that drove this stage
        self.refused: list[str] = []  # what the grader refused to do, in order
        self.lock = threading.Lock()

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if not 0 <= i < self.n_micro:
            raise ValueError(f"micro-batch {i} does not exist: there are {self.n_micro} (0 to {self.n_micro - 1})")
        if tuple(x.shape) != (self.rows, self.in_features):
            raise ValueError(f"forward({i}, x) got x of shape {tuple(x.shape)}; this stage takes "
                             f"({self.rows}, {self.in_features}), one micro-batch of its input")
        leaf = x.clone().requires_grad_(True)
        with torch.enable_grad():
            out = self.layer(leaf)
        self.saved[i] = (leaf, out)
        self.journal.append(("F", i, len(self.saved)))
        return out.detach()

    def backward(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        if i not in self.saved:
            done = any(op == "B" and j == i for op, j, _ in self.journal)
            raise ValueError(f"backward({i}, grad) before forward({i}) on this stage" if not done else
                             f"backward({i}, grad) a second time: micro-batch {i}'s activations were freed by its "
                             "first backward")
        if tuple(grad.shape) != (self.rows, self.out_features):
            raise ValueError(f"backward({i}, grad) got grad of shape {tuple(grad.shape)}; it must be the shape of "
                             f"forward({i})'s output, ({self.rows}, {self.out_features})")
        leaf, out = self.saved.pop(i)
        torch.autograd.backward(out, grad)
        self.journal.append(("B", i, len(self.saved)))
        return leaf.grad

    def report(self) -> dict:
        return {"journal": list(self.journal), "pids": list(self.pids), "refused": list(self.refused),
                "grads": {name: None if p.grad is None else p.grad.detach().clone()
                          for name, p in self.layer.named_parameters()}}


def _read(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


class StageServer:
    """The stages of one pipeline, served to its ranks (see the module's text). A context manager: leaving it
    closes the socket and its folder."""

    def __init__(self, widths: list[int], rows: int, n_micro: int):
        self.widths, self.rows, self.n_micro = list(widths), rows, n_micro
        self.seed = _FROM_BYTES(_URANDOM(6), "little")  # the weights: known to this process only
        self.stages = [Stage(s, layer, rows, n_micro) for s, layer in enumerate(make_layers(self.widths, self.seed))]
        self.tokens = [_URANDOM(_HELLO).hex() for _ in self.stages]
        self.folder = tempfile.mkdtemp(prefix="ddp-course-stages-")
        self.address = os.path.join(self.folder, "stages")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(len(self.stages) + 4)
        self.bound: dict[int, socket.socket] = {}
        self.threads = [threading.Thread(target=self._accept, daemon=True, name="ddp-course-stages")]
        self.threads[0].start()

    def shapes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Each stage's (input, output) shape of one micro-batch."""
        return [((self.rows, self.widths[s]), (self.rows, self.widths[s + 1])) for s in range(len(self.stages))]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="ddp-course-stage")
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                pid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
                token = _read(conn, _HELLO).hex()
            except (OSError, ConnectionError):
                return
            if token not in self.tokens:
                return
            stage = self.stages[self.tokens.index(token)]
            with stage.lock:
                stage.pids.append(pid)
                if len(stage.pids) > 1:
                    stage.refused.append(f"a second connection, from process {pid}")
                    self._reply_error(conn, f"stage {stage.index} is already driven by process {stage.pids[0]}")
                    return
            self._loop(conn, stage)

    def _loop(self, conn: socket.socket, stage: Stage) -> None:
        while True:
            try:
                op, i, rows, cols = _REQUEST.unpack(_read(conn, _REQUEST.size))
                if op not in (b"F", b"B") or not (0 < rows <= 1 << 16 and 0 < cols <= 1 << 16):
                    raise ValueError(f"a malformed request ({op!r}, {rows} x {cols})")
                values = torch.frombuffer(bytearray(_read(conn, 4 * rows * cols)), dtype=torch.float32)
            except (OSError, ConnectionError):
                return
            except (ValueError, struct.error) as exc:
                stage.refused.append(str(exc))
                return
            try:
                with stage.lock:
                    fn = stage.forward if op == b"F" else stage.backward
                    out = fn(i, values.reshape(rows, cols))
                data = out.detach().to(torch.float32).contiguous()
                conn.sendall(_REPLY.pack(b"\0", *data.shape) + data.numpy().tobytes())
            except ValueError as exc:
                stage.refused.append(str(exc))
                self._reply_error(conn, str(exc))
            except OSError:
                return

    @staticmethod
    def _reply_error(conn: socket.socket, text: str) -> None:
        data = text.encode()
        try:
            conn.sendall(_REPLY.pack(b"\1", len(data), 0) + data)
        except OSError:
            pass

    def report(self) -> list[dict]:
        out = []
        for stage in self.stages:
            with stage.lock:
                out.append(stage.report())
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> StageServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteStage:
    """This rank's stage of the pipeline, which the grader holds: ``forward(i, x)`` and ``backward(i, grad)``
    (see the module's text); ``in_shape`` and ``out_shape``: one micro-batch's input and output at this stage."""

    def __init__(self, address: str, token: str, index: int, in_shape, out_shape):
        self.index, self.in_shape, self.out_shape = index, tuple(in_shape), tuple(out_shape)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(address)
        self._conn.sendall(bytes.fromhex(token))
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<stage {self.index} of the pipeline, held by the grader: in {self.in_shape}, out {self.out_shape}>"

    def __call__(self, *args, **kwargs):
        raise TypeError("a stage is not called like a module: stage.forward(i, x) runs micro-batch i's forward, "
                        "stage.backward(i, grad) its backward")

    def __reduce__(self):
        raise TypeError("a pipeline stage cannot be pickled or sent: it is this rank's connection to its stage")

    def _ask(self, op: bytes, i: int, tensor, what: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"stage.{what}({i}, ...) takes a tensor, got {type(tensor).__name__}")
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"stage.{what}(i, ...): i is the micro-batch's number, an int; got {i!r}")
        data = tensor.detach().to("cpu", torch.float32).contiguous()
        if data.dim() != 2:
            raise ValueError(f"stage.{what}({i}, ...) takes a 2-D tensor (rows, features); got shape "
                             f"{tuple(data.shape)}")
        with self._lock:
            self._conn.sendall(_REQUEST.pack(op, i, *data.shape) + data.numpy().tobytes())
            status, a, b = _REPLY.unpack(_read(self._conn, _REPLY.size))
            if status != b"\0":
                raise RuntimeError(f"stage {self.index}: {_read(self._conn, a).decode()}")
            out = torch.frombuffer(bytearray(_read(self._conn, 4 * a * b)), dtype=torch.float32).reshape(a, b)
        return out.to(tensor.device)

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``i``'s output of this stage (its activations stay with the grader until ``backward(i)``)."""
        return self._ask(b"F", i, x, "forward")

    def backward(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``i``'s backward through this stage, given the gradient of its output: the gradient of its
        input (this stage's weights' gradients accumulate with the grader)."""
        return self._ask(b"B", i, grad, "backward")

    def close(self) -> None:
        self._conn.close()
