"""What a sandbox may use: :class:`Limits`, shared by the grader side (:mod:`course.sandbox.box`) and the
wrapper that applies them (:mod:`course.sandbox.wrapper`)."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Limits:
    """Resource limits of one sandbox (all processes of one submission together, where the OS allows)."""

    #: bytes of memory for the whole sandbox (cgroup); a kernel, its forkserver and 4 gloo ranks
    #: training a small DDP model use ~0.8 GB (measured: 250 MB kernel, 290 MB forkserver,
    #: 4 x 15-100 MB ranks sharing the forkserver's pages)
    memory: int = 3 * GiB
    #: bytes of address space per process, used only when no cgroup is available (torch ranks map ~1 GB)
    address_space: int = 6 * GiB
    #: processes + threads of the sandbox uid (a kernel + 4 ranks use ~60)
    nproc: int = 512
    #: CPU seconds per process
    cpu_seconds: int = 1800
    #: largest file a sandboxed process may write
    file_size: int = 512 * MiB
    open_files: int = 4096
    #: size of the private /tmp and /dev/shm (counted in ``memory`` too)
    tmp_size: int = 1 * GiB
