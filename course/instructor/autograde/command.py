"""The ``ddp-course autograde`` verb: grade here on N workers (:mod:`~course.instructor.autograde.run`) or on a
Slurm cluster as one job array (:mod:`~course.instructor.autograde.slurm`); then the summary table."""

from __future__ import annotations

import click

from course.errors import PartlyDone
from course.instructor.autograde.records import summary_table
from course.instructor.autograde.run import default_jobs, run_autograde
from course.instructor.coursedir import Course, course_dir_option

#: options that only mean something with --slurm or --collect
_SLURM_ONLY = ("partition", "account", "time_limit", "cpus_per_task", "mem", "gpus_per_task", "per_task", "no_wait")


@click.command()
@click.argument("assignments", nargs=-1)
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=default_jobs(), show_default=True,
              help="Submissions graded at the same time (a positive integer).")
@click.option("--student", "students", multiple=True, help="Grade only this student (repeatable).")
@click.option("--force", is_flag=True, help="Grade again submissions that are already graded.")
@click.option("--timeout", type=float, default=None,
              help="Seconds one submission may take before it is stopped (default: the sum of its cells' limits + 120).")
@click.option("--slurm", is_flag=True,
              help="Grade on a Slurm cluster: the ungraded submissions as one job array, merged here as tasks end.")
@click.option("--partition", default=None, help="[--slurm] Slurm partition (default: the cluster's).")
@click.option("--account", default=None, help="[--slurm] Slurm account to charge.")
@click.option("--time", "time_limit", default=None,
              help="[--slurm] Time limit of each array task, in Slurm's format "
                   "(default: the sum of its submissions' --timeout + 4 min).")
@click.option("--cpus-per-task", type=click.IntRange(min=1), default=None,
              help="[--slurm] CPUs per task (default: the most ranks a check of the assignments starts, "
                   "at most a node's CPUs; 2 when no check says).")
@click.option("--mem", default=None, help="[--slurm] Memory per task, in Slurm's format (default: the sandbox's + 1 GiB).")
@click.option("--gpus-per-task", type=click.IntRange(min=0), default=0, help="[--slurm] GPUs per task (--gres=gpu:N).")
@click.option("--per-task", type=click.IntRange(min=1), default=1, show_default=True,
              help="[--slurm] Submissions each array task grades, one after the other.")
@click.option("--no-wait", is_flag=True, help="[--slurm] Submit and return; --collect merges the results later.")
@click.option("--collect", is_flag=True,
              help="Merge what finished Slurm array tasks graded and report the rest; submit nothing.")
@course_dir_option
def command(assignments, jobs, students, force, timeout, slurm, partition, account, time_limit, cpus_per_task, mem,
            gpus_per_task, per_task, no_wait, collect, course_dir):
    """Autograde every submission (of all or the named assignments) on nbgrader, N at a time, or on Slurm.

    Exit status: 0 every submission graded (or queued on Slurm), 1 a usage or input error (nothing graded),
    2 some submissions could not be graded (listed; ddp-course status says why).
    """
    from rich.console import Console

    given = {"partition": partition, "account": account, "time_limit": time_limit, "cpus_per_task": cpus_per_task,
             "mem": mem, "gpus_per_task": gpus_per_task, "per_task": per_task != 1 or None, "no_wait": no_wait}
    stray = [f"--{name.replace('_limit', '').replace('_', '-')}" for name in _SLURM_ONLY if given[name]]
    if stray and not slurm:
        raise click.UsageError(f"{', '.join(stray)}: only with --slurm")
    if slurm and collect:
        raise click.UsageError("--collect merges finished Slurm runs and submits nothing: drop --slurm, or --collect")
    course = Course.open(course_dir)
    console = Console()
    picked = course.pick_assignments(assignments)
    students = course.pick_students(students)
    if slurm or collect:
        from course.instructor.autograde.slurm import SlurmOptions, run_slurm

        options = SlurmOptions(partition=partition, account=account, time=time_limit, cpus_per_task=cpus_per_task,
                               mem=mem, gpus_per_task=gpus_per_task, per_task=per_task)
        run = run_slurm(course, picked, options=options, students=students, force=force, timeout=timeout,
                        wait=not no_wait, collect_only=collect, console=console)
    else:
        run = run_autograde(course, picked, jobs=jobs, students=students, force=force, timeout=timeout,
                            console=console)
    if not run.rows:
        console.print("no Slurm run to collect" if collect else
                      "nothing submitted yet: file submissions with ddp-course collect ZIP_OR_DIR")
        return
    console.print(summary_table(run.rows))
    bad = [r for r in run.rows if r.status in ("failed", "timeout")]
    if bad:
        console.print(f"[red]{len(bad)} submission(s) could not be graded; ddp-course status says why")
    for scheduler, merge in (("Slurm", "ddp-course autograde --collect"), ("Kubernetes", "ddp-course k8s-job --collect")):
        queued = [r for r in run.rows if r.status == "not graded" and r.reason.startswith(f"on {scheduler}")]
        if queued and not run.interrupted:
            console.print(f"{len(queued)} submission(s) on {scheduler}: {merge} merges what has finished")
    if run.interrupted:
        if slurm or collect:
            console.print("[yellow]stopped following: the array keeps running on Slurm; ddp-course autograde --collect "
                          "merges it later (scancel JOB stops it)")
        else:
            console.print("[yellow]interrupted: everything graded so far is saved; run ddp-course autograde again "
                          "for the rest")
        raise SystemExit(130)
    if bad:
        raise PartlyDone(f"{len(bad)} of {len(run.rows)} submission(s) could not be graded (listed above)")
    stopped = [r for r in run.rows if r.status == "interrupted"]  # a stop signal reached their workers, not this run
    if stopped:
        raise PartlyDone(f"{len(stopped)} of {len(run.rows)} submission(s) not graded: stopped before they were "
                         "(listed above); run ddp-course autograde again for them")
