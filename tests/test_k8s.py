"""``ddp-course k8s-job`` (issue 17): the Indexed Job and NetworkPolicy it writes, checked offline.

No cluster runs here (DESIGN.md). Every manifest is validated against the Kubernetes API's own schemas for
batch/v1 Job and networking.k8s.io/v1 NetworkPolicy (kubernetes-validate bundles them, strict: unknown fields
are errors) and against the rules the API server checks that a schema cannot say (``api_server_rules``). Both
must reject broken manifests, or they prove nothing. Nothing is graded: a pod's work is stood in for by the
outcome file it would write, and the container's shell command runs with a stand-in ``python``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import kubernetes_validate
import nbformat
import pytest
import yaml
from click.testing import CliRunner

from course.errors import CourseError
from course.instructor.autograde.batch import MEMORY_MARGIN_MIB, Manifest, elsewhere, sandbox_memory_mib, task_folder
from course.instructor.autograde.k8s import (
    MANIFEST_NAME,
    NO_SANDBOX_EXIT,
    RUN_LABEL,
    JobOptions,
    collect_runs,
    command,
    make_job,
    preflight,
)
from course.instructor.autograde.records import Submission, read_record
from course.instructor.coursedir import Course

# nbgrader's own gradebook code trips SQLAlchemy autoflush warnings (harmless, not ours)
pytestmark = [pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning"), pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "files" / "exercises"
ASSIGNMENT, NOTEBOOK = "ex0-tiny", "tiny"
#: the oldest Kubernetes the Job is written for (user namespaces on by default) and the newest schemas bundled
VERSIONS = ("1.33", kubernetes_validate.utils.latest_version())
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


# -- the validator ----------------------------------------------------------------------------------------------


def api_server_rules(doc: dict) -> list[str]:
    """What kube-apiserver rejects in these two kinds that the OpenAPI schema cannot express (there every
    field is optional and no string is an enum): an empty list means the API server would take it."""
    problems = []
    meta = doc.get("metadata", {})
    if not _DNS_LABEL.fullmatch(meta.get("name", "")) or len(meta.get("name", "")) > 63:
        problems.append(f"metadata.name {meta.get('name')!r} is not a DNS label")
    for key, value in meta.get("labels", {}).items():
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            problems.append(f"label {key}={value!r} is not a label value")
    spec = doc.get("spec", {})
    if doc.get("kind") == "NetworkPolicy":
        if set(spec.get("policyTypes", [])) - {"Ingress", "Egress"}:
            problems.append(f"policyTypes {spec['policyTypes']}: only Ingress and Egress")
        return problems
    mode = spec.get("completionMode", "NonIndexed")
    if mode not in ("NonIndexed", "Indexed"):
        problems.append(f"spec.completionMode {mode!r}: NonIndexed or Indexed")
    if mode == "Indexed" and not spec.get("completions"):
        problems.append("spec.completions: required when completionMode is Indexed")
    pod = spec.get("template", {}).get("spec", {})
    restart = pod.get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        problems.append(f"restartPolicy {restart!r}: a Job's pods use Never or OnFailure")
    if "backoffLimitPerIndex" in spec and (mode != "Indexed" or restart != "Never"):
        problems.append("backoffLimitPerIndex: only with completionMode Indexed and restartPolicy Never")
    if "podFailurePolicy" in spec and restart != "Never":
        problems.append("podFailurePolicy: only with restartPolicy Never")
    containers = pod.get("containers", [])
    if not containers:
        problems.append("spec.template.spec.containers: required")
    names = [c.get("name") for c in containers]
    for rule in spec.get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes and (codes.get("containerName") not in names or codes.get("operator") not in ("In", "NotIn")
                      or 0 in codes.get("values", [])):
            problems.append(f"podFailurePolicy rule {rule}: names no container, or a bad operator or exit code")
    volumes = {v["name"] for v in pod.get("volumes", [])}
    pod_user = pod.get("securityContext", {}).get("runAsUser")
    for c in containers:
        if not c.get("image"):
            problems.append(f"container {c.get('name')}: image is required")
        for mount in c.get("volumeMounts", []):
            if mount["name"] not in volumes:
                problems.append(f"volumeMount {mount['name']}: no such volume")
        context = c.get("securityContext", {})
        if context.get("procMount") == "Unmasked" and pod.get("hostUsers") is not False:
            problems.append("procMount Unmasked: only with hostUsers false")
        if context.get("runAsNonRoot", pod.get("securityContext", {}).get("runAsNonRoot")) and \
                context.get("runAsUser", pod_user) == 0:
            problems.append("runAsNonRoot with runAsUser 0")
    return problems


def problems(doc: dict) -> list[str]:
    """Schema errors (every version in VERSIONS, strict) and API server rule breaches of one document."""
    found = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            found.append(f"schema {version}: {'.'.join(map(str, err.path))}: {err.message}")
    return found + api_server_rules(doc)


# -- a course with submissions, made once, copied per test -----------------------------------------------------


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A course of the tiny exercise, released (the gradebook knows it); no submissions."""
    base = tmp_path_factory.mktemp("k8s")
    for args, cwd in ((["init", str(base / "course"), "--exercises", str(TINY)], base),
                      (["release"], base / "course")):
        subprocess.run(["ddp-course", *args], cwd=cwd, check=True, capture_output=True, timeout=120)
    return base / "course"


