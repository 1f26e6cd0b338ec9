"""Right answers in other styles, graded as a student meets them: in the notebook, through the kernel and the verifier.

The graders' own tests (test_graders_ex1.py, test_graders_ex2*.py, test_graders_ex3*.py) call the checks directly
with answers written in other styles than the reference. Here those answers are the notebook's answer cells, as a
student would type them (helpers, imports and names bound at a cell's top level included), and each notebook of
ex1-ex3 is graded once with EVERY answer cell replaced: it must score full marks. A grade costs a kernel, so one
submission per notebook holds all its cells. (ex4's notebooks have theirs in test_graders_ex4*.py.)

Also here, at the notebook level: a realistic wrong fix of debug_training's given script.
"""

from __future__ import annotations

import inspect

import pytest
import submissions
import test_graders_ex1_experts as ex1_experts
import test_graders_ex1_pipeline as ex1_pipeline
import test_graders_ex3_activations as ex3_activations
import test_graders_ex3_mesh as ex3_mesh
import test_graders_ex3_zero as ex3_zero

GRADE_TIMEOUT = 300  # one in-process grading of a notebook on a loaded 2-core machine, with room to spare

# --- ex1-parallelism / parallelism ------------------------------------------------------------------------------

PARALLELISM = {
    # numpy's array_split of the row numbers (test_graders_ex1.shard_numpy_indices)
    "ex1_shard_batch": '''
import numpy as np


def shard_batch(batch, rank, world_size):
    rows = np.array_split(np.arange(len(batch)), world_size)[rank]
    return batch[torch.as_tensor(rows, dtype=torch.long)]
''',
    # the gradients and the row count in ONE flat all-reduce (test_graders_ex1.average_one_buffer)
    "ex1_average_gradients": '''
def average_gradients(model, n_local):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) * n_local for g in grads] + [grads[0].new_tensor([float(n_local)])])
    dist.all_reduce(flat)
    flat = flat[:-1] / flat[-1]
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
''',
    # a helper class moving tensors with batched P2P ops (test_graders_ex1.two_stage_pipe)
    "ex1_two_stage_step": '''
class Pipe:
    """Moves tensors between the two stages with batched point-to-point ops."""

    def __init__(self, peer):
        self.peer = peer

    def send(self, tensor):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.contiguous(), self.peer)]):
            work.wait()

    def recv(self, like):
        buffer = torch.empty_like(like)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, self.peer)]):
            work.wait()
        return buffer


def two_stage_step(rank, stage, x, y, hidden_shape):
    pipe = Pipe(1 - rank)
    if rank == 0:
        out = stage(x)
        pipe.send(out.detach())
        out.backward(pipe.recv(out))
        return None
    act = pipe.recv(torch.empty(hidden_shape, device=y.device)).requires_grad_()
    loss = F.mse_loss(stage(act), y)
    loss.backward()
    pipe.send(act.grad)
    return loss.detach()
''',
    # one module holding the four shards, an async all-reduce waited on in backward, a functional collective in
    # forward (test_graders_ex1.tp_async_funcol)
    "ex1_tensor_parallel": '''
import torch.distributed._functional_collectives as funcol


class CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, async_op=True)
        work.wait()
        return grad


class SumOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))

    @staticmethod
    def backward(ctx, grad):
        return grad


class TPMLP(nn.Module):
    def __init__(self, mlp, rank, world_size):
        super().__init__()
        first, self.act, second = mlp
        self.w1 = nn.Parameter(first.weight.detach().chunk(world_size, dim=0)[rank].clone())
        self.b1 = nn.Parameter(first.bias.detach().chunk(world_size)[rank].clone())
        self.w2 = nn.Parameter(second.weight.detach().chunk(world_size, dim=1)[rank].clone())
        self.b2 = nn.Parameter(second.bias.detach().clone())

    def forward(self, x):
        h = self.act(F.linear(CopyIn.apply(x), self.w1, self.b1))
        return SumOut.apply(F.linear(h, self.w2)) + self.b2


def tensor_parallel_mlp(mlp, rank, world_size):
    return TPMLP(mlp, rank, world_size)
''',
}

