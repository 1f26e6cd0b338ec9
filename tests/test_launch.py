"""The launcher: real multi-rank jobs, their failures, deadlines and leftovers."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import course
from course.launcher.job import resolve_backend
from course.paths import CHECKOUT

pytestmark = pytest.mark.timeout(180)


# --- helpers ---------------------------------------------------------------


def _descendants() -> set[int]:
    """Live descendants of this process, except the forkserver and its resource tracker."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        if "forkserver" in cmdline or "resource_tracker" in cmdline:
            continue
        out.add(child.pid)
    return out


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- functions that run on the ranks (module level: shipped by reference) --------


def all_reduce_rank(rank):
    dist.init_process_group(course.backend())
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    world = dist.get_world_size()
    dist.destroy_process_group()
    return {"rank": rank, "sum": t.item(), "world_size": world, "env_rank": int(os.environ["RANK"])}


def ddp_step(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(course.backend())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp_model = DDP(model)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # rank-dependent data
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    torch.nn.functional.mse_loss(ddp_model(x), y).backward()
    opt.step()
    params = [p.detach().clone() for p in ddp_model.module.parameters()]
    grads_local_differ = True
    dist.destroy_process_group()
    return params, grads_local_differ


def raise_on_rank_1(rank):
    print(f"rank {rank} starting")
    dist.init_process_group("gloo")
    if rank == 1:
        raise ValueError("bad value on purpose")
    dist.barrier()  # rank 0 waits here for a peer that has died
    time.sleep(60)
    return rank


def deadlock(rank):
    dist.init_process_group("gloo")
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(3600)


def stubborn_loop(rank):
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "600"])
    print(f"child pid {child.pid}", flush=True)
    while True:
        pass


def raises_when_stopped(rank):
    """Loops until the launcher's deadline, then (rank 1) raises as a rank does whose peer the launcher killed
    first (gloo's "connection closed"): what it reports after the deadline must not hide that it was running."""
    import signal

    def lost_peer(*_):
        raise RuntimeError("Connection closed by peer")

    if rank == 1:
        signal.signal(signal.SIGUSR1, lost_peer)
    while True:
        time.sleep(0.01)


def exit_hard(rank):
    if rank == 1:
        os._exit(3)
    time.sleep(30)


def unpicklable(rank):
    return lambda: rank  # fine: cloudpickle handles lambdas


def return_lock(rank):
    import threading

    return threading.Lock()


def noisy(rank):
    print(f"stdout from {rank}")
    print(f"stderr from {rank}", file=sys.stderr)
    return rank


def scalar_job(rank, base):
    return base + rank


# --- tests -----------------------------------------------------------------


def test_returns_values_in_rank_order_with_torchrun_env():
    values = course.run_ranks(all_reduce_rank, 4, echo=False)
    assert [v["rank"] for v in values] == [0, 1, 2, 3]
    assert [v["env_rank"] for v in values] == [0, 1, 2, 3]
    assert all(v["sum"] == 10.0 and v["world_size"] == 4 for v in values)


def test_args_are_passed_after_rank():
    assert course.run_ranks(scalar_job, 3, args=(10,), echo=False) == [10, 11, 12]


def test_ddp_step_leaves_parameters_bitwise_equal():
    values = course.run_ranks(ddp_step, 3, echo=False)
    reference = values[0][0]
    for params, _ in values[1:]:
        for a, b in zip(reference, params):
            assert torch.equal(a, b)


def test_job_result_reports_destroy_and_output():
    job = course.launch(all_reduce_rank, 2, echo=False)
    assert job.destroy_called == [True, True]
    assert job.pg_initialized == [False, False]
    assert job.backend == "gloo"
    job = course.launch(noisy, 2, echo=False)
    assert "stdout from 1" in job.outputs[1] and "stderr from 1" in job.outputs[1]


