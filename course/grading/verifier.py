"""Verdicts a student cannot forge: re-run each test cell's checks in a trusted process.

In the student's kernel, student code could monkeypatch the graders, the
launcher or AssertionError, or print a fake "passed". So the kernel runs no
check at all (a test cell of check calls becomes a comment there, see
:func:`course.grading.checkcalls.kernel_source`), and after the notebook ran, the
checks run here, once:

1. in the kernel, where each test cell would run, :mod:`course.grading.snapshot` pickled
   the objects its check calls name (``graders.parallelism.check_shards(shard_batch)``);
2. :func:`verify_notebook` starts ``python -m course.grading.verifier`` in a fresh
   sandbox (:mod:`course.sandbox`; no student code ran in that process, it
   imports nothing from the work folder) and hands it the test cells and the
   pickles as opaque bytes;
3. the verifier calls the real checks with :class:`StudentObject` proxies in
   place of the student's objects. A proxy pickles as the student's own bytes,
   so a check can ship it to ranks (:func:`course.launch`), which unpickle and run it
   inside the sandbox; every rank result comes back weights-only decoded
   (``launcher.configure(safe_results=True)``), so nothing a student returns can run code in
   the verifier. A check that calls a student function directly gets a
   1-rank sandboxed job; one that looks inside a student object fails loudly;
4. :func:`apply_verdicts` rewrites each test cell's outputs to the trusted
   verdict, so nbgrader (which scores cell outputs) and ``ddp-course grade``
   both score what the verifier decided.

A test cell that is not made of check calls runs in the kernel as written and
is graded from its own output ("unchecked").
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

from course.grading import cells as cell_kinds
from course.grading import checkcalls, hints
from course.grading.cells import TEST_CELL_TIMEOUT, is_test_cell
from course.grading.student import StudentObject, StudentObjectUsed

#: seconds the verifier may spend on one test cell (its jobs have their own deadlines inside): as long as
#: the cell itself may run in the kernel
DEFAULT_CELL_TIMEOUT = TEST_CELL_TIMEOUT
STARTUP = 60.0  # the verifier's own start: imports, the forkserver's first start


VerdictStatus = Literal["passed", "failed", "not run", "unchecked", ""]


@dataclass
class Verdict:
    """The trusted outcome of one test cell."""

    #: index of the cell in the notebook
    index: int
    grade_id: str
    #: "passed", "failed", "not run" (the cell never ran) or "unchecked" (not a check call:
    #: graded from the notebook's own output); "" only while the verifier has not answered
    status: VerdictStatus
    #: the student-facing message (a CheckFailed's level 1 on failure: :mod:`course.grading.hints`)
    message: str = ""
    #: what the checks printed on success ("passed check_x")
    stdout: str = ""
    #: for an unchecked cell: whether its own output in the notebook passes (nbgrader's rule)
    kernel_passed: bool | None = None
    points: float = 0.0
    #: what the cell's check jobs ran on ("gloo, GPUs hidden", "nccl"), each once; empty when they started none
    #: through :func:`course.checks.run` (an unchecked cell, a torchrun launch)
    ran_on: list[str] = field(default_factory=list)
    #: the check that failed, its package and its message at every hint level (level 1 is ``message``); for
    #: ``ddp-course check --hint``, never written into the notebook
    check: str = ""
    package: str = ""
    levels: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed" or (self.status == "unchecked" and bool(self.kernel_passed))


# --------------------------------------------------------------------------- the notebook side


def test_cells(nb) -> list[tuple[int, dict]]:
    """(index, cell) of every nbgrader test cell (grade: true, code) of ``nb``."""
    return [(index, cell) for index, cell in enumerate(nb.cells) if is_test_cell(cell)]


def kernel_passed(cell) -> bool:
    """nbgrader's rule on the cell's own outputs: no error and nothing on stderr."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return False
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            return False
    return True


def cell_ran(cell) -> bool:
    return cell.get("execution_count") is not None


