"""DDP from scratch: step time and collectives of the notebook's NaiveDDP and BucketedDDP vs torch's DDP.

    python benchmarks/ddp_scratch_bench.py [--ranks 2,4] [--steps 50] [--width 256] [--layers 12] [--bucket-mb 1]

NaiveDDP and BucketedDDP are the reference solutions in
exercises/ex2-ddp-basics/ddp_from_scratch.ipynb (its imports cell, then the answer cells
``ex2s_naive`` and ``ex2s_bucketed`` without their nbgrader markers), executed here, so this always
measures the notebook's reference. They run against torch's DistributedDataParallel with its defaults
(``bucket_cap_mb`` not given: 25 MiB buckets after a first one of 1 MiB) and with ``bucket_cap_mb`` equal
to the bucketed version's ``--bucket-mb`` (the fair comparison, and the ratios' reference).

One job per world size (gloo, CPU) builds every variant on the same MLP (``--layers`` Linear layers of
``--width``, same initial weights) and the same batches; after ``--warmup`` steps per variant, one step
of each is read from torch's flight recorder (the all-reduces it issued and the values they carried),
then ``--steps`` timed steps (forward, backward, gradient sync, optimizer step) run interleaved across
the variants, each after a barrier. Step time: the slowest rank's per step, median over the steps.
One run, one table: timings on a shared 2-core machine are noisy (and 4 ranks oversubscribe it):
compare the ratios within the table, not the absolute times.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

NOTEBOOK = ROOT / "exercises" / "ex2-ddp-basics" / "ddp_from_scratch.ipynb"
CELLS = ("ex2s_imports", "ex2s_naive", "ex2s_bucketed")
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


def notebook_reference() -> tuple[type, type]:
    """NaiveDDP and BucketedDDP, from executing the notebook's imports cell and its two answer cells.

    The namespace's ``__name__`` names no importable module, so cloudpickle sends the classes to the
    ranks by value, as it does for classes defined in a notebook."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in nb.cells}
    missing = [g for g in CELLS if g not in by_id]
    if missing:
        raise SystemExit(f"{NOTEBOOK}: no cell with grade_id {', '.join(missing)}")
    namespace: dict = {"__name__": "ddp_from_scratch_reference"}
    for grade_id in CELLS:
        source = "\n".join(line for line in by_id[grade_id].source.splitlines() if line.strip() not in MARKERS)
        exec(compile(source, f"<{NOTEBOOK.name}:{grade_id}>", "exec"), namespace)
    return namespace["NaiveDDP"], namespace["BucketedDDP"]


def variants(bucket_mb: float) -> list[tuple[str, str, dict]]:
    """(label, kind, keyword arguments), in table order; the last is the ratios' reference."""
    return [
        ("naive (per parameter)", "naive", {}),
        (f"bucketed ({bucket_mb:g} MiB)", "bucketed", {"bucket_size_mb": bucket_mb}),
        # no bucket_cap_mb: torch's real default (25 MiB, but a first bucket of 1 MiB; passing 25 drops that)
        ("torch DDP (default, 25 MiB)", "ddp", {}),
        (f"torch DDP (bucket_cap_mb={bucket_mb:g})", "ddp", {"bucket_cap_mb": bucket_mb}),
    ]


