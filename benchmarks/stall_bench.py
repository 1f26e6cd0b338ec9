"""Deadlocks: time from the divergence to the failure, with and without early detection, and the trace's cost.

    python benchmarks/stall_bench.py [--deadline 20] [--repeat 3]

For each failure kind (another collective, a collective only rank 0 calls, other shapes, a rank that
returns early) one 2-rank job runs with ``detect_stalls=False`` (what a deadlock cost before: the
job's deadline, here ``--deadline`` s) and with early detection; each rank stamps the time it
diverges, so the table shows divergence-to-failure seconds. Then the per-job wall time of the
launcher benchmark's DDP step job with the flight recorder on (the default) and off
(``TORCH_FR_BUFFER_SIZE=0``), median of ``--repeat`` warm runs each, interleaved.
One run, one table: timings on a shared 2-core machine are noisy; compare within the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _join(rank, stamp):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(2)
    dist.all_reduce(t)
    with open(f"{stamp}.{rank}", "w") as fh:  # the moment this rank diverges
        fh.write(repr(time.time()))
    return t


def other_op(rank, stamp):
    import torch.distributed as dist

    t = _join(rank, stamp)
    dist.all_reduce(t) if rank == 0 else dist.barrier()


def only_rank0(rank, stamp):
    import torch.distributed as dist

    t = _join(rank, stamp)
    if rank == 0:
        dist.all_reduce(t)


def shapes(rank, stamp):
    import torch
    import torch.distributed as dist

    _join(rank, stamp)
    dist.all_reduce(torch.ones(2 + rank))


def returns_early(rank, stamp):
    import torch.distributed as dist

    t = _join(rank, stamp)
    for _ in range(1 if rank == 1 else 3):
        dist.all_reduce(t)


KINDS = [("another collective", other_op), ("only rank 0 calls it", only_rank0),
         ("other shapes", shapes), ("a rank returns early", returns_early)]


def divergence_to_failure(fn, detect: bool, deadline: float) -> tuple[float, str]:
    import course

    stamp = tempfile.mktemp(prefix="ddp-course-stall-")
    try:
        course.run_ranks(fn, 2, args=(stamp,), echo=False, timeout=deadline, detect_stalls=detect)
        return float("nan"), "finished (!)"
    except course.LaunchError as err:
        ended = time.time()
        kind = type(err).__name__
    diverged = []
    for rank in range(2):
        try:
            diverged.append(float(Path(f"{stamp}.{rank}").read_text()))
            Path(f"{stamp}.{rank}").unlink()
        except (OSError, ValueError):
            pass
    return ended - max(diverged), kind


def ddp_step_seconds(repeat: int) -> tuple[float, float]:
    import _workloads

    import course

    fn = _workloads.WORKLOADS["ddp_step"]
    course.run_ranks(fn, 2, echo=False)  # warm the forkserver
    on, off = [], []
    for _ in range(repeat):
        for env, samples in ((None, on), ({"TORCH_FR_BUFFER_SIZE": "0"}, off)):
            t0 = time.perf_counter()
            course.run_ranks(fn, 2, echo=False, env=env)
            samples.append(time.perf_counter() - t0)
    return statistics.median(on), statistics.median(off)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"| failure kind | before: deadline only ({args.deadline:g} s) | after: early detection | error |")
    print("| --- | --- | --- | --- |")
    for name, fn in KINDS:
        before, _ = divergence_to_failure(fn, False, args.deadline)
        after, kind = divergence_to_failure(fn, True, args.deadline)
        print(f"| {name} | {before:.1f} s | {after:.1f} s | {kind} |")
    on, off = ddp_step_seconds(args.repeat)
    print(f"\nDDP step job (2 ranks, warm), median of {args.repeat}: flight recorder on {on:.3f} s, "
          f"off {off:.3f} s, overhead {100 * (on / off - 1):+.1f}%")


if __name__ == "__main__":
    main()
