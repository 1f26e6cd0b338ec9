"""Exercise 2's third notebook (ddp_from_scratch): each check catches its class of mistake, on every rank, and only that one.

The checks are called directly with wrapper classes defined here: the notebook's reference, right answers
in other styles (a plain class, tensor hooks, torch's flatten helpers, futures, torch's own DDP inside),
realistic mistakes (each must fail the checks it breaks, with a message that names it, and pass the
others) and forgeries. The notebook itself is graded in tests/test_exercise_notebooks-style tests below.
"""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel as DDP

import graders.ddp_from_scratch.checks as ex2s
from course.checks import TIMEOUT_ENV

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A = "ex2-ddp-basics"
NB = "ddp_from_scratch"
HANG_TIMEOUT = 6
HIDDEN = {"bucket_size_mb": 0.0015, "world_size": 3, "width": 24, "seed": 1}

fails = submissions.fails


# --- the reference (the notebook's solution) ---------------------------------------------------------


class NaiveDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size


def _buckets(params, bucket_size_mb, *, before_the_limit=False):
    """DDP's rule: a bucket closes once it reaches or exceeds the limit. ``before_the_limit``: the known mistake
    (the rule the notebook stated before issue 40), a bucket closes before the parameter that would cross it."""
    limit = int(bucket_size_mb * 2**20)
    buckets, current, size = [], [], 0
    for p in reversed([p for p in params if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if before_the_limit and current and size + nbytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
        if not before_the_limit and size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP(nn.Module):
    """The reference; its keyword switches make the realistic mistakes below (one thing changed each)."""

    def __init__(self, module, bucket_size_mb, *, broadcast=True, average=True, per_param=False, launch_unfilled=True,
                 in_hooks=True, wait_in_finish=True, rank_order=False, before_the_limit=False):
        super().__init__()
        self.module = module
        self.average, self.launch_unfilled, self.in_hooks, self.wait_in_finish = (
            average, launch_unfilled, in_hooks, wait_in_finish)
        if broadcast:
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
        params = list(module.parameters())
        if rank_order and dist.get_rank() % 2 == 1:
            params.reverse()  # another order on odd ranks: other buckets, whose all-reduces no longer match
        self.buckets = [[p] for p in reversed(params)] if per_param else _buckets(
            params, bucket_size_mb, before_the_limit=before_the_limit)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._reset()
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.waiting = [len(b) for b in self.buckets]
        self.pending = {}

    def _grad_ready(self, p):
        i = self.bucket_of[p]
        self.waiting[i] -= 1
        if self.waiting[i] == 0 and self.in_hooks:
            self._launch(i)

    def _launch(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.pending[i] = (dist.all_reduce(flat, async_op=True), flat)

    def forward(self, *args, **kwargs):
        if not self.wait_in_finish:
            self._wait()  # the previous step's handles: after its optimizer.step()
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.pending and self.launch_unfilled:
                self._launch(i)
        if self.wait_in_finish:
            self._wait()

    def _wait(self):
        world_size = dist.get_world_size()
        for i, (work, flat) in sorted(self.pending.items()):
            work.wait()
            if self.average:
                flat /= world_size
            offset = 0
            for p in self.buckets[i]:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        self._reset()


# --- right answers in other styles -------------------------------------------------------------------


class NaiveFlat:
    """Right: a plain class (no nn.Module), torch's flatten helpers, ONE all-reduce of every gradient (the
    naive part asks for no particular number), broadcast of one flat vector."""

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


class NaiveAsyncPerParam(nn.Module):
    """Right: parameters_to_vector for the broadcast, async all-reduces of pre-divided gradients, waited together."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        vec = nn.utils.parameters_to_vector(module.parameters()).detach()
        dist.broadcast(vec, src=0)
        with torch.no_grad():
            nn.utils.vector_to_parameters(vec, module.parameters())

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        works = []
        for p in self.module.parameters():
            if p.grad is None:
                continue
            p.grad.div_(dist.get_world_size())
            works.append(dist.all_reduce(p.grad, async_op=True))
        for w in works:
            w.wait()


class TorchDDPInside:
    """torch's own DDP behind the interface: shows that the checks' reference is what DDP computes."""

    def __init__(self, module, bucket_size_mb=None):
        self.ddp = DDP(module, find_unused_parameters=True)

    def __call__(self, x):
        return self.ddp(x)

    def finish_gradient_synchronization(self):
        pass


class BucketedFutures:
    """Right, another style (Horovod's and apex's): a plain class, hooks on each parameter's AccumulateGrad node
    (they run once the gradient is in `.grad`), buckets by named_parameters, pre-divided buckets whose futures
    copy back (`.then`), one torch.futures.wait_all. (A tensor hook, `p.register_hook`, would be wrong here:
    it runs before the gradient is accumulated, so an all-reduce that finished first would be added to:
    a race, that the checks catch when the race is lost; the notebook asks for post-accumulate hooks.)"""

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


class _Bucket:
    """One bucket of BucketedTensorHooks: its parameters and a flat buffer their gradients are copied into."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params))
        self.work, self.ready = None, 0


class BucketedTensorHooks:
    """Right, another style (DDP's own reducer, a helper class): tensor hooks (`p.register_hook`) that copy the
    gradient they are given into the bucket's preallocated flat buffer; the bucket's async all-reduce starts
    when its last gradient arrives; finish launches what never filled, waits, and writes `.grad` itself."""

    def __init__(self, module, bucket_size_mb):
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.buckets = [_Bucket(b) for b in _buckets(module.parameters(), bucket_size_mb)]
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                p.register_hook(self._hook(bucket, offset, p.numel()))
                offset += p.numel()

    def _hook(self, bucket, offset, n):
        def hook(grad):
            bucket.buffer[offset:offset + n].copy_(grad.reshape(-1))
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
            return grad
        return hook

    def __call__(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        for bucket in self.buckets:
            bucket.work.wait()
            offset = 0
            for p in bucket.params:
                p.grad = (bucket.buffer[offset:offset + p.numel()] / dist.get_world_size()).view_as(p).clone()
                offset += p.numel()
            bucket.buffer.zero_()
            bucket.work, bucket.ready = None, 0


# --- mistakes ----------------------------------------------------------------------------------------


class NaiveNoBroadcast(NaiveDDP):
    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module


class NaiveAveragedStart(NaiveDDP):
    """Averages the ranks' initial weights instead of taking rank 0's."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        for p in module.parameters():
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()


class NaiveSum(NaiveDDP):
    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)


class NaiveNoneCrash(NaiveDDP):
    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


class NaiveZerosForUnused(NaiveDDP):
    """Wrong for the naive part: an unused parameter given a zero gradient (and an all-reduce of it) instead of none."""

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _variant(**switches):
    class Variant(BucketedDDP):
        def __init__(self, module, bucket_size_mb):
            super().__init__(module, bucket_size_mb, **switches)

    return Variant


PerParam = _variant(per_param=True)
Summed = _variant(average=False)
NoBroadcast = _variant(broadcast=False)
Unfilled = _variant(launch_unfilled=False)
AfterBackward = _variant(in_hooks=False)  # right buckets, all launched in finish: no overlap
AfterStep = _variant(wait_in_finish=False)  # waits on the handles in the next forward, after step()
RankOrder = _variant(rank_order=True)
ClosedBeforeTheLimit = _variant(before_the_limit=True)  # the rule the notebook stated before issue 40


class OneBucket(BucketedDDP):
    """Every gradient in one flat all-reduce after backward."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, 1e9, in_hooks=False)


class WaitsForever(BucketedDDP):
    """Waits until every bucket was launched from a hook: the one with an unused parameter never is."""

    def finish_gradient_synchronization(self):
        self.ready = getattr(self, "ready", threading.Event())
        while len(self.pending) < len(self.buckets):
            self.ready.wait(0.05)
        self._wait()


class FakeOverlap(BucketedDDP):
    """Forgery: an extra all-reduce of zeros launched from the last layer's hook, the real buckets after backward."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb, in_hooks=False)
        last = list(module.parameters())[-1]
        self.fake = []
        last.register_post_accumulate_grad_hook(
            lambda p: self.fake.append(dist.all_reduce(torch.zeros(p.numel()), async_op=True)))


class FakeOverlapEmpty(BucketedDDP):
    """Forgery: an all-reduce of an EMPTY tensor from the last layer's hook (adds no values to the total)."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb, in_hooks=False)
        last = list(module.parameters())[-1]
        self.fake = []
        last.register_post_accumulate_grad_hook(lambda p: self.fake.append(dist.all_reduce(torch.zeros(0), async_op=True)))


class ForgedRecorder(BucketedDDP):
    """Forgery: communicates nothing, but replaces torch's flight-recorder dump (and pickle.loads) with ones that
    show the wanted all-reduces, launched early, and makes torch.distributed say this is a 1-rank job."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb, in_hooks=False)
        import pickle

        import torch._C._distributed_c10d as c10d_C
        from torch.distributed import distributed_c10d as c10d

        sizes = [sum(p.numel() for p in b) for b in self.buckets]
        entries = [{"profiling_name": "gloo:all_reduce", "collective_seq_id": 10**6 + i, "input_sizes": [[n]],
                    "process_group": ("0", "default_pg")} for i, n in enumerate(sizes)]
        fake = pickle.dumps({"entries": entries})
        c10d_C._dump_fr_trace = lambda *a, **k: fake
        pickle.loads = lambda *a, **k: {"entries": entries}
        c10d.get_world_size = dist.get_world_size = lambda group=None: 1

    def finish_gradient_synchronization(self):
        pass


class BlockingInHook(BucketedDDP):
    """Mistake (issue 24): the right buckets, launched from the hooks, but each with a BLOCKING all-reduce:
    nothing overlaps, backward stops in every hook until the bucket has crossed."""

    def _launch(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        self.pending[i] = (_Done(), flat)


class TriggersTheFirstHook(BucketedDDP):
    """Forgery: each bucket's all-reduce is waited for in its hook (nothing overlaps), but between the launch and
    the wait the first layer's tensor hooks (the grader's among them) are called by hand, so that "backward
    reached the first layer while a bucket was in flight" would be recorded."""

    def _launch(self, i):
        super()._launch(i)
        first = next(iter(self.module.parameters()))
        for hook in list((first._backward_hooks or {}).values()):
            hook(torch.zeros_like(first))
        self.pending[i][0].wait()


class _Done:
    def wait(self):
        return True


class DecoyInForward(BucketedDDP):
    """Forgery: an async all-reduce launched in forward (before any gradient exists), the real buckets after backward."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb, in_hooks=False)
        self.decoys = []

    def forward(self, *args, **kwargs):
        self.decoys.append(dist.all_reduce(torch.zeros(len(self.buckets[0])), async_op=True))
        return super().forward(*args, **kwargs)


class Padded(BucketedDDP):
    """Mistake: each bucket all-reduced with one value more than its gradients (a padding slot), from the hooks."""

    def _launch(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.zeros(1)])
        self.pending[i] = (dist.all_reduce(flat, async_op=True), flat)

    def _wait(self):
        for i, (work, flat) in self.pending.items():
            self.pending[i] = (work, flat[:-1])
        super()._wait()


class ZeroDecoys(BucketedDDP):
    """Forgery: the right async buckets, plus an all-reduce of zeros the size of each bucket."""

    def _launch(self, i):
        super()._launch(i)
        self.decoys = getattr(self, "decoys", [])
        self.decoys.append(dist.all_reduce(torch.zeros(self.pending[i][1].numel()), async_op=True))


class StoreDecoys(BucketedDDP):
    """Forgery: all-reduces of zeros of exactly the buckets' sizes, launched from the hooks (what a counter of
    all-reduces by size expects); the gradients really travel through the job's key-value store."""

    made = 0  # wrappers made in this process: the same sequence on every rank, so a key prefix they agree on

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb)
        StoreDecoys.made += 1
        self.name, self.round = f"w{StoreDecoys.made}", 0

    def _launch(self, i):
        flat = torch.zeros(sum(p.numel() for p in self.buckets[i]))
        self.pending[i] = (dist.all_reduce(flat, async_op=True), flat)

    def _wait(self):
        from torch.distributed import distributed_c10d as c10d

        store, rank, world_size = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        self.round += 1
        for i, (work, _) in sorted(self.pending.items()):
            work.wait()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
            key = f"{self.name}-{self.round}-{i}"
            store.set(f"{key}-{rank}", torch.cat([g.reshape(-1) for g in grads]).numpy().tobytes())
            total = sum(torch.frombuffer(bytearray(store.get(f"{key}-{r}")), dtype=torch.float32)
                        for r in range(world_size))
            self.pending[i] = (work, total)
        super()._wait()


class AllGatherBuckets(BucketedDDP):
    """Another collective: each bucket all-gathered asynchronously from its hook, summed locally after the wait."""

    def _launch(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        self.pending[i] = (dist.all_gather(parts, flat, async_op=True), flat, parts)

    def _wait(self):
        for i, (work, _flat, parts) in list(self.pending.items()):
            work.wait()
            self.pending[i] = (_Done(), torch.stack(parts).sum(0))
        super()._wait()


class AllGatherWithDecoys(AllGatherBuckets):
    """Forgery: the buckets travel in all_gathers, and an all-reduce of zeros the size of each bucket is what a
    count of all-reduces by size sees."""

    def _launch(self, i):
        super()._launch(i)
        self.decoys = getattr(self, "decoys", [])
        self.decoys.append(dist.all_reduce(torch.zeros(self.pending[i][1].numel()), async_op=True))


class SendRecvWithDecoys(StoreDecoys):
    """Forgery: all-reduces of zeros of the buckets' sizes from the hooks; the gradients travel point to point
    (isend/irecv, which gloo's flight recorder does not list)."""

    def _wait(self):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        for i, (work, _) in sorted(self.pending.items()):
            work.wait()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
            mine = torch.cat([g.reshape(-1) for g in grads])
            parts = {r: torch.empty_like(mine) for r in range(world_size) if r != rank}
            requests = [dist.isend(mine, r) for r in parts] + [dist.irecv(t, r) for r, t in parts.items()]
            for request in requests:
                request.wait()
            self.pending[i] = (work, mine + sum(parts.values()))
        BucketedDDP._wait(self)


# --- the tests ----------------------------------------------------------------------------------------


def test_bucket_rule_and_test_models():
    mlp = ex2s.make_model("mlp", 0)
    # 3 + 48 + 16 + 256 values: l2.weight takes the bucket past 262 values (1048 bytes) and stays in it
    assert ex2s.buckets_of(mlp, 0.001) == [["l3.bias", "l3.weight", "l2.bias", "l2.weight"], ["l1.bias", "l1.weight"]]
    assert ex2s.buckets_of(mlp, 1.0) == [[n for n, _ in reversed(list(mlp.named_parameters()))]]
    assert len(ex2s.buckets_of(mlp, 1e-9)) == 6  # every parameter reaches the limit alone: a bucket each
    exact = (3 + 48 + 16) * 4 / 2**20  # a limit the first three parameters reach exactly: they close the bucket
    assert ex2s.buckets_of(mlp, exact)[0] == ["l3.bias", "l3.weight", "l2.bias"]
    tied = ex2s.make_model("tied", 0)
    assert tied.head.weight is tied.embed.weight and len(list(tied.parameters())) == 3
    for kwargs in ({"bucket_size_mb": 0.001, "width": 16}, {"bucket_size_mb": HIDDEN["bucket_size_mb"], "width": 24}):
        buckets = ex2s.buckets_of(ex2s.make_model("unused", 0, kwargs["width"]), kwargs["bucket_size_mb"])
        assert any(any(n.startswith("spare.") for n in b) and not all(n.startswith("spare.") for n in b) for b in buckets)
        mlp_buckets = ex2s.buckets_of(ex2s.make_model("mlp", 0, kwargs["width"]), kwargs["bucket_size_mb"])
        assert len(mlp_buckets) >= 2 and "l1.weight" not in mlp_buckets[0]  # check_overlap has a bucket to overlap
        # the old rule gives other sizes: check_buckets tells it apart
        old = _buckets(ex2s.make_model("mlp", 0, kwargs["width"]).parameters(), kwargs["bucket_size_mb"],
                       before_the_limit=True)
        assert sorted(sum(p.numel() for p in b) for b in old) != sorted(
            sum(ex2s.make_model("mlp", 0, kwargs["width"]).get_parameter(n).numel() for n in b) for b in mlp_buckets)


CAPS = (1e-9, 0.0002, 0.001, (3 + 48 + 16) * 4 / 2**20, 0.0015, 0.002, 0.01, 1.0)


def test_bucket_rule_is_torchs_own_assignment():
    """buckets_of is what torch's bucket assignment (the function DDP calls to form buckets) gives for the
    parameters in reverse order, at every cap, on every model of the notebook (a cap reached exactly included)."""
    for kind in ("mlp", "unused", "tied"):
        for width in (16, 24):
            model = ex2s.make_model(kind, 0, width)
            reverse = list(reversed(list(model.named_parameters())))
            for cap in CAPS:
                indices, _ = dist._compute_bucket_assignment_by_size([p for _, p in reverse], [int(cap * 2**20)])
                assert ex2s.buckets_of(model, cap) == [[reverse[i][0] for i in b] for b in indices], (kind, width, cap)


def ddp_rebuilt_buckets(rank, width, bucket_size_mb):
    """The MLP under torch's DDP at ``bucket_cap_mb=bucket_size_mb``: the parameter names of each bucket DDP hands
    its communication hook, per step (step 1: one bucket; from step 2: the buckets DDP rebuilt in arrival order)."""
    dist.init_process_group("gloo")
    model = ex2s.make_model("mlp", 0, width)
    names = {id(p): n for n, p in model.named_parameters()}
    ddp_model = DDP(model, bucket_cap_mb=bucket_size_mb)
    steps: list[list[list[str]]] = []

    def hook(state, bucket):
        steps[-1].append([names[id(p)] for p in bucket.parameters()])
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp_model.register_comm_hook(None, hook)
    for batches in ex2s.make_batches("mlp", 0, 2, 3):
        steps.append([])
        x, y = batches[rank]
        nn.functional.mse_loss(ddp_model(x), y).backward()
    dist.destroy_process_group()
    return steps


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("width, bucket_size_mb", [(16, 0.001), (HIDDEN["width"], HIDDEN["bucket_size_mb"])])
def test_bucket_rule_is_the_buckets_torch_ddp_rebuilds(width, bucket_size_mb):
    """The buckets check_buckets asks for are the ones a real DDP model forms at the same cap on 2 gloo ranks,
    once it has rebuilt them after its first step (which sends every gradient in one bucket)."""
    import course

    want = ex2s.buckets_of(ex2s.make_model("mlp", 0, width), bucket_size_mb)
    for steps in course.run_ranks(ddp_rebuilt_buckets, 2, args=(width, bucket_size_mb), backend="gloo", echo=False,
                                  timeout=60):
        assert len(steps[0]) == 1, steps[0]
        assert steps[1] == steps[2] == want, (steps, want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_and_other_styles_pass_every_check():
    for cls in (NaiveDDP, NaiveFlat, NaiveAsyncPerParam):
        ex2s.check_broadcast(cls)
        ex2s.check_naive(cls)
    ex2s.check_naive(NaiveDDP, world_size=3, width=24, seed=1)
    for cls in (BucketedDDP, BucketedFutures, BucketedTensorHooks):
        for kwargs in ({}, HIDDEN):
            ex2s.check_broadcast(cls, **{k: v for k, v in {"bucket_size_mb": 0.001, **kwargs}.items()})
            ex2s.check_bucketed(cls, **kwargs)
            ex2s.check_buckets(cls, **kwargs)
            ex2s.check_overlap(cls, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_ddp_itself_meets_the_reference():
    """The checks' one-process reference is torch's DDP: DDP behind the interface passes the training checks
    (its buckets follow its own rule, so check_buckets is not asked of it)."""
    ex2s.check_naive(TorchDDPInside)
    ex2s.check_bucketed(TorchDDPInside, **HIDDEN)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_naive_mistakes():
    fails(ex2s.check_broadcast, NaiveNoBroadcast, "[rank 1]", "does not hold rank 0's weights",
          "still hold this rank's own initial values", "broadcast every parameter of the module from rank 0")
    fails(ex2s.check_broadcast, NaiveAveragedStart, "[rank 0]", "hold other values", "do not average")
    ex2s.check_naive(NaiveNoBroadcast)  # same-seeded ranks: the broadcast is judged only by check_broadcast
    ex2s.check_broadcast(NaiveSum)
    fails(ex2s.check_naive, NaiveSum, "[rank 0]", "not the ranks' average", "SUM over the 2 ranks",
          "divide by the world size")
    fails(ex2s.check_naive, NaiveNoneCrash, "NoneType", "`spare`", "Skip it")
    fails(ex2s.check_naive, NaiveZerosForUnused, "a parameter forward never used has a gradient", "`spare.weight`",
          "is a tensor", "still None", "no collective for it")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bucketed_mistakes_lose_exactly_their_checks():
    # one all-reduce per parameter: right weights and overlap, wrong communication
    ex2s.check_bucketed(PerParam)
    ex2s.check_overlap(PerParam)
    fails(ex2s.check_buckets, PerParam, "6 all-reduces", "one all-reduce per parameter", "2 all-reduces carrying")
    # everything in one all-reduce after backward
    ex2s.check_bucketed(OneBucket)
    fails(ex2s.check_buckets, OneBucket, "1 all-reduces carrying 435", "every gradient in one all-reduce")
    fails(ex2s.check_overlap, OneBucket, "no all-reduce carrying this step's gradients had started",
          "register_post_accumulate_grad_hook")
    # right buckets, launched synchronously after backward
    ex2s.check_bucketed(AfterBackward)
    ex2s.check_buckets(AfterBackward)
    fails(ex2s.check_overlap, AfterBackward, "no all-reduce carrying this step's gradients had started",
          "0 collectives launched before `l1.weight`'s gradient")
    # sums
    ex2s.check_buckets(Summed)
    ex2s.check_overlap(Summed)
    fails(ex2s.check_bucketed, Summed, "SUM over the 2 ranks")
    # the rule DDP does not follow (the notebook's before issue 40): right averages and overlap, other buckets
    ex2s.check_bucketed(ClosedBeforeTheLimit)
    ex2s.check_overlap(ClosedBeforeTheLimit)
    fails(ex2s.check_buckets, ClosedBeforeTheLimit, "3 all-reduces carrying 67, 256, 112 values",
          "2 all-reduces carrying 112, 323 values", "closed BEFORE the parameter", "reach or exceed",
          "stays in the bucket it crossed it in")
    fails(ex2s.check_buckets, ClosedBeforeTheLimit, "3 all-reduces carrying 99, 576, 168 values",
          "closed BEFORE the parameter", **HIDDEN)
    # no broadcast
    fails(ex2s.check_broadcast, NoBroadcast, "[rank 1]", "own initial values", bucket_size_mb=0.001)
    ex2s.check_bucketed(NoBroadcast)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stale_gradients_and_unfilled_buckets():
    fails(ex2s.check_bucketed, AfterStep, "not the ranks' average", "this rank's own gradients", "work.wait()")
    ex2s.check_buckets(AfterStep)  # its late averages land in .grad before the next backward, which adds to them
    ex2s.check_overlap(AfterStep)
    msg = fails(ex2s.check_bucketed, Unfilled, "share a bucket with `spare`", "never filled", "zeros")
    assert "l2.weight" in msg or "l1." in msg, msg
    ex2s.check_buckets(Unfilled)  # the plain MLP fills every bucket
    ex2s.check_overlap(Unfilled)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bucket_that_never_fills_fails_within_the_timeout(monkeypatch):
    import time

    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    started = time.monotonic()
    fails(ex2s.check_bucketed, WaitsForever, "did not finish within 6 s", "unused in forward",
          "launch the all-reduce of every bucket not launched yet")
    assert time.monotonic() - started < HANG_TIMEOUT + 20
    ex2s.check_buckets(WaitsForever)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_buckets_in_another_order_on_some_ranks_are_reported_not_hung(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "20")
    msg = fails(ex2s.check_bucketed, RankOrder, "tensors of different sizes", "formed different buckets",
                "the same on every rank")
    assert "did not finish within" not in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_forgeries_do_not_pass():
    fails(ex2s.check_overlap, FakeOverlap, "no all-reduce carrying this step's gradients had started",
          "carried none of this step's gradients", "zeros")
    fails(ex2s.check_buckets, FakeOverlap, "3 all-reduces carrying 3, 323, 112 values", "nothing else")
    fails(ex2s.check_overlap, FakeOverlapEmpty, "no all-reduce carrying this step's gradients had started")
    fails(ex2s.check_buckets, ForgedRecorder, "did not all-reduce one flat tensor per bucket", "0 all-reduces",
          "no all-reduce ran in this step")
    fails(ex2s.check_bucketed, ForgedRecorder, "this rank's own gradients")
    fails(ex2s.check_overlap, ForgedRecorder, "no all-reduce carrying this step's gradients had started",
          "0 collectives launched")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overlap_is_judged_by_concurrency_not_issue_order():
    """Issue 24, class 2: a bucket launched in time but with a blocking all-reduce, and a decoy launched in
    forward, both issue an all-reduce before the first layer's gradient; neither lets backward go on while a
    bucket of this step's gradients is in flight."""
    ex2s.check_bucketed(BlockingInHook)
    ex2s.check_buckets(BlockingInHook)
    fails(ex2s.check_overlap, BlockingInHook, "backward waited for the communication", "held back before its backward",
          "after rank", "async_op=True", "blocking `dist.all_reduce(flat)`")
    fails(ex2s.check_overlap, BlockingInHook, "backward waited for the communication", **HIDDEN)
    fails(ex2s.check_overlap, TriggersTheFirstHook, "backward waited for the communication")
    ex2s.check_bucketed(DecoyInForward)
    fails(ex2s.check_overlap, DecoyInForward, "no all-reduce carrying this step's gradients had started",
          "carried none of this step's gradients", "in forward")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collectives_are_judged_by_what_they_carry():
    """Issue 24, class 1: padding, decoys of zeros and another collective each lose check_buckets, and only it
    when the real buckets still overlap; decoys in place of the buckets (the gradients sent another way) lose
    check_buckets on what the all-reduces carried, and check_bucketed when the way is not a collective (the
    store: the average carries none of the numbers the grader's marker put on what the collectives sent)."""
    for cls in (Padded, ZeroDecoys, AllGatherBuckets):
        ex2s.check_bucketed(cls)
        ex2s.check_overlap(cls)
    fails(ex2s.check_buckets, Padded, "did not all-reduce one flat tensor per bucket", "324, 113 values",
          "no padding")
    fails(ex2s.check_buckets, ZeroDecoys, "4 all-reduces carrying 323, 323, 112, 112 values", "nothing else")
    fails(ex2s.check_buckets, AllGatherBuckets, "other collectives than all_reduce", "all_gather",
          "dist.all_reduce(flat, async_op=True)")
    fails(ex2s.check_buckets, AllGatherWithDecoys, "other collectives than all_reduce", "2 x all_gather, and 2 all-reduces")
    ex2s.check_bucketed(SendRecvWithDecoys)
    fails(ex2s.check_buckets, SendRecvWithDecoys, "other collectives than all_reduce", "x send", "x recv")
    fails(ex2s.check_buckets, SendRecvWithDecoys, "other collectives than all_reduce", **HIDDEN)
    fails(ex2s.check_overlap, SendRecvWithDecoys, "no all-reduce carrying this step's gradients had started")
    # the gradients went through the store: the average carries none of what the all-reduces delivered (issue 37)
    fails(ex2s.check_bucketed, StoreDecoys, "not the ranks' average", "not the values your collectives delivered")
    fails(ex2s.check_buckets, StoreDecoys, "did not carry its bucket's gradients", "only zeros", "synchronises nothing")
    fails(ex2s.check_buckets, StoreDecoys, "did not carry its bucket's gradients", **HIDDEN)
    fails(ex2s.check_overlap, StoreDecoys, "no all-reduce carrying this step's gradients had started")


# --- the notebook ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks():
    submissions.assert_reference_full_marks(A, NB)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_untouched_student_copy_scores_zero_saying_not_written_yet(tmp_path):
    report = submissions.assert_untouched_scores_zero(A, tmp_path, NB)
    unwritten = {"ex2s_test_step_plan": "plan_step", "ex2s_test_step_cost": "step_cost"}  # part 3's functions
    assert all(unwritten.get(t.id, "__init__") in t.message for t in report.tests), report.tests  # names what is unwritten


WRONG = {
    # name: (answer cell, old text, new text, the test cells that must fail, words the first one's message contains)
    "no broadcast": ("ex2s_naive", "            dist.broadcast(p.data, src=0)  # in place: every rank now holds rank 0's values",
                     "            pass", ["ex2s_test_broadcast_naive"], ["own initial values"]),
    "gradients summed, not averaged": ("ex2s_naive", "                p.grad /= world_size\n", "",
                                       ["ex2s_test_naive"], ["SUM over the 2 ranks"]),
    "one all-reduce per parameter": (
        "ex2s_bucketed", "            if size >= limit:  # the parameter that reaches the limit stays in the bucket, which "
        "closes", "            if True:", ["ex2s_test_buckets"], ["one all-reduce per parameter"]),
    "buckets closed before the parameter that crosses the limit": (
        "ex2s_bucketed", "            current.append(p)\n            size += p.numel() * p.element_size()\n"
        "            if size >= limit:  # the parameter that reaches the limit stays in the bucket, which closes\n"
        "                self.buckets.append(current)\n                current, size = [], 0\n",
        "            nbytes = p.numel() * p.element_size()\n            if current and size + nbytes > limit:\n"
        "                self.buckets.append(current)\n                current, size = [], 0\n"
        "            current.append(p)\n            size += nbytes\n",
        ["ex2s_test_buckets"], ["closed BEFORE the parameter", "reach or exceed"]),
    "all-reduced after backward, not from the hooks": (
        "ex2s_bucketed", "            if self.waiting[i] == 0:  # the bucket's last gradient: send it while backward goes on",
        "            if False:", ["ex2s_test_overlap"], ["no all-reduce carrying this step's gradients had started"]),
    "a blocking all-reduce in the hook": (
        "ex2s_bucketed", "            self.launched[i] = (dist.all_reduce(flat, async_op=True), flat)",
        "            dist.all_reduce(flat)  # blocks until every rank has sent its part\n"
        "            self.launched[i] = (type('Done', (), {'wait': lambda self: None})(), flat)",
        ["ex2s_test_overlap"], ["backward waited for the communication"]),
    "waits on the handles after step()": (
        "ex2s_bucketed", "        for i, (work, flat) in sorted(self.launched.items()):\n            work.wait()\n",
        "        for i, (work, flat) in sorted(self.launched.items()):\n", ["ex2s_test_bucketed"], ["not the ranks' average"]),
    "bucket sums not averaged": ("ex2s_bucketed", "            flat /= world_size\n", "",
                                 ["ex2s_test_bucketed"], ["SUM over the 2 ranks"]),
    "unfilled buckets never launched": ("ex2s_bucketed", "                self.launch(i)\n        world_size",
                                        "                pass\n        world_size",
                                        ["ex2s_test_bucketed"], ["share a bucket with `spare`"]),
    "parameters in another order on odd ranks": (
        "ex2s_bucketed", "        for p in reversed([p for p in module.parameters() if p.requires_grad]):",
        "        params = [p for p in module.parameters() if p.requires_grad]\n        if dist.get_rank() % 2:\n"
        "            params.reverse()\n        for p in reversed(params):",
        # other buckets on odd ranks: their first all-reduces differ in size, in every bucketed test
        ["ex2s_test_bucketed", "ex2s_test_buckets", "ex2s_test_overlap"], ["formed different buckets"]),
}


#: name: ([(answer cell, old, new)], failing test cells, words)
MISTAKES = {name: ([(gid, old, new)], failing, words) for name, (gid, old, new, failing, words) in WRONG.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    """The mistakes of a group (:func:`submissions.pack`: other answer cells, other test cells) in one submission."""
    submissions.grade_packed(A, tmp_path, MISTAKES, group, notebook=NB)
