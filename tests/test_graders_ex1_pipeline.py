"""Exercise 1's pipeline notebook (graders.pipeline): each check catches its class of mistake, and only that one.

The checks are called directly with the notebook's reference, right answers in other styles (Megatron's warm-up,
steady state and cool-down loops over a counter; a class with non-blocking receives and GPipe's backwards last
micro-batch first), realistic mistakes and forgeries; then the notebook is graded with mistakes packed together
(:func:`submissions.pack`). What the grader's stages record, and the stall watch's rule for point-to-point
deadlocks, are tested here too.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import submissions
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graders.pipeline.checks as pp
from course.checks import TIMEOUT_ENV
from course.launcher import stall
from graders.pipeline.stages import RemoteStage, StageServer

cloudpickle.register_pickle_by_value(sys.modules[__name__])

A, NB = "ex1-parallelism", "pipeline"
HANG_TIMEOUT = 20
HIDDEN = {"configs": ((2, 5), (4, 6)), "rows": 2, "seed": 3}
fails = submissions.fails


# --- the reference, from the notebook, and its mistakes ----------------------------------------------------------


def _answer(name: str, gid: str, *edits: tuple[str, str]) -> object:
    """The notebook's answer cell ``gid`` with ``edits`` applied, defined here under ``name``."""
    function = "pipeline_step" if gid == "pp_pipeline_step" else "predict_pipeline"
    return submissions.answer_function(A, NB, gid, function, name,
                                       {"torch": torch, "dist": dist, "F": F, "__name__": __name__}, *edits)


reference = _answer("reference", "pp_pipeline_step")
predict = _answer("predict", "pp_predict")
#: the loss of each micro-batch not divided by their number: gradients n_micro times too large
undivided = _answer("undivided", "pp_pipeline_step", ("F.mse_loss(out, ys[i]) / n_micro", "F.mse_loss(out, ys[i])"))
#: "1f1b" run as GPipe: right gradients, every stage holds every micro-batch
always_gpipe = _answer("always_gpipe", "pp_pipeline_step", ('if schedule == "gpipe":', "if True:"))
#: one forward too few in 1F1B's warm-up (Megatron's p - s - 1 without its steady-state forward first)
short_warmup = _answer("short_warmup", "pp_pipeline_step",
                       ("warm = min(world_size - rank, n_micro)", "warm = max(1, min(world_size - rank - 1, n_micro))"))
#: blocking sends: on gloo a send waits for its receive, so 1F1B's neighbours wait for each other
blocking = _answer("blocking", "pp_pipeline_step", ("sending.append(dist.isend(out, dst=rank + 1))",
                                                    "dist.send(out, dst=rank + 1)"),
                   ("sending.append(dist.isend(gx, dst=rank - 1))", "dist.send(gx, dst=rank - 1)"))
#: rank 0 takes every n_micro-th row as a micro-batch, the last rank blocks of rows: inputs and targets mismatched
strided = _answer("strided", "pp_pipeline_step",
                  ("xs = x.chunk(n_micro) if first else None", "xs = [x[i::n_micro] for i in range(n_micro)] if first "
                   "else None"))
#: the first stage skips its backwards (nothing to send back): its weights get no gradient
no_first_backward = _answer("no_first_backward", "pp_pipeline_step",
                            ("            gx = stage.backward(i, g)\n",
                             "            if first:\n                continue\n            gx = stage.backward(i, g)\n"))
#: the prediction: 1F1B's peaks as p on every stage; the bubble over the work alone
peaks_all_p = _answer("peaks_all_p", "pp_predict", ("[min(p - s, m) for s in range(p)]", "[min(p, m)] * p"))
bubble_over_work = _answer("bubble_over_work", "pp_predict", ("(p - 1) / (m + p - 1)", "(p - 1) / m"))


# --- right answers in other styles ----------------------------------------------------------------------------


def _recv_from(shape, src):
    buf = torch.empty(shape)
    dist.recv(buf, src=src)
    return buf


