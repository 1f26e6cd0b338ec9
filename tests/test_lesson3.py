"""Lesson 3 runs top to bottom, and its demos really ran multi-rank and got the right results.

The notebook is executed once per session; the tests read its printed outputs.
"""

from __future__ import annotations

import ast
import re

import pytest
from lesson_output import assert_clean_run, assert_summary_and_quick_check, output_of, world_sizes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def nb(executed_lesson):
    """The executed lesson (run once per session by conftest's fixture)."""
    return executed_lesson("03")


def test_runs_cleanly_and_draws_the_plots(nb):
    assert_clean_run(nb, images=2)
    assert_summary_and_quick_check(nb, answers=5)


def test_per_rank_batchnorm_statistics_differ_from_the_global_batch(nb):
    assert world_sizes(output_of(nb, "course.run_ranks(bn_stats, 4)")) == [4]
    diffs = re.findall(r"rank (\d): running_mean .*?max diff from the global batch's: ([\d.]+)",
                       output_of(nb, "reference = nn.BatchNorm1d(3)"))
    assert [int(r) for r, _ in diffs] == [0, 1, 2, 3]
    assert all(float(d) > 0.005 for _, d in diffs), diffs
    assert "after the next forward, every rank's running_mean is rank 0's: True" in output_of(nb, "reference = nn.BatchNorm1d(3)")


def test_convert_sync_batchnorm_replaces_every_batchnorm(nb):
    m = re.search(r"BatchNorm layers before: (\d+); after: (\d+) SyncBatchNorm, (\d+) plain BatchNorm left",
                  output_of(nb, "model = small_cnn()"))
    assert m, "conversion summary line missing"
    before, synced, left = map(int, m.groups())
    assert before == synced == 3 and left == 0
    assert "the returned module is SyncBatchNorm" in output_of(nb, "bn = nn.BatchNorm1d(16)")
    # the converted layer holds the same tensors: converting before or after .to(device) is the same
    assert "holds the argument's own parameters and buffers (the same tensors, not copies): True" in output_of(
        nb, "bn = nn.BatchNorm1d(16)")


def test_syncbatchnorm_on_cpu_raises_in_training_and_works_in_eval(nb):
    text = output_of(nb, "course.run_ranks(syncbn_forward, 2)")
    assert world_sizes(text) == [2]
    for rank in (0, 1):
        if "backend=gloo" in text:
            assert f"[rank {rank}] rank {rank}: training forward on cpu raised ValueError: SyncBatchNorm expected" in text
        else:
            assert f"[rank {rank}] rank {rank}: training forward ran on cuda" in text
        assert f"[rank {rank}] rank {rank}: eval forward ran" in text
    # the closing line says what happened: an error caught on gloo, the forward run on GPUs (never both)
    caught, ran = "the error above was caught inside each rank" in text, "on GPUs the training forward ran" in text
    assert (caught, ran) == ((True, False) if "backend=gloo" in text else (False, True)), text[-400:]


@pytest.mark.parametrize("world_size", [2, 4])
def test_synced_batchnorm_matches_the_global_batch_and_plain_does_not(nb, world_size):
    text = output_of(nb, "for synced in (False, True):")
    assert world_sizes(text) == [2, 2, 4, 4]
    line = r"{} world_size={}: equals the global batch's: (True|False) \(max diff running_mean (\S+), running_var (\S+), grad (\S+)\)"
    synced = re.search(line.format("synced BN", world_size), text)
    plain = re.search(line.format("plain BN ", world_size), text)
    assert synced and plain, text
    assert synced.group(1) == "True" and max(map(float, synced.groups()[1:])) < 1e-5, synced.group(0)
    assert plain.group(1) == "False" and float(plain.group(2)) > 1e-3, plain.group(0)
    layer = "AllReduceBatchNorm" if "backend=gloo" in text else "SyncBatchNorm"
    assert text.count(f"BatchNorm layer in this job: {layer}") == 2


