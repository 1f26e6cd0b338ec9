"""``ddp-course k8s-job``: the ungraded submissions as one Kubernetes Indexed Job; ``--collect`` merges its results.

The Kubernetes client beside :mod:`~course.instructor.autograde.slurm`: it plans as ``autograde --slurm``
does (run.py's ``plan``, the submissions other runs hold set aside) and prepares the same batch run
(:func:`~course.instructor.autograde.batch.prepare_run`: a scratch course per submission in
``.ddp-course/slurm/<run>/task-<i>/``), but asks no node for its CPUs and submits nothing: it writes a
batch/v1 Job (``completionMode: Indexed``, one index per share of ``--per-pod`` submissions) and a
NetworkPolicy that takes every egress from the Job's pods. Pod i runs the batch run's task i,
``python -m course.instructor.autograde.batch task MANIFEST $JOB_COMPLETION_INDEX``, on the course
folder mounted from a ReadWriteMany volume at the same path as here (the manifest holds absolute paths).

The run's manifest is ``k8s-job.json``, not Slurm's ``manifest.json``: ``autograde --collect`` asks Slurm
which array tasks ended and takes a run Slurm has never heard of as ended, so it would report the
submissions of pods still grading as failed. ``k8s-job --collect`` merges the outcomes pods have written
(:func:`~course.instructor.autograde.batch.collect_run`, told that no task is known to have ended) and
lists the rest; ``--ended JOB``, once the Job is over, records what it left without an outcome as failed,
so the next k8s-job grades it again.

Pods run as a non-root user with no capabilities; the submissions inside run in the rootless sandbox, which
needs user namespaces in the pod (see :func:`job_documents` and README.md, "Grading on Kubernetes"). A pod
whose sandbox cannot isolate stops before grading anything (exit status 3) and fails the whole Job, unless
the Job was made with ``--allow-partial``.

``python -m course.instructor.autograde.k8s preflight`` is that check, run first in every pod.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import click

from course.errors import CourseError
from course.instructor.autograde.batch import (
    DEFAULT_CPUS,
    K8S_MANIFEST,
    MEMORY_MARGIN_MIB,
    TASK_MARGIN,
    Manifest,
    Unfinished,
    collect_run,
    held,
    largest_world_size,
    log_folder,
    manifests,
    on_kubernetes,
    prepare_run,
    sandbox_memory_mib,
    set_aside,
)
from course.instructor.autograde.guards import course_lock
from course.instructor.autograde.records import Row, Submission
from course.instructor.coursedir import Course, course_dir_option

#: the grader image docker/Dockerfile builds (``--target grader -t ddp-course:grader``)
DEFAULT_IMAGE = "ddp-course:grader"
#: the image's own user (docker/Dockerfile: learner, uid 1000), for a course folder that root owns
IMAGE_UID = 1000
#: each run's manifest, beside the run's scratch courses
MANIFEST_NAME = K8S_MANIFEST
#: the pod label the NetworkPolicy selects
RUN_LABEL = "ddp-course/run"
CONTAINER = "grader"
#: exit status of a pod whose sandbox cannot isolate submissions (the Job's podFailurePolicy fails the Job)
NO_SANDBOX_EXIT = 3
#: seconds a Job may take beyond its pods' own deadlines: scheduling, image pulls
START_MARGIN = 600
#: size of the pod's /tmp and /dev/shm (the sandbox makes its own, inside the memory limit)
SCRATCH_SIZE = "1Gi"
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?")


@dataclass
class JobOptions:
    """What the Job asks the cluster for; None: this module's default (see :func:`prepare`)."""

    #: the PersistentVolumeClaim (ReadWriteMany) holding the course folder
    pvc: str
    #: where that volume is mounted in the pod: the folder on this machine it holds (default: the course folder)
    course_mount: str | None = None
    image: str = DEFAULT_IMAGE
    namespace: str | None = None
    per_pod: int = 1
    #: pods at a time (default: all; the scheduler queues what does not fit)
    parallelism: int | None = None
    cpus: int | None = None
    #: per pod, a Kubernetes quantity ("6Gi")
    memory: str | None = None
    #: new pods for an index whose pod failed (evictions do not count)
    retries: int = 1
    uid: int | None = None
    gid: int | None = None
    #: seconds the whole Job may run (default: every wave of pods, each retried, at its deadline)
    deadline: int | None = None
    #: grade even where the pod's sandbox cannot isolate (submissions could then read and write the course volume)
    allow_partial: bool = False


