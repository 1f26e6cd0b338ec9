"""Which rank was in which collective when: a per-rank timeline of a job, and its plot.

In a rank, :func:`record` notes every collective the rank calls through ``torch.distributed``
(its start, its end, the line that called it), and, for a DDP model given to
:meth:`Recorder.watch_ddp`, when each layer's backward ran and when each gradient bucket's
all-reduce was launched and finished (DDP launches them asynchronously from its hooks, while
backward goes on: the overlap the plot shows)::

    def work(rank):
        dist.init_process_group("gloo")
        with course.timeline.record() as rec:
            dist.all_reduce(t)
        dist.destroy_process_group()
        return rec.events

    events = course.run_ranks(work, 2)
    course.timeline.plot(events)

Times are wall-clock seconds (every rank of a job runs on this machine, so they line up).

Under nccl a collective returns as soon as it is queued on the GPU, and DDP's bucket futures complete as
they are queued too: a bar would then show how long the CPU took to queue the call, not the collective.
Such events are marked ``"queued": True`` and :func:`plot` says so in its title. ``record(synchronize=True)``
waits for the GPU after each call instead (``torch.cuda.synchronize()``), so the bar ends when the
collective has run (at the price of the overlap a real job would have).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

#: the torch.distributed functions a recorder watches
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "gather", "scatter", "reduce", "send", "recv",
               "all_gather_object", "broadcast_object_list")


class Recorder:
    """The events of one rank: dicts with rank, kind ("collective", "backward", "bucket"), name, start, end, where."""

    def __init__(self, synchronize: bool = False):
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.backend = str(dist.get_backend()) if dist.is_initialized() else ""
        self.synchronize = synchronize and self.backend == "nccl"
        self.events: list[dict[str, Any]] = []

    @property
    def queued_only(self) -> bool:
        """Whether the calls return once queued (nccl) and nothing waits for the GPU: times are the CPU's."""
        return self.backend == "nccl" and not self.synchronize

    def add(self, kind: str, name: str, start: float, end: float | None, where: str = "") -> None:
        event = {"rank": self.rank, "kind": kind, "name": name, "start": start, "end": end, "where": where}
        if self.queued_only:
            event["queued"] = True  # the CPU's time to queue the call on the GPU: not how long it ran
        self.events.append(event)

    def watch_ddp(self, ddp_model) -> None:
        """Record each layer's backward and each gradient bucket's all-reduce (launch to completion)."""
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        recorder = self
        count = {"bucket": 0}

        def hook(state, bucket):
            count["bucket"] += 1
            recorder.add("bucket", f"bucket {bucket.index()} ({bucket.buffer().numel()} values)", time.time(), None)
            event = recorder.events[-1]  # its end is set when the all-reduce completes (never, if it hangs)
            future = allreduce_hook(state, bucket)

            def finished(fut):
                event["end"] = time.time()
                return fut.value()[0] if isinstance(fut.value(), list) else fut.value()

            return future.then(finished)

        ddp_model.register_comm_hook(None, hook)
        for name, module in ddp_model.module.named_modules():
            if next(module.children(), None) is not None or not any(True for _ in module.parameters(recurse=False)):
                continue  # leaf layers with parameters only

            # a layer's backward: from the gradient of its output (a hook on the output tensor) to the last of its
            # parameters' gradients (post-accumulate hooks). Not module backward hooks: on a first layer, whose
            # input needs no gradient, those make torch warn "Full backward hook is firing ..." at every step.
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            state = {"start": None, "pending": 0}

            def started(grad, state=state, count=len(params)):
                state["start"], state["pending"] = time.time(), count

            def output_hook(module, args, output, started=started):
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(started)

            def accumulated(param, name=name, state=state):
                state["pending"] -= 1
                if state["pending"] == 0 and state["start"] is not None:
                    recorder.add("backward", f"backward {name}", state["start"], time.time())
                    state["start"] = None

            module.register_forward_hook(output_hook)
            for param in params:
                param.register_post_accumulate_grad_hook(accumulated)


