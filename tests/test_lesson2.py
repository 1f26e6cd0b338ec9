"""Lesson 2's demos really ran multi-rank and got the right results, read from what its cells printed."""

from __future__ import annotations

import ast
import re

import pytest
from lesson_output import assert_clean_run, assert_summary_and_quick_check, output_of, world_sizes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def nb(executed_lesson):
    return executed_lesson("02")


def rows(pattern: str, text: str) -> list[tuple[str, ...]]:
    found = re.findall(pattern, text, re.M)
    assert found, f"no line matching {pattern!r} in:\n{text}"
    return found


def test_clean_run_with_plots_summary_and_quick_check(nb):
    assert_clean_run(nb, images=3)
    assert_summary_and_quick_check(nb, answers=3)


def test_one_process_per_rank(nb):
    text = output_of(nb, "run_ranks(which_process")
    [ws] = world_sizes(text)
    notebook = rows(r"notebook process (\d+)", text)[0]
    pids = [pid for _, pid in rows(r"rank (\d+): process (\d+)", text)]
    assert len(pids) == len(set(pids)) == ws >= 2 and notebook not in pids


def test_every_rank_logs_unless_guarded(nb):
    text = output_of(nb, "run_ranks(log_lines")
    [ws] = world_sizes(text)
    assert ws >= 2
    everyone = rows(r"^\[rank (\d+)\] starting training$", text)
    assert sorted(int(r) for r in everyone) == list(range(ws))
    assert rows(r"\[rank (\d+)\] starting training on (\d+) ranks", text) == [("0", str(ws))]


def test_environment_read_by_init_process_group(nb):
    text = output_of(nb, "run_ranks(show_environment")
    [ws] = world_sizes(text)
    envs = [(int(r), ast.literal_eval(env), up) for r, env, up in
            rows(r"rank (\d+): (\{.*?\}), process group up: (\w+)", text)]
    assert len(envs) == ws >= 2
    assert len({env["MASTER_PORT"] for _, env, _ in envs}) == 1
    for rank, env, up in envs:
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == str(ws) and up == "True"


def test_each_rank_pinned_to_its_device(nb):
    text = output_of(nb, "run_ranks(show_device")
    [ws] = world_sizes(text)
    found = rows(r"rank (\d+): local_rank (\d+), device (\S+), current GPU (\S+),", text)
    assert len(found) == ws >= 2
    for rank, local_rank, device, gpu in found:
        assert rank == local_rank
        assert (device, gpu) in {("cpu", "None"), (f"cuda:{local_rank}", local_rank)}


def test_ddp_broadcasts_rank0_weights_and_seeds_matter(nb):
    text = output_of(nb, "run_ranks(wrap_and_seed")
    [ws] = world_sizes(text)
    sums = [(float(b), float(a)) for _, b, a in rows(r"rank (\d+): weight checksum (\S+) before DDP -> (\S+) after", text)]
    assert len(sums) == ws >= 2
    assert len({b for b, _ in sums}) == ws, "each rank should start from its own weights"
    assert all(a == sums[0][0] for _, a in sums), "after wrapping every rank should hold rank 0's weights"
    noise = rows(r"seed 0: (\[.*?\]); seed 0 \+ rank: (\[.*?\])", text)
    assert len({same for same, _ in noise}) == 1 and len({own for _, own in noise}) == ws


def test_gradients_are_synchronised(nb):
    text = output_of(nb, "run_ranks(train_on_own_data")
    assert len(world_sizes(text)) == 2 and min(world_sizes(text)) >= 2
    assert "DDP: parameters bitwise equal across ranks after every step: True" in text
    assert "plain model: parameters bitwise equal across ranks after every step: False" in text
    text = output_of(nb, "run_ranks(train_ddp")
    assert world_sizes(text)[0] >= 2
    assert float(rows(r"max \|one process - DDP\| weight difference = (\S+)", text)[0]) < 1e-6
    assert "DDP matches one process on the full batch (atol=1e-6): True" in text


