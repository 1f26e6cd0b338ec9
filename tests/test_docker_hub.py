"""The class server in its image (docker/Dockerfile, target hub; docker/compose.yml, profile hub): JupyterHub comes
up for a roster, a student logs in to their own lab, cannot read the exercise sources the image holds, and a
container made anew from the image on the same volumes keeps every account as it was (same uid, same password).

Build the image first (docker/ci/build.sh); image name: env DDP_COURSE_HUB_IMAGE (default ddp-course:hub).
Skipped without a Docker engine or the image, unless DDP_COURSE_REQUIRE_DOCKER=1 (CI), where it fails.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requirements_gate
from serving import hub_login, wait_for_http
from test_docker import image_built

ROOT = Path(__file__).resolve().parent.parent
HUB_IMAGE = os.environ.get("DDP_COURSE_HUB_IMAGE", "ddp-course:hub")

pytestmark = [pytest.mark.slow, pytest.mark.docker]


def unavailable(reason: str):
    requirements_gate.unavailable(reason, "DDP_COURSE_REQUIRE_DOCKER")


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        pytest.fail(f"docker {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def hub_image():
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
        unavailable("no Docker engine (docker/ci/install-engine.sh)")
    return image_built(HUB_IMAGE)


def login(url: str, user: str, password: str) -> float:
    """Log in through the hub's form and wait for the user's lab; returns the seconds it took."""
    started = time.monotonic()
    session = hub_login(url, user, password, next_url="")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        lab = session.get(f"{url}/user/{user}/lab", timeout=30)
        if lab.status_code == 200 and "JupyterLab" in lab.text:
            return time.monotonic() - started
        time.sleep(1)
    pytest.fail(f"{user}'s lab did not open: {lab.status_code} {lab.url}")


@pytest.mark.timeout(400)
def test_the_hub_image_serves_a_class_and_keeps_its_accounts(hub_image, tmp_path):
    tag = secrets.token_hex(3)
    student = f"ada{tag}"
    roster = tmp_path / "roster.csv"
    roster.write_text(f"username,role\n{student},student\ngrace{tag},instructor\n")
    roster.chmod(0o644)
    name, volumes = f"ddp-course-hub-{tag}", (f"ddp-course-hub-class-{tag}", f"ddp-course-hub-homes-{tag}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def start() -> None:
        docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", "--shm-size", "1g",
               "-v", f"{roster}:/etc/ddp-course/roster.csv:ro", "-v", f"{volumes[0]}:/srv/ddp-course",
               "-v", f"{volumes[1]}:/home", hub_image)
        wait_for_http(f"{url}/hub/api", "the hub's container", lambda: docker("logs", name, check=False).stderr[-4000:],
                      every_s=1)

    try:
        start()
        passwords = docker("exec", name, "cat", "/srv/ddp-course/hub/passwords.csv").stdout
        password = dict(line.split(",", 1) for line in passwords.splitlines()[1:])[student]
        login(url, student, password)
        source = docker("exec", name, "sh", "-c", "ls /opt/ddp-course-src/exercises/*/*.ipynb | head -1").stdout.strip()
        peek = docker("exec", "-u", student, name, "cat", source, check=False)
        assert peek.returncode != 0 and "Permission denied" in peek.stderr, "a student read an exercise source"
        owner = docker("exec", name, "stat", "-c", "%U %a", f"/home/{student}/ddp-course-work").stdout.split()
        assert owner == [student, "700"], owner

        docker("rm", "-f", name)  # the container goes; the class and the homes stay on their volumes
        start()
        log = docker("logs", name).stdout
        assert "made again as they were: 2" in log, log
        login(url, student, password)  # the same password still lets them in
        owner = docker("exec", name, "stat", "-c", "%U", f"/home/{student}/ddp-course-work").stdout.strip()
        assert owner == student, "the student's files are no longer theirs after the container was made anew"
    finally:
        docker("rm", "-f", name, check=False)
        docker("volume", "rm", *volumes, check=False)


def test_compose_describes_the_class_server():
    compose = (["docker", "compose"] if subprocess.run(["docker", "compose", "version"], capture_output=True)
               .returncode == 0 else ["docker-compose"] if shutil.which("docker-compose") else None)
    if compose is None:
        unavailable("neither `docker compose` nor docker-compose is installed")
    proc = subprocess.run([*compose, "-f", str(ROOT / "docker" / "compose.yml"), "--profile", "hub", "config"],
                          capture_output=True, text=True, env={**os.environ, "DDP_COURSE_ROSTER": "/tmp/roster.csv"})
    assert proc.returncode == 0, proc.stderr
    import yaml

    hub = yaml.safe_load(proc.stdout)["services"]["hub"]
    assert hub["build"]["target"] == "hub" and hub["image"] == "ddp-course:hub"
    targets = {v["target"] if isinstance(v, dict) else v.split(":")[1] for v in hub["volumes"]}  # v2 / v1 output
    assert {"/etc/ddp-course/roster.csv", "/srv/ddp-course", "/home"} <= targets
