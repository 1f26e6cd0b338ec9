"""Run a script under real torchrun and return what each worker did; nothing here knows a check or an exercise.

How it works: :func:`run_script` starts ``python -m torch.distributed.run`` (one agent, or several
joined by a c10d rendezvous) on :mod:`~course.launcher.torchrun.torchrun_probe`, which every
worker runs: it records what the worker really did (its environment, checkpoint writes and
renames, optimizer steps, ``destroy_process_group``, its collectives) and then runs the script as
``__main__``. While the job runs, the launcher's deadlock watch (:mod:`course.launcher.stall`)
reads the workers' collectives and stops a job that can no longer finish. The result is a
:class:`Run` of :class:`Worker` records (:mod:`~course.launcher.torchrun.runner`);
:mod:`~course.launcher.torchrun.elastic` runs a job whose nodes leave and join. The agents are forked from a
warm zygote of the launcher's (:mod:`~course.launcher.torchrun.agents`), and each forks its workers from one of
its own (:mod:`~course.launcher.torchrun.agent`), which gives each worker a secret it reports to the launcher
(``Run.forks``; a caller's ``prelude`` receives it in the worker before the script). Turning a run into
verdicts (why it did not finish, the root cause first) is the check API's: :mod:`course.checks.torchrun`.
"""

from course.launcher.torchrun.runner import (
    NODES_TIMEOUT,
    PROBE_SCRIPT,
    RESTART_TIMEOUT,
    Run,
    Scenario,
    Worker,
    run_script,
)

__all__ = [
    "NODES_TIMEOUT",
    "PROBE_SCRIPT",
    "RESTART_TIMEOUT",
    "Run",
    "Scenario",
    "Worker",
    "run_script",
]
