"""Per-job wall time of course.run_ranks vs mp.spawn, a bare fork and a torchrun subprocess.

    python benchmarks/launch_bench.py [--repeat 5]

Prints one table of per-job seconds and ratios, all measured in this one run
(timings on a shared 2-core machine are noisy: compare ratios, not absolutes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

CASES = [("ddp_step", 2), ("all_reduce", 4)]

COLD = """
import sys, time
sys.path.insert(0, {here!r})
t0 = time.perf_counter()
import course, _workloads
course.run_ranks(_workloads.WORKLOADS[{name!r}], {n}, echo=False)
print(time.perf_counter() - t0)
"""


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run_ranks_warm(name, n, repeat):
    import _workloads

    import course

    course.run_ranks(_workloads.WORKLOADS[name], n, echo=False)  # warm the forkserver
    return timed(lambda: course.run_ranks(_workloads.WORKLOADS[name], n, echo=False), repeat)


def run_ranks_cold(name, n):
    code = COLD.format(here=str(HERE), name=name, n=n)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=HERE.parent)
    return float(out.stdout.strip().splitlines()[-1])


def start_method(method, name, n, repeat):
    import _workloads
    import torch.multiprocessing as mp

    def once():
        mp.start_processes(_workloads.with_env, args=(name, n, _workloads.free_port()), nprocs=n, start_method=method)

    return timed(once, repeat)


def torchrun(name, n):
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
         str(HERE / "_workloads.py"), name],
        check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return time.perf_counter() - t0


def main() -> None:
    # The same modules the launcher's forkserver preloads, so "fork" is a fair baseline.
    import torch._dynamo  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()
    rows = []
    for name, n in CASES:
        print(f"timing {name} on {n} ranks ...", file=sys.stderr)
        r = {
            "job": f"{name} x{n}",
            "run_ranks warm": run_ranks_warm(name, n, opts.repeat),
            "run_ranks cold": run_ranks_cold(name, n),
            "fork": start_method("fork", name, n, opts.repeat),
            "mp.spawn": start_method("spawn", name, n, max(1, opts.repeat // 2)),
            "torchrun": torchrun(name, n),
        }
        rows.append(r)
    cols = ["run_ranks warm", "run_ranks cold", "fork", "mp.spawn", "torchrun"]
    print("\nseconds per job (median of runs; cold and torchrun: one run)")
    print(f"{'job':<16}" + "".join(f"{c:>16}" for c in cols) + f"{'spawn/warm':>12}{'warm/fork':>11}{'torchrun/warm':>15}")
    for r in rows:
        w = r["run_ranks warm"]
        print(
            f"{r['job']:<16}" + "".join(f"{r[c]:>16.3f}" for c in cols)
            + f"{r['mp.spawn'] / w:>11.1f}x{w / r['fork']:>10.2f}x{r['torchrun'] / w:>14.0f}x"
        )


if __name__ == "__main__":
    main()
