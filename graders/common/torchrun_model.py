"""Exercise 4's train.py as the checks know it: its given parts, a single-process reference of its training, and
the two helpers both ex4 graders judge a script with (is it written, how far are two sets of weights apart)."""

from __future__ import annotations

import ast
import functools

import torch
import torch.nn as nn

# The script's given parts (the notebook's train.py): tests keep the two in step.
EPOCHS = 4
STEPS_PER_EPOCH = 2
LR = 0.05
MOMENTUM = 0.9


def make_model() -> nn.Module:
    """The tiny model: the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def get_batch(rank: int, epoch: int, step: int):
    """This rank's batch for (epoch, step): different on every rank and in every epoch."""
    g = torch.Generator().manual_seed(1000 * epoch + 10 * step + rank)
    x = torch.randn(8, 4, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


#: the size of each worker's secret offset to its own batches' inputs in the grader's runs (:func:`install`)
OFFSET = 0.5
_randn = torch.randn  # torch's own, bound at import (install replaces torch.randn in the worker)


def offset_of(secret: int, seed: int) -> torch.Tensor:
    """The offset a worker whose secret is ``secret`` adds to the inputs of its batch drawn with ``seed``."""
    g = torch.Generator().manual_seed((secret * 1_000_003 + seed) % (1 << 63))
    return OFFSET * _randn(8, 4, generator=g)


def own_seeds(rank: int) -> dict[int, tuple[int, int]]:
    """The seeds get_batch draws rank ``rank``'s batches with: seed -> (epoch, step)."""
    return {1000 * epoch + 10 * step + rank: (epoch, step) for epoch in range(EPOCHS) for step in range(STEPS_PER_EPOCH)}


def install(rank: int | None, secret: int | None) -> None:
    """The prelude of the grader's torchrun runs, in each worker before the script: the batches this worker draws
    for its own rank carry an offset only it and the grader know (:func:`offset_of` its secret, which the
    worker's zygote drew and told the grader's launcher). torch.randn drawing 8 x 4 values from a generator seeded
    as get_batch seeds this rank's batches returns them plus that offset; every other draw is torch's. So a job
    trains right only on each rank's own batches: a batch of another rank computed here lacks that rank's offset."""
    if rank is None or secret is None:
        return
    seeds = own_seeds(rank)
    original = torch.randn

    def randn(*args, generator=None, **kwargs):
        drawn = original(*args, generator=generator, **kwargs)
        if (generator is not None and tuple(drawn.shape) == (8, 4) and drawn.dtype == torch.float32
                and not drawn.requires_grad and kwargs.get("out") is None):
            seed = generator.initial_seed()
            if seed in seeds:
                drawn = drawn + offset_of(secret, seed).to(drawn.device)
        return drawn

    randn.__doc__, randn.__name__ = original.__doc__, "randn"
    torch.randn = randn


def batch_of(rank: int, epoch: int, step: int, secret: int | None = None):
    """Rank ``rank``'s batch for (epoch, step) in a worker whose secret is ``secret`` (None: get_batch's own)."""
    x, _ = get_batch(rank, epoch, step)
    if secret is not None:
        x = x + offset_of(secret, 1000 * epoch + 10 * step + rank)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def secrets_of(forks: list, world_size: int) -> tuple[tuple, tuple]:
    """The workers' secrets ``(before, after)`` a restart, a secret per rank (None: a rank no zygote forked),
    from what the zygotes told the launcher (``Run.forks``: (pid, RANK, secret) in the order they forked): a
    rank's first worker is the first launch's, its last the restart's (the same worker without a restart)."""
    by_rank: dict[int, list[int]] = {}
    for _, rank, secret in forks:
        if rank is not None and secret is not None:
            by_rank.setdefault(rank, []).append(secret)
    first = tuple(by_rank[r][0] if r in by_rank else None for r in range(world_size))
    last = tuple(by_rank[r][-1] if r in by_rank else None for r in range(world_size))
    return first, last


#: the size of the shift the grader adds to the checkpoint's weights while a crashed job is down
SHIFT = 0.05


def random_shift(shape, generator: torch.Generator) -> torch.Tensor:
    """``SHIFT`` times a random sign times ``1 + |z|`` (``z`` normal) for each value: every value moves by at least
    ``SHIFT``, so no weight's shift is too small to tell a loaded state from one rebuilt by hand."""
    z = torch.randn(shape, generator=generator)
    return SHIFT * torch.where(z >= 0, 1.0, -1.0) * (1 + z.abs())


def shift_of(seed: int) -> dict[str, torch.Tensor]:
    """The shift of each of the model's weights the grader makes with ``seed`` (the seed stays in the grader)."""
    g = torch.Generator().manual_seed(seed)
    return {name: random_shift(p.shape, g) for name, p in sorted(make_model().state_dict().items())}


def shift_checkpoint(path: str) -> int | None:
    """At the crash, in the grader's process: add :func:`shift_of` a fresh secret seed to every copy of the model's
    weights the checkpoint at ``path`` holds (a state dict anywhere in it, "module." prefixes too), written back
    atomically; the seed, or None when the file holds no such weights or does not load as plain tensors."""
    import os

    seed = int.from_bytes(os.urandom(4), "little")
    shift = shift_of(seed)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - no checkpoint yet, or one that is not plain data: judged unshifted
        return None
    found = [0]

    def walk(obj):
        if isinstance(obj, dict):
            names = {str(k).removeprefix("module.").removeprefix("_orig_mod."): k for k in obj}
            if set(shift) <= set(names) and all(isinstance(obj[names[n]], torch.Tensor) for n in shift):
                for name, delta in shift.items():
                    tensor = obj[names[name]]
                    if tensor.shape == delta.shape and tensor.is_floating_point():
                        obj[names[name]] = tensor + delta.to(tensor.dtype)
                        found[0] += 1
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(state)
    if not found[0]:
        return None
    tmp = os.path.join(os.path.dirname(path), ".ddp-course-grader-shift.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return seed


@functools.cache
def expected_weights(world_size: int, ranks: tuple[int, ...] | None = None,
                     resume: tuple | None = None, data: tuple | None = None) -> dict:
    """Final weights of an uninterrupted DDP run on ``world_size`` ranks, computed in one process.

    DDP averages the ranks' gradients, which (equal batch sizes) is one process
    training on all ranks' batches at once. ``ranks`` restricts the data to
    those ranks (``(0,)``: what rank 0 computes when gradients are not averaged).
    ``resume``: a run restarted as ``(restored, first, momentum_kept[, seed])``: the state after
    epochs ``0..restored-1`` (0: none, a fresh model), shifted by :func:`shift_of` ``seed`` where given (the
    grader's change to the checkpoint: a job that loaded it carries it on), then epochs ``first..EPOCHS-1``, the
    optimizer's momentum kept or started afresh at the restart.
    ``data``: the workers' secrets (:func:`install`), ``(before, after)`` the restart, each a secret per rank
    (None: get_batch's batches); None: every batch as get_batch gives it.
    """
    ranks = tuple(range(world_size)) if ranks is None else ranks
    model = make_model()
    params = list(model.parameters())
    momentum = [None] * len(params)
    epochs = list(range(EPOCHS))
    if resume is not None:
        restored, first, momentum_kept, *seed = resume
        epochs = [*range(restored), None, *range(first, EPOCHS)]  # None: the restart
    secrets = [None] * world_size
    if data:
        secrets = list(data[0])
    for epoch in epochs:
        if epoch is None:
            if data:
                secrets = list(data[-1])
            if not momentum_kept:
                momentum = [None] * len(params)
            if seed and seed[0] is not None and restored:
                with torch.no_grad():
                    for (name, p) in model.named_parameters():
                        p.add_(shift_of(seed[0])[name])
            continue
        for step in range(STEPS_PER_EPOCH):
            x, y = _global_batch(ranks, epoch, step, secrets)
            _sgd(params, momentum, torch.autograd.grad(nn.functional.mse_loss(model(x), y), params))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def replayed_by_hand(world_size: int, restored: int, secrets: tuple) -> dict:
    """Rank 0's final weights in a restarted job whose every worker recomputed epochs ``0..restored-1`` by itself
    (on its own batches, with ``secrets`` its offsets, and the other ranks' as get_batch gives them anywhere)
    instead of loading the checkpoint, then trained on with DDP: rank 0's weights broadcast to every rank when
    the model is wrapped, each rank keeping the momentum of its own recomputation (so the ranks' weights part
    after the first step: every rank's gradient is taken at its own weights, and DDP averages them)."""
    params, momenta = [], []
    for rank in range(world_size):
        own = tuple(secret if r == rank else None for r, secret in enumerate(secrets))
        model = make_model()
        momentum = [None] * len(list(model.parameters()))
        for epoch in range(restored):
            for step in range(STEPS_PER_EPOCH):
                x, y = _global_batch(range(world_size), epoch, step, own)
                _sgd(list(model.parameters()), momentum,
                     torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters())))
        params.append(model)
        momenta.append(momentum)
    for model in params[1:]:
        model.load_state_dict(params[0].state_dict())  # DDP's broadcast of rank 0's weights at the wrap
    for epoch in range(restored, EPOCHS):
        for step in range(STEPS_PER_EPOCH):
            grads = []
            for rank, model in enumerate(params):
                x, y = batch_of(rank, epoch, step, secrets[rank])
                grads.append(torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters())))
            average = [sum(g[i] for g in grads) / world_size for i in range(len(grads[0]))]
            for model, momentum in zip(params, momenta):
                _sgd(list(model.parameters()), momentum, average)
    return {k: v.detach().clone() for k, v in params[0].state_dict().items()}