# --- ex2-ddp-basics / ddp_basics --------------------------------------------------------------------------------

DDP_BASICS = {
    # keywords and env:// spelled out (test_graders_ex2.setup_keywords)
    "ex2_setup": '''
def setup(rank, world_size):
    backend = course.backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend, init_method="env://", world_size=world_size, rank=rank)
    return dist.new_group(list(range(world_size)), backend=dist.Backend.GLOO)
''',
    # the tutorials' guard, and a barrier first (test_graders_ex2.cleanup_guarded)
    "ex2_cleanup": '''
def cleanup():
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
''',
    # no torch Sampler base, numpy's generator, contiguous chunks, np.resize to pad (test_graders_ex2.NumpyChunkSampler)
    "ex2_sampler": '''
import numpy as np


class ShardSampler:
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
''',
    # PyTorch's DDP tutorial series (multigpu.py): a Trainer class, nn.MSELoss (summed; the world size scales the
    # learning rate, since DDP averages), set_to_none (test_graders_ex2.Trainer)
    "ex2_train": '''
class Trainer:
    def __init__(self, model, loader, lr):
        self.device = next(model.parameters()).device
        self.loader = loader
        self.model = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr * dist.get_world_size())
        self.loss_fn = torch.nn.MSELoss(reduction="sum")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(source.to(self.device)), targets.to(self.device))
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


def train(rank, model, loader, epochs, lr):
    return Trainer(model, loader, lr).train(epochs)
''',
    # torch.save through a name bound at the cell's top level (before the grader's job), every rank's state on
    # every rank (all_gather_object), an async barrier waited for (test_graders_ex2_checkpoint.save_bound, _rngs,
    # save_async_barrier_waited)
    "ex2_save_checkpoint": '''
save = torch.save


def save_checkpoint(rank, ddp_model, ckpt_path):
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state())
    if rank == 0:
        save({"model": ddp_model.module.state_dict(), "rng": states}, ckpt_path)
    dist.barrier(async_op=True).wait()
''',
}

# --- ex2-ddp-basics / ddp_from_scratch --------------------------------------------------------------------------

