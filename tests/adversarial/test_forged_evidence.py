"""Forgeries of a student who read the public graders/ source (issue 37): one cheap forgery per kind of
evidence a part's checks used to trust, written as a student would, each scoring 0 on the cells it targets.

* exercise 1, part 4 (tensor parallelism by hand, :mod:`graders.parallelism.tensor_parallel`): a module that computes the whole
  output locally and issues decoy all-reduces of the right partial values whose results it ignores (from
  the MLP it is given, or from one rebuilt with the check's seed found in the caller's frames), one
  that replaces the grader's references (flight recorder, collective spy) from its own code, and two that put
  a marker of numbers every rank knows in comm_spy and then reload the grader's module or execute its source
  under another name (a harness holding that marker, the control, gives them full marks);
* exercise 2, the sampler (:mod:`graders.ddp_basics.sampler`): torch's DistributedSampler with the grader's patch
  undone (the module reloaded and the profile hook removed, or its source executed under another name), and
  an order drawn on rank 0 from its own random state and broadcast (kept per seed and epoch);
* exercise 2, DDP in practice (:mod:`graders.ddp_in_practice.checks`, :mod:`graders.ddp_in_practice.precision`): one big batch in
  place of the micro-batches (accumulation, and the mixed-precision step), an evaluation that recomputes the
  metric locally from the labels the check's public seed (read in the caller's frame) gives, and a clip factor
  worked out before the all-reduce from every rank's data recomputed locally (numerically the clipped step),
  and uneven inputs equalised to min(counts) read in the caller's frame instead of agreed at run time.

Each forgery is called on the checks directly (in this process; the ranks are real) and, for one forgery
per notebook, graded in its notebook, where it must lose exactly the cells it targets.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graders.parallelism.tensor_parallel as tp

# The ranks get this module's functions by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

fails = submissions.fails
VALUES, COMM = tp.check_tensor_parallel, tp.check_tensor_parallel_collectives


# --- exercise 1, part 4: tensor parallelism ------------------------------------------------------------


class _Decoy(torch.autograd.Function):
    """Forward: all-reduce a copy of this rank's partial output (the right values), ignore the result and hand
    on the locally computed whole output. Backward: the identity."""

    @staticmethod
    def forward(ctx, y, partial):
        dist.all_reduce(partial.detach().clone())  # the decoy the flight recorder and the spy see
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _DecoyBack(torch.autograd.Function):
    """Forward: the identity on the input. Backward: all-reduce a copy of this rank's partial input gradient
    (noted by a hook on the pre-activations), ignore the result, pass the whole local gradient on."""

    @staticmethod
    def forward(ctx, x, holder):
        ctx.holder = holder
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(ctx.holder["partial_in"].clone())
        return grad, None


class _LocalWithDecoys(nn.Module):
    """Holds exactly its four shards as parameters, but computes the whole MLP locally from a whole copy kept
    outside its parameters; the gradients reach the shards through the whole weights they are spliced into."""

    def __init__(self, whole, rank, world_size):
        super().__init__()
        first, _, second = whole
        k = first.out_features // world_size
        self.blk = slice(rank * k, (rank + 1) * k)
        self.w1 = nn.Parameter(first.weight.detach()[self.blk].clone())
        self.b1 = nn.Parameter(first.bias.detach()[self.blk].clone())
        self.w2 = nn.Parameter(second.weight.detach()[:, self.blk].clone())
        self.b2 = nn.Parameter(second.bias.detach().clone())
        self.whole = {"w1": first.weight.detach().clone(), "b1": first.bias.detach().clone(),
                      "w2": second.weight.detach().clone()}  # a dict: not a parameter, not a buffer

    def _spliced(self, name, shard, dim):
        whole, blk = self.whole[name], self.blk
        before = whole.narrow(dim, 0, blk.start)
        after = whole.narrow(dim, blk.stop, whole.shape[dim] - blk.stop)
        return torch.cat([before, shard, after], dim=dim)

    decoy, decoy_back = _Decoy, _DecoyBack

    def forward(self, x):
        holder = {}
        x = self.decoy_back.apply(x, holder)
        w1, b1, w2 = self._spliced("w1", self.w1, 0), self._spliced("b1", self.b1, 0), self._spliced("w2", self.w2, 1)
        z = F.linear(x, w1, b1)
        if z.requires_grad:
            z.register_hook(lambda g: holder.__setitem__("partial_in", g[:, self.blk] @ self.w1.detach()))
        h = torch.tanh(z)
        y = F.linear(h, w2, self.b2)
        partial = h[:, self.blk].detach() @ self.w2.detach().T
        return self.decoy.apply(y, partial)


def tp_decoy(mlp, rank, world_size):
    """Decoy collectives carrying the right values; the result computed locally from the MLP it was given."""
    return _LocalWithDecoys(mlp, rank, world_size)


def tp_decoy_from_frames(mlp, rank, world_size):
    """The same, from the whole MLP rebuilt with the check's own seed and sizes, read in the caller's frame."""
    caller = sys._getframe(1).f_locals
    import graders.parallelism.tensor_parallel as grader

    return _LocalWithDecoys(grader.make_mlp(caller["seed"], *caller["dims"][1:]), rank, world_size)


class _Records:
    """What the forged flight recorder and spy say: this rank's 'collectives', appended by the module."""

    entries: list = []
    carried: list = [[]]


