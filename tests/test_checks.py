"""The check API (course/checks/) on its own: "not written yet", messages, failures of a job."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import course
from course import checks
from course.errors import CheckFailed
from course.grading.student import StudentObject

STUB = "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"


@pytest.mark.parametrize("source, names", [
    (STUB, ["f"]),
    ('def f(x):\n    """Doc."""\n    raise NotImplementedError\n', ["f"]),
    # nbgrader's stub after a given guard clause (ex3's CPUSyncBatchNorm.forward)
    ("class B:\n    def forward(self, x):\n        if not self.training:\n            return x\n"
     "        # YOUR CODE HERE\n        raise NotImplementedError()\n", ["B.forward"]),
    ("def main():\n    raise NotImplementedError()\n\ndef helper():\n    return 1\n", ["main"]),
    # given lines, then the stub (ex4's main): it always raises, so it is not written yet
    ("def main():\n    args = parse()\n    # YOUR CODE HERE\n    raise NotImplementedError()\n", ["main"]),
    # a nested function's return does not leave the outer one
    ("def f(x):\n    def g():\n        return 1\n    raise NotImplementedError()\n", ["f"]),
])
def test_unwritten_finds_nbgraders_stub(source, names):
    assert checks.unwritten(source) == names


@pytest.mark.parametrize("source", [
    "def f(x):\n    return 2 * x\n",
    # written, with the stub line forgotten after it: the student's work, never "not written yet"
    "def f(x):\n    return 2 * x\n    raise NotImplementedError()\n",
    "def f(x):\n    if x:\n        return 1\n    else:\n        return 2\n    raise NotImplementedError()\n",
    "def f(x):\n    for i in x:\n        return i\n    raise NotImplementedError()\n",
    "def f(x):\n    try:\n        return g(x)\n    except ValueError:\n        pass\n    raise NotImplementedError()\n",
    # the stub line in the middle, the student's code after it: the job says what happens
    "def f(x):\n    raise NotImplementedError()\n    return x\n",
    'def f(x):\n    raise NotImplementedError("only 2-D inputs")\n',  # the student's own error
    "class A:\n    def forward(self, x):\n        return x\n",
    "def f(x:\n",  # unparseable: the job reports it
])
def test_unwritten_leaves_the_students_work_alone(source):
    assert checks.unwritten(source) == []


def stub_fn(x):
    # YOUR CODE HERE
    raise NotImplementedError()


def written_fn(x):
    return x


class StubModule:
    def forward(self, x):
        raise NotImplementedError()


def test_require_written_in_the_notebook():
    checks.require_written("check_x", f=written_fn)
    with pytest.raises(CheckFailed, match="`f` is not written yet: it only raises NotImplementedError"):
        checks.require_written("check_x", f=stub_fn)
    with pytest.raises(CheckFailed, match=r"`M` is not written yet \(`StubModule.forward`\)"):
        checks.require_written("check_x", M=StubModule)
    with pytest.raises(CheckFailed, match="`f` is not a function \\(got int\\)"):
        checks.require_written("check_x", f=3)


def test_require_written_on_the_trusted_path_starts_no_job(monkeypatch):
    """In the verifier the answer is a stand-in: its recorded source says it is the stub, and no job starts."""
    import course.launcher.job

    def no_job(*args, **kwargs):
        raise AssertionError("a job was started for an untouched stub")

    monkeypatch.setattr(course.launcher.job, "launch", no_job)
    stand_in = StudentObject("f", b"not a pickle", kind="function", source=STUB)
    with pytest.raises(CheckFailed, match="`f` is not written yet"):
        checks.require_written("check_x", f=stand_in)
    number = StudentObject("f", b"", kind="int", is_callable=False)
    with pytest.raises(CheckFailed, match="not a function \\(got int\\)"):
        checks.require_written("check_x", f=number)
    # no recorded source (the notebook could not say): the job decides, require_written lets it through
    checks.require_written("check_x", f=StudentObject("f", b"", kind="function", source=None))
    assert stand_in.misuse == [] and number.misuse == []  # nothing looked inside the stand-ins


def test_require_written_source_for_scripts():
    script = "import os\n\ndef main():\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    with pytest.raises(CheckFailed, match="train.py is not written yet: main\\(\\) still raises NotImplementedError"):
        checks.require_written_source("check_x", script, "train.py", names=("main",))
    with pytest.raises(CheckFailed, match="does not compile"):
        checks.require_written_source("check_x", "def main(:\n", "train.py")
    checks.require_written_source("check_x", "def main():\n    print(1)\n", "train.py", names=("main",))


def test_answer_source_of_a_class_defined_in_a_notebook_cell():
    """Python < 3.13 cannot find a notebook class's source by itself; its methods' cell has it."""
    import linecache

    from course.grading.student import answer_source

    cell = "<ipython-input-7-abc>"
    text = "import torch\n\nclass Norm:\n    def forward(self, x):\n        raise NotImplementedError()\n"
    linecache.cache[cell] = (len(text), None, text.splitlines(True), cell)
    namespace = {"__name__": "__main__"}
    exec(compile(text, cell, "exec"), namespace)
    try:
        assert checks.unwritten(answer_source(namespace["Norm"])) == ["Norm.forward"]
    finally:
        del linecache.cache[cell]


def _raises(rank):
    raise ValueError(f"boom on {rank}")


def _stub_on_ranks(rank):
    raise NotImplementedError()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_turns_failures_into_rank_aware_messages():
    with pytest.raises(CheckFailed) as err:
        checks.run("check_x", _raises, 2)
    text = str(err.value)
    assert text.startswith("FAILED check_x [rank")
    assert "your code raised ValueError: boom on" in text and "(2-rank job)" in text
    with pytest.raises(CheckFailed, match="part of your answer is not written yet: `_stub_on_ranks` raised"):
        checks.run("check_x", _stub_on_ranks, 2)
    with pytest.raises(CheckFailed) as err:
        checks.run("check_x", _raises, 2, hints=[("boom", "do not explode")])
    assert "try:      do not explode" in str(err.value)


def _count_step(rank, per_parameter):
    """A harness: what one DDP-free step of manual gradient averaging issued, seen in the trace."""
    from course import checks

    checks.join_job()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    model(torch.randn(2, 3)).sum().backward()
    before = len(checks.collectives())
    grads = [p.grad for p in model.parameters()]
    if per_parameter:
        for g in grads:
            dist.all_reduce(g)
    else:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
    # a patched torch.distributed cannot hide or invent what the process group really ran
    dist.all_reduce = lambda *a, **k: None
    dist.all_reduce(torch.ones(1))
    return [(e["op"], e["sizes"]) for e in checks.collectives()[before:]]


def test_collectives_show_what_the_process_group_really_ran():
    per_parameter = course.run_ranks(_count_step, 2, args=(True,), echo=False)
    assert per_parameter[0] == per_parameter[1] == [("all_reduce", [[4, 3]]), ("all_reduce", [[4]]),
                                                    ("all_reduce", [[1, 4]]), ("all_reduce", [[1]])]
    flat = course.run_ranks(_count_step, 2, args=(False,), echo=False)
    assert flat == [[("all_reduce", [[21]])]] * 2


def _harness_diverging(rank, kind):
    """A check's harness whose 'student code' deadlocks in one of the four ways the launcher recognises."""
    from course import checks

    checks.join_job()
    t = torch.ones(2)
    dist.all_reduce(t)
    if kind == "another op":
        dist.all_reduce(t) if rank == 0 else dist.barrier()
    elif kind == "only rank 0":
        if rank == 0:
            dist.all_reduce(t)
    elif kind == "other shapes":
        dist.all_reduce(torch.ones(2 + rank))
    elif kind == "returns early":
        for _ in range(1 if rank == 1 else 3):
            dist.all_reduce(t)
    return rank