# -- the pure parts: names and the documents --------------------------------------------------------------------


def job_name(course_id: str, run: str) -> str:
    """A DNS label of at most 50 characters (Indexed pods are named ``<job>-<index>-<suffix>``)."""
    stamp = run.removeprefix("k8s-")
    slug = re.sub(r"[^a-z0-9]+", "-", course_id.lower()).strip("-")[: 50 - len("ddp-grade--") - len(stamp)]
    return "-".join(p for p in ("ddp-grade", slug.strip("-"), stamp) if p)


def pod_seconds(manifest: Manifest, slack: float) -> int:
    """One pod's deadline: the sum of its share's per-submission limits, the largest share, + ``slack``."""
    return math.ceil(manifest.longest_task() + slack)


def job_documents(manifest: Manifest, options: JobOptions, *, memory: str, pod_deadline: int, uid: int, gid: int,
                  manifest_path: Path) -> list[dict]:
    """The Job and its NetworkPolicy, as dicts in the API's shapes.

    The securityContext is what the rootless sandbox needs and no more: a non-root user, no capabilities, no
    privilege escalation, a read-only root filesystem. It creates user, network, mount and pid namespaces and
    mounts a fresh /proc, which needs a user namespace for the pod (``hostUsers: false``) with an unmasked
    /proc (``procMount: Unmasked`` is only valid there), and no seccomp or AppArmor profile that forbids
    unshare and mount to processes without CAP_SYS_ADMIN (the runtimes' default profiles do)."""
    name = manifest.job_id
    labels = {"app.kubernetes.io/name": "ddp-course", "app.kubernetes.io/component": "autograde",
              RUN_LABEL: manifest.run}
    meta = {"name": name, "labels": dict(labels)}
    if options.namespace:
        meta["namespace"] = options.namespace
    completions = len(manifest.tasks)
    parallelism = min(options.parallelism or completions, completions)
    waves = math.ceil(completions / parallelism)
    deadline = options.deadline or pod_deadline * (options.retries + 1) * waves + START_MARGIN
    preflight = "python -m course.instructor.autograde.k8s preflight" + (" --allow-partial" if options.allow_partial else "")
    script = (f"{preflight} || exit {NO_SANDBOX_EXIT}; "
              'exec python -m course.instructor.autograde.batch task "$1" "$JOB_COMPLETION_INDEX"')
    resources = {"cpu": str(manifest.cpus_per_task), "memory": memory}
    container = {
        "name": CONTAINER,
        "image": options.image,
        # tini reaps what a dead kernel leaves (the image's own entrypoint does the same)
        "command": ["tini", "--", "/bin/sh", "-c", script, "ddp-course-task", str(manifest_path)],
        "workingDir": manifest.course,
        "env": [
            # the Job controller sets it too (Kubernetes >= 1.22); spelled out so the command never lacks it
            {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": "HOME", "value": "/tmp/home"},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        ],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "procMount": "Unmasked",
        },
        "volumeMounts": [
            {"name": "course", "mountPath": options.course_mount or manifest.course},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    pod = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": pod_deadline,
        "hostUsers": False,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "seccompProfile": {"type": "Unconfined"},
            "appArmorProfile": {"type": "Unconfined"},
        },
        "containers": [container],
        "volumes": [
            {"name": "course", "persistentVolumeClaim": {"claimName": options.pvc}},
            {"name": "tmp", "emptyDir": {"sizeLimit": SCRATCH_SIZE}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SCRATCH_SIZE}},
        ],
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**meta, "annotations": {"ddp-course/manifest": str(manifest_path)}},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": parallelism,
            "backoffLimitPerIndex": options.retries,
            "activeDeadlineSeconds": deadline,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                      "values": [NO_SANDBOX_EXIT]}},
                # an evicted or preempted pod is started again without using up a retry (graded ones are skipped)
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {**meta, "name": f"{name}-no-egress"},
        # no egress rule: nothing leaves the pods (the sandbox gives each submission loopback only as well)
        "spec": {"podSelector": {"matchLabels": {RUN_LABEL: manifest.run}}, "policyTypes": ["Egress"]},
    }
    return [job, policy]


def render(documents: list[dict], header: str) -> str:
    """Multi-document YAML, after a comment header."""
    import yaml

    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    return comment + yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False, width=120)


