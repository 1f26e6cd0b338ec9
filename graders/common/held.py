"""Modules the grader holds and the ranks drive: evidence of the work, kept where the student's code cannot write.

Some properties are about work itself: the order of a pipeline stage's forwards and backwards, the activations it
holds, the tokens an expert was given. A rank runs the student's code, which can write anything its process
holds, so such work is not done in the ranks at all. A :class:`HeldServer` lives in the check's process (the
trusted verifier when grading, the student's kernel for a self-check) and holds the modules, with weights drawn
there from the OS's randomness (no rank, and no public seed, knows them). Each rank reaches the modules it owns
through a :class:`Held` handle, connected by the grader's harness before the student's code is called, over a Unix
socket whose peer the kernel names (``SO_PEERCRED``):

* ``held.forward(m, key, x)`` sends module ``m`` the input of one piece of work named ``key`` (a micro-batch, a
  batch of tokens); the grader runs the module, keeps what backward needs, and sends back the output;
  ``held.backward(m, key, grad)`` sends the gradient of that output, the grader runs that piece's backward (the
  module's weights' gradients accumulate there) and sends back the input's gradient;
* the grader writes down each module's work in the order it came (its journal: op, key, pieces held after it,
  the input's rows), and the process that drove each owner's connection; a second connection for an owner, a
  module the owner does not own, or a request that breaks the module's rules is refused and written down.

So the only way to a held module's output is to ask the grader for it, and the only way to its weights'
gradients is a backward the grader ran: what a check judges is what the grader did, in its own process. Messages
are fixed-size headers and raw float32 (never pickles): nothing a rank sends can run code in the grader.
"""

from __future__ import annotations

import operator
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable

import torch
import torch.nn as nn

_HELLO = 16  # bytes of an owner's token
_REQUEST = struct.Struct("<ciiii")  # op (b"F", b"B", a subclass's), module, key, rows, columns; then rows x columns float32
_REPLY = struct.Struct("<cii")  # b"\0" + rows, columns, then the float32 values; b"\1" + length, 0, then UTF-8 text
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_URANDOM, _FROM_BYTES = os.urandom, int.from_bytes  # bound at import
_MAX = 1 << 16  # the most rows or columns of one request
_MAX_VALUES = 1 << 22  # the most values of one request (16 MiB): a rank cannot make the grader allocate more


class Refused(ValueError):
    """What a held module will not do (its text goes back to the rank, and into the module's record)."""


