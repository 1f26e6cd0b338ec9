"""A class on one server, end to end: `ddp-course hub start` with a real JupyterHub, real Linux accounts, a real
browser, nbgrader's exchange.

A student logs in through the hub's login page in headless Chromium, fetches an exercise from the lab's
Assignments list, runs its checks in the notebook (their answers written into the fetched copy, as they would
type them), sees their progress page and submits. The instructor, in their own account (the commands their
lab's terminal runs), collects, autogrades, writes and releases feedback; the student fetches it. A second
student tries what a classmate could: read the first one's work, submit in their name, read the course or the
hub's secrets, open their progress page; all of it fails and nothing of it changes the first one's grade.

Needs root (the hub makes accounts and starts each server as its user), JupyterHub, configurable-http-proxy
and the browser (docker/ci/install-hub.sh, install-browser.sh); skipped without them unless
DDP_COURSE_REQUIRE_HUB=1 (CI), where it fails. The course is served from a copy of its code (what a
non-editable install holds) and a copy of its sources closed to other users, as the hub demands.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
import requirements_gate
import submissions
from serving import hub_login, wait_for_http

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = os.environ.get("DDP_COURSE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ASSIGNMENT, NOTEBOOK = "ex1-parallelism", "expert_parallel"
COURSE_ID = "ddp-course"

pytestmark = [pytest.mark.slow, pytest.mark.hub]


def unavailable(reason: str):
    requirements_gate.unavailable(reason, "DDP_COURSE_REQUIRE_HUB")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def as_user(user: str, script: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` in bash as the Linux user ``user`` (what a terminal of theirs runs), from their home."""
    home = pwd.getpwnam(user).pw_dir
    argv = ["runuser", "-u", user, "--", "env", "-i", f"HOME={home}", f"USER={user}", f"LOGNAME={user}",
            *(f"{k}={v}" for k, v in env.items()), "bash", "-c", f"cd {home} && {script}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


class ClassServer:
    def __init__(self, base: Path):
        tag = secrets.token_hex(3)
        self.student, self.classmate, self.instructor = f"ada{tag}", f"bob{tag}", f"grace{tag}"
        self.group = f"ddpi{tag}"
        self.base = base
        self.folder = base / "class"
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"  # the hub serves HTTPS with its own certificate
        self.cert, self.key = base / "tls" / "cert.pem", base / "tls" / "key.pem"
        self.install = base / "install"  # the course's code, as a non-editable install holds it
        self.sources = base / "sources"  # the course's lessons and exercise sources, root only
        self.process = None
        self.log = None

    def user_env(self, role: str) -> dict:
        """The environment of a terminal in a server of ``role`` (course/hub/singleuser.py sets the same)."""
        return {"PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
                "PYTHONPATH": str(self.install),
                "JUPYTER_CONFIG_PATH": str(self.folder / "config" / role)}

    def password(self, user: str) -> str:
        for line in (self.folder / "hub" / "passwords.csv").read_text().splitlines():
            name, _, password = line.partition(",")
            if name == user:
                return password
        raise KeyError(user)

    def start(self) -> None:
        for name in ("course", "graders"):
            shutil.copytree(ROOT / name, self.install / name, ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("lessons", "exercises"):
            shutil.copytree(ROOT / name, self.sources / name)
        os.chmod(self.sources, 0o700)
        subprocess.run(["chmod", "-R", "a+rX", str(self.install)], check=True)
        roster = self.base / "roster.csv"
        roster.write_text(f"username,role,name\n{self.student},student,Ada\n{self.classmate},student,Bob\n"
                          f"{self.instructor},instructor,Grace\n")
        self.cert.parent.mkdir(mode=0o700)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(self.key),
                        "-out", str(self.cert)], check=True, capture_output=True)
        env = {**os.environ, "PYTHONPATH": str(self.install), "DDP_COURSE_ROOT": str(self.sources)}
        self.log = open(self.base / "hub.log", "w")  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "course.cli", "hub", "start", "--roster", str(roster), "--dir", str(self.folder),
             "--port", str(self.port), "--instructor-group", self.group, "--ssl-cert", str(self.cert),
             "--ssl-key", str(self.key), "--cull-idle-after", "30"],
            env=env, cwd=self.base, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_http(f"{self.url}/hub/api", "the hub", self.logs, self.process, cafile=str(self.cert))
        self.up_after = time.monotonic() - self.started

    def logs(self) -> str:
        self.log.flush()
        return (self.base / "hub.log").read_text()[-6000:]

    def stop(self) -> None:
        import psutil

        # what the hub started, services and proxy included (each in a session of its own, out of the hub's
        # process group): whatever JupyterHub does not stop on its way out is killed after it
        try:
            started = psutil.Process(self.process.pid).children(recursive=True) if self.process else []
        except psutil.NoSuchProcess:
            started = []
        if self.process is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                    self.process.wait(timeout=30)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        for child in started:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        for user in (self.student, self.classmate, self.instructor):
            subprocess.run(["pkill", "-KILL", "-u", user], capture_output=True)
        time.sleep(0.5)
        for user in (self.student, self.classmate, self.instructor):
            subprocess.run(["userdel", "--remove", user], capture_output=True)
        subprocess.run(["groupdel", self.group], capture_output=True)
        if self.log is not None:
            self.log.close()


