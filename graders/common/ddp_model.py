"""What exercise 2's checks run and compare with, apart from their verdicts (:mod:`graders.ddp_basics.checks`): the shared
model and datasets, the harnesses that run on the ranks, and the single-process training reference.

What a student's code can overwrite in its own process (dist.is_initialized, dist.get_rank, ...) is
never read here. A harness acts with torch's own functions (:data:`course.checks.REAL`, taken before
the student's code runs) and observes effects: a collective that only completes in a real process group
of every rank, a re-initialisation that only succeeds after the student's group was really destroyed.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from course import checks

HOLD_LIMIT = 4.0  # least seconds rank 0's checkpoint write waits for ranks that neither wait for it nor return


def make_net(seed: int) -> nn.Sequential:
    """The model the checks train (4 inputs, 2 outputs), with weights from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class IndexDataset(Dataset):
    """Item i is the integer i: a loader over it shows exactly which samples a rank gets."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return int(i)


class RegressionDataset(Dataset):
    """(x, y) pairs from a fixed seed; every x row is different, so a batch says which samples it holds."""

    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(500 + seed)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = torch.randn(n, 2, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def indices_of(self, x: torch.Tensor) -> list[int]:
        """The sample index of every row of a batch of inputs (-1: not a sample of this dataset)."""
        rows = {self.x[i].numpy().tobytes(): i for i in range(len(self.x))}
        return [rows.get(row.numpy().tobytes(), -1) for row in x.detach().to("cpu", torch.float32).reshape(-1, 4)]


#: seconds a rank waits for the others after cleanup(): only a peer stuck in its cleanup is that late (whether every
#: rank destroyed its group is settled through the store first, so a rank that kept its group never leaves its peers
#: waiting in a rendezvous); a load-starved peer a few seconds late must not make a right cleanup lose
REJOIN_TIMEOUT = 60
#: seconds between the other ranks' starts of save_checkpoint, the last rank first: a rank 0 that takes the states in
#: the order they arrive (a receive from any source) gets them reversed, every run, not now and then
ARRIVAL_STAGGER = 0.3
_REAL = checks.REAL  # torch's own functions, taken before any student code runs (the captured-torch guard)
#: the CPU generator's functions, bound at import, before any student code runs (a payload that patches torch's names
#: as it is unpickled cannot make the ranks' secret states predictable)
_RNG_STATE, _SEED, _DRAW, _URANDOM = torch.get_rng_state, torch.manual_seed, torch.rand, os.urandom
#: where torch keeps the default group (init_process_group refuses a second one while ``WORLD`` is set), bound at import
_GROUP_MEMBER = dist.distributed_c10d.GroupMember


def _membership(real: checks.RealTorch, rank: int, world_size: int, dev) -> dict:
    """Prove, with a collective, that this process is rank ``rank`` of one group of ``world_size``.

    Each rank draws a random token and all-gathers it through the real default group: only a real
    group of every rank can hand each rank all the others' tokens, in rank order."""
    token = int.from_bytes(os.urandom(6), "little")
    mine = torch.tensor([token], dtype=torch.int64, device=dev)
    gathered = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    try:
        real.all_gather(gathered, mine)
    except Exception as exc:  # noqa: BLE001 - no (real) default group: whatever torch then raises
        return {"joined": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"joined": True, "token": token, "gathered": [int(t.item()) for t in gathered],
            "backend": str(real.get_backend())}


def _setup_harness(rank, setup, _real=_REAL):
    real = _real  # bound at import, before any student object is unpickled
    world_size = int(os.environ["WORLD_SIZE"])
    checks.prepare_alias()  # the name course.backend() gives in this job (course.checks.backends) can be joined
    returned = setup(rank, world_size)
    nccl = os.environ.get("DDP_COURSE_BACKEND") == "nccl"
    dev = torch.device("cuda", real.cuda_device()) if nccl else "cpu"
    obs = _membership(real, rank, world_size, dev)
    obs["device"] = real.cuda_device() if nccl else None  # the GPU this rank selected
    if obs["joined"]:
        obs["cpu_group"] = _cpu_group(real, returned, world_size, dev)
    return obs


def _backend_for(group, device: str):
    """The backend object ``group`` runs collectives on ``device``'s tensors with (None: it has none)."""
    try:
        return group._get_backend(torch.device(device))
    except Exception:  # noqa: BLE001 - no backend for that device type
        return None