DDP_FROM_SCRATCH = {
    # a plain class, torch's flatten helpers, one all-reduce of every gradient (test_graders_ex2_scratch.NaiveFlat)
    "ex2s_naive": '''
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class NaiveDDP:
    def __init__(self, module):
        self.module = module
        params = list(module.parameters())
        flat = _flatten_dense_tensors([p.data for p in params])
        dist.broadcast(flat, 0)
        for p, value in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
            p.data.copy_(value)

    def __call__(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        params = [p for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors([p.grad for p in params]) / dist.get_world_size()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params])):
            p.grad.copy_(g)
''',
    # Horovod's and apex's style: hooks on each parameter's AccumulateGrad node, futures that copy back, one
    # torch.futures.wait_all (test_graders_ex2_scratch.BucketedFutures)
    "ex2s_bucketed": '''
def _buckets(params, bucket_size_mb):
    cap = int(bucket_size_mb * 2**20)
    buckets = [[]]
    for p in reversed([p for p in params if p.requires_grad]):
        if sum(q.numel() * q.element_size() for q in buckets[-1]) >= cap:
            buckets.append([])
        buckets[-1].append(p)
    return buckets


class BucketedDDP:
    def __init__(self, module, bucket_size_mb):
        self.module = module
        with torch.no_grad():
            for _, p in module.named_parameters():
                dist.broadcast(p, 0)
        self.buckets = _buckets([p for _, p in module.named_parameters()], bucket_size_mb)
        self.ready = set()
        self.futures = []
        self.nodes = []  # the AccumulateGrad nodes must stay alive for their hooks to fire
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                node = p.view_as(p).grad_fn.next_functions[0][0]
                node.register_hook(self._hook(i, p))
                self.nodes.append(node)

    def _hook(self, i, p):
        def hook(*_):
            self.ready.add(p)
            if all(q in self.ready for q in self.buckets[i]):
                self._launch(i)
        return hook

    def _launch(self, i):
        bucket = self.buckets[i]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.flatten() for g in grads]) / dist.get_world_size()
        work = dist.all_reduce(flat, async_op=True)

        def copy_back(fut, bucket=bucket):
            out, offset = fut.value()[0], 0
            for p in bucket:
                p.grad = out[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()

        self.futures.append((i, work.get_future().then(copy_back)))

    def __call__(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        launched = {i for i, _ in self.futures}
        for i in range(len(self.buckets)):
            if i not in launched:
                self._launch(i)
        torch.futures.wait_all([f for _, f in self.futures])
        self.futures, self.ready = [], set()
''',
    # a helper class with sizes from torch tensors; a table of factors summed with numpy
    # (test_graders_ex2_cost.Planner, cost_by_table)
    "ex2s_step_cost": '''
import numpy as np


class Planner:
    def __init__(self, world_size):
        self.n = world_size

    def shard(self, shape):
        rows = torch.empty(shape).tensor_split(self.n)[0].shape[0] if shape[0] % self.n == 0 else -(-shape[0] // self.n)
        return rows * int(torch.Size(shape[1:]).numel())

    def __call__(self, layers, strategy, cap_mb):
        grads = [int(torch.Size(s).numel()) for layer in layers for s in layer][::-1]
        if strategy == "fsdp":
            sizes = [self.n * sum(self.shard(s) for s in layer) for layer in layers]
            return [(op, s) for s in sizes for op in ("all_gather", "reduce_scatter", "all_gather")]
        cap, buckets, acc = cap_mb * 1024 * 1024 / 4, [], []
        for g in grads:
            acc.append(g)
            if sum(acc) >= cap:
                buckets.append(sum(acc))
                acc = []
        buckets += [sum(acc)] if acc else []
        out = [("all_reduce", b) for b in buckets]
        return out + ([("broadcast", g) for g in grads] if strategy == "zero" else [])


def plan_step(layers, world_size, strategy, bucket_cap_mb):
    return tuple(Planner(world_size)(layers, strategy, bucket_cap_mb))


def step_cost(plan, world_size, alpha, bandwidth):
    n = world_size
    factors = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n, 2 * (n - 1) / n), "broadcast": (n - 1, (n - 1) / n, 1.0),
               "all_gather": (n - 1, (n - 1) / n, (n - 1) / n), "reduce_scatter": (n - 1, (n - 1) / n, (n - 1) / n)}
    rows = np.array([(factors[op][0], factors[op][1] * 4 * k, factors[op][2] * 4 * k) for op, k in plan])
    return float(rows[:, 1].sum()), float((rows[:, 0] * alpha).sum() + (rows[:, 2] / bandwidth).sum())
''',
}

# --- ex2-ddp-basics / ddp_in_practice ---------------------------------------------------------------------------