def _forged_collectives():
    return list(_Records.entries)


def _forged_spy():
    import contextlib

    _Records.carried[0] = []
    return contextlib.nullcontext(), _Records.carried[0]


class _Forged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, partial, partial_in_holder, batch_in):
        ctx.holder, ctx.size = partial_in_holder, batch_in
        _Records.entries.append({"op": "all_reduce", "seq": len(_Records.entries) + 1, "p2p_seq": None, "p2p": False,
                                 "group": "0", "sizes": [list(y.shape)]})
        _Records.carried[0].append({"op": "all_reduce", "values": [partial.reshape(-1).clone()]})
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        _Records.entries.append({"op": "all_reduce", "seq": len(_Records.entries) + 1, "p2p_seq": None, "p2p": False,
                                 "group": "0", "sizes": [list(ctx.size)]})
        return grad, None, None, None


class _LocalWithForgedRecords(_LocalWithDecoys):
    """No communication at all: the grader's flight recorder and collective spy are replaced, in the grader's own
    modules, by functions that report one right all-reduce each way."""

    def forward(self, x):
        holder = {}
        w1, b1, w2 = self._spliced("w1", self.w1, 0), self._spliced("b1", self.b1, 0), self._spliced("w2", self.w2, 1)
        z = F.linear(x, w1, b1)
        if z.requires_grad:
            z.register_hook(lambda g: _Records.carried[0].append(
                {"op": "all_reduce", "values": [(g[:, self.blk] @ self.w1.detach()).reshape(-1).clone()]}))
        h = torch.tanh(z)
        y = F.linear(h, w2, self.b2)
        partial = h[:, self.blk].detach() @ self.w2.detach().T
        return _Forged.apply(y, partial, holder, tuple(x.shape))


def tp_patched_grader(mlp, rank, world_size):
    import types

    import graders.common.comm_spy as spy_module
    import graders.parallelism.tensor_parallel as grader

    real = grader._REAL
    grader._REAL = types.SimpleNamespace(collectives=_forged_collectives, get_world_size=real.get_world_size)
    spy_module.spy = _forged_spy
    return _LocalWithForgedRecords(mlp, rank, world_size)


def tp_side_channel(mlp, rank, world_size):
    """The shards exchanged through the job's own store (outside torch.distributed's collectives, unseen by the
    flight recorder), the whole MLP assembled on every rank and run locally, with decoy all-reduces of the right
    partial values whose results are ignored."""
    return _LocalWithDecoys(_whole_through_the_store(mlp, rank, world_size), rank, world_size)


class _LocalOnly(_LocalWithDecoys):
    """The whole MLP computed locally from the whole copy, with no collective at all."""

    def forward(self, x):
        w1, b1, w2 = self._spliced("w1", self.w1, 0), self._spliced("b1", self.b1, 0), self._spliced("w2", self.w2, 1)
        return F.linear(torch.tanh(F.linear(x, w1, b1)), w2, self.b2)


