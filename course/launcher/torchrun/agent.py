"""torchrun's agent, as the launcher starts it: ``python -m course.launcher.torchrun.agent TORCHRUN-ARGS``.

This is ``python -m torch.distributed.run TORCHRUN-ARGS`` (torch's own ``main``: its rendezvous, restarts,
monitoring and failure report, unchanged) with one difference, in how a worker process comes to be. Every
worker runs the same probe (:mod:`~course.launcher.torchrun.torchrun_probe`), and a fresh Python spends
about 2.5 CPU seconds importing torch and, at the first DDP construction, ``torch._dynamo``: nearly all of
a worker's cost on this course's small jobs (an elastic launch started 8 workers and spent 19 of its 29 CPU
seconds in them). So the agent keeps a warm zygote (:class:`course.sandbox.zygote.Zygote`): it imports
the workers' modules (:data:`PRELOAD`, torch among them, which it needs itself) and forks the zygote from
itself before torchrun's code runs (one import of torch per agent, not two: about 1.1 CPU s less per agent;
the launcher starts the agent with the zygote's flags, so nothing is imported from the job's folder). Torch's
subprocess handler then forks each worker from the zygote instead of exec'ing
``python -u torchrun_probe.py SCRIPT ARGS``: the child takes the worker's environment, streams, working folder
and a session of its own, and runs the probe as ``__main__``, as the fresh interpreter would (see the zygote's
module text for what a forked process shares with its zygote). A worker whose
environment differs in what is read at import time, or any failure to reach the zygote, is exec'd as
before; ``DDP_COURSE_ZYGOTE=0`` exec's every worker.

The worker is then the agent's grandchild (agent, zygote, worker): ``DDP_COURSE_PROBE_AGENT`` carries the
agent's pid to the probe (an elastic node that leaves kills its own agent), and the launcher tells a worker
from the zygote by its process name (:data:`~course.launcher.torchrun.workers.ZYGOTE_NAME`) where it only counts workers. Where it judges who
wrote a file it needs each worker's RANK, which a forked worker's /proc/PID/environ no longer shows (that is
the zygote's): :class:`~course.launcher.torchrun.workers.ZygoteReports` is the launcher's side of a pipe on which only the (undumpable) zygotes
say who they are and whom they forked with which RANK. Nothing of a submission runs in the agent or in its
zygote.
"""

from __future__ import annotations

import os
import sys

from course.launcher.torchrun.workers import PROBE_SCRIPT, REPORT_FD, SECRET_FD