def bench_rank(rank, classes, specs, width, layers, batch, warmup, steps):
    """On every rank: build each variant, count one step's all-reduces, time ``steps`` interleaved steps."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course import checks

    dist.init_process_group("gloo")
    world_size = dist.get_world_size()

    def mark() -> dict:
        seen: dict = {}
        for e in checks.collectives():
            if not e["p2p"]:
                seen[e["group"]] = max(seen.get(e["group"], 0), e["seq"] or 0)
        return seen

    def all_reduces_since(before: dict) -> list[int]:
        """Values carried by each all-reduce issued after ``before``."""
        return [sum(math.prod(s) for s in e["sizes"] or []) for e in checks.collectives()
                if not e["p2p"] and (e["seq"] or 0) > before.get(e["group"], 0) and e["op"] == "all_reduce"]

    def mlp():
        torch.manual_seed(0)  # the same initial weights for every variant (and every rank)
        mods = []
        for i in range(layers):
            mods.append(torch.nn.Linear(width, width))
            if i < layers - 1:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods)

    gen = torch.Generator().manual_seed(1000 + rank)  # this rank's data, the same for every variant
    batches = [(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)) for _ in range(4)]

    runs = []
    for _label, kind, kwargs in specs:
        model = mlp()
        if kind == "ddp":
            wrapper, sync = DDP(model, **kwargs), None
        else:
            wrapper = classes[kind](model, **kwargs)
            sync = wrapper.finish_gradient_synchronization
        runs.append({"model": model, "wrapper": wrapper, "sync": sync,
                     "opt": torch.optim.SGD(model.parameters(), lr=1e-3), "times": []})

    def step(run, i):
        x, y = batches[i % len(batches)]
        run["opt"].zero_grad(set_to_none=True)
        F.mse_loss(run["wrapper"](x), y).backward()
        if run["sync"] is not None:
            run["sync"]()
        run["opt"].step()

    i = 0
    for run in runs:  # warm-up (DDP rebuilds its buckets after its first step), then one counted step
        for _ in range(warmup):
            step(run, i)
            i += 1
        dist.barrier()
        before = mark()
        step(run, i)
        i += 1
        run["all_reduces"] = all_reduces_since(before)
    for _ in range(steps):
        for run in runs:
            dist.barrier()
            t0 = time.perf_counter()
            step(run, i)
            run["times"].append(time.perf_counter() - t0)
        i += 1
    with torch.no_grad():  # every variant took the same steps on the same data: it should hold DDP's weights
        ref = torch.cat([p.reshape(-1) for p in runs[-1]["model"].parameters()])
        drift = [(torch.cat([p.reshape(-1) for p in r["model"].parameters()]) - ref).abs().max().item() for r in runs]
    out = [{"times": r["times"], "all_reduces": r["all_reduces"], "drift": d} for r, d in zip(runs, drift)]
    del runs  # free the DDP instances before the group
    dist.destroy_process_group()
    return {"world_size": world_size, "variants": out,
            "params": sum(p.numel() for p in mlp().parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per variant (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    parser.add_argument("--width", type=int, default=256, help="width of every Linear layer (default 256)")
    parser.add_argument("--layers", type=int, default=12, help="number of Linear layers (default 12)")
    parser.add_argument("--batch", type=int, default=64, help="batch size per rank (default 64)")
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="BucketedDDP's bucket_size_mb, and the second DDP's bucket_cap_mb (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of each job, s (default 600)")
    opts = parser.parse_args()
    ranks = [int(r) for r in opts.ranks.split(",") if r.strip()]

    import course

    started = time.perf_counter()
    naive, bucketed = notebook_reference()  # its imports cell also starts the launcher's forkserver
    classes = {"naive": naive, "bucketed": bucketed}
    specs = variants(opts.bucket_mb)
    rows, params = [], 0
    for n in ranks:
        print(f"{len(specs)} variants on {n} ranks ...", file=sys.stderr)
        values = course.run_ranks(
            bench_rank, n, echo=False, timeout=opts.timeout,
            args=(classes, specs, opts.width, opts.layers, opts.batch, opts.warmup, opts.steps),
        )
        params = values[0]["params"]
        per_variant = []
        for v, (label, _kind, _kwargs) in enumerate(specs):
            runs = [value["variants"][v] for value in values]
            slowest = [max(ts) for ts in zip(*(r["times"] for r in runs))]  # the slowest rank, per step
            calls = runs[0]["all_reduces"]
            per_variant.append({"label": label, "ms": 1e3 * statistics.median(slowest), "calls": len(calls),
                                "values": sum(calls), "drift": max(r["drift"] for r in runs),
                                "same": all(r["all_reduces"] == calls for r in runs)})
        ref = per_variant[-1]["ms"]
        for r in per_variant:
            rows.append({**r, "ranks": n, "ratio": r["ms"] / ref})

    print(f"\n{opts.layers} x Linear({opts.width}, {opts.width}): {params:,} parameters "
          f"({params * 4 / 2**20:.2f} MiB), batch {opts.batch} per rank, gloo on CPU; "
          f"median of {opts.steps} steps of the slowest rank; ratio vs torch DDP with bucket_cap_mb={opts.bucket_mb:g}\n")
    print("| variant | ranks | step time (ms) | ratio vs torch DDP | all-reduces per step | values all-reduced per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        calls = f"{r['calls']}" + ("" if r["same"] else " (differs across ranks!)")
        print(f"| {r['label']} | {r['ranks']} | {r['ms']:.1f} | {r['ratio']:.2f}x | {calls} | {r['values']:,} |")
    drift = max(r["drift"] for r in rows)
    print(f"\nlargest |weight - torch DDP's weight| after all steps, any variant: {drift:.1e}; "
          f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