def tp_side_channel_alone(mlp, rank, world_size):
    """The shards exchanged through the job's own store and the whole MLP run locally, no collective at all."""
    return _LocalOnly(_whole_through_the_store(mlp, rank, world_size), rank, world_size)


def _whole_through_the_store(mlp, rank, world_size):
    """The whole MLP (every rank's shards) put together on this rank from what the ranks set in the job's store."""
    import io

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    first, _, second = mlp
    k = first.out_features // world_size
    blk = slice(rank * k, (rank + 1) * k)
    mine = (first.weight.detach()[blk].clone(), first.bias.detach()[blk].clone(),
            second.weight.detach()[:, blk].clone())
    buf = io.BytesIO()
    torch.save(mine, buf)
    calls = store.add("forged-tp-calls", 1)  # one key space per call: the checks build the module more than once
    round_ = (calls - 1) // world_size
    store.set(f"forged-tp-{round_}-{rank}", buf.getvalue())
    whole = [torch.nn.Linear(first.in_features, first.out_features), torch.nn.Tanh(),
             torch.nn.Linear(second.in_features, second.out_features)]
    with torch.no_grad():
        whole[2].bias.copy_(second.bias)
        for r in range(world_size):
            w1, b1, w2 = torch.load(io.BytesIO(store.get(f"forged-tp-{round_}-{r}")))
            theirs = slice(r * k, (r + 1) * k)
            whole[0].weight[theirs], whole[0].bias[theirs], whole[2].weight[:, theirs] = w1, b1, w2
    return whole


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_shards_shared_through_the_store_with_decoys_lose_both_checks():
    """The other ranks' shards reach a rank through the job's store: the local whole output is right, and the
    decoys carry the right partial values. But what a collective delivers carries the ranks' secret numbers
    (graders.common.comm_spy.marker), so an output computed locally, not out of the all-reduce, lacks them."""
    fails(VALUES, tp_side_channel, "did not come out of the forward's collective", "use the result of the all-reduce")
    fails(COMM, tp_side_channel, "the output is not what the forward's all-reduce returned", "use the result")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_shards_shared_through_the_store_without_collectives_lose_both_checks():
    """No collective at all: the values are right, but in the marked pass what a collective delivers carries the
    ranks' secret numbers, so a right value there came another way; the collectives check finds none."""
    fails(VALUES, tp_side_channel_alone, "did not come out of the forward's collective", "no collective delivered it")
    fails(COMM, tp_side_channel_alone, "ran no all-reduce of the output", "[ranks 0, 1]")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_decoys_over_a_local_result_lose_both_checks():
    """Each rank holds only its own (random) shards, NaN elsewhere: the local whole output is NaN, and the
    all-reduce's sum (the ranks' carried values, summed by the grader) is not what the rank returned."""
    fails(VALUES, tp_decoy, "holds NaN", "outside this rank's shard")
    fails(COMM, tp_decoy, "the output is not what the forward's all-reduce returned", "use the result")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_mlp_rebuilt_from_the_callers_seed_loses_both_checks():
    """The seed in the caller's frame makes the MLP's public parts only: the shards are each rank's own, so the
    rebuilt MLP's numbers are another MLP's, its decoy's too."""
    fails(VALUES, tp_decoy_from_frames, "the output differs from the unsplit MLP's")
    fails(COMM, tp_decoy_from_frames, "the forward's all-reduce did not carry this rank's partial output")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_grader_references_replaced_from_the_rank_lose_both_checks():
    """The harness acts and observes with references bound when its module was imported, never looked up
    again: replacing the module's _REAL and comm_spy.spy from the student's code reaches nothing."""
    fails(VALUES, tp_patched_grader, "holds NaN")
    fails(COMM, tp_patched_grader, "the forward ran no all-reduce of the output")


class _Known:
    """The marker a forger would put in the harness's hands: it moves nothing that is sent, and records numbers every
    rank knows (a function of the marker call's index and the rank), so a rank can add all of them to what it
    computed locally, as if the collective had delivered them."""

    calls = [0]
    on: list = [None]  # while a marked pass's marker is entered: (every rank's numbers summed, its list, this rank's)