@pytest.fixture(scope="module")
def hub():
    if os.geteuid() != 0:
        unavailable("the class server needs root (it makes Linux accounts)")
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        unavailable("JupyterHub is not installed (pip install -e '.[dev]')")
    if shutil.which("configurable-http-proxy") is None or shutil.which("openssl") is None:
        unavailable("configurable-http-proxy or openssl is not installed (docker/ci/install-hub.sh)")
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        unavailable("playwright is not installed (docker/ci/install-browser.sh)")
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"no chromium at {CHROMIUM} (docker/ci/install-browser.sh)")
    # the students' servers run as their own users: every folder the class uses must be one they can enter
    base = Path(tempfile.mkdtemp(prefix="ddp-course-hub-", dir="/tmp"))
    os.chmod(base, 0o755)
    server = ClassServer(base)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def lab_settings(home: Path, user: str) -> None:
    """The student's JupyterLab settings, as they could set them: every cell rendered (no windowing, so the page
    holds every output), no news toast over the notebook."""
    settings = home / ".jupyter" / "lab" / "user-settings" / "@jupyterlab"
    for path, value in ((settings / "notebook-extension" / "tracker.jupyterlab-settings", {"windowingMode": "none"}),
                        (settings / "apputils-extension" / "notification.jupyterlab-settings",
                         {"fetchNews": "false", "checkForUpdates": False})):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    subprocess.run(["chown", "-R", f"{user}:{user}", str(home / ".jupyter")], check=True)


def solved_copy(fetched: Path) -> None:
    """Write the reference answers into the student's fetched copy (as a student would type them)."""
    reference = submissions.load(ASSIGNMENT, NOTEBOOK)
    nb = nbformat.read(fetched, as_version=4)
    for grade_id in submissions.answer_ids(reference):
        nb = submissions.replace_answer(nb, grade_id, submissions.answer(reference, grade_id))
    st = fetched.stat()
    nbformat.write(nb, fetched)
    os.chown(fetched, st.st_uid, st.st_gid)