#: what the workers' zygote imports: a worker's torch and torch.distributed, the probe's own imports (the probe
#: module itself runs afresh as ``__main__`` in each worker), and torch._dynamo, which a worker's first optimizer or
#: DDP model imports (about 0.8 CPU s a worker). torch._dynamo imported before ``init_process_group`` made workers
#: hang at their end (exec'd too: 8 of 24 three-worker runs of a script that builds its optimizer before init, under
#: plain torchrun): freeing a DDP model after ``destroy_process_group`` ran ~ProcessGroupGloo holding the GIL while a
#: gloo thread needed it. The probe now keeps every destroyed group until its os._exit (its destroy_process_group),
#: so that teardown never runs in a worker: 0 of 45 runs hung (20 of exercise 4's reference, 25 of a script that
#: builds its optimizer before init), forked with this list or exec'd.
PRELOAD = ("course.sandbox.wrapper", "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "course.launcher.rank", "course.launcher.torchrun.torchrun_probe")
PROBE_MODULE = "course.launcher.torchrun.torchrun_probe"


def forked_argv(args: tuple | list) -> list[str] | None:
    """The zygote's form of a worker's command (``python -u torchrun_probe.py ...`` becomes
    ``python -u -m course.launcher.torchrun.torchrun_probe ...``), or None for any other command."""
    args = [str(a) for a in args]
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-u" and args[2] == PROBE_SCRIPT:
        return [sys.executable, "-u", "-m", PROBE_MODULE, *args[3:]]
    return None


def install(zygote, report_fd: int | None = None) -> None:
    """Make torch's subprocess handler fork the probe's workers from ``zygote`` (None: exec them, as torch does).

    ``report_fd``: where there is no zygote, the launcher's report pipe, now this agent's: a probe's worker it
    exec's gets a secret of its own as the zygote would give it (:func:`_exec_with_secret`), said on the pipe."""
    if zygote is None and report_fd is None:
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    real_popen = subprocess_handler.SubprocessHandler._popen

    def _popen(self, args, env):
        argv = forked_argv(args)
        if argv is not None and zygote is not None and zygote.alive():
            try:
                return zygote.popen(argv, env=env, stdout=self._stdout, stderr=self._stderr)
            except OSError as exc:  # the zygote could not start it: exec it, as torch would
                print(f"[ddp-course] worker exec'd, not forked: {exc}", file=sys.stderr, flush=True)
        if argv is not None and report_fd is not None:
            return _exec_with_secret(args, env, self._stdout, self._stderr, report_fd)
        return real_popen(self, args, env)

    subprocess_handler.SubprocessHandler._popen = _popen


def _exec_with_secret(args, env: dict, stdout, stderr, report_fd: int):
    """torch's ``Popen`` of a worker (a session of its own), which also holds, on a pipe only it gets, a number
    drawn for it alone (the probe reads it before the script runs, :data:`SECRET_FD`); its pid, RANK and that
    number are said on ``report_fd``, as a reporting zygote says them."""
    import subprocess

    from course.sandbox.zygote import draw_secret, say_fork

    secret = draw_secret()
    read, write = os.pipe()
    os.write(write, str(secret).encode())
    os.close(write)
    try:
        proc = subprocess.Popen(args=args, env={**env, SECRET_FD: str(read)}, stdout=stdout, stderr=stderr,
                                start_new_session=True, pass_fds=(read,))
    finally:
        os.close(read)
    say_fork(report_fd, proc.pid, env, secret)
    return proc


def start_zygote():
    """``(zygote, report_fd)``: a zygote with the workers' import-time environment, or None where zygotes are off
    or cannot start; the launcher's report pipe where this agent keeps it (no zygote), else None.

    The launcher's end of a pipe, named by :data:`REPORT_FD`, goes to the zygote alone (this agent closes its
    copy): there the zygote says its pid and each worker's pid, RANK and secret, for the launcher, which cannot
    read a forked worker's RANK in /proc/PID/environ (that shows the zygote's environment). Without a zygote this
    agent keeps the pipe and says the same of the workers it exec's, having made itself undumpable (as a reporting
    zygote does: no process of its uid may then write on the pipe through /proc/PID/fd)."""
    from course.sandbox import zygote as zygotes

    named = os.environ.pop(REPORT_FD, "")
    report_fd = int(named) if named.isdigit() else None
    zygote = None
    try:
        if not zygotes.enabled():
            return None, _keep(report_fd)
        # what torch's local agent adds to every worker's environment and a worker's imports may read: the zygote
        # imports with it too (OMP_NUM_THREADS the launcher sets for the whole job)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        # this agent imports torch anyway: import the workers' modules here once and fork the zygote from this
        # process (about 1.1 CPU s less per agent than a zygote of its own Python), before any thread of torchrun's
        import importlib

        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - not preloaded: the zygote is then exec'd (Zygote's fork needs them all)
                pass
        try:
            zygote = zygotes.Zygote(PRELOAD, report_fd=report_fd, fork=True)
            return zygote, None
        except OSError as exc:
            print(f"[ddp-course] no zygote for the workers: {exc}", file=sys.stderr, flush=True)
            return None, _keep(report_fd)
    finally:
        if report_fd is not None and zygote is not None:
            os.close(report_fd)


def _keep(report_fd: int | None) -> int | None:
    """The report pipe this agent keeps (no zygote holds it), this agent made undumpable first."""
    if report_fd is not None:
        from course.proc import make_undumpable

        make_undumpable()
    return report_fd


def main() -> None:
    from course.launcher.torchrun.torchrun_probe import AGENT_PID

    os.environ[AGENT_PID] = str(os.getpid())
    zygote, report_fd = start_zygote()
    install(zygote, report_fd)
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    finally:
        if zygote is not None:
            zygote.close()


if __name__ == "__main__":
    main()
