"""The grader's side of exercise 3's FSDP notebook that is not a verdict: its model (:class:`Net`), each
rank's data, the single-process reference, and the harnesses that run on the ranks (:mod:`graders.fsdp_checkpoint.checks`
holds the checks).

The harnesses take torch's classes and functions (DTensor, its ``to_local``, the flight recorder's
dump, module hooks) when this module is imported, which in a rank is before the student's objects
are unpickled: reassigning torch attributes cannot fake an observation.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import distributed_c10d as _c10d
from torch.distributed.tensor import DTensor, Shard

from course import checks

#: the grader's process groups' timeout, a backstop only: the stall watch names a collective some rank skipped within
#: seconds, while on a busy 2-core grader a peer can lag by more than 15 s (CI saw it), and a right answer must not lose
PG_TIMEOUT = timedelta(seconds=60)
INPUTS, OUTPUTS = 6, 2
BATCH = 4  # samples per rank and step
LR = 0.05
MOMENTUM = 0.9


class Block(nn.Module):
    """A residual MLP block: the unit ``fully_shard`` is applied to; ``hidden`` wide inside (2 * width by default)."""

    def __init__(self, width: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 2 * width
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """``embed`` -> ``blocks`` (an ``nn.ModuleList`` of :class:`Block`) -> ``head``.

    ``hiddens``: each block's inner width (``depth`` of them; 2 * width each by default); ``outputs``: the head's."""

    def __init__(self, width: int = 8, depth: int = 3, hiddens: tuple | None = None, outputs: int = OUTPUTS):
        super().__init__()
        hiddens = tuple(hiddens) if hiddens else (None,) * depth
        self.embed = nn.Linear(INPUTS, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for hidden in hiddens)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(spec: tuple, outputs: int = OUTPUTS) -> Net:
    """The model of ``spec`` = (width, depth, seed) or (width, depth, seed, hiddens), with weights from ``seed``, its
    head ``outputs`` wide."""
    width, depth, seed = spec[:3]
    torch.manual_seed(seed)
    return Net(width, depth, hiddens=spec[3] if len(spec) > 3 else None, outputs=outputs)


def batch(rank: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: every rank's data has its own mean and scale."""
    g = torch.Generator().manual_seed(1000 * seed + 50 * step + rank)
    x = torch.randn(BATCH, INPUTS, generator=g) * (1 + 0.5 * rank) + rank
    y = torch.stack([torch.sin(x.sum(1)), torch.cos(x[:, 0] - x[:, 1])], dim=1)
    return x, y


