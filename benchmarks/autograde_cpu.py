"""CPU seconds per graded submission, split by process role: where autograde's CPU goes.

    python benchmarks/autograde_cpu.py [--submissions 4] [--assignment ex1-parallelism] [--jobs 1]

Prepares a course with N reference submissions (as autograde_bench.py does), runs
``ddp-course autograde --jobs J`` (or ``--nbgrader``: plain ``nbgrader autograde``)
and samples /proc every 20 ms for every process it starts, keeping each process's
last CPU time (user + system) and its command line. Processes are grouped by role
(the command, an autograde worker, a sandbox wrapper, a kernel, a verifier, a
forkserver, a rank, ...) and the table gives CPU seconds per submission for each.
Sampling misses only what a process spends in its last 20 ms; the total is checked
against the command's own rusage (children included) and both are printed.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from autograde_bench import check, prepare  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def role(cmd: str, parent_role: str | None) -> str:
    """What a process is, from its command line and, for a forked one, its name (``cmd [name]``)."""
    named = {"[sandbox]": "sandbox wrapper", "[ipykernel_launc]": "kernel", "[verifier]": "verifier",
             "[forkserver]": "forkserver", "[zygote]": "zygote"}
    for name, what in named.items():
        if cmd.endswith(name) and (what != "forkserver" or parent_role != "forkserver"):
            return what
    if "course.sandbox" in cmd and " run " in cmd:
        return "sandbox wrapper"
    for needle, name in (("ipykernel_launcher", "kernel"), ("course.grading.verifier", "verifier"),
                         ("multiprocessing.forkserver", "forkserver"), ("resource_tracker", "resource tracker"),
                         ("course.sandbox.zygote", "zygote")):
        if needle in cmd:
            return name
    if "autograde" in cmd:
        return "command" if parent_role is None else "autograde worker"
    return "other: " + cmd.split(" ")[0].rsplit("/", 1)[-1]


def sample(argv: list[str], cwd: Path) -> tuple[dict, float, float]:
    """Run ``argv``; {(pid, start): [ppid, cpu s, cmdline]} of it and every descendant, its wall time
    and its rusage CPU (children included)."""
    seen: dict[tuple[int, int], list] = {}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as fh:
                    stat = fh.read()
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{name}/comm") as fh:  # a forked process renames itself (the zygote's children)
                    comm = fh.read().strip()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            key = (int(name), int(fields[19]))
            entry = seen.setdefault(key, [int(fields[1]), 0.0, cmd])
            entry[1] = (int(fields[11]) + int(fields[12])) / _TICK
            entry[2] = f"{cmd} [{comm}]" if cmd else entry[2]
        time.sleep(0.02)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rusage = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    by_pid = {pid: key for key in seen for pid in [key[0]]}
    roles: dict[tuple[int, int], str] = {}

    def role_of(key) -> str | None:
        if key in roles:
            return roles[key]
        ppid, _, cmd = seen[key]
        if key[0] == proc.pid:
            roles[key] = "command"
            return roles[key]
        parent = by_pid.get(ppid)
        if parent is None:
            return None
        parent_role = role_of(parent)
        if parent_role is None:
            return None
        if seen[parent][2] == cmd:  # forked, not exec'd: a forkserver's children are ranks, the rest keep the role
            roles[key] = "rank" if parent_role == "forkserver" else parent_role
        else:
            roles[key] = role(cmd, parent_role)
        return roles[key]

    mine = {key: (role_of(key), seen[key][1]) for key in seen if role_of(key) is not None}
    return mine, wall, rusage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=4)
    parser.add_argument("--assignment", default="ex1-parallelism")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--nbgrader", action="store_true", help="plain nbgrader autograde instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddp-autograde-cpu-") as tmp:
        root = Path(tmp)
        prepared = prepare(root, args.assignment, args.submissions)
        argv = ([sys.executable, "-m", "nbgrader", "autograde", args.assignment] if args.nbgrader else
                ["ddp-course", "autograde", args.assignment, "--jobs", str(args.jobs)])
        course_dir = root / "run"
        shutil.copytree(prepared, course_dir)
        processes, wall, rusage = sample(argv, course_dir)
        check(course_dir, args.assignment, args.submissions)
    per_role: dict[str, list[float]] = defaultdict(list)
    for name, cpu in processes.values():
        per_role[name].append(cpu)
    n = args.submissions
    total = sum(sum(v) for v in per_role.values())
    print(f"{' '.join(argv[-4:])}: {n} reference submissions of {args.assignment}, {os.cpu_count()} CPUs, "
          f"wall {wall:.1f} s, load average {os.getloadavg()[0]:.1f}")
    print(f"{'role':<28} {'processes':>9} {'CPU s total':>12} {'CPU s/submission':>17}")
    for name, cpus in sorted(per_role.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:<28} {len(cpus):9d} {sum(cpus):12.2f} {sum(cpus) / n:17.2f}")
    print(f"{'total (sampled)':<28} {'':9} {total:12.2f} {total / n:17.2f}")
    print(f"{'total (rusage, children)':<28} {'':9} {rusage:12.2f} {rusage / n:17.2f}")


if __name__ == "__main__":
    main()