def _own_gloo(group) -> bool:
    """Whether ``group`` was made with gloo of its own for CPU tensors: its CPU backend is gloo and, for CUDA
    tensors, it has none or gloo, not the stand-in the job's default names (course.checks.backends: torch's fake
    process group), which a group that took the default's backend carries. Set when the group was made: a name in
    torch's Python registry can be rewritten, this cannot."""
    cuda = _backend_for(group, "cuda")
    if cuda is None and os.environ.get(checks.BACKEND_ENV) == checks.PLAIN_ALIAS:
        return False  # no stand-in (course.checks.backends): only a group made with "gloo" shows its own backend
    return (type(_backend_for(group, "cpu")).__name__ == "ProcessGroupGloo"
            and (cuda is None or type(cuda).__name__ == "ProcessGroupGloo"))


def _cpu_group(real: checks.RealTorch, group, world_size: int, dev) -> dict:
    """What the group ``setup`` returned is: its backend and size as torch's registry has them, the backends the group
    object itself runs, and (where every rank returned a gloo group of every rank) who answers in a collective on CPU
    tensors through it: each rank's fresh token must come back to every rank at its own rank's place. The ranks first
    agree, through the default group, whether all of them have a group to use (a rank without one would leave the
    others waiting in the collective)."""
    found: dict = {"kind": type(group).__name__}
    if isinstance(group, dist.ProcessGroup):
        try:
            found.update(backend=str(real.get_backend(group)), size=real.get_world_size(group))
        except Exception as exc:  # noqa: BLE001 - a group torch does not know (made by hand, or destroyed)
            found["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        # what the group object itself runs, set when it was made (a name in torch's Python registry can be
        # rewritten; this cannot): see _own_gloo
        found["made_for_gloo"] = _own_gloo(group)
        found["is_default"] = group is dist.group.WORLD  # only to say so in a message
    usable = torch.tensor([1 if found.get("size") == world_size and checks.gloo_for_cpu(found.get("backend"))
                           and found.get("made_for_gloo") else 0], device=dev)
    real.all_reduce(usable, op=dist.ReduceOp.MIN)
    if not int(usable.item()):
        return found
    token = int.from_bytes(_URANDOM(6), "little")
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    try:
        real.all_gather(gathered, torch.tensor([token], dtype=torch.int64), group=group)  # CPU tensors
    except Exception as exc:  # noqa: BLE001 - shown to the student
        found["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return found
    found.update(token=token, gathered=[int(t.item()) for t in gathered])
    return found


def _cleanup_harness(rank, cleanup, store_dir, _real=_REAL):
    from datetime import timedelta

    real = _real  # bound at import, before any student object is unpickled
    dev = checks.join_job()
    world_size = int(os.environ["WORLD_SIZE"])
    backend = str(real.get_backend())
    cleanup()
    # Only a destroyed default group lets a new one be made: try, through a store of our own. The ranks first tell
    # each other whether they still hold a default group, so that none waits in a rendezvous for a peer that cannot come.
    store = dist.FileStore(os.path.join(store_dir, "rejoin"), world_size)
    store.set_timeout(timedelta(seconds=REJOIN_TIMEOUT))
    holds = _GROUP_MEMBER.WORLD is not None
    store.set(f"held/{rank}", "1" if holds else "0")
    if holds:
        try:
            real.init(backend, store=store, rank=rank, world_size=world_size)  # refuses at once: a group is set
        except ValueError as exc:  # "trying to initialize the default process group twice"
            return {"destroyed": False, "rejoined": False, "error": str(exc).splitlines()[0][:200]}
    try:
        store.wait([f"held/{r}" for r in range(world_size)])
    except RuntimeError as exc:  # a peer still in its cleanup (the job's deadline or the stall watch names it)
        return {"destroyed": True, "rejoined": False, "error": str(exc).splitlines()[0][:200]}
    kept = [r for r in range(world_size) if store.get(f"held/{r}") == b"1"]
    if kept:
        return {"destroyed": True, "rejoined": False,
                "error": f"{checks.rank_list(kept)} kept its process group, so no new one could be made"}
    try:
        real.init(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=REJOIN_TIMEOUT))
    except (ValueError, RuntimeError) as exc:
        return {"destroyed": not isinstance(exc, ValueError), "rejoined": False, "error": str(exc).splitlines()[0][:200]}
    obs = {"destroyed": True, **_membership(real, rank, world_size, dev)}
    obs["rejoined"] = obs.pop("joined")
    real.destroy()
    return obs


def _train_harness(rank, train, n, batch_size, epochs, lr, seed):
    """Train with the student's train(); observe what reached the model and what each optimizer step used.

    A forward pre-hook on the model records the samples of every training forward (grad on, model in
    training mode); a global optimizer step hook closes a step. So a step's batch is what the model
    really saw before that step, whatever else the loop reads from the loader (to log a batch size, say).
    """
    dev = checks.join_job()
    world_size = dist.get_world_size()
    model = make_net(seed + 17 * rank).to(dev)  # different on purpose: DDP must broadcast rank 0's weights
    dataset = RegressionDataset(n, seed)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    steps: list[list[int]] = []
    pending: list[list[int]] = []  # the forwards since the last step, one list of samples each

    def on_forward(module, args):
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            seen = dataset.indices_of(args[0])
            if seen not in pending:  # the same batch again (its loss logged, say): one use
                pending.append(seen)

    def on_step(optimizer, args, kwargs):
        if pending:  # an optimizer stepping inside another's step (ZeRO) is not one more step
            steps.append([i for seen in pending for i in seen])
            pending.clear()

    model.register_forward_pre_hook(checks.grader_hook(on_forward))
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(on_step)
    try:
        returned = train(rank, model, loader, epochs, lr)
    finally:
        handle.remove()
    return {"state": checks.to_cpu(model.state_dict()), "steps": steps,
            "returned": type(returned).__name__, "is_ddp": isinstance(returned, DDP)}


def _reference(steps_per_rank, n, lr, seed, lr_scale=1.0, zero_grad=True, reduction="mean"):
    """One process that took the same optimizer steps on the global batches (all ranks' batches together), on the
    squared error's ``reduction`` over each global batch ("mean" or "sum")."""
    dataset = RegressionDataset(n, seed)
    model = make_net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr * lr_scale)
    for step in range(len(steps_per_rank[0])):
        idx = torch.tensor([i for steps in steps_per_rank for i in steps[step]])
        if zero_grad:
            opt.zero_grad()
        F.mse_loss(model(dataset.x[idx]), dataset.y[idx], reduction=reduction).backward()
        opt.step()
    return model.state_dict()