def test_a_class_runs_on_one_server(hub):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    instructor = hub.user_env("instructor")
    course = hub.folder / "course"

    # the instructor releases the exercise from their own account, as their lab's terminal does
    released = as_user(hub.instructor, f"umask 002 && cd {course} && ddp-course release {ASSIGNMENT} && "
                                       f"nbgrader release_assignment {ASSIGNMENT}", instructor)
    assert released.returncode == 0, released.stdout + released.stderr

    workspace = Path(pwd.getpwnam(hub.student).pw_dir) / "ddp-course-work"
    lab_settings(Path(pwd.getpwnam(hub.student).pw_dir), hub.student)
    fetched = workspace / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    timings = {"hub up": round(hub.up_after, 1)}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, ignore_https_errors=True)
            started = time.monotonic()
            page.goto(f"{hub.url}/hub/login")
            page.fill("#username_input", hub.student)
            page.fill("#password_input", hub.password(hub.student))
            page.click("#login_submit")
            page.wait_for_url(f"**/user/{hub.student}/lab**", timeout=60_000)
            page.locator(".jp-DirListing-item", has_text="lessons").first.wait_for(timeout=60_000)
            timings["login to open lab"] = round(time.monotonic() - started, 1)

            # the lab is the student's: lessons, no instructor tools
            menus = page.locator(".lm-MenuBar-itemLabel").all_inner_texts()
            page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").first.click()
            items = [i for i in page.locator(".lm-Menu-itemLabel").all_inner_texts() if i.strip()]
            assert items == ["Assignment List"], f"a student's Nbgrader menu offers {items} (menus {menus})"
            page.locator(".lm-Menu-itemLabel", has_text="Assignment List").first.click()
            page.get_by_role("button", name="Fetch").first.click(timeout=60_000)
            page.get_by_role("button", name="Submit").first.wait_for(timeout=60_000)
            assert fetched.is_file(), f"the Fetch button did not put {fetched} in the workspace"
            assert pwd.getpwuid(fetched.stat().st_uid).pw_name == hub.student

            # the student's answers, then Run All: the visible checks run in their kernel, as them
            solved_copy(fetched)
            page.goto(f"{hub.url}/user/{hub.student}/lab/tree/{ASSIGNMENT}/{NOTEBOOK}.ipynb")
            # Run All before the kernel is up skips the cells: wait until their server has an idle kernel for the
            # notebook (asked with the browser's own login) and the page shows it idle
            deadline = time.monotonic() + 120
            while not any(s.get("kernel", {}).get("execution_state") == "idle"
                          for s in page.request.get(f"{hub.url}/user/{hub.student}/api/sessions").json()):
                assert time.monotonic() < deadline, "no idle kernel for the notebook after 120 s"
                time.sleep(0.5)
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(
                state="attached", timeout=90_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            notebook = page.locator(".jp-Notebook:visible")
            page.wait_for_function(
                """() => document.querySelectorAll('.jp-CodeCell .jp-InputPrompt').length > 0
                       && [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                            .every(p => /\\[\\d+\\]/.test(p.textContent))
                       && document.querySelector(".jp-Notebook-ExecutionIndicator[data-status='idle']")""",
                timeout=300_000)
            page.screenshot(path=str(ARTIFACTS / "hub-student-notebook.png"))
            text = notebook.inner_text()
            tests = [c for c in submissions.load(ASSIGNMENT, NOTEBOOK).cells
                     if c.metadata.get("nbgrader", {}).get("grade")]
            assert text.count("passed check_") >= len(tests), f"the visible checks did not all pass:\n{text[-3000:]}"

            # their progress page, through the hub (its Services menu), shows what their kernel recorded
            page.goto(f"{hub.url}/hub/home")
            assert page.locator("a[href*='/services/progress']").count() >= 1, "no link to the progress page"
            page.goto(f"{hub.url}/services/progress/")
            page.get_by_text(f"Progress of {hub.student}").wait_for(timeout=30_000)
            progress = page.locator("body").inner_text()
            page.screenshot(path=str(ARTIFACTS / "hub-student-progress.png"))
            assert f"{ASSIGNMENT}/{NOTEBOOK}.ipynb" in progress and "passed" in progress, progress
            assert "failed" not in progress, progress
            assert "lessons/01-" in progress and "not started" in progress, "the page lists the lessons to run"
            page.goto(f"{hub.url}/services/progress/?student={hub.classmate}")
            assert "403" in page.locator("body").inner_text()

            # submit from the Assignments list
            page.goto(f"{hub.url}/user/{hub.student}/lab")
            page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Assignment List").first.click()
            page.get_by_role("button", name="Submit").first.click(timeout=60_000)
            deadline = time.monotonic() + 30
            while not list((hub.folder / "exchange" / COURSE_ID / "inbound" / hub.student).glob("*")):
                assert time.monotonic() < deadline, "the Submit button put nothing in the student's inbound folder"
                time.sleep(0.5)
        finally:
            browser.close()
    (ARTIFACTS / "hub-timings.json").write_text(json.dumps(timings, indent=1))

    # the student's own check in their lab's terminal: the grader's pipeline on their fetched copy
    checked = as_user(hub.student, f"cd ddp-course-work && ddp-course check {ASSIGNMENT}/{NOTEBOOK}.ipynb",
                      {**hub.user_env("student"), "DDP_COURSE_ROOT": str(hub.folder / "edition")})
    assert checked.returncode == 0 and "hidden variant" in checked.stdout, checked.stdout + checked.stderr
    assert not (workspace / "exercises").exists(), "a class server's workspace takes the lessons only"

    # a classmate tries what the exchange's default allows, and more
    classmate = hub.user_env("student")
    inbound = hub.folder / "exchange" / COURSE_ID / "inbound"
    attempts = {
        "read the first student's workspace": f"ls {workspace}",
        "read the first student's submission": f"ls {inbound / hub.student}",
        "list every submission": f"ls {inbound}",
        "read the course (sources, gradebook)": f"ls {course}/source",
        "read the hub's secrets": f"cat {hub.folder}/hub/passwords.csv",
        "read the exercise sources": f"cat {hub.sources}/exercises/{ASSIGNMENT}/{NOTEBOOK}.ipynb",
        "list the feedback": f"ls {hub.folder}/exchange/{COURSE_ID}/feedback",
    }
    for what, script in attempts.items():
        result = as_user(hub.classmate, script, classmate)
        assert result.returncode != 0 and "Permission denied" in result.stderr, f"a classmate could {what}: {result}"
    fetch = as_user(hub.classmate, f"mkdir -p ddp-course-work && cd ddp-course-work && nbgrader fetch_assignment {ASSIGNMENT} --course {COURSE_ID}",
                    classmate)
    assert fetch.returncode == 0, fetch.stdout + fetch.stderr
    as_them = as_user(hub.classmate, f"cd ddp-course-work && nbgrader submit {ASSIGNMENT} --course {COURSE_ID} "
                                     f"--student {hub.student}", classmate)
    assert as_them.returncode != 0 and "as yourself" in as_them.stdout + as_them.stderr, as_them
    forged = f"{inbound / hub.classmate}/{hub.student}+{ASSIGNMENT}+2099-01-01 00:00:00.000000 UTC+forged"
    planted = as_user(hub.classmate, f"cp -r ddp-course-work/{ASSIGNMENT} '{forged}'", classmate)
    assert planted.returncode == 0, planted.stderr  # their own folder: they may write there, it is not filed

    # the instructor collects, grades, writes and releases feedback
    graded = as_user(hub.instructor, f"umask 002 && cd {course} && nbgrader collect {ASSIGNMENT} && "
                                     f"ddp-course autograde {ASSIGNMENT} && ddp-course feedback {ASSIGNMENT} && "
                                     f"nbgrader release_feedback {ASSIGNMENT}", instructor, timeout=400)
    output = graded.stdout + graded.stderr
    assert graded.returncode == 0, output
    assert "Not collected" in output and f"named for {hub.student!r}" in output, output
    submitted = course / "submitted"
    assert sorted(p.name for p in submitted.iterdir()) == [hub.student], "only the real submission is filed"
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", COURSE_ID) as gradebook:
        score = gradebook.find_submission_notebook(NOTEBOOK, ASSIGNMENT, hub.student).score
        students = sorted(s.id for s in gradebook.students)
    assert score == sum(submissions.full_marks(ASSIGNMENT, NOTEBOOK).values()), score
    assert students == [hub.student], students

    # the student fetches the feedback from their Assignments list and reads it in the browser
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, ignore_https_errors=True)
            page.goto(f"{hub.url}/hub/login")
            page.fill("#username_input", hub.student)
            page.fill("#password_input", hub.password(hub.student))
            page.click("#login_submit")
            page.wait_for_url(f"**/user/{hub.student}/lab**", timeout=60_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Assignment List").first.click()
            page.get_by_role("button", name="Fetch Feedback").first.click(timeout=60_000)
            deadline = time.monotonic() + 60
            while not (pages := list((workspace / ASSIGNMENT / "feedback").rglob(f"{NOTEBOOK}.html"))):
                assert time.monotonic() < deadline, "Fetch Feedback put no feedback in the workspace"
                time.sleep(0.5)
            relative = pages[0].relative_to(workspace).as_posix()
            page.goto(f"{hub.url}/user/{hub.student}/files/{relative}")
            page.get_by_text("passed check_").first.wait_for(timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "hub-student-feedback.png"))
            shown = page.locator("body").inner_text()
            assert "BEGIN HIDDEN TESTS" not in shown and "check_moe_outputs(moe_layer, world_size" not in shown
        finally:
            browser.close()

    # the instructor's class view, through the hub: who passed what, the classmate's empty row
    view = hub_session(hub, hub.instructor).get(f"{hub.url}/services/progress/?format=json", timeout=30)
    assert view.status_code == 200, view.text[:2000]
    students = view.json()["students"]
    assert sorted(students) == [hub.student, hub.classmate], students
    mine = students[hub.student]
    assert mine["passing"] >= len(tests) and mine["failing"] == 0 and mine["stuck"] is None, mine
    assert students[hub.classmate]["passing"] == 0, students

    # the idle culler, a service of the hub's, asked the hub for its users with its own scopes
    hub.log.flush()
    log = (hub.base / "hub.log").read_text()
    culled = [line for line in log.splitlines() if "/hub/api/users" in line and "idle-culler" in line]
    assert culled and all(" 200 " in line for line in culled), culled or [x for x in log.splitlines() if "cull" in x]

    # the instructor's tools are the instructors': a student's server has no formgrader, and the student no class view
    student = hub_session(hub, hub.student)
    formgrader = student.get(f"{hub.url}/user/{hub.student}/formgrader", timeout=60)
    assert formgrader.status_code == 404, (formgrader.status_code, formgrader.text[:500])
    own = student.get(f"{hub.url}/services/progress/?format=json", timeout=30).json()
    assert own["student"] == hub.student and "students" not in own, own


def hub_session(hub, user: str):
    """A requests session logged in to the hub as ``user``."""
    return hub_login(hub.url, user, hub.password(user), cert=str(hub.cert))
