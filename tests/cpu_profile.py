"""CPU seconds per test file, the test's own processes included (``DDP_COURSE_CPU_PROFILE=1``; Linux, root, a
cgroup v1 ``cpuacct`` hierarchy, as on the project's machines).

Wall time says little on a 2-core machine shared by three workers: a test that waits on a deadline costs its
worker's time but leaves the cores to the others. Each worker moves itself into a ``cpuacct`` cgroup of its own,
which every process it starts inherits (rank processes, kernels, torchrun agents, sandboxed gradings: the sandbox
uses other controllers), and reads the cgroup's CPU time around each test. What runs under another service's
cgroup (Docker's containers, Slurm's jobs) is not counted here. The report's "CPU by file" section lists the
files, costliest first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import report_sections

ROOT = Path("/sys/fs/cgroup/cpuacct")
TOP_TESTS = 25  # per worker


class CpuProfile:
    def __init__(self, name: str):
        self.group = ROOT / f"ddp-course-profile-{name}-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        self.by_test: dict[str, float] = {}  # nodeid -> CPU seconds
        self._at = 0.0
        report_sections.at_session_end(self._report)

    def _usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(tryfirst=True)  # before the fixtures are set up: their cost is the test's
    def pytest_runtest_setup(self, item):
        self._at = self._usage()

    @pytest.hookimpl(trylast=True)  # after they are torn down
    def pytest_runtest_teardown(self, item, nextitem):
        self.by_test[item.nodeid] = self._usage() - self._at

    def pytest_unconfigure(self, config):
        try:
            (ROOT / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()
        except OSError:
            pass  # a process of ours still in it: the group stays, empty once it ends

    def _report(self):
        by_file: dict[str, float] = {}
        for test, seconds in self.by_test.items():
            path = test.split("::", 1)[0].removeprefix("tests/")
            by_file[path] = by_file.get(path, 0.0) + seconds
        report_sections.add(f"CPU by file ({self.group.name}; s; not Docker's or Slurm's)", [
            f"{seconds:7.1f} {path}" for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])]
            + ["costliest tests:"] + [f"{seconds:7.1f} {test}" for test, seconds in
                                      sorted(self.by_test.items(), key=lambda kv: -kv[1])[:TOP_TESTS]])


def register(config) -> None:
    if os.environ.get("DDP_COURSE_CPU_PROFILE") != "1" or not (ROOT / "cgroup.procs").exists():
        return
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is None and config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        return  # the controller runs no tests
    try:
        profile = CpuProfile(worker or "main")
    except OSError:  # not root (tests/test_rootless.py's replay as nobody): no profile
        return
    config.pluginmanager.register(profile, "ddp-course-cpu-profile")
