"""Stall detection, holds and the timeline under nccl (issue 39, item 3), without a GPU.

Under nccl a collective returns once queued: a rank whose collective never completes spins in ``.item()`` (busy,
outside torch.distributed's code), so neither the CPU time nor the stack says it waits. The stall watch then judges
nccl's flight-recorder states (scheduled / completed) and gives no verdict it cannot prove; the hold counts a rank
whose nccl collective is queued ahead of rank 0 as waiting on its GPU; the timeline marks its CPU times as
meaningless. Each is tested here with faked nccl recorder entries (the keys of torch's dump, as tests/test_recorder.py
fakes them) and a faked backend.
"""

from __future__ import annotations

import json
import math
import pickle

import pytest

from course.launcher import hold, recorder, stall
from course.launcher.stall import StallWatch, analyse


def raw(name: str, seq: int, state: str = "scheduled", sizes=((4,),), pg=("0", "default_pg"), created: int = 0):
    return {"profiling_name": name, "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "state": state,
            "process_group": pg, "input_sizes": [list(s) for s in sizes], "input_dtypes": ["Float"],
            "time_created_ns": created}


def answer(*entries, waiting=False, site="Cell In[3], line 7"):
    """A rank's probe answer: its entries as the probe sends them (course.launcher.recorder.entry_of)."""
    return {"entries": [recorder.entry_of(e) for e in entries], "waiting": waiting,
            "site": {"where": site, "line": "x.item()"}}


DONE = [raw("nccl:all_reduce", 1, "completed"), raw("nccl:all_reduce", 2, "completed")]


# --------------------------------------------------------------------------- the recorder's entries


def test_an_entry_says_its_backend_and_state_from_the_dump():
    e = recorder.entry_of(raw("nccl:all_reduce", 3, "completed", pg=("5", "undefined")))
    assert (e["backend"], e["state"], e["pg"], e["group"], e["op"]) == ("nccl", "completed", "5", "undefined",
                                                                         "all_reduce")
    assert recorder.entry_of({**raw("all_reduce", 1), "backend": "gloo"})["backend"] == "gloo"


# --------------------------------------------------------------------------- the verdicts


def test_ranks_queued_different_collectives_at_the_same_point_is_a_mismatch():
    """Both ranks busy in .item() (not waiting by their stacks): nccl's states alone prove it."""
    verdict = analyse({0: answer(*DONE, raw("nccl:all_reduce", 3)), 1: answer(*DONE, raw("nccl:broadcast", 3))}, [])
    assert verdict is not None and verdict.kind == "mismatch"
    assert "rank 0 waits in all_reduce #3" in verdict.lined_up and "queued on the GPU and never completed" in \
        verdict.lined_up
    assert "broadcast" in verdict.hint and "nccl's flight recorder" in verdict.hint


def test_a_rank_that_returned_without_issuing_the_pending_collective_is_named():
    verdict = analyse({0: answer(*DONE, raw("nccl:all_reduce", 3))}, [1], {1: answer(*DONE)})
    assert verdict is not None and verdict.kind == "returned"
    assert "rank 1 returned without calling all_reduce #3" in verdict.hint
    assert verdict.lines[1] == "had returned from the function"


def test_different_shapes_of_an_all_reduce_are_named_but_not_of_a_scatter():
    small, big = raw("nccl:all_reduce", 3, sizes=((4,),)), raw("nccl:all_reduce", 3, "completed", sizes=((2,),))
    verdict = analyse({0: answer(*DONE, small), 1: answer(*DONE, big)}, [])
    assert verdict is not None and verdict.kind == "shapes" and "[4] vs [2]" in verdict.hint
    root, leaf = raw("nccl:scatter", 3, sizes=((4,), (4,))), raw("nccl:scatter", 3, sizes=((4,),))
    assert analyse({0: answer(*DONE, root), 1: answer(*DONE, leaf)}, []) is None  # inputs differ by design


