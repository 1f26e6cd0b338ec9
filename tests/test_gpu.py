"""The nccl path on real GPUs: the engine, DDP, SyncBatchNorm and every lesson's rank functions.

Skipped where torch sees no CUDA (CI has none). On a GPU machine:
``python -m pytest -m gpu``. Set ``DDP_COURSE_GPU_REPORT=DIR`` to keep a JSON report of
the lesson probe (which lesson function ran on nccl, and how it ended).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn as nn

import course
from course.launcher.job import resolve_backend

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

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
    """Why the launcher refuses: NCCL fails a job whose ranks share a GPU (and the launcher says which)."""
    with pytest.raises((course.RankFailedError, course.RankTimeoutError)) as info:
        course.launch(nccl_two_ranks_on_gpu_zero, 2, backend="gloo", echo=False, timeout=90)
    text = str(info.value)
    print(text[:3000])
    assert "rank" in text


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

_PROBE = """
import inspect as _inspect, json as _json, course as _course
_report = []
for _name, _fn in list(globals().items()):
    if not (_inspect.isfunction(_fn) and _fn.__module__ == "__main__" and not _name.startswith("_")):
        continue
    _params = list(_inspect.signature(_fn).parameters.values())
    if not _params or _params[0].name != "rank":
        continue
    if any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in _params[1:]):
        continue
    try:
        _job = _course.launch(_fn, 1, echo=False, timeout=30)
        _report.append({"function": _name, "backend": _job.backend, "ok": True, "seconds": round(_job.elapsed, 2)})
    except Exception as _exc:
        _report.append({"function": _name, "ok": False, "error": f"{type(_exc).__name__}: {_exc}"[:1500]})
print("PROBE " + _json.dumps(_report))
"""


def _probe_lesson(path: Path) -> list[dict]:
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddp-course-gpu-") as tmp:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout")
    return json.loads(text.split("PROBE ", 1)[1])


@pytest.mark.parametrize(
    "lesson", sorted((Path(__file__).parent.parent / "lessons").glob("*.ipynb")), ids=lambda p: p.name[:2]
)
def test_lesson_rank_functions_run_on_nccl(lesson):
    """Each lesson runs top to bottom with a GPU visible; then each of its ``fn(rank)`` runs as one nccl rank.

    Lessons show mistakes on purpose (a hang without join, device_ids on a CPU model, ...),
    so a failing function is reported, not failed; the test fails when the lesson does not
    run, when no function took the nccl path, or when most of them broke on it.
    """
    report = _probe_lesson(lesson)
    out = os.environ.get("DDP_COURSE_GPU_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"lesson{lesson.name[:2]}.json").write_text(json.dumps(report, indent=1))
    for row in report:
        print(row["function"], "ok" if row["ok"] else row["error"][:300])
    if not report:  # lesson 4 runs its jobs as torchrun scripts: nothing to probe, it ran with a GPU visible
        return
    ok = [row for row in report if row["ok"]]
    assert ok and {row["backend"] for row in ok} == {"nccl"}, report
    assert len(ok) * 2 >= len(report), report

