"""``ddp-course autograde --slurm``: grade the submissions as one Slurm job array; merge the results here.

The command plans as a local run does (:func:`~course.instructor.autograde.run.plan`: graded
submissions are skipped), prepares each submission's scratch course in a run folder,
``.ddp-course/slurm/<run>/``, writes a manifest and a batch script there, and submits ONE array.
Array task i grades its share of the submissions one at a time on a one-worker pool
(:mod:`~course.instructor.autograde.pool`, :mod:`~course.instructor.autograde.worker`: the same
code, sandbox and per-submission deadline as ``--jobs N``) and writes each outcome as JSON beside
its scratch course. A task never opens the real gradebook: this process merges each outcome, one at
a time, with run.py's own ``_finish`` (install_results / merge_submission), while it follows the
array or later with ``--collect``. A submission whose task ended without its outcome (time limit,
out of memory, node failure, scancel) stays ungraded and is reported with the task's state; the
next run submits it again.

The course folder and the Python environment must be at the same paths on the compute nodes (a
shared filesystem), as on any cluster where jobs read their inputs from home or project space.
Slurm is asked with ``squeue`` (live tasks), then ``scontrol show job`` (finished ones, kept
MinJobAge seconds), ``sacct`` (clusters with accounting) or a ``jobcomp/filetxt`` log.

Run as ``python -m course.instructor.autograde.slurm task MANIFEST INDEX``, this module is an array task.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from course.errors import CourseError
from course.instructor.autograde.pool import _READY_TIMEOUT, Outcome
from course.instructor.autograde.records import Row, Submission, fill_scores, write_record
from course.instructor.autograde.run import (
    AutogradeRun,
    _course_lock,
    _deferred_interrupts,
    _finish,
    _sigterm_as_interrupt,
    check_released,
    isolation_line,
    plan,
    submission_timeout,
)
from course.instructor.autograde.scratch import prepare_scratch, scratch_course
from course.instructor.coursedir import STATE_DIR, Course
from course.instructor.gradebook import make_template

POLL = 2.0  # seconds between looks at the queue (squeue is cheap, but it is the cluster's controller)
#: what a task may take beyond its submissions' limits: Python and nbgrader imports, the worker's first start
TASK_MARGIN = 60.0 + _READY_TIMEOUT
#: CPUs per task when no check call of the assignments names its world size (the course's checks default to 2-3 ranks)
DEFAULT_CPUS = 2
#: memory per task beyond the sandbox's: nbgrader, the worker and the verifier's parent process
MEMORY_MARGIN_MIB = 1024
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


@dataclass
class Manifest:
    """What one run submitted (its ``manifest.json``): the course, the job, each task's share of the submissions."""

    course: str
    run: str
    #: per task: [{"assignment", "student", "timeout"}, ...]
    tasks: list[list[dict]]
    cpus_per_task: int
    job_id: str | None = None
    #: tasks whose every submission is merged or reported
    collected: list[int] = field(default_factory=list)
    #: tasks that ended without an outcome for some submission
    failed: list[int] = field(default_factory=list)
    #: seconds each task waited from submission to start, by task index (as a string: JSON keys)
    waited: dict[str, float] = field(default_factory=dict)

    @property
    def folder(self) -> Path:
        return Path(self.course) / STATE_DIR / "slurm" / self.run

    @property
    def path(self) -> Path:
        return self.folder / "manifest.json"

    def share(self, index: int) -> list[tuple[Submission, float]]:
        """The submissions of task ``index`` and each one's time limit (seconds)."""
        return [(Submission(e["assignment"], e["student"]), float(e["timeout"])) for e in self.tasks[index]]

    def label(self, index: int) -> str:
        return f"{self.job_id or '?'}_{index}"

    @property
    def done(self) -> bool:
        return len(set(self.collected)) == len(self.tasks)

    def longest_task(self) -> float:
        """Seconds the longest task may take: the sum of its submissions' time limits, the largest share."""
        return max(sum(float(e["timeout"]) for e in share) for share in self.tasks)

    def save(self, path: Path | None = None) -> None:
        """Write the manifest (whole, or not at all) to ``path``, by default :attr:`path`."""
        path = path or self.path
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> Manifest:
        return cls(**json.loads(Path(path).read_text()))


# -- the pure parts: tasks, limits, the batch script, what Slurm prints ---------------------------------------