def test_zero_shards_optimizer_state_and_needs_consolidation(nb):
    text = output_of(nb, "shards = course.run_ranks(zero_demo, 2")
    assert world_sizes(text) == [2]
    shards = {}
    for rank, count, total, nbytes, names in re.findall(
            r"\[rank (\d)\] rank \1 holds Adam state for (\d+) of (\d+) parameters \((\d+) bytes\): (\[.*\])", text):
        names = ast.literal_eval(names)
        assert int(count) == len(names) >= 1 and int(total) == 8 and int(nbytes) > 0
        shards[int(rank)] = (set(names), int(nbytes))
    # the predict-then-run question's answer: rank 0 holds the 256x256 weight alone, rank 1 the other seven
    answer = _answer_before(nb, "def zero_demo(rank, ckpt_path):")
    assert "524,292 bytes" in answer and "408,684 bytes" in answer
    assert shards[0] == ({"2.weight"}, 524_292) and shards[1][1] == 408_684, shards
    shards = {rank: names for rank, (names, _) in shards.items()}
    assert sorted(shards) == [0, 1]
    assert not shards[0] & shards[1], "a parameter's state is held on both ranks"
    assert len(shards[0] | shards[1]) == 8
    assert text.count("state_dict() before consolidating raised RuntimeError: Optimizer state has not been consolidated") == 2
    saved = output_of(nb, "saved = torch.load(ckpt_path")
    assert "every parameter in exactly one rank's shard: True" in saved
    assert "consolidated checkpoint holds Adam state for 8 of 8 parameters" in saved
    assert "loaded into a plain torch.optim.Adam: state for 8 parameters" in saved


def _answer_before(nb, needle: str) -> str:
    """The <details> answer of the markdown cell just before the code cell holding ``needle``."""
    index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and needle in c.source)
    question = nb.cells[index - 1]
    assert question.cell_type == "markdown" and "**Predict, then run.**" in question.source
    return question.source.split("<details>", 1)[1]


def test_float32_sums_cancel_far_from_zero_as_the_question_predicts(nb):
    """Predict, then run: the sums recipe is exact near 0 and off by about 0.1 around 1000, where one process's
    float32 BatchNorm stays near 1e-4; the answer states those values."""
    text = output_of(nb, "parts = course.run_ranks(sums_far_from_zero, 2")
    assert world_sizes(text) == [2, 2]
    found = {float(o): (float(s), float(p)) for o, s, p in re.findall(
        r"values around (\S+): all-reduced sums off by (\S+); one process's float32 BatchNorm off by (\S+)", text)}
    assert set(found) == {0.0, 1000.0}, text
    assert found[0.0][0] < 1e-5 and found[0.0][1] < 1e-5
    assert 0.03 < found[1000.0][0] < 0.3 and found[1000.0][1] < 3e-4, found
    answer = _answer_before(nb, "parts = course.run_ranks(sums_far_from_zero, 2")
    # the answer states the live values' sizes: rounding noise near 0 (its last digit varies from run to run with
    # the order of float32 additions, so within a factor of 3), a fifth of a unit around 1000 (within 50%)
    near_zero = float(re.search(r"Around 0, yes: about (\S+?)\.", answer).group(1))
    far = float(re.search(r"Around 1000, no: the output is off by about (\S+?),", answer).group(1))
    assert found[0.0][0] / 3 <= near_zero <= 3 * max(found[0.0][0], 1e-7), (found, answer)
    assert found[1000.0][0] / 1.5 <= far <= 1.5 * found[1000.0][0], (found, answer)


def test_fsdp2_shards_parameters_and_checkpoints_with_dcp(nb):
    text = output_of(nb, "course.run_ranks(fsdp_demo, 2")
    assert world_sizes(text) == [2]
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}: 0.weight is a DTensor of shape (256, 64); this rank holds (128, 64)" in text
        m = re.search(rf"\[rank {rank}\] rank {rank}: model.state_dict\(\) holds (\d+) of (\d+) numbers", text)
        assert m and int(m.group(1)) * 2 == int(m.group(2))
        m = re.search(rf"\[rank {rank}\] rank {rank}: max weight diff to the trained model: "
                      r"before loading (\S+), after loading (\S+)", text)
        assert m and float(m.group(1)) > 0 and float(m.group(2)) == 0.0, m and m.group(0)
    files = output_of(nb, 'print("files in the DCP checkpoint:"')
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        assert f"'{name}'" in files
    # converted offline into one ordinary file that a plain model loads
    assert "the full copy loads into a plain model: {'0.weight': (256, 64), '0.bias': (256,)} ..." in files