def _match_snapshots(cells, snapshots):
    """For each test cell (in order), the snapshot taken just before it ran: the next one with the source
    the kernel ran (:func:`course.grading.checkcalls.kernel_source`)."""
    matched, position = {}, 0
    for index, cell in cells:
        if not cell_ran(cell):
            continue
        ran = checkcalls.kernel_source(cell["source"])
        for k in range(position, len(snapshots)):
            if snapshots[k].source == ran:
                matched[index] = snapshots[k]
                position = k + 1
                break
    return matched


def verify_notebook(nb, workdir: str, *, hide=(), limits=None, cell_timeout: float = DEFAULT_CELL_TIMEOUT,
                    env: dict | None = None, log=None) -> list[Verdict]:
    """The trusted verdict of every test cell of the executed notebook ``nb`` run in ``workdir``.

    Call it once the notebook's kernel is dead (its snapshots are then final).
    The verifier runs in a new :class:`course.sandbox.Sandbox` of ``workdir``.
    """
    from course.grading import snapshot
    from course.sandbox import Sandbox

    cells = test_cells(nb)
    snaps = _match_snapshots(cells, snapshot.read(workdir))
    verdicts: dict[int, Verdict] = {}
    requests = []
    for index, cell in cells:
        meta = cell["metadata"]["nbgrader"]
        v = Verdict(index, str(meta.get("grade_id", index)), "", points=float(meta.get("points", 0) or 0))
        verdicts[index] = v
        if not cell_ran(cell):
            v.status = "not run"
            v.message = _not_run_reason(cell)
            continue
        if checkcalls.parse(cell["source"]) is None:
            v.status, v.kernel_passed = "unchecked", kernel_passed(cell)
            v.message = ("this test cell is not a single check call, so the grader cannot re-run it on its own: "
                         "it is graded from the notebook's own output")
            continue
        snap = snaps.get(index)
        if snap is None:
            v.status = "failed"
            v.message = ("the grader could not re-run this test: the notebook left no record of the objects it "
                         "used (was the grader's startup hook removed, or the kernel replaced?)")
            continue
        requests.append({"index": index, "source": cell["source"], "objects": snap.objects,
                         "errors": snap.errors, "files": snap.files, "kinds": snap.kinds,
                         "callable": snap.callable, "sources": snap.sources, "cells": snap.cells})
    if requests:
        if limits is None:
            from course.grading.kernel import sandbox_memory
            from course.sandbox import Limits

            limits = Limits(memory=sandbox_memory())  # a check may ask for nccl ranks (backend="auto")
        with Sandbox(workdir, hide=hide, limits=limits) as box:
            if log:
                log(box.summary)
            for result in _run_verifier(box, requests, cell_timeout, env):
                v = verdicts[result["index"]]
                v.status = result["status"]
                v.message = result.get("message", "")
                v.stdout = result.get("stdout", "")
                v.ran_on = [str(r) for r in result.get("ran_on") or []]
                v.check, v.package = str(result.get("check", "")), str(result.get("package") or "")
                v.levels = [str(text) for text in result.get("levels") or []]
    for v in verdicts.values():
        if v.status == "":
            v.status = "failed"
            v.message = "the grader's own run of this test did not finish in time (or its process died)"
    return [verdicts[i] for i, _ in cells]


def _not_run_reason(cell) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return str(out.get("evalue") or out.get("ename"))
    return "this test cell did not run"