def split(todo: list[Submission], per_task: int) -> list[list[Submission]]:
    """The submissions in tasks of ``per_task``, in order."""
    per_task = max(1, per_task)
    return [todo[i:i + per_task] for i in range(0, len(todo), per_task)]


def slurm_time(seconds: float) -> str:
    """A time limit in Slurm's format, rounded up to the minute: ``HH:MM:SS`` or ``D-HH:MM:SS``."""
    minutes = max(1, math.ceil(seconds / 60))
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours:02d}:{minutes:02d}:00"


def largest_world_size(course: Course, assignments: list[str]) -> int | None:
    """The most ranks any check call of these assignments' test cells asks for (``world_size=N`` or
    ``world_sizes=(...)``, hidden tests included), read from the source notebooks; None when none says."""
    import nbformat

    from course.grading import checkcalls

    sizes = []
    for assignment in assignments:
        for path in course.folder("source", assignment=assignment).glob("*.ipynb"):
            for cell in nbformat.read(str(path), as_version=4).cells:
                if cell.cell_type != "code" or not cell.metadata.get("nbgrader", {}).get("grade"):
                    continue
                for call in checkcalls.parse(cell.source) or []:
                    for name, (kind, value) in call.kwargs:
                        if kind != "value":
                            continue
                        if name == "world_size" and isinstance(value, int):
                            sizes.append(value)
                        elif name == "world_sizes" and isinstance(value, (tuple, list)):
                            sizes += [v for v in value if isinstance(v, int)]
    return max(sizes) if sizes else None