DDP_IN_PRACTICE = {
    # contiguous chunks by hand, each rank's k best (loss, index) pairs gathered as objects, a tensor returned
    "ex2p_hardest": '''
def hardest(model, dataset, rank, world_size, sample_losses, k):
    chunk = -(-len(dataset) // world_size)
    mine = range(rank * chunk, min(len(dataset), (rank + 1) * chunk))
    losses = sample_losses(model, Subset(dataset, mine)).cpu()
    pairs = sorted(zip(losses.tolist(), mine), reverse=True)[:k]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, pairs)
    merged = sorted((p for part in everyone for p in part), key=lambda p: p[0], reverse=True)
    return torch.tensor([i for _, i in merged[:k]])
''',
    # a context chosen per micro-batch, the loss weighted by the batch's fraction
    # (test_graders_ex2_practice.accumulate_nullcontext)
    "ex2p_accumulate_grads": '''
def accumulate_grads(ddp_model, micro_batches):
    k = len(micro_batches)
    fractions = torch.tensor([float(len(x)) for x, _ in micro_batches])
    fractions /= fractions.sum()
    for i, (x, y) in enumerate(micro_batches):
        context = ddp_model.no_sync() if i + 1 < k else contextlib.nullcontext()
        with context:
            loss = F.mse_loss(ddp_model(x), y) * fractions[i]
            loss.backward()
''',
    # the general Join context manager (test_graders_ex2_practice.train_uneven_join_active)
    "ex2p_train_uneven": '''
def train_uneven(ddp_model, optimizer, batches, train_steps):
    with Join([ddp_model], divide_by_initial_world_size=False):
        train_steps(ddp_model, optimizer, batches)
''',
    # torch.load bound at the cell's top level, before any check runs (test_graders_ex2_practice.load_bound_early)
    "ex2p_load_checkpoint": '''
_torch_load = torch.load


def load_checkpoint(ckpt_path, ddp_model, device):
    checkpoint = _torch_load(ckpt_path, map_location=device)
    ddp_model.module.load_state_dict(checkpoint["model"])
    return checkpoint["epoch"]
''',
    # PyTorch's AMP recipe: torch.amp.autocast with enabled=, one `with no_sync()` around the first k - 1
    # micro-batches, clip_grad_norm_ with foreach (test_graders_ex2_practice.amp_recipe_style)
    "ex2p_amp_clip_grads": '''
def amp_clip_grads(ddp_model, optimizer, scaler, micro_batches, max_norm):
    *first, last = micro_batches
    k = len(micro_batches)
    with ddp_model.no_sync():
        for x, y in first:
            with torch.amp.autocast(x.device.type, dtype=torch.float16, enabled=True):
                loss = F.mse_loss(ddp_model(x), y)
            scaler.scale(loss / k).backward()
    with torch.amp.autocast(last[0].device.type, dtype=torch.float16, enabled=True):
        loss = F.mse_loss(ddp_model(last[0]), last[1])
    scaler.scale(loss / k).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm=max_norm, foreach=True)
''',
}

# --- ex2-ddp-basics / debug_training ----------------------------------------------------------------------------

BUGGY = (submissions.EXERCISES / "ex2-ddp-basics" / "buggy_training.py").read_text()
LOADED = "# %load buggy_training.py\n"  # what Jupyter leaves on top of the cell it loaded the script into


def _edit(source: str, *edits: tuple[str, str]) -> str:
    for old, new in edits:
        assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times in buggy_training.py"
        source = source.replace(old, new)
    return source


#: the reference's fix of each of the four bugs (as test_graders_ex2_debug.FIX)
FIX = {
    "shuffle": ("        ddp_model.train()\n", "        sampler.set_epoch(epoch)\n        ddp_model.train()\n"),
    "metric": ("    accuracy = torch.tensor([correct / len(share)], device=device)\n    dist.all_reduce(accuracy)\n"
               "    return accuracy.item() / world_size",
               "    counts = torch.tensor([float(correct), float(len(share))], device=device)\n"
               "    dist.all_reduce(counts)\n    return (counts[0] / counts[1]).item()"),
    "checkpoint": ('"model": ddp_model.state_dict()}', '"model": ddp_model.module.state_dict()}'),
    "finishes": ("        dist.barrier()  # the other ranks", "    dist.barrier()  # the other ranks"),
}

