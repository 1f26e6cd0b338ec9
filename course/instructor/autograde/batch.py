"""A batch run, whichever scheduler runs its tasks: prepare it here, grade its shares elsewhere, merge here.

How it works. :func:`prepare_run` makes a run folder, ``.ddp-course/slurm/<run>/`` (the name is older than
Kubernetes; both schedulers' runs live there): a template gradebook, each submission's scratch course in
its task's folder ``task-<i>/``, and a :class:`Manifest` of each task's share of the submissions. The
scheduler's module (:mod:`~course.instructor.autograde.slurm`, :mod:`~course.instructor.autograde.k8s`)
saves it, as ``manifest.json`` or :data:`K8S_MANIFEST`, and starts one task per share. Each task runs
``python -m course.instructor.autograde.batch task MANIFEST INDEX`` (:func:`run_task`): it grades its share
one submission at a time on a one-worker pool (:mod:`~course.instructor.autograde.pool`: the same code,
sandbox and per-submission deadline as ``--jobs N``) and writes each outcome as JSON beside its scratch
course. A task never opens the real gradebook: :func:`collect_run`, in the process holding the course
lock, merges each outcome (:func:`~course.instructor.autograde.merge.finish`) and records what the tasks
the scheduler says ended left without one (:class:`Unfinished`); the next run grades those again.

Until then the run holds its submissions (:func:`held`): every verb that plans grading asks
:func:`elsewhere` and leaves them alone (:func:`set_aside`), since the run's result would replace its own.

The course folder and the Python environment must be at the same paths where the tasks run (a shared
filesystem, a volume mounted at the same path): the manifest holds absolute paths.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from course.instructor.autograde.config import isolation_line, submission_timeout
from course.instructor.autograde.guards import deferred_interrupts, sigterm_as_interrupt
from course.instructor.autograde.merge import finish
from course.instructor.autograde.pool import READY_TIMEOUT, Outcome
from course.instructor.autograde.records import Row, Submission, write_record
from course.instructor.autograde.scratch import prepare_scratch, scratch_course
from course.instructor.coursedir import STATE_DIR, Course
from course.instructor.gradebook import make_template

#: what a task may take beyond its submissions' limits: Python and nbgrader imports, the worker's first start
TASK_MARGIN = 60.0 + READY_TIMEOUT
#: CPUs per task when no check call of the assignments names its world size (the course's checks default to 2-3 ranks)
DEFAULT_CPUS = 2
#: memory per task beyond the sandbox's: nbgrader, the worker and the verifier's parent process
MEMORY_MARGIN_MIB = 1024
#: the folder under .ddp-course/ that holds every run's folder (named before Kubernetes runs lived there too)
RUNS_DIR = "slurm"
#: a Slurm run's manifest; a Kubernetes run's (:mod:`~course.instructor.autograde.k8s`) is K8S_MANIFEST
SLURM_MANIFEST = "manifest.json"
K8S_MANIFEST = "k8s-job.json"


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
        return Path(self.course) / STATE_DIR / RUNS_DIR / self.run

    @property
    def path(self) -> Path:
        return self.folder / SLURM_MANIFEST

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


# -- what each task asks for ---------------------------------------------------------------------------------


def split(todo: list[Submission], per_task: int) -> list[list[Submission]]:
    """The submissions in tasks of ``per_task``, in order."""
    per_task = max(1, per_task)
    return [todo[i:i + per_task] for i in range(0, len(todo), per_task)]


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


# -- a run's folders -------------------------------------------------------------------------------------------


def runs_root(course: Course) -> Path:
    """Where each run keeps its manifest, template gradebook and the tasks' scratch courses
    (see :attr:`Manifest.folder`)."""
    return course.state_dir / RUNS_DIR


def task_folder(manifest: Manifest, index: int) -> Path:
    return manifest.folder / f"task-{index}"


def log_folder(course: Course, run: str) -> Path:
    """Each task's output; kept after the run is collected (ddp-course status points at it)."""
    return course.state_dir / "logs" / "slurm" / run


def outcome_path(manifest: Manifest, index: int, submission: Submission) -> Path:
    """Where task ``index`` writes the outcome of ``submission``."""
    return task_folder(manifest, index) / f"{submission.assignment}--{submission.student}.json"


def prepare_run(course: Course, todo: list[Submission], run: str, *, per_task: int, cpus: int,
                timeout: float | None, job_id: str | None = None) -> Manifest:
    """A run's folder for ``todo`` in shares of ``per_task``: the template gradebook and each submission's
    scratch course in its task's folder; the Manifest (not saved yet). A Slurm run and a Kubernetes Job
    both start here. Nothing is left behind when it fails."""
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