def test_rank_error_names_rank_and_stops_the_others():
    before = _descendants()
    start = time.monotonic()
    with pytest.raises(course.RankFailedError) as info:
        course.run_ranks(raise_on_rank_1, 2, echo=False, timeout=60)
    elapsed = time.monotonic() - start
    err = info.value
    text = str(err)
    assert err.ranks[0] == 1
    assert "rank 1 raised ValueError: bad value on purpose" in text
    assert 'raise ValueError("bad value on purpose")' in text  # the student's frame, with source
    assert "rank 1 starting" in text  # its output
    assert err.failures[1].exc_type == "ValueError"
    assert isinstance(err.failures[1].exception, ValueError)
    assert elapsed < 20, f"rank 0 kept running for {elapsed:.1f} s"
    assert _descendants() <= before


def test_deadlock_fails_within_deadline_naming_the_stuck_rank():
    """Rank 0 waits in an all_reduce rank 1 never calls (rank 1 sleeps, in no collective: no deadlock the stall
    watch can prove). The deadline stops both, and the error shows where each one was."""
    before = _descendants()
    start = time.monotonic()
    with pytest.raises(course.RankTimeoutError) as info:
        course.run_ranks(deadlock, 2, echo=False, timeout=8)
    elapsed = time.monotonic() - start
    assert elapsed < 8 + 5
    err = info.value
    assert not isinstance(err, course.RankStallError)  # rank 1 waits in no collective: nothing to prove
    assert err.ranks == [0, 1] and "ranks 0, 1 were still running and killed" in str(err)
    assert any("in all_reduce" in line for line in err.failures[0].last_output), err.failures[0].last_output
    sleeping = f"line {deadlock.__code__.co_firstlineno + 5} in deadlock"  # its time.sleep(3600)
    assert any(sleeping in line for line in err.failures[1].last_output), err.failures[1].last_output
    assert _descendants() <= before


def test_sigint_ignoring_loop_and_its_child_are_killed_at_the_deadline():
    before = _descendants()
    start = time.monotonic()
    with pytest.raises(course.RankTimeoutError) as info:
        course.run_ranks(stubborn_loop, 2, echo=False, timeout=4)
    assert time.monotonic() - start < 4 + 5
    err = info.value
    assert err.running == [0, 1]
    text = str(err)
    assert "did not finish within 4 s" in text and "ranks 0, 1 were still running" in text
    assert "stubborn_loop" in text  # where each rank was (faulthandler dump)
    child_pids = [
        int(line.split()[-1]) for f in err.failures.values() for line in f.last_output if line.startswith("child pid")
    ]
    assert len(child_pids) == 2
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in child_pids), "a rank's child survived the job"
    assert _descendants() <= before


def test_a_rank_that_raises_after_the_deadline_was_still_running_at_it():
    """The race seen under load: the launcher kills rank 0, rank 1 sees its peer gone and reports an error
    before it is killed too. Both ranks were running at the deadline; the error says so."""
    with pytest.raises(course.RankTimeoutError) as info:
        course.run_ranks(raises_when_stopped, 2, echo=False, timeout=8, detect_stalls=False)
    err = info.value
    assert err.running == [0, 1] and err.failures[1].kind == "timeout"
    assert "ranks 0, 1 were still running" in str(err)


def test_rank_that_dies_without_traceback():
    with pytest.raises(course.RankFailedError) as info:
        course.run_ranks(exit_hard, 2, echo=False, timeout=30)
    assert info.value.failures[1].kind == "exited"
    assert "exited with code 3" in str(info.value)


def test_unpicklable_return_value_is_a_clear_error():
    assert callable(course.run_ranks(unpicklable, 1, echo=False)[0])
    with pytest.raises(course.RankFailedError, match="cannot be sent back"):
        course.run_ranks(return_lock, 1, echo=False)


def test_bad_arguments():
    with pytest.raises(ValueError):
        course.run_ranks(scalar_job, 0)
    with pytest.raises(TypeError):
        course.run_ranks("not a function", 2)
    with pytest.raises(ValueError):
        course.run_ranks(scalar_job, 2, backend="carrier-pigeon")