#: other right fixes of the four bugs (as test_graders_ex2_debug.OTHER_FIX): a sampler and loader per epoch, counts
#: gathered as objects, DDP's prefix stripped by hand, an all-reduce as the sync; and rank 0 printing and logging
#: through Python's logging, as the rules allow (test_graders_ex2_debug.RULE_KEEPING)
DEBUG_TRAINING = {
    "ex2d_script": LOADED + _edit(
        BUGGY,
        ("    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)\n\n    for epoch in range(epochs):\n",
         "\n    for epoch in range(epochs):\n        sampler = DistributedSampler(train_set, num_replicas=world_size, "
         "rank=rank, seed=1000 + epoch)\n        loader = DataLoader(train_set, batch_size=batch_size, "
         "sampler=sampler)\n"),
        ("    accuracy = torch.tensor([correct / len(share)], device=device)\n    dist.all_reduce(accuracy)\n"
         "    return accuracy.item() / world_size",
         "    everyone = [None] * world_size\n    dist.all_gather_object(everyone, (correct, len(share)))\n"
         "    return sum(c for c, _ in everyone) / sum(n for _, n in everyone)"),
        ('"model": ddp_model.state_dict()}, ckpt_path)',
         '"model": {k.removeprefix("module."): v for k, v in ddp_model.state_dict().items()}}, ckpt_path)'),
        ("        dist.barrier()  # the other ranks must not go on before the checkpoint is written",
         "    flag = torch.ones(1)\n    dist.all_reduce(flag)  # every rank waits for rank 0's save"),
        ("import torch\n", "import logging\n\nimport torch\n"),
        ('            log({"epoch": epoch, "accuracy": accuracy})\n',
         '            log({"epoch": epoch, "accuracy": accuracy})\n'
         '            print(f"epoch {epoch}: accuracy {accuracy:.3f}")\n'
         '            logging.warning("epoch %d done", epoch)\n'),
    ),
}

# --- ex3-syncbn-sharding / syncbn_sharding ----------------------------------------------------------------------

SYNCBN_SHARDING = {
    # torch's own recipe (nn.SyncBatchNorm on gloo): all_gather every rank's (mean, var, count), drop empty ranks
    # (test_graders_ex3.GATHER_SOURCE)
    "ex3_cpu_sync_batchnorm": '''
class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    def forward(self, x):
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // c
        if n:
            mean = x.mean(dims)
            var = ((x - mean.view([1, c] + [1] * (x.dim() - 2))) ** 2).mean(dims)
        else:
            mean = var = x.sum(dims)
        stats = torch.stack(dist_fn.all_gather(torch.cat([mean, var, x.new_tensor([float(n)])])))
        stats = stats[stats[:, -1] > 0]
        m, v, k = stats[:, :c], stats[:, c:2 * c], stats[:, -1:]
        N = k.sum()
        mean = (k * m).sum(0) / N
        var = (k * (v + (m - mean) ** 2)).sum(0) / N
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * N / (N - 1))
        shape = [1, c] + [1] * (x.dim() - 2)
        normalized = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return normalized * self.weight.view(shape) + self.bias.view(shape)
''',
    # a heap for ZeRO's owners; meta tensors chunked as FSDP2 chunks them (test_graders_ex3.predict_zero_bytes,
    # predict_fsdp_bytes)
    "ex3_predict_memory": '''
import heapq


def predict_zero_bytes(model, world_size):
    params = list(model.parameters())
    everything = sum(p.nbytes for p in params)
    ranks = [(0, r) for r in range(world_size)]
    state = [0] * world_size
    for p in sorted(params, key=lambda p: p.numel(), reverse=True):
        load, r = heapq.heappop(ranks)
        state[r] += sum(t.nbytes for t in (p, p, torch.tensor(0.0)))
        heapq.heappush(ranks, (load + p.numel(), r))
    return [{"params": everything, "grads": everything, "optimizer": s} for s in state]


def predict_fsdp_bytes(model, world_size):
    out = []
    for rank in range(world_size):
        shards = []
        for p in model.parameters():
            chunks = torch.empty(p.shape, dtype=p.dtype, device="meta").chunk(world_size)
            shards.append(chunks[rank] if rank < len(chunks) else torch.empty((0, *p.shape[1:]), device="meta"))
        local = sum(s.numel() * s.element_size() for s in shards)
        out.append({"params": local, "grads": local, "optimizer": 2 * local + 4 * len(shards)})
    return out
''',
    # the local optimizer's own state_dict with the global index of each of its parameters beside it, pickled, a
    # barrier (test_graders_ex3.save_pickled_local_state_dict, load_pickled_local_state_dicts)
    "ex3_shard_checkpoint": '''
import glob
import os
import pickle


def save_shard(optimizer, model, rank, ckpt_dir):
    position = {id(p): i for i, p in enumerate(model.parameters())}
    local = optimizer.optim.state_dict()
    owned = [position[id(p)] for group in optimizer.optim.param_groups for p in group["params"]]
    with open(os.path.join(ckpt_dir, f"rank{rank:03d}.pkl"), "wb") as fh:
        pickle.dump({"local": local, "global_index": owned}, fh)
    dist.barrier()


def load_full_state(ckpt_dir, model):
    merged = {"state": {}, "param_groups": None}
    for path in sorted(glob.glob(os.path.join(ckpt_dir, "rank*.pkl"))):
        with open(path, "rb") as fh:
            part = pickle.load(fh)
        for local_index, state in part["local"]["state"].items():
            merged["state"][part["global_index"][local_index]] = state
        group = dict(part["local"]["param_groups"][0])
        group["params"] = [i for i, _ in enumerate(model.parameters())]
        merged["param_groups"] = [group]
    return merged
''',
}