def test_unused_parameters_and_no_sync(nb):
    text = output_of(nb, "run_ranks(unused_parameters")
    assert world_sizes(text)[0] >= 2
    assert "Expected to have finished reduction in the prior iteration" in text
    text = output_of(nb, "run_ranks(accumulate")
    assert len(world_sizes(text)) == 2 and min(world_sizes(text)) >= 2
    (micro, without, with_no_sync), = rows(r"(\d+) micro-batches without no_sync: (\d+) all-reduces; with no_sync: (\d+)", text)
    assert int(without) == int(micro) > 1 and int(with_no_sync) == 1
    assert "same accumulated gradients on every rank: True" in text
    # each micro-batch's loss divided by their number: the accumulated gradient is the big batch's mean gradient
    (loss_over, samples), = rows(r"accumulated gradient \(each micro-batch's loss / (\d+)\) equals one backward on the "
                                 r"whole batch of (\d+) on every rank: True", text)
    assert int(loss_over) == int(micro) and int(samples) == 8 * int(micro)


def test_sampler_shards_are_disjoint_covering_and_padded(nb):
    text = output_of(nb, "run_ranks(shards")
    [ws] = world_sizes(text)
    assert ws >= 2
    blocks = re.findall(r"dataset of (\d+) samples:\n((?:  rank .*\n)+)", text)
    assert len(blocks) == 2
    for n, block in blocks:
        n = int(n)
        shards = [ast.literal_eval(s) for _, s in re.findall(r"rank (\d+) gets indices (\[.*?\])", block)]
        assert len(shards) == ws and len({len(s) for s in shards}) == 1
        seen = [i for s in shards for i in s]
        assert set(seen) == set(range(n))
        assert len(seen) == -(-n // ws) * ws  # padded up to a multiple of world_size
        if n % ws == 0:
            assert len(set(seen)) == len(seen), "an even split must not repeat indices"
        else:
            assert len(seen) - len(set(seen)) == len(seen) - n
    dropped = re.search(r"dataset of 10 samples, drop_last=True: (\[.*?\]\]); repeated: \[\]; not seen this epoch: "
                        r"(\[.*?\])", text)
    assert dropped, text
    kept = [i for shard in ast.literal_eval(dropped.group(1)) for i in shard]
    assert len(kept) == 10 // ws * ws and len(set(kept)) == len(kept)
    assert sorted(set(range(10)) - set(kept)) == ast.literal_eval(dropped.group(2))


def test_uneven_batches_hang_without_join(nb):
    text = output_of(nb, "run_ranks(uneven_batches")
    assert world_sizes(text) == [2, 2]
    without = rows(r"without Join, rank \d+: (\d+) batches, (\d+) steps done, (failed|finished)", text)
    with_join = rows(r"with Join, rank \d+: (\d+) batches, (\d+) steps done, (failed|finished)", text)
    assert len({b for b, _, _ in without}) == 2, "the ranks should have different numbers of batches"
    assert all(outcome == "failed" for *_, outcome in without)
    assert all(outcome == "finished" and b == s for b, s, outcome in with_join)


def test_loader_with_sampler(nb):
    text = output_of(nb, "run_ranks(loader_demo")
    [ws] = world_sizes(text)
    assert ws >= 2
    assert "ValueError: sampler option is mutually exclusive with shuffle" in text
    (single, each, bs, global_batch), = rows(r"1 process: (\d+) batches per epoch; each of \d+ ranks: (\d+) batches of (\d+) \(global batch (\d+)\)", text)
    assert int(each) * ws == int(single) and int(global_batch) == int(bs) * ws
    batches = [ast.literal_eval(b) for b in rows(r"rank \d+ first batch: (\[.*?\])", text)]
    seen = [i for b in batches for i in b]
    assert len(batches) == ws and len(seen) == len(set(seen))


def test_evaluation_counts_each_sample_once(nb):
    text = output_of(nb, "run_ranks(evaluate")
    assert world_sizes(text)[0] >= 2
    true = float(rows(r"true accuracy: (\S+)", text)[0])
    found = {name: (ast.literal_eval(idx), float(mean), float(counts)) for name, idx, mean, counts in
             rows(r"(padded sampler|unpadded split): indices per rank (\[.*?\]); mean of per-rank accuracies (\S+), "
                  r"all-reduced counts (\S+)", text)}
    padded, unpadded = found["padded sampler"], found["unpadded split"]
    flat = [i for shard in unpadded[0] for i in shard]
    assert sorted(flat) == sorted(set(flat)), "the unpadded split must score each sample once"
    assert unpadded[2] == pytest.approx(true, abs=1e-3)
    assert padded[2] != pytest.approx(true, abs=1e-3) and unpadded[1] != pytest.approx(true, abs=1e-3)


def test_a_joined_rank_sends_zeros_and_ddp_divides_by_the_initial_world_size_unless_told(nb):
    """Rank 0's second step, the other rank joined: the sum of gradients (1 + 0) over 2 by default, over 1 with
    divide_by_initial_world_size=False; both ranks' first step is the plain average."""
    text = output_of(nb, "run_ranks(joined_gradients")
    assert world_sizes(text) == [2, 2]
    pattern = r"divide_by_initial_world_size=(True|False): rank 0's gradient in each step (\[.*?\]), rank 1's (\[.*?\])"
    found = {d: (ast.literal_eval(a), ast.literal_eval(b)) for d, a, b in rows(pattern, text)}
    assert found == {"True": ([1.0, 0.5], [1.0]), "False": ([1.0, 1.0], [1.0])}, found


def test_set_epoch_reshuffles_and_keeps_shards_disjoint(nb):
    text = output_of(nb, "run_ranks(epoch_orders")
    [ws, ws2] = world_sizes(text)
    assert ws == ws2 >= 2
    orders = {}
    for label, rank, line in rows(r"(with|without) set_epoch, rank (\d+): (.*)", text):
        orders.setdefault(label, {})[int(rank)] = [ast.literal_eval(o) for o in re.findall(r"epoch \d+: (\[.*?\])", line)]
    for label, per_rank in orders.items():
        assert sorted(per_rank) == list(range(ws))
        for epoch in range(len(per_rank[0])):
            seen = [i for rank in range(ws) for i in per_rank[rank][epoch]]
            assert len(seen) == len(set(seen)), f"{label} set_epoch: ranks overlap in epoch {epoch}"
    assert all(all(e == o[0] for e in o) for o in orders["without"].values()), "without set_epoch every epoch repeats"
    assert all(len({tuple(e) for e in o}) > 1 for o in orders["with"].values()), "with set_epoch the order changes"


def test_checkpoint_saved_once_loaded_everywhere(nb):
    text = output_of(nb, "run_ranks(checkpoint")
    [ws] = world_sizes(text)
    assert ws >= 2
    assert ast.literal_eval(rows(r"files in the checkpoint directory: (\[.*?\])", text)[0]) == ["ckpt.pt"]
    (keys, ddp_keys), = rows(r"checkpoint keys: (\[.*?\]) \| ddp_model.state_dict\(\) keys: (\[.*?\])", text)
    keys, ddp_keys = ast.literal_eval(keys), ast.literal_eval(ddp_keys)
    assert not any(k.startswith("module.") for k in keys) and ddp_keys == [f"module.{k}" for k in keys]
    found = rows(r"rank (\d+): wrote it: (\w+); loaded onto (\S+); same weights as its replica: (\w+)", text)
    assert [w for _, w, _, _ in found] == ["True"] + ["False"] * (ws - 1)
    assert all(same == "True" for *_, same in found)


def test_module_prefix_and_missing_barrier_fail_live(nb):
    text = output_of(nb, "run_ranks(wrong_keys")
    assert world_sizes(text)[0] >= 2
    assert 'Unexpected key(s) in state_dict: "module.' in text
    fixed = ast.literal_eval(rows(r"after consume_prefix_in_state_dict_if_present: (\[.*?\])", text)[0])
    assert fixed and not any(k.startswith("module.") for k in fixed)
    text = output_of(nb, "run_ranks(load_without_barrier")
    assert len(world_sizes(text)) == 2 and min(world_sizes(text)) >= 2
    without = ast.literal_eval(rows(r"without barrier: (\[.*?\])", text)[0])
    with_barrier = ast.literal_eval(rows(r"with barrier: (\[.*?\])", text)[0])
    assert without[0] == "loaded" and any(o != "loaded" for o in without[1:])
    assert with_barrier == ["loaded"] * len(with_barrier)


def test_destroy_process_group(nb):
    text = output_of(nb, "course.launch(fn, 2)")
    assert world_sizes(text) == [2, 2]
    assert "forgets_to_destroy: second init_process_group: ValueError" in text
    assert "forgets_to_destroy: called destroy_process_group [False, False], process group still up when the function returned [True, True]" in text
    assert "destroys: called destroy_process_group [True, True], process group still up when the function returned [False, False]" in text


def test_complete_training_script(nb):
    text = output_of(nb, "run_ranks(train,")
    [ws] = world_sizes(text)
    assert ws >= 2
    epochs = rows(r"\[rank (\d+)\] epoch (\d+): mean loss (\S+) over (\d+) samples", text)
    assert {r for r, *_ in epochs} == {"0"}, "only rank 0 logs"
    losses = [float(loss) for _, _, loss, _ in epochs]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert len({n for *_, n in epochs}) == 1
    assert rows(r"the checkpoint loads into a plain model; its loss on the whole dataset: (\S+)", text)


def test_the_bucket_timeline_shows_all_reduce_overlapping_backward(nb):
    text = output_of(nb, "def bucket_overlap(rank, steps=3):")
    assert world_sizes(text) == [2]
    buckets = ast.literal_eval(rows(r"^buckets in the last step: (\[.*\])$", text)[0])
    assert len(buckets) >= 2, buckets  # 0.3 MB buckets: the 6 layers need several
    layer, cap = 256 * 256 + 256, 0.3 * 2**20 / 4  # values in one layer, in one bucket's cap (float32)
    sizes = [int(re.search(r"\((\d+) values\)", b).group(1)) for b in buckets]
    assert sum(sizes) == 6 * layer and all(n % layer == 0 for n in sizes), sizes  # whole layers, all of them
    assert all(n >= cap for n in sizes[:-1]), sizes  # a bucket closes once it reaches the cap (the lesson's claim)
    first = ast.literal_eval(rows(r"^buckets in the first step: (\[.*\])$", text)[0])
    assert len(first) == 1 and int(re.search(r"\((\d+) values\)", first[0]).group(1)) == 6 * layer, first
    overlap = [float(ms) for _, ms in rows(r"^rank (\d): ([\d.]+) ms of all-reduce ran while backward", text)]
    assert len(overlap) == 2 and all(ms > 0 for ms in overlap), text


def test_the_bucket_rules_cell_shows_one_bucket_then_a_1_mib_first_bucket(nb):
    """What lesson 2 says after the cell (two 1 KiB tensors close a 2048-byte bucket; step 1 one bucket of all 6
    layers; from step 2 a first bucket of 4 layers, the one that crosses 1 MiB included, then the rest)."""
    text = output_of(nb, "def buckets_per_step(rank, steps=2):")
    assert world_sizes(text) == [2]
    assert "five 1 KiB tensors, a 2048-byte cap: buckets [[0, 1], [2, 3], [4]]" in text
    steps = [(int(s), int(n), ast.literal_eval(layers)) for s, n, layers in
             rows(r"^step (\d): (\d+) bucket\(s\) of \[.*\] bytes, (\[.*\]) layers$", text)]
    assert steps == [(1, 1, [6]), (2, 2, [4, 2])], steps


# --- predict, then run: each answer states what the next cell computes live --------------------------------


def _answer(nb, question: str) -> str:
    """The folded answer of the quick-check question whose markdown holds ``question``, on one line."""
    [cell] = [c for c in nb.cells if c.cell_type == "markdown" and question in c.source]
    found = re.search(r"<details><summary>Answer</summary>(.*?)</details>", cell.source, re.S)
    assert found, cell.source
    return " ".join(re.sub(r"</?code>", "", found.group(1)).split())


def test_predict_then_run_the_shards_of_an_uneven_dataset(nb):
    answer = _answer(nb, "**Question 1.**")
    text = output_of(nb, "run_ranks(predict_shards")
    assert world_sizes(text) == [3]
    live = {int(r): (ast.literal_eval(p), ast.literal_eval(d)) for r, p, d in
            rows(r"7 samples on 3 ranks, rank (\d+): padded (\[.*?\]), drop_last=True (\[.*?\])", text)}
    stated = [ast.literal_eval(s) for s in re.findall(r"\[[\d, ]+\]", answer)]
    assert stated == [live[r][0] for r in range(3)] + [live[r][1] for r in range(3)], (stated, live)
    unseen = sorted(set(range(7)) - {i for r in range(3) for i in live[r][1]})
    assert f"index {', '.join(map(str, unseen))} is not seen this epoch" in answer


def test_predict_then_run_what_batch_size_means_per_rank(nb):
    answer = _answer(nb, "**Question 2.**")
    text = output_of(nb, "run_ranks(predict_batches")
    [ws] = world_sizes(text)
    per_rank = [(int(steps), ast.literal_eval(sizes)) for _, steps, sizes in
                rows(r"100 samples, batch_size=8, rank (\d+): (\d+) steps, batch sizes (\[.*?\])", text)]
    assert len(per_rank) == ws == 4 and len({(s, tuple(b)) for s, b in per_rank}) == 1
    steps, sizes = per_rank[0]
    assert steps == len(sizes) and sum(sizes) == 100 // ws
    stated = f"{steps} steps per rank in batches of {', '.join(map(str, sizes[:-1]))} and {sizes[-1]}"
    assert stated in answer, (stated, answer)
    (full, last), = rows(r"the global batch\): (\d+); in the last step: (\d+)", text)
    assert f"{ws} x {sizes[0]} = {full} samples over all ranks" in answer and f"the last step only {last}" in answer


def test_mixed_precision_dtypes_predicted_then_measured(nb):
    """Section 12's predict-then-run answer (bfloat16 output; float32 loss, weight, gradient and bucket; a Float
    all-reduce unless bf16_compress_hook sends BFloat16) is what the next cell measured live."""
    answer = next(c.source for c in nb.cells if c.cell_type == "markdown" and "**Predict, then run.**" in c.source
                  and "bf16_compress_hook" in c.source)
    text = output_of(nb, "def amp_dtypes(rank, hook):")
    assert world_sizes(text) == [2, 2]
    default = ast.literal_eval(rows(r"^default: (\{.*\})$", text)[0])
    compressed = ast.literal_eval(rows(r"^bf16_compress_hook: (\{.*\})$", text)[0])
    want = {"first layer's output": "bfloat16", "loss": "float32", "weight": "float32", "weight.grad": "float32",
            "bucket": "float32"}
    assert default == compressed == want
    for name, dtype in want.items():
        assert f"<code>{dtype}</code>" in answer, (name, dtype)
    assert rows(r"^default: all-reduced on the wire \(flight recorder\): (.*)$", text) == ['["all_reduce [\'Float\']"]']
    assert rows(r"^bf16_compress_hook: all-reduced on the wire \(flight recorder\): (.*)$", text) == [
        '["all_reduce [\'BFloat16\']"]']


def test_casting_the_wrapped_model_stops_ddp(nb):
    text = output_of(nb, "def cast_after_wrapping(rank):")
    assert world_sizes(text) == [2]
    assert rows(r"after ddp_model.to\(torch.bfloat16\): all-reduces in one backward: (\d+); same gradients on every "
                r"rank: (\w+)", text) == [("0", "False")]
    assert rows(r"^same Parameter objects: (\w+); same gradient accumulators \(DDP's hooks\): (\w+)$", text) == [
        ("True", "False")]


def test_clipping_after_the_all_reduce_matches_one_process(nb):
    text = output_of(nb, "def clip_under_ddp(rank, where")
    assert world_sizes(text) == [2, 2]
    found = {where: ([float(n) for n in norms.strip("[]").split(", ")], float(norm)) for where, norms, norm in
             rows(r"^clipped (inside no_sync|after the all-reduce): norms the ranks clipped with (\[.*?\]); one "
                  r"process's global norm (\S+)$", text)}
    inside, after = found["inside no_sync"], found["after the all-reduce"]
    assert inside[0][0] < 0.5 < inside[0][1], inside  # rank 0 left alone, rank 1 scaled: different factors
    assert after[0][0] == after[0][1] == pytest.approx(after[1], rel=2**-6)  # the global norm on every rank
    verdicts = dict((w, (same, bf16)) for w, same, bf16 in rows(
        r"^clipped (inside no_sync|after the all-reduce): same gradients on every rank: (\w+); max .* = \S+; "
        r"within bf16 rounding \(4 x 2\*\*-8 x the largest gradient\): (\w+)$", text))
    assert verdicts == {"inside no_sync": ("True", "False"), "after the all-reduce": ("True", "True")}


def test_groups_sum_inside_themselves_and_take_the_default_backend(nb):
    """The even and the odd ranks each make their own sum; a group made without a backend uses the default's."""
    text = output_of(nb, "run_ranks(show_groups")
    [ws] = world_sizes(text)
    found = rows(r"rank (\d+): in the (evens|odds), rank (\d+) of (\d+) there, group sum (\d+), backend (\S+) "
                 r"\(the default group's: (\S+)\)", text)
    assert len(found) == ws == 4
    for rank, group, group_rank, size, total, backend, default in found:
        members = [r for r in range(ws) if r % 2 == int(rank) % 2]
        assert group == ("evens" if int(rank) % 2 == 0 else "odds")
        assert int(group_rank) == members.index(int(rank)) and int(size) == len(members)
        assert int(total) == sum(members) and backend == default


def test_rank_0_gathers_what_differs_on_every_rank(nb):
    """Each rank draws from its own stream; rank 0 alone receives every rank's values, in rank order."""
    text = output_of(nb, "run_ranks(who_drew_what")
    [ws] = world_sizes(text)
    held = {int(r): ast.literal_eval(v) for r, v in rows(r"^rank (\d+) holds: (.*)$", text)}
    assert len(held) == ws == 3 and all(held[r] is None for r in range(1, ws))
    gathered = held[0]
    assert len(gathered) == ws and len({g["pid"] for g in gathered}) == ws
    assert len({tuple(g["drew"]) for g in gathered}) == ws  # three streams, three draws


def test_every_rank_gets_the_median_of_values_of_different_lengths(nb):
    """Three ranks with 3, 2 and 1 values: every rank computes the median of all six, through objects and through
    padded tensors, and both are the median of the values the ranks printed."""
    import statistics

    text = output_of(nb, "run_ranks(median_of_all")
    [ws] = world_sizes(text)
    found = rows(r"^rank (\d+) holds (\[.*\]); median of all: ([\d.]+) \(objects\), ([\d.]+) \(padded tensors\)$", text)
    assert len(found) == ws == 3
    values = [v for _, held, _, _ in found for v in ast.literal_eval(held)]
    assert [len(ast.literal_eval(held)) for _, held, _, _ in found] == [3, 2, 1]
    want = sorted(values)[(len(values) - 1) // 2]  # torch's median of an even count: the lower middle value
    assert statistics.median_low(values) == want
    for _, _, objects, tensors in found:
        assert abs(float(objects) - want) < 1e-4 and abs(float(tensors) - want) < 1e-4


def test_float16_underflows_without_a_scale_and_survives_with_one(nb):
    """On one process, the classifier's small gradients: float32 keeps every element, float16 autocast without
    scaling loses some to exactly zero, and the GradScaler's scale keeps more of them (all, here)."""
    text = output_of(nb, "def zero_gradients(autocast")
    found = {name: (int(zeros), int(total)) for name, zeros, total in rows(
        r"^(float32|float16 autocast, no scaling|float16 autocast, GradScaler): (\d+) of (\d+) gradient elements "
        r"exactly zero", text)}
    assert set(found) == {"float32", "float16 autocast, no scaling", "float16 autocast, GradScaler"}, text
    plain, scaled = found["float16 autocast, no scaling"][0], found["float16 autocast, GradScaler"][0]
    assert found["float32"][0] == 0 and plain > 0 and scaled < plain, found
    assert len({total for _, total in found.values()}) == 1
    assert rows(r"\(\.grad holds (\d+) x the gradient\)$", text) == ["65536"]


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(nb):
    """Rank 1's batch overflows float16; DDP's all-reduce hands its NaN to rank 0 too, so every rank's scaler skips
    the same step and halves its scale, and no rank's weights move."""
    text = output_of(nb, "def overflow_on_one_rank(rank):")
    assert world_sizes(text) == [2]
    found = rows(r"^rank (\d+): loss (\S+); sent finite gradients: (\w+); got back finite: (\w+); step skipped: (\w+); "
                 r"scale (\S+) -> (\S+); weights unchanged: (\w+)$", text)
    assert [int(r[0]) for r in found] == [0, 1], text
    sent = {int(rank): s for rank, _, s, *_ in found}
    assert sent == {0: "True", 1: "False"}  # only rank 1's own gradients overflowed
    for _, _, _, back, skipped, before, after, unchanged in found:
        assert (back, skipped, unchanged) == ("False", "True", "True")
        assert float(after) == float(before) / 2


def test_clipping_with_a_scaler_points_to_pytorchs_examples_without_the_exercises_lines(nb):
    """The lesson says why the clip must see unscaled gradients and where PyTorch shows how; the two calls that do
    it are part 5 of the practice exercise, so no cell of the lesson writes them."""
    prose = " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    assert 'section "Working with Unscaled Gradients"' in prose and "bf16 needs no scaler" in prose
    assert not [c.source[:80] for c in nb.cells if "unscale_" in c.source]