def sandbox_memory_mib(course: Course) -> int:
    """The memory one submission's sandbox may use (the course's SandboxKernelManager.memory_limit), in MiB."""
    from course.sandbox.limits import Limits, MiB

    limit = course.config.SandboxKernelManager.get("memory_limit", Limits.memory)
    return math.ceil(int(limit) / MiB)


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
    lines.append(f'exec {shlex.quote(python)} -m course.instructor.autograde.slurm task '
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


def slurm_root(course: Course) -> Path:
    """Where each run keeps its manifest, batch script, template gradebook and the tasks' scratch courses
    (see :attr:`Manifest.folder`)."""
    return course.state_dir / "slurm"


def task_folder(manifest: Manifest, index: int) -> Path:
    return manifest.folder / f"task-{index}"


def log_folder(course: Course, run: str) -> Path:
    """Slurm's output of each task; kept after the run is collected (ddp-course status points at it)."""
    return course.state_dir / "logs" / "slurm" / run


def _outcome_path(manifest: Manifest, index: int, submission: Submission) -> Path:
    return task_folder(manifest, index) / f"{submission.assignment}--{submission.student}.json"


def prepare_run(course: Course, todo: list[Submission], run: str, *, per_task: int, cpus: int,
                timeout: float | None, job_id: str | None = None) -> Manifest:
    """A run's folder, ``.ddp-course/slurm/<run>/``, for ``todo`` in shares of ``per_task``: the template
    gradebook and each submission's scratch course in its task's folder; the Manifest (not saved yet).
    A Slurm run and a Kubernetes Job (:mod:`course.instructor.k8s`) both start here. Nothing is left
    behind when it fails."""
    assignments = sorted({s.assignment for s in todo})
    limits = {a: timeout or submission_timeout(course, a) for a in assignments}
    tasks = split(todo, per_task)
    manifest = Manifest(str(course.root), run, [[{"assignment": s.assignment, "student": s.student,
                                                  "timeout": limits[s.assignment]} for s in share] for share in tasks],
                        max(1, cpus), job_id=job_id)
    manifest.folder.mkdir(parents=True)
    try:
        template = manifest.folder / "template.db"
        make_template(course.db_url, course.course_id, assignments, template,
                      [(s.assignment, s.student) for s in todo])
        for index, share in enumerate(tasks):
            for submission in share:
                prepare_scratch(course, submission, template, under=task_folder(manifest, index))
    except BaseException:
        shutil.rmtree(manifest.folder, ignore_errors=True)
        raise
    return manifest


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


#: a Kubernetes run's manifest (course.instructor.k8s), in a run folder of its own beside Slurm's
K8S_MANIFEST = "k8s-job.json"


def manifests(course: Course, name: str = "manifest.json") -> list[tuple[Path, Manifest]]:
    """(path, Manifest) of every run folder holding ``name`` (Slurm's runs; K8S_MANIFEST: Kubernetes'), oldest first."""
    found = []
    for path in sorted(slurm_root(course).glob(f"*/{name}")):
        try:
            found.append((path, Manifest.read(path)))
        except (OSError, ValueError, TypeError):
            continue
    return found


def pending_runs(course: Course) -> list[Manifest]:
    """Slurm runs not fully collected yet, oldest first."""
    return [m for _, m in manifests(course) if not m.done]


def held(course: Course, manifest: Manifest) -> list[tuple[int, Submission]]:
    """(task index, submission) of a run's submissions neither merged nor reported yet (their scratch course
    is still there)."""
    return [(index, submission) for index in range(len(manifest.tasks)) if index not in manifest.collected
            for submission, _ in manifest.share(index)
            if scratch_course(course, submission, task_folder(manifest, index)).root.exists()]


@dataclass(frozen=True)
class Held:
    """Where a scheduler's run holds a submission, and what merges it; ``str()``: the reason a row gives."""

    scheduler: str  # "Slurm" | "Kubernetes"
    place: str  # "task 123_4" | "job NAME, pod I"
    merge: str

    def __str__(self) -> str:
        return f"on {self.scheduler} ({self.place}): {self.merge}"


def on_slurm(manifest: Manifest, index: int) -> Held:
    return Held("Slurm", f"task {manifest.label(index)}", "ddp-course autograde --collect merges it")


def on_kubernetes(manifest: Manifest, index: int) -> Held:
    return Held("Kubernetes", f"job {manifest.job_id}, pod {index}",
                "ddp-course k8s-job --collect merges it once its pod has graded it")


def elsewhere(course: Course) -> dict[Submission, Held]:
    """Each submission a Slurm or Kubernetes run holds, and where. Every verb that plans grading leaves
    these alone (their run's result would replace its own)."""
    found = {s: on_slurm(m, i) for m in pending_runs(course) for i, s in held(course, m)}
    for _, manifest in manifests(course, K8S_MANIFEST):
        found.update({s: on_kubernetes(manifest, i) for i, s in held(course, manifest)})
    return found


def _tail(path: Path, lines: int = 200) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def collect_run(course: Course, manifest: Manifest, live: dict[int, TaskState] | None) -> list[Row]:
    """Merge every outcome the run's tasks have written; report the submissions of tasks that ended
    without theirs. ``live``: the tasks not ended (None: unknown, so no task is taken as ended)."""
    rows: list[Row] = []
    ended = {i for i in range(len(manifest.tasks)) if i not in manifest.collected and live is not None
             and i not in live}
    states = ended_states(manifest.job_id, ended) if ended and manifest.job_id else {}
    for index in range(len(manifest.tasks)):
        if index in manifest.collected:
            continue
        folder = task_folder(manifest, index)
        for submission, _ in manifest.share(index):
            scratch = scratch_course(course, submission, folder)
            outcome_file = _outcome_path(manifest, index, submission)
            with _deferred_interrupts():  # a Ctrl-C waits until this submission is merged or reported
                if outcome_file.is_file():
                    saved = json.loads(outcome_file.read_text())
                    outcome = Outcome(submission, saved["result"], saved["kind"], saved["elapsed"], saved["detail"])
                    rows.append(_finish(course, outcome, scratch, isolation=saved.get("isolation", "")))
                    outcome_file.unlink()
                elif index in ended and scratch.root.exists():
                    state = states.get(index) or TaskState(index, "UNKNOWN", "sbatch never said it took the array")
                    status = "timeout" if state.state in ("TIMEOUT", "DEADLINE") else "failed"
                    reason = (f"Slurm task {manifest.label(index)} ended {state.describe()} before grading it; "
                              f"run ddp-course autograde --slurm again")
                    log = log_folder(course, manifest.run) / f"task-{index}.out"
                    write_record(course, submission, status, None, reason, _tail(log))
                    shutil.rmtree(scratch.root, ignore_errors=True)
                    rows.append(Row(submission, status, reason=reason))
                    if index not in manifest.failed:
                        manifest.failed.append(index)
        if index in ended:
            state = states.get(index)
            if state is not None and state.waited is not None:
                manifest.waited[str(index)] = state.waited
            manifest.collected.append(index)
            manifest.save()
    if manifest.done:
        shutil.rmtree(manifest.folder, ignore_errors=True)
    return rows


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
                for row in collect_run(course, manifest, live[manifest.run]):
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
    with _course_lock(course):
        earlier = pending_runs(course)
        rows: list[Row] = []
        still = follow(course, earlier, rows, console, wait=False)
        if collect_only:
            rows += _not_yet(course)
            return AutogradeRun([fill_scores(course, r) for r in rows])
        _require_tools()
        flying = elsewhere(course)
        todo, done = plan(course, assignments, students, force)
        rows += done
        rows += _not_yet(course, [s for s in todo if s in flying])
        todo = [s for s in todo if s not in flying]
        if todo:
            check_released(course, todo)
            console.print(isolation_line(course), highlight=False)
            still.append(submit(course, todo, options, timeout=timeout, console=console))
        if not wait:
            rows += _not_yet(course, todo)
            return AutogradeRun([fill_scores(course, r) for r in rows])
        followed = list(still)
        try:
            with _sigterm_as_interrupt():
                follow(course, still, rows, console, wait=True)
        except KeyboardInterrupt:
            rows += _not_yet(course)
            return AutogradeRun([fill_scores(course, r) for r in rows], interrupted=True)
        line = queue_wait_line(followed)
        if line:
            console.print(line, highlight=False)
        return AutogradeRun([fill_scores(course, r) for r in rows])


def _not_yet(course: Course, only: list[Submission] | None = None) -> list[Row]:
    """A row for each submission still on Slurm or Kubernetes (of ``only``, when given)."""
    return [Row(s, "not graded", reason=str(where)) for s, where in sorted(elsewhere(course).items())
            if only is None or s in only]


# -- one array task -----------------------------------------------------------------------------------------------


def _write_outcome(path: Path, outcome: Outcome, isolation: str = "") -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kind": outcome.kind, "result": outcome.result, "elapsed": outcome.elapsed,
                               "detail": outcome.detail, "isolation": isolation}, default=str))
    os.replace(tmp, path)  # the parent merges only whole outcomes


