"""Lesson 1's demos really ran multi-rank and got the right results, read from what its cells printed."""

from __future__ import annotations

import ast
import re

import pytest
from lesson_output import assert_clean_run, assert_summary_and_quick_check, cell_with, output_of, stdout_of, world_sizes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def nb(executed_lesson):
    return executed_lesson("01")


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return float(match.group(1))


def test_clean_run_with_plots_summary_and_quick_check(nb):
    assert_clean_run(nb, images=3)
    assert_summary_and_quick_check(nb, answers=3)


def test_each_rank_is_its_own_process(nb):
    text = output_of(nb, "run_ranks(hello")
    [ws] = world_sizes(text)
    assert ws >= 2
    greetings = re.findall(r"\[rank (\d+)\] I am rank (\d+) of (\d+), process (\d+)", text)
    assert sorted(int(r) for r, *_ in greetings) == list(range(ws))
    assert all(r == me and int(of) == ws for r, me, of, _ in greetings)
    pids = ast.literal_eval(re.search(r"process ids: (\[.*?\])", text).group(1))
    notebook = int(re.search(r"this notebook: (\d+)", text).group(1))
    assert len(set(pids)) == ws and notebook not in pids


def test_collectives_give_what_each_rank_should_hold(nb):
    text = output_of(nb, "run_ranks(collectives")
    [ws] = world_sizes(text)
    assert ws >= 2
    blocks = {}
    for op in ["broadcast", "all_reduce", "all_gather"]:
        block = re.search(rf"^{op}:\n((?:  rank .*\n?)+)", text, re.M)
        assert block, f"no {op} block in:\n{text}"
        rows = re.findall(r"rank (\d+): before (\[.*?\]) -> after (.*)", block.group(1))
        assert [int(r) for r, _, _ in rows] == list(range(ws))
        blocks[op] = [(ast.literal_eval(b), ast.literal_eval(a)) for _, b, a in rows]
    before = [b for b, _ in blocks["broadcast"]]
    assert len({tuple(b) for b in before}) == ws, "ranks should start with different tensors"
    total = [sum(col) for col in zip(*before)]
    for rank in range(ws):
        assert blocks["broadcast"][rank][1] == before[0]
        assert blocks["all_reduce"][rank][1] == pytest.approx(total)
        assert blocks["all_gather"][rank][1] == before


def test_data_parallel_by_hand_matches_one_process(nb):
    text = output_of(nb, "run_ranks(train_data_parallel, 4, args=(X, y, STEPS, LR))")
    [ws] = world_sizes(text)
    assert ws >= 2
    per_rank = ast.literal_eval(re.search(r"per-rank batch: (\[.*?\])", text).group(1))
    global_batch = int(re.search(r"-> global batch (\d+)", text).group(1))
    assert len(per_rank) == ws and len(set(per_rank)) == 1 and sum(per_rank) == global_batch
    assert number(r"max \|single - data-parallel\| weight difference = (\S+)", text) < 1e-6
    assert "identical weights (allclose, atol=1e-6): True" in text
    assert "all ranks hold bitwise the same weights: True" in text


def test_summing_without_averaging_acts_like_a_larger_learning_rate(nb):
    text = output_of(nb, "run_ranks(train_data_parallel, 4, args=(X, y, STEPS, LR, False))")
    [ws] = world_sizes(text)
    assert ws >= 2
    rows = re.findall(r"lr=(\S+): max weight difference = (\S+)", text)
    assert len(rows) == 2
    (lr, same_lr_diff), (scaled_lr, scaled_diff) = [(float(a), float(b)) for a, b in rows]
    assert scaled_lr == pytest.approx(lr * ws)
    assert same_lr_diff > 1e-3, "summed gradients should differ from the single process at the same lr"
    assert scaled_diff < 1e-6


def test_batch_size_is_per_rank(nb):
    text = output_of(nb, "run_ranks(steps_per_epoch")
    [ws] = world_sizes(text)
    assert ws >= 2
    single_steps = int(re.search(r"1 process, batch_size=32: (\d+) steps per epoch", text).group(1))
    rows = {int(bs): (int(steps), int(g)) for bs, steps, g in
            re.findall(rf"{ws} ranks, batch_size=(\d+) each: (\d+) steps per epoch, global batch (\d+)", text)}
    assert rows[32] == (single_steps // ws, 32 * ws)
    assert rows[32 // ws] == (single_steps, 32)


def test_pipeline_split_across_two_ranks_matches_one_process(nb):
    text = output_of(nb, "run_ranks(train_pipeline")
    assert world_sizes(text) == [2]
    held = re.search(r"rank 0 holds (\[.*?\]) \| rank 1 holds (\[.*?\])", text)
    stage0, stage1 = ast.literal_eval(held.group(1)), ast.literal_eval(held.group(2))
    assert stage0 and stage1 and not set(stage0) & set(stage1)
    assert number(r"max \|single - pipeline\| output difference = (\S+)", text) < 1e-6
    assert number(r"max \|single - pipeline\| weight difference after \d+ steps = (\S+)", text) < 1e-6


def test_costs_are_counted_from_the_runs(nb):
    text = stdout_of(cell_with(nb, "n_total = sum("))
    total = int(re.search(r"holds (\d+) of (\d+) parameters", text).group(2))
    dp_held = int(re.search(r"holds (\d+) of", text).group(1))
    mp = re.search(r"rank 0 holds (\d+), rank 1 holds (\d+) of (\d+)", text)
    assert dp_held == total
    assert int(mp.group(1)) + int(mp.group(2)) == total and int(mp.group(1)) < total


def test_device_ids_on_a_cpu_model_fails_and_the_right_wrap_works(nb):
    text = output_of(nb, "run_ranks(wrap_with_device_ids")
    assert world_sizes(text)[0] >= 2
    assert "ValueError: DistributedDataParallel device_ids and output_device arguments only work" in text
    text = output_of(nb, "run_ranks(wrap_right")
    [ws] = world_sizes(text)
    rows = re.findall(r"rank (\d+): model on (\S+), DDP device_ids=(.*)", text)
    assert len(rows) == ws >= 2
    for _, device, device_ids in rows:
        assert device_ids == ("None" if device == "cpu" else f"[{device.split(':')[1]}]")


def test_the_timeline_shows_the_late_rank_keeping_the_others_waiting(nb):
    text = output_of(nb, "def late_rank(rank):")
    assert world_sizes(text) == [4]
    assert "rank 2 waited least: True" in text, text
    waited = {int(r): float(s) for r, s in re.findall(r"(\d+): ([\d.]+)", text.split("collectives:", 1)[1])}
    assert sorted(waited) == [0, 1, 2, 3]
    assert all(waited[r] >= 0.1 for r in (0, 1, 3)), waited  # 3 collectives x 60 ms of waiting, minus noise
