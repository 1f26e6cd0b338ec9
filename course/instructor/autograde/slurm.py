"""``ddp-course autograde --slurm``: the Slurm client that runs a batch run's tasks as one job array.

The command plans as a local run does (:func:`~course.instructor.autograde.run.plan`: graded and held
submissions are skipped), prepares the run (:func:`~course.instructor.autograde.batch.prepare_run`), writes
its manifest and a batch script beside it and submits ONE array: array task i is the batch run's task i,
``python -m course.instructor.autograde.batch task MANIFEST $SLURM_ARRAY_TASK_ID``. While it follows the
array, or later with ``--collect``, this process merges each outcome a task wrote
(:func:`~course.instructor.autograde.batch.collect_run`). A submission whose task ended without its outcome
(time limit, out of memory, node failure, scancel) stays ungraded and is reported with the task's state;
the next run submits it again.

The course folder and the Python environment must be at the same paths on the compute nodes (a shared
filesystem), as on any cluster where jobs read their inputs from home or project space.
Slurm is asked with ``squeue`` (live tasks), then ``scontrol show job`` (finished ones, kept
MinJobAge seconds), ``sacct`` (clusters with accounting) or a ``jobcomp/filetxt`` log.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from course.errors import CourseError
from course.instructor.autograde.batch import (
    DEFAULT_CPUS,
    MEMORY_MARGIN_MIB,
    TASK_MARGIN,
    Manifest,
    Unfinished,
    collect_run,
    largest_world_size,
    log_folder,
    not_yet,
    pending_runs,
    prepare_run,
    sandbox_memory_mib,
    set_aside,
)
from course.instructor.autograde.config import isolation_line
from course.instructor.autograde.guards import course_lock, sigterm_as_interrupt
from course.instructor.autograde.records import Row, Submission, fill_scores
from course.instructor.autograde.run import AutogradeRun, check_released, plan
from course.instructor.coursedir import Course

POLL = 2.0  # seconds between looks at the queue (squeue is cheap, but it is the cluster's controller)
#: Slurm job states of a task that has not ended (squeue lists these)
LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
        "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
_TOOLS = ("sbatch", "squeue", "scontrol")


@dataclass
class SlurmOptions:
    """What each array task asks Slurm for; None: this module's default (see :func:`submit`)."""

    partition: str | None = None
    account: str | None = None
    #: per task, in Slurm's format ("30", "1:00:00", "1-00:00:00")
    time: str | None = None
    cpus_per_task: int | None = None
    #: per task, in Slurm's format ("4G", "4096")
    mem: str | None = None
    gpus_per_task: int = 0
    #: submissions each task grades, one after the other
    per_task: int = 1


@dataclass
class TaskState:
    """One array task as Slurm reports it."""

    index: int
    #: Slurm's job state: PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, CANCELLED, OUT_OF_MEMORY, NODE_FAIL, ...
    state: str
    reason: str = ""
    exit_code: str = ""
    submitted: datetime | None = None
    started: datetime | None = None
    ended: datetime | None = None

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def waited(self) -> float | None:
        """Seconds from submission to start."""
        if self.submitted is None or self.started is None:
            return None
        return (self.started - self.submitted).total_seconds()

    def describe(self) -> str:
        said = self.state
        if self.state == "FAILED" and self.exit_code:
            said += f" (exit code {self.exit_code})"
        elif self.reason and self.reason not in ("None", "NonZeroExitCode"):
            said += f" ({self.reason})"
        return said


# -- the pure parts: tasks, limits, the batch script, what Slurm prints ---------------------------------------


def slurm_time(seconds: float) -> str:
    """A time limit in Slurm's format, rounded up to the minute: ``HH:MM:SS`` or ``D-HH:MM:SS``."""
    minutes = max(1, math.ceil(seconds / 60))
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours:02d}:{minutes:02d}:00"


def _quote(value: str) -> str:
    """A value on an ``#SBATCH`` line (sbatch reads double quotes there)."""
    if re.fullmatch(r"[\w@%+=:,./-]+", value):
        return value
    if '"' in value or "\n" in value:
        raise CourseError(f"cannot pass {value!r} to sbatch: no double quotes or new lines in paths and options")
    return f'"{value}"'


