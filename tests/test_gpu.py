"""The nccl path on real GPUs: the engine, the check API's recorder, stall detection, the timeline, DDP, SyncBatchNorm
and every lesson's jobs.

Skipped where torch sees no CUDA (CI has none). On a GPU machine: ``python -m pytest -m gpu`` (benchmarks/gpu_check.sh
runs it in two parts, the lessons last). Set ``DDP_COURSE_GPU_REPORT=DIR`` to keep a JSON report of the lesson probe
(each job a lesson ran, on which backend, and each rank function run again at world size = GPU count).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn as nn

import course
from course.launcher.gpus import gpu_count
from course.launcher.job import resolve_backend

GPUS = gpu_count()  # asked without initialising CUDA in this process, which forks the ranks' forkserver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs CUDA GPUs"),
    pytest.mark.timeout(600),
]


def _join_pinned():
    """What the lessons do on nccl: select GPU LOCAL_RANK, join bound to it, return that device."""
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if course.backend() == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group(course.backend())
    return torch.device("cpu")


def all_reduce_on_device(rank):
    import torch.distributed as dist

    device = _join_pinned()
    t = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(t)
    backend = dist.get_backend()
    dist.destroy_process_group()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None
    return {"sum": t.item(), "device": str(t.device), "backend": backend, "nccl": nccl}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(rows):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)


def ddp_steps(rank, rows, steps):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = _join_pinned()
    world = dist.get_world_size()
    model = DDP(_model().to(device), device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = _batch(rows)
    X, y = X.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(X), y).backward()
        opt.step()
    params = [p.detach().cpu() for p in model.module.parameters()]
    dist.destroy_process_group()
    return params


def sync_bn_stats(rank, rows):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = _join_pinned()
    world = dist.get_world_size()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    model = DDP(model.to(device), device_ids=[device.index])
    X = torch.randn(rows, 3, generator=torch.Generator().manual_seed(2))
    model(X.chunk(world)[rank].to(device)).sum().backward()
    bn = model.module[1]
    result = {"kind": type(bn).__name__, "mean": bn.running_mean.cpu(), "var": bn.running_var.cpu()}
    dist.destroy_process_group()
    return result


def nccl_two_ranks_on_gpu_zero(rank):
    """Bypasses the launcher's check on purpose: what NCCL itself says about a shared GPU."""
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_auto_picks_nccl_with_a_gpu_per_rank_and_reduces_on_the_gpus():
    job = course.launch(all_reduce_on_device, GPUS, echo=False, timeout=120)
    assert job.backend == "nccl" and resolve_backend("auto", GPUS) == "nccl"
    expected = GPUS * (GPUS + 1) / 2
    for rank, value in enumerate(job.values):
        assert value == {"sum": expected, "device": f"cuda:{rank}", "backend": "nccl", "nccl": value["nccl"]}
    print(f"{GPUS} GPU rank(s) on nccl {job.values[0]['nccl']}: job took {job.elapsed:.2f} s")


def test_more_ranks_than_gpus_fall_back_to_gloo_on_the_cpu():
    job = course.launch(all_reduce_on_device, GPUS + 1, echo=False, timeout=120)
    assert job.backend == "gloo"
    expected = (GPUS + 1) * (GPUS + 2) / 2
    assert [v["sum"] for v in job.values] == [expected] * (GPUS + 1)
    assert {v["device"] for v in job.values} == {"cpu"}


def test_nccl_asked_for_with_too_few_gpus_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match=f"needs one GPU per rank: {GPUS + 1} ranks"):
        course.run_ranks(all_reduce_on_device, GPUS + 1, backend="nccl")


def test_nccl_itself_refuses_two_ranks_on_one_gpu():
    """Why the launcher gives each nccl rank its own GPU: NCCL fails a job whose ranks share one, and the
    launcher's report names the failing ranks with NCCL's own words."""
    with pytest.raises(course.RankFailedError) as info:
        course.launch(nccl_two_ranks_on_gpu_zero, 2, backend="gloo", echo=False, timeout=90)
    text = str(info.value)
    print(text[:3000])
    assert info.value.ranks, "the report names no failing rank"
    assert re.search(r"Duplicate GPU detected|ncclInvalidUsage|invalid usage", text, re.I), text[:3000]


