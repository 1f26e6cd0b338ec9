"""Backend choice without the CUDA driver (course/launcher/gpus.py): the process that forks ranks never initialises
CUDA to count GPUs, and a forkserver is not forked from one that did. No GPU here: torch's CUDA entry points are
replaced by functions that fail the test if called, and NVML's answer is faked."""

from __future__ import annotations

import pytest
import torch

from course.launcher import forkserver, gpus
from course.launcher.job import resolve_backend


def _driver_touched(*args, **kwargs):
    raise AssertionError("the CUDA driver was asked in the process that forks ranks")


@pytest.fixture
def cuda_build(monkeypatch):
    """As on a CUDA build of torch whose driver must not be touched: NVML's count is set by the test."""
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", _driver_touched)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", _driver_touched, raising=False)
    gpus._count_in_child.cache_clear()

    def nvml(count: int):
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: count)
    return nvml


def test_a_cpu_build_has_no_gpu_and_asks_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", _driver_touched)
    assert not torch.cuda._is_compiled()  # this machine's torch
    assert gpus.gpu_count() == 0
    assert resolve_backend("auto", 1) == "gloo"


def test_nvml_counts_the_gpus_and_auto_picks_nccl_with_one_per_rank(cuda_build):
    cuda_build(2)
    assert gpus.gpu_count() == 2
    assert resolve_backend("auto", 2) == "nccl"
    assert resolve_backend("auto", 3) == "gloo"
    assert resolve_backend("nccl", 2) == "nccl"
    with pytest.raises(ValueError, match="one GPU per rank"):
        resolve_backend("nccl", 3)


def test_without_nvml_a_child_process_counts(cuda_build, monkeypatch):
    cuda_build(-1)  # NVML could not answer
    asked = []
    monkeypatch.setattr(gpus.subprocess, "run", lambda argv, **kw: asked.append(argv) or
                        type("Done", (), {"returncode": 0, "stdout": "4\n"})())
    assert gpus.gpu_count() == 4 and gpus.gpu_count() == 4
    assert len(asked) == 1 and "torch.cuda.device_count()" in asked[0][-1]  # once per CUDA_VISIBLE_DEVICES


def test_driver_use_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not gpus.driver_used(str(maps))
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54\n")
    assert gpus.driver_used(str(maps))
    assert not gpus.driver_used()  # this test process: no driver on a CPU machine


def test_the_forkserver_is_not_forked_from_a_process_that_used_the_driver(monkeypatch):
    import sys
    from multiprocessing import forkserver as fs

    for name in forkserver.PRELOAD:
        __import__(name)
    monkeypatch.setattr(gpus, "driver_used", lambda maps="/proc/self/maps": True)
    monkeypatch.setattr(forkserver.threading, "active_count", lambda: 1)
    server = fs.ForkServer()  # a fresh one: nothing started
    assert all(name in sys.modules for name in forkserver.PRELOAD)
    assert forkserver._fork_forkserver(server) is False
    assert server._forkserver_pid is None


def test_without_gpu_device_files_the_count_is_0_without_importing_torch(monkeypatch, tmp_path):
    """A process that has not imported torch (``ddp-course grade``, which starts kernels and verifiers) learns that
    there is no GPU from the device files alone, and keeps from importing torch (a CPU second each time); where a
    GPU's device file exists, torch is asked as before."""
    import subprocess
    import sys

    code = ("import sys; from course.launcher import gpus; "
            "print(gpus.no_gpu_devices(), gpus.gpu_count(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == (["True", "0", "False"] if gpus.no_gpu_devices() else [out[0], out[1], "True"]), out
    (tmp_path / "nvidiactl").write_text("")
    monkeypatch.setattr(gpus, "GPU_DEVICE_FILES", (str(tmp_path / "nvidia*"),))
    assert not gpus.no_gpu_devices()
    monkeypatch.setattr(gpus, "GPU_DEVICE_FILES", (str(tmp_path / "missing*"), str(tmp_path / "kfd")))
    assert gpus.no_gpu_devices()
