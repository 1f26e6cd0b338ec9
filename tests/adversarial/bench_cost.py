"""What verification costs: ``ddp-course grade`` on reference solutions, with and without the verifier.

Not a test (figures, no asserts): ``python tests/adversarial/bench_cost.py [ASSIGNMENT ...] [--repeat N]``.
For each source notebook it grades, one at a time:

* ``plain``: a fresh kernel, no sandbox, no verifier (nbclient as it comes, what
  ``ddp-course grade`` did before issue 7);
* ``verified``: :func:`course.grading.grade.grade_notebook`, the sandboxed kernel (visible tests
  only) then the trusted verifier (all tests), and the verifier's share of it;
* ``verified, hidden tests in kernel too``: the same with the kernel running the hidden
  tests as well (how it was before they were kept from the kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def plain(path: Path) -> float:
    from nbclient import NotebookClient

    from course.grading.cells import Timeouts
    from course.grading.notebook import Execution, clear_outputs, read
    from course.grading.restore import find_source, graded_cells, restore
    from course.grading.scoring import score_notebook

    started = time.monotonic()
    source = read(find_source(path))
    nb = restore(read(path), source)
    clear_outputs(nb)
    NotebookClient(nb, kernel_name="python3", timeout_func=Timeouts().for_cell, allow_errors=True).execute(
        cwd=str(path.parent))
    ran = {index for index, cell in enumerate(nb.cells) if cell.cell_type == "code"}
    report = score_notebook(Execution(nb, ran), graded_cells(source), str(path))
    assert report.score == report.max_score, report
    return time.monotonic() - started


def verified(path: Path, hidden_in_kernel: bool = False) -> tuple[float, float]:
    """(total seconds, seconds in the verifier). ``hidden_in_kernel``: the kernel runs the hidden tests
    too, as before they were kept from it (for comparison)."""
    from course.grading import checkcalls
    from course.grading import verifier as verify
    from course.grading.grade import grade_notebook

    spent = []
    real = verify.verify_notebook

    def timed(*args, **kwargs):
        started = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.monotonic() - started)

    verify.verify_notebook = timed
    real_source = checkcalls.kernel_source
    if hidden_in_kernel:
        checkcalls.kernel_source = lambda source: source
    try:
        started = time.monotonic()
        report = grade_notebook(path)
        total = time.monotonic() - started
    finally:
        verify.verify_notebook = real
        checkcalls.kernel_source = real_source
    assert report.score == report.max_score, report
    return total, sum(spent)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assignments", nargs="*", default=["ex1-parallelism", "ex2-ddp-basics"])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    for assignment in args.assignments:
        path = next((ROOT / "exercises" / assignment).glob("*.ipynb"))
        rows = {"plain": [], "verified": [], "of which verifier": [], "verified, hidden tests in kernel too": []}
        for _ in range(args.repeat):
            rows["plain"].append(plain(path))
            total, verifier = verified(path)
            rows["verified"].append(total)
            rows["of which verifier"].append(verifier)
            rows["verified, hidden tests in kernel too"].append(verified(path, hidden_in_kernel=True)[0])
        print(f"{assignment}: " + ", ".join(f"{k} {statistics.median(v):.1f} s ({', '.join(f'{x:.1f}' for x in v)})"
                                            for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