# --------------------------------------------------------------------------- the check API and the launcher on nccl


def collectives_on_nccl(rank):
    import torch.distributed as dist

    from course import checks

    dev = checks.join_job()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    time.sleep(0.5)  # nccl's watchdog marks a finished collective "completed" in its recorder
    seen = checks.collectives()
    dist.destroy_process_group()
    return {"device": str(dev), "sum": t[0].item(), "entries": seen}


def test_the_check_api_reads_nccls_recorder_and_the_report_says_nccl():
    from course import checks
    from course.grading import cells

    cells.RAN_ON.clear()
    job = checks.run("gpu_probe", collectives_on_nccl, GPUS, backend="auto")
    assert cells.RAN_ON == ["nccl"] and job.backend == "nccl"
    for rank, value in enumerate(job.values):
        assert value["device"] == f"cuda:{rank}" and value["sum"] == GPUS
        mine = [e for e in value["entries"] if e["op"] == "all_reduce"]
        assert mine and all(e["backend"] == "nccl" for e in mine), value["entries"]
        assert mine[-1]["state"] == "completed", value["entries"]


def skips_a_collective(rank):
    import torch.distributed as dist

    device = _join_pinned()
    if rank == 0:  # rank 1 never calls it: rank 0's all_reduce is queued and never completes
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        t.item()  # spins here, outside torch.distributed: only nccl's recorder shows the wait
    return rank


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_a_deadlock_on_nccl_is_found_from_the_recorders_states():
    started = time.monotonic()
    with pytest.raises(course.RankStallError) as info:
        course.launch(skips_a_collective, 2, echo=False, timeout=150)
    verdict = info.value.verdict
    print(verdict.lined_up, verdict.hint, sep="\n")
    assert (verdict.kind, verdict.waiting, verdict.returned) == ("returned", [0], [1])
    assert "queued on the GPU and never completed" in verdict.lined_up
    assert time.monotonic() - started < 60, "found at the deadline, not from the recorder"


def timeline_on_nccl(rank):
    import torch.distributed as dist

    import course.timeline as timeline

    device = _join_pinned()
    t = torch.ones(1 << 20, device=device)
    with timeline.record() as plain:
        dist.all_reduce(t)
    with timeline.record(synchronize=True) as synced:
        dist.all_reduce(t)
    dist.destroy_process_group()
    return plain.events, synced.events


def test_the_timeline_marks_nccl_calls_as_queued_unless_it_synchronizes():
    for plain, synced in course.launch(timeline_on_nccl, GPUS, echo=False, timeout=120).values:
        assert [e["name"] for e in plain] == ["all_reduce"] and plain[0]["queued"] is True
        assert [e["name"] for e in synced] == ["all_reduce"] and "queued" not in synced[0]


