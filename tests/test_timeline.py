"""course.timeline: what a rank records, and the plot of a job's collectives."""

from __future__ import annotations

import time

import matplotlib
import pytest
import torch
import torch.distributed as dist

import course
import course.timeline as timeline

matplotlib.use("Agg")


def _two_collectives(rank):
    dist.init_process_group("gloo")
    t = torch.ones(4)
    with timeline.record() as rec:
        if rank == 1:
            time.sleep(0.2)
        dist.all_reduce(t)
        dist.barrier()
        dist.all_reduce(t, async_op=True).wait()  # launched elsewhere than waited for: not recorded
    dist.all_reduce(t)  # outside the block: not recorded
    dist.destroy_process_group()
    return rec.events


def test_a_rank_records_its_collectives_with_start_end_and_line():
    events = course.run_ranks(_two_collectives, 2, echo=False)
    for rank, per_rank in enumerate(events):
        assert [(e["rank"], e["kind"], e["name"]) for e in per_rank] == [(rank, "collective", "all_reduce"),
                                                                         (rank, "collective", "barrier")]
        assert all(e["end"] >= e["start"] and e["where"].startswith("test_timeline.py:") for e in per_rank)
    waited = [per_rank[0]["end"] - per_rank[0]["start"] for per_rank in events]
    assert waited[0] > waited[1] + 0.1  # rank 0 waited in the all_reduce for the late rank 1


def _ddp_step_watched(rank):
    import warnings

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    with warnings.catch_warnings(record=True) as caught, timeline.record() as rec:
        warnings.simplefilter("always")
        rec.watch_ddp(ddp_model)
        for _ in range(2):
            ddp_model(torch.randn(3, 4)).sum().backward()
    dist.destroy_process_group()
    return rec.events, [str(w.message) for w in caught]


def test_watching_ddp_records_each_layers_backward_and_each_bucket_without_warnings():
    for events, warned in course.run_ranks(_ddp_step_watched, 2, echo=False):
        assert warned == []  # no "Full backward hook is firing ..." from the course's own hooks
        backward = [e["name"] for e in events if e["kind"] == "backward"]
        assert backward == ["backward 2", "backward 0"] * 2, backward  # the last layer's backward comes first
        assert all(e["end"] >= e["start"] for e in events)
        assert sum(e["kind"] == "bucket" for e in events) >= 2 and all(e["end"] for e in events if e["kind"] == "bucket")


def test_plot_draws_a_row_per_rank_and_kind_and_open_ended_waits():
    events = [[{"rank": 0, "kind": "collective", "name": "all_reduce", "start": 0.0, "end": 0.5, "where": ""},
               {"rank": 0, "kind": "bucket", "name": "bucket 0 (10 values)", "start": 0.1, "end": 0.3, "where": ""},
               {"rank": 0, "kind": "backward", "name": "backward 1", "start": 0.0, "end": 0.2, "where": ""}],
              [{"rank": 1, "kind": "collective", "name": "barrier", "start": 0.2, "end": None, "where": ""}]]
    ax = timeline.plot(events)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 0 backward", "rank 0 bucket", "rank 1"]
    hatched = [p for p in ax.collections if p.get_hatch()]
    assert len(hatched) == 1  # rank 1 never left its barrier
    assert timeline.overlap(events[0]) == pytest.approx(0.1)  # bucket 0.1-0.3 vs backward ending at 0.2
    with pytest.raises(ValueError, match="no events"):
        timeline.plot([[], []])