def _global_batch(ranks, epoch: int, step: int, secrets: tuple):
    batches = [batch_of(rank, epoch, step, secrets[rank] if rank < len(secrets) else None) for rank in ranks]
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def _sgd(params: list, momentum: list, grads) -> None:
    """torch.optim.SGD's update with momentum, written out (importing torch.optim costs seconds)."""
    with torch.no_grad():
        for i, (p, g) in enumerate(zip(params, grads)):
            momentum[i] = g.clone() if momentum[i] is None else momentum[i].mul_(MOMENTUM).add_(g)
            p.sub_(LR * momentum[i])


def top_level_stub(source: str) -> bool:
    """Whether the script still holds nbgrader's stub at module level: the released cell's bare
    ``raise NotImplementedError()`` where the student writes the whole script."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False  # require_written_source reports it
    for node in tree.body:
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and not node.exc.args
                and isinstance(node.exc.func, ast.Name) and node.exc.func.id == "NotImplementedError"):
            return True
    return False


def compare_weights(final: dict, reference: dict) -> float | None:
    """Max abs difference to ``reference``; None if the keys or shapes differ."""
    if set(final) != set(reference) or any(final[k].shape != reference[k].shape for k in reference):
        return None
    return max(float((final[k].float() - reference[k]).abs().max()) for k in reference)
