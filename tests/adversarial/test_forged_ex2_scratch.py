"""Forgeries of ddp_from_scratch parts 1-2 (DDP without DDP, :mod:`graders.ddp_from_scratch.checks`; issue 37), written as a
student who read the public graders/ source would: the right collectives, carrying the right values, issued at
the right moments (asynchronously, from the gradient hooks), whose results are thrown away, while the
gradients the optimizer uses are made another way:

* :class:`LocalFromFrames`: computed locally, every rank's batch read from the grader's harness through the
  caller's frames (``batches``, the list of every rank's inputs for this step), averaged in this process;
* :class:`StoreAveraged`: sent through the job's key-value store after backward, synchronously;
* :class:`NaiveThroughStore`: part 1's NaiveDDP, the same way;
* :class:`StoreWithItsNumber`: StoreAveraged that also reads, right after launching each all-reduce, the number
  the grader's marker added to its tensor and sends it through the store too (it got through the MLPs when the
  marker moved the caller's own tensor; the marker now sends a moved copy, so a rank never sees its number).

Each must lose check_bucketed (check_naive) and keep the reference's other cells. :class:`BroadcastFromFrames`
(no broadcast: every rank rebuilds rank 0's model from the seed read in the harness's frame) must lose
check_broadcast. And one that patches what
the grader observes with: :class:`ClockPatched` (the buckets all-reduced after backward, synchronously; the
grader's spy told, from the wrapper's ``__init__``, that every collective was issued at time 0) must lose
check_overlap.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn as nn

import graders.ddp_from_scratch.checks as ex2s

cloudpickle.register_pickle_by_value(sys.modules[__name__])

fails = submissions.fails


def _buckets(params, bucket_size_mb):
    """DDP's rule: a bucket closes once its bytes reach or exceed the limit."""
    limit = int(bucket_size_mb * 2**20)
    buckets, current, size = [], [], 0
    for p in reversed([p for p in params if p.requires_grad]):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Decoys(nn.Module):
    """Broadcast at construction; each bucket's real gradients all-reduced asynchronously from its hooks (what
    every check of the collectives sees); finish_gradient_synchronization waits for them and drops the results."""

    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.buckets = _buckets(module.parameters(), bucket_size_mb)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.waiting, self.works = [len(b) for b in self.buckets], {}
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._ready)

    def _flat(self, i):
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.buckets[i]])

    def _ready(self, p):
        i = self.bucket_of[p]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:
            self.works[i] = dist.all_reduce(self._flat(i).clone(), async_op=True)  # right values, result dropped

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.works:
                self.works[i] = dist.all_reduce(self._flat(i).clone(), async_op=True)
        for work in self.works.values():
            work.wait()
        self.waiting, self.works = [len(b) for b in self.buckets], {}
        self._average()


class LocalFromFrames(_Decoys):
    def _average(self):
        import copy

        frame = sys._getframe()
        while frame is not None and "batches" not in frame.f_locals:
            frame = frame.f_back
        batches, kind = frame.f_locals["batches"], frame.f_locals["kind"]
        from graders.ddp_from_scratch.harness import loss_of

        params = list(self.module.parameters())
        total = [torch.zeros_like(p) for p in params]
        for x, y in batches:
            twin = copy.deepcopy(self.module)
            for q in twin.parameters():
                q.grad = None
            loss_of(kind, twin(x), y).backward()
            for t, q in zip(total, twin.parameters()):
                if q.grad is not None:
                    t += q.grad
        for p, t in zip(params, total):
            if p.grad is not None:
                p.grad = t / len(batches)


class StoreAveraged(_Decoys):
    made = 0

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb)
        StoreAveraged.made += 1
        self.name, self.round = f"sa{StoreAveraged.made}", 0

    def _average(self):
        from torch.distributed import distributed_c10d as c10d

        store, rank, n = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        self.round += 1
        for i, bucket in enumerate(self.buckets):
            key = f"{self.name}-{self.round}-{i}"
            store.set(f"{key}-{rank}", self._flat(i).numpy().tobytes())
            total = sum(torch.frombuffer(bytearray(store.get(f"{key}-{r}")), dtype=torch.float32) for r in range(n))
            offset = 0
            for p in bucket:
                if p.grad is not None:
                    p.grad = (total[offset:offset + p.numel()] / n).view_as(p).clone()
                offset += p.numel()


# --- the tests ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("forgery", [LocalFromFrames, StoreAveraged])
def test_right_values_in_decoys_with_the_average_made_elsewhere_lose_the_weights_cell(forgery):
    fails(ex2s.check_bucketed, forgery, "not the ranks' average", "not the values your collectives delivered")
    fails(ex2s.check_bucketed, forgery, "not the ranks' average", bucket_size_mb=0.0015, world_size=3, width=24,
          seed=1)
    # what they communicate is right: the other cells keep the reference's points
    ex2s.check_broadcast(forgery, bucket_size_mb=0.001)
    ex2s.check_buckets(forgery)
    ex2s.check_overlap(forgery)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_naive_average_through_the_store_loses_check_naive():
    fails(ex2s.check_naive, NaiveThroughStore, "not the ranks' average", "not the values your collectives delivered")


