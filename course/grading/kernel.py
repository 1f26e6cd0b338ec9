"""The Jupyter kernel manager of grading: a submission's kernel, started in a :class:`~course.sandbox.Sandbox`.

:class:`SandboxKernelManager` is a jupyter_client kernel manager (usable as nbclient's and
nbgrader's ``kernel_manager_class``) whose kernel runs in a sandbox of its own work folder,
with the check-recording hook installed (:func:`course.grading.snapshot.prepare`), forked from
the autograde worker's zygote when there is one (:mod:`course.sandbox.zygote`). The kernel talks
to its client over unix sockets (ZMQ ``ipc``), which cross the sandbox's network namespace.
:data:`ZYGOTE_PRELOAD` is what such a zygote imports once for the kernels and verifiers it forks.
"""

from __future__ import annotations

import os

from jupyter_client.manager import AsyncKernelManager
from traitlets import Bool, Integer, List, Unicode, default

from course.grading import snapshot
from course.launcher.forkserver import PRELOAD as FORKSERVER_PRELOAD
from course.sandbox import Limits, Sandbox
from course.sandbox import zygote as zygotes
from course.sandbox.limits import GiB

#: what an autograde worker's zygote imports once, so that no kernel, verifier or rank forkserver it forks
#: imports it again: the launcher's forkserver preload (the verifier forks the forkserver), the check API and
#: what a kernel and a verifier import
ZYGOTE_PRELOAD = (*FORKSERVER_PRELOAD, "course.launcher.job", "course.checks", "course.grading.checkcalls",
                  "course.grading.snapshot", "course.grading.student", *zygotes.PRELOAD,
                  "ipykernel.kernelapp", "ipykernel.ipkernel")


#: host memory one nccl rank's CUDA context adds to a sandbox's cgroup, on top of :attr:`Limits.memory` (sized for a
#: kernel and 4 gloo ranks): the CUDA libraries' pages, cuBLAS/cuDNN workspaces, NCCL's buffers in /dev/shm. Not
#: measured here (no GPU was lent yet); torch's CUDA ranks commonly hold 0.5-1.5 GB each, and
#: benchmarks/gpu_check.sh reports the sandbox's peak on a GPU machine
CUDA_RANK_MEMORY = 2 * GiB


def sandbox_memory(gpus: int | None = None) -> int:
    """Bytes of memory for a grading sandbox: :attr:`Limits.memory`, plus :data:`CUDA_RANK_MEMORY` per GPU this
    machine shows (the notebook's own jobs run a rank per GPU on nccl; the checks' jobs hide the GPUs). ``gpus``:
    the count, else asked without initialising CUDA here (:func:`course.launcher.gpus.gpu_count`)."""
    if gpus is None:
        from course.launcher.gpus import gpu_count

        gpus = gpu_count()
    return Limits.memory + CUDA_RANK_MEMORY * max(0, int(gpus))


class SandboxKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel runs in a :class:`Sandbox` of its own work folder.

    Use as ``NotebookClient(kernel_manager_class=SandboxKernelManager)`` or in an
    nbgrader config ``c.Execute.kernel_manager_class = "course.grading.kernel.SandboxKernelManager"``.
    The work folder is the ``cwd`` the client starts the kernel in (nbclient and
    nbgrader pass the notebook's folder). ``hide`` adds paths to cover; with an
    nbgrader config, the course folder (and the one its source/ links to) is
    hidden too. Every process of the kernel is killed when the kernel shuts down.
    """

    hide = List(Unicode(), help="Paths the submission must not see (besides exercises/, tests/ and .git).").tag(config=True)
    memory_limit = Integer(help="Bytes of memory for the whole sandbox (default: sandbox_memory()).").tag(config=True)
    nproc_limit = Integer(Limits.nproc, help="Processes and threads of the sandbox.").tag(config=True)
    cpu_limit = Integer(Limits.cpu_seconds, help="CPU seconds per process.").tag(config=True)
    file_size_limit = Integer(Limits.file_size, help="Largest file a sandboxed process may write.").tag(config=True)
    snapshot_checks = Bool(True, help="Record what each check call receives, for course.grading.verifier.").tag(config=True)

    sandbox: Sandbox | None = None

    @default("memory_limit")
    def _memory_limit(self) -> int:
        return sandbox_memory()

    def limits(self) -> Limits:
        return Limits(memory=self.memory_limit, nproc=self.nproc_limit, cpu_seconds=self.cpu_limit,
                      file_size=self.file_size_limit)

    def hidden_paths(self) -> list[str]:
        return [*self.hide, *course_paths(self.config)]

    async def _async_pre_start_kernel(self, **kw):
        workdir = os.path.realpath(kw.get("cwd") or os.getcwd())
        if self.sandbox is None or self.sandbox.workdir != workdir:
            if self.sandbox is not None:
                self.sandbox.close()
            self.sandbox = Sandbox(workdir, hide=self.hidden_paths(), limits=self.limits()).open()
        box = self.sandbox
        box.kill()  # a restart: nothing of the previous kernel survives
        kernel_dir = box.runtime_dir
        self.transport = "ipc"  # unix sockets cross the network namespace; TCP would not
        self.connection_file = os.path.join(kernel_dir, "kernel.json")
        self.ip = os.path.join(kernel_dir, "ipc")
        if self.snapshot_checks:
            snapshot.prepare(box)
        kw["cwd"] = workdir
        cmd, kw = await super()._async_pre_start_kernel(**kw)
        if box.uid is not None:
            os.chown(self.connection_file, box.uid, box.uid, follow_symlinks=False)
        self.log.info(box.summary)
        return box.command(cmd, relay_output=True), kw

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        if not self._launch_from_zygote(kernel_cmd, kw):
            await super()._async_launch_kernel(kernel_cmd, **kw)
        pid = getattr(self.provisioner, "pid", None)
        if self.sandbox is not None and pid:
            self.sandbox.pids.append(pid)

    def _launch_from_zygote(self, kernel_cmd, kw) -> bool:
        """Start the kernel from this process's zygote (:mod:`course.sandbox.zygote`), as the local
        provisioner's ``launch_kernel`` would start it with Popen; False where there is no zygote."""
        from jupyter_client.provisioning.local_provisioner import LocalProvisioner

        zygote, prov = zygotes.current(), self.provisioner
        if zygote is None or type(prov) is not LocalProvisioner or not hasattr(self, "_reconcile_connection_info"):
            return False
        kw = LocalProvisioner._scrub_kwargs(kw)
        env = dict(kw.get("env") or os.environ)
        env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launch_kernel sets it
        prov.process = zygote.popen(kernel_cmd, env=env, cwd=kw.get("cwd"), stdin=kw.get("stdin"),
                                    stdout=kw.get("stdout"), stderr=kw.get("stderr"))
        prov.pid = prov.pgid = prov.process.pid  # a session of its own, as with start_new_session
        self._reconcile_connection_info(prov.connection_info)
        return True

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        try:
            await super()._async_cleanup_resources(restart=restart)
        finally:
            if self.sandbox is not None:
                self.sandbox.kill() if restart else self.sandbox.close()

    def close_sandbox(self) -> None:
        """Kill everything left and give the work folder back (also when the kernel was never shut down)."""
        if self.sandbox is not None:
            self.sandbox.close()


def course_paths(config) -> list[str]:
    """The nbgrader course folder of a traitlets config, and the real course its source/ links to, if any."""
    try:
        root = config.CourseDirectory.root
    except AttributeError:
        return []
    if not isinstance(root, str) or not root:
        return []
    paths = [root]
    source = os.path.join(root, "source")
    if os.path.islink(source) or os.path.isdir(source):
        paths.append(os.path.dirname(os.path.realpath(source)))
    return paths