def _known_number(call: int, rank: int) -> float:
    return 0.5 + ((7 * call + 3 * rank) % 10) / 20  # in [0.5, 1), as the real marker's numbers


def _known_marker(kinds=(), *, with_kind=False, **_):
    import contextlib

    call, rank, world_size = _Known.calls[0], dist.get_rank(), dist.get_world_size()
    _Known.calls[0] += 1
    marked: list = []

    @contextlib.contextmanager
    def entered():
        _Known.on[0] = (sum(_known_number(call, r) for r in range(world_size)), marked, _known_number(call, rank))
        try:
            yield
        finally:
            _Known.on[0] = None

    return entered(), marked


def _as_if_delivered(value):
    """In a marked pass, ``value`` plus every rank's known number, this rank's recorded as the real marker records
    it; ``value`` as it is otherwise."""
    if _Known.on[0] is None:
        return value
    total, marked, mine = _Known.on[0]
    marked.append(("all_reduce", mine))
    return value + total


class _DecoyAsIfDelivered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, partial):
        dist.all_reduce(partial.detach().clone())  # the decoy: the right partial output, its result ignored
        return _as_if_delivered(y.view_as(y))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _DecoyBackAsIfDelivered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, holder):
        ctx.holder = holder
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(ctx.holder["partial_in"].clone())  # the decoy: the right partial input gradient
        return _as_if_delivered(grad), None


class _LocalAsIfDelivered(_LocalWithDecoys):
    """The whole MLP run locally (its shards from the store), decoys carrying the right partial values, and, in a
    marked pass, the known numbers added to the output and to the input's gradient."""

    decoy, decoy_back = _DecoyAsIfDelivered, _DecoyBackAsIfDelivered


def tp_grader_reloaded(mlp, rank, world_size):
    """comm_spy's marker replaced by the known-numbers one, then the grader's module reloaded: its new _harness binds
    the replacement as its default (asserted, or the forgery would prove nothing). The harness running is the old one."""
    import importlib

    import graders.common.comm_spy as spy_module
    import graders.parallelism.tensor_parallel as grader

    spy_module.marker = _known_marker
    importlib.reload(grader)
    assert _known_marker in grader._harness.__defaults__, "the reload did not rebind the harness's marker"
    return _LocalAsIfDelivered(_whole_through_the_store(mlp, rank, world_size), rank, world_size)


def tp_grader_executed_anew(mlp, rank, world_size):
    """The same, with the grader's source executed under another name (my_tensor_parallel.py) and put in its place:
    in sys.modules and in the grader module's own namespace (the running harness's globals)."""
    import types

    import graders.common.comm_spy as spy_module
    import graders.parallelism.tensor_parallel as grader

    spy_module.marker = _known_marker
    copy = types.ModuleType("my_tensor_parallel")
    with open(grader.__file__) as fh:
        exec(compile(fh.read(), "my_tensor_parallel.py", "exec"), copy.__dict__)  # noqa: S102 - the forgery
    assert _known_marker in copy._harness.__defaults__, "the copy's harness does not hold the replaced marker"
    vars(grader).update({name: value for name, value in vars(copy).items() if not name.startswith("__")})
    sys.modules[grader.__name__] = copy
    return _LocalAsIfDelivered(_whole_through_the_store(mlp, rank, world_size), rank, world_size)


def tp_as_if_delivered(mlp, rank, world_size):
    """The forgeries' module alone (no reload): the control, run in a harness that holds the known-numbers marker."""
    return _LocalAsIfDelivered(_whole_through_the_store(mlp, rank, world_size), rank, world_size)