def megatron_style(stage, rank, world_size, x, y, n_micro, schedule):
    """Megatron's shape: warm-up forwards, then a backward and a forward while forwards remain, then the rest;
    counters instead of a list of steps; autograd.grad for the loss; a 0-d tensor returned."""
    prev = rank - 1 if rank > 0 else None
    nxt = rank + 1 if rank < world_size - 1 else None
    inputs = torch.tensor_split(x, n_micro) if prev is None else None
    targets = torch.tensor_split(y, n_micro) if nxt is None else None
    pending, losses, out_grads = [], [], {}
    count = {"fwd": 0, "bwd": 0}

    def forward():
        i = count["fwd"]
        a = inputs[i] if prev is None else _recv_from(stage.in_shape, prev)
        out = stage.forward(i, a)
        if nxt is None:
            out = out.detach().requires_grad_()
            loss = F.mse_loss(out, targets[i]) / n_micro
            out_grads[i] = torch.autograd.grad(loss, out)[0]
            losses.append(loss.detach())
        else:
            pending.append(dist.isend(out.contiguous(), nxt))
        count["fwd"] += 1

    def backward():
        i = count["bwd"]
        g = out_grads.pop(i) if nxt is None else _recv_from(stage.out_shape, nxt)
        gin = stage.backward(i, g)
        if prev is not None:
            pending.append(dist.isend(gin, prev))
        count["bwd"] += 1

    warmup = n_micro if schedule == "gpipe" else min(world_size - rank, n_micro)
    for _ in range(warmup):
        forward()
    while count["bwd"] < n_micro:
        backward()
        if count["fwd"] < n_micro:
            forward()
    for req in pending:
        req.wait()
    return torch.stack(losses).sum() if nxt is None else None