@pytest.mark.slow
@pytest.mark.parametrize("kind, words", [
    ("another op", ["rank 0 waits in all_reduce #2", "rank 1 waits in barrier #2", "different collectives"]),
    ("only rank 0", ["rank 0 waits in all_reduce #2", "rank 1 had returned from the function"]),
    ("other shapes", ["of shape [2]", "of shape [3]", "different shapes"]),
    ("returns early", ["rank 0 waits in all_reduce #3", "rank 1 had returned from the function"]),
])
def test_a_deadlocked_check_fails_in_seconds_naming_every_rank_and_line(kind, words):
    import time

    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        checks.run("check_demo", _harness_diverging, 2, args=(kind,), timeout=60,
                   hints=[("timeout", "every rank must call the same collectives")])
    message = str(info.value)
    assert re.match(r"FAILED check_demo \[ranks? [0-9, ]+\]: the 2-rank job deadlocked: ", message), message
    for word in words:
        assert word in message, f"{word!r} not in:\n{message}"
    assert 'test_checks.py", line' in message  # each rank's own line
    assert "try:      every rank must call the same collectives" in message and "why: " in message
    assert time.monotonic() - start < 15, message


def _what_the_rank_sees(rank):
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES"), course.backend()


@pytest.mark.slow
def test_a_check_runs_on_gloo_with_the_gpus_hidden_unless_it_asks_for_auto():
    """The backend policy: by default a check's job is gloo with no GPU visible to its ranks, so the same submission
    is judged the same on a grader with GPUs; ``backend="auto"`` leaves the GPUs (and nccl, with one per rank)."""
    job = checks.run("check_policy", _what_the_rank_sees, 2)
    assert job.values == [("", "gloo"), ("", "gloo")]
    job = checks.run("check_policy", _what_the_rank_sees, 2, backend="auto", env={"CUDA_VISIBLE_DEVICES": "7"})
    assert job.values == [("7", "gloo"), ("7", "gloo")]  # no GPU on this machine: auto is gloo here too