@contextlib.contextmanager
def record(synchronize: bool = False):
    """Within the block, every torch.distributed collective this rank calls is recorded (start, end, line).

    Under nccl the calls return once queued: their events are marked ``queued`` unless ``synchronize=True``,
    which waits for the GPU after each call so that its end is when the collective finished."""
    import torch.distributed as dist

    recorder = Recorder(synchronize)
    sync = _synchronizer() if recorder.synchronize else None
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            caller = sys._getframe(1)
            where = f"{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}"
            if kwargs.get("async_op"):  # launched, not waited for here (DDP's buckets): watch_ddp times those
                return fn(*args, **kwargs)
            if sync is not None:
                sync()  # what was queued before is not this call's time
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                recorder.add("collective", name, start, time.time(), where)

        recorded.__wrapped__ = fn
        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield recorder
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _synchronizer():
    import torch

    return torch.cuda.synchronize


#: what :func:`plot` adds to its title when the events' times are only the CPU's (nccl, not synchronized)
QUEUED_NOTE = "nccl: bars show the CPU queueing each call, not the collective running on the GPU"


def queued(events_per_rank) -> bool:
    """Whether any of these events was timed only as it was queued (nccl without ``synchronize``)."""
    return any(e.get("queued") for per_rank in events_per_rank for e in (per_rank or []))


def plot(events_per_rank, ax=None, title: str = "collectives per rank"):
    """Draw the events (a list per rank, as the ranks returned them) as one row per rank; returns the axes.

    Collectives are bars from start to end; an event without an end (still waiting when the rank was
    stopped) runs to the right edge, hatched. DDP's layers' backward and bucket all-reduces (from
    :meth:`Recorder.watch_ddp`) get their own row under each rank, so the overlap shows."""
    import matplotlib.pyplot as plt

    events = [e for per_rank in events_per_rank for e in (per_rank or [])]
    if not events:
        raise ValueError("no events to plot: record them in the ranks with course.timeline.record()")
    t0 = min(e["start"] for e in events)
    t1 = max(max(e["start"], e["end"] or e["start"]) for e in events)
    span = max(t1 - t0, 1e-6)
    ranks = sorted({e["rank"] for e in events})
    rows = []
    for rank in ranks:
        kinds = sorted({e["kind"] for e in events if e["rank"] == rank}, key=["collective", "backward", "bucket"].index)
        rows += [(rank, kind) for kind in kinds]
    names = sorted({e["name"].split(" (")[0] if e["kind"] != "backward" else "backward" for e in events})
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(rows)))
    for y, (rank, kind) in enumerate(rows):
        for e in (e for e in events if e["rank"] == rank and e["kind"] == kind):
            key = e["name"].split(" (")[0] if kind != "backward" else "backward"
            end = e["end"] if e["end"] is not None else t1 + 0.05 * span
            width = max((end - e["start"]) * 1e3, span * 1e3 / 400)
            ax.broken_barh([((e["start"] - t0) * 1e3, width)], (y - 0.35, 0.7), facecolors=colors[key],
                           edgecolor="black", linewidth=0.3, hatch="//" if e["end"] is None else None)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" + ("" if k == "collective" else f" {k}") for r, k in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first event (ms)")
    ax.set_title(title + (f"\n({QUEUED_NOTE})" if queued(events_per_rank) else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=colors[n]) for n in names]
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return ax


def overlap(events: list[dict]) -> float:
    """Seconds of one rank's bucket all-reduces that ran while its backward was still computing.

    Under nccl (events marked ``queued``) the buckets' ends are when they were queued: NaN, not a number
    that means nothing (:data:`QUEUED_NOTE` says why)."""
    if any(e.get("queued") and e["kind"] == "bucket" for e in events):
        return float("nan")
    backward = [(e["start"], e["end"]) for e in events if e["kind"] == "backward" and e["end"] is not None]
    if not backward:
        return 0.0
    last = max(end for _, end in backward)
    return sum(max(0.0, min(e["end"], last) - e["start"]) for e in events if e["kind"] == "bucket" and e["end"])
