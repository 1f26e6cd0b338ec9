"""Shared fixtures (executed lessons, once per test session) and how the suite runs on three workers.

``executed_lesson("01")`` runs ``lessons/01-*.ipynb`` top to bottom (nbclient,
kernel python3, in a temporary folder) the first time any test asks for it, and
returns the executed notebook; later calls get the same object.

The suite runs on three pytest-xdist workers (``-n 3 --dist loadfile`` in pyproject.toml): much
of its time is spent waiting (deadlines, timeouts, torchrun agents, Slurm), so three workers keep a
2-core machine busy (98% measured) where two left it idle part of the time. Each test file is one unit of work, so a file's session fixtures
(an executed lesson, the adversarial batches) are built once; the longest files start first.
Tests that look for leftovers look for their own (their temporary folder, their sandbox uids),
never for every process or folder on the machine. ``-n 0`` runs everything in this process.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
import warnings
from pathlib import Path

import cpu_profile
import nbformat
import pytest
import report_sections

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
CELL_TIMEOUT = 300  # seconds per cell; the whole notebook is bounded by each test's pytest timeout

_timings: dict[str, float] = {}

# Sandboxes graded by the suite take uids from the lower part of the sandbox's range; the adversarial
# attacks take the upper part (tests/adversarial/runs.py), so their "no process left behind" checks see
# their own sandboxes only, whatever the other worker is grading meanwhile.
os.environ.setdefault("DDP_COURSE_SANDBOX_UIDS", "61000-61399")


#: signals whose disposition a child process inherits when it is ignored or blocked: a test that leaves one ignored
#: in this worker (code run in-process by IPython, a library's handler) would make every later test's
#: ``ddp-course autograde`` deaf to Ctrl-C
_INHERITED = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signals_restored(request):
    """Each test leaves SIGINT and SIGTERM as it found them, neither ignored nor blocked (restored and reported
    as a warning naming the test otherwise)."""
    before = {sig: signal.getsignal(sig) for sig in _INHERITED}
    yield
    changed = [sig.name for sig in _INHERITED
               if signal.getsignal(sig) is not before[sig] and signal.getsignal(sig) == signal.SIG_IGN]
    blocked = [sig.name for sig in signal.pthread_sigmask(signal.SIG_BLOCK, []) if sig in _INHERITED]
    for sig in _INHERITED:
        signal.signal(sig, before[sig])
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _INHERITED)
    if changed or blocked:
        warnings.warn(f"{request.node.nodeid} left {', '.join(changed + blocked)} ignored or blocked (restored)",
                      stacklevel=1)


@pytest.fixture
def linked_tempdir(tmp_path, monkeypatch):
    """The temporary folder reached through a symbolic link, as macOS's /var/folders is (/private/var): what the
    checks make there has two names, the one they give and its real path."""
    import tempfile

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "linked"))
    return real


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


#: the longest files (seconds on this 2-core machine, measured with --durations: the sum of a file's tests, 3
#: workers; test_docker.py alone, quiet, 206 s: it runs where CI installs Docker) start first
LONGEST_FIRST = ("test_graders_ex4.py", "test_graders_ex4_elastic.py", "test_instructor.py", "test_docker",
                 "adversarial/test_attacks.py", "test_rootless.py", "test_slurm.py", "test_graders_ex3.py",
                 "test_grade.py", "test_graders_ex4_hang.py", "test_graders_ex2.py", "test_launch.py",
                 "test_graders_ex2_scratch.py", "test_pipeline.py", "test_graders_ex2_practice.py", "test_lesson4.py",
                 "test_graders_ex2_debug.py", "test_graders_ex3_fsdp.py", "adversarial/")


def _file_of(item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(Path(__file__).parent).as_posix()


def _rank(path: str) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    """The longest files first, each file's own order kept."""
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (_rank(_file_of(item)), order[id(item)]))


def _compile_sources() -> None:
    """Byte-compile the project's own modules once, before any worker starts.

    The suite starts hundreds of fresh interpreters that import course/ and graders/ (each sandboxed
    ``grade``'s CLI, kernel and verifier; torchrun's agents and workers). An editable install is never
    compiled by pip, and where ``PYTHONDONTWRITEBYTECODE`` is set (as on our machines) no import writes a
    cache either, so each of them compiled every module it imported from source again. Python reads an
    up-to-date cache whatever that variable says; a stale one is ignored (the source's mtime is in it)."""
    import compileall

    for folder in ("course", "graders", "tests"):
        if os.access(ROOT / folder, os.W_OK):  # not the rootless replay's user: it reads the caches root wrote
            compileall.compile_dir(str(ROOT / folder), quiet=2, workers=2)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or -n 0): once per run
        _compile_sources()
    cpu_profile.register(config)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Controller(), "ddp-course-xdist-controller")


#: test files that share session fixtures (an executed lesson, the attacks' batches) or one machine-wide resource
#: (the Docker engine): each set is one unit of work, on one worker, so nothing is built twice. Of the adversarial
#: files only test_attacks.py uses the batches; the forgeries, the sandbox's and the verifier's files are units of
#: their own, so they run beside the batches on the other workers instead of after them on the same one
UNITS = {"lessons": ("tests/test_lesson",), "adversarial": ("tests/adversarial/test_attacks.py",),
         "docker": ("tests/test_docker",)}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the set of files (UNITS) its file is in."""
    path = nodeid.split("::", 1)[0]
    return next((unit for unit, prefixes in UNITS.items() if path.startswith(prefixes)), path)


class _Controller:
    """The controller's side: xdist's scheduler with our units of work, and report_sections (a plugin of its
    own: these hooks exist only with xdist)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadFileScheduling

        class Units(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return unit_of(nodeid)

        return Units(config, log)

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


#: on the controller: per xdist worker, the seconds its tests took and when (since the session began) it reported
#: last; the summary's "workers" section shows how evenly the files were spread and how long the run's tail was
_workers: dict[str, list[float]] = {}
_began = time.monotonic()


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # set by xdist on the controller
    name = getattr(getattr(node, "gateway", None), "id", None)
    if name:
        busy = _workers.setdefault(name, [0.0, 0.0])
        busy[0] += report.duration
        busy[1] = time.monotonic() - _began


def pytest_terminal_summary(terminalreporter):
    if _workers:
        report_sections.add("workers (busy s, last report at s)", [
            f"{name}: {busy:.0f} s busy, last report at {last:.0f} s" for name, (busy, last) in sorted(_workers.items())])
    for title, lines in report_sections.sections:
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