def batch_script(manifest: Manifest, *, time_limit: str, mem: str, options: SlurmOptions, log_dir: Path,
                 python: str, job_name: str) -> str:
    """The array job's batch script: every request as an ``#SBATCH`` line, then the task's one command."""
    import shlex

    lines = [
        "#!/bin/bash",
        f"# ddp-course autograde --slurm, run {manifest.run}: array task i grades task i's share of the",
        f"# submissions in {manifest.path.name} (the command that submitted it merges the results).",
        f"#SBATCH --job-name={_quote(job_name)}",
        f"#SBATCH --array=0-{len(manifest.tasks) - 1}",
        f"#SBATCH --cpus-per-task={manifest.cpus_per_task}",
        f"#SBATCH --mem={_quote(mem)}",
        f"#SBATCH --time={_quote(time_limit)}",
        f"#SBATCH --chdir={_quote(manifest.course)}",
        f"#SBATCH --output={_quote(str(log_dir / 'task-%a.out'))}",
    ]
    if options.partition:
        lines.append(f"#SBATCH --partition={_quote(options.partition)}")
    if options.account:
        lines.append(f"#SBATCH --account={_quote(options.account)}")
    if options.gpus_per_task:
        lines.append(f"#SBATCH --gres=gpu:{int(options.gpus_per_task)}")
    lines.append(f'exec {shlex.quote(python)} -m course.instructor.autograde.batch task '
                 f'{shlex.quote(str(manifest.path))} "$SLURM_ARRAY_TASK_ID"')
    return "\n".join(lines) + "\n"


def _indices(spec: str) -> list[int]:
    """Array task indices of ``3``, ``[0-3,7]`` or ``4-7%2`` (a throttle after ``%``)."""
    found = []
    for part in spec.strip("[]").split("%")[0].split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        found += list(range(int(low), int(high or low) + 1))
    return found


def parse_squeue(text: str, job_id: str) -> dict[int, TaskState]:
    """Live tasks of array ``job_id`` from ``squeue --array --noheader --format=%i|%T|%r``."""
    found = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or "_" not in parts[0]:
            continue
        job, _, spec = parts[0].partition("_")
        if job != job_id:
            continue
        for index in _indices(spec):
            found[index] = TaskState(index, parts[1].strip(), parts[2].strip() if len(parts) > 2 else "")
    return found


def _fields(line: str) -> dict[str, str]:
    """``Key=value Key2=a value with spaces`` (scontrol -o, jobcomp/filetxt) as a dict."""
    found = {}
    for token in re.split(r"\s+(?=[A-Za-z][\w/:]*=)", line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            found[key] = value
    return found


def _when(value: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if value and value not in ("Unknown", "None", "N/A") else None
    except ValueError:
        return None


def parse_records(text: str, job_id: str) -> dict[int, TaskState]:
    """Tasks of array ``job_id`` from ``scontrol -o show job`` or a jobcomp/filetxt log: one record a line.
    A record of tasks not started yet (``ArrayTaskId=2-5``) is skipped: squeue lists those."""
    found = {}
    for line in text.splitlines():
        record = _fields(line)
        task = record.get("ArrayTaskId", "")
        if record.get("ArrayJobId") != job_id or not task.isdigit():
            continue
        state = record.get("JobState", "UNKNOWN").split()[0]
        found[int(task)] = TaskState(int(task), state, record.get("Reason", ""), record.get("ExitCode", ""),
                                     _when(record.get("SubmitTime")), _when(record.get("StartTime")),
                                     _when(record.get("EndTime")))
    return found


def parse_sacct(text: str, job_id: str) -> dict[int, TaskState]:
    """Tasks of array ``job_id`` from ``sacct -n -P -X --format=JobID,State,ExitCode,Submit,Start,End``."""
    found = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0].startswith(f"{job_id}_") or "." in parts[0]:
            continue
        spec = parts[0].partition("_")[2]
        state = parts[1].split()[0] if parts[1] else "UNKNOWN"  # "CANCELLED by 0"
        times = [_when(p) for p in (parts[3:6] + [None, None, None])[:3]]
        for index in _indices(spec):
            found[index] = TaskState(index, state, "", parts[2], *times)
    return found


# -- asking Slurm ---------------------------------------------------------------------------------------------


def _slurm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def _require_tools() -> None:
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise CourseError(f"--slurm needs Slurm's {', '.join(missing)} on PATH: run ddp-course on a machine "
                          f"that submits jobs to the cluster (a login node)")


def live_tasks(job_id: str) -> dict[int, TaskState] | None:
    """The array's tasks that have not ended; None when squeue could not say (ask again later)."""
    try:
        proc = _slurm("squeue", "--array", "--noheader", f"--jobs={job_id}", "--format=%i|%T|%r")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        # a job slurmctld has forgotten (every task ended more than MinJobAge ago) is no error here
        return {} if "Invalid job id" in proc.stderr else None
    return parse_squeue(proc.stdout, job_id)


def _jobcomp_log() -> Path | None:
    """The jobcomp/filetxt log, where this cluster keeps one and it is readable here."""
    try:
        proc = _slurm("scontrol", "show", "config")
    except (OSError, subprocess.TimeoutExpired):
        return None
    config = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", proc.stdout, flags=re.M))
    path = Path(config.get("JobCompLoc", ""))
    return path if config.get("JobCompType") == "jobcomp/filetxt" and path.is_file() else None


def _scontrol_states(job_id: str) -> dict[int, TaskState]:
    return parse_records(_slurm("scontrol", "-o", "show", "job", job_id).stdout, job_id)


def _sacct_states(job_id: str) -> dict[int, TaskState]:
    fields = "--format=JobID,State,ExitCode,Submit,Start,End"
    return parse_sacct(_slurm("sacct", "-n", "-P", "-X", "-j", job_id, fields).stdout, job_id)


def _jobcomp_states(job_id: str) -> dict[int, TaskState]:
    log = _jobcomp_log()
    return parse_records(log.read_text(errors="replace"), job_id) if log else {}


def ended_states(job_id: str, wanted: set[int]) -> dict[int, TaskState]:
    """How the tasks ``wanted`` ended: scontrol, else sacct, else the jobcomp log; UNKNOWN where none says."""
    found: dict[int, TaskState] = {}
    for source in (_scontrol_states, _sacct_states, _jobcomp_states):
        if wanted <= set(found):
            break
        try:
            found = {**source(job_id), **found}
        except (OSError, subprocess.TimeoutExpired):
            continue
    return {i: found.get(i, TaskState(i, "UNKNOWN", "Slurm no longer knows this task")) for i in wanted}


def node_cpus(partition: str | None) -> int | None:
    """The most CPUs a node of ``partition`` (default: the default one) has, or None."""
    args = ["sinfo", "--noheader", "--format=%c"] + ([f"--partition={partition}"] if partition else [])
    try:
        text = _slurm(*args).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(m) for m in re.findall(r"\d+", text)]
    return max(counts) if counts else None