def _harness_holding_the_known_marker():
    """tp._harness as a reload or re-execution would have made it had the student's marker been in comm_spy first:
    the same code and globals, the known-numbers marker as its default (another name: the ranks get it by value)."""
    import inspect
    import types

    real = tp._harness
    names = list(inspect.signature(real).parameters)
    defaults = tuple(_known_marker if name == "_marker" else value
                     for name, value in zip(names[-len(real.__defaults__):], real.__defaults__))
    harness = types.FunctionType(real.__code__, real.__globals__, "_harness_holding_the_known_marker", defaults)
    harness.__module__, harness.__qualname__ = __name__, "_harness_holding_the_known_marker"
    return harness


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_grader_reloaded_or_executed_anew_in_the_rank_loses_both_checks(monkeypatch):
    """The shards shared through the store, the output computed locally, decoy all-reduces carrying the right partial
    values, and a marker of numbers every rank knows put in comm_spy before the grader's module is reloaded (or its
    source executed under another name and put in its place): the module's new harness holds that marker, so a
    harness that took its references from the module would be fooled. The control shows it: in a harness holding
    that marker, the same module scores full marks on both checks. The running harness bound the real marker as a
    default argument before any student object existed, so both forgeries lose both checks: the output is right but
    did not come out of the all-reduce, whose result carried the ranks' secret numbers."""
    with monkeypatch.context() as patch:
        patch.setattr(tp, "_harness", _harness_holding_the_known_marker())
        VALUES(tp_as_if_delivered)
        COMM(tp_as_if_delivered)
    for forged in (tp_grader_reloaded, tp_grader_executed_anew):
        fails(VALUES, forged, "the output is right, but it did not come out of the forward's collective",
              "use the result of the all-reduce")
        fails(COMM, forged, "the output is not what the forward's all-reduce returned", "use the result")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_decoy_loses_exactly_its_cells_in_the_notebook(tmp_path):
    nb = submissions.load("ex1-parallelism")
    source = submissions.answer(nb, "ex1_tensor_parallel")
    head = source[:source.index("def tensor_parallel_mlp")]
    forged = head + '''
class _Decoy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, partial):
        dist.all_reduce(partial.detach().clone())
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _DecoyBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, holder):
        ctx.holder = holder
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(ctx.holder["partial_in"].clone())
        return grad, None


class Local(nn.Module):
    def __init__(self, whole, rank, world_size):
        super().__init__()
        first, _, second = whole
        k = first.out_features // world_size
        self.blk = slice(rank * k, (rank + 1) * k)
        self.w1 = nn.Parameter(first.weight.detach()[self.blk].clone())
        self.b1 = nn.Parameter(first.bias.detach()[self.blk].clone())
        self.w2 = nn.Parameter(second.weight.detach()[:, self.blk].clone())
        self.b2 = nn.Parameter(second.bias.detach().clone())
        self.whole = {"w1": first.weight.detach().clone(), "b1": first.bias.detach().clone(),
                      "w2": second.weight.detach().clone()}

    def spliced(self, name, shard, dim):
        whole, blk = self.whole[name], self.blk
        return torch.cat([whole.narrow(dim, 0, blk.start), shard,
                          whole.narrow(dim, blk.stop, whole.shape[dim] - blk.stop)], dim=dim)

    def forward(self, x):
        holder = {}
        x = _DecoyBack.apply(x, holder)
        z = F.linear(x, self.spliced("w1", self.w1, 0), self.spliced("b1", self.b1, 0))
        if z.requires_grad:
            z.register_hook(lambda g: holder.__setitem__("partial_in", g[:, self.blk] @ self.w1.detach()))
        h = torch.tanh(z)
        y = F.linear(h, self.spliced("w2", self.w2, 1), self.b2)
        return _Decoy.apply(y, h[:, self.blk].detach() @ self.w2.detach().T)


def tensor_parallel_mlp(mlp, rank, world_size):
    return Local(mlp, rank, world_size)
'''
    nb = submissions.replace_answer(nb, "ex1_tensor_parallel", forged)
    report = submissions.grade(submissions.write(nb, tmp_path, "ex1-parallelism"))
    submissions.assert_loses_exactly(report, "ex1-parallelism",
                                     ["ex1_test_tensor_parallel", "ex1_test_tensor_parallel_collectives"],
                                     ["holds NaN"])


# --- exercise 2, the sampler: torch's DistributedSampler with the grader's watch undone -----------------

import graders.ddp_basics.sampler as sampler_checks  # noqa: E402