# -- what the runs hold --------------------------------------------------------------------------------------


def manifests(course: Course, name: str = SLURM_MANIFEST) -> list[tuple[Path, Manifest]]:
    """(path, Manifest) of every run folder holding ``name`` (Slurm's runs; K8S_MANIFEST: Kubernetes'), oldest first."""
    found = []
    for path in sorted(runs_root(course).glob(f"*/{name}")):
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


def not_yet(course: Course, only: list[Submission] | None = None) -> list[Row]:
    """A "not graded" row for each submission a run holds (of ``only``, when given), saying where it is."""
    return [Row(s, "not graded", reason=str(where)) for s, where in sorted(elsewhere(course).items())
            if only is None or s in only]


def set_aside(course: Course, todo: list[Submission], rows: list[Row]) -> list[Submission]:
    """``todo`` without the submissions a run holds; a row for each of those onto ``rows``."""
    away = elsewhere(course)
    rows += [Row(s, "not graded", reason=str(away[s])) for s in todo if s in away]
    return [s for s in todo if s not in away]


# -- merging what the tasks wrote ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unfinished:
    """What a task that ended leaves for each submission it wrote no outcome for: the status and reason
    recorded, and the log whose tail goes with them."""

    status: str  # "failed" | "timeout"
    reason: str
    log: Path


def _tail(path: Path, lines: int = 200) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def collect_run(course: Course, manifest: Manifest, ended: dict[int, Unfinished] | None = None, *,
                path: Path | None = None) -> list[Row]:
    """Merge every outcome the run's tasks have written. The tasks in ``ended`` are over: their submissions
    still without an outcome are recorded as their Unfinished says, and the tasks are collected (the
    manifest saved to ``path``, default :attr:`Manifest.path`; its folder removed once every task is)."""
    ended = ended or {}
    rows: list[Row] = []
    for index in range(len(manifest.tasks)):
        if index in manifest.collected:
            continue
        folder = task_folder(manifest, index)
        for submission, _ in manifest.share(index):
            scratch = scratch_course(course, submission, folder)
            outcome_file = outcome_path(manifest, index, submission)
            with deferred_interrupts():  # a Ctrl-C waits until this submission is merged or reported
                if outcome_file.is_file():
                    saved = json.loads(outcome_file.read_text())
                    outcome = Outcome(submission, saved["result"], saved["kind"], saved["elapsed"], saved["detail"])
                    rows.append(finish(course, outcome, scratch, isolation=saved.get("isolation", "")))
                    outcome_file.unlink()
                elif index in ended and scratch.root.exists():
                    left = ended[index]
                    write_record(course, submission, left.status, None, left.reason, _tail(left.log))
                    shutil.rmtree(scratch.root, ignore_errors=True)
                    rows.append(Row(submission, left.status, reason=left.reason))
                    if index not in manifest.failed:
                        manifest.failed.append(index)
        if index in ended:
            manifest.collected.append(index)
            manifest.save(path)
    if manifest.done:
        shutil.rmtree(manifest.folder, ignore_errors=True)
    return rows


# -- one task ----------------------------------------------------------------------------------------------------


def write_outcome(path: Path, outcome: Outcome, isolation: str = "") -> None:
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
        with sigterm_as_interrupt():  # scancel, a time limit or a pod's deadline send SIGTERM: stop the worker's tree
            for submission, limit in manifest.share(index):
                scratch = scratch_course(course, submission, folder)
                target = outcome_path(manifest, index, submission)
                if target.exists() or not scratch.root.exists():
                    continue  # graded by an earlier attempt of this task (Slurm requeues a task after a node failure)
                pool.submit(0, submission, {"scratch": str(scratch.root), "assignment": submission.assignment,
                                            "student": submission.student}, limit)
                ended: list[Outcome] = []
                while not ended:
                    ended = pool.poll(wait=1.0)
                write_outcome(target, ended[0], isolation)
                print(f"{ended[0].kind}: {submission} ({ended[0].elapsed:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("stopped (SIGTERM): the submissions without an outcome stay ungraded", flush=True)
        return 143
    finally:
        pool.close()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "task" or not argv[2].isdigit():
        print("usage: python -m course.instructor.autograde.batch task MANIFEST INDEX", file=sys.stderr)
        return 2
    return run_task(Path(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