# -- runs on this machine --------------------------------------------------------------------------------------


def k8s_runs(course: Course) -> list[tuple[Path, Manifest]]:
    """(manifest path, Manifest) of every run whose submissions are not all merged or reported, oldest first."""
    return manifests(course, MANIFEST_NAME)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), uid, gid)


def _owner(course: Course, uid: int | None, gid: int | None) -> tuple[int, int]:
    """The pod's uid and gid: as given, else the course folder's owner, else the image's user (root owns it)."""
    st = course.root.stat()
    return (uid if uid is not None else st.st_uid or IMAGE_UID,
            gid if gid is not None else st.st_gid or IMAGE_UID)


def _check(options: JobOptions, course: Course) -> None:
    for what, value in (("--pvc", options.pvc), ("--namespace", options.namespace)):
        if value is not None and not (_NAME.fullmatch(value) and len(value) <= 253):
            raise CourseError(f"{what} {value!r} is not a Kubernetes name (lower-case letters, digits and '-')")
    if options.memory is not None and not _QUANTITY.fullmatch(options.memory):
        raise CourseError(f"--memory {options.memory!r} is not a Kubernetes quantity such as 6Gi or 4096Mi")
    uid, gid = _owner(course, options.uid, options.gid)
    if max(uid, gid) > 65535:  # a pod's user namespace (hostUsers: false) maps ids 0-65535 only
        raise CourseError(f"the pods would run as uid {uid}, gid {gid}: in a pod's user namespace ids stop at 65535; "
                          "pass --uid and --gid that own the course folder as the volume shows it to the pods")
    if options.course_mount is not None:
        mount = Path(options.course_mount)
        if not mount.is_absolute() or not course.root.is_relative_to(mount):
            raise CourseError(f"--course-mount {mount} must be an absolute path that holds the course folder "
                              f"{course.root} (the folder on this machine that the volume {options.pvc} holds)")