def test_nccl_without_a_gpu_per_rank_is_refused_before_any_rank_starts():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="backend 'nccl' needs .*GPU.* backend='gloo'"):
        course.run_ranks(scalar_job, gpus + 1, backend="nccl")


def test_backend_auto_is_gloo_without_enough_gpus():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("machine has GPUs")
    assert resolve_backend("auto", 2) == "gloo"


@pytest.mark.slow
def test_fifty_jobs_in_a_row_leave_nothing_behind(tmp_path, monkeypatch):
    # the jobs' folders go to a temporary folder of this test's own: another test (another xdist worker) may be
    # running jobs in the machine's /tmp meanwhile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _descendants()
    folders = set(glob.glob(os.path.join(tempfile.gettempdir(), "ddp-course-job-*")))
    assert tempfile.gettempdir() == str(tmp_path)
    ports = set()
    for _ in range(50):
        job = course.launch(all_reduce_rank, 2, echo=False)
        assert [v["sum"] for v in job.values] == [3.0, 3.0]
        ports.add(job.port)
    assert _descendants() <= before
    # the ranks meet through a file store in their job folder, removed after each job;
    # MASTER_PORT is the one TCPStore this process hosts
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "ddp-course-job-*"))) <= folders
    assert len(ports) == 1


_CONCURRENT = textwrap.dedent(
    """
    import sys, course, torch, torch.distributed as dist
    def work(rank):
        dist.init_process_group(course.backend())
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()
    if __name__ == "__main__":
        for _ in range(int(sys.argv[1])):
            assert course.run_ranks(work, 2, echo=False) == [1.0, 1.0]
        print("ok")
    """
)


