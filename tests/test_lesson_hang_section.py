"""The section "Finding a hang" (lessons/_hang_section.ipynb, to be spliced into lesson 4 before its summary): each
tool shows, live, what the text says it shows, and the quick check's answer is what the cell computes.

Once the section is in lesson 4, these tests move to test_lesson4.py (``executed_lesson("04")``)."""

from __future__ import annotations

import pytest
from lesson_output import assert_clean_run, output_of


@pytest.fixture(scope="module")
def nb(executed_lesson):
    return executed_lesson("_hang_section")


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_runs_cleanly(nb):
    assert_clean_run(nb, images=0)


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