class NaiveThroughStore(nn.Module):
    """Part 1 forged: one all-reduce per gradient (of a copy, result dropped); the average through the store."""

    made = 0

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        NaiveThroughStore.made += 1
        self.name, self.round = f"nts{NaiveThroughStore.made}", 0

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        from torch.distributed import distributed_c10d as c10d

        store, rank, n = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        self.round += 1
        for i, p in enumerate(self.module.parameters()):
            if p.grad is None:
                continue
            dist.all_reduce(p.grad.clone())
            key = f"{self.name}-{self.round}-{i}"
            store.set(f"{key}-{rank}", p.grad.reshape(-1).numpy().tobytes())
            total = sum(torch.frombuffer(bytearray(store.get(f"{key}-{r}")), dtype=torch.float32) for r in range(n))
            p.grad = (total / n).view_as(p).clone()


class ClockPatched(_Decoys):
    """Overlap forged by patching the grader's spy before the harness makes it: the buckets all-reduced after
    backward, synchronously (blocking), their results used; the spy's clock (``graders.common.comm_spy._CLOCK``, which the
    harness's ``comm_spy.spy()`` read after the wrapper was made) set to say every collective was issued at time 0,
    before backward reached the first layer."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb)
        import graders.common.comm_spy as spy_module

        spy_module._CLOCK = lambda: 0.0

    def _ready(self, p):  # nothing from the hooks
        pass

    def finish_gradient_synchronization(self):
        n = dist.get_world_size()
        for bucket in self.buckets:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
            dist.all_reduce(flat)
            flat /= n
            offset = 0
            for p in bucket:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_spy_s_clock_patched_in_init_loses_the_overlap_cell():
    fails(ex2s.check_overlap, ClockPatched, "no all-reduce carrying this step's gradients had started")
    # a right answer otherwise (the buckets all-reduced after backward): the other cells keep their points
    ex2s.check_bucketed(ClockPatched)
    ex2s.check_buckets(ClockPatched)


class FirstLayerForgedFromFrames(_Decoys):
    """Overlap forged through the harness's frames: when the last layer's bucket is ready its gradients are
    all-reduced asynchronously (the launch the check looks for), then, before waiting for that all-reduce
    (blocking: no overlap), the hook computes the first layer's true gradient on a copy of the model from the
    step's batch, appends it with an early time to the grader's record of its first-layer hook (reached through
    the frames) and tells the held-back rank to go."""

    def _ready(self, p):
        i = self.bucket_of[p]
        self.waiting[i] -= 1
        if self.waiting[i]:
            return
        work = dist.all_reduce(self._flat(i), async_op=True)
        if i == 0:
            import copy

            from graders.ddp_from_scratch.harness import loss_of

            frame = sys._getframe()
            while frame is not None and "at_first" not in frame.f_locals:
                frame = frame.f_back
            if frame is not None:
                local = frame.f_locals
                twin = copy.deepcopy(local["model"])
                with torch.enable_grad():  # a hook runs with grad mode off
                    loss_of("mlp", twin(local["x"]), local["y"]).backward()
                local["at_first"].append((local["clock"](), twin.l1.weight.grad.detach().to("cpu").clone()))
                if local["signal"][0] is not None:
                    local["store"].set(local["signal"][0], "1")
        work.wait()  # blocking: backward waits here for the slowest rank
        self.works[i] = work

    def finish_gradient_synchronization(self):
        n = dist.get_world_size()
        for i, bucket in enumerate(self.buckets):
            flat = self._flat(i)
            if i not in self.works:
                dist.all_reduce(flat)
            flat /= n
            offset = 0
            for p in bucket:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        self.waiting, self.works, self._sent = [len(b) for b in self.buckets], {}, {}

    def _flat(self, i):
        if i in getattr(self, "_sent", {}):
            return self._sent[i]
        flat = super()._flat(i)
        self._sent = {**getattr(self, "_sent", {}), i: flat}
        return flat


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_first_layer_time_forged_through_the_frames_loses_the_overlap_cell():
    """The grader's record of its first-layer hook is reachable through the frames, and an early entry with the true
    gradient can be added; but backward's own call of that hook comes later (after the blocking wait), and the
    check judges the step by backward's last call with the true gradient."""
    fails(ex2s.check_overlap, FirstLayerForgedFromFrames, "backward waited for the communication")


# --- in the notebook ------------------------------------------------------------------------------------

A, NB = "ex2-ddp-basics", "ddp_from_scratch"

