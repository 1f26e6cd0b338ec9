"""Shared fixtures (executed lessons, once per test session) and how the suite runs on two workers.

``executed_lesson("01")`` runs ``lessons/01-*.ipynb`` top to bottom (nbclient,
kernel python3, in a temporary folder) the first time any test asks for it, and
returns the executed notebook; later calls get the same object.

The suite runs on pytest-xdist workers (``-n 2 --dist loadgroup`` in pyproject.toml): most
of its time is spent waiting (deadlines, timeouts, torchrun agents, Slurm), so two workers on
two cores finish in about 60% of the time. Each test file is one unit of work, so a file's
session fixtures (an executed lesson, the adversarial batches) are built once; files that share
a machine-wide resource (the Slurm cluster, the Docker engine, the sandbox's fork bombs) share a
group and never run at the same time; the longest files start first. ``-n 0`` runs everything
in this process (longest files first, each file in its own order).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import nbformat
import pytest
import report_sections

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
CELL_TIMEOUT = 300  # seconds per cell; the whole notebook is bounded by each test's pytest timeout

_timings: dict[str, float] = {}

def lesson_path(key: str) -> Path:
    """The one lesson notebook whose name starts with ``key`` ("01" or "01-data-vs-model-parallelism")."""
    matches = sorted(LESSONS.glob(f"{key}*.ipynb"))
    if len(matches) != 1:
        raise LookupError(f"expected one lessons/{key}*.ipynb, found {[m.name for m in matches]}")
    return matches[0]


def execute_lesson(path: Path) -> tuple[nbformat.NotebookNode, float]:
    """Execute the notebook (in memory) with a fresh temporary folder as its cwd; return it and the seconds it took."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="ddp-course-lesson-") as tmp:
        client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                resources={"metadata": {"path": tmp}})
        start = time.monotonic()
        client.execute()
        return nb, time.monotonic() - start


@pytest.fixture(scope="session")
def executed_lesson():
    """``executed_lesson(key)`` -> the executed notebook, run once per session (a failure is cached too)."""
    cache: dict[str, nbformat.NotebookNode | BaseException] = {}

    def get(key: str) -> nbformat.NotebookNode:
        path = lesson_path(key)
        if path.name not in cache:
            try:
                nb, seconds = execute_lesson(path)
                _timings[path.name] = seconds
                print(f"executed {path.name} in {seconds:.1f} s")
                cache[path.name] = nb
            except BaseException as exc:  # noqa: BLE001 - re-raised to every test that asks
                cache[path.name] = exc
        found = cache[path.name]
        if isinstance(found, BaseException):
            raise found
        return found

    return get


#: files that use one machine-wide resource run in one group (one after another, on one worker)
SHARED = {
    "docker": ("test_docker.py", "test_docker_ci.py"),
    # the sandbox's limits per uid (fork bombs, memory hogs): as root and as nobody, one at a time
    "sandbox-attacks": ("adversarial/", "test_rootless.py"),
}
#: the longest files (seconds on this 2-core machine, measured with --durations) start first
LONGEST_FIRST = ("test_graders_ex4.py", "test_instructor.py", "adversarial/", "test_rootless.py", "test_slurm.py",
                 "test_graders_ex2_debug.py", "test_graders_ex2.py", "test_launch.py", "test_graders_ex3_fsdp.py",
                 "test_pipeline.py", "test_grade.py", "test_graders_ex2_practice.py", "test_lesson4.py")


def _file_of(item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(Path(__file__).parent).as_posix()


def _group(path: str) -> str:
    for group, prefixes in SHARED.items():
        if any(path.startswith(prefix) for prefix in prefixes):
            return group
    return path


def _rank(path: str) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)), len(LONGEST_FIRST))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    """One xdist group per test file (or per shared resource); the longest files first, each file's order kept."""
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (_rank(_file_of(item)), order[id(item)]))
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(_group(_file_of(item))))


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Controller(), "ddp-course-xdist-controller")


class _Controller:
    """The controller's side of report_sections (a plugin of its own: the hook exists only with xdist)."""

    @staticmethod
    def pytest_testnodedown(node, error):
        report_sections.received(getattr(node, "workeroutput", {}))


def pytest_sessionfinish(session):
    if _timings:
        report_sections.add("lesson execution times", [f"{n}: {s:.1f} s" for n, s in sorted(_timings.items())])
    report_sections.finish()
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the sections to the controller
        session.config.workeroutput[report_sections.KEY] = list(report_sections.sections)
        report_sections.sections.clear()


def pytest_terminal_summary(terminalreporter):
    for title, lines in report_sections.sections:
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