def _global_batch(world_size: int, step: int, seed: int):
    parts = [batch(r, step, seed) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


# In a rank this module is imported while the job's payload is unpickled, before the student's objects: what
# is taken here is torch's own, whatever the student's code later assigns to torch's attributes.
_DTENSOR = DTensor
_SHARD = Shard
_TO_LOCAL = DTensor.to_local
_PLACEMENTS = DTensor.placements.fget
_MESH = DTensor.device_mesh.fget
_IS_INSTANCE = isinstance
_NAMED_PARAMETERS = nn.Module.named_parameters
_PRE_HOOK = nn.Module.register_forward_pre_hook
_CLONE = torch.Tensor.clone
_DETACH = torch.Tensor.detach
_CPU = torch.Tensor.cpu
_SGD = torch.optim.SGD
_OPTIMIZER = torch.optim.Optimizer
_RECORDED = checks.recorder()  # taken at import, before student code
_INIT_PG = _c10d.init_process_group


def _join() -> torch.device:
    """Join the job as the grader: gloo on the CPU, or the job's backend with this rank's GPU (selected first)."""
    dev = checks.device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        _INIT_PG(checks.backend(), device_id=dev, timeout=PG_TIMEOUT)
    else:
        _INIT_PG("gloo", timeout=PG_TIMEOUT)
    return dev


def _data(rank: int, step: int, seed: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(rank, step, seed)
    return x.to(dev), y.to(dev)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return _CLONE(_CPU(_DETACH(t)))


def _local(p) -> torch.Tensor:
    """This rank's part of a parameter (all of it when it is a plain tensor)."""
    return _copy(_TO_LOCAL(p)) if _IS_INSTANCE(p, _DTENSOR) else _copy(p)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _local(p) for name, p in _NAMED_PARAMETERS(model)}


def _gathers_so_far() -> list[int] | None:
    """The per-rank sizes of every all-gather this rank ran so far (the flight recorder); None without one."""
    if _RECORDED is None:
        return None
    entries = _RECORDED()
    out = []
    for e in entries:
        name = str(e.get("profiling_name", "")).lower()
        if "all_gather" in name or "allgather" in name:
            sizes = e.get("input_sizes") or [[0]]
            n = 1
            for d in sizes[0]:
                n *= int(d)
            out.append(n)
    return out


def _shard_of(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``t`` sharded on dim 0 (possibly none)."""
    chunks = t.chunk(world_size)
    return chunks[rank] if rank < len(chunks) else t[:0]


def _full(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's dim-0 shards (rank order)."""
    return {name: torch.cat([obs[name] for obs in per_rank]) for name in per_rank[0]}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in b)


def reference_shard(model: nn.Module) -> nn.Module:
    """The right answer of part 1, which the other parts' checks use: blocks, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _shard_harness(rank: int, shard_model, spec: tuple) -> dict:
    dev = _join()
    model = make_net(spec).to(dev)
    returned = shard_model(model)
    obs: dict = {"returned": None}
    if returned is not None and not _IS_INSTANCE(returned, nn.Module):
        obs["returned"] = type(returned).__name__
        return obs
    if returned is not None:
        model = returned
    params = {}
    for name, p in _NAMED_PARAMETERS(model):
        if _IS_INSTANCE(p, _DTENSOR):
            placements = _PLACEMENTS(p)
            params[name] = {"dtensor": True, "placements": [repr(pl) for pl in placements],
                            "rows": all(_IS_INSTANCE(pl, _SHARD) and pl.dim == 0 for pl in placements),
                            "mesh": int(_MESH(p).size()), "local": list(_TO_LOCAL(p).shape)}
        else:
            params[name] = {"dtensor": False, "local": list(p.shape)}
    obs["params"] = params
    blocks = getattr(model, "blocks", None)
    if not _IS_INSTANCE(blocks, nn.ModuleList):
        obs["blocks"] = None
        return obs
    marks: list[dict] = []

    def pre_hook(index):
        def hook(module, args):
            gathered = _gathers_so_far()
            whole = all(not _IS_INSTANCE(p, _DTENSOR) and list(p.shape) == full
                        for (_, p), full in zip(_NAMED_PARAMETERS(module), shapes[index]))
            marks.append({"block": index, "gathers": None if gathered is None else len(gathered), "whole": whole})
        return hook

    shapes = [[list(t.shape) for _, t in _NAMED_PARAMETERS(Block(spec[0]))] for _ in blocks]
    for index, block in enumerate(blocks):
        _PRE_HOOK(block, pre_hook(index))
    before = _gathers_so_far()
    with torch.no_grad():
        model(_data(rank, 0, spec[2], dev)[0])
    after = _gathers_so_far()
    obs["blocks"] = len(blocks)
    obs["marks"] = marks
    obs["gathers"] = None if after is None else after[len(before):]
    obs["start"] = None if before is None else len(before)
    return obs


def reference_optimizer(model: nn.Module, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)


def reference_step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def decays(p: torch.Tensor) -> bool:
    """Whether part 2's optimizer decays ``p``: the weight matrices (two dimensions or more), not the biases."""
    return p.dim() >= 2


def _training_harness(rank: int, make_optimizer, spec: tuple, steps: int, weight_decay: float) -> dict:
    dev = _join()
    model = make_net(spec).to(dev)
    optimizer = make_optimizer(model, LR, weight_decay, reference_shard)
    if not _IS_INSTANCE(optimizer, _OPTIMIZER):
        return {"optimizer": type(optimizer).__name__}
    init = _locals(model)
    own = {id(p) for _, p in _NAMED_PARAMETERS(model)}
    names = {id(p): name for name, p in _NAMED_PARAMETERS(model)}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    obs = {"optimizer": None, "sgd": type(optimizer) is _SGD, "type": type(optimizer).__name__,
           "groups": [[float(g.get("lr", -1)), float(g.get("momentum", -1))] for g in optimizer.param_groups],
           # each group's weight_decay, and its parameters' names with whether part 2 decays them (:func:`decays`)
           "decay": [[float(g.get("weight_decay", 0)), [[names.get(id(p), "?"), decays(p)] for p in g["params"]]]
                     for g in optimizer.param_groups],
           "foreign": sum(id(p) not in own for p in held), "held": len(held),
           "plain": [name for name, p in _NAMED_PARAMETERS(model) if not _IS_INSTANCE(p, _DTENSOR)],
           "init": init}
    for step in range(steps):
        reference_step(model, optimizer, *_data(rank, step, spec[2], dev))  # the exercise's given training step
    obs["final"] = _locals(model)
    return obs


@checks.reference
@torch.no_grad()
def _training_reference(spec: tuple, ws: int, steps: int, weight_decay: float) -> dict[str, torch.Tensor]:
    """Single-process SGD on the global batch, ``weight_decay`` on the weight matrices only."""
    model = make_net(spec)
    params = list(model.parameters())
    optimizer = torch.optim.SGD([{"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
                                 {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}],
                                lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        with torch.enable_grad():  # the exercise's given step (SGD's own update is no_grad inside)
            reference_step(model, optimizer, *_global_batch(ws, step, spec[2]))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _trained(rank: int, spec: tuple, steps: int, dev):
    """The grader's own sharded model and optimizer after ``steps`` steps on this rank's batches."""
    model = reference_shard(make_net(spec).to(dev))
    optimizer = reference_optimizer(model)
    for step in range(steps):
        reference_step(model, optimizer, *_data(rank, step, spec[2], dev))
    return model, optimizer


def _momenta(model: nn.Module, optimizer) -> dict[str, torch.Tensor | None]:
    """This rank's part of SGD's momentum buffer of every parameter (None: the optimizer holds no state for it)."""
    state = optimizer.state
    out = {}
    for name, p in _NAMED_PARAMETERS(model):
        buf = state[p].get("momentum_buffer") if p in state else None
        out[name] = None if buf is None else _local(buf)
    return out


def _save_harness(rank: int, save_checkpoint, path: str, spec: tuple, steps: int) -> dict:
    model, optimizer = _trained(rank, spec, steps, _join())
    obs = {"params": _locals(model), "momentum": _momenta(model, optimizer)}
    with checks.record_writes() as writes:  # which rank wrote which file of the checkpoint, however it wrote it
        save_checkpoint(model, optimizer, path)
    obs["writes"] = sorted({e["path"] for e in writes})
    obs["moves"] = [(e["from"], e["path"]) for e in writes if e["how"] == "rename" and e.get("from")]
    return obs  # no collective of the grader's after the student's: a save on some ranks only hangs in DCP's own


def _observers():
    """What :func:`_finetune_harness` observes after the student's code has run, as closures over torch's own
    functions taken now (at import, before any student object is unpickled). Code that patches torch and then
    reloads this module, or executes its source again, rebinds the module's names, never these."""
    to_local, dtensor, is_instance = DTensor.to_local, DTensor, isinstance
    named, clone, cpu, detach = nn.Module.named_parameters, torch.Tensor.clone, torch.Tensor.cpu, torch.Tensor.detach

    def local(p):
        return clone(cpu(detach(to_local(p) if is_instance(p, dtensor) else p)))

    def params(model):
        return {name: local(p) for name, p in named(model)}

    return params


_OBSERVERS = _observers()


def finetune_spec(spec: tuple) -> tuple:
    """The new task's model: the saved one's width and depth, weights from another seed (its head wider)."""
    width, depth, seed = spec[:3]
    return (width, depth, seed + 100)


def _finetune_harness(rank: int, load_for_finetune, path: str, spec: tuple, outputs: int) -> dict:
    """A freshly built sharded model for a new task (its head ``outputs`` wide, other weights than the saved model's),
    given to the student's ``load_for_finetune`` with the checkpoint at ``path``; this rank's rows of every parameter
    after (what they were before, the grader knows: it builds the same model again from the spec)."""
    params = _OBSERVERS  # bound before the student's code runs: see _observers
    dev = _join()
    model = reference_shard(make_net(finetune_spec(spec), outputs=outputs).to(dev))  # the grader builds it again
    load_for_finetune(model, path)
    return {"params": params(model)}


def _export_harness(rank: int, export_parts, folder: str, spec: tuple, steps: int) -> dict:
    """Every rank calls ``export_parts`` with the trained sharded model and the same ``folder``; every file each rank
    wrote while it ran (however it wrote it) is recorded."""
    model, _ = _trained(rank, spec, steps, _join())
    params = _locals(model)
    with checks.record_writes() as writes:  # every file this rank writes, however it writes it
        export_parts(model, folder)
    return {"params": params, "writes": sorted({e["path"] for e in writes})}
