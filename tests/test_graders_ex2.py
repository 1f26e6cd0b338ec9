"""Exercise 2's checks: each catches its class of mistake, on every rank, and only that one.

Unit tests call the checks with correct and wrong functions directly. Wrong
submissions are the source notebook with one answer edited, graded in this
process; each must lose exactly the intended test cell's points.
"""

from __future__ import annotations

import os
import random
import re
import sys
import time

import cloudpickle
import numpy as np
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Sampler

import course
import graders.ddp_basics.checks as ex2
import graders.ddp_basics.sampler as ex2s
from course.checks import TIMEOUT_ENV

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

A = "ex2-ddp-basics"
HANG_TIMEOUT = 15  # the check timeout the hang tests use (DDP_COURSE_CHECK_TIMEOUT)


fails = submissions.fails


# --- student functions, right and wrong --------------------------------------------------------


def setup(rank, world_size):
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.new_group(backend="gloo")


def setup_from_environment(rank, world_size):  # also right: torchrun's variables are set, every rank listed
    dist.init_process_group(course.backend())
    return dist.new_group(list(range(world_size)), backend="gloo")


def setup_two_ranks(rank, world_size):
    dist.init_process_group(course.backend(), rank=rank, world_size=2)
    return dist.new_group(backend="gloo")


def setup_nothing(rank, world_size):
    print("ready")


def setup_keywords(rank, world_size):  # also right: another spelling of the same calls
    dist.init_process_group(backend=course.backend(), init_method="env://", world_size=world_size, rank=rank)
    return dist.new_group(ranks=None, backend=dist.Backend.GLOO)


def setup_group_in_a_global(rank, world_size):
    """Also right: the tutorials' habit of a module-level group, made once and returned."""
    global CPU_GROUP
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    CPU_GROUP = dist.new_group(backend="gloo", timeout=__import__("datetime").timedelta(minutes=5))
    return CPU_GROUP


def setup_cpu_spelling(rank, world_size):
    """Right: gloo named for the one device type the group is for (torch's "device:backend" spelling)."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.new_group(backend="cpu:gloo")


def setup_per_device_spelling(rank, world_size):
    """Right: gloo for CPU tensors and for CUDA ones, spelled device by device."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.new_group(backend="cpu:gloo,cuda:gloo")


def setup_group_of_the_default_spelling(rank, world_size):
    """Wrong: the CPU group made with whatever the default group runs, spelled out (nccl on GPUs)."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.new_group(backend=dist.get_backend())


def setup_returns_nothing(rank, world_size):
    """Wrong: makes the CPU group, forgets to return it."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    dist.new_group(backend="gloo")


def setup_returns_the_default_group(rank, world_size):
    """Wrong: the default group is nccl on a GPU machine."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.group.WORLD


def setup_group_of_the_default_backend(rank, world_size):
    """Wrong: a new group without a backend of its own takes the default's (nccl on GPUs)."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.new_group()


def setup_inherited_group_renamed(rank, world_size):
    """A forgery: a group that takes the default's backend (nccl on a GPU), its entry in torch's Python tables
    rewritten to say gloo."""
    from torch.distributed import distributed_c10d as c10d

    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    group = dist.new_group()
    c10d._world.pg_map[group] = ("gloo", c10d._world.pg_map[group][1])
    c10d._world.pg_backend_config[group] = "gloo"
    return group


def setup_group_without_the_last_rank(rank, world_size):
    """Wrong: the CPU group leaves the last rank out (that rank gets torch's placeholder back)."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.new_group(list(range(world_size - 1)), backend="gloo")


def setup_group_in_reverse(rank, world_size):
    """Right: the ranks listed backwards (torch sorts a new group's ranks: rank r is still rank r there)."""
    dist.init_process_group(course.backend(), rank=rank, world_size=world_size)
    return dist.new_group(list(reversed(range(world_size))), backend="gloo")


def setup_reversed_ranks(rank, world_size):
    dist.init_process_group(course.backend(), rank=world_size - 1 - rank, world_size=world_size)


def setup_fixed_gloo(rank, world_size):  # the PyTorch DDP tutorial's setup: right on CPUs only
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def setup_by_cuda(rank, world_size):  # a common idiom: nccl on two ranks sharing one GPU fails
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)