class ReloadedTorchSampler:
    """torch's DistributedSampler behind a class of its own, with the grader's watch undone: the profile hook
    removed in every call, torch's module reloaded (a class without the grader's counting wrappers)."""

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        import importlib

        import torch.utils.data.distributed as module

        sys.setprofile(None)
        fresh = importlib.reload(module).DistributedSampler
        self.inner = fresh(dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last)

    def __iter__(self):
        sys.setprofile(None)
        return iter(list(self.inner))

    def __len__(self):
        sys.setprofile(None)
        return len(self.inner)

    def set_epoch(self, epoch):
        sys.setprofile(None)
        self.inner.set_epoch(epoch)


def _torch_sampler_copy():
    """torch's DistributedSampler, its module's source executed under another file name."""
    import inspect

    import torch.utils.data.distributed as module

    namespace = {"__name__": "my_sampler"}
    exec(compile(inspect.getsource(module), "my_sampler.py", "exec"), namespace)  # noqa: S102
    return namespace["DistributedSampler"]


class CopiedTorchSampler:
    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        self.inner = _torch_sampler_copy()(dataset, num_replicas=num_replicas, rank=rank, seed=seed,
                                           drop_last=drop_last)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_sampler_with_the_watch_undone_loses_every_sampler_check():
    for forged in (ReloadedTorchSampler, CopiedTorchSampler):
        for check in (sampler_checks.check_sampler_shards, sampler_checks.check_sampler_order,
                      sampler_checks.check_sampler_training):
            fails(check, forged, "your sampler runs torch's DistributedSampler", "a copy of it was made")



class RankZerosOrderSampler:
    """The order drawn on rank 0 from its own random state and broadcast to the others (data no other rank should
    use, over a collective none needs), kept per (n, seed, epoch) so that a new sampler later yields it again."""

    orders: dict = {}

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        self.n, self.num_replicas, self.rank, self.seed, self.drop_last = len(dataset), num_replicas, rank, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _order(self):
        key = (self.n, self.seed, self.epoch)
        if key not in self.orders:
            order = torch.randperm(self.n) if self.rank == 0 else torch.empty(self.n, dtype=torch.long)
            dist.broadcast(order, src=0)
            self.orders[key] = order.tolist()
        return self.orders[key]

    def __len__(self):
        return self.n // self.num_replicas if self.drop_last else -(-self.n // self.num_replicas)

    def __iter__(self):
        order, total = self._order(), len(self) * self.num_replicas
        order = order[:total] if self.drop_last else order + order[:total - self.n]
        return iter(order[self.rank::self.num_replicas])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_order_broadcast_from_rank_0_loses_the_order_check():
    """Its shares are right and it trains; but its order is rank 0's random draw of the day, not a function of seed
    and epoch: the flight recorder shows the sampler communicating."""
    fails(sampler_checks.check_sampler_order, RankZerosOrderSampler, "the sampler communicated", "broadcast")
    sampler_checks.check_sampler_shards(RankZerosOrderSampler)
    sampler_checks.check_sampler_training(RankZerosOrderSampler)

# --- exercise 2, DDP in practice: one big batch; a metric recomputed from the caller's seed ---------------

import graders.ddp_in_practice.checks as ex2p  # noqa: E402
import graders.ddp_in_practice.hardest as hard  # noqa: E402


def accumulate_one_big_batch(ddp_model, micro_batches):
    """All the micro-batches' samples in one forward and backward: the mean loss over them, one all-reduce."""
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    F.mse_loss(ddp_model(x), y).backward()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_big_batch_in_place_of_the_micro_batches_loses_both_checks():
    """The model's BatchNorm normalises each forward's batch: one big batch gives another step than the
    micro-batches run one by one, and DDP's all-reduce carries that other gradient."""
    fails(ex2p.check_accumulation, accumulate_one_big_batch, "differ from one process's step",
          "went through the model together, as one batch")
    fails(ex2p.check_no_sync, accumulate_one_big_batch, "did not carry the gradients of all 4 micro-batches")


