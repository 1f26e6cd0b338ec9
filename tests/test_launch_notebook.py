"""run_ranks from inside a real Jupyter kernel: notebook functions, classes and globals."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CELLS = [
    "import course, torch, torch.distributed as dist",
    "SCALE = 10  # a notebook global\n"
    "class Box:\n"
    "    def __init__(self, value):\n"
    "        self.value = value\n"
    "    def doubled(self):\n"
    "        return 2 * self.value",
    "def work(rank):\n"
    "    dist.init_process_group(course.backend())\n"
    "    t = torch.tensor([float(rank)])\n"
    "    dist.all_reduce(t)\n"
    "    box = Box(t.item() * SCALE)\n"
    "    print('world_size', dist.get_world_size())\n"
    "    dist.destroy_process_group()\n"
    "    return box.doubled()",
    "print('two:', course.run_ranks(work, 2))",
    "print('four:', course.run_ranks(work, 4))",
    "def broken(rank):\n"
    "    if rank == 1:\n"
    "        raise KeyError('missing on purpose')\n"
    "    return rank",
    "try:\n"
    "    course.run_ranks(broken, 2)\n"
    "except course.RankFailedError as err:\n"
    "    print(err)",
]


def test_notebook_functions_classes_and_globals_run_on_2_and_4_ranks():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    NotebookClient(nb, timeout=240, kernel_name="python3").execute()

    def text(i):
        return "".join(o.get("text", "") for o in nb.cells[i].outputs if o.output_type == "stream")

    def stderr(i):
        return "".join(o.get("text", "") for o in nb.cells[i].outputs if o.get("name") == "stderr")

    # sum of ranks 0..n-1, times SCALE, doubled
    assert "two: [20.0, 20.0]" in text(3)
    assert "four: [120.0, 120.0, 120.0, 120.0]" in text(4)
    assert "[rank 3] world_size 4" in text(4)
    report = text(6)
    assert "rank 1 raised KeyError" in report
    assert "raise KeyError('missing on purpose')" in report  # the cell's source line travels with the function
    for i in range(len(CELLS)):
        assert stderr(i) == "", f"cell {i} wrote to stderr: {stderr(i)}"


FAILING = [
    "import course, torch, torch.distributed as dist",
    "def step(rank):\n"
    "    dist.init_process_group('gloo')\n"
    "    t = torch.ones(2)\n"
    "    if rank == 0:\n"
    "        dist.all_reduce(t)\n"
    "    return t.tolist()",
    "course.run_ranks(step, 2, timeout=30)",
    "def no_group(rank):\n"
    "    t = torch.ones(2)\n"
    "    dist.all_reduce(t)",
    "course.run_ranks(no_group, 2, timeout=30)",
    "1 / 0",
    "def spin(rank):\n"
    "    while True:\n"
    "        pass",
    "course.run_ranks(spin, 2, timeout=6)",
]


def test_a_failed_job_shows_the_students_cells_and_one_summary_in_a_notebook():
    import re

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in FAILING]
    NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=True).execute()

    def error(i):
        (out,) = [o for o in nb.cells[i].outputs if o.output_type == "error"]
        return out.ename, re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out.traceback))

    ename, deadlock = error(2)
    assert ename == "RankStallError"
    assert deadlock.count("is deadlocked") == 1, deadlock  # the summary once
    assert "course/launcher" not in deadlock and "job.py" not in deadlock, deadlock  # no engine frames
    assert "Cell In[3], line 1" in deadlock  # the student's own call
    assert "Cell In[2], line 5 in step" in deadlock and "ipykernel_" not in deadlock  # the stack names the cell
    _, independent = error(4)
    assert "raised the same error on its own" in independent and "consequence" not in independent, independent
    assert "course/launcher" not in independent
    ename, plain = error(5)  # other errors keep IPython's own display
    assert ename == "ZeroDivisionError" and "Cell In[6], line 1" in plain
    ename, endless = error(7)  # an endless loop: where each rank was at the deadline, by cell and line
    assert ename == "RankTimeoutError" and endless.count("did not finish within 6 s") == 1, endless
    # the loop's `while` or its `pass`: where the sample of the stack caught it
    assert re.search(r"Cell In\[7\], line [23] in spin", endless) and "course/launcher" not in endless, endless