# --- ex3-syncbn-sharding / fsdp_checkpoint ----------------------------------------------------------------------

FSDP_CHECKPOINT = {
    # an odd depth's lone block first, then pairs, fully_shard's result returned
    # (test_graders_ex3_fsdp.shard_lone_first)
    "ex3f_shard_model": '''
def shard_model(model):
    blocks = list(model.blocks)
    start = len(blocks) % 2
    if start:
        fully_shard(blocks[0])
    for i in range(start, len(blocks), 2):
        fully_shard(blocks[i:i + 2])
    return fully_shard(model)
''',
    # weights and biases told apart by name after sharding, SGD's for-loop implementation
    # (test_graders_ex3_fsdp.make_optimizer_groups_for_loop)
    "ex3f_training": '''
def make_optimizer(model, lr, weight_decay, shard=shard_model):
    shard(model)
    named = list(model.named_parameters())
    weights = [p for name, p in named if name.endswith("weight")]
    others = [p for name, p in named if not name.endswith("weight")]
    return torch.optim.SGD([{"params": weights, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}],
                           lr=lr, momentum=0.9, foreach=False)
''',
    # the model's own state_dict (DTensors) saved beside the optimizer's plain one; the load in place into the
    # model's own sharded tensors, through a partial-load planner, DCP's load bound at the cell's top level
    # (test_graders_ex3_fsdp.save_plain, load_in_place, load_partial_planner)
    "ex3f_checkpoint": '''
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

_dcp_load = dcp.load


def save_checkpoint(model, optimizer, path):
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)


def load_for_finetune(model, path):
    kept = {k: v for k, v in model.state_dict().items() if "head" not in k.split(".")}
    _dcp_load({"model": kept}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
''',
    # the full state dict on every rank, dealt round by round by size; written through a temporary name
    # (test_graders_ex3_fsdp_export.export_dealt_by_size, export_gathered_by_hand)
    "ex3f_export_weights": '''
def export_parts(model, folder):
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    order = sorted(full, key=lambda k: (-full[k].numel(), k))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    target = os.path.join(folder, f"part-{rank}.pt")
    torch.save({k: full[k].clone() for k in order[rank::world_size]}, target + ".tmp")
    os.replace(target + ".tmp", target)
''',
    # every Linear its own unit, found by type, the policy from a helper; torch's two halves of clipping
    # (test_graders_ex3_precision.shard_every_linear, clipped_with_total_norm)
    "ex3f_precision": '''
from torch.distributed.fsdp import MixedPrecisionPolicy


def _policy(output_dtype=None):
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=output_dtype,
                                cast_forward_inputs=True)


def shard_mixed(model):
    for module in list(model.modules()):
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mp_policy=_policy())
    fully_shard(model, mp_policy=_policy(torch.float32))


def clip_gradients(model, max_norm):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return total
''',
}