def _checkpoint_harness(rank, save_checkpoint, ckpt_path, workdir, seed, hold_limit, _world_size=_REAL.get_world_size):
    """Run save_checkpoint with every file write of the rank recorded (whatever name the student's code
    reached the writing function by) and rank 0's first write into the checkpoint's folder held until the
    other ranks wait for it in a collective, or return (:class:`course.checks.Hold`); then look at the file.
    Before the call, this rank's CPU generator is seeded from os.urandom and advanced a random number of draws:
    the state it then has (``rng``) is known to this rank alone, so a checkpoint that holds it got it from here."""
    dev = checks.join_job()
    cwd = os.path.join(workdir, f"rank{rank}")  # relative paths and temporary files: a folder of this rank's
    tmp = os.path.join(cwd, "tmp")
    os.makedirs(tmp, exist_ok=True)
    os.chdir(cwd)
    os.environ["TMPDIR"] = tempfile.tempdir = tmp
    model = make_net(seed + 17 * rank).to(dev)
    ddp_model = DDP(model, device_ids=[dev.index]) if dev.type == "cuda" else DDP(model)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank)).to(dev)
    ddp_model(x).pow(2).mean().backward()  # rank-dependent data, averaged: parameters stay equal
    torch.optim.SGD(ddp_model.parameters(), lr=0.1).step()

    hold = checks.Hold(os.path.join(workdir, "hold"), rank, _world_size(), hold_limit)
    folder = os.path.dirname(ckpt_path)

    def before(event):  # rank 0, about to write the checkpoint (or a file beside it): the others must wait
        if rank == 0 and os.path.dirname(event["path"]) == folder:
            hold.wait()

    # this rank's random stream, from a seed no other rank knows: only this rank can tell the checkpoint its state
    _SEED(int.from_bytes(_URANDOM(7), "little"))
    _DRAW(1 + _URANDOM(1)[0])
    rng = _RNG_STATE().clone()
    if rank > 0:  # the last rank first, rank 1 last: states taken in order of arrival are out of rank order
        time.sleep(ARRIVAL_STAGGER * (_world_size() - 1 - rank))
    hold.start()
    try:
        with checks.record_writes(before) as writes:
            save_checkpoint(rank, ddp_model, ckpt_path)
        seen = file_digest(ckpt_path)  # the checkpoint as this rank finds it the moment save_checkpoint returned
    finally:
        hold.returned()
        hold.stop()
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(cwd) for f in fs)
    return {"writes": [dict(e) for e in writes], "files": files, "state": checks.to_cpu(model.state_dict()),
            "seen": seen, "hold": hold.result, "rng": rng}


def file_digest(path: str) -> str:
    """The file's sha256, or "missing"."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return "missing"
