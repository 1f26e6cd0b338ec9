"""What check_fix of find_the_hang.ipynb judges from, kept out of the student's reach (:mod:`graders.find_the_hang.checks`).

* **Private validation data.** Each rank of a fix's job holds the real features of its own share of the validation set
  only: the rows of the other ranks' shares are poison (other random rows), and the real rows are drawn in the
  grader's process from a fresh secret, not from the settings (a seed in a frame or an argument regenerates nothing).
  Each rank's view travels in a file of its own that its harness reads and deletes before any rank runs the student's
  function (:func:`take_view`), so no rank can read another's share, whatever frames or files it looks through. The
  poison is drawn (:func:`views`) until the logging rank's shortcut (computing the metric alone over the whole
  validation set it holds) gives another number than the truth: only a metric that really reached the logging rank
  from the other ranks is right.
* **Failed barriers, seen by the launcher.** ``monitored_barrier`` talks point to point, outside gloo's flight
  recorder. When it fails, the process group's C++ code writes the failure to the rank's standard error, which the
  launcher reads into the job's output in its own process (:func:`failed_barriers`): a rank's list of barriers that
  raised (kept in the rank, which the student's code can clear, reload or bypass) only adds what it caught.
* **Genuine waiting.** Whether rank 0 waits in a collective is judged by the code objects of its stack (taken from
  torch's modules when :mod:`graders.find_the_hang.harness` is imported, before student code): code compiled from torch's
  source under torch's file name is no collective (:func:`in_torch_collective_code`).
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import types
import warnings

import torch

#: what gloo's process group writes (ProcessGroupGloo.cpp) when a monitored_barrier fails, on rank 0 and the others
FAILED_BARRIER_LINES = (re.compile(r"Rank \d+ failed to pass monitoredBarrier"),
                        re.compile(r"received errors while waiting for send/recv from rank \d+"),
                        re.compile(r"failed to pass monitoredBarrier"))
#: the launcher's marker of output lines it did not keep (course.launcher.output)
DROPPED = re.compile(r"^\.\.\. \((\d+) lines not kept\) \.\.\.$", re.M)
TRIES = 200  # draws of the poison (and of the secret rows) before giving up on a shortcut-proof set


# --- private validation data (grader side) -----------------------------------------------------------------------


def owned(part: str, rank: int, world_size: int, n: int) -> list[int]:
    """The validation indices whose features ``rank`` needs in ``part``'s given training (its share)."""
    if part == "early":
        chunk = -(-n // world_size)
        return list(range(rank * chunk, min(n, (rank + 1) * chunk)))
    return list(range(rank, n, world_size))


def views(part: str, s: dict, labels: torch.Tensor, features: int, shortcut_differs) -> tuple[torch.Tensor, list]:
    """(the real features, each rank's view of them): the labels are the part's (rank 0 merges with every label in
    "early"); the features of rank r's share are real in its view, the rest are poison. ``shortcut_differs(real,
    view)`` says whether a metric computed alone over ``view`` differs from the truth over ``real``; drawn until it
    does for the logging rank (the secret rows too, if the poison alone cannot make it differ)."""
    gen = torch.Generator().manual_seed(secrets.randbits(62))
    n, ws = len(labels), s["world_size"]
    logger = s.get("log_rank", 0)
    real = torch.randn(n, features, generator=gen)
    out = None
    for attempt in range(TRIES):
        if attempt and attempt % 20 == 0:
            real = torch.randn(n, features, generator=gen)
        out = []
        for rank in range(ws):
            x = real.clone()
            other = [i for i in range(n) if i not in set(owned(part, rank, ws, n))]
            if other:
                x[other] = torch.randn(len(other), features, generator=gen) * (1 + attempt % 4)
            out.append(x)
        if not any(i not in owned(part, logger, ws, n) for i in range(n)) or shortcut_differs(real, out[logger]):
            return real, out
    return real, out  # a model that predicts alike for every input: no data can tell the shortcut apart


def write_views(folder: str, view_x: list[torch.Tensor], labels: torch.Tensor) -> None:
    for rank, x in enumerate(view_x):
        torch.save({"x": x, "y": labels}, os.path.join(folder, f"view{rank}.pt"))


# --- private validation data (rank side) ----------------------------------------------------------------------


def take_view(folder: str, rank: int, dataset, all_reduce, grader_writes):
    """In rank ``rank``'s harness, before the student's function: its view of the validation set (a ``dataset``, the
    part's sample class, filled in), its file deleted, and every rank's deleted before any goes on (a collective
    with ``all_reduce``, torch's own taken before student code)."""
    path = os.path.join(folder, f"view{rank}.pt")
    with open(path, "rb") as fh:
        data = torch.load(fh, weights_only=True)
    with grader_writes():
        os.unlink(path)
    dataset.x, dataset.y, dataset.rows = data["x"], data["y"], {}
    all_reduce(torch.zeros(1))  # no rank's student code runs before every view file is gone
    return dataset


# --- failed barriers, from the launcher's record of the ranks' output ----------------------------------------------


def failed_barriers(outputs: list[str]) -> dict[int, str]:
    """rank -> the line its process group wrote when a barrier of it failed, from the job's output (read by the
    launcher, outside the rank); a rank whose output the launcher had to cut is listed with why."""
    found = {}
    for rank, text in enumerate(outputs):
        for line in text.splitlines():
            if any(p.search(line) for p in FAILED_BARRIER_LINES):
                found[rank] = line.split("] ", 1)[-1].strip()[:200]
                break
        else:
            dropped = DROPPED.search(text)
            if dropped:
                found[rank] = (f"(the rank printed so much that the launcher kept only its first and last lines, "
                               f"{dropped.group(1)} lines were not kept: whether a barrier failed cannot be seen)")
    return found


# --- genuine waiting (rank side) ----------------------------------------------------------------------------------


def torch_code() -> frozenset:
    """Every code object of torch's distributed modules loaded now (their functions, methods, the functions they
    wrap, and the code nested in them): taken before student code, so a copy compiled later is not among them."""
    found: set = set()

    def code(c):
        if isinstance(c, types.CodeType) and c not in found:
            found.add(c)
            for const in c.co_consts:
                code(const)

    def fn(obj, depth=0):
        if depth > 3:
            return
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                fn(f, depth + 1)
            return
        code(getattr(obj, "__code__", None))
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None and wrapped is not obj:
            fn(wrapped, depth + 1)

    with warnings.catch_warnings():  # a deprecated name (torch.distributed.reduce_op) warns when looked at
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            _module_code(name, module, fn)
    return frozenset(found)


def _module_code(name, module, fn) -> None:
    if module is None or not (name.startswith("torch.distributed") or name.startswith("torch.nn.parallel")
                              or name == "torch.autograd.graph"):
        return
    for value in list(vars(module).values()):
        if isinstance(value, type) and getattr(value, "__module__", "") == name:
            for attr in list(vars(value).values()):
                fn(attr)
        else:
            fn(value)


def in_torch_collective_code(frame, genuine: frozenset) -> bool:
    """Whether a frame of this thread's stack (``frame`` and its callers) runs torch's own distributed code."""
    while frame is not None:
        if frame.f_code in genuine:
            return True
        frame = frame.f_back
    return False
