"""fsdp_checkpoint part 5, mixed precision and clipping with FSDP2 (graders/fsdp_checkpoint/precision.py; issue 28 part 2).

Right answers in several styles pass at the visible and the hidden sizes; each realistic mistake fails its
check with a message that names it; the notebook is graded with a wrong answer of each kind.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graders.fsdp_checkpoint.precision as ex3p

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex3-syncbn-sharding", "fsdp_checkpoint"
HIDDEN = {"world_size": 3, "width": 10, "depth": 3, "seed": 4}
fails = submissions.fails


# --- mixed precision ------------------------------------------------------------------------------------


def shard_mixed(model):
    """The notebook's reference."""
    from dataclasses import replace

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    inside = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=inside)
    fully_shard(model, mp_policy=replace(inside, output_dtype=torch.float32))


def shard_every_linear(model):
    """Another style: every Linear its own unit, found by type, the policy from a helper."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def policy(output_dtype=None):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=output_dtype,
                                    cast_forward_inputs=True)

    for module in list(model.modules()):
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mp_policy=policy())
    fully_shard(model, mp_policy=policy(torch.float32))


def shard_root_only(model):
    """Another style: one unit for the whole model (more memory at once, the same precision)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                      output_dtype=torch.float32))


def shard_and_cast_by_hook(model):
    """Another style: the lesson's policy on every unit, and a forward hook that casts what the model returns."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.register_forward_hook(lambda module, inputs, output: output.float())


def shard_bf16_output(model):
    """The lesson's policy as it is: everything right but the output, which stays bfloat16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def shard_float32_everywhere(model):
    """float32 outputs asked of every unit: the head (in the outer unit, bfloat16) then gets a float32 input."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def shard_reduce_bf16(model):
    from dataclasses import replace

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=replace(policy, output_dtype=torch.float32))


def shard_cast_to_bf16(model):
    from torch.distributed.fsdp import fully_shard

    model.to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def shard_autocast_only(model):
    """Computes in bf16 by wrapping forward in autocast: the gathered parameters are still float32."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    forward = model.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = autocast_forward


def shard_blocks_only(model):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)


@pytest.mark.parametrize("answer", [shard_mixed, shard_every_linear, shard_root_only, shard_and_cast_by_hook])
def test_right_precision_passes_visible_and_hidden(answer):
    ex3p.check_mixed_precision(answer)
    ex3p.check_mixed_precision(answer, **HIDDEN)


@pytest.mark.parametrize("answer,words", [
    (shard_reduce_bf16, ["not reduced in float32", "reduce_dtype"]),
    (shard_cast_to_bf16, ["parameters themselves are not float32", "do not cast the model"]),
    (shard_autocast_only, ["did not gather bfloat16", "autocast alone still gathers float32"]),
    (shard_blocks_only, ["not sharded", "embed.weight"]),
    (shard_bf16_output, ["output is not float32", "returned torch.bfloat16"]),
    (shard_float32_everywhere, ["raised RuntimeError", "same dtype"]),
])
def test_precision_mistakes_fail_naming_them(answer, words):
    fails(ex3p.check_mixed_precision, answer, *words)


def test_the_bf16_tolerance_separates_right_from_float32_compute_and_bfloat16_reduction():
    """The tolerance's justification, measured: the reference repeats a right answer's bf16 arithmetic; gradients
    computed in float32, or each rank's bf16 gradients summed in bfloat16, differ by far more than BF16_TOL."""
    for ws, width, depth, seed in [(2, 8, 2, 0), (3, 10, 3, 4)]:
        want = ex3p._mixed_reference(ws, width, depth, seed)
        fp32, bf16 = {}, {}
        for rank in range(ws):
            x, y = ex3p.batch(rank, 0, seed)
            for dtype, total in ((torch.float32, fp32), (torch.bfloat16, bf16)):
                model = ex3p.make_net(width, depth, seed).to(dtype)
                F.mse_loss(model(x.to(dtype)).float(), y).backward()
                for n, p in model.named_parameters():
                    total[n] = total[n] + p.grad if n in total else p.grad
        for total in (fp32, bf16):
            worst = max(((total[n] / ws).float() - want[n]).abs().max().item() / want[n].abs().max().item()
                        for n in want)
            assert worst > 10 * ex3p.BF16_TOL, worst


# --- clipping ---------------------------------------------------------------------------------------------


def clip_gradients(model, max_norm):
    """The notebook's reference."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor().item()


def clipped_by_hand(model, max_norm):
    """Another style: sum of squares of the local shards, one all-reduce, the factor applied by hand."""
    squares = torch.zeros(())
    for p in model.parameters():
        squares += p.grad.to_local().pow(2).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt()
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in model.parameters():
        p.grad.mul_(factor)
    return norm


def clipped_with_total_norm(model, max_norm):
    """Another style: torch's two halves, get_total_norm then clip_grads_with_norm_, on the DTensor gradients."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return total


def clip_local_shards(model, max_norm):
    local = [p.grad.to_local() for p in model.parameters()]  # views of this rank's shards
    norm = torch.nn.utils.get_total_norm(local)
    for g in local:
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def clip_local_return_global(model, max_norm):
    global_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    local = [p.grad.to_local() for p in model.parameters()]
    local_norm = torch.nn.utils.get_total_norm(local)
    for g in local:
        g.mul_(torch.clamp(max_norm / (local_norm + 1e-6), max=1.0))
    return global_norm


def no_clipping(model, max_norm):
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return norm


def clip_each_parameter(model, max_norm):
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    for p in model.parameters():
        torch.nn.utils.clip_grad_norm_([p], max_norm)
    return norm


def scale_always(model, max_norm):
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    for p in model.parameters():
        p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def return_clipped_norm(model, max_norm):
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return norm


@pytest.mark.parametrize("answer", [clip_gradients, clipped_by_hand, clipped_with_total_norm])
def test_right_clipping_passes_visible_and_hidden(answer):
    ex3p.check_clipping(answer)
    ex3p.check_clipping(answer, **HIDDEN)


@pytest.mark.parametrize("answer,words", [
    (clip_local_shards, ["step 0 (clipping engaged)", "the rank's own shards", "sum over ranks"]),
    (clip_local_return_global, ["step 0", "each rank clipped by the norm of its own shards"]),
    (no_clipping, ["step 0 (clipping engaged)", ": no clipping"]),
    (clip_each_parameter, ["step 0", "each parameter clipped by its own norm", "one total norm"]),
    (scale_always, ["step 1 (no clipping needed)", "even below it", "only when the norm exceeds"]),
    (return_clipped_norm, ["step 0", "the one after clipping"]),
])
def test_clipping_mistakes_fail_naming_them(answer, words):
    fails(ex3p.check_clipping, answer, *words)


# --- the notebook ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit,failing,words", [
    (("ex3f_precision", "reduce_dtype=torch.float32", "reduce_dtype=torch.bfloat16"),
     ["ex3f_test_mixed_precision"], ["not reduced in float32"]),
    (("ex3f_precision", "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)",
      "torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])"),  # measured, never applied
     ["ex3f_test_clipping"], ["step 0 (clipping engaged)", ": no clipping"]),
])
def test_wrong_answers_in_the_notebook_lose_exactly_their_cells(tmp_path, edit, failing, words):
    report = submissions.grade_edited(A, tmp_path, edit, notebook=NB)
    submissions.assert_loses_exactly(report, A, failing, words, notebook=NB)