def test_dcp_reads_the_tensors_it_is_asked_for_and_full_tensor_gathers_them(nb):
    """Lesson 3's demo for fsdp_checkpoint parts 3 and 4, on its own model: asking the checkpoint for a last layer of
    another shape fails on every rank, naming the key; asking for the first two layers reads those and nothing else,
    as full_tensor() (called on every rank) shows."""
    text = output_of(nb, "course.run_ranks(read_part, 2, args=(ckpt_dir,))")
    assert world_sizes(text) == [2]
    assert ("[rank 0] asking for every tensor: ValueError: Size mismatch between saved torch.Size([10, 128]) and "
            "current: torch.Size([3, 128]) for app.model.6.weight") in text
    assert ("asked for ['0.bias', '0.weight', '2.bias', '2.weight'] ; changed: ['0.bias', '0.weight', '2.bias', "
            "'2.weight']") in text


def test_optimizer_built_before_fully_shard_leaves_the_loss_flat(nb):
    text = output_of(nb, "for optimizer_first in (True, False):")
    assert world_sizes(text) == [2, 2]
    before = ast.literal_eval(re.search(r"built before fully_shard: rank 0 losses (\[.*\])", text).group(1))
    after = ast.literal_eval(re.search(r"built after fully_shard *: rank 0 losses (\[.*\])", text).group(1))
    assert len(set(before)) == 1, before
    assert all(b < a for a, b in zip(after, after[1:])), after


def test_optimizer_memory_per_rank_with_and_without_sharding(nb):
    text = output_of(nb, "memory = {ws:")
    assert world_sizes(text) == [2, 2, 2, 4, 4, 4]
    table = {(int(ws), s): ast.literal_eval(b) for ws, s, b in
             re.findall(r"world_size=(\d) +(DDP \+ Adam|ZeRO|FSDP2): bytes per rank (\[[\d, ]+\])", text)}
    full = table[(2, "DDP + Adam")][0]
    assert full > 900_000  # 116,618 float32 parameters x 2 Adam tensors
    for world_size in (2, 4):
        ddp, zero, fsdp = (table[(world_size, s)] for s in ("DDP + Adam", "ZeRO", "FSDP2"))
        assert len(ddp) == len(zero) == len(fsdp) == world_size
        assert ddp == [full] * world_size
        assert sum(zero) == full and max(zero) < full
        for nbytes in fsdp:
            assert 0.9 * full / world_size < nbytes < 1.05 * full / world_size


def test_two_forwards_before_one_backward_are_run_live_on_this_torch(nb):
    text = output_of(nb, "outcome = course.run_ranks(two_forwards, 2)")
    assert world_sizes(text) == [2]
    match = re.search(r"torch (\S+): (ran cleanly|backward raised: .*modified by an inplace operation)", text)
    assert match, text
    version = tuple(int(v) for v in re.findall(r"\d+", match.group(1))[:2])
    if version >= (2, 13):  # has pytorch/pytorch#175851: the lesson says so
        assert match.group(2) == "ran cleanly", text