def test_ddp_on_nccl_matches_one_process_on_the_cpu():
    rows, steps = 8 * GPUS, 5
    per_rank = course.launch(ddp_steps, GPUS, args=(rows, steps), echo=False, timeout=180).values
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = _batch(rows)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(X), y).backward()
        opt.step()
    for rank, params in enumerate(per_rank):
        assert all(torch.equal(a, b) for a, b in zip(params, per_rank[0])), f"rank {rank} differs from rank 0"
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_sync_batchnorm_on_nccl_keeps_the_global_batch_statistics():
    rows = 6 * GPUS
    per_rank = course.launch(sync_bn_stats, GPUS, args=(rows,), echo=False, timeout=180).values
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    model(torch.randn(rows, 3, generator=torch.Generator().manual_seed(2)))
    for result in per_rank:
        assert result["kind"] == "SyncBatchNorm"
        torch.testing.assert_close(result["mean"], model[1].running_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(result["var"], model[1].running_var, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the lessons on nccl

#: run before the lesson: every job it starts (course.run_ranks, course.launch) is noted with its function, world
#: size, the backend asked for and the one it got, and whether it returned
_RECORD = """
import course as _course, course.launcher.job as _job
_CALLS, _real_launch = [], _job.launch
def _recording_launch(fn, world_size, *args, **kwargs):
    row = {"function": getattr(fn, "__name__", repr(fn)), "world_size": world_size,
           "asked": kwargs.get("backend", "auto"), "fn": fn, "args": kwargs.get("args", ())}
    _CALLS.append(row)
    try:
        job = _real_launch(fn, world_size, *args, **kwargs)
    except BaseException as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:800])
        raise
    row.update(ok=True, backend=job.backend)
    return job
_job.launch = _course.launch = _recording_launch
"""

#: run after the lesson: each function whose job returned there runs again at world size = GPU count, its real
#: arguments (the lesson's own), on the backend 'auto' gives
_PROBE = """
import json as _json
_report = {"calls": [{k: v for k, v in row.items() if k not in ("fn", "args")} for row in _CALLS], "reruns": []}
_done = set()
for _row in _CALLS:
    if not _row.get("ok") or _row["asked"] != "auto" or _row["function"] in _done:
        continue
    _done.add(_row["function"])
    _rerun = {"function": _row["function"], "world_size": {gpus}}
    try:
        _job = _real_launch(_row["fn"], {gpus}, args=_row["args"], echo=False, timeout=45)
        _rerun.update(ok=True, backend=_job.backend, seconds=round(_job.elapsed, 2))
    except Exception as _exc:
        _rerun.update(ok=False, error=f"{type(_exc).__name__}: {_exc}"[:1500])
    _report["reruns"].append(_rerun)
print("PROBE " + _json.dumps(_report))
"""


def _probe_lesson(path: Path) -> tuple[dict, str]:
    """The lesson run with its jobs noted, then its functions at world size = GPU count: (report, its outputs)."""
    import tempfile

    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_RECORD))
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE.replace("{gpus}", str(GPUS))))
    with tempfile.TemporaryDirectory(prefix="ddp-course-gpu-") as tmp:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout")
    outputs = "".join(o.get("text", "") for cell in nb.cells[1:-1] for o in cell.get("outputs", []))
    return json.loads(text.split("PROBE ", 1)[1]), outputs


def expected_backend(asked: str, world_size: int) -> str:
    """What a job should run on here: gloo where asked for, else nccl with a GPU per rank (1 GPU: 1-rank jobs only)."""
    return "gloo" if asked == "gloo" else ("nccl" if GPUS >= world_size else "gloo")


@pytest.mark.parametrize(
    "lesson", sorted((Path(__file__).parent.parent / "lessons").glob("*.ipynb")), ids=lambda p: p.name[:2]
)
def test_lesson_jobs_take_the_gpu_counts_backend_and_its_functions_run_on_nccl_at_world_size_gpu_count(lesson):
    """Each lesson runs top to bottom with the GPUs visible (a lesson cell that fails fails the test). Every job it
    started took the backend this GPU count gives (nccl with a GPU per rank, gloo beyond or where the lesson pins
    it). Then each rank function whose job returned runs again with the lesson's own arguments at world size = GPU
    count: every such job takes nccl, and none fails with a CUDA or NCCL error (a failure that comes from the
    function's own assumption about the world size is reported, not failed)."""
    report, outputs = _probe_lesson(lesson)
    out = os.environ.get("DDP_COURSE_GPU_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"lesson{lesson.name[:2]}.json").write_text(json.dumps(report, indent=1))
    for row in report["calls"] + report["reruns"]:
        print(row["function"], row["world_size"], row.get("backend"), "ok" if row["ok"] else row["error"][:300])
    assert report["calls"], "the lesson started no job through course.run_ranks or course.launch"
    wrong = [(r["function"], r["world_size"], r["asked"], r["backend"]) for r in report["calls"]
             if r["ok"] and r["backend"] != expected_backend(r["asked"], r["world_size"])]
    assert not wrong, f"jobs on another backend than {GPUS} GPU(s) give: {wrong}"
    assert report["reruns"] or all(r["asked"] == "gloo" or not r["ok"] for r in report["calls"])
    assert all(r["backend"] == "nccl" for r in report["reruns"] if r["ok"]), report["reruns"]
    gpu_errors = [r for r in report["reruns"] if not r["ok"] and re.search(r"cuda|nccl|device", r["error"], re.I)]
    assert not gpu_errors, gpu_errors
    if lesson.name.startswith("04"):  # its torchrun scripts choose their backend themselves
        assert ("backend=nccl" in outputs) == (GPUS >= 2), outputs[-3000:]