def setup_forged(rank, world_size):
    """Never joins: only makes torch.distributed's own questions answer as if it had."""
    from torch.distributed import distributed_c10d as c10d

    for module in (dist, c10d):
        module.is_initialized = lambda: True
        module.get_rank = lambda group=None: rank
        module.get_world_size = lambda group=None: world_size
        module.get_backend = lambda group=None: "gloo"


def cleanup():
    dist.destroy_process_group()


def cleanup_guarded():  # also right: the tutorials' guard, and a barrier first
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cleanup_forged():
    """Destroys nothing: only makes torch.distributed say it did."""
    from torch.distributed import distributed_c10d as c10d

    dist.is_initialized = c10d.is_initialized = lambda: False
    import course.launcher.rank as rank_side

    rank_side._STATE["destroy_called"] = True


def cleanup_barrier_only():
    dist.barrier()


def cleanup_rank0_only():
    if dist.get_rank() == 0:
        dist.destroy_process_group()


class ShardSampler(Sampler):
    """Right: a torch Generator seeded with seed + epoch, padded by repeating the order's start, every W-th index."""

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        self.n = len(dataset)
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.epoch = 0
        self.per_rank = self.n // num_replicas if drop_last else -(-self.n // num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        total = self.per_rank * self.num_replicas
        while len(order) < total:
            order += order[: total - len(order)]
        return iter(order[:total][self.rank::self.num_replicas])

    def __len__(self):
        return self.per_rank


class NumpyChunkSampler:
    """Right, another style: no torch Sampler base, numpy's generator, contiguous chunks, np.resize to pad."""

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        self.size, self.replicas, self.rank, self.seed, self.drop = len(dataset), num_replicas, rank, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.size // self.replicas if self.drop else -(-self.size // self.replicas)

    def __iter__(self):
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
        perm = np.resize(perm, len(self) * self.replicas)
        k = len(self)
        yield from (int(i) for i in perm[self.rank * k:(self.rank + 1) * k])


class PythonRandomSampler:
    """Right, another style: random.Random seeded from a string, a generator __iter__, len from the order."""

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.seed, self.drop_last, self.epoch = seed, drop_last, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _order(self):
        order = list(range(len(self.dataset)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        if self.drop_last:
            return order[:len(order) - len(order) % self.num_replicas]
        return order + order[:(-len(order)) % self.num_replicas]

    def __iter__(self):
        for position, index in enumerate(self._order()):
            if position % self.num_replicas == self.rank:
                yield index

    def __len__(self):
        return len(self._order()) // self.num_replicas


class SamplerIgnoringEpoch(ShardSampler):
    def set_epoch(self, epoch):
        pass  # the order never changes


class SamplerWithoutPadding(ShardSampler):
    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return iter(order[self.rank::self.num_replicas])


class SamplerSameShard(ShardSampler):
    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return iter((order + order)[:self.per_rank])  # forgets the rank


class SamplerSeededByRank(ShardSampler):
    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch + self.rank)  # "different data on every rank"
        order = torch.randperm(self.n, generator=g).tolist()
        return iter((order + order)[:self.per_rank * self.num_replicas][self.rank::self.num_replicas])


class SamplerGlobalRandom(ShardSampler):
    def __iter__(self):
        order = torch.randperm(self.n).tolist()  # the process's random state: not deterministic
        return iter((order + order)[:self.per_rank * self.num_replicas][self.rank::self.num_replicas])


class SamplerNotShuffled(ShardSampler):
    def __iter__(self):
        order = list(range(self.n))  # every rank's part of 0..n-1, padded: right lengths, never shuffled
        total = self.per_rank * self.num_replicas
        return iter((order + order)[:total][self.rank::self.num_replicas])


class SamplerIgnoringSeed(ShardSampler):
    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)  # the epoch alone: every seed gives the same order
        order = torch.randperm(self.n, generator=g).tolist()
        total = self.per_rank * self.num_replicas
        return iter((order + order)[:total][self.rank::self.num_replicas])


class SamplerCountingFromOne(ShardSampler):
    def __iter__(self):
        return (i + 1 for i in super().__iter__())  # positions 1..n: n is no index of the dataset


class SamplerLenOfDataset(ShardSampler):
    def __len__(self):
        return self.n