def prepare(course: Course, todo: list[Submission], options: JobOptions, *,
            timeout: float | None) -> tuple[str, Manifest]:
    """Prepare ``todo``'s scratch courses and the manifest as ``autograde --slurm`` does; the YAML and the Manifest."""
    # one core per rank of the largest job a check starts (no node size to cap it with: the scheduler places it)
    cpus = options.cpus or largest_world_size(course, sorted({s.assignment for s in todo})) or DEFAULT_CPUS
    run = datetime.now().strftime("k8s-%Y%m%d-%H%M%S-") + secrets.token_hex(3)  # unique: it names the pods' label
    uid, gid = _owner(course, options.uid, options.gid)
    manifest = prepare_run(course, todo, run, per_task=options.per_pod, cpus=cpus, timeout=timeout,
                           job_id=job_name(course.course_id, run))
    shares = manifest.tasks
    path = manifest.folder / MANIFEST_NAME
    logs = log_folder(course, run)
    try:
        logs.mkdir(parents=True, exist_ok=True)  # each pod's worker log goes here (run_task)
        manifest.save(path)
        if os.geteuid() == 0:  # the pods write their outcomes and logs here as uid, not as root
            for folder in (manifest.folder, logs):
                _chown_tree(folder, uid, gid)
    except BaseException:
        shutil.rmtree(manifest.folder, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
        raise
    memory = options.memory or f"{sandbox_memory_mib(course) + MEMORY_MARGIN_MIB}Mi"
    documents = job_documents(manifest, options, memory=memory, pod_deadline=pod_seconds(manifest, TASK_MARGIN),
                              uid=uid, gid=gid, manifest_path=path)
    where = f" -n {options.namespace}" if options.namespace else ""
    header = (f"ddp-course k8s-job, run {run}: {len(todo)} submission(s) of {course.root} in {len(shares)} pod(s).\n"
              f"Apply: kubectl apply{where} -f THIS_FILE; follow: kubectl get job{where} {manifest.job_id}\n"
              f"Merge: ddp-course k8s-job --collect -C {course.root} (add --ended {manifest.job_id} once the Job "
              f"is Complete or Failed)")
    return render(documents, header), manifest


def collect_runs(course: Course, ended: tuple[str, ...] = ()) -> list[Row]:
    """Merge every outcome the pods have written (batch.collect_run); the Jobs named in ``ended`` are
    over, so what they left without an outcome is recorded as failed and their runs closed. Summary rows."""
    with course_lock(course):
        return _collect(course, ended)


def _collect(course: Course, ended: tuple[str, ...]) -> list[Row]:
    runs = k8s_runs(course)
    unknown = sorted(set(ended) - {m.job_id for _, m in runs})
    if unknown:
        raise CourseError(f"no open k8s-job run is job {', '.join(unknown)} (open: "
                          f"{', '.join(m.job_id for _, m in runs) or 'none'})")
    rows = []
    for path, manifest in runs:
        over = {index: _unfinished(course, manifest, index) for index in range(len(manifest.tasks))
                } if manifest.job_id in ended else {}
        rows += collect_run(course, manifest, over, path=path)
        rows += [Row(submission, "not graded", reason=str(on_kubernetes(manifest, index)))
                 for index, submission in held(course, manifest)]
        if not held(course, manifest):
            shutil.rmtree(manifest.folder, ignore_errors=True)
    return rows


def _unfinished(course: Course, manifest: Manifest, index: int) -> Unfinished:
    """What pod ``index`` of a Job that is over left ungraded is recorded as."""
    reason = (f"pod {index} of Kubernetes job {manifest.job_id} ended before grading it (kubectl describe job "
              f"{manifest.job_id} says why: deadline, retries, out of memory?); run ddp-course k8s-job again")
    # the pod's one worker's log
    return Unfinished("failed", reason, log_folder(course, manifest.run) / f"task-{index}" / "worker-0.log")


# -- the verb ---------------------------------------------------------------------------------------------------


def make_job(course: Course, assignments: list[str], options: JobOptions, *, students: tuple[str, ...] = (),
             force: bool = False, timeout: float | None = None) -> tuple[str | None, Manifest | None, list[Row]]:
    """Plan and prepare a run of every submission not graded and not on Slurm or Kubernetes already:
    (its YAML, its Manifest, rows for the rest); (None, None, rows) when there is nothing to grade."""
    from course.instructor.autograde.run import check_released, plan

    _check(options, course)
    with course_lock(course):
        todo, rows = plan(course, assignments, students, force)
        todo = set_aside(course, todo, rows)
        if not todo:
            return None, None, rows
        check_released(course, todo)
        text, manifest = prepare(course, todo, options, timeout=timeout)
    return text, manifest, rows


@click.command()
@click.argument("assignments", nargs=-1)
@click.option("--pvc", default=None, help="The PersistentVolumeClaim (ReadWriteMany) that holds the course folder.")
@click.option("--course-mount", type=click.Path(), default=None,
              help="Where the volume is mounted in the pods: the folder on this machine it holds, the course "
                   "folder or one above it (default: the course folder).")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True, help="The grader image (docker/Dockerfile, --target grader).")
@click.option("--namespace", "-n", default=None, help="Kubernetes namespace (default: kubectl's current one).")
@click.option("--per-pod", type=click.IntRange(min=1), default=1, show_default=True,
              help="Submissions each pod grades, one after the other (the Job has one index per share).")
@click.option("--parallelism", type=click.IntRange(min=1), default=None, help="Pods at a time (default: all).")
@click.option("--cpus", type=click.IntRange(min=1), default=None,
              help="CPUs per pod (default: the most ranks a check of the assignments starts; 2 when no check says).")
@click.option("--memory", default=None, help="Memory per pod, a Kubernetes quantity (default: the sandbox's + 1Gi).")
@click.option("--retries", type=click.IntRange(min=0), default=1, show_default=True,
              help="New pods for an index whose pod failed (backoffLimitPerIndex; evictions do not count).")
@click.option("--uid", type=click.IntRange(min=1), default=None,
              help="The pods' user (default: the course folder's owner; 1000, the image's user, if that is root).")
@click.option("--gid", type=click.IntRange(min=0), default=None,
              help="The pods' group (default: the course folder's group; 1000 if that is root's).")
@click.option("--deadline", type=click.IntRange(min=1), default=None,
              help="Seconds the whole Job may run (default: each wave of pods at its deadline, retried, + 10 min).")
@click.option("--allow-partial", is_flag=True,
              help="Grade even in pods where the sandbox cannot isolate submissions (they could then read and "
                   "write the course volume). Without it such a pod fails the Job before grading.")
@click.option("--student", "students", multiple=True, help="Only this student (repeatable).")
@click.option("--force", is_flag=True, help="Grade again submissions that are already graded.")
@click.option("--timeout", type=float, default=None,
              help="Seconds one submission may take (default: the sum of its cells' limits + 120).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the YAML here (default: stdout).")
