"""A real browser runs lesson 1 and opens an exercise in the student's workspace: JupyterLab started by
`ddp-course lab`, driven by headless Chromium.

Playwright (pip install playwright) drives Debian's chromium (/usr/bin/chromium, or env
DDP_COURSE_CHROMIUM): Playwright cannot download its own browser here. Without either the test
skips, unless DDP_COURSE_REQUIRE_BROWSER=1 (CI: docker/ci/install-browser.sh), where it fails.
The screenshot lands in artifacts/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import requirements_gate
from serving import wait_for_http

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = os.environ.get("DDP_COURSE_CHROMIUM", "/usr/bin/chromium")
TOKEN = "ddp-course-browser"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_DEADLINE_MS = 300_000  # lesson 1 runs ~30 s on 2 busy cores; a stuck run fails well before pytest's timeout

pytestmark = pytest.mark.slow


def unavailable(reason: str):
    """Skip, or fail where DDP_COURSE_REQUIRE_BROWSER=1 (CI)."""
    requirements_gate.unavailable(reason, "DDP_COURSE_REQUIRE_BROWSER")


@pytest.fixture
def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed (docker/ci/install-browser.sh)")
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"no chromium at {CHROMIUM} (docker/ci/install-browser.sh)")
    return sync_playwright


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """`ddp-course lab` on a temporary workspace (made from the course), with its own settings: (base URL, lesson 1's
    name)."""
    lessons = sorted((ROOT / "lessons").glob("01-*.ipynb"))
    if not lessons:
        pytest.fail("no lessons/01-*.ipynb in the repository")
    root = tmp_path / "course"
    shutil.copytree(ROOT / "lessons", root / "lessons")
    settings = tmp_path / "settings"
    # Render every cell (no windowing), so outputs far down the notebook are in the page.
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    # No "official Jupyter news?" toast over the notebook, no requests to jupyter.org.
    notices = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notices.parent.mkdir(parents=True)
    notices.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    port = free_port()
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115 - closed below, after the server stops
    server = subprocess.Popen(
        [sys.executable, "-m", "course.cli", "lab", "--dir", str(root), "--no-browser", "--port", str(port),
         "--ip", "127.0.0.1", f"--ServerApp.token={TOKEN}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI runs as root
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base_url}/api/status?token={TOKEN}", "`ddp-course lab`",
                      lambda: (tmp_path / "lab.log").read_text()[-4000:], server, every_s=0.5)
        yield base_url, lessons[0].name
    finally:
        # The server, its kernel and the kernel's rank processes share the session started above.
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()


def wait_for_idle_kernel(base_url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with urllib.request.urlopen(f"{base_url}/api/sessions?token={TOKEN}", timeout=5) as resp:
            sessions = json.load(resp)
        if any(s.get("kernel", {}).get("execution_state") == "idle" for s in sessions):
            return
        time.sleep(0.5)
    pytest.fail(f"no idle kernel for the notebook after {deadline_s} s: sessions {sessions}")


@pytest.mark.timeout(600)
def test_lesson_1_runs_in_a_real_browser(sync_playwright, lab):
    base_url, lesson = lab
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "browser-lesson-01.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base_url}/lab/tree/lessons/{lesson}?token={TOKEN}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=90_000)
            # Run All before the kernel is up skips the cells: wait until the server has an idle kernel
            # for the notebook and the page shows it idle.
            wait_for_idle_kernel(base_url, deadline_s=90)
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(
                state="attached", timeout=90_000)

            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            rank_output = page.locator(".jp-OutputArea-output", has_text="[rank 1]").first
            try:
                rank_output.wait_for(state="attached", timeout=RUN_DEADLINE_MS)
                # Run All is done when no cell is queued or running ("[*]") and the kernel is idle.
                page.wait_for_function(
                    """() => ![...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'))
                           && document.querySelector(".jp-Notebook-ExecutionIndicator[data-status='idle']")""",
                    timeout=RUN_DEADLINE_MS)
            finally:
                page.screenshot(path=str(shot))
            rank_output.scroll_into_view_if_needed()
            page.screenshot(path=str(shot))

            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                  has_text="Traceback")
            assert errors.count() == 0, f"a cell raised in the browser:\n{errors.first.inner_text()[:3000]}"
            code_cells = page.locator(".jp-CodeCell").count()
            ran = page.locator(".jp-CodeCell .jp-InputPrompt", has_text="[").all_inner_texts()
            assert code_cells > 0 and sum(1 for text in ran if text.strip("[]: ").isdigit()) == code_cells, (
                f"not every code cell ran: prompts {ran}")
            assert "world_size=" in page.locator(".jp-Notebook").inner_text()

            # the same workspace holds the exercise as students get it: no solution, no instructor menu
            exercise = ARTIFACTS / "browser-exercise-01.png"
            page.goto(f"{base_url}/lab/tree/exercises/ex1-parallelism/parallelism.ipynb?token={TOKEN}")
            notebook = page.locator(".jp-Notebook:visible")  # the lesson's tab stays open behind it
            notebook.get_by_text("def shard_batch").first.wait_for(timeout=90_000)
            text = notebook.inner_text()
            page.screenshot(path=str(exercise))
            assert "raise NotImplementedError" in text and "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
            menus = page.locator(".lm-MenuBar-itemLabel").all_inner_texts()
            assert "Run" in menus and not [m for m in menus if "nbgrader" in m.lower()], menus
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000


@pytest.mark.browser
@pytest.mark.timeout(180)
def test_report_page_shows_its_tables_and_plots_in_a_real_browser(sync_playwright, tmp_path):
    """`ddp-course report`'s page (the graded tiny class of test_instructor_views) as a browser renders it."""
    from test_instructor_views import report_page

    _, page_file = report_page(tmp_path)
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(page_file.as_uri())
            rows = {name: page.locator(f"table#{name} tbody tr").count()
                    for name in ("assignments", "checks", "students", "grading-time")}
            assert rows == {"assignments": 1, "checks": 4, "students": 6, "grading-time": 2}, rows
            checks = page.locator("table#checks").inner_text()
            assert "test_double_visible" in checks and "double(2) should be 4" in checks, checks
            assert "FAILED check_rank_sum [rank 1]: the job did not finish within 20 s" in checks
            plots = page.locator("figure.plot svg")
            assert plots.count() == 3
            for index in range(plots.count()):  # drawn, with room on the page, and their labels are text
                box = plots.nth(index).bounding_box()
                assert box and box["width"] > 200 and box["height"] > 80, box
            assert "test_rank_sum" in plots.nth(1).text_content()
            page.screenshot(path=str(ARTIFACTS / "browser-report.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "browser-report.png").stat().st_size > 10_000
