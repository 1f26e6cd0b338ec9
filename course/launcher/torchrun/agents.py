"""Starting torchrun's agents (:mod:`~course.launcher.torchrun.agent`) from a warm zygote of the launcher's.

Every torchrun launch starts one agent per node, and each agent is a fresh Python that imports torch and the
workers' modules (:data:`~course.launcher.torchrun.agent.PRELOAD`) before torchrun's own code runs: about 1.5 of
its 1.9 CPU seconds. The grader starts hundreds of agents in a day (the suite: about 140). So the launcher keeps
a zygote (:class:`course.sandbox.zygote.Zygote`) that has imported the agent's PRELOAD once, with the jobs'
import-time environment, and forks each agent from it: the agent runs ``course.launcher.torchrun.agent`` as
``__main__`` in the forked child, as the fresh interpreter would, with the launcher's environment, working
folder, streams, the report pipe's end under its own number and a session of its own. The agent then forks its
workers' zygote from itself, as before (it has everything imported: the zygote's own condition for a fork).

What changes for the launcher: an agent is the zygote's child, not the launcher's; :func:`start` returns a
``Popen`` look-alike (pid, poll, wait, returncode). It gets SIGKILL when the zygote ends, and the zygote ends
when this process is gone (``PR_SET_PDEATHSIG`` and the zygote's channel): the same "never outlive the
launcher" as :func:`course.proc.dies_with_caller`. The agent's imports are the same as an exec'd agent's (only
PRELOAD: torch.distributed.run is imported by the agent after it forked its workers' zygote, as before, so
the workers' zygote holds the same modules either way). ``DDP_COURSE_ZYGOTE=0``, a command that is not the
agent module, or a zygote that cannot start or answer: the agent is exec'd as before.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from course.proc import dies_with_caller

_lock = threading.Lock()
#: this process's agent zygotes, by the import-time environment they imported with (the agent's must match)
_zygotes: dict[tuple, object] = {}
_MODULE = "course.launcher.torchrun.agent"


def _zygote_for(env: dict):
    """This process's agent zygote for ``env``'s import-time environment (started on first use), or None."""
    from course.sandbox import zygote as zygotes

    if not zygotes.enabled():
        return None
    from course.launcher.torchrun.agent import PRELOAD

    key = tuple(sorted(zygotes._import_time_env(env).items()))
    with _lock:
        z = _zygotes.get(key)
        if z is not None and z.alive():
            return z
        clean = {k: v for k, v in env.items() if not k.startswith(("DDP_COURSE_PROBE_", "DDP_COURSE_AGENT_"))}
        try:
            z = zygotes.Zygote(PRELOAD, env=clean)
        except OSError as exc:
            print(f"[ddp-course] no zygote for torchrun's agents: {exc}", file=sys.stderr, flush=True)
            return None
        _zygotes[key] = z
        return z


def start(cmd: list[str], *, cwd: str, env: dict, stdout, pass_fds=()) -> object:
    """Start torchrun's agent ``cmd`` (``python -s -P -m course.launcher.torchrun.agent ARGS``) in a session of its
    own, stdin /dev/null, stdout and stderr to ``stdout``: forked from the agent zygote where it can be, else
    exec'd (:func:`course.proc.dies_with_caller`); either way it ends when this process does."""
    forkable = _MODULE in cmd and cmd[0] == sys.executable
    z = _zygote_for(env) if forkable else None
    if z is not None:
        try:
            return z.popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stdout,
                           pass_fds=pass_fds, deathsig=signal.SIGKILL)
        except OSError as exc:  # the zygote could not start it: exec it
            print(f"[ddp-course] torchrun agent exec'd, not forked: {exc}", file=sys.stderr, flush=True)
    return subprocess.Popen(dies_with_caller(cmd), cwd=cwd, env=env, pass_fds=pass_fds, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)

