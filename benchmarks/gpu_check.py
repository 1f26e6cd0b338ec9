"""The Python parts of benchmarks/gpu_check.sh: one graded check per exercise through the grading pipeline (its
sandboxed kernel and trusted verifier), the sandbox's uid opening the GPU under its memory limit, and the summary.

    python benchmarks/gpu_check.py verifier [--policy auto|gloo] [--dry-run] [--json FILE]
    python benchmarks/gpu_check.py sandbox [--json FILE]
    python benchmarks/gpu_check.py summary OUTDIR

``verifier``: each exercise's notebook cut after its first test cell (hidden tests included) runs through
``course.grading.pipeline`` as ``ddp-course grade`` runs it; the verifier's verdict and what its check jobs ran on
(the grade report's "ran on") are compared with what this machine's GPU count must give. ``--policy auto``
(``DDP_COURSE_CHECK_BACKEND=auto``) makes every check take nccl where there is a GPU per rank, to prove the checks
right on nccl; ``--policy gloo`` is grading as it is (GPUs hidden from the checks' ranks whatever the machine).
``--dry-run`` builds the notebooks and prints the plan, running nothing (tests/test_gpu_check.py runs it on CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: one notebook per exercise, and the first test cell's check: what the verifier re-runs
EXERCISES = (("ex1-parallelism", "parallelism"), ("ex2-ddp-basics", "ddp_basics"),
             ("ex3-syncbn-sharding", "syncbn_sharding"), ("ex4-torchrun", "find_the_hang"))
#: the environment variable course.checks.run reads for its backend policy (benchmarks only)
POLICY_ENV = "DDP_COURSE_CHECK_BACKEND"


def cut_after_first_test(nb):
    """A copy of ``nb`` holding its cells up to its first test cell (included): what that test needs, and no
    other test; returns (notebook, the test cell's grade_id)."""
    import copy

    from course.grading.cells import is_test_cell

    index = next(i for i, cell in enumerate(nb.cells) if is_test_cell(cell))
    cut = copy.deepcopy(nb)
    cut.cells = cut.cells[: index + 1]
    return cut, cut.cells[index].metadata["nbgrader"]["grade_id"]


def expected(gpus: int, policy: str, ran_on: list[str]) -> str:
    """"" when what a cell's check jobs ran on is what ``gpus`` GPUs must give under ``policy``, else why not.

    ``gloo``: every job on gloo with the GPUs hidden. ``auto``: with 2 GPUs or more some job took nccl (every
    check runs at least 2 ranks); with 1 GPU the multi-rank jobs fell back to gloo; with none, gloo only."""
    if not ran_on:
        return "no check job was noted (did the check run through course.checks.run?)"
    kinds = set(ran_on)
    if policy == "gloo":
        return "" if kinds == {"gloo, GPUs hidden"} else f"expected only 'gloo, GPUs hidden', got {ran_on}"
    if gpus >= 2:
        return "" if "nccl" in kinds else f"expected nccl with {gpus} GPUs, got {ran_on}"
    if gpus == 1:
        return "" if "gloo" in kinds and kinds <= {"gloo", "nccl"} else f"expected gloo with 1 GPU, got {ran_on}"
    return "" if kinds == {"gloo"} else f"expected gloo without GPUs, got {ran_on}"


def plan(policy: str, only: tuple[str, ...] = ()) -> list[dict]:
    """What :func:`verifier_part` runs: per exercise (``only``: those), its notebook, the test it keeps and how many
    cells."""
    from course.grading.notebook import read

    rows = []
    for assignment, name in EXERCISES:
        if only and assignment not in only:
            continue
        path = ROOT / "exercises" / assignment / f"{name}.ipynb"
        nb, test = cut_after_first_test(read(path))
        rows.append({"exercise": assignment, "notebook": name, "test": test, "cells": len(nb.cells),
                     "policy": policy, "path": str(path)})
    return rows


def verifier_part(policy: str, gpus: int, dry_run: bool = False, test_timeout: float = 150,
                  only: tuple[str, ...] = ()) -> list[dict]:
    """Each exercise's first test through the grading pipeline; one row per exercise with the verdict."""
    from traitlets.config import Config

    from course.grading import pipeline, scoring
    from course.grading.cells import is_test_cell
    from course.grading.notebook import clear_outputs, read

    rows = plan(policy, only)
    if dry_run:
        return rows
    os.environ[POLICY_ENV] = policy
    for row in rows:
        started = time.monotonic()
        nb, test = cut_after_first_test(read(Path(row["path"])))
        clear_outputs(nb)
        config = pipeline.configure(Config(), test_timeout=test_timeout, other_timeout=test_timeout,
                                    hide=[str(ROOT / "exercises")])
        try:
            run = pipeline.run(nb, Path(row["path"]).parent, config)
        except Exception as err:  # noqa: BLE001 - one exercise's failure is a row, not the end of the check
            row.update(ok=False, problem=f"{type(err).__name__}: {err}"[:2000])
            continue
        cell = next(c for c in run.nb.cells if is_test_cell(c))
        result = scoring.score_cell(cell, 1.0, True)
        ran_on = scoring.ran_on(cell)
        why = expected(gpus, policy, ran_on)
        row.update(seconds=round(time.monotonic() - started, 1), score=result.score, ran_on=ran_on,
                   message=result.message[:2000], notes=run.notes,
                   ok=result.score == 1.0 and not why, problem=why or (result.message.splitlines() or [""])[0])
    return rows


def sandbox_part(gpus: int) -> dict:
    """The sandbox's uid opens /dev/nvidia* and runs a CUDA tensor under the memory limit grading gives it."""
    import subprocess

    from course.grading.kernel import sandbox_memory
    from course.sandbox import Limits, Sandbox

    code = ("import os, torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); "
            "print(os.getuid(), torch.cuda.get_device_name(0), float(x.sum()))")
    limit = sandbox_memory(gpus)
    with tempfile.TemporaryDirectory(prefix="ddp-course-gpu-sandbox-") as tmp:
        with Sandbox(Path(tmp) / "w", limits=Limits(memory=limit)) as box:
            proc = subprocess.run(box.command([sys.executable, "-c", code]), capture_output=True, text=True,
                                  timeout=180)
            record = box.cgroups.memory_record() if box.cgroups else None
            summary = box.summary
    ok = proc.returncode == 0 and str(float(1 << 20)) in proc.stdout
    if record and record.get("peak") is not None:
        ok = ok and record["peak"] <= record["limit"]
    return {"ok": ok, "summary": summary, "limit": limit, "record": record, "stdout": proc.stdout[-500:],
            "stderr": proc.stderr[-2000:], "devices": sorted(p.name for p in Path("/dev").glob("nvidia*"))}


def summary(outdir: Path) -> tuple[str, int]:
    """The end of gpu_check.sh: one line per part (its exit and what failed), and the exit status (0: all well)."""
    lines, bad = [], 0
    for log in sorted(outdir.glob("part-*.exit")):
        name = log.stem[len("part-"):]
        code = log.read_text().strip()
        line = f"{name:10} exit {code}"
        if code != "0":
            bad += 1
        log = outdir / f"{name}.log"
        tail = [t for t in log.read_text(errors="replace").splitlines() if t.strip()][-1:] if log.is_file() else []
        if tail and tail[0].startswith("="):  # pytest's last line: "=== 5 passed, 1 skipped in 40.1s ==="
            line += "; " + tail[0].strip("= ")
        report = outdir / f"{name}.json"
        if report.is_file() and name != "lessons":
            try:
                data = json.loads(report.read_text())
            except ValueError:
                data = None
            rows = data if isinstance(data, list) else [data] if isinstance(data, dict) else []
            failed = [r for r in rows if isinstance(r, dict) and not r.get("ok", True)]
            line += f"; {len(rows) - len(failed)}/{len(rows)} ok"
            line += "".join(f"\n    FAILED {r.get('exercise') or r.get('summary', '')}: {r.get('problem')}"
                            for r in failed)
            bad += bool(failed) and code == "0"
        lines.append(line)
    if not lines:
        return "no part ran", 1
    return "\n".join(lines) + ("\nall parts passed" if not bad else f"\n{bad} part(s) failed"), int(bool(bad))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["verifier", "sandbox", "summary"])
    parser.add_argument("outdir", nargs="?")
    parser.add_argument("--policy", choices=["auto", "gloo"], default="auto")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--gpus", type=int, help="the machine's GPU count (default: asked without using CUDA)")
    parser.add_argument("--only", action="append", default=[], help="an exercise (ex1-parallelism ...): only those")
    args = parser.parse_args(argv)
    if args.part == "summary":
        text, code = summary(Path(args.outdir or "."))
        print(text)
        return code
    from course.launcher.gpus import gpu_count

    gpus = gpu_count() if args.gpus is None else args.gpus
    if args.part == "verifier":
        result = verifier_part(args.policy, gpus, args.dry_run, only=tuple(args.only))
        ok = all(r.get("ok", True) for r in result)
    else:
        result = sandbox_part(gpus)
        ok = result["ok"]
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