def test_fsdp2_mixed_precision_and_clipping_by_the_global_norm(nb):
    """Section 7 (issue 28 part 2): float32 shards, bfloat16 compute and all-gathers, float32 reduce-scatters; the
    global norm is the root of the sum of the ranks' squares, and clip_grad_norm_ returns it on every rank."""
    text = output_of(nb, "_ = course.run_ranks(mixed_demo, 2)")
    assert "the shard this rank stores: torch.float32" in text
    assert re.search(r"as forward uses it: +torch.bfloat16 +its input: torch.bfloat16", text), text
    assert re.search(r"gradient shard: +torch.float32", text), text
    assert re.search(r"\d+ x _allgather_base_ +sends bfloat16", text), text
    assert re.search(r"\d+ x _reduce_scatter_base_ +sends float32", text), text
    assert "sends float32" not in re.sub(r".*_reduce_scatter_base_.*", "", text), text  # gathers never float32
    text = output_of(nb, "clipped = course.run_ranks(clip_demo, 2)")
    own = [float(v) for v in re.search(r"shard norm n_r: \[([\d.]+), ([\d.]+)\]", text).groups()]
    root = float(re.search(r"sqrt\(n_0\^2 \+ n_1\^2\) = ([\d.]+)", text).group(1))
    returned = [float(v) for v in re.search(r"holding ([\d.]+) on rank 0, ([\d.]+) on rank 1", text).groups()]
    assert abs(root - (own[0] ** 2 + own[1] ** 2) ** 0.5) < 1e-4 and returned == [root, root], text
    assert "returned a DTensor" in text and "after clipping: 0.01000" in text


def test_zero_broadcasts_each_parameter_from_its_owner_after_the_step(nb):
    """Issue 40: what a ZeroRedundancyOptimizer step sends, live: by default one broadcast per parameter, the whole
    parameter, from the rank that owns it; with parameters_as_bucket_view=True one per rank."""
    text = output_of(nb, "course.run_ranks(zero_broadcasts, 2, args=(bucket_view,))")
    assert world_sizes(text) == [2, 2]
    default, flat = text.split("parameters_as_bucket_view=True")
    assert "parameters_as_bucket_view=False: optimizer.step() ran 4 collectives" in default
    sent = {name: (int(n), int(root)) for n, root, name in
            re.findall(r"broadcast_ of (\d+) values from rank (\d): (\S+)", default)}
    assert sent == {"0.weight": (128, 0), "2.weight": (64, 1), "0.bias": (16, 1), "2.bias": (4, 1)}, default
    assert ": optimizer.step() ran 2 collectives" in flat
    assert "broadcast_ of 128 values from rank 0: 0.weight" in flat
    assert "broadcast_ of 84 values from rank 1: a flat buffer of parameters" in flat
    after = " ".join(nb.cells[next(i for i, c in enumerate(nb.cells) if "def zero_broadcasts(" in c.source) + 1].source.split())
    assert "rank 0 owns the 16×8 weight (128 values), rank 1 the other three (84 values together)" in after


def test_fsdp2_pads_dim_0_in_its_collectives_not_in_the_shards(nb):
    """Issue 40: 10 rows on 4 ranks: torch.chunk's shards (3, 3, 3, 1 rows), collectives of 12 padded rows; the
    predict-then-run answer states the measured numbers."""
    text = output_of(nb, "_ = course.run_ranks(fsdp_padding, 4)")
    assert world_sizes(text) == [4]
    for rank, rows in enumerate((3, 3, 3, 1)):
        assert f"[rank {rank}] rank {rank}: holds weight ({rows}, 4), bias ({rows},)" in text, text
    assert "_allgather_base_: the whole tensor 60 values, each rank's part 15" in text
    assert "_reduce_scatter_base_: the whole tensor 60 values, each rank's part 15" in text
    answer = " ".join(_answer_before(nb, "_ = course.run_ranks(fsdp_padding, 4)").split())
    assert "Ranks 0 to 2 hold 3 rows" in answer and "rank 3 holds 1 row" in answer
    assert "15 values" in answer and "delivers 60 values, 10 of them padding" in answer


def test_fsdp2_units_without_parameters_of_their_own_send_nothing(nb):
    """Issue 40: a root holding every parameter gathers once; per-layer units gather twice and reduce-scatter once
    each; a root (or a ReLU) unit holding no parameters adds no collective."""
    text = output_of(nb, "course.run_ranks(unit_collectives, 2, args=(layout,))")
    assert world_sizes(text) == [2, 2, 2]
    assert "the root only: 1 x _allgather_base_ of 144, 1 x _reduce_scatter_base_ of 144" in text
    for layout in ("each Linear, then the root", "every module, then the root"):
        assert f"{layout}: 4 x _allgather_base_ of 72, 2 x _reduce_scatter_base_ of 72" in text, text