@pytest.mark.parametrize("answers, returned, returned_answers", [
    # every rank in the same queued collective: a slow GPU, not a deadlock
    ({0: answer(*DONE, raw("nccl:all_reduce", 3)), 1: answer(*DONE, raw("nccl:all_reduce", 3))}, [], {}),
    # rank 1 has not reached collective #3 yet and is still in the function: computing, perhaps
    ({0: answer(*DONE, raw("nccl:all_reduce", 3)), 1: answer(*DONE)}, [], {}),
    # everything completed: the ranks are busy with their own work
    ({0: answer(*DONE), 1: answer(*DONE)}, [], {}),
    # rank 1 returned, but its answer was full (16 entries of another group): it may have issued #3 earlier
    ({0: answer(*DONE, raw("nccl:all_reduce", 3))}, [1],
     {1: answer(*[raw("nccl:all_reduce", i, "completed", pg=("1", "undefined")) for i in range(16)])}),
    # the same collective number in two different subgroups (same description, other names): not a mismatch
    ({0: answer(raw("nccl:all_reduce", 1, pg=("1", "undefined"))),
      1: answer(raw("nccl:broadcast", 1, "completed", pg=("2", "undefined")))}, [], {}),
    # rank 1 did issue #3 (queued, then returned): rank 0's may still complete
    ({0: answer(*DONE, raw("nccl:all_reduce", 3))}, [1], {1: answer(*DONE, raw("nccl:all_reduce", 3))}),
    # a rank that cannot read its recorder
    ({0: answer(*DONE, raw("nccl:all_reduce", 3)), 1: {"entries": None, "waiting": False}}, [], {}),
])
def test_what_nccl_states_do_not_prove_is_no_verdict(answers, returned, returned_answers):
    assert analyse(answers, returned, returned_answers) is None


def test_a_stack_in_a_collective_proves_nothing_under_nccl():
    """The gloo rule (every rank waiting, their last collectives differ) would name these ranks; under nccl the last
    entries were queued and completed, and the stacks are in a barrier that returns: no verdict."""
    a = answer(raw("nccl:all_reduce", 1, "completed"), raw("nccl:all_reduce_barrier", 2, "completed"), waiting=True)
    b = answer(raw("nccl:all_reduce", 1, "completed"), waiting=True)
    assert analyse({0: a, 1: b}, []) is None
    gloo_a = answer(raw("gloo:all_reduce", 1), raw("gloo:barrier", 2), waiting=True)
    gloo_b = answer(raw("gloo:all_reduce", 1), waiting=True)
    assert analyse({0: gloo_a, 1: gloo_b}, []).kind == "sequence"  # gloo's rule, unchanged


# --------------------------------------------------------------------------- the watch on a busy GPU job


def test_a_busy_gpu_job_is_asked_and_stopped_by_two_equal_verdicts(tmp_path, monkeypatch):
    """nccl ranks spin while they wait: the watch finds the CUDA driver in their maps and asks every GPU_ASK s."""
    clock = iter(range(1, 10_000))
    monkeypatch.setattr(stall, "_cpu_seconds", lambda pid: float(next(clock)))  # always busy
    monkeypatch.setattr(stall, "_uses_gpu", lambda pid: True)
    probes = [str(tmp_path / f"rank{r}.probe") for r in range(2)]
    watch = StallWatch([11, 12], probes, [str(tmp_path / f"rank{r}.result") for r in range(2)])
    answers = [answer(*DONE, raw("nccl:all_reduce", 3)), answer(*DONE, raw("nccl:broadcast", 3))]

    def reply():
        for path, data in zip(probes, answers):
            (tmp_path / (path.rsplit("/", 1)[1] + ".req")).unlink()  # asked: the rank takes the request
            with open(path, "w") as fh:
                json.dump(data, fh)

    assert watch.poll([0, 1], now=0.0) is None and watch.on_gpu  # asked at once
    reply()
    assert watch.poll([0, 1], now=0.3) is None  # first verdict: not yet
    assert watch.poll([0, 1], now=0.6) is None  # not GPU_ASK seconds since
    assert watch.poll([0, 1], now=0.4 + stall.GPU_ASK) is None  # asked again
    reply()
    verdict = watch.poll([0, 1], now=0.7 + stall.GPU_ASK)
    assert verdict is not None and verdict.kind == "mismatch"


def test_a_busy_cpu_job_is_never_asked(tmp_path, monkeypatch):
    clock = iter(range(1, 10_000))
    monkeypatch.setattr(stall, "_cpu_seconds", lambda pid: float(next(clock)))
    monkeypatch.setattr(stall, "_uses_gpu", lambda pid: False)
    probes = [str(tmp_path / f"rank{r}.probe") for r in range(2)]
    watch = StallWatch([11, 12], probes, [str(tmp_path / f"rank{r}.result") for r in range(2)])
    for step in range(60):
        assert watch.poll([0, 1], now=step * 0.3) is None
    assert not watch.on_gpu and not list(tmp_path.glob("*.req"))


def test_the_driver_is_found_in_a_process_memory_map(tmp_path):
    from course.launcher.gpus import driver_used

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.535.1\n")
    assert driver_used(str(maps))
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    assert not driver_used(str(maps)) and not stall._uses_gpu(2 ** 22 + 12345)  # no such process


