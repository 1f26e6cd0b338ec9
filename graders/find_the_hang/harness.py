"""What the checks of find_the_hang.ipynb share: the data, the model, the four scripts, a journal of what
every rank issued, and the single-process reference of the training.

The four buggy scripts are ``graders/find_the_hang/hang_<part>.py``; the student reads the same files, copied
into the exercise's folder (``exercises/ex4-torchrun/hang_<part>.py``, a test keeps them identical): the
exercise sources are hidden from the sandbox the checks run in. A diagnosis check runs the script itself, unchanged, on real ranks
(:func:`run_buggy`), and derives the truth from what the ranks really did: each rank's harness keeps a
journal of its flight recorder (every collective the rank issued: op, sequence number, shapes, and the
script line that issued it, from the recorder's stack traces), and of the line at which the script's
function returned, if it did. The job deadlocks; the launcher's stall report ends it within seconds, and
the journals say who issued what where. Nothing about the answer is written down here: another world
size, data size or logging rank gives another truth.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from course import checks
from course.checks import CheckFailed
from graders.common.samples import Samples
from graders.find_the_hang.evidence import in_torch_collective_code, torch_code

FEATURES = 4
#: the scripts, by part: (the student's copy in the exercise's folder, its given training function, the small
#: function that training calls and the student fixes: a keyword argument of the training, of the same name)
SCRIPTS = {
    "metric": ("hang_metric.py", "train_metric", "log_val_loss"),
    "uneven": ("hang_uneven.py", "train_uneven", "share_of"),
    "early": ("hang_early.py", "train_early", "predict_and_merge"),
    "shapes": ("hang_shapes.py", "train_shapes", "class_counts"),
}
JOURNAL_EVERY = 0.05  # seconds between two looks at the rank's flight recorder


# --- data and model ----------------------------------------------------------------------------------


def make_model(seed: int, classes: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, classes))


def val_loss(state: dict, dataset: Samples, classes: int) -> float:
    """The mean cross-entropy of the weights ``state`` over the whole ``dataset``, in one process."""
    model = make_model(0, classes)
    model.load_state_dict(state)
    with torch.no_grad():
        return float(F.cross_entropy(model(dataset.x), dataset.y))


def predictions(state: dict, dataset: Samples, classes: int) -> torch.Tensor:
    model = make_model(0, classes)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(dataset.x).argmax(dim=1)


@checks.reference
def reference(seed: int, classes: int, n_train: int, world_size: int, batch_size: int, epochs: int, lr: float) -> dict:
    """The weights DDP reaches with a DistributedSampler (no shuffle) and SGD, computed in one process:
    each step averages the ranks' mean-loss gradients, as DDP does."""
    data = Samples(n_train, seed, classes)
    model = make_model(seed, classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    per_rank = math.ceil(n_train / world_size)
    padded = list(range(n_train)) + list(range(per_rank * world_size - n_train))  # as DistributedSampler pads
    shares = [padded[r::world_size] for r in range(world_size)]
    for _ in range(epochs):
        for start in range(0, per_rank, batch_size):
            optimizer.zero_grad()
            loss = sum(F.cross_entropy(model(data.x[s[start:start + batch_size]]), data.y[s[start:start + batch_size]])
                       for s in shares) / world_size
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- the scripts ----------------------------------------------------------------------------------------


def script_path(part: str) -> str:
    """The grader's copy of ``part``'s script (the student's is ``exercises/ex4-torchrun/hang_<part>.py``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"hang_{part}.py")


def script_lines(part: str) -> list[str]:
    with open(script_path(part)) as fh:
        return fh.read().splitlines()


def load_script(part: str):
    """The script of ``part``, compiled from the grader's copy under the name the student knows (``hang_<part>.py``:
    the stall report and tracebacks show the student's file and its lines, and it is no grader frame to hide), in a
    module of its own that is not in sys.modules: its functions travel to the ranks by value. Returns its given
    training function; the buggy function it calls by default is :func:`buggy_function`."""
    return getattr(_script_module(part), SCRIPTS[part][1])


def buggy_function(part: str):
    """The small function of ``part``'s script that the student fixes, as given (it hangs)."""
    return getattr(_script_module(part), SCRIPTS[part][2])


def _script_module(part: str) -> types.ModuleType:
    with open(script_path(part)) as fh:
        source = fh.read()
    module = types.ModuleType(f"_ddp_course_{SCRIPTS[part][1]}")
    module.__file__ = SCRIPTS[part][0]
    exec(compile(source, SCRIPTS[part][0], "exec"), module.__dict__)  # noqa: S102 - the course's own file
    return module


# --- the journal of a rank (harness side) ----------------------------------------------------------------


#: (method, error) for every barrier of this process that raised: read after the student's function returned, so
#: an error the function caught (a timeout that let the rank go on) is still seen
FAILED_BARRIERS: list[tuple[str, str]] = []


def _watch_barriers() -> None:
    """Wrap the process group's own barrier methods (what ``dist.barrier`` and ``dist.monitored_barrier`` call),
    at import, before any student object exists, so that a barrier that failed is recorded even if it was caught.
    ``monitored_barrier`` talks point to point, which the flight recorder's list of collectives leaves out."""
    from torch._C._distributed_c10d import ProcessGroup

    for name in ("monitored_barrier", "barrier"):
        real = getattr(ProcessGroup, name, None)
        if real is None or getattr(real, "_ddp_course_watched", False):
            continue

        def watched(self, *args, _real=real, _name=name, **kwargs):
            try:
                work = _real(self, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - recorded, then raised as it was
                FAILED_BARRIERS.append((_name, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))
                raise
            return work

        watched._ddp_course_watched = True
        setattr(ProcessGroup, name, watched)


_watch_barriers()


_DUMP = checks.recorder()  # torch's flight recorder with stack traces, taken at import (before student code)
#: the code objects of torch's distributed modules, taken at import (before student code): a rank waits in a
#: collective only in these, not in a copy compiled later under torch's file name (graders.find_the_hang.evidence)
_GENUINE = torch_code()


class Journal:
    """A rank's record, kept in ``<folder>/rank<r>.json`` as the job runs: every collective the rank issued (op,
    sequence number, shapes, the line of ``script`` that issued it) and where ``fn`` returned. A thread rewrites it
    whenever the flight recorder grows, so what a rank did before it got stuck survives the job being stopped."""

    def __init__(self, folder: str, rank: int, script: str):
        self.path = os.path.join(folder, f"rank{rank}.json")
        self.script = script  # the name the script was compiled under (:func:`load_script`)
        self.count = -1
        self.returned_at = None
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def _entries(self) -> list[dict]:
        found = []
        for e in _DUMP() if _DUMP is not None else []:
            lines = [f.get("line") for f in e.get("frames") or [] if f.get("filename") == self.script]
            found.append({"op": str(e.get("profiling_name", "")).split(":")[-1], "seq": e.get("collective_seq_id"),
                          "sizes": e.get("input_sizes"), "line": lines[0] if lines else None})
        return found

    def write(self, force: bool = False) -> None:
        with self.lock, checks.grader_writes():
            entries = self._entries()
            if len(entries) == self.count and not force:
                return
            self.count = len(entries)
            with open(self.path + ".tmp", "w") as fh:
                json.dump({"entries": entries, "returned_at": self.returned_at}, fh)
            os.replace(self.path + ".tmp", self.path)

    def start(self) -> None:
        def loop():
            while not self.stop.wait(JOURNAL_EVERY):
                try:
                    self.write()
                except Exception:  # noqa: BLE001 - a missed look: the next one writes it
                    pass

        threading.Thread(target=loop, name="ddp-course-hang-journal", daemon=True).start()

    def call(self, fn, *args, watch=None, **kwargs):
        """``fn(*args, **kwargs)``, noting the line of ``watch`` (a function ``fn`` calls; ``fn`` itself by default) at
        which it last returned (a ``return`` statement, or its end)."""
        code = getattr(watch if watch is not None else fn, "__code__", None)

        def tracer(frame, event, arg):
            if frame.f_code is not code:
                return None
            frame.f_trace_lines = False

            def local(frame, event, arg):
                if event == "return":
                    self.returned_at = frame.f_lineno
                return local

            return local

        old = sys.gettrace()
        sys.settrace(tracer)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.settrace(old)
            self.stop.set()
            self.write(force=True)


def read_journals(folder: str, world_size: int) -> list[dict]:
    out = []
    for rank in range(world_size):
        try:
            with open(os.path.join(folder, f"rank{rank}.json")) as fh:
                out.append(json.load(fh))
        except (OSError, ValueError):
            out.append({"entries": [], "returned_at": None})
    return out


def wait_for_rank0(folder: str, rank: int, limit: float) -> str:
    """On a rank other than 0: wait until rank 0 waits in torch.distributed or has returned (it says so once asked,
    :func:`report_rank0`): "waiting", "returned", or "neither" when it did neither within ``limit`` seconds."""
    path, request = os.path.join(folder, "rank0.state"), os.path.join(folder, f"ask{rank}")
    with checks.grader_writes():
        open(request, "w").close()
    end = time.monotonic() + limit
    steady = None
    try:
        while time.monotonic() < end:
            try:
                with open(path) as fh:
                    state = fh.read().strip()
            except OSError:
                state = ""
            if state == "returned":
                return state
            if state == "waiting":
                steady = steady or time.monotonic()
                if time.monotonic() - steady >= 0.3:  # not merely passing through a collective
                    return state
            else:
                steady = None
            time.sleep(0.005)
        return "neither"
    finally:
        with checks.grader_writes():
            os.unlink(request)


def report_rank0(folder: str):
    """On rank 0: a thread that, while another rank asks (:func:`wait_for_rank0`), keeps ``rank0.state`` saying
    whether the main thread waits in torch.distributed's collective code ("waiting": torch's own code objects, taken at
    import, not a copy compiled under torch's file name) or runs ("running"); idle
    otherwise, so that a deadlock is still seen as one. The returned function marks it "returned"."""
    import glob
    import traceback

    path = os.path.join(folder, "rank0.state")
    main = threading.main_thread().ident
    done = threading.Event()

    def state(genuine=_GENUINE, frames=sys._current_frames, extract=traceback.extract_stack) -> str:
        frame = frames().get(main)
        stack = extract(frame) if frame is not None else []
        return ("waiting" if checks.waiting_in_collective(stack) and in_torch_collective_code(frame, genuine)
                else "running")

    def put(text: str) -> None:
        tmp = f"{path}.{threading.get_ident()}.tmp"  # each writer its own: the thread and returned() may overlap
        with checks.grader_writes():
            with open(tmp, "w") as fh:
                fh.write(text)
            os.replace(tmp, path)

    def loop():
        asked = False
        while not done.wait(0.005 if asked else 0.05):
            try:
                asked = bool(glob.glob(os.path.join(folder, "ask*")))
                if asked:
                    put(state())
            except Exception:  # noqa: BLE001 - the next look writes it
                pass

    reporter = threading.Thread(target=loop, name="ddp-course-hang-rank0", daemon=True)
    reporter.start()

    def returned():
        done.set()
        reporter.join(timeout=1.0)  # its last write first, so "returned" is the last word
        put("returned")

    return returned


# --- the verdict on part uneven's fix -------------------------------------------------------------------------


def judge_uneven(check: str, s: dict, obs: list[dict]) -> None:
    """check_fix_uneven's verdict on the ranks' observations: every sample trained on in every epoch (the batches the
    ranks' forward passes saw), the same weights on every rank, and those weights the replay of those batches (a
    forward pass the training did not make, or one it made that was hidden, gives other weights)."""
    counts = [0] * s["n_train"]
    for o in obs:
        for i in (i for batch in o["forwards"] for i in batch):
            if 0 <= i < len(counts):
                counts[i] += 1
    missing = [i for i, c in enumerate(counts) if c < s["epochs"]]
    if missing:
        raise CheckFailed(check, f"{len(missing)} training samples were trained on fewer than {s['epochs']} times in "
                          f"{s['epochs']} epochs", ranks=list(range(s["world_size"])),
                          expected="every sample trained on in every epoch (by some rank)",
                          got=f"samples {missing[:8]} trained on {[counts[i] for i in missing[:8]]} times",
                          hint="the ranks no longer hang because samples were left out of the shares: the "
                          "docstring says every sample counts. Give every rank as many samples (so as many steps) "
                          "without leaving one out (a sample in two shares is fine)")
    base = obs[0]["state"]
    for rank, o in enumerate(obs[1:], start=1):
        bad = [k for k in base if not torch.allclose(o["state"][k].float(), base[k].float(), atol=1e-6)]
        if bad:
            raise CheckFailed(check, f"rank {rank}'s weights differ from rank 0's at the end", ranks=[rank],
                              expected="the same weights on every rank (each step's gradients averaged over the ranks)",
                              got=f"{len(bad)} tensors differ, e.g. `{bad[0]}`",
                              hint="some steps were not synchronised: every rank must take part in every step's "
                              "gradient all-reduce")
    _judge_replay(check, s, obs, base)
    init = make_model(s["seed"], s["classes"]).state_dict()
    if all(torch.equal(base[k], init[k]) for k in init):
        raise CheckFailed(check, "the model was not trained", expected="weights that changed", got="the initial weights",
                          hint="give every rank a share to train on")


def replay(seed: int, classes: int, n_train: int, steps: list, lr: float) -> dict:
    """The weights of DDP training on ``steps`` (per step, per rank, the indices of its batch), in one process: each
    step averages the ranks' mean-loss gradients."""
    data = Samples(n_train, seed, classes)
    model = make_model(seed, classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batches in steps:
        optimizer.zero_grad()
        (sum(F.cross_entropy(model(data.x[b]), data.y[b]) for b in batches) / len(batches)).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _judge_replay(check: str, s: dict, obs: list[dict], state: dict) -> None:
    runs = [o["forwards"] for o in obs]
    bad = {len(r) for r in runs} != {len(runs[0])} or any(i < 0 for r in runs for b in r for i in b)
    want = None if bad else replay(s["seed"], s["classes"], s["n_train"], [list(b) for b in zip(*runs)], s["lr"])
    if want is None or any(not torch.allclose(state[k].float(), want[k], atol=1e-5) for k in want):
        raise CheckFailed(check, "rank 0's weights are not those of training on the batches the ranks' forward "
                          "passes saw", ranks=[0], expected="the weights of one DDP step per batch each rank's "
                          "forward pass saw (replayed here in one process)",
                          got=("ranks with different numbers of forward passes, or rows not from the training set"
                               if bad else "other weights"),
                          hint="fix the shares and nothing else: every sample in some rank's share, as many batches "
                          "on every rank, each trained on by the given training loop")