class Runner:
    """A class per stage: non-blocking receives waited on at once, sends kept until the end, a summed loss over
    the batch's element count (the same as the mean of the micro-batches' means)."""

    def __init__(self, stage, rank, world_size, x, y, n_micro):
        self.stage, self.m = stage, n_micro
        self.up = None if rank == 0 else rank - 1
        self.down = None if rank == world_size - 1 else rank + 1
        self.xs = None if x is None else list(x.split(x.shape[0] // n_micro))
        self.ys = None if y is None else list(y.split(y.shape[0] // n_micro))
        self.total = None if y is None else y.numel()
        self.loss, self.grads, self.outbox = 0.0, {}, []

    def take(self, shape, src):
        buf = torch.zeros(shape)
        dist.irecv(buf, src=src).wait()
        return buf

    def give(self, tensor, dst):
        self.outbox.append((dist.isend(tensor, dst=dst), tensor))

    def fwd(self, i):
        act = self.xs[i] if self.up is None else self.take(self.stage.in_shape, self.up)
        out = self.stage.forward(i, act)
        if self.down is None:
            out.requires_grad_(True)
            loss = torch.nn.MSELoss(reduction="sum")(out, self.ys[i]) / self.total
            loss.backward()
            self.grads[i], self.loss = out.grad, self.loss + loss.item()
        else:
            self.give(out, self.down)

    def bwd(self, i):
        grad = self.grads.pop(i) if self.down is None else self.take(self.stage.out_shape, self.down)
        back = self.stage.backward(i, grad)
        if self.up is not None:
            self.give(back, self.up)

    def finish(self):
        for work, _ in self.outbox:
            work.wait()
        return self.loss if self.down is None else None


def class_style(stage, rank, world_size, x, y, n_micro, schedule):
    run = Runner(stage, rank, world_size, x, y, n_micro)
    if schedule == "gpipe":  # the GPipe paper's figure: backwards last micro-batch first
        for i in range(n_micro):
            run.fwd(i)
        for i in reversed(range(n_micro)):
            run.bwd(i)
    else:
        ahead = min(world_size - rank, n_micro)
        for i in range(ahead):
            run.fwd(i)
        for i in range(n_micro):
            run.bwd(i)
            if i + ahead < n_micro:
                run.fwd(i + ahead)
    return run.finish()


def predict_by_simulation(p, m, schedule):
    """Right by another road: a small simulator of one's own (the grader's is refused)."""
    orders = []
    for s in range(p):
        warm = m if schedule == "gpipe" else min(p - s, m)
        order = [("F", i) for i in range(warm)]
        for i in range(m):
            order.append(("B", i))
            if warm + i < m:
                order.append(("F", warm + i))
        orders.append(order)
    end, free, pos, held, peak = {}, [0] * p, [0] * p, [0] * p, [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(orders[s]):
                op, i = orders[s][pos[s]]
                deps = [(op, i, s - 1)] if op == "F" and s else [("B", i, s + 1)] if op == "B" and s < p - 1 else []
                if any(d not in end for d in deps):
                    break
                end[(op, i, s)] = free[s] = max([free[s]] + [end[d] for d in deps]) + 1
                held[s] += 1 if op == "F" else -1
                peak[s] = max(peak[s], held[s])
                pos[s] += 1
    return 1 - 2 * m * p / (p * max(free)), peak


def predict_in_float32(p, m, schedule):
    """Right: the bubble computed with float32 tensors (a few 1e-8 off the exact fraction), the peaks a tensor."""
    steps = torch.tensor(2 * (m + p - 1), dtype=torch.float32)
    bubble = 1 - (2 * m * p) / (p * steps)
    peaks = torch.full((p,), m) if schedule == "gpipe" else torch.clamp(p - torch.arange(p), max=m)
    return bubble, peaks


def looks_first(stage, rank, world_size, x, y, n_micro, schedule):
    """Wrong: rank 0 runs micro-batch 0 forward once more before the schedule (to see the output's shape): the
    stage's work is no longer one forward and one backward per micro-batch."""
    if rank == 0:
        stage.forward(0, x.chunk(n_micro)[0])
    return reference(stage, rank, world_size, x, y, n_micro, schedule)


def predict_from_the_grader(p, m, schedule):
    """A forgery: the grader's own simulator, which refuses to run in the predicting rank."""
    from graders.pipeline.checks import truth

    found = truth(p, m, schedule)
    return found["bubble"], found["peak"]


def second_driver(stage, rank, world_size, x, y, n_micro, schedule):
    """A forgery: rank 0 also connects to stage 1 (its token read from the harness's frame), then works as the
    reference does: a stage driven from two processes is refused and named."""
    if rank == 0:
        runs = sys._getframe(1).f_locals["runs"]
        for sched, address, tokens, shapes in runs:
            if sched == schedule:
                RemoteStage(address, tokens[1], 1, *shapes[1])
    return reference(stage, rank, world_size, x, y, n_micro, schedule)


# --- the checks, called directly --------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [reference, megatron_style, class_style], ids=lambda f: f.__name__)
def test_right_schedules_pass_both_checks_visible_and_hidden(step):
    for kwargs in ({}, HIDDEN):
        pp.check_pipeline_gradients(step, **kwargs)
        pp.check_pipeline_schedule(step, **kwargs)


def test_a_loss_not_divided_by_the_micro_batches_loses_the_gradients_only():
    fails(pp.check_pipeline_gradients, undivided, "[rank 0]", "stage 0's gradients are 4 x the whole batch's",
          "not divided by the number of micro-batches", "divide each micro-batch's loss by n_micro")
    pp.check_pipeline_schedule(undivided)


def test_gpipe_run_for_1f1b_loses_the_schedule_only_naming_the_memory():
    pp.check_pipeline_gradients(always_gpipe)
    fails(pp.check_pipeline_schedule, always_gpipe, "[rank 0]", "not in 1f1b's order", "step 4",
          "F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3", "held up to 4 at once", "at most 3")


def test_a_short_warm_up_loses_the_schedule_only():
    pp.check_pipeline_gradients(short_warmup)
    fails(pp.check_pipeline_schedule, short_warmup, "[rank 0]", "F0 F1 B0 F2", "held up to 2 at once",
          "3 forwards (p - s, at most m)")


def test_mismatched_micro_batches_lose_the_gradients_only():
    fails(pp.check_pipeline_gradients, strided, "stage", "differ from the whole batch's", "rows i*b")
    pp.check_pipeline_schedule(strided)


def test_a_repeated_forward_loses_the_gradients_too():
    fails(pp.check_pipeline_gradients, looks_first, "[rank 0]",
          "stage 0 did not run every micro-batch forward and backward once", "forwards of [0, 0, 1, 2, 3]")


def test_a_first_stage_without_backwards_is_named():
    fails(pp.check_pipeline_gradients, no_first_backward, "[rank 0]",
          "stage 0 did not run every micro-batch forward and backward once", "backwards of []")
    fails(pp.check_pipeline_schedule, no_first_backward, "[rank 0]", "not in gpipe's order")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_blocking_sends_deadlock_and_are_named_within_seconds(monkeypatch):
    """On gloo a send waits for its receive: 1F1B's neighbours wait for each other. The stall watch ends the job
    (every rank idle in send or recv) long before the deadline."""
    monkeypatch.setenv(TIMEOUT_ENV, str(HANG_TIMEOUT))
    start = time.monotonic()
    message = fails(pp.check_pipeline_gradients, blocking, "deadlocked", "waits in send",
                    "on gloo a send waits until its peer receives", "dist.isend")
    assert time.monotonic() - start < HANG_TIMEOUT, f"{time.monotonic() - start:.0f} s: the deadline, not the watch"
    assert "[ranks 0, 1, 2]" in message, message


def test_a_second_connection_to_a_stage_is_refused_and_named():
    message = fails(pp.check_pipeline_schedule, second_driver, "stage 1")
    # whichever connected first, the other is refused: the forger's (the stage was asked by two processes) or the
    # harness's (the job fails, the grader's refusal shown)
    assert "more than one connection" in message or "a second connection as rank 1" in message, message


def test_predictions_right_and_wrong():
    pp.check_pipeline_prediction(predict, drawn=40)
    pp.check_pipeline_prediction(predict_by_simulation, asked=(), drawn=40)
    pp.check_pipeline_prediction(predict_in_float32, drawn=40)
    fails(pp.check_pipeline_prediction, peaks_all_p, "predicted peaks are wrong", "1f1b, 3 stages",
          "expected: [3, 2, 1]", "got:      [3, 3, 3]")
    fails(pp.check_pipeline_prediction, bubble_over_work, "predicted bubble is wrong", "gpipe, 3 stages",
          "0.333333333", "got:      0.5\n")
    fails(pp.check_pipeline_prediction, predict_from_the_grader, "refused to the answer")


# --- what the grader's stages record ------------------------------------------------------------------------


def test_a_stage_records_its_work_in_order_and_refuses_what_a_schedule_cannot_do():
    with StageServer([3, 4, 2], rows=2, n_micro=2) as server:
        (in0, out0), _ = server.shapes()
        stage = RemoteStage(server.address, server.tokens[0], 0, in0, out0)
        out = stage.forward(torch.tensor(0), torch.ones(in0))  # a micro-batch's number as a tensor: an int too
        assert out.shape == out0
        with pytest.raises(RuntimeError, match=r"backward\(1, grad\) before forward\(1\)"):
            stage.backward(1, torch.ones(out0))
        with pytest.raises(RuntimeError, match="micro-batch 5 does not exist"):
            stage.forward(5, torch.ones(in0))
        with pytest.raises(RuntimeError, match=r"got x of shape \(2, 5\)"):
            stage.forward(1, torch.ones(2, 5))
        grad_in = stage.backward(0, torch.ones(out0))
        assert grad_in.shape == in0
        with pytest.raises(RuntimeError, match="a second time"):
            stage.backward(0, torch.ones(out0))
        intruder = RemoteStage(server.address, server.tokens[0], 0, in0, out0)
        with pytest.raises(RuntimeError, match="already driven by process"):
            intruder.forward(1, torch.ones(in0))
        report = server.stages()[0]
        assert [(op, i, held) for op, i, held in report["journal"]] == [("F", 0, 1), ("B", 0, 0)]
        assert len(report["pids"]) == 2 and report["refused"][-1].startswith("a second connection")
        assert report["grads"]["0.weight"] is not None and report["grads"]["0.weight"].abs().sum() > 0
        with pytest.raises(TypeError, match="cannot be pickled"):
            cloudpickle.dumps(stage)


def test_the_simulator_gives_the_schedules_known_bubbles_and_peaks_and_sees_a_deadlock():
    for p, m in ((2, 1), (3, 4), (4, 8), (5, 2)):
        for schedule in pp.SCHEDULES:
            found = pp.truth(p, m, schedule)
            assert found["bubble"] == pytest.approx((p - 1) / (m + p - 1))
            assert found["peak"] == ([m] * p if schedule == "gpipe" else [min(p - s, m) for s in range(p)])
    # two stages, each waiting for the other's backward before its own forward: no order runs
    assert pp.simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]) is None


def test_the_stall_rule_for_point_to_point_deadlocks():
    def answer(op=None, peer=None, waiting=True):
        return {"waiting": waiting, "entries": [], "p2p": {"op": op, "peer": peer} if op else None,
                "site": {"where": "Cell In[3], line 9", "line": "dist.send(out, dst=rank + 1)", "function": "f"}}

    # 1F1B with blocking sends: rank 1 sends to 2 while 2 sends to 1; rank 0 waits to receive from 1
    verdict = stall.analyse({0: answer("recv", 1), 1: answer("send", 2), 2: answer("send", 1)}, [])
    assert verdict is not None and verdict.kind == "p2p"
    assert "rank 1 waits in send to rank 2 (Cell In[3], line 9" in verdict.lined_up and "dist.isend" in verdict.hint
    assert stall.analyse({0: answer("recv", 1), 1: answer("recv", 0)}, []).kind == "p2p"  # both receive first
    assert stall.analyse({0: answer("recv", 1)}, [1]).kind == "p2p"  # its peer returned
    # a send and the receive that takes it may only be slow (a starved machine): never a verdict
    assert stall.analyse({0: answer("send", 1), 1: answer("recv", 0)}, []) is None
    assert stall.analyse({0: answer("send", 1), 1: answer("recv", None)}, []) is None  # a receive from any source
    assert stall.analyse({0: answer("send", None), 1: answer("recv", 0)}, []) is None  # a peer the probe cannot name
    assert stall.analyse({0: answer("send", 1), 1: answer(waiting=False)}, []) is None  # rank 1 computes
    assert stall.analyse({0: answer("send", 1), 1: answer()}, []) is None  # rank 1 in a collective's wait


def _looked_at_while_receiving(rank):
    """Rank 0 waits in recv from rank 1 (which sleeps 2 s first) while a thread reads its main thread's frames."""
    import threading

    from course.launcher.rank import point_to_point

    dist.init_process_group("gloo")
    seen, main = {}, threading.main_thread().ident

    def look():
        time.sleep(1.0)
        seen["p2p"] = point_to_point(sys._current_frames().get(main))

    if rank == 0:
        looker = threading.Thread(target=look)
        looker.start()
        dist.recv(torch.zeros(1), src=1)
        looker.join()
    else:
        time.sleep(2.0)
        dist.send(torch.ones(1), dst=0)
    dist.destroy_process_group()
    return seen.get("p2p")


def test_the_probe_names_the_point_to_point_call_and_its_peer():
    """What a rank's probe reports, read from its main thread's frames while it is blocked in torch's recv; a
    receive that its peer serves late is no deadlock (rank 1 sleeps, it is not in send or recv)."""
    import course

    assert course.run_ranks(_looked_at_while_receiving, 2) == [{"op": "recv", "peer": 1}, None]


# --- the notebook ---------------------------------------------------------------------------------------------

WRONG = {
    # name: (answer cell, old text, new text, the test cells that must fail, words their first message must contain)
    "loss not divided by n_micro": ("pp_pipeline_step", "F.mse_loss(out, ys[i]) / n_micro", "F.mse_loss(out, ys[i])",
                                    ["pp_test_gradients"], ["4 x the whole batch's", "n_micro"]),
    "1F1B peaks as p everywhere": ("pp_predict", "[min(p - s, m) for s in range(p)]", "[min(p, m)] * p",
                                   ["pp_test_predict"], ["predicted peaks are wrong"]),
    "a short warm-up": ("pp_pipeline_step", "warm = min(world_size - rank, n_micro)",
                        "warm = max(1, min(world_size - rank - 1, n_micro))", ["pp_test_schedule"],
                        ["not in 1f1b's order", "held up to 2 at once"]),
}
MISTAKES = {name: ([(gid, old, new)], failing, words) for name, (gid, old, new, failing, words) in WRONG.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", submissions.pack(MISTAKES), ids=" + ".join)
def test_wrong_submissions_lose_exactly_their_tests(tmp_path, group):
    submissions.grade_packed(A, tmp_path, MISTAKES, group, notebook=NB)


def test_the_grader_refuses_a_request_it_would_have_to_allocate_gigabytes_for():
    """A rank that writes its own header asking for 65536 x 65536 floats (16 GiB) is cut off before the grader reads
    a byte of it; the refusal is in the record."""
    import socket
    import struct

    with StageServer([3, 4], rows=2, n_micro=1) as server:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(server.address)
        raw.sendall(bytes.fromhex(server.tokens[0]) + struct.pack("<ciiii", b"F", 0, 0, 1 << 16, 1 << 16))
        raw.settimeout(10)
        assert raw.recv(1) == b""  # closed
        raw.close()
        assert any("malformed request" in r for r in server.report()["refused"])