# --------------------------------------------------------------------------- the hold


def test_a_rank_spinning_after_queueing_a_collective_ahead_of_rank_0_is_not_accused(monkeypatch):
    """Under nccl a rank that queued the broadcast it waits for spins in .item(): its stack is not in
    torch.distributed, but nccl's recorder shows the collective ahead of rank 0's: 'issued', never 'neither'."""
    monkeypatch.setattr(hold, "_entries", lambda: [raw("nccl:all_reduce", 1, "completed"), raw("nccl:broadcast", 2)])
    theirs = {"returned": False, "waiting": False, "seqs": hold.last_seqs()}
    assert theirs["seqs"] == {"default_pg": 2}
    assert hold.Hold._state(theirs, {"default_pg": 1}) == "issued"
    assert hold.Hold._state({**theirs, "seqs": {"default_pg": 1}}, {"default_pg": 1}) == "neither"


# --------------------------------------------------------------------------- the timeline


@pytest.fixture
def fake_nccl(monkeypatch):
    """torch.distributed as a rank of an nccl job sees it, with an all_reduce that only counts its calls."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append("all_reduce"))
    return calls


def test_the_timeline_marks_nccl_times_as_queued_and_says_so(fake_nccl):
    import matplotlib

    matplotlib.use("Agg")
    import torch.distributed as dist

    import course.timeline as timeline

    with timeline.record() as rec:
        dist.all_reduce(None)
    assert fake_nccl == ["all_reduce"] and rec.events[0]["queued"] is True
    ax = timeline.plot([rec.events])
    assert timeline.QUEUED_NOTE in ax.get_title()
    bucket = {"rank": 0, "kind": "bucket", "name": "bucket 0", "start": 0.0, "end": 1.0, "queued": True}
    backward = {"rank": 0, "kind": "backward", "name": "backward 0", "start": 0.0, "end": 2.0, "queued": True}
    assert math.isnan(timeline.overlap([backward, bucket]))
    assert timeline.overlap([{**backward, "queued": False}, {**bucket, "queued": False}]) == 1.0


def test_a_synchronized_nccl_timeline_waits_for_the_gpu(fake_nccl, monkeypatch):
    import torch.distributed as dist

    import course.timeline as timeline

    synced = []
    monkeypatch.setattr(timeline, "_synchronizer", lambda: lambda: synced.append(len(fake_nccl)))
    with timeline.record(synchronize=True) as rec:
        dist.all_reduce(None)
    assert synced == [0, 1] and "queued" not in rec.events[0]  # before and after the call


def test_a_gloo_timeline_is_unchanged(monkeypatch, fake_nccl):
    import torch.distributed as dist

    import course.timeline as timeline

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with timeline.record(synchronize=True) as rec:  # nothing to synchronize on gloo
        dist.all_reduce(None)
    assert "queued" not in rec.events[0]
    assert pickle.loads(pickle.dumps(rec.events))[0]["name"] == "all_reduce"


def test_on_gpus_gloos_rule_still_needs_idle_ranks(tmp_path, monkeypatch):
    """A GPU job's gloo group: ranks whose stacks are in a backward (counted as waiting) and whose last collectives
    differ are stuck only if idle; busy, they are computing, and two equal answers do not stop the job."""
    busy = {"on": True}
    ticks = iter(range(1, 10_000))
    monkeypatch.setattr(stall, "_cpu_seconds", lambda pid: float(next(ticks)) if busy["on"] else 1.0)
    monkeypatch.setattr(stall, "_uses_gpu", lambda pid: True)
    probes = [str(tmp_path / f"rank{r}.probe") for r in range(2)]
    watch = StallWatch([11, 12], probes, [str(tmp_path / f"rank{r}.result") for r in range(2)])
    answers = [answer(raw("gloo:all_reduce", 1), raw("gloo:all_reduce", 2), waiting=True),
               answer(raw("gloo:all_reduce", 1), waiting=True)]

    def reply():
        for path, data in zip(probes, answers):
            with open(path, "w") as fh:
                json.dump(data, fh)

    now, verdicts = 0.0, []
    for _ in range(40):
        reply()
        verdicts.append(watch.poll([0, 1], now=now))
        now += 0.3
    assert verdicts == [None] * 40
    busy["on"] = False  # idle from now on: the same answers are a deadlock
    for _ in range(40):
        reply()
        verdicts.append(watch.poll([0, 1], now=now))
        now += 0.3
    assert any(v is not None and v.kind == "sequence" for v in verdicts)