# --- ex1-parallelism / pipeline and expert_parallel: the answers test_graders_ex1_* hold to their checks ---------


def _renamed(fn, name: str, *helpers) -> str:
    """The source of ``fn`` (and its ``helpers``, first), ``fn`` under the notebook's name ``name``."""
    text = "".join(inspect.getsource(h) + "\n\n" for h in helpers) + inspect.getsource(fn)
    return "\n" + text.replace(f"def {fn.__name__}(", f"def {name}(", 1)


PIPELINE = {
    # Megatron's warm-up, steady state and cool-down over counters
    "pp_pipeline_step": _renamed(ex1_pipeline.megatron_style, "pipeline_step", ex1_pipeline._recv_from),
    # a simulator of one's own
    "pp_predict": _renamed(ex1_pipeline.predict_by_simulation, "predict_pipeline"),
}

EXPERT_PARALLEL = {
    # torch's functional collectives with autograd, Python lists
    "ep_moe_layer": _renamed(ex1_experts.functional_style, "moe_layer"),
}

SHARDED_OPTIMIZER = {
    # a strided partition held by a class of one's own, one add and one step per element
    "so_zero_step": _renamed(ex3_zero.strided_class_style, "zero_step", ex3_zero.StridedZero),
    # bytes a parameter, piece by piece, from the stage that shards each
    "so_predict": _renamed(ex3_zero.predict_by_counting, "predict_zero_memory"),
}

ACTIVATION_MEMORY = {
    # a table of what each layer saves
    "am_predict": _renamed(ex3_activations.predict_by_layer, "predict_saved_bytes"),
    # an autograd Function that recomputes, a planner class
    "am_run_blocks": _renamed(ex3_activations.function_class_style, "run_blocks", ex3_activations.Recompute,
                              ex3_activations.Planner),
}

TWO_DIMENSIONS = {
    # rows and columns as a class over new_subgroups_by_enumeration
    "td_train": _renamed(ex3_mesh.class_style, "train_on_mesh", ex3_mesh.Grid),
    # torch's placement objects, the counts from the slices' shapes
    "td_predict": _renamed(ex3_mesh.predict_with_dtensor_objects, "predict_mesh"),
}

OTHER_STYLES = {
    ("ex1-parallelism", "parallelism"): PARALLELISM,
    ("ex1-parallelism", "pipeline"): PIPELINE,
    ("ex1-parallelism", "expert_parallel"): EXPERT_PARALLEL,
    ("ex2-ddp-basics", "ddp_basics"): DDP_BASICS,
    ("ex2-ddp-basics", "ddp_from_scratch"): DDP_FROM_SCRATCH,
    ("ex2-ddp-basics", "ddp_in_practice"): DDP_IN_PRACTICE,
    ("ex2-ddp-basics", "debug_training"): DEBUG_TRAINING,
    ("ex3-syncbn-sharding", "fsdp_checkpoint"): FSDP_CHECKPOINT,
    ("ex3-syncbn-sharding", "sharded_optimizer"): SHARDED_OPTIMIZER,
    ("ex3-syncbn-sharding", "activation_memory"): ACTIVATION_MEMORY,
    ("ex3-syncbn-sharding", "two_dimensions"): TWO_DIMENSIONS,
    ("ex3-syncbn-sharding", "syncbn_sharding"): SYNCBN_SHARDING,
}


