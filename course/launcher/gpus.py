"""How many GPUs a job may use, asked without touching the CUDA driver in this process, and whether it was touched.

A rank forked from a process that initialised the CUDA driver cannot use the GPU, and torch's
``torch.cuda.is_available()`` initialises it (``cudaGetDeviceCount`` calls ``cuInit``) unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``; ``torch.cuda.is_initialized()`` still says False afterwards. So the
launcher never asks torch that in a process that forks ranks: :func:`gpu_count` asks NVML (the management
library: no driver context), and where NVML cannot answer, a short-lived child process, where the driver may
be initialised at no cost to this one. :func:`driver_used` says whether this process loaded the driver
anyway (someone else asked): a forkserver is then started fresh instead of forked from it.
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys

#: the driver's library: a process that mapped it has used the CUDA driver (torch's runtime loads it on first use)
DRIVER_LIBRARY = "libcuda.so"

#: device files one of which every GPU torch can use needs (NVIDIA's driver, in a container too; ROCm's kernel
#: driver; WSL2's GPU): where none exists, there is no GPU to count
GPU_DEVICE_FILES = ("/dev/nvidia*", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def no_gpu_devices() -> bool:
    """Whether this machine has none of :data:`GPU_DEVICE_FILES`: no GPU, known without importing torch."""
    return not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def gpu_count() -> int:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES`` counted), found without initialising CUDA here.
    Without a GPU's device files, 0 without importing torch where it is not imported yet (a CPU second saved in
    the processes that grade, which start kernels and verifiers but run no rank themselves)."""
    if "torch" not in sys.modules and no_gpu_devices():
        return 0
    import torch

    if not torch.cuda._is_compiled():  # a CPU build of torch: no GPU whatever the machine has
        return 0
    if torch.cuda.is_initialized():  # CUDA is in use here already: torch's own count costs nothing more
        return torch.cuda.device_count()
    count = _nvml_count()
    return count if count >= 0 else _count_in_child(os.environ.get("CUDA_VISIBLE_DEVICES"))


def _nvml_count() -> int:
    """NVML's count of the visible GPUs (torch's own reading of it), or -1 where NVML cannot answer."""
    import torch

    try:
        return int(torch.cuda._device_count_nvml())
    except Exception:  # noqa: BLE001 - a torch without the helper, a broken NVML: the child answers
        return -1


@functools.cache
def _count_in_child(visible: str | None) -> int:
    """torch's count in a child process (the driver is initialised there, never here); 0 when it cannot say."""
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def driver_used(maps: str = "/proc/self/maps") -> bool:
    """Whether this process has loaded the CUDA driver (whoever asked it: ``torch.cuda.is_available()``, a
    ``cudaGetDeviceCount``, a tensor on a GPU). A process forked from it could not use the GPU."""
    try:
        with open(maps, "rb") as fh:
            return DRIVER_LIBRARY.encode() in fh.read()
    except OSError:
        return False


def missing_requirements(package: str = "torch", requires: list[str] | None = None) -> list[str]:
    """The requirements ``package`` declares (its metadata's, or ``requires``) that this environment lacks or has at
    another version, extras aside: a torch installed with ``pip install --no-deps`` (the Docker image's first step)
    whose CUDA runtime wheels (``nvidia-*``) did not come afterwards imports no CUDA library."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv: pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    missing = []
    for text in metadata.requires(package) or [] if requires is None else requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra, or another platform's
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(f"{text} (installed: {version})")
    return missing


def check_install() -> int:
    """The image build's check of its torch (docker/Dockerfile): 0 when every requirement torch declares is
    installed, else 1, naming them."""
    lacking = missing_requirements()
    import torch

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}): "
          + ("every requirement it declares is installed" if not lacking else "missing " + ", ".join(lacking)))
    return 1 if lacking else 0