class Module:
    """One module as the grader holds it: its layer, the pieces of work in flight, and its journal.

    ``check_forward(key, x)`` and ``check_backward(key, grad)`` (optional) raise :class:`Refused` for a request
    the exercise's rules forbid (a key out of range, a shape other than the exercise's)."""

    def __init__(self, index: int, layer: nn.Module, *, check_forward: Callable | None = None,
                 check_backward: Callable | None = None):
        self.index, self.layer = index, layer
        params = list(layer.parameters())
        self.in_features, self.out_features = params[0].shape[1], params[-1].shape[0]
        self.check_forward, self.check_backward = check_forward, check_backward
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.journal: list[tuple[str, int, int]] = []  # (op, key, pieces held after it)
        self.inputs: list[tuple[int, torch.Tensor]] = []  # (key, the input's rows) of every forward

    def forward(self, key: int, x: torch.Tensor) -> torch.Tensor:
        if self.check_forward is not None:
            self.check_forward(key, x)
        if x.shape[1] != self.in_features:
            raise Refused(f"forward got an input of {x.shape[1]} features; this module takes {self.in_features}")
        leaf = x.clone().requires_grad_(True)
        with torch.enable_grad():
            out = self.layer(leaf)
        self.saved[key] = (leaf, out)
        self.journal.append(("F", key, len(self.saved)))
        self.inputs.append((key, x.clone()))
        return out.detach()

    def backward(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        if key not in self.saved:
            done = any(op == "B" and k == key for op, k, _ in self.journal)
            raise Refused(f"backward({key}, grad) a second time: {key}'s activations were freed by its first "
                          "backward" if done else f"backward({key}, grad) before forward({key}) on this module")
        leaf, out = self.saved[key]
        if tuple(grad.shape) != tuple(out.shape):
            raise Refused(f"backward({key}, grad) got grad of shape {tuple(grad.shape)}; it must be the shape of "
                          f"forward({key})'s output, {tuple(out.shape)}")
        if self.check_backward is not None:
            self.check_backward(key, grad)
        del self.saved[key]
        torch.autograd.backward(out, grad)
        self.journal.append(("B", key, len(self.saved)))
        return leaf.grad

    def report(self) -> dict:
        return {"journal": list(self.journal), "inputs": [(k, x.clone()) for k, x in self.inputs],
                "grads": {name: None if p.grad is None else p.grad.detach().clone()
                          for name, p in self.layer.named_parameters()}}


def _peer(conn: socket.socket) -> int:
    """The process at the other end of a Unix socket, as the kernel says (Linux); -1 where it cannot say (a
    student's self-check on a Mac: the grading machine is Linux)."""
    try:
        return _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
    except (AttributeError, OSError):
        return -1


def _read(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


class HeldServer:
    """``modules`` served to their owners: ``owners[r]`` lists the modules rank r may drive (see the module's
    text). A context manager: leaving it closes the socket and its folder. ``tokens[r]`` and ``address`` are
    what rank r's harness connects with; ``pids[r]``, every process that connected as rank r; ``refused``, what the
    grader refused, in order, as (rank, what)."""

    OPS = (b"F", b"B")  # the requests this server answers (see handle)

    def __init__(self, modules: list[Module], owners: list[list[int]]):
        self.modules, self.owners = modules, [list(o) for o in owners]
        self.tokens = [_URANDOM(_HELLO).hex() for _ in owners]
        self.pids: list[list[int]] = [[] for _ in owners]
        self.refused: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.folder = tempfile.mkdtemp(prefix="ddp-course-held-")
        self.address = os.path.join(self.folder, "held")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(len(owners) + 4)
        threading.Thread(target=self._accept, daemon=True, name="ddp-course-held").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="ddp-course-held-rank").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                token = _read(conn, _HELLO).hex()
            except (OSError, ConnectionError):
                return
            pid = _peer(conn)
            if token not in self.tokens:
                return
            owner = self.tokens.index(token)
            with self.lock:
                self.pids[owner].append(pid)
                first = self.pids[owner][0]
                if len(self.pids[owner]) > 1:
                    self.refused.append((owner, f"a second connection as rank {owner}, from process {pid}"))
                    self._reply_error(conn, f"rank {owner}'s connection to the grader is already driven by process {first}")
                    return
            self._loop(conn, owner)

    def _loop(self, conn: socket.socket, owner: int) -> None:
        while True:
            try:
                op, index, key, rows, cols = _REQUEST.unpack(_read(conn, _REQUEST.size))
                if op not in self.OPS or not (0 < rows <= _MAX and 0 < cols <= _MAX) or rows * cols > _MAX_VALUES:
                    raise Refused(f"a malformed request ({op!r}, {rows} x {cols})")
                values = torch.frombuffer(bytearray(_read(conn, 4 * rows * cols)), dtype=torch.float32)
            except (OSError, ConnectionError):
                return
            except (Refused, struct.error) as exc:
                with self.lock:
                    self.refused.append((owner, f"rank {owner}: {exc}"))
                return
            try:
                with self.lock:
                    out = self.handle(owner, op, index, key, values.reshape(rows, cols))
                data = out.detach().to(torch.float32).contiguous()
                conn.sendall(_REPLY.pack(b"\0", *data.shape) + data.numpy().tobytes())
            except Refused as exc:
                with self.lock:
                    self.refused.append((owner, f"rank {owner}: {exc}"))
                self._reply_error(conn, str(exc))
            except OSError:
                return

    def handle(self, owner: int, op: bytes, index: int, key: int, values: torch.Tensor) -> torch.Tensor:
        """Rank ``owner``'s request ``op`` (one of :attr:`OPS`) with its ``index``, ``key`` and 2-D ``values``: the
        2-D reply, or :class:`Refused`. Called under :attr:`lock`. A server of other work than modules (an
        optimizer's partitions) overrides it and :attr:`OPS`."""
        if index not in self.owners[owner]:
            raise Refused(f"module {index} is not rank {owner}'s: it drives {self.owners[owner]}")
        module = self.modules[index]
        return (module.forward if op == b"F" else module.backward)(key, values)

    @staticmethod
    def _reply_error(conn: socket.socket, text: str) -> None:
        data = text.encode()
        try:
            conn.sendall(_REPLY.pack(b"\1", len(data), 0) + data)
        except OSError:
            pass

    def report(self) -> dict:
        """{"modules": each module's :meth:`Module.report`, "pids": per rank, "refused": what the grader refused,
        in order, "refused_by": the same per rank}."""
        with self.lock:
            return {"modules": [m.report() for m in self.modules], "pids": [list(p) for p in self.pids],
                    "refused": [text for _, text in self.refused],
                    "refused_by": [[text for r, text in self.refused if r == owner] for owner in range(len(self.pids))]}

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> HeldServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def explain(err, refused: list[str]) -> None:
    """Add the grader's first refusal (what a rank asked of its held modules and was refused) to the detail of
    ``err``, a job's failure, unless it already shows it: the rank's traceback says only that a call failed."""
    if refused and refused[0] not in (err.detail or ""):
        err.detail = f"{err.detail or ''}\nthe grader refused: {refused[0]}".strip()


def private_seed() -> int:
    """A seed only this process knows (the held modules' weights)."""
    return _FROM_BYTES(_URANDOM(6), "little")


def as_int(value, what: str) -> int:
    """``value`` as an int: Python's, numpy's or a one-element integer tensor (anything with ``__index__``), never a
    bool; TypeError naming ``what`` otherwise."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} is an int; got {value!r}")


class Held:
    """A rank's connection to the modules it drives, held by the grader (see the module's text)."""

    def __init__(self, address: str, token: str):
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(address)
        self._conn.sendall(bytes.fromhex(token))
        self._lock = threading.Lock()

    def __reduce__(self):
        raise TypeError("a held module cannot be pickled or sent: it is this rank's connection to the grader")

    def ask(self, op: bytes, index: int, key: int, tensor, what: str) -> torch.Tensor:
        """``op`` (b"F" or b"B") of module ``index`` on ``tensor`` for piece ``key``; RuntimeError with the grader's
        words when it refuses. ``what`` names the call in the errors."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} takes a tensor, got {type(tensor).__name__}")
        key = as_int(key, f"{what}: the number of the piece of work")
        data = tensor.detach().to("cpu", torch.float32).contiguous()
        if data.dim() != 2 or data.shape[0] == 0:
            raise ValueError(f"{what} takes a 2-D tensor (rows, features) with at least one row; got shape "
                             f"{tuple(data.shape)}")
        with self._lock:
            try:
                self._conn.sendall(_REQUEST.pack(op, index, key, *data.shape) + data.numpy().tobytes())
            except OSError:  # the grader closed the connection: its reason, when it sent one, is waiting
                pass
            try:
                status, a, b = _REPLY.unpack(_read(self._conn, _REPLY.size))
                if status != b"\0":
                    raise RuntimeError(_read(self._conn, a).decode())
                out = torch.frombuffer(bytearray(_read(self._conn, 4 * a * b)), dtype=torch.float32).reshape(a, b)
            except (OSError, ConnectionError):
                raise RuntimeError("the grader closed this rank's connection to its modules") from None
        return out.to(tensor.device)

    def close(self) -> None:
        self._conn.close()