def _run_verifier(box, requests, cell_timeout: float, env: dict | None):
    """Run the verifier in ``box`` on ``requests``; yield each cell's result as it arrives."""
    nonce = secrets.token_hex(16)
    payload = json.dumps({"nonce": nonce, "cell_timeout": cell_timeout, "cells": requests}).encode()
    from course.sandbox import HOME_DIR, python_flags

    box.fresh_dir(HOME_DIR)  # nothing the kernel left in its home (caches, user site-packages) reaches us
    cmd = box.command([sys.executable, *python_flags(), "-m", "course.grading.verifier"])
    full_env = dict(os.environ)
    full_env.update(env or {})
    from course.sandbox import zygote

    proc = zygote.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        cwd=box.workdir, env=full_env)  # forked from the worker's zygote, if it has one
    box.pids.append(proc.pid)
    deadline = STARTUP + cell_timeout * len(requests) + 10
    try:
        out, err = proc.communicate(payload, timeout=deadline)
    except subprocess.TimeoutExpired:
        box.kill()
        out, err = proc.communicate()
    for line in out.decode(errors="replace").splitlines():
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and result.pop("nonce", None) == nonce:
            yield result
    if proc.returncode not in (0, None) and b"Traceback" in err:
        sys.stderr.write(err.decode(errors="replace")[-3000:])


def apply_verdicts(nb, verdicts: list[Verdict]):
    """Rewrite each test cell's outputs to its trusted verdict (in place; returns ``nb``).

    Passed: one clean stdout output (with what its jobs ran on). Failed or not run: one error output with the
    trusted message. Unchecked cells keep their own outputs, plus a note saying so. What the jobs ran on is
    also in the cell's metadata (``ddp_course.ran_on``), for the grade report.
    """
    import nbformat

    for v in verdicts:
        cell = nb.cells[v.index]
        if v.ran_on:
            cell.setdefault("metadata", {}).setdefault("ddp_course", {})["ran_on"] = list(v.ran_on)
        if v.status == "passed":
            text = (v.stdout or "passed\n") + (f"(ran on {ran_on_text(v.ran_on)})\n" if v.ran_on else "")
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        elif v.status in ("failed", "not run"):
            cell.outputs = [nbformat.v4.new_output("error", ename="CheckFailed" if v.status == "failed" else "NotRun",
                                                   evalue=v.message, traceback=v.message.splitlines())]
        else:  # unchecked
            cell.outputs = list(cell.get("outputs", [])) + [
                nbformat.v4.new_output("stream", name="stdout", text=f"(note: {v.message})\n")]
    return nb


def ran_on_text(ran_on: list[str]) -> str:
    """What a cell's jobs ran on, in words: "gloo, GPUs hidden", or "gloo, GPUs hidden; nccl"."""
    return "; ".join(dict.fromkeys(ran_on))


def summary(verdicts: list[Verdict]) -> list[str]:
    """Lines for a grading report: the cells graded without verification."""
    return [f"{v.grade_id}: not re-run by the grader (not a check call); scored from the notebook's output"
            for v in verdicts if v.status == "unchecked"]


# --------------------------------------------------------------------------- the verifier process


class _CellDeadline(BaseException):
    pass


def _resolve(call: checkcalls.CheckCall):
    import importlib

    module = importlib.import_module(call.module)
    fn = getattr(module, call.function, None)
    home = getattr(fn, "__module__", None) or ""
    # defined in the module the call names, or (a package: graders.ddp_basics) in one of its own modules
    if not callable(fn) or not (home == call.module or hasattr(module, "__path__") and home.startswith(call.module + ".")):
        raise LookupError(f"{call.module} has no check {call.function}")
    return fn


