"""What the elastic checks know from outside the student's workers: the checkpoint as the grader's process read it
at each change of membership, the secret change it made to it then, and a replay of each round from there.

The launch (:func:`course.checks.torchrun.run_elastic`) holds every new worker at the probe's gate until
:func:`at_round` has run in the grader's process, the old round's workers all gone and no worker of the new round
having run the script: it reads CKPT (only as plain data, ``weights_only=True``), keeps the model's weights and
SGD's momentum found there, and adds a secret seed's shift to every copy of them in the file (written back
atomically). A worker that really loads CKPT carries the shift on; one that recomputes the weights by hand, never
loads them, or (joining) never loads the optimizer state, does not, and its round's weights then differ from a
replay from the shifted state. Nothing here is read from the probe's records, which live in the student's
processes: the samples and learning rates a replay takes are what the probe saw, and the weights the round left
(the next snapshot, or final.pt) must equal that replay, so a record that lies gives weights that do not match.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from course.checks import torchrun
from graders.common.torchrun_model import compare_weights, make_model, random_shift, shift_of
from graders.elastic.story import MOMENTUM, Round, Story, make_dataset, step_lr

ATOL = 1e-5
_TMP = ".ddp-course-grader-shift.tmp"


@dataclass
class Snapshot:
    """CKPT as the grader's process found it at a round's start (before its shift) or at the end of the job."""

    exists: bool
    sha: str | None = None
    weights: dict | None = None  # the model's state dict in it (the first copy; "module." prefixes removed)
    momentum: list | None = None  # SGD's momentum buffers in parameter order (None: none in it)
    seed: int | None = None  # the secret seed of the shift written back (None: not shifted)
    momentum_shifted: bool = False
    problem: str = ""  # why the file could not be read as plain data, or holds no copy of the model's weights


@functools.cache
def _shapes() -> dict[str, torch.Size]:
    """The model's state dict names and shapes, in order (its parameters are these, in this order)."""
    return {k: v.shape for k, v in make_model().state_dict().items()}


def _names() -> list[str]:
    return list(_shapes())


def momentum_shift_of(seed: int) -> list[torch.Tensor]:
    """The shift of each momentum buffer (parameter order) the grader makes with ``seed``."""
    g = torch.Generator().manual_seed(seed + 1)
    return [random_shift(p.shape, g) for p in make_model().parameters()]