def course_with(released: Path, where: Path, students: list[str]) -> Course:
    """A copy of the released course with one submission (the student copy) per student."""
    root = where / "course"
    shutil.copytree(released, root, symlinks=True)
    for student in students:
        folder = root / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        shutil.copy(root / "release" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", folder)
    return Course.open(root)


def generate(course: Course, **options) -> tuple[list[dict], Manifest, list]:
    """Make a run as `ddp-course k8s-job` does: its YAML documents (parsed back), its manifest, the other rows."""
    options.setdefault("pvc", "course-volume")
    timeout = options.pop("timeout", None)
    text, manifest, rows = make_job(course, [ASSIGNMENT], JobOptions(**options), timeout=timeout)
    return (list(yaml.safe_load_all(text)) if text else []), manifest, rows


def job_of(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Job")


def pod_of(docs: list[dict]) -> dict:
    return job_of(docs)["spec"]["template"]["spec"]


def mark_graded(course: Course, student: str) -> None:
    """What a finished grading leaves, without grading: autograded notebooks and a score for every test cell."""
    from nbgrader.api import Gradebook

    folder = course.folder("autograded", student, ASSIGNMENT)
    shutil.copytree(course.folder("submitted", student, ASSIGNMENT), folder)
    with Gradebook(course.db_url, course.course_id) as gb:
        gb.update_or_create_student(student)
        submission = gb.add_submission(ASSIGNMENT, student)
        for notebook in submission.notebooks:
            for grade in notebook.grades:
                grade.auto_score = 0.0
        gb.db.commit()


# -- the manifest is valid, and the validator is not a no-op ---------------------------------------------------


def test_the_manifest_is_a_valid_indexed_job_and_network_policy(released, tmp_path):
    course = course_with(released, tmp_path, ["ada", "bob", "cy"])
    docs, manifest, _ = generate(course, per_pod=2, namespace="grading")
    assert [d["kind"] for d in docs] == ["Job", "NetworkPolicy"]
    for doc in docs:
        assert problems(doc) == [], doc["kind"]
        assert doc["metadata"]["namespace"] == "grading"
    job = job_of(docs)["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    assert pod_of(docs)["restartPolicy"] == "Never"
    assert Manifest.read(manifest.folder / MANIFEST_NAME) == manifest


@pytest.mark.parametrize("breakage, expected", [
    (lambda d: d["spec"].update(completionMod=d["spec"].pop("completionMode")), "'completionMod' was unexpected"),
    (lambda d: d["spec"].update(completionMode="Indexd"), "completionMode"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("image"), "image is required"),
    (lambda d: d["spec"]["template"]["spec"].update(restartPolicy="Always"), "restartPolicy"),
    (lambda d: d["spec"].update(completions="3"), "spec.completions: '3' is not of type"),
    (lambda d: d["spec"]["template"]["spec"].pop("hostUsers"), "procMount"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(runAsUser=0), "runAsUser 0"),
])
def test_the_validator_rejects_a_broken_job(released, tmp_path, breakage, expected):
    course = course_with(released, tmp_path, ["ada"])
    job = job_of(generate(course)[0])
    broken = deepcopy(job)
    breakage(broken)
    found = problems(broken)
    assert found and any(expected in p for p in found), found


def test_the_validator_rejects_a_broken_network_policy(released, tmp_path):
    course = course_with(released, tmp_path, ["ada"])
    policy = generate(course)[0][1]
    misspelled = deepcopy(policy)
    misspelled["spec"]["policyType"] = misspelled["spec"].pop("policyTypes")
    wrong = deepcopy(policy)
    wrong["spec"]["policyTypes"] = ["Outgoing"]
    assert any("'policyType' was unexpected" in p for p in problems(misspelled))
    assert any("policyTypes" in p for p in problems(wrong))


# -- what the Job asks for ---------------------------------------------------------------------------------------


def test_each_pod_runs_the_slurm_task_with_its_completion_index(released, tmp_path):
    course = course_with(released, tmp_path, ["ada", "bob"])
    docs, manifest, _ = generate(course)
    container = pod_of(docs)["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert container["command"][:4] == ["tini", "--", "/bin/sh", "-c"]
    assert container["workingDir"] == str(course.root)
    script, argv = container["command"][4], container["command"][5:]
    assert argv[1] == str(manifest.folder / MANIFEST_NAME)
    # run the container's own shell line with a stand-in python that says what it was asked to run
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text('#!/bin/sh\necho "python $*" >> "$CALLS"\n')
    (bin_dir / "python").chmod(0o755)
    calls = tmp_path / "calls.txt"
    env_vars = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "JOB_COMPLETION_INDEX": "1"}
    subprocess.run(["/bin/sh", "-c", script, *argv], env=env_vars, check=True, timeout=30)
    assert calls.read_text().splitlines() == [
        "python -m course.instructor.autograde.k8s preflight",
        f"python -m course.instructor.autograde.batch task {manifest.folder / MANIFEST_NAME} 1",
    ]


def test_a_failed_preflight_stops_the_pod_with_the_exit_code_that_fails_the_job(released, tmp_path):
    course = course_with(released, tmp_path, ["ada"])
    docs, manifest, _ = generate(course)
    script, argv = pod_of(docs)["containers"][0]["command"][4], pod_of(docs)["containers"][0]["command"][5:]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text('#!/bin/sh\ncase "$*" in *preflight*) exit 1;; esac\necho graded\n')
    (bin_dir / "python").chmod(0o755)
    proc = subprocess.run(["/bin/sh", "-c", script, *argv], env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout) == (NO_SANDBOX_EXIT, "")
    rule = job_of(docs)["spec"]["podFailurePolicy"]["rules"][0]
    assert rule == {"action": "FailJob", "onExitCodes": {"containerName": "grader", "operator": "In",
                                                         "values": [NO_SANDBOX_EXIT]}}


def test_preflight_refuses_a_pod_whose_sandbox_cannot_isolate(monkeypatch, capsys):
    import course.sandbox as sandbox

    refused = lambda: (False, "unshare: Operation not permitted")  # noqa: E731
    monkeypatch.setattr(sandbox, "describe", lambda: "sandbox: partial, ...")
    monkeypatch.setattr(sandbox, "rootless_available", refused)
    monkeypatch.setattr(sandbox, "namespaces_available", refused)
    assert preflight() == NO_SANDBOX_EXIT
    assert "Operation not permitted" in capsys.readouterr().err
    assert preflight(allow_partial=True) == 0
    monkeypatch.setattr(sandbox, "rootless_available", lambda: (True, ""))
    monkeypatch.setattr(sandbox, "namespaces_available", lambda: (True, ""))
    assert preflight() == 0


@pytest.mark.parametrize("submissions, per_pod", [(5, 1), (5, 2), (5, 5), (5, 9), (4, 3)])
def test_one_index_per_share_of_submissions(released, tmp_path, submissions, per_pod):
    students = [f"s{i}" for i in range(submissions)]
    course = course_with(released, tmp_path, students)
    docs, manifest, _ = generate(course, per_pod=per_pod)
    job = job_of(docs)["spec"]
    assert job["completions"] == math.ceil(submissions / per_pod) == len(manifest.tasks)
    assert job["parallelism"] == job["completions"]  # all at once unless --parallelism; the scheduler queues
    assert [s.student for i in range(len(manifest.tasks)) for s, _ in manifest.share(i)] == students
    for index in range(len(manifest.tasks)):
        for submission, _ in manifest.share(index):
            assert (task_folder(manifest, index) / f"{ASSIGNMENT}--{submission.student}" / "submitted").is_dir()


def test_parallelism_and_deadlines(released, tmp_path):
    course = course_with(released, tmp_path, ["a", "b", "c", "d", "e"])
    docs, manifest, _ = generate(course, per_pod=2, parallelism=2, retries=2, timeout=100)
    job, pod = job_of(docs)["spec"], pod_of(docs)
    assert (job["completions"], job["parallelism"], job["backoffLimitPerIndex"]) == (3, 2, 2)
    from course.instructor.autograde.batch import TASK_MARGIN

    assert pod["activeDeadlineSeconds"] == math.ceil(2 * 100 + TASK_MARGIN)  # a pod of 2: their limits + margin
    waves = 2  # 3 pods, 2 at a time
    assert job["activeDeadlineSeconds"] == pod["activeDeadlineSeconds"] * 3 * waves + 600
    assert job_of(generate(course_with(released, tmp_path / "x", ["a"]), deadline=999)[0])["spec"][
        "activeDeadlineSeconds"] == 999


def test_resources_come_from_the_world_sizes_and_the_sandbox_memory(released, tmp_path):
    course = course_with(released, tmp_path, ["ada"])
    resources = pod_of(generate(course)[0])["containers"][0]["resources"]
    # tiny's checks name no world size (run_ranks(..., 2)): batch.py's default of 2 CPUs
    default_memory = f"{sandbox_memory_mib(course) + MEMORY_MARGIN_MIB}Mi"
    assert resources == {"requests": {"cpu": "2", "memory": default_memory},
                         "limits": {"cpu": "2", "memory": default_memory}}

    other = course_with(released, tmp_path / "other", ["ada"])
    source = other.folder("source", assignment=ASSIGNMENT) / f"{NOTEBOOK}.ipynb"
    nb = nbformat.read(source, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "graders.parallelism.check_shards(f)\n### BEGIN HIDDEN TESTS\ngraders.parallelism.check_shards(f, world_sizes=(6, 3))\n"
        "### END HIDDEN TESTS", metadata={"nbgrader": {"grade": True, "grade_id": "ws", "points": 1}}))
    nbformat.write(nb, source)
    config = other.root / "nbgrader_config.py"
    config.write_text(config.read_text() + "\nc.SandboxKernelManager.memory_limit = 2 * 1024 ** 3\n")
    other = Course.open(other.root)
    resources = pod_of(generate(other)[0])["containers"][0]["resources"]
    assert resources["limits"] == resources["requests"] == {"cpu": "6", "memory": f"{2048 + MEMORY_MARGIN_MIB}Mi"}
    shutil.rmtree(other.state_dir / "slurm")
    resources = pod_of(generate(other, cpus=3, memory="6Gi")[0])["containers"][0]["resources"]
    assert resources["limits"] == {"cpu": "3", "memory": "6Gi"}


def test_pods_run_as_a_user_without_privileges(released, tmp_path):
    course = course_with(released, tmp_path, ["ada"])
    docs, manifest, _ = generate(course, uid=4321, gid=4322)
    pod = pod_of(docs)
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and container["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (4321, 4322)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "privileged" not in container["securityContext"]
    # the rootless sandbox's namespaces and fresh /proc: a user namespace for the pod, /proc unmasked
    assert pod["hostUsers"] is False and container["securityContext"]["procMount"] == "Unmasked"
    assert pod["automountServiceAccountToken"] is False  # no API token for submissions to find
    writable = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/dev/shm", str(course.root)} <= writable  # all a read-only root leaves writable
    if os.geteuid() == 0:  # the pods write the run folder as their own user
        assert {p.lstat().st_uid for p in [manifest.folder, *manifest.folder.rglob("*")]} == {4321}


def test_the_default_user_is_the_course_folders_owner(released, tmp_path):
    course = course_with(released, tmp_path, ["ada"])
    owner = course.root.stat().st_uid
    user = pod_of(generate(course)[0])["securityContext"]["runAsUser"]
    assert user == (owner or 1000)  # root's course: the image's own user (docker/Dockerfile: uid 1000)


def test_the_course_volume_is_mounted_where_the_manifest_expects_it(released, tmp_path):
    course = course_with(released, tmp_path, ["ada"])
    docs, manifest, _ = generate(course, pvc="cs101-course", course_mount=str(tmp_path))
    pod = pod_of(docs)
    assert pod["volumes"][0] == {"name": "course", "persistentVolumeClaim": {"claimName": "cs101-course"}}
    assert pod["containers"][0]["volumeMounts"][0] == {"name": "course", "mountPath": str(tmp_path)}
    assert manifest.course == str(course.root) and course.root.is_relative_to(tmp_path)
    with pytest.raises(CourseError, match="holds the course folder"):
        generate(course, course_mount=str(tmp_path / "elsewhere"))
    with pytest.raises(CourseError, match="not a Kubernetes name"):
        generate(course, pvc="Course_Volume")
    with pytest.raises(CourseError, match="stop at 65535"):
        generate(course, uid=1234567)


def test_the_network_policy_takes_egress_from_this_jobs_pods_only(released, tmp_path):
    course = course_with(released, tmp_path, ["ada", "bob"])
    docs, manifest, _ = generate(course)
    policy = docs[1]
    assert policy["spec"]["policyTypes"] == ["Egress"] and "egress" not in policy["spec"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    pod_labels = job_of(docs)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert selector == {RUN_LABEL: manifest.run}
    other = course_with(released, tmp_path / "other", ["cy"])
    other_pods = job_of(generate(other)[0])["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= other_pods.items()


# -- runs: what a rerun includes, merging, a Job that ended --------------------------------------------------------


def _outcome(manifest: Manifest, index: int, student: str, kind: str = "timeout") -> None:
    """What a pod writes when a submission is done (batch.py's run_task): here one that timed out."""
    path = task_folder(manifest, index) / f"{ASSIGNMENT}--{student}.json"
    path.write_text(json.dumps({"kind": kind, "result": {}, "elapsed": 7.0, "detail": "stopped after 7 s"}))


def test_a_rerun_includes_only_what_is_neither_graded_nor_on_its_way(released, tmp_path):
    course = course_with(released, tmp_path, ["ada", "bob", "cy", "dee"])
    mark_graded(course, "ada")
    docs, first, rows = generate(course, per_pod=2)
    assert [s.student for i in range(len(first.tasks)) for s, _ in first.share(i)] == ["bob", "cy", "dee"]
    assert [(r.submission.student, r.status) for r in rows] == [("ada", "already graded")]
    assert job_of(docs)["spec"]["completions"] == 2
    assert set(elsewhere(course)) == {Submission(ASSIGNMENT, s) for s in ("bob", "cy", "dee")}

    docs, again, rows = generate(course)  # all on their way: no second Job
    assert docs == [] and again is None
    assert {r.submission.student: r.status for r in rows} == {"ada": "already graded", "bob": "not graded",
                                                               "cy": "not graded", "dee": "not graded"}
    assert all(first.job_id in r.reason for r in rows if r.status == "not graded")

    _outcome(first, 0, "bob")  # pod 0 has graded bob (his notebook timed out); cy and dee have no outcome
    merged = {r.submission.student: r for r in collect_runs(course)}
    assert merged["bob"].status == "timeout" and merged["bob"].reason == "stopped after 7 s"
    assert read_record(course, Submission(ASSIGNMENT, "bob"))["status"] == "timeout"
    assert merged["cy"].status == merged["dee"].status == "not graded"
    assert (first.folder / MANIFEST_NAME).is_file()

    ended = {r.submission.student: r for r in collect_runs(course, ended=(first.job_id,))}
    assert set(ended) == {"cy", "dee"} and {r.status for r in ended.values()} == {"failed"}
    assert "ended before grading it" in read_record(course, Submission(ASSIGNMENT, "dee"))["reason"]
    assert not first.folder.exists() and elsewhere(course) == {}

    _, third, _ = generate(course)  # the timed-out and the failed ones go again; ada stays graded
    assert [s.student for i in range(len(third.tasks)) for s, _ in third.share(i)] == ["bob", "cy", "dee"]
    with pytest.raises(CourseError, match="no open k8s-job run"):
        collect_runs(course, ended=("ddp-grade-nope",))


def test_slurm_collect_never_sees_a_k8s_run(released, tmp_path):
    """autograde --collect would take a run Slurm never heard of as ended: the k8s manifest is not its file."""
    from course.instructor.autograde.batch import pending_runs

    course = course_with(released, tmp_path, ["ada"])
    _, manifest, _ = generate(course)
    assert pending_runs(course) == [] and [h for h in elsewhere(course).values() if h.scheduler == "Slurm"] == []
    assert not manifest.path.exists()  # Slurm's manifest.json


def test_every_verb_leaves_a_k8s_runs_submissions_to_it(released, tmp_path):
    """A local autograde, autograde --slurm (its collect step here: no Slurm needed) and status all see the
    Job's submissions as on their way: none is graded twice, and each says where it is."""
    import io

    from rich.console import Console

    from course.instructor.autograde.run import run_autograde
    from course.instructor.autograde.slurm import SlurmOptions, run_slurm
    from course.instructor.status import course_status

    course = course_with(released, tmp_path, ["ada", "bob", "cy"])
    mark_graded(course, "cy")
    _, manifest, _ = generate(course, per_pod=1)
    away = elsewhere(course)
    assert {s.student for s in away} == {"ada", "bob"}
    assert {str(why).split(":")[0] for why in away.values()} == {f"on Kubernetes (job {manifest.job_id}, pod {i})"
                                                                 for i in (0, 1)}
    quiet = Console(file=io.StringIO())
    local = run_autograde(course, [ASSIGNMENT], console=quiet)
    assert {(r.submission.student, r.status) for r in local.rows} == {
        ("ada", "not graded"), ("bob", "not graded"), ("cy", "already graded")}
    assert all("k8s-job --collect" in r.reason for r in local.rows if r.status == "not graded")
    assert not (course.root / "autograded" / "ada").exists()
    collected = run_slurm(course, [ASSIGNMENT], options=SlurmOptions(), collect_only=True, console=quiet)
    assert {(r.submission.student, r.reason.split(":")[0]) for r in collected.rows} == {
        ("ada", f"on Kubernetes (job {manifest.job_id}, pod 0)"), ("bob", f"on Kubernetes (job {manifest.job_id}, pod 1)")}
    problems = {p[0]: p[1:3] for s in course_status(course) for p in s.problems}
    assert problems["ada"][0] == "on Kubernetes" and problems["ada"][1].startswith(f"job {manifest.job_id}, pod 0: ")


def test_the_verb_writes_yaml_on_stdout_and_talks_on_stderr(released, tmp_path):
    course = course_with(released, tmp_path, ["ada", "bob"])
    runner = CliRunner()
    result = runner.invoke(command, ["--pvc", "course-volume", "--per-pod", "2", "-C", str(course.root)])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["Job", "NetworkPolicy"] and job_of(docs)["spec"]["completions"] == 1
    assert "kubectl apply -f -" in result.stderr
    out = tmp_path / "job.yaml"
    again = runner.invoke(command, ["--pvc", "course-volume", "--force", "-o", str(out), "-C", str(course.root)])
    assert again.exit_code == 0 and "nothing to grade" in again.stderr and not out.exists()
    collected = runner.invoke(command, ["--collect", "-C", str(course.root)])
    assert collected.exit_code == 0 and "not graded" in collected.stdout
    assert runner.invoke(command, ["-C", str(course.root)]).exit_code == 2  # no --pvc
    assert runner.invoke(command, ["--ended", "x", "-C", str(course.root)]).exit_code == 2


def test_the_pod_entry_point_is_a_module_with_a_usage_line():
    proc = subprocess.run([sys.executable, "-m", "course.instructor.autograde.k8s"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "preflight" in proc.stderr