@click.option("--collect", is_flag=True, help="Merge what the pods of earlier k8s-job runs graded; write no Job.")
@click.option("--ended", "ended", multiple=True, metavar="JOB",
              help="[--collect] This Job is Complete or Failed: what it left ungraded is recorded as failed, "
                   "for the next k8s-job to grade again (repeatable).")
@course_dir_option
def command(assignments, pvc, course_mount, image, namespace, per_pod, parallelism, cpus, memory, retries, uid, gid,
            deadline, allow_partial, students, force, timeout, output, collect, ended, course_dir):
    """Write a Kubernetes Indexed Job that grades the ungraded submissions, one pod per share (kubectl apply -f)."""
    from rich.console import Console

    from course.instructor.autograde.records import fill_scores, summary_table

    err = Console(stderr=True)  # stdout carries the YAML (ddp-course k8s-job ... | kubectl apply -f -)
    if ended and not collect:
        raise click.UsageError("--ended JOB: only with --collect")
    course = Course.open(course_dir)
    if collect:
        rows = [fill_scores(course, r) for r in collect_runs(course, tuple(ended))]
        if not rows:
            err.print("no k8s-job run to collect")
            return
        Console().print(summary_table(rows))
        waiting = [r for r in rows if r.status == "not graded"]
        if waiting:
            err.print(f"{len(waiting)} submission(s) still on Kubernetes: once `kubectl get job` shows a Job Complete "
                      "or Failed, ddp-course k8s-job --collect --ended JOB records what it left ungraded")
        return
    if pvc is None:
        raise click.UsageError("--pvc NAME: the PersistentVolumeClaim that holds the course folder")
    options = JobOptions(pvc=pvc, course_mount=course_mount, image=image, namespace=namespace, per_pod=per_pod,
                         parallelism=parallelism, cpus=cpus, memory=memory, retries=retries, uid=uid, gid=gid,
                         deadline=deadline, allow_partial=allow_partial)
    text, manifest, rows = make_job(course, course.pick_assignments(assignments), options, students=students,
                                    force=force, timeout=timeout)
    for row in rows:
        if row.status != "already graded":
            err.print(f"{row.status:>14}  {row.submission} {row.reason}".rstrip(), markup=False, highlight=False)
    if text is None:
        err.print("nothing to grade: every submission is graded or on its way" if rows else
                  "nothing submitted yet: file submissions with ddp-course collect ZIP_OR_DIR")
        return
    if output is not None:
        output.write_text(text)
    else:
        click.echo(text, nl=False)
    target = str(output) if output is not None else "-"
    count = sum(len(share) for share in manifest.tasks)
    err.print(f"Job {manifest.job_id}: {count} submission(s) in {len(manifest.tasks)} pod(s), "
              f"{manifest.cpus_per_task} CPUs each; apply with kubectl apply -f {target}, merge with "
              f"ddp-course k8s-job --collect", markup=False, highlight=False)
    pod_uid = _owner(course, uid, gid)[0]
    if os.geteuid() != 0 and pod_uid != os.getuid():
        err.print(f"[yellow]the pods run as uid {pod_uid}, not as you: they must be able to write {manifest.folder}")


# -- in the pod -------------------------------------------------------------------------------------------------


def preflight(allow_partial: bool = False) -> int:
    """Say which sandbox this pod gives submissions; NO_SANDBOX_EXIT where it cannot isolate them."""
    from course.sandbox import describe, namespaces_available, rootless_available

    print(describe(), flush=True)
    ok, why = (namespaces_available if os.geteuid() == 0 else rootless_available)()
    if ok or allow_partial:
        return 0
    print(f"ddp-course: this pod cannot isolate submissions ({why}). The rootless sandbox needs a user namespace "
          "for the pod (hostUsers: false, procMount: Unmasked) and no seccomp or AppArmor profile that forbids "
          "unshare and mount (README.md, 'Grading on Kubernetes'). Nothing was graded; the Job fails.",
          file=sys.stderr, flush=True)
    return NO_SANDBOX_EXIT


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "preflight" or set(argv[1:]) - {"--allow-partial"}:
        print("usage: python -m course.instructor.autograde.k8s preflight [--allow-partial]", file=sys.stderr)
        return 2
    return preflight("--allow-partial" in argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