#: the reference's BucketedDDP, forged: it all-reduces a copy of each bucket (right values, from the hooks,
#: asynchronously) and averages the buckets through the job's store after backward
STORE_FORGERY = [
    ("ex2s_bucketed", "            self.launched[i] = (dist.all_reduce(flat, async_op=True), flat)",
     "            self.launched[i] = (dist.all_reduce(flat.clone(), async_op=True), flat)"),
    ("ex2s_bucketed", "            work.wait()\n            flat /= world_size\n",
     "            work.wait()\n"
     "            from torch.distributed import distributed_c10d as c10d\n"
     "            if not hasattr(self, 'tag'):\n"
     "                BucketedDDP.made = getattr(BucketedDDP, 'made', 0) + 1\n"
     "                self.tag, self.round = BucketedDDP.made, 0\n"
     "            self.round += 1 if i == min(self.launched) else 0\n"
     "            key = f'forged-{self.tag}-{self.round}-{i}'\n"
     "            c10d._get_default_store().set(f'{key}-{dist.get_rank()}', flat.numpy().tobytes())\n"
     "            flat = sum(torch.frombuffer(bytearray(c10d._get_default_store().get(f'{key}-{r}')),\n"
     "                                        dtype=torch.float32) for r in range(world_size))\n"
     "            flat /= world_size\n"),
]

#: the reference's plan_step, forged: the course's cost model executed from its file
EXEC_FORGERY = [
    ("ex2s_step_cost", '    """The collectives of one settled training step: a list of (op, numel of the whole tensor)."""\n',
     '    """The collectives of one settled training step: a list of (op, numel of the whole tensor)."""\n'
     "    import course.costmodel as cm\n"
     "    space = {'__name__': 'cm_copy'}\n"
     "    exec(compile(open(cm.__file__).read(), 'cm_copy.py', 'exec'), space)\n"
     "    return space['step_collectives'](layers, world_size, strategy, bucket_cap_mb)\n"),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_in_the_notebook_each_forgery_loses_exactly_its_cell(tmp_path):
    """One submission: BucketedDDP averaging through the store (loses ex2s_test_bucketed) and plan_step executing
    the course's model from its file (loses ex2s_test_step_plan); every other cell keeps the reference's points."""
    report = submissions.grade_edited(A, tmp_path, *STORE_FORGERY, *EXEC_FORGERY, notebook=NB)
    submissions.assert_mistakes_lose_exactly(report, A, [
        (["ex2s_test_bucketed"], ["not the values your collectives delivered"]),
        (["ex2s_test_step_plan"], ["refused by the grader's sandbox"]),
    ], notebook=NB)


class StoreWithItsNumber(StoreAveraged):
    """StoreAveraged, one step deeper: each bucket's all-reduce is of the bucket's own flat tensor, and right after
    launching it the rank reads what the grader's marker added to it (the tensor minus a copy taken before) and sends
    that through the store too, to add every rank's number to the store's average."""

    def _ready(self, p):
        i = self.bucket_of[p]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:
            self._launch(i)

    def _launch(self, i):
        flat = self._flat(i)
        before = flat.clone()
        self.works[i] = dist.all_reduce(flat, async_op=True)
        self.numbers = getattr(self, "numbers", {})
        self.numbers[i] = float((flat - before).mean())  # the marker's number, if it shows

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.works:
                self._launch(i)
        for work in self.works.values():
            work.wait()
        self.waiting, self.works = [len(b) for b in self.buckets], {}
        from torch.distributed import distributed_c10d as c10d

        store, rank, n = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        self.round += 1
        for i, bucket in enumerate(self.buckets):
            key = f"{self.name}-{self.round}-{i}"
            mine = torch.cat([self._flat(i), torch.tensor([self.numbers[i]])])
            store.set(f"{key}-{rank}", mine.numpy().tobytes())
            total = sum(torch.frombuffer(bytearray(store.get(f"{key}-{r}")), dtype=torch.float32) for r in range(n))
            values = total[:-1] + total[-1]
            offset = 0
            for p in bucket:
                if p.grad is not None:
                    p.grad = (values[offset:offset + p.numel()] / n).view_as(p).clone()
                offset += p.numel()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_cannot_read_its_own_number_to_send_it_along():
    fails(ex2s.check_bucketed, StoreWithItsNumber, "not the ranks' average")


class BroadcastFromFrames(_Decoys):
    """check_broadcast forged: no broadcast; each rank rebuilds rank 0's model itself from the seed it reads in the
    harness's frame (rank 0's model is seeded ``seed + 1``: public source), with decoy broadcasts of its own values."""

    def __init__(self, module, bucket_size_mb):
        nn.Module.__init__(self)
        self.module = module
        frame = sys._getframe()
        while frame is not None and "same_seed" not in frame.f_locals:
            frame = frame.f_back
        f = frame.f_locals
        from graders.ddp_from_scratch.harness import make_model

        twin = make_model(f["kind"], f["seed"] + 1, f["width"])
        with torch.no_grad():
            for p, q in zip(module.parameters(), twin.parameters()):
                dist.broadcast(p.data.clone(), src=0)  # decoy
                p.copy_(q)
        self.buckets = _buckets(module.parameters(), bucket_size_mb)
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.waiting, self.works = [len(b) for b in self.buckets], {}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_0_s_weights_rebuilt_from_the_seed_lose_the_broadcast_cell():
    fails(ex2s.check_broadcast, BroadcastFromFrames, "does not hold rank 0's weights", bucket_size_mb=0.001)