def _model_dicts(obj, found: list) -> None:
    """Every dict in ``obj`` that holds the model's state dict (its names, prefixes aside, as tensors)."""
    if isinstance(obj, dict):
        names = {str(k).removeprefix("module.").removeprefix("_orig_mod."): k for k in obj}
        wanted = _shapes()
        if set(wanted) <= set(names) and all(isinstance(obj[names[n]], torch.Tensor)
                                             and obj[names[n]].shape == wanted[n] for n in wanted):
            found.append((obj, names))
        for value in obj.values():
            _model_dicts(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _model_dicts(value, found)


def _optimizer_states(obj, found: list) -> None:
    """Every optimizer state dict in ``obj`` with a momentum buffer for each of the model's parameters:
    (its "state" dict, the keys of the parameters in order)."""
    if isinstance(obj, dict):
        state, groups = obj.get("state"), obj.get("param_groups")
        if isinstance(state, dict) and isinstance(groups, list):
            ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
            shapes = list(_shapes().values())
            if len(ids) == len(shapes) and all(
                    isinstance(state.get(i), dict) and isinstance(state[i].get("momentum_buffer"), torch.Tensor)
                    and state[i]["momentum_buffer"].shape == s for i, s in zip(ids, shapes)):
                found.append((state, ids))
        for value in obj.values():
            _optimizer_states(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _optimizer_states(value, found)


def at_round(path: str, starting: bool) -> Snapshot:
    """The launcher's ``on_round``, in the grader's process: read CKPT and, at a round's start, shift every copy of
    the model's weights and of SGD's momentum in it by a fresh secret seed's amount (written back atomically)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return Snapshot(exists=False)
    except OSError as exc:
        return Snapshot(exists=True, problem=f"the grader could not read CKPT ({exc})")
    snap = Snapshot(exists=True, sha=hashlib.sha256(raw).hexdigest())
    try:
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - not plain data: said to the student
        snap.problem = (f"the grader could not read CKPT as plain data with torch.load(..., weights_only=True) "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")
        return snap
    models, optimizers = [], []
    _model_dicts(state, models)
    _optimizer_states(state, optimizers)
    if not models:
        snap.problem = "CKPT holds no copy of the model's state dict (its names and shapes, as tensors)"
        return snap
    first, names = models[0]
    snap.weights = {n: first[names[n]].detach().clone().float() for n in _names()}
    if optimizers:
        opt_state, ids = optimizers[0]
        snap.momentum = [opt_state[i]["momentum_buffer"].detach().clone().float() for i in ids]
    if not starting:
        return snap
    seed = int.from_bytes(os.urandom(4), "little")
    shift, mshift = shift_of(seed), momentum_shift_of(seed)
    for obj, names in models:
        for n, delta in shift.items():
            obj[names[n]] = obj[names[n]] + delta.to(obj[names[n]].dtype)
    for opt_state, ids in optimizers:
        for i, delta in zip(ids, mshift):
            buf = opt_state[i]["momentum_buffer"]
            opt_state[i]["momentum_buffer"] = buf + delta.to(buf.dtype)
    tmp = os.path.join(os.path.dirname(path), _TMP)
    torch.save(state, tmp)
    os.replace(tmp, path)
    snap.seed, snap.momentum_shifted = seed, bool(optimizers)
    return snap


State = tuple[dict, list]  # (the model's weights, the momentum buffers in parameter order; None entries: none yet)


def fresh() -> State:
    """The state a job that loads nothing starts from: the given model, no momentum."""
    return {k: v.detach().clone() for k, v in make_model().state_dict().items()}, [None] * len(_names())


def loaded(snap: Snapshot, momentum: list | None, shifted: bool = True) -> State:
    """The state a round starts from when its workers load ``snap`` as the grader left it (``shifted``) or as it
    was before (the state a job recomputing the same weights by hand would have): the momentum from the file where
    it holds one, else ``momentum`` (the replay's of the round before)."""
    weights = {k: v.clone() for k, v in snap.weights.items()}
    bufs = [m.clone() for m in snap.momentum] if snap.momentum is not None else \
        [None if m is None else m.clone() for m in (momentum or [None] * len(weights))]
    if shifted and snap.seed is not None:
        for k, delta in shift_of(snap.seed).items():
            weights[k] += delta
        if snap.momentum_shifted:
            bufs = [b + d for b, d in zip(bufs, momentum_shift_of(snap.seed))]
    return weights, bufs


def replay(start: State, steps: list[list[list[int]]], lrs: list[float]) -> list[State]:
    """The state before each of ``steps`` and after the last, in one process, from ``start``: per step DDP's
    average of each rank's mean loss, SGD with momentum at that step's learning rate."""
    x, y = make_dataset().tensors
    model = make_model()
    model.load_state_dict(start[0])
    params = list(model.parameters())
    momentum = [None if m is None else m.clone() for m in start[1]]
    states = [({k: v.detach().clone() for k, v in model.state_dict().items()}, list(momentum))]
    for per_rank, lr in zip(steps, lrs, strict=True):
        parts = [p for p in per_rank if p]
        loss = sum(nn.functional.mse_loss(model(x[p]), y[p]) for p in parts) / len(per_rank)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():  # torch.optim.SGD's update, written out: the buffer does not hold the lr
            for i, (p, g) in enumerate(zip(params, grads)):
                momentum[i] = g.clone() if momentum[i] is None else momentum[i].mul(MOMENTUM).add_(g)
                p.sub_(lr * momentum[i])
        states.append(({k: v.detach().clone() for k, v in model.state_dict().items()},
                       [None if m is None else m.clone() for m in momentum]))
    return states


def matches(states: list[State], weights: dict | None) -> list[int]:
    """The step counts after which the replay's weights equal ``weights`` within :data:`ATOL`."""
    if weights is None:
        return []
    found = []
    for n, (w, _) in enumerate(states):
        diff = compare_weights(weights, w)
        if diff is not None and diff <= ATOL:
            found.append(n)
    return found


def distance(states: list[State], weights: dict | None, n: int) -> float | None:
    """Max |diff| between ``weights`` and the replay's after ``n`` steps (None: other keys or shapes)."""
    return None if weights is None else compare_weights(weights, states[n][0])


def _round_key(r: Round) -> tuple:
    env = r.workers[0].of("start")[0]["env"]
    return env.get("WORLD_SIZE"), env.get("MASTER_ADDR"), env.get("MASTER_PORT")


def weigh(story: Story) -> None:
    """Pair each round with the grader's snapshots of CKPT and replay it from where a load leaves it."""
    notes = list(story.run.round_notes or [])
    story.at_end = next((note for key, note in reversed(notes) if key is None), None)
    at = 0
    for r in story.rounds:
        key = _round_key(r)
        found = next((i for i in range(at, len(notes)) if notes[i][0] == key), None)
        if found is not None:
            story.start[r.number], at = notes[found][1], found + 1
    for i, r in enumerate(story.rounds):
        after = story.rounds[i + 1] if i + 1 < len(story.rounds) else None
        story.end[r.number] = story.start.get(after.number) if after is not None else story.at_end
        snap = story.start.get(r.number)
        before = story.rounds[i - 1] if i else None
        if not isinstance(snap, Snapshot) or not snap.exists:
            begin = fresh()
            story.origin[r.number] = None
        elif snap.weights is None:
            begin = None
            story.origin[r.number] = None
        else:
            momentum = None
            if before is not None and story.matched.get(before.number) and story.replay.get(before.number):
                momentum = story.replay[before.number][story.matched[before.number][-1]][1]
            story.carried[r.number] = momentum
            begin = loaded(snap, momentum)
            if before is not None:
                n = story.matched[before.number][-1] if story.matched.get(before.number) else len(before.batches)
                story.origin[r.number] = (before.number, n)
        story.replay[r.number] = None if begin is None else replay(
            begin, r.batches, [step_lr(story, r, n) for n in range(len(r.batches))])
        end = story.end[r.number]
        story.matched[r.number] = (matches(story.replay[r.number], getattr(end, "weights", None))
                                   if story.replay[r.number] else [])


def commits_by_round(story: Story) -> dict[int, int] | None:
    """How many times each round put CKPT in place, in the kernel's account of CKPT's folder (read by the launcher,
    from its own process: no worker can add to it): the moves into CKPT (and closes after writing it in place)
    between the grader's own move that changed CKPT when the round started and its next one (the first round runs
    before any). A round that started without a change of the grader's is counted with the one before. None where
    the kernel could not be asked, or where CKPT was moved in from a folder it did not watch (the kernel keeps two
    such moves in a row as one when they are read late: :func:`~course.launcher.fswatch.lone_moves`, so the count
    could be short of what rank 0 did; the probe's record of rank 0's writes then says how often)."""
    files = story.run.files
    if files is None:
        return None
    folder, name = os.path.dirname(story.run.ckpt_path), os.path.basename(story.run.ckpt_path)
    if torchrun.lone_moves(files, folder, name):
        return None
    graders = {e.cookie for e in files if e.kind == "moved_from" and e.name == _TMP}
    segments, count = [], 0
    for e in files:
        if e.folder != folder or e.name != name or e.kind not in ("moved_to", "close_write"):
            continue
        if e.kind == "moved_to" and e.cookie in graders:
            segments.append(count)
            count = 0
        else:
            count += 1
    segments.append(count)
    found, at = {}, 0
    for i, r in enumerate(story.rounds):
        snap = story.start.get(r.number)
        if i and isinstance(snap, Snapshot) and snap.seed is not None:
            at += 1
        found[r.number] = segments[at] if at < len(segments) else 0
    return found

