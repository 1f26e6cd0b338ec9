"""Lesson 4 runs top to bottom, and its torchrun jobs really ran multi-rank with the right results.

The notebook is executed once per session; the tests read what the ranks printed.
"""

from __future__ import annotations

import ast
import re

import pytest
from lesson_output import assert_clean_run, assert_summary_and_quick_check, output_of

# Five torchrun jobs (one of them elastic, with two agents); each imports torch in every process, which is slow on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BACKEND = r"backend=(?:gloo|nccl)"


@pytest.fixture(scope="module")
def nb(executed_lesson):
    """The executed lesson (run once per session by conftest's fixture)."""
    return executed_lesson("04")


def hello_lines(text: str) -> list[dict]:
    pattern = (r"\[rank (?P<rank>\d+)\] node=(?P<node>\d+) local_rank=(?P<local_rank>\d+) argv=(?P<argv>\[.*?\]) "
               r"--local_rank flag=(?P<flag>\d+) all_reduce sum=(?P<sum>\d+) "
               rf"ran on world_size=(?P<world_size>\d+) \({BACKEND}\)")
    rows = []
    for m in re.finditer(pattern, text):
        row = {k: (ast.literal_eval(v) if k == "argv" else int(v)) for k, v in m.groupdict().items()}
        rows.append(row)
    return sorted(rows, key=lambda r: r["rank"])


def test_runs_cleanly_and_draws_the_plots(nb):
    assert_clean_run(nb, images=2)
    assert_summary_and_quick_check(nb, answers=6)


def test_torchrun_sets_the_environment_and_passes_no_local_rank_flag(nb):
    rows = hello_lines(output_of(nb, 'hello = torchrun("--standalone"'))
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in rows] == [(0, 0, 2), (1, 1, 2)]
    for row in rows:
        assert row["argv"] == ["--epochs", "3"]  # the script's own arguments, and nothing else
        assert row["flag"] == 0  # an argparse --local_rank keeps its default on every rank
        assert row["sum"] == 0 + 1  # the ranks really talked


def test_plain_python_has_no_rank(nb):
    text = output_of(nb, 'plain = subprocess.run([sys.executable, "hello.py"]')
    assert "exit code: 1" in text
    assert "KeyError: 'RANK'" in text


def test_two_nodes_give_local_rank_different_from_rank(nb):
    rows = hello_lines(output_of(nb, "two_nodes = [finish(agent) for agent in agents]"))
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert {r["world_size"] for r in rows} == {4}
    assert {r["sum"] for r in rows} == {0 + 1 + 2 + 3}
    for node in (0, 1):
        assert sorted(r["local_rank"] for r in rows if r["node"] == node) == [0, 1]
    for row in rows:
        assert row["rank"] == row["node"] * 2 + row["local_rank"]
    assert any(r["local_rank"] != r["rank"] for r in rows)
    assert "LOCAL_RANK != RANK" in output_of(nb, "rows = sorted(")


def epoch_losses(text: str) -> dict[int, tuple[int, str]]:
    """epoch -> (attempt, loss) from rank 0's per-epoch lines (the only rank that logs)."""
    pattern = r"attempt (\d+), world size \d+: epoch (\d+) ends at step \d+, loss ([\d.]+)"
    return {int(e): (int(a), loss) for a, e, loss in re.findall(pattern, text)}


def weight_difference(text: str) -> float:
    m = re.search(r"max \|difference\| [^:]*: (\S+)", text)
    assert m, text
    return float(m.group(1))


def test_uninterrupted_reference_run(nb):
    text = output_of(nb, "reference = torchrun(")
    assert re.search(rf"attempt 0: done, ran on world_size=2 \({BACKEND}\)", text), text
    assert sorted(epoch_losses(text)) == [0, 1, 2]
    assert text.count("done, ran on") == 1  # only rank 0 logs


def test_record_wrote_the_crashed_ranks_error_file(nb):
    text = output_of(nb, 'glob.glob(os.path.join(log_dir, "*", "attempt_0"')
    assert "attempt 0, local_rank 1: RuntimeError: simulated crash of rank 1 before step 14" in text
    assert set(re.findall(r"attempt 0, local_rank (\d)", text)) <= {"0", "1"}