# -- submitting -------------------------------------------------------------------------------------------


def submit(course: Course, todo: list[Submission], options: SlurmOptions, *, timeout: float | None,
           console) -> Manifest:
    """Prepare the scratch courses of ``todo``, write the manifest and the batch script, sbatch the array."""
    cpus = options.cpus_per_task
    if cpus is None:  # one core per rank of the largest job a check starts, as far as one node has cores
        cpus = largest_world_size(course, sorted({s.assignment for s in todo})) or DEFAULT_CPUS
        cpus = min(cpus, node_cpus(options.partition) or cpus)
    run = datetime.now().strftime("%Y%m%d-%H%M%S-") + str(os.getpid())
    manifest = prepare_run(course, todo, run, per_task=options.per_task, cpus=cpus, timeout=timeout)
    tasks = manifest.tasks
    try:
        time_limit = options.time or slurm_time(manifest.longest_task() + TASK_MARGIN)
        mem = options.mem or f"{sandbox_memory_mib(course) + MEMORY_MARGIN_MIB}M"
        logs = log_folder(course, run)
        logs.mkdir(parents=True, exist_ok=True)
        script = manifest.folder / "batch.sh"
        script.write_text(batch_script(manifest, time_limit=time_limit, mem=mem, options=options, log_dir=logs,
                                       python=sys.executable, job_name=f"ddp-autograde-{course.course_id}"))
        manifest.save()
        proc = _slurm("sbatch", "--parsable", str(script), timeout=120)
        if proc.returncode != 0:
            raise CourseError(f"sbatch refused the array: {proc.stderr.strip() or proc.stdout.strip()}")
    except BaseException:
        shutil.rmtree(manifest.folder, ignore_errors=True)
        shutil.rmtree(log_folder(course, run), ignore_errors=True)
        raise
    manifest.job_id = proc.stdout.strip().split(";")[0]
    manifest.save()
    per = f"{options.per_task} submissions each" if options.per_task > 1 else "1 submission each"
    console.print(f"submitted Slurm job {manifest.job_id}: {len(tasks)} array tasks ({per}), "
                  f"{manifest.cpus_per_task} CPUs, {mem} memory, {time_limit} each"
                  + (f", {options.gpus_per_task} GPUs" if options.gpus_per_task else "")
                  + (f", partition {options.partition}" if options.partition else ""), highlight=False)
    return manifest


# -- following and merging -------------------------------------------------------------------------------------


def collect(course: Course, manifest: Manifest, live: dict[int, TaskState] | None) -> list[Row]:
    """Merge what the run's tasks have written (:func:`~course.instructor.autograde.batch.collect_run`); the
    tasks Slurm no longer lists ended, so what they left without an outcome is reported with the state Slurm
    gives. ``live``: the tasks not ended (None: unknown, so no task is taken as ended)."""
    ended = {i for i in range(len(manifest.tasks)) if i not in manifest.collected and live is not None
             and i not in live}
    states = ended_states(manifest.job_id, ended) if ended and manifest.job_id else {}
    unfinished = {}
    for index in ended:
        state = states.get(index) or TaskState(index, "UNKNOWN", "sbatch never said it took the array")
        if state.waited is not None:
            manifest.waited[str(index)] = state.waited
        unfinished[index] = Unfinished(
            "timeout" if state.state in ("TIMEOUT", "DEADLINE") else "failed",
            f"Slurm task {manifest.label(index)} ended {state.describe()} before grading it; "
            f"run ddp-course autograde --slurm again",
            log_folder(course, manifest.run) / f"task-{index}.out")
    return collect_run(course, manifest, unfinished)


