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
    assert_clean_run(nb, images=6)
    assert_summary_and_quick_check(nb, answers=9)


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
    for op in ["broadcast", "all_reduce", "all_gather", "reduce_scatter"]:
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
    pieces = [b for b, _ in blocks["reduce_scatter"]]
    assert all(len(p) == ws for p in pieces), "each rank passes world_size pieces to reduce_scatter"
    piece_sums = [sum(col) for col in zip(*pieces)]
    assert [after for _, after in blocks["reduce_scatter"]] == [[piece_sums[rank]] for rank in range(ws)]


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


def test_ring_attention_matches_whole_sequence_attention_and_sends_what_the_answer_says(nb):
    """Each rank attends its block of queries to every block of keys and values as they come round the ring (its own
    first, then its left neighbours', in order), merges them by log-sum-exp into whole-sequence attention, and sends
    2 (N - 1) / N x S x D values: the figure the lesson's answer gives for N = 3."""
    text = output_of(nb, "run_ranks(ring_attention")
    s, d = (int(v) for v in re.search(r"S, D = (\d+), (\d+)", cell_with(nb, "def ring_attention").source).groups())
    rows = re.findall(r"N=(\d+) rank (\d+): (\d+) of (\d+) queries; held the keys/values of ranks (\[.*?\]) in turn; "
                      r"sent (\d+) values; max \|ring - whole-sequence attention\| = (\S+)", text)
    assert world_sizes(text) == [2, 3] and len(rows) == 5, text
    for n, rank, block, total, held, sent, diff in rows:
        n, rank = int(n), int(rank)
        assert int(total) == s and int(block) == s // n
        assert ast.literal_eval(held) == [(rank - k) % n for k in range(n)]
        assert int(sent) == (n - 1) * 2 * (s // n) * d
        assert float(diff) < 1e-5
    answer = next(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown"
                  and "how many values does each rank send" in " ".join(c.source.split()))
    assert f"<details><summary>Answer</summary>{(3 - 1) * 2 * (s // 3) * d}:" in answer


def test_expert_parallel_all_to_all_matches_the_dense_layer_and_the_answers_counts(nb):
    """Every token reaches its expert's rank and comes back in place (equal to one process running each token
    through its expert); what each expert received adds up to every rank's tokens; the answer's counts are the
    run's."""
    text = output_of(nb, "run_ranks(expert_parallel")
    t = int(re.search(r"T, E_D = (\d+), ", cell_with(nb, "def expert_parallel").source).group(1))
    rows = re.findall(r"rank (\d+): its expert got (\[.*?\]) tokens from ranks 0\.\.2; (\d+) of its (\d+) tokens "
                      r"went to another rank's expert; max \|expert parallel - dense\| = (\S+)", text)
    assert world_sizes(text) == [3] and [int(r[0]) for r in rows] == [0, 1, 2], text
    got = [ast.literal_eval(r[1]) for r in rows]
    away = [int(r[2]) for r in rows]
    assert all(int(r[3]) == t and float(r[4]) < 1e-5 for r in rows)
    for sender in range(3):  # what rank `sender` sent to each expert adds up to its tokens; all but its own went away
        assert sum(got[e][sender] for e in range(3)) == t
        assert away[sender] == t - got[sender][sender]
    answer = next(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown"
                  and "capacity" in c.source.lower() and "all-to-all" in c.source)
    assert f"send {away[0]}, {away[1]} and {away[2]} of their {t} tokens away" in answer
    loads = [sum(g) for g in got]
    assert f"the experts received {loads[0]}, {loads[1]} and {loads[2]} tokens" in answer


def _stage_rows(text: str, name: str) -> list[tuple[str, int, float]]:
    rows = re.findall(rf"^  {re.escape(name)} +stage (\d+): ([FB]+)  holds at most (\d+) micro-batch\(es\); "
                      r"gradient vs one process (\S+)$", text, re.M)
    assert [int(s) for s, *_ in rows] == list(range(len(rows))), text
    return [(order, int(most), float(diff)) for _, order, most, diff in rows]


def test_torchs_pipeline_schedules_run_and_hold_what_the_lesson_says(nb):
    """GPipe runs every forward first and holds all m micro-batches on every stage; 1F1B warms up p - s forwards on
    stage s, then alternates, and holds at most p - s; both give one process's gradients; the bubble is
    (p - 1) / (m + p - 1). Read from the schedules torch ran, through hooks on each stage."""
    text = output_of(nb, "run_ranks(pipeline_schedule")
    p, m = (int(v) for v in re.search(r"p = (\d+) stages, m = (\d+) micro-batches", text).groups())
    assert world_sizes(text) == [p, p] and p >= 3
    assert number(r"bubble \(p - 1\) / \(m \+ p - 1\) = (\S+)", text) == pytest.approx((p - 1) / (m + p - 1), abs=5e-3)
    gpipe, one_f_one_b = _stage_rows(text, "GPipe"), _stage_rows(text, "1F1B")
    assert len(gpipe) == len(one_f_one_b) == p
    for s in range(p):
        assert gpipe[s][:2] == ("F" * m + "B" * m, m), gpipe[s]
        warm = p - s  # forwards before the first backward on stage s (all of them on the last stage: 1)
        assert one_f_one_b[s][0] == "F" * warm + "BF" * (m - warm) + "B" * warm, one_f_one_b[s]
        assert one_f_one_b[s][1] == warm <= p
        assert gpipe[s][2] < 1e-6 and one_f_one_b[s][2] < 1e-6
    # what the lesson's answer states for its own p and m
    answer = next(c.source for c in nb.cells if c.cell_type == "markdown" and "FFFBFBBB" in c.source)
    assert (p, m) == (3, 4) and "2 / 6 = 0.33" in answer
    assert all(f"`{row[0]}`" in answer for row in one_f_one_b) and f"`{gpipe[0][0]}`" in answer


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


def has_plot(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.outputs)


def test_the_hand_written_ring_sends_exactly_2_n_minus_1_over_n_p_and_matches_all_reduce(nb):
    cell = cell_with(nb, "run_ranks(ring_vs_all_reduce")
    text = stdout_of(cell)
    P = int(re.search(r"^P = (\d+)$", cell.source, re.M).group(1))
    rows = re.findall(r"^N=(\d+): values sent per rank (\[.*?\]), formula 2\(N-1\)/N x P = (\S+); "
                      r"ring == all_reduce on every rank: (True|False)$", text, re.M)
    ns = [int(n) for n, *_ in rows]
    assert world_sizes(text) == ns and {2, 3, 4} <= set(ns), text
    for n, sent, formula, equal in rows:
        n, sent = int(n), ast.literal_eval(sent)
        assert P % n == 0, f"P={P} must be divisible by N={n} for the exact figure"
        exact = 2 * (n - 1) * P // n
        assert sent == [exact] * n, f"N={n}: ranks sent {sent}, the ring sends exactly 2(N-1)/N x P = {exact}"
        assert float(formula) == exact and equal == "True"
    halves = re.findall(r"^without the all-gather, N=(\d+): values sent per rank (\[.*?\]); == all_reduce on some "
                        r"rank: (True|False); own chunk fully summed on every rank: (True|False)$", text, re.M)
    assert [int(n) for n, *_ in halves] == ns
    for n, sent, equal, own in halves:
        n = int(n)
        assert ast.literal_eval(sent) == [(n - 1) * P // n] * n
        assert (equal, own) == ("False", "True"), f"N={n}: a reduce-scatter alone must not pass for an all-reduce"
    assert has_plot(cell_with(nb, "ax.plot(ns, [course.commcost.ring_sent(P, n) for n in ns]"))


def test_all_reduce_is_timed_against_message_size_on_two_ranks(nb):
    cell = cell_with(nb, "run_ranks(time_all_reduce")
    text = stdout_of(cell)
    assert world_sizes(text) == [2]
    rows = [(int(n), float(ms)) for n, ms in re.findall(r"all_reduce of +(\d+) values \(.*?\): +(\S+) ms", text)]
    assert [n for n, _ in rows] == [4**k for k in range(3, 12)]
    assert all(ms > 0 for _, ms in rows)
    assert rows[-1][1] > rows[0][1], f"16 MB should take longer than 256 bytes: {rows}"
    assert has_plot(cell)


def test_one_layer_split_both_ways_equals_the_unsplit_layer(nb):
    text = output_of(nb, "run_ranks(split_one_layer")
    assert world_sizes(text) == [4]
    assert number(r"all_gather: max difference (\S+)", text) < 1e-5
    assert number(r"all_reduce: +max difference (\S+)", text) < 1e-5
    assert number(r"partial output alone: +max difference (\S+)", text) > 0.1  # a part alone is not the output


def test_predict_then_run_a_sum_that_all_reduces_in_backward_gives_world_size_times_the_gradient(nb):
    """Quick check: the answer (in <details>) says 4, the world size; the next cell computes it live."""
    question = next(c for c in nb.cells if c.cell_type == "markdown" and "What is the ratio, on 4 ranks?" in c.source)
    assert "<details>" in question.source and "4, the world size" in question.source
    following = nb.cells[nb.cells.index(question) + 1]
    assert "run_ranks(gradient_through_the_sum" in following.source
    text = stdout_of(following)
    [ws] = world_sizes(text)
    ratios = ast.literal_eval(re.search(r"the unsplit gradient's block: (\[.*?\])", text).group(1))
    assert ws == 4 and ratios == [pytest.approx(ws, abs=1e-3)] * ws, ratios


def test_predict_then_run_no_rank_holds_the_input_gradient_but_their_sum_does(nb):
    question = next(c for c in nb.cells if c.cell_type == "markdown" and "add up to?" in c.source)
    assert "<details>" in question.source and "No rank holds the unsplit gradient; the sum of the four equals it" \
        in question.source
    following = nb.cells[nb.cells.index(question) + 1]
    text = stdout_of(following)
    assert world_sizes(text) == [4] and "run_ranks(input_gradient_by_output_split" in following.source
    assert "rank r's x.grad equals the unsplit x.grad: [False, False, False, False]" in text
    assert "the sum over ranks equals the unsplit x.grad: True" in text


def test_torch_tensor_parallel_runs_on_gloo_with_the_collectives_the_lesson_names(nb):
    text = output_of(nb, "run_ranks(torch_tensor_parallel")
    assert world_sizes(text) == [4]
    col = re.search(r"ColwiseParallel: weight (\S+), local shard (\(.*?\)), max difference (\S+); forward ran "
                    r"(\[.*?\]), backward ran (\[.*?\])$", text, re.M)
    row = re.search(r"RowwiseParallel: weight (\S+), local shard (\(.*?\)), max difference (\S+); forward ran "
                    r"(\[.*?\]), backward ran (\[.*?\])$", text, re.M)
    assert col and row, text
    assert col.group(1) == "S(0)" and float(col.group(3)) < 1e-5
    assert [op for op, _ in ast.literal_eval(col.group(4))] == ["all_gather"]
    assert [op for op, _ in ast.literal_eval(col.group(5))] == ["all_reduce"]  # the input's gradient
    assert row.group(1) == "S(1)" and float(row.group(3)) < 1e-5
    assert [op for op, _ in ast.literal_eval(row.group(4))] == ["all_reduce"]
    assert ast.literal_eval(row.group(5)) == []


def test_the_cost_model_is_fitted_here_and_prices_real_machines(nb):
    """Section 6's alpha-beta model (issue 28 part 4): this machine's two numbers, the real machines' figures with
    their sources, the ring/tree crossover, the traffic of DDP, ZeRO and FSDP (the predict-then-run answer)."""
    text = output_of(nb, "alpha_here = seconds[n_small] / 2")
    assert "this machine (2 processes)" in text and "NVIDIA H100 datasheet" in text and "PCI-SIG" in text
    assert re.search(r"within \d+% of every measured size", text), text  # a noisy machine: reported, not bounded
    text = output_of(nb, 'ib = costmodel.MACHINES["InfiniBand NDR 400 Gb/s"]')
    assert re.search(r"the ring is faster from [\d.]+ MiB on", text), text
    text = output_of(nb, "block = [[(3 * d, d), (3 * d,)]")
    assert "FSDP / DDP bytes per rank: {8: 1.5, 64: 1.5}" in text  # the answer the lesson states
    assert len(re.findall(r"ddp: .* zero: .* fsdp: ", text)) == 2, text
    text = output_of(nb, "bucket_runs = course.run_ranks(time_buckets, 2")
    rows = re.findall(r"(\d+) buckets of .*measured +([\d.]+) ms, model +([\d.]+) ms", text)
    assert [int(k) for k, _, _ in rows] == [1, 4, 16, 64, 256], text
    model = [float(m) for _, _, m in rows]
    assert model == sorted(model) and model[-1] > 5 * model[0]  # the latency term adds up with the bucket count