def test_restarted_run_resumes_mid_epoch_and_ends_with_the_uninterrupted_weights(nb):
    text = output_of(nb, "restarted = torchrun(")
    assert "attempt 1, world size 2: resumed at step 12 (epoch 1, batch 4)" in text, text
    assert re.search(rf"attempt 1: done, ran on world_size=2 \({BACKEND}\)", text), text
    assert "from torchrun's log: [rank1]: RuntimeError: simulated crash of rank 1 before step 14" in text
    restarted = epoch_losses(text)
    assert {e: a for e, (a, _) in restarted.items()} == {0: 0, 1: 1, 2: 1}
    reference = epoch_losses(output_of(nb, "reference = torchrun("))
    assert {e: loss for e, (_, loss) in restarted.items()} == {e: loss for e, (_, loss) in reference.items()}
    assert weight_difference(output_of(nb, "print(f\"max |difference| between resumed")) <= 1e-6


def test_predict_then_run_the_local_rank_flag(nb):
    """The quick check before the standalone run: rank 1's --local_rank flag is 0, its LOCAL_RANK 1."""
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "`--local_rank flag=0` on rank 1 too" in markdown
    rank1 = [r for r in hello_lines(output_of(nb, 'hello = torchrun("--standalone"')) if r["rank"] == 1]
    assert rank1 and rank1[0]["flag"] == 0 and rank1[0]["local_rank"] == 1


def test_predict_then_run_plain_python(nb):
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "`KeyError: 'RANK'`" in markdown
    assert "KeyError: 'RANK'" in output_of(nb, 'plain = subprocess.run([sys.executable, "hello.py"]')


def test_predict_then_run_the_elastic_scale_down_then_up(nb):
    """The answer's claims, from the live run: the 2-rank job resumed at step 8, a node joined and the job
    grew back from a later checkpoint (a multiple of 4, whichever was latest when the joiner came), finished on
    world size 3, with the uninterrupted run's weights up to rounding (not bitwise: the sums were split over
    other ranks). The grown job's "attempt" is TORCHELASTIC_RESTART_COUNT of whichever node holds rank 0: 1 on
    the stayer's workers, 0 on the joiner's (a scale-up is no failure)."""
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "resumes at **step 8**" in markdown and "finishes on **world size 3**" in markdown
    text = output_of(nb, "grown = finish(stayer)")
    assert re.search(r"attempt 0, world size 3: epoch 0 ends at step 8", text), text
    assert re.search(r"rank \d leaves the job after step 10", text), text
    assert "attempt 1, world size 2: resumed at step 8 (epoch 1, batch 0)" in text, text
    grown = re.findall(r"attempt ([01]), world size 3: resumed at step (\d+)", text)
    assert len(grown) == 1 and int(grown[0][1]) % 4 == 0 and 8 <= int(grown[0][1]) < 24, text
    assert text.index("world size 2: resumed at step 8") < text.index(f"world size 3: resumed at step {grown[0][1]}")
    assert re.search(rf"attempt [01]: done, ran on world_size=3 \({BACKEND}\)", text), text
    assert "ran on world_size=2" not in text and "attempt 2" not in text  # grown before the end; one failure
    assert weight_difference(text) <= 1e-5


def test_spawn_cannot_find_a_notebook_function(nb):
    text = output_of(nb, "spawned = subprocess.run(")
    assert "child exit code: 1" in text
    assert "Can't get attribute 'work'" in text


# --- section 6, finding a hang (issue 28 part 3) ---------------------------------------------------------


def test_detail_names_the_shapes_before_any_data_moves(nb):
    text = output_of(nb, "course.run_ranks(gather_lengths_checked")
    assert "Detected mismatch between collectives on ranks" in text and "OpType=ALLGATHER" in text
    assert "Tensor shapes: 2vs 3" in text or "Tensor shapes: 3vs 2" in text


def test_without_detail_gloo_aborts_on_the_sizes(nb):
    text = output_of(nb, "course.run_ranks(gather_lengths, 2")
    assert "SIGABRT" in text and "Received data size doesn't match expected size" in text


def test_monitored_barrier_names_the_rank_that_left(nb):
    assert "Ranks 2 failed to pass monitoredBarrier" in output_of(nb, "args=(True,)")


def test_the_flight_recorder_shows_where_the_ranks_parted(nb):
    text = output_of(nb, "course.run_ranks(last_collectives")
    assert "rank 2: 2 collectives, the last: #2" in text
    assert "rank 0: 3 collectives, the last: #3" in text and "rank 1: 3 collectives, the last: #3" in text
    assert "_dump_fr_trace" in text


def test_the_quick_checks_answer_is_what_the_stall_report_says(nb):
    """The answer: rank 2 had returned; ranks 0 and 1 wait in all_reduce, at dist.all_reduce(grad)."""
    text = output_of(nb, "except course.RankStallError")
    assert "returned: [2], waiting: [0, 1]" in text
    assert "rank 0 waits in all_reduce" in text and "dist.all_reduce(grad)" in text
    assert "rank 2 had returned from the function" in text