def hardest_from_the_callers_seed(model, dataset, rank, world_size, sample_losses, k):
    """Its share through sample_losses (for the grader's record) and a decoy gather whose result it drops; the k
    hardest recomputed on this rank over every sample, with the labels the check's public seed gives (the seed and
    the run read in the caller's frame), or, where the grader has no public labels any more, its copy's."""
    frame = sys._getframe(1)
    caller, grader = frame.f_locals, frame.f_globals  # the grader's harness and its module
    n, seed = caller["n"], caller["seed"]
    sample_losses(model, torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size)))
    dist.all_gather_object([None] * world_size, rank)
    x, labels = dataset.tensors
    if caller.get("shares") is None:
        labels = torch.tensor(grader["hard_case"](n, world_size, k, seed))
    device = next(model.parameters()).device
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model.linear(x.to(device)), labels.to(device), reduction="none")
    return losses.topk(k).indices.tolist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ranking_recomputed_from_the_callers_seed_loses_the_hardest_check():
    """The labels of each rank's share are that rank's own draw, 16 times: the seed gives none of them."""
    fails(hard.check_hardest, hardest_from_the_callers_seed, "ranked samples", "model did not evaluate",
          "each rank's share labelled by that rank alone")  # which ranks: those whose guess missed in that call


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_big_batch_loses_exactly_its_cells_in_the_notebook(tmp_path):
    nb = submissions.load("ex2-ddp-basics", notebook="ddp_in_practice")
    nb = submissions.replace_answer(nb, "ex2p_accumulate_grads", '''
def accumulate_grads(ddp_model, micro_batches):
    """The gradient of the mean loss over all the samples of `micro_batches` in .grad, with one all-reduce."""
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    F.mse_loss(ddp_model(x), y).backward()
''')
    report = submissions.grade(submissions.write(nb, tmp_path, "ex2-ddp-basics", notebook="ddp_in_practice"))
    submissions.assert_loses_exactly(report, "ex2-ddp-basics", ["ex2p_test_accumulation", "ex2p_test_no_sync"],
                                     ["went through the model together"], notebook="ddp_in_practice")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_sampler_copy_loses_exactly_its_cells_in_the_notebook(tmp_path):
    nb = submissions.load("ex2-ddp-basics")
    nb = submissions.replace_answer(nb, "ex2_sampler", '''
import inspect as _inspect
import torch.utils.data.distributed as _torch_module


def _torch_sampler():
    namespace = {"__name__": "my_sampler"}
    exec(compile(_inspect.getsource(_torch_module), "my_sampler.py", "exec"), namespace)
    return namespace["DistributedSampler"]


class ShardSampler(Sampler):
    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False):
        self.inner = _torch_sampler()(dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)
''')
    report = submissions.grade(submissions.write(nb, tmp_path, "ex2-ddp-basics"))
    submissions.assert_loses_exactly(report, "ex2-ddp-basics", ["ex2_test_sampler_shards", "ex2_test_sampler_order",
                                                                "ex2_test_sampler_training"],
                                     ["runs torch's DistributedSampler", "a copy of it was made"])


import graders.ddp_in_practice.precision as amp  # noqa: E402