@pytest.mark.slow
def test_two_launching_processes_at_once_never_collide(tmp_path):
    script = tmp_path / "launch_many.py"
    script.write_text(_CONCURRENT)
    procs = [
        subprocess.Popen([sys.executable, str(script), "15"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, err
        assert out.strip() == "ok"
        assert err == ""  # and nothing on the caller's stderr


_CLEAN = textwrap.dedent(
    """
    import sys, course
    def work(rank):
        import warnings, torch.distributed as dist
        print("rank", rank, "says hi", file=sys.stderr)
        warnings.warn("a warning in a rank")
        dist.init_process_group(course.backend())
        dist.barrier()
        dist.destroy_process_group()
        return rank
    if __name__ == "__main__":
        print(course.run_ranks(work, 2))
    """
)


def test_a_clean_job_writes_nothing_on_the_callers_stderr(tmp_path):
    script = tmp_path / "clean.py"
    script.write_text(_CLEAN)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "[rank 1] rank 1 says hi" in proc.stdout  # rank stderr is shown, on stdout, labelled
    assert "[0, 1]" in proc.stdout


@pytest.mark.gpu
def test_nccl_is_chosen_with_enough_gpus():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    n = torch.cuda.device_count()
    assert resolve_backend("auto", n) == "nccl"
    assert resolve_backend("auto", n + 1) == "gloo"


class Opaque:
    pass


def return_plain(rank):
    return {"rank": rank, "t": torch.ones(2) * rank, "items": [1, 2.5, "x", (3, 4)]}


def return_object(rank):
    return Opaque()


def test_safe_results_accept_plain_data_only():
    values = course.launch(return_plain, 2, echo=False, safe_results=True).values
    assert values[1]["rank"] == 1 and torch.equal(values[1]["t"], torch.ones(2))
    assert values[0]["items"] == [1, 2.5, "x", (3, 4)]
    with pytest.raises(course.RankFailedError, match="cannot read"):
        course.launch(return_object, 1, echo=False, safe_results=True)


def test_safe_results_send_no_exception_objects():
    with pytest.raises(course.RankFailedError) as info:
        course.launch(raise_on_rank_1, 2, echo=False, safe_results=True, timeout=60)
    failure = info.value.failures[1]
    assert failure.exc_type == "ValueError" and failure.exception is None
    assert "bad value on purpose" in failure.message


def init_and_leave(rank):
    dist.init_process_group(course.backend())
    dist.destroy_process_group()
    return rank


def init_twice(rank):
    dist.init_process_group(course.backend())
    dist.destroy_process_group()
    dist.init_process_group(course.backend())
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


@pytest.mark.slow
def test_a_rank_that_returns_early_does_not_break_slower_peers():
    # Without the launcher's finish barrier this failed 17/40 runs ("connectFullMesh failed").
    for _ in range(15):
        assert course.run_ranks(init_and_leave, 4, echo=False, timeout=60) == [0, 1, 2, 3]


def test_process_group_can_be_created_again_after_destroy():
    for _ in range(3):
        assert course.run_ranks(init_twice, 2, echo=False, timeout=30) == [2.0, 2.0]


def overrides_master_port(rank):
    import os

    os.environ["MASTER_ADDR"] = "localhost"  # the PyTorch DDP tutorial's setup()
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_master_port_set_by_hand_is_named_at_once():
    """Under the launcher (as under torchrun) nobody hosts a store at a port the rank picked: say so, don't hang."""
    start = time.monotonic()
    with pytest.raises(course.RankFailedError) as err:
        course.run_ranks(overrides_master_port, 2, echo=False, timeout=60)
    assert time.monotonic() - start < 20
    text = str(err.value)
    assert "told to meet at localhost:12355" in text and "MASTER_PORT=" in text, text
    assert "Remove the code that sets MASTER_ADDR/MASTER_PORT" in text


# --- deadlocks found early (course.launcher.stall) -------------------------------------------------

STALL_TIMEOUT = 60  # the deadline each deadlock below must beat by far (issue 15's target is 5 s from the divergence,
# measured by benchmarks, not asserted: a loaded 2-core machine stretches it)


def _join():
    dist.init_process_group("gloo")
    t = torch.ones(2)
    dist.all_reduce(t)  # every rank is in step here: collective #1
    return t


def stall_other_op(rank):
    t = _join()
    if rank == 0:
        dist.all_reduce(t)  # rank 0: all_reduce #2
    else:
        dist.barrier()  # rank 1: barrier #2


def stall_only_rank0(rank):
    t = _join()
    if rank == 0:
        dist.all_reduce(t)  # nobody else calls it
    return rank


def stall_shapes(rank):
    _join()
    dist.all_reduce(torch.ones(2 + rank))  # a 2-element tensor on rank 0, 3 elements on rank 1


def stall_rank_returns_early(rank):
    t = _join()
    for _ in range(3 if rank == 1 else 5):  # uneven data: rank 1 runs out of batches first
        dist.all_reduce(t)
    return rank


def slow_rank_in_step(rank):
    """Correct, but rank 0 sleeps while the others wait in a barrier: never a deadlock."""
    _join()
    if rank == 0:
        time.sleep(4)
    dist.barrier()
    dist.all_reduce(torch.ones(3))
    dist.destroy_process_group()
    return rank


@pytest.mark.slow
@pytest.mark.parametrize("fn, words", [
    (stall_other_op, ["rank 0 waits in all_reduce #2 of shape [2]", "rank 1 waits in barrier #2",
                      "dist.all_reduce(t)  # rank 0", "dist.barrier()  # rank 1", "different collectives"]),
    (stall_only_rank0, ["rank 0 waits in all_reduce #2 of shape [2]", "rank 1 had returned from the function",
                        "dist.all_reduce(t)  # nobody else calls it", "Rank 1 returned without calling"]),
    (stall_shapes, ["all_reduce #2 of shape [2]", "all_reduce #2 of shape [3]", "different shapes"]),
    (stall_rank_returns_early, ["rank 0 waits in all_reduce #5", "rank 1 had returned from the function",
                                "different number of times on different ranks"]),
], ids=["another op", "only rank 0", "other shapes", "a rank returned early"])
def test_a_deadlock_fails_in_seconds_lining_up_every_rank(fn, words):
    before = _descendants()
    start = time.monotonic()
    with pytest.raises(course.RankStallError) as info:
        course.run_ranks(fn, 2, echo=False, timeout=STALL_TIMEOUT)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert text.startswith("the job (2 ranks) is deadlocked, stopped after"), text
    for word in words:
        assert word in text, f"{word!r} not in:\n{text}"
    assert f'{os.path.basename(__file__)}", line' in text  # each rank's own source line
    # the stall detector stopped it, not the deadline (no tight timing here: CI's 2 cores run three workers at once)
    assert elapsed < STALL_TIMEOUT / 2, f"{elapsed:.1f} s"
    assert info.value.verdict is not None and sorted(info.value.verdict.lines) == [0, 1]
    assert _descendants() <= before


@pytest.mark.slow
def test_a_slow_rank_and_an_endless_loop_are_not_deadlocks():
    assert course.run_ranks(slow_rank_in_step, 3, echo=False, timeout=STALL_TIMEOUT) == [0, 1, 2]
    start = time.monotonic()
    with pytest.raises(course.RankTimeoutError) as info:  # computing forever: only the deadline can tell
        course.run_ranks(stubborn_loop, 2, echo=False, timeout=6)
    assert not isinstance(info.value, course.RankStallError)
    assert time.monotonic() - start >= 6


def test_a_shorter_stall_window_asks_the_ranks_sooner(tmp_path):
    """StallWatch asks idle ranks where they are after its idle window: the default, or a job's own."""
    from course.launcher.stall import IDLE_WINDOW, SAMPLE, StallWatch

    sleeper = subprocess.Popen(["sleep", "30"])  # an idle "rank"
    try:
        asked = {}
        for window in (IDLE_WINDOW, 0.5):
            probe = tmp_path / f"probe-{window}.json"
            watch = StallWatch([sleeper.pid], [str(probe)], [str(tmp_path / "result")], idle_window=window)
            now = 100.0
            while not (tmp_path / f"probe-{window}.json.req").exists() and now < 110:
                watch.poll([0], now)
                now += SAMPLE
            asked[window] = now - 100.0
        assert asked[0.5] < asked[IDLE_WINDOW] <= IDLE_WINDOW + 3 * SAMPLE, asked
        assert asked[0.5] >= 0.5, asked
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.slow
def test_a_short_stall_window_still_finds_deadlocks_and_lets_a_slow_rank_be():
    with pytest.raises(course.RankStallError) as info:
        course.launch(stall_other_op, 2, echo=False, timeout=STALL_TIMEOUT, stall_window=0.5)
    assert "rank 1 waits in barrier #2" in str(info.value)
    assert course.launch(slow_rank_in_step, 3, echo=False, timeout=STALL_TIMEOUT, stall_window=0.5).values == [0, 1, 2]


@pytest.mark.slow
def test_without_stall_detection_a_deadlock_waits_for_the_deadline():
    start = time.monotonic()
    with pytest.raises(course.RankTimeoutError) as info:
        course.run_ranks(stall_other_op, 2, echo=False, timeout=8, detect_stalls=False)
    assert not isinstance(info.value, course.RankStallError)
    assert time.monotonic() - start >= 8


def joins_twice(rank):
    dist.init_process_group("gloo")
    dist.init_process_group("gloo")


def collective_before_joining(rank):
    dist.all_reduce(torch.ones(1))


def device_ids_on_cpu(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    DDP(torch.nn.Linear(2, 1), device_ids=[rank])


@pytest.mark.parametrize("fn, words", [
    (joins_twice, "init_process_group was called twice in one process"),
    (collective_before_joining, "ran before init_process_group: join the job first"),
    (device_ids_on_cpu, "DDP got device_ids for a model on the CPU"),
], ids=["init twice", "collective before init", "device_ids on a CPU model"])
def test_known_misconfigurations_are_named_with_what_to_do(fn, words):
    with pytest.raises(course.RankFailedError) as info:
        course.run_ranks(fn, 2, echo=False, timeout=60)
    text = str(info.value)
    assert "hint: " in text and words in text, text


# --- a forkserver forked, not started (the verifier's) ----------------------------

_FORKED_FORKSERVER = textwrap.dedent('''
    import importlib, json, os, sys, threading, time
    from multiprocessing import forkserver
    from course.launcher import configure, job
    from course.launcher.forkserver import PRELOAD

    def ranks_view(rank):
        # what a rank can reach: its parent's descriptors, its stdin, a secret in its parent's memory
        fds = sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                     if os.path.exists(f"/proc/self/fd/{fd}"))
        import ctypes
        return {"fds": fds, "stdin": os.readlink("/proc/self/fd/0"),
                "secret": getattr(sys.modules["__main__"], "SECRET", None),
                "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)}

    configure(fork_forkserver=True)
    mode = sys.argv[1]
    if mode == "thread":  # another thread: must fall back to a freshly started forkserver
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    if mode != "missing":  # "missing": a preload module not imported yet: must fall back too
        for name in PRELOAD:
            importlib.import_module(name)
    channel = os.dup(1)  # a private descriptor, as the verifier's verdict channel
    if mode == "fork":
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # undumpable, as the verifier makes itself
    job.warm_up()
    SECRET = "read after the fork"
    pid = forkserver._forkserver._forkserver_pid
    server_cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    result = job.run_ranks(all_reduce_sum, 2, echo=False)  # the forkserver serves: it has closed what it closes
    server_fds = sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    print(json.dumps({"forked": server_cmdline == open("/proc/self/cmdline", "rb").read(),
                      "parent": open(f"/proc/{pid}/stat").read().split()[3] == str(os.getpid()),
                      "server_fds": server_fds, "channel": os.readlink(f"/proc/self/fd/{channel}"), "sums": result,
                      "view": job.run_ranks(ranks_view, 1, echo=False)[0]}))
''')

_FORKED_RANK_FN = textwrap.dedent('''
    import torch, torch.distributed as dist
    def all_reduce_sum(rank):
        dist.init_process_group("gloo")
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()
''')


@pytest.mark.parametrize("mode", ["fork", "thread", "missing"])
def test_the_verifier_forkserver_is_forked_only_when_safe_and_keeps_nothing_of_its_parent(mode, tmp_path):
    import json

    script = tmp_path / "forked.py"
    script.write_text(_FORKED_RANK_FN + _FORKED_FORKSERVER)
    proc = subprocess.run([sys.executable, "-s", "-P", str(script), mode], capture_output=True, text=True,
                          timeout=150, stdin=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["sums"] == [3.0, 3.0]
    assert seen["parent"] and seen["forked"] is (mode == "fork")  # else a fresh interpreter, as before
    if mode == "fork":
        assert seen["channel"] not in seen["server_fds"]
        assert seen["view"]["stdin"] == "/dev/null"
        assert seen["view"]["secret"] is None  # what the parent holds after the fork never reaches a rank
        assert seen["view"]["dumpable"] == 1  # as a freshly started forkserver's ranks are
        assert seen["channel"] not in seen["view"]["fds"]


def test_a_later_failure_is_called_a_consequence_only_when_it_lost_its_peer():
    from course.errors import RankFailure
    from course.launcher.job import _failure_summary

    first = RankFailure(1, "raised", exc_type="ValueError", message="bad value")
    lost = RankFailure(0, "raised", exc_type="RuntimeError", message="[gloo] Connection closed by peer [127.0.0.1]")
    text = _failure_summary(1, {1: first, 0: lost}, [], [1, 0], 2)
    assert "then rank 0 failed too, as a consequence" in text
    same = RankFailure(0, "raised", exc_type="ValueError", message="bad value")
    text = _failure_summary(1, {1: first, 0: same}, [], [1, 0], 2)
    assert "rank 0 raised the same error on its own (not because of rank 1)" in text and "consequence" not in text
    from course.launcher.job import _same_errors_by_rank

    assert _same_errors_by_rank([1, 0], {1: first, 0: same}) == [0, 1]  # the same error on its own: by rank
    assert _same_errors_by_rank([1, 0], {1: first, 0: lost}) == [1, 0]  # a consequence stays after its cause
    other = RankFailure(0, "raised", exc_type="KeyError", message="'x'")
    assert _same_errors_by_rank([1, 0], {1: first, 0: other}) == [1, 0]  # another error: the order it came in
    text = _failure_summary(1, {1: first, 0: other}, [], [1, 0], 2)
    assert "rank 0 raised KeyError: 'x' on its own (not because of rank 1)" in text and "consequence" not in text


def test_a_stuck_ranks_stack_shows_the_students_frames_only():
    from course.launcher.job import _user_frames

    dump = ["Stack (most recent call first):",
            '  File "/tmp/ipykernel_7/123.py", line 2 in shard_batch',
            '  File "/opt/course/graders/parallelism/checks.py", line 40 in _harness',
            '  File "/opt/course/course/launcher/rank.py", line 300 in main',
            '  File "/opt/course/course/checks.py", line 172 in run',
            '  File "/opt/course/course/grading/verifier.py", line 292 in _verify_cell',
            '  File "<frozen runpy>", line 88 in _run_code']
    shown = _user_frames(dump, {"/tmp/ipykernel_7/123.py": "Cell In[2]"}, ["/opt/course/course", "/opt/course/graders"])
    assert shown == ["Stack (most recent call first):", "  Cell In[2], line 2 in shard_batch"]


def test_a_timed_out_check_names_where_each_rank_was_innermost_first():
    from course.checks import _last_output
    from course.errors import RankFailure, RankTimeoutError

    stack = ["printed before", "Stack (most recent call first):"] + [f'  File "x.py", line {i} in f{i}' for i in range(12)]
    err = RankTimeoutError("late", {0: RankFailure(0, "timeout", last_output=stack)}, [], 1, 60.0)
    text = _last_output(err)
    assert 'line 0 in f0' in text and "line 7 in f7" in text and "line 8 in" not in text and "printed" not in text


_bound_save = torch.save  # bound before any job: as `save = torch.save` at a notebook's top level


def record_every_write(rank, folder):
    """A rank writes in five ways while recording, plus once as the grader (not recorded)."""
    import pickle

    from course.launcher import writes

    with writes.recording() as events:
        _bound_save({"a": 1}, os.path.join(folder, f"bound{rank}.pt"))
        torch.serialization.save({"a": 1}, os.path.join(folder, f"module{rank}.pt"))
        with open(os.path.join(folder, f"pickled{rank}.pkl"), "wb") as fh:
            pickle.dump(1, fh)
        fd, tmp = tempfile.mkstemp(dir=folder)
        os.close(fd)
        os.replace(tmp, os.path.join(folder, f"moved{rank}"))
        with writes.paused():
            torch.save({"a": 1}, os.path.join(folder, f"grader{rank}.pt"))
    torch.save({"a": 1}, os.path.join(folder, f"after{rank}.pt"))  # recording is over
    return [(os.path.basename(e["path"]) if not e["path"].startswith(os.path.join(folder, "tmp")) else "tmp", e["how"])
            for e in events]


def test_a_rank_records_every_write_however_the_writer_was_reached(tmp_path):
    values = course.run_ranks(record_every_write, 2, args=(str(tmp_path),), echo=False)
    for rank, got in enumerate(values):
        assert got == [(f"bound{rank}.pt", "torch.save"), (f"module{rank}.pt", "torch.save"),
                       (f"pickled{rank}.pkl", "open"), ("tmp", "open"), (f"moved{rank}", "rename")], got