class SamplerLenIgnoringDropLast(ShardSampler):
    """Wrong: len() ceil(n / W) whatever drop_last (the indices themselves right)."""

    def __len__(self):
        return -(-self.n // self.num_replicas)


class SamplerCutBeforeShuffle(ShardSampler):
    """Wrong: with drop_last the dataset is cut to a multiple of W first, then shuffled: the same samples are left
    out in every epoch."""

    def __iter__(self):
        total = self.per_rank * self.num_replicas
        kept = torch.arange(self.n)[:total] if total <= self.n else torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = kept[torch.randperm(len(kept), generator=g)].tolist()
        while len(order) < total:
            order += order[: total - len(order)]
        return iter(order[self.rank::self.num_replicas])


class SamplerIgnoringDropLast(ShardSampler):
    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        super().__init__(dataset, num_replicas, rank, seed, False)


class SamplerFromTorch(DistributedSampler):
    """torch's own, under the exercise's name: not the student's."""

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last)


class SamplerWrappingTorchQuietly:
    """A forgery: switches the grader's profile hook off, then delegates to torch's DistributedSampler."""

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        sys.setprofile(None)
        self.inner = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last)

    def set_epoch(self, epoch):
        sys.setprofile(None)
        self.inner.set_epoch(epoch)

    def __iter__(self):
        sys.setprofile(None)
        return iter(list(self.inner))

    def __len__(self):
        return len(self.inner)


def _loop(rank, model, loader, epochs, lr, *, wrap=True, set_epoch="epoch", reduction="sum", scale=True,
          extra_sync=False, log_on_rank0=False, smallest=0):
    """The summed objective's loop (scale: the rank's loss times the world size, which DDP's average divides out),
    with one mistake or another switched on."""
    ddp_model = DDP(model) if wrap else model
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    factor = dist.get_world_size() if scale else 1
    for epoch in range(epochs):
        if set_epoch == "epoch":
            loader.sampler.set_epoch(epoch)
        elif set_epoch == "rank0" and rank == 0:
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if len(x) < smallest:
                continue
            optimizer.zero_grad()
            loss = F.mse_loss(ddp_model(x), y, reduction=reduction) * factor
            loss.backward()
            if extra_sync:
                for p in ddp_model.parameters():
                    dist.all_reduce(p.grad)
            optimizer.step()
            if log_on_rank0 and rank == 0:
                dist.all_reduce(loss.detach().clone())  # the others never call it
    return ddp_model


def train(rank, model, loader, epochs, lr):
    return _loop(rank, model, loader, epochs, lr)


def train_no_ddp(rank, model, loader, epochs, lr):
    return _loop(rank, model, loader, epochs, lr, wrap=False)


def train_no_set_epoch(rank, model, loader, epochs, lr):
    return _loop(rank, model, loader, epochs, lr, set_epoch=None)


def train_set_epoch_rank0(rank, model, loader, epochs, lr):
    return _loop(rank, model, loader, epochs, lr, set_epoch="rank0")


def train_sum_unscaled(rank, model, loader, epochs, lr):
    """Wrong (the usual mistake): each rank's loss summed, as the objective says, but DDP averages the ranks'
    gradients, so each step is 1/world_size of the summed objective's."""
    return _loop(rank, model, loader, epochs, lr, scale=False)


def train_mean_loss(rank, model, loader, epochs, lr):
    """Wrong: the lesson's loop as it is, on the mean squared error."""
    return _loop(rank, model, loader, epochs, lr, reduction="mean", scale=False)


def train_lr_scaled(rank, model, loader, epochs, lr):
    """Right, another way: plain SGD's step is lr times the gradient, so lr x world_size on the averaged gradient of
    the ranks' sums is the summed objective's step."""
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr * dist.get_world_size())
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp_model(x), y, reduction="sum").backward()
            optimizer.step()
    return ddp_model


