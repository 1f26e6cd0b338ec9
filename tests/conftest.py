"""Shared fixtures: executed lessons, once per test session.

``executed_lesson("01")`` runs ``lessons/01-*.ipynb`` top to bottom (nbclient,
kernel python3, in a temporary folder) the first time any test asks for it, and
returns the executed notebook; later calls get the same object.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import nbformat
import pytest

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


def pytest_terminal_summary(terminalreporter):
    if _timings:
        terminalreporter.section("lesson execution times")
        for name, seconds in sorted(_timings.items()):
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