def run_task(manifest_path: Path, index: int) -> int:
    """Grade task ``index``'s share, one submission at a time, each in its scratch course, as a ``--jobs``
    worker does; write each outcome beside it. Never opens the real gradebook. The exit status."""
    import nbgrader.apps  # noqa: F401  (imported before the pool forks its worker, as in a local run)

    from course.instructor.autograde.pool import WorkerPool

    manifest = Manifest.read(manifest_path)
    course = Course(manifest.course)
    folder = task_folder(manifest, index)
    pool = WorkerPool(1, course.root, log_folder(course, manifest.run) / f"task-{index}")
    try:  # the cores Slurm gave this task, for the submission's kernel, verifier and ranks
        pool.cpus = max(1, int(os.environ["SLURM_CPUS_PER_TASK"]))
    except (KeyError, ValueError):
        pool.cpus = manifest.cpus_per_task
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    isolation = isolation_line(course)  # this node's: it may isolate otherwise than the machine that submitted
    print(f"ddp-course array task {index} of run {manifest.run}: {len(manifest.tasks[index])} submission(s), "
          f"{pool.cpus} CPUs, started {started}\n{isolation}", flush=True)
    try:
        with _sigterm_as_interrupt():  # scancel and the time limit send SIGTERM: stop the worker's whole tree
            for submission, limit in manifest.share(index):
                scratch = scratch_course(course, submission, folder)
                target = _outcome_path(manifest, index, submission)
                if target.exists() or not scratch.root.exists():
                    continue  # graded by an earlier attempt of this task (Slurm requeues a task after a node failure)
                pool.submit(0, submission, {"scratch": str(scratch.root), "assignment": submission.assignment,
                                            "student": submission.student}, limit)
                ended: list[Outcome] = []
                while not ended:
                    ended = pool.poll(wait=1.0)
                _write_outcome(target, ended[0], isolation)
                print(f"{ended[0].kind}: {submission} ({ended[0].elapsed:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("stopped (SIGTERM): the submissions without an outcome stay ungraded", flush=True)
        return 143
    finally:
        pool.close()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "task" or not argv[2].isdigit():
        print("usage: python -m course.instructor.autograde.slurm task MANIFEST INDEX", file=sys.stderr)
        return 2
    return run_task(Path(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