def test_activation_memory_is_counted_and_checkpointing_keeps_only_the_blocks_input(nb):
    """The block saves each layer's input for backward (parameters aside): the bytes the lesson's answer states;
    under checkpoint only the block's input, every layer but the last run again in backward, same gradients."""
    text = output_of(nb, "run_block(use_checkpoint")
    rows = dict(re.findall(r"^(plain block|checkpoint\(block\)) *: (.*)$", text, re.M))
    plain = re.search(r"saved (\d+) tensor\(s\), (\d+) bytes (\[.*?\]); forward runs per layer (\{.*?\})", rows["plain block"])
    ckpt = re.search(r"saved (\d+) tensor\(s\), (\d+) bytes (\[.*?\]); forward runs per layer (\{.*?\})",
                     rows["checkpoint(block)"])
    batch, width, hidden = 32, 64, 256
    assert ast.literal_eval(plain.group(3)) == [(batch, width), (batch, hidden), (batch, hidden)]
    assert int(plain.group(2)) == 4 * (batch * width + 2 * batch * hidden)
    assert ast.literal_eval(plain.group(4)) == {"0": 1, "1": 1, "2": 1}
    assert ast.literal_eval(ckpt.group(3)) == [(batch, width)] and int(ckpt.group(2)) == 4 * batch * width
    assert ast.literal_eval(ckpt.group(4)) == {"0": 2, "1": 2, "2": 1}  # recomputation stops once backward has its tensors
    assert float(re.search(r"max \|input gradient difference\| = (\S+)", text).group(1)) == 0
    answer = " ".join(next(c.source for c in nb.cells if c.get("id") == "activation-memory-answer").split())
    assert f"Three tensors, {plain.group(2)} bytes" in answer and "(8 KiB)" in answer


def test_a_2x2_device_mesh_makes_a_group_per_row_and_column(nb):
    """Rank r sits at (r // 2, r % 2); its dp group is its column, its tp group its row; an all-reduce of the rank
    numbers over each gives that line's sum: the figures the lesson's answer gives for rank 3."""
    text = output_of(nb, "run_ranks(mesh_groups")
    assert world_sizes(text) == [4]
    rows = re.findall(r"rank (\d): coordinate \(dp, tp\) = \((\d), (\d)\); its dp group (\[.*?\]), its tp group (\[.*?\]); "
                      r"all_reduce of the ranks' numbers over dp = (\d+), over tp = (\d+)", text)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], text
    for rank, dp, tp, dp_group, tp_group, dp_sum, tp_sum in rows:
        rank, dp, tp = int(rank), int(dp), int(tp)
        assert (dp, tp) == divmod(rank, 2)
        column, row = [tp, 2 + tp], [2 * dp, 2 * dp + 1]
        assert ast.literal_eval(dp_group) == column and ast.literal_eval(tp_group) == row
        assert (int(dp_sum), int(tp_sum)) == (sum(column), sum(row))
    answer = " ".join(next(c.source for c in nb.cells if c.get("id") == "device-mesh-answer").split())
    assert "ranks 1 and 3: 1 + 3 = 4" in answer and "ranks 2 and 3: 2 + 3 = 5" in answer


def test_a_vector_sharded_by_hand_is_reduce_scattered_then_all_gathered(nb):
    """Issue 42: section 4b's mechanism, live on 3 ranks: each rank receives the sum of its own piece only (the
    last piece shorter), and the all-gather gives every rank the whole sum back."""
    text = output_of(nb, "course.run_ranks(sharded_sum, 3)")
    assert world_sizes(text) == [3]
    owned = {int(r): ([int(e) for e in elems.split(", ")], [float(v) for v in sums.split(", ")])
             for r, elems, sums in re.findall(r"rank (\d) owns elements \[([\d, ]+)\]: their sum over the ranks is "
                                              r"\[([\d., ]+)\]", text)}
    assert {r: e for r, (e, _) in owned.items()} == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9]}, text
    assert all(s == [6.0 * e for e in elems] for elems, s in owned.values()), text
    assert "equal to the sum of every rank's vector: True" in text