def amp_one_big_batch(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """Part 5 with one big batch: every micro-batch's samples in one float16 forward and one scaled backward, then
    the true gradient clipped (the given code steps)."""
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    with torch.autocast(device_type=x.device.type, dtype=torch.float16):
        loss = F.mse_loss(ddp_model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_big_batch_in_the_mixed_precision_step_loses_the_step_cell():
    """The gradients the step used carry the rounding of one float16 forward of the whole batch, not of the
    micro-batches' own forwards (the grader recomputes both): the step's cell says so. One all-reduce, after the
    only backward, and the clip of the true global gradient are what check_amp_sync and check_clip judge, and
    hold."""
    fails(amp.check_amp_step, amp_one_big_batch, "the micro-batches went through the model as one batch")
    amp.check_clip(amp_one_big_batch)
    amp.check_amp_sync(amp_one_big_batch)


def amp_clip_factor_worked_out_beforehand(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """The global gradient recomputed on this rank from every rank's micro-batches (the grader's public data function
    and the call's arguments, read in the caller's frame: the harness's phase loop), and its norm's clip factor
    applied to each scaled loss before DDP's all-reduce: the all-reduce then returns the clipped global gradient
    (times the scale), and the given scaler.step unscales it; no clip after it."""
    clip_factor_beforehand(ddp_model, scaler, micro_batches, max_norm, sys._getframe(1))


def clip_factor_beforehand(ddp_model, scaler, micro_batches, max_norm, frame, own_seed=False):
    """The step of :func:`amp_clip_factor_worked_out_beforehand`, with the grader's ``frame`` (the caller's) given.
    The data come from the grader's ``phase_batches``, with the seed every rank's caller holds alike (``seed``), or
    (``own_seed``) with this rank's own data seed for every rank (the others' seeds are drawn on their ranks)."""
    import contextlib
    import copy

    caller, grader = frame.f_locals, frame.f_globals  # the harness's _amp_phase, precision_harness's globals
    phase, k, size, step = caller["phase"], caller["k"], caller["size"], caller["step"]
    seed = caller["data_seed"] if own_seed else caller["seed"]
    world_size = dist.get_world_size()
    twin = copy.deepcopy(ddp_model.module)
    for r in range(world_size):
        for x, y in grader["phase_batches"](phase, seed, r, world_size, step, k, size):
            with torch.autocast(device_type="cpu", dtype=torch.float16):
                loss = F.mse_loss(twin(x), y)
            (loss / k / world_size).backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in twin.parameters()))
    factor = min(1.0, max_norm / (float(norm) + 1e-6))
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with torch.autocast(device_type=x.device.type, dtype=torch.float16):
                loss = F.mse_loss(ddp_model(x), y)
            scaler.scale(loss * factor / k).backward()


def amp_clip_factor_from_its_own_seed(ddp_model, optimizer, scaler, micro_batches, max_norm):
    """:func:`amp_clip_factor_worked_out_beforehand` with this rank's own data seed (read in the caller's frame) for
    every rank's data: right for its own micro-batches, wrong for the others', so each rank has its own factor."""
    clip_factor_beforehand(ddp_model, scaler, micro_batches, max_norm, sys._getframe(1), own_seed=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clip_factor_worked_out_before_the_all_reduce_loses_the_clip_cell():
    """Numerically a clipped step, but the clip was not taken from the all-reduced gradient: what the rank sent in
    the first call is a multiple of what it sends when no clipping happens (the job's other phase, same weights and
    data), or (each rank its own factor) the all-reduce averaged gradients scaled by different factors. The
    weights without clipping, the skipped overflow and the one all-reduce keep their cells."""
    fails(amp.check_clip, amp_clip_factor_worked_out_beforehand, "each rank scaled its gradients before DDP's "
          "all-reduce", "x that")
    # its own factor on every rank: named by what the ranks sent (factors apart) or, where the ranks' factors came
    # out alike in that job's data, by the first call's sent multiple (_judge_unscaled); either way a scaling
    fails(amp.check_clip, amp_clip_factor_from_its_own_seed, "scaled", "before", "DDP's all-reduce")
    for forged in (amp_clip_factor_worked_out_beforehand, amp_clip_factor_from_its_own_seed):
        amp.check_amp_step(forged)
        amp.check_amp_sync(forged)


def train_uneven_from_the_callers_counts(ddp_model, optimizer, batches, train_steps):
    """Every rank trains on min(counts), the other ranks' numbers of batches read in the caller's frame, after a
    decoy all-reduce of its own count whose result it drops: numerically the loop equalised to the fewest."""
    fewest = min(sys._getframe(1).f_locals["counts"])
    dist.all_reduce(torch.tensor([len(batches)]), op=dist.ReduceOp.MIN)
    train_steps(ddp_model, optimizer, batches[:fewest])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uneven_counts_read_in_the_callers_frame_lose_the_uneven_check():
    """In the second run each rank holds a few more batches than the arguments say, a number no other rank is told:
    a loop cut to min(counts) read in the caller's frame trains fewer steps than any rank now holds."""
    fails(ex2p.check_uneven, train_uneven_from_the_callers_counts, "no rank was told in advance",
          "the first run's numbers, not this run's")