def _verify_cell(request: dict, cell_timeout: float) -> dict:
    from course.errors import CheckFailed, LaunchError

    calls = checkcalls.parse(request["source"])
    result = {"index": request["index"]}
    if calls is None:
        return {**result, "status": "unchecked", "message": "not a check call"}
    for path, data in request.get("files", {}).items():
        _restore_file(path, data)
    from course.grading.snapshot import install_cells

    install_cells(request.get("cells") or {})
    proxies: dict[str, StudentObject] = {}
    for name, blob in request.get("objects", {}).items():
        proxies[name] = StudentObject(name, base64.b64decode(blob), kind=request.get("kinds", {}).get(name, ""),
                                      is_callable=request.get("callable", {}).get(name, "yes") != "no",
                                      source=request.get("sources", {}).get(name))
    printed = io.StringIO()

    def on_alarm(signum, frame):
        raise _CellDeadline()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(cell_timeout)))

    def failed(message: str) -> dict:
        return {**result, "status": "failed", "message": message}

    try:
        for current in calls:
            missing = [n for n in current.names if n not in proxies]
            if missing:
                why = [request.get("errors", {}).get(n) or f"`{n}` was not defined when this test ran" for n in missing]
                return failed(f"FAILED {current.function}: " + "; ".join(why))
            fn = _resolve(current)
            value = lambda a: proxies[a[1]] if a[0] == "name" else a[1]  # noqa: E731
            with contextlib.redirect_stdout(printed):
                fn(*[value(a) for a in current.args], **{k: value(a) for k, a in current.kwargs})
        misuse = {name: p.misuse for name, p in proxies.items() if p.misuse}
        if misuse:
            return failed(f"the grader cannot verify this test safely: the check looked inside {misuse}")
        return {**result, "status": "passed", "stdout": printed.getvalue()}
    except CheckFailed as err:
        hints.attach(err, current.module)
        return {**failed(err.render(1)), "check": err.check, "package": err.package, "levels": hints.levels(err)}
    except StudentObjectUsed as err:
        return failed(f"the grader cannot verify this test safely: {err}")
    except LaunchError as err:
        return failed(f"the grader's own run failed:\n{err}")
    except _CellDeadline:
        return failed(f"the grader's own run of this test did not finish within {cell_timeout:g} s")
    except (Exception, SystemExit) as err:  # noqa: BLE001 - a grader bug must not lose the other cells
        return failed(f"the grader's own run of this test raised {type(err).__name__}: {err}"[:4000])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def verify_noting_backends(request: dict, cell_timeout: float) -> dict:
    """One cell's result, with ``ran_on``: what each job its checks started ran on (:func:`course.checks.run` notes
    each in :data:`course.grading.cells.RAN_ON`), each once, in order."""
    cell_kinds.RAN_ON.clear()
    result = _verify_cell(request, cell_timeout)
    result["ran_on"] = list(dict.fromkeys(cell_kinds.RAN_ON))
    return result


def _restore_file(path: str, data: str) -> None:
    """Put back a file a check reads (as it was when the test ran), without leaving the work folder."""
    from course.grading.snapshot import _plain_relative

    if not _plain_relative(path):
        return
    target = os.path.realpath(path)
    if os.path.commonpath([target, os.getcwd()]) != os.getcwd():
        return
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = target + ".ddp-restore"
    with open(tmp, "wb") as fh:
        fh.write(base64.b64decode(data))
    os.replace(tmp, target)


def serve() -> int:
    """The verifier: read the request on stdin, print one JSON verdict per cell on the original stdout."""
    from course.proc import make_undumpable

    make_undumpable()  # ranks run as our uid: they must not ptrace us or reach our fds
    out = os.fdopen(os.dup(1), "w")  # our private channel (not inherited by children)
    os.dup2(2, 1)  # anything else printed goes to the log
    from course import launcher
    from course.launcher.forkserver import PRELOAD

    # Every job reads its ranks' results as data only. The ranks' forkserver is forked from here, torch
    # imported once for both. That happens before the request is read: the forkserver, and every rank, holds a
    # copy of this process's memory, which must not hold the hidden tests or the nonce yet (and it keeps none
    # of our descriptors, this channel included).
    launcher.configure(safe_results=True, fork_forkserver=True)
    for name in PRELOAD:
        importlib.import_module(name)
    launcher.warm_up()
    request = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    nonce = request["nonce"]
    cell_timeout = float(request.get("cell_timeout", DEFAULT_CELL_TIMEOUT))
    for cell in request["cells"]:
        started = time.monotonic()
        result = verify_noting_backends(cell, cell_timeout)
        result["seconds"] = round(time.monotonic() - started, 2)
        out.write(json.dumps({"nonce": nonce, **result}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