def _sum_hook(state, bucket):
    """A DDP communication hook that adds the ranks' gradients up (the default hook divides by the world size)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def train_sum_comm_hook(rank, model, loader, epochs, lr):
    """Right, another API: DDP told to sum, not average, with a communication hook of its own."""
    ddp_model = DDP(model)
    ddp_model.register_comm_hook(None, _sum_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            (ddp_model(inputs) - targets).pow(2).sum().backward()
            optimizer.step()
    return ddp_model


def train_grads_rescaled(rank, model, loader, epochs, lr):
    """Right, and unusual: the gradients multiplied by the world size after backward, before the step."""
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(ddp_model(x), y, reduction="sum").backward()
            for p in ddp_model.parameters():
                p.grad.mul_(dist.get_world_size())
            optimizer.step()
    return ddp_model


def train_extra_all_reduce(rank, model, loader, epochs, lr):
    return _loop(rank, model, loader, epochs, lr, extra_sync=True)


def train_returns_nothing(rank, model, loader, epochs, lr):
    _loop(rank, model, loader, epochs, lr)


def train_logs_batch_size(rank, model, loader, epochs, lr):
    """Right: reads one batch to log its size first (public example code does), and logs each loss
    with another forward of the same batch."""
    x0, _ = next(iter(loader))
    print(f"[rank {rank}] batch size {len(x0)}")
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            (F.mse_loss(ddp_model(x), y, reduction="sum") * dist.get_world_size()).backward()
            optimizer.step()
            with torch.no_grad():
                print(f"[rank {rank}] loss {F.mse_loss(ddp_model(x), y).item():.3f}")
    return ddp_model


class Trainer:
    """Right, in the style of PyTorch's DDP tutorial series (multigpu.py): a class, nn.MSELoss (summed, its gradient
    averaged by DDP: the world size scales the learning rate), set_to_none."""

    def __init__(self, model, loader, lr, local_rank):
        self.loader = loader
        self.model = DDP(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr * int(os.environ["WORLD_SIZE"]))
        self.loss_fn = torch.nn.MSELoss(reduction="sum")
        self.local_rank = local_rank

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.loader.sampler.set_epoch(epoch)
        for source, targets in self.loader:
            self._run_batch(source, targets)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
        return self.model


def train_tutorial_style(rank, model, loader, epochs, lr):
    return Trainer(model, loader, lr, int(os.environ["LOCAL_RANK"])).train(epochs)


def train_one_epoch_short(rank, model, loader, epochs, lr):
    return _loop(rank, model, loader, epochs - 1, lr)


def train_skips_small_batches(rank, model, loader, epochs, lr):
    return _loop(rank, model, loader, epochs, lr, smallest=3)  # "a full batch only": drops the last one


# --- unit tests of the checks ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_setup():
    ex2.check_setup(setup)
    ex2.check_setup(setup_from_environment, world_sizes=(4,))
    fails(ex2.check_setup, setup_two_ranks, "[rank 2]", "do not hard-code the number of ranks")
    fails(ex2.check_setup, setup_nothing, "no process group after setup()", "[ranks 0, 1]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_setup_judges_the_group_for_cpu_tensors():
    """The returned group: gloo whatever the default is, every rank in order, shown by a collective on CPU tensors."""
    ex2.check_setup(setup_group_in_a_global, world_sizes=(3,))
    fails(ex2.check_setup, setup_returns_nothing, "setup() returned NoneType on ranks 0, 1, not a process group")
    for default in (setup_returns_the_default_group, setup_group_of_the_default_backend,
                    setup_group_of_the_default_spelling):
        fails(ex2.check_setup, default, "uses the job's default backend, 'cpu:gloo,cuda:ddpcourse', not gloo",
              "[ranks 0, 1]", "unless it is given its own")
    fails(ex2.check_setup, setup_group_without_the_last_rank, "returned", "on rank 2, not a process group",
          world_sizes=(3,))
    fails(ex2.check_setup, setup_inherited_group_renamed, "registry calls the group setup() returned gloo",
          "[ranks 0, 1]", "only its name says gloo")
    ex2.check_setup(setup_group_in_reverse, world_sizes=(3,))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_setup_takes_gloo_in_every_spelling_torch_has():
    """A CPU group made with "cpu:gloo" once looked like one that took the grader's "cpu:gloo" default, and lost
    its points; the default now names a stand-in for CUDA tensors, which only a group that took it carries."""
    ex2.check_setup(setup_cpu_spelling)
    ex2.check_setup(setup_per_device_spelling, world_sizes=(3,))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_setup_judges_what_a_collective_shows():
    ex2.check_setup(setup_keywords, world_sizes=(3,))
    fails(ex2.check_setup, setup_reversed_ranks, "did not join as ranks 0..1", "group ranks [1, 0]", "rank=rank")
    fails(ex2.check_setup, setup_forged, "no process group after setup()", "a collective could not run",
          "[ranks 0, 1]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_setup_tells_course_backend_from_a_fixed_one_on_a_cpu():
    """On a CPU grader course.backend() and a fixed "gloo" make the same group; the grader's jobs name their backend
    "cpu:gloo,cuda:ddpcourse" (gloo for CPU tensors), so the spec's "never a fixed one" is judged here too."""
    for fixed in (setup_fixed_gloo, setup_by_cuda):
        fails(ex2.check_setup, fixed, "another backend than the one course.backend() names",
              "ranks 0, 1 joined with a fixed 'gloo'", "'cpu:gloo,cuda:ddpcourse'",
              "dist.init_process_group(course.backend())")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_cleanup():
    ex2.check_cleanup(cleanup)
    fails(ex2.check_cleanup, cleanup_barrier_only, "still up", "[ranks 0, 1]", "destroy_process_group")
    fails(ex2.check_cleanup, cleanup_rank0_only, "still up", "[rank 1]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_cleanup_judges_a_real_destroy():
    ex2.check_cleanup(cleanup_guarded, world_sizes=(3,))
    fails(ex2.check_cleanup, cleanup_forged, "still up", "[ranks 0, 1]", "initialize the default process group twice")


HIDDEN_SAMPLER = {"world_sizes": (4,), "cases": ((13, 1, False), (10, 2, True), (6, 4, False))}
SAMPLER_CHECKS = (ex2s.check_sampler_shards, ex2s.check_sampler_order, ex2s.check_sampler_training)


def _sampler_fails(sampler, failing: dict):
    """``sampler`` fails exactly the checks in ``failing`` ({check: words of its message}) and passes the others."""
    for check in SAMPLER_CHECKS:
        if check in failing:
            fails(check, sampler, *failing[check])
        else:
            check(sampler)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_right_samplers_in_three_styles_pass_every_sampler_check():
    for sampler in (ShardSampler, NumpyChunkSampler, PythonRandomSampler):
        for check in SAMPLER_CHECKS[:2]:
            check(sampler)
            check(sampler, **HIDDEN_SAMPLER)
        ex2s.check_sampler_training(sampler)
        ex2s.check_sampler_training(sampler, world_sizes=(3,), n=13, batch_size=2, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_sampler_mistake_loses_its_checks_with_a_message_naming_it():
    _sampler_fails(SamplerIgnoringEpoch, {ex2s.check_sampler_order: ["set_epoch(1) did not change the order",
                                                                     "not once in __init__"]})
    _sampler_fails(SamplerLenOfDataset, {ex2s.check_sampler_training: ["len(loader) is not the number of batches",
                                                                      "__len__ must return"]})
    _sampler_fails(SamplerIgnoringDropLast, {ex2s.check_sampler_shards: ["drop_last=True", "[6, 6] indices per rank",
                                                                         "n // num_replicas"]})
    _sampler_fails(SamplerLenIgnoringDropLast, {ex2s.check_sampler_training: [
        "with drop_last=True, len() of the sampler is not the number of indices it yields", "len() = 5"]})
    _sampler_fails(SamplerCutBeforeShuffle, {ex2s.check_sampler_shards: [
        "the same indices are left out in every epoch", "in each of 6 epochs", "shuffle all n indices first"]})
    # a share of the wrong length is also a DDP run whose ranks take different numbers of steps: a hang
    _sampler_fails(SamplerWithoutPadding, {
        ex2s.check_sampler_shards: ["do not have the contract's length", "[4, 3] indices per rank", "pad"],
        ex2s.check_sampler_training: ["different numbers of steps", "waited in DDP's all-reduce", "pad"]})
    # shares that do not split one permutation train some samples twice and others never
    _sampler_fails(SamplerSameShard, {ex2s.check_sampler_shards: ["every rank got the same share", "rank argument"],
                                      ex2s.check_sampler_training: ["never trained on"]})
    _sampler_fails(SamplerSeededByRank, {ex2s.check_sampler_shards: ["overlap", "never with the rank"],
                                         ex2s.check_sampler_training: ["never trained on", "not the rank"]})
    _sampler_fails(SamplerNotShuffled, {ex2s.check_sampler_order: ["the indices are not shuffled",
                                                                   "always in increasing order", "torch.randperm"]})
    _sampler_fails(SamplerIgnoringSeed, {ex2s.check_sampler_order: ["another seed gave the same order",
                                                                    "seed your generator with seed + epoch"]})
    _sampler_fails(SamplerCountingFromOne, {
        ex2s.check_sampler_shards: ["is not an index of the dataset", "integers 0 .."],
        ex2s.check_sampler_order: ["is not an index of the dataset"],
        ex2s.check_sampler_training: ["IndexError"]})
    _sampler_fails(SamplerGlobalRandom, {
        ex2s.check_sampler_shards: ["overlap", "process's random state"],
        ex2s.check_sampler_order: ["a new sampler with the same seed and epoch yielded other indices",
                                   "not the global random state"],
        ex2s.check_sampler_training: ["never trained on"]})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchs_sampler_under_the_exercises_name_scores_nothing():
    for sampler in (SamplerFromTorch, SamplerWrappingTorchQuietly):
        for check in SAMPLER_CHECKS:
            fails(check, sampler, "runs torch's DistributedSampler", "writing the split yourself")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_training():
    ex2.check_training(train)
    ex2.check_training(train, world_sizes=(4,), n=16, batch_size=3, epochs=2, lr=0.01, seed=1)
    ex2.check_training(train_no_set_epoch)  # set_epoch is check_set_epoch's business
    ex2.check_training(train_set_epoch_rank0)
    fails(ex2.check_training, train_no_ddp, "different parameters", "[rank 1]", "DDP(model)")
    fails(ex2.check_training, train_sum_unscaled, "differ from one process", "1/2 of the summed objective's",
          "DDP averages")
    fails(ex2.check_training, train_sum_unscaled, "1/4 of the summed objective's", world_sizes=(4,), n=16,
          batch_size=3, lr=0.01, seed=1)
    fails(ex2.check_training, train_mean_loss, "differ from one process", "MEAN squared error")
    fails(ex2.check_training, train_extra_all_reduce, "differ from one process", "2 x too large")
    fails(ex2.check_training, train_returns_nothing, "returned NoneType", "return ddp_model")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_is_judged_by_what_reached_the_model():
    """Reading a batch to log it, or a logging forward, is not training; skipping batches or an epoch is wrong."""
    ex2.check_training(train_logs_batch_size)
    ex2.check_set_epoch(train_logs_batch_size)
    ex2.check_training(train_tutorial_style)
    ex2.check_set_epoch(train_tutorial_style)
    for right in (train_lr_scaled, train_sum_comm_hook, train_grads_rescaled):  # the summed objective, other ways
        ex2.check_training(right)
    ex2.check_training(train_sum_comm_hook, world_sizes=(4,), n=16, batch_size=3, epochs=2, lr=0.01, seed=1)
    fails(ex2.check_training, train_one_epoch_short, "wrong number of optimizer steps", "2 epochs")
    fails(ex2.check_training, train_skips_small_batches, "wrong number of optimizer steps", "[ranks 0, 1]",
          n=14, batch_size=3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_set_epoch():
    ex2.check_set_epoch(train)
    ex2.check_set_epoch(train_no_ddp)  # wrapping is check_training's business
    fails(ex2.check_set_epoch, train_no_set_epoch, "same order as epoch 0", "set_epoch(epoch)")
    fails(ex2.check_set_epoch, train_set_epoch_rank0, "overlap", "same epoch number")


# --- wrong submissions, graded as notebooks -------------------------------------------------------


def grade_with(tmp_path, grade_id, old, new):
    return submissions.grade_edited(A, tmp_path, (grade_id, old, new))


WRONG = {
    # name: (answer cell, old text, new text, the test cell that must fail, words its message must contain)
    "no set_epoch": ("ex2_train", "        loader.sampler.set_epoch(epoch)", "        pass",
                     "ex2_test_set_epoch", ["same order", "set_epoch(epoch)"]),
    "every rank saves": ("ex2_save_checkpoint", "    if rank == 0:\n", "    if True:\n",
                         "ex2_test_checkpoint", ["rank 1 also wrote ckpt.pt", "rank == 0"]),
    "saves ddp_model.state_dict()": ("ex2_save_checkpoint", "ddp_model.module.state_dict()", "ddp_model.state_dict()",
                                     "ex2_test_checkpoint", ["'module.'"]),
    "wrong rank saves": ("ex2_save_checkpoint", "if rank == 0:", "if rank:",
                         "ex2_test_checkpoint", ["instead of rank 0"]),
    "no barrier after the save": ("ex2_save_checkpoint", "    dist.barrier()  # every rank: no one goes on before the file is complete", "",
                                  "ex2_test_checkpoint", ["before rank 0's ckpt.pt was complete", "dist.barrier()"]),
    "no DDP wrap": ("ex2_train", 'DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)',
                    "model", "ex2_test_training", ["different parameters", "DDP(model)"]),
    "no destroy_process_group": ("ex2_cleanup", "dist.destroy_process_group()", "dist.barrier()",
                                 "ex2_test_cleanup", ["still up", "destroy_process_group"]),
    "hard-coded world size": ("ex2_setup", "world_size=world_size,", "world_size=2,",
                              "ex2_test_setup", ["rank 2", "hard-code"]),
    "the CPU group takes the default backend": ("ex2_setup", 'dist.new_group(backend="gloo")', "dist.new_group()",
                                                "ex2_test_setup", ["default backend", "not gloo"]),
    "sampler ignores set_epoch": ("ex2_sampler", "        self.epoch = epoch\n", "        pass\n",
                                  "ex2_test_sampler_order", ["set_epoch(1) did not change the order"]),
}

#: mistakes that break two properties, each judged by its own check: (answer, old, new, failing tests, words)
WRONG_TWICE = {
    "sampler without padding": ("ex2_sampler", "        while len(order) < wanted:  # pad by repeating the start of the order\n"
                                "            order += order[:wanted - len(order)]\n", "",
                                ["ex2_test_sampler_shards", "ex2_test_sampler_training"],
                                ["do not have the contract's length", "pad"]),
}


#: name: ([(answer cell, old, new)], failing test cells, words)
MISTAKES = {name: ([(gid, old, new)], [failing], words) for name, (gid, old, new, failing, words) in WRONG.items()}
# the lesson's loop as it is: the mean squared error, not scaled (two edits of one answer)
MISTAKES["the lesson's mean loss"] = ([("ex2_train", ', reduction="sum")', ")"),
                                      ("ex2_train", "(local * dist.get_world_size()).backward()", "local.backward()")],
                                     ["ex2_test_training"], ["MEAN squared error", "SUM over the global batch"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    """The mistakes of a group (:func:`submissions.pack`: other answer cells, other test cells) in one submission."""
    submissions.grade_packed(A, tmp_path, MISTAKES, group)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(WRONG_TWICE))
def test_wrong_submission_loses_exactly_the_tests_of_what_it_breaks(tmp_path, name):
    grade_id, old, new, failing, words = WRONG_TWICE[name]
    report = grade_with(tmp_path, grade_id, old, new)
    submissions.assert_loses_exactly(report, A, failing, words)
    assert "different numbers of steps" in submissions.messages(report)["ex2_test_sampler_training"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_barrier_inside_rank0_branch_is_caught_within_the_check_timeout(tmp_path, monkeypatch):
    """save_checkpoint with the barrier inside `if rank == 0:` loses the checkpoint test only, in bounded time."""
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    start = time.monotonic()
    report = grade_with(tmp_path, "ex2_save_checkpoint", "\n    dist.barrier()", "\n        dist.barrier()")
    seconds = time.monotonic() - start
    assert submissions.scores(report) == submissions.losing(A, "ex2_test_checkpoint")
    assert "inside `if rank == 0:`" in submissions.messages(report)["ex2_test_checkpoint"]
    assert seconds < HANG_TIMEOUT + 60, f"grading took {seconds:.0f} s"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collective_inside_rank0_branch_in_training_deadlocks_within_the_bound(tmp_path, monkeypatch):
    """An all_reduce on rank 0 only, in the training loop: a real DDP deadlock; both checks that
    train fail as soon as the ranks' collectives show it (not at their deadline), naming the line."""
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    start = time.monotonic()
    report = grade_with(tmp_path, "ex2_train", "            sgd.step()\n",
                        "            sgd.step()\n"
                        "            if rank == 0:  # count the steps of all ranks\n"
                        "                dist.all_reduce(torch.ones(1))\n")
    seconds = time.monotonic() - start
    assert submissions.scores(report) == submissions.losing(A, "ex2_test_training", "ex2_test_set_epoch")
    for test in ("ex2_test_training", "ex2_test_set_epoch"):
        message = submissions.messages(report)[test]
        # found as a deadlock at once: rank 0 in its extra all_reduce, rank 1 already in DDP's next step
        assert "job deadlocked: rank 0 waits in all_reduce" in message, message
        assert re.search(r"Cell In\[\d+\], line \d+: dist\.all_reduce\(torch\.ones\(1\)\)", message), message
        assert "inside `if rank == 0:`" in message
    assert seconds < HANG_TIMEOUT + 60, f"grading took {seconds:.0f} s"