def _code(text: str) -> list[str]:
    """The code lines of a cell: no blank lines, comments, or nbgrader's markers."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _solution(text: str) -> list[str]:
    """The code lines between nbgrader's BEGIN and END SOLUTION markers."""
    lines, inside = [], False
    for line in text.splitlines():
        if "### BEGIN SOLUTION" in line or "### END SOLUTION" in line:
            inside = "BEGIN" in line
        elif inside:
            lines += _code(line)
    return lines


def test_every_notebook_of_ex1_to_ex3_has_every_answer_cell_in_another_style():
    """The graded submissions below replace EVERY answer cell of EVERY notebook of ex1-ex3, each with text that is
    not the reference's: a notebook or an answer cell added later fails here until it has its other style."""
    notebooks = {(a, nb) for a in ("ex1-parallelism", "ex2-ddp-basics", "ex3-syncbn-sharding")
                 for nb in submissions.notebooks(a)}
    assert set(OTHER_STYLES) == notebooks
    for (assignment, notebook), answers in OTHER_STYLES.items():
        nb = submissions.load(assignment, notebook)
        assert list(answers) == submissions.answer_ids(nb), (assignment, notebook)
        for gid, text in answers.items():
            reference = _code(submissions.answer(nb, gid))
            assert _code(text) != reference, f"{gid}: the same code as the reference"
            if gid == "ex2d_script":  # the given script fixed: none of the reference's four fixes in it
                assert not any(new.strip() in text for _, new in FIX.values()), gid
                continue
            # not the reference's solution with lines added: some of its lines are gone (a one-line one may stay)
            solution = _solution(submissions.answer(nb, gid))
            assert len(solution) == 1 or not set(solution) <= set(_code(text)), f"{gid} holds the reference's solution"


@pytest.mark.slow
@pytest.mark.timeout(GRADE_TIMEOUT)
@pytest.mark.parametrize("assignment,notebook", list(OTHER_STYLES), ids=[nb for _, nb in OTHER_STYLES])
def test_right_answers_in_other_styles_score_full_marks_in_the_notebook(tmp_path, assignment, notebook):
    """Every answer cell replaced by a right answer in another style (one grading per notebook): through the kernel
    and the verifier, every test cell keeps its points, with no message."""
    nb = submissions.load(assignment, notebook)
    for gid, text in OTHER_STYLES[assignment, notebook].items():
        nb = submissions.replace_answer(nb, gid, text)
    report = submissions.grade(submissions.write(nb, tmp_path, assignment, notebook))
    assert submissions.scores(report) == submissions.full_marks(assignment, notebook), submissions.messages(report)
    assert all(message == "" for message in submissions.messages(report).values()), submissions.messages(report)


# --- debug_training: a wrong fix, graded in the notebook -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(GRADE_TIMEOUT)
def test_debug_training_with_the_deadlock_fixed_by_deleting_the_barrier_loses_exactly_the_finish_cell(tmp_path):
    """What a student who loaded the script, fixed three bugs the reference's way and "fixed" the deadlock by
    deleting the barrier hands in: rank 1 returns before rank 0's checkpoint is written. Only ex2d_test_finishes
    loses its points, naming that; the three right fixes keep theirs."""
    A, NB = "ex2-ddp-basics", "debug_training"
    script = LOADED + _edit(BUGGY, FIX["shuffle"], FIX["metric"], FIX["checkpoint"],
                            ("        dist.barrier()  # the other ranks must not go on before the checkpoint is "
                             "written\n", ""))
    assert "barrier" not in script
    nb = submissions.replace_answer(submissions.load(A, NB), "ex2d_script", script)
    report = submissions.grade(submissions.write(nb, tmp_path, A, NB))
    submissions.assert_loses_exactly(report, A, ["ex2d_test_finishes"],
                                     ["returned from main before the checkpoint was complete"], NB)