def _counts(manifests: list[Manifest], live: dict[str, dict[int, TaskState] | None]) -> str:
    queued = running = done = failed = 0
    for m in manifests:
        tasks = live.get(m.run) or {}
        queued += sum(1 for t in tasks.values() if t.state == "PENDING")
        running += sum(1 for t in tasks.values() if t.state != "PENDING")
        failed += len(set(m.failed))
        done += len(set(m.collected)) - len(set(m.failed))
    jobs = ", ".join(m.job_id or "?" for m in manifests)
    return f"Slurm job {jobs}: {queued} queued, {running} running, {done} done, {failed} failed"


def follow(course: Course, manifests: list[Manifest], rows: list[Row], console, *, wait: bool) -> list[Manifest]:
    """Merge what the runs' tasks finish into the gradebook, a row each onto ``rows`` (until every task
    ended, with ``wait``; else what is there now). The runs not collected yet."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    total = sum(len(share) for m in manifests for i, share in enumerate(m.tasks) if i not in m.collected)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=not wait, disable=not wait) as progress:
        bar = progress.add_task("Slurm", total=total)
        while manifests:
            live = {}
            for manifest in list(manifests):
                # no job id: the command that made the run stopped before sbatch answered; nothing is taken as live
                live[manifest.run] = live_tasks(manifest.job_id) if manifest.job_id else {}
                for row in collect(course, manifest, live[manifest.run]):
                    rows.append(row)
                    progress.advance(bar)
                    score = f" {row.score:g}/{row.max_score:g}" if row.score is not None else ""
                    elapsed = f" ({row.elapsed:.0f} s)" if row.elapsed is not None else ""
                    progress.console.print(f"{row.status:>8}  {row.submission}{score}{elapsed} {row.reason}".rstrip(),
                                           highlight=False)
            progress.update(bar, description=_counts(manifests, live))
            manifests = [m for m in manifests if not m.done]
            if not wait:
                break
            if manifests:
                time.sleep(POLL)
    return manifests


def queue_wait_line(manifests: list[Manifest]) -> str | None:
    """How long the runs' tasks waited from submission to start, for the end of a run."""
    waits = [w for m in manifests for w in m.waited.values()]
    if not waits:
        return None
    return (f"Slurm: {len(waits)} tasks waited {min(waits):.0f}-{max(waits):.0f} s from submission to start "
            f"(median {statistics.median(waits):.0f} s)")


def run_slurm(course: Course, assignments: list[str], *, options: SlurmOptions, students: tuple[str, ...] = (),
              force: bool = False, timeout: float | None = None, wait: bool = True, collect_only: bool = False,
              console=None) -> AutogradeRun:
    """Merge what earlier runs finished; then (unless ``collect_only``) submit every submission not graded
    and not on Slurm already as one array and, with ``wait``, follow it to the end."""
    from rich.console import Console

    console = console or Console()
    with course_lock(course):
        earlier = pending_runs(course)
        rows: list[Row] = []
        still = follow(course, earlier, rows, console, wait=False)
        if collect_only:
            rows += not_yet(course)
            return AutogradeRun([fill_scores(course, r) for r in rows])
        _require_tools()
        todo, done = plan(course, assignments, students, force)
        rows += done
        todo = set_aside(course, todo, rows)
        if todo:
            check_released(course, todo)
            console.print(isolation_line(course), highlight=False)
            still.append(submit(course, todo, options, timeout=timeout, console=console))
        if not wait:
            rows += not_yet(course, todo)
            return AutogradeRun([fill_scores(course, r) for r in rows])
        followed = list(still)
        try:
            with sigterm_as_interrupt():
                follow(course, still, rows, console, wait=True)
        except KeyboardInterrupt:
            rows += not_yet(course)
            return AutogradeRun([fill_scores(course, r) for r in rows], interrupted=True)
        line = queue_wait_line(followed)
        if line:
            console.print(line, highlight=False)
        return AutogradeRun([fill_scores(course, r) for r in rows])


if __name__ == "__main__":
    # Kubernetes Jobs written before batch.py existed run each pod's task as `-m course.instructor.autograde.slurm task`
    from course.instructor.autograde.batch import main

    sys.exit(main(sys.argv[1:]))