def test_a_grader_hook_on_a_saved_module_pickles_as_a_hook_that_does_nothing(tmp_path):
    """torch.save(model) of a module the grader hooked with a closure: the save works, nothing of the grader's goes
    along, and the loaded module runs with a hook that notes nothing."""
    import io

    import torch

    from course.checks.hooks import grader_hook

    seen = []
    model = torch.nn.Linear(2, 1)
    model.register_forward_pre_hook(grader_hook(lambda module, args: seen.append(args[0].shape)))
    model(torch.ones(3, 2))
    assert seen == [torch.Size([3, 2])]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert b"seen" not in buffer.getvalue()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded(torch.ones(4, 2))
    assert seen == [torch.Size([3, 2])]  # the copy's hook noted nothing
    assert torch.equal(loaded.weight, model.weight)


@pytest.mark.parametrize("name, gloo", [("gloo", True), ("GLOO", True), ("cpu:gloo", True), ("cpu:gloo,cuda:gloo", True),
                                        ("cuda:nccl,cpu:gloo", True), ("cpu:gloo,cuda:ddpcourse", True),
                                        ("nccl", False), ("cuda:gloo", False), ("cuda:nccl", False), ("", False),
                                        (None, False)])
def test_gloo_for_cpu_reads_every_spelling_of_a_backend(name, gloo):
    assert checks.gloo_for_cpu(name) is gloo


def test_the_alias_names_a_stand_in_for_cuda_that_this_torch_can_make(monkeypatch):
    from course.checks import backends

    monkeypatch.delenv("DDP_COURSE_CHECK_BACKEND", raising=False)
    env, name = checks.backend_alias()
    assert name == backends.GLOO_ALIAS == "cpu:gloo,cuda:ddpcourse" and env == {checks.BACKEND_ENV: name}
    assert checks.backend_alias("auto") == ({}, None)
    monkeypatch.setattr(backends, "_FAKE", None)  # a torch without the fake group: the plain alias
    assert checks.backend_alias() == ({checks.BACKEND_ENV: "cpu:gloo"}, "cpu:gloo")
