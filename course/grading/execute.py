"""Step 2 of the grading pipeline: execute a submission in a sandboxed kernel, every cell bounded.

:class:`SandboxedExecute` is nbgrader's Execute with the kernel in the sandbox
(:class:`course.grading.kernel.SandboxKernelManager`) and :class:`GuardedExecution`'s
bounds: a kernel that dies (``os._exit``, out of memory), a cell that ignores the
interrupt after its time limit, or an output flood costs the submission the cells
from there on, with a clear message in each, instead of aborting the whole
notebook (nbclient raises DeadKernelError; nbgrader then loses the entire
submission). Both ``ddp-course grade`` and ``ddp-course autograde`` run it, as
the first of :data:`course.grading.pipeline.GRADING_STEPS`.

The student's kernel runs no check: a test cell of check calls becomes a comment
naming what the checks use (:func:`kernel_source`), so each check runs once, in
the verifier (:mod:`course.grading.verifier`), and hidden tests never reach the
kernel, where a later cell could read them back (``_ih``, ``In``, linecache, a
``pre_run_cell`` hook) and print them into the graded notebook.
"""

from __future__ import annotations

import contextlib
import os

import nbformat
from jupyter_core.utils import run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from traitlets import Float, Integer
from traitlets.config import Configurable

from course.grading import cells
from course.grading.notebook import TIMEOUT_ENAME, timeout_output

KILLED_ENAME = "KernelStopped"


class GuardedExecution(Configurable):
    """Mixin for nbclient.NotebookClient subclasses: every way a cell can wreck the kernel is bounded.

    When the kernel dies or must be stopped, the cell gets an error output saying
    why and every later cell is not run but marked (``ename`` NotRun, no
    execution count), so graders score them 0 and say why.
    """

    max_cell_output = Integer(2 << 20, help="Bytes of output kept per cell; more is dropped.").tag(config=True)
    interrupt_grace = Float(10.0, help="Seconds a timed-out cell has to honour the interrupt "
                                       "before its kernel is stopped.").tag(config=True)

    _stop_reason: str | None = None
    _output_bytes: dict | None = None

    @property
    def stop_reason(self) -> str | None:
        """Why the kernel was stopped (the later cells were not run), or None."""
        return self._stop_reason

    def _guard(self) -> None:
        if self._output_bytes is None:
            self._output_bytes = {}
            # after an interrupt, a kernel that never goes idle raises CellTimeoutError: we stop it then
            self.raise_on_iopub_timeout = True
            self.iopub_timeout = max(self.iopub_timeout, int(self.interrupt_grace))

    async def async_execute(self, reset_kc: bool = False, **kwargs):
        self._stop_reason, self._output_bytes = None, None
        self._guard()
        return await super().async_execute(reset_kc=reset_kc, **kwargs)

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        self._guard()
        if self._stop_reason is not None and cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output(
                "error", ename="NotRun", evalue=f"not run: {self._stop_reason}",
                traceback=[f"NotRun: this cell was not run: {self._stop_reason}"])]
            cell.execution_count = None
            return cell
        full = cell.source
        cell.source = kernel_source(cell)  # no check runs here, no hidden test reaches here (the verifier runs them)
        try:
            return await super().async_execute_cell(cell, cell_index, execution_count=execution_count,
                                                    store_history=store_history)
        except DeadKernelError:
            await self._stop(cell, cell_index, "the kernel died while running {where} (os._exit, a crash, or more "
                                               "memory than the grader allows)", kill=False)
        except CellTimeoutError:
            await self._stop(cell, cell_index, "{where} ran past its time limit and did not stop when "
                                               "interrupted, so the grader stopped its kernel")
        finally:
            cell.source = full
        return cell

    async def _stop(self, cell, cell_index: int, why: str, kill: bool = True) -> None:
        from jupyter_core.utils import ensure_async

        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        where = f"cell {cell_index}" + (f" ({gid})" if gid else "")
        self._stop_reason = why.format(where=where) + "; the cells after it were not run and score 0"
        cell.outputs = list(cell.get("outputs", [])) + [nbformat.v4.new_output(
            "error", ename=KILLED_ENAME, evalue=self._stop_reason, traceback=[f"{KILLED_ENAME}: {self._stop_reason}"])]
        if kill and self.km is not None:
            try:
                await ensure_async(self.km.shutdown_kernel(now=True))
            except Exception:  # noqa: BLE001 - it is being killed anyway
                pass

    # nbclient binds its sync entry points to its own coroutines: rebind them to ours
    execute = run_sync(async_execute)
    execute_cell = run_sync(async_execute_cell)

    #: where the kernel process's own stdout/stderr go (the cells' outputs come as messages): None
    #: inherits ours; ``ddp-course grade --json`` must print nothing but JSON
    kernel_log = None
    #: what protects the grader from this notebook (set when its kernel starts)
    sandbox_summary = ""

    async def async_start_new_kernel(self, **kwargs):
        # as nbgrader's autograde sets it while it executes, for the kernel alone (never this process's
        # environment: ddp-course grade may run several notebooks at once, in threads)
        kwargs.setdefault("env", {**os.environ, "NBGRADER_EXECUTION": "autograde"})
        if self.kernel_log is not None:
            kwargs.setdefault("stdout", self.kernel_log)
            kwargs.setdefault("stderr", self.kernel_log)
        await super().async_start_new_kernel(**kwargs)
        box = getattr(self.km, "sandbox", None)
        self.sandbox_summary = box.summary if box is not None else ""

    start_new_kernel = run_sync(async_start_new_kernel)

    def on_cell_executed(self, **kwargs):
        """A cell stopped by its time limit gets an error output saying after how long (both verbs alike)."""
        cell, reply = kwargs["cell"], kwargs.get("execute_reply") or {}
        content = reply.get("content", {})
        if content.get("status") == "error" and content.get("ename") == TIMEOUT_ENAME:
            cell.outputs = [o for o in cell.outputs if o.get("ename") != TIMEOUT_ENAME]
            cell.outputs.append(timeout_output(self.timeout_func(cell) if self.timeout_func else self.timeout))
            return
        super().on_cell_executed(**kwargs)

    def output(self, outs, msg, display_id, cell_index):
        self._guard()
        size = _size(msg)
        before = self._output_bytes.get(cell_index, 0)
        self._output_bytes[cell_index] = before + size
        if before + size <= self.max_cell_output:
            return super().output(outs, msg, display_id, cell_index)
        out = None
        if before < self.max_cell_output and "text" in msg.get("content", {}):  # keep the head of a stream
            msg = {**msg, "content": {**msg["content"], "text": msg["content"]["text"][:self.max_cell_output - before]}}
            out = super().output(outs, msg, display_id, cell_index)
        if before <= self.max_cell_output:  # first thing in the cell: nbgrader's LimitOutput keeps the head
            note = (f"[ddp-course: this cell printed more than {self.max_cell_output >> 20} MB; "
                    "the rest of its output was dropped]\n")
            outs.insert(0, nbformat.v4.new_output("stream", name="stdout", text=note))
        return out


def kernel_source(cell) -> str:
    """The source the kernel runs for ``cell``: a test cell the verifier runs becomes a comment."""
    from course.grading import checkcalls

    return checkcalls.kernel_source(cell.source) if cells.is_test_cell(cell) else cell.source


def _size(msg) -> int:
    content = msg.get("content", {})
    if "text" in content:
        return len(content["text"])
    data = content.get("data") or {}
    return sum(len(v) if isinstance(v, str) else len(str(v)) for v in data.values()) + len(str(content.get("traceback", "")))


# --------------------------------------------------------------------------- nbgrader


def _execute_base():
    from nbgrader.preprocessors import Execute

    return Execute


class SandboxedExecute(GuardedExecution, _execute_base()):
    """nbgrader's Execute with the kernel in the sandbox and bounded cells: the pipeline's execution step.

    nbgrader executes the notebook in the folder where it wrote the restored copy
    (hidden tests included) a moment before; that file, and any other notebook there
    that holds hidden tests, is moved out of the folder while the kernel runs.
    ``resources["ddp_course"]`` gets ``notes`` (the sandbox summary) and ``stopped``
    (why the kernel was stopped early, "" when every cell ran).
    """

    def __init__(self, *args, **kwargs):
        from course.grading.kernel import SandboxKernelManager

        kwargs.setdefault("kernel_manager_class", SandboxKernelManager)
        kwargs.setdefault("error_on_timeout", {"ename": TIMEOUT_ENAME, "evalue": "", "traceback": []})
        super().__init__(*args, **kwargs)

    def preprocess(self, nb, resources=None, km=None):
        resources = resources if resources is not None else {}
        workdir = resources.get("metadata", {}).get("path") or os.getcwd()
        self._stop_reason, self._output_bytes = None, None
        with hidden_notebooks_away(workdir):
            try:
                nb, resources = super().preprocess(nb, resources, km=km)
            except RuntimeError as err:
                if "before replying" not in str(err):
                    raise
                # a RuntimeError, as nbclient raises it: grading did not run (not a fault of the notebook's cells)
                raise RuntimeError(f"the sandboxed kernel died before it started: {_last_words(self.kernel_log)}") from err
        state = resources.setdefault("ddp_course", {})
        state.setdefault("notes", [])
        if self.sandbox_summary:
            state["notes"].append(self.sandbox_summary)
        state["stopped"] = self.stop_reason or ""
        return nb, resources


def holds_hidden_tests(path: str) -> bool:
    """Whether the notebook file at ``path`` holds hidden tests: the kernel must not see it."""
    try:
        with open(path, "rb") as fh:
            return cells.holds_hidden_tests(fh.read())
    except OSError:
        return False


#: a stash's name: this prefix, the pid of the process that made it, "-", a random part
STASH_PREFIX = "ddp-course-stash-"


def sweep_stale_stashes(tmp: str | None = None) -> list[str]:
    """Remove the stashes of :func:`hidden_notebooks_away` (in ``tmp``, the temporary folder) that a killed grading
    left (its process is gone: a SIGKILL runs no ``finally``), if this user owns them; the paths removed. Each
    holds a restored notebook, hidden tests included: nothing should keep it past its grading."""
    import shutil
    import stat
    import tempfile

    from course.proc import alive

    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        pid = name[len(STASH_PREFIX):].split("-", 1)[0]
        if not name.startswith(STASH_PREFIX) or not pid.isdigit() or alive(int(pid)):
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode):  # lstat: a link is no folder here
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def hidden_notebooks_away(workdir: str):
    """Move the notebooks of ``workdir`` that hold hidden tests to a private folder for the block, then back."""
    import shutil
    import tempfile

    found = [os.path.join(root, name) for root, dirs, files in os.walk(workdir) for name in files
             if name.endswith(".ipynb") and not os.path.islink(os.path.join(root, name))
             and holds_hidden_tests(os.path.join(root, name))]
    if not found:
        yield
        return
    sweep_stale_stashes()
    stash = tempfile.mkdtemp(prefix=f"{STASH_PREFIX}{os.getpid()}-")
    moved = []
    try:
        for k, path in enumerate(found):
            kept = os.path.join(stash, f"{k}.ipynb")
            shutil.move(path, kept)
            moved.append((kept, path))
        yield
    finally:
        for kept, path in moved:
            if os.path.isdir(path) and not os.path.islink(path):  # the submission put something there meanwhile
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            shutil.move(kept, path)
        shutil.rmtree(stash, ignore_errors=True)


def remove_machinery(workdir: str) -> None:
    """Remove the sandbox's own folders (kernel sockets, home, snapshots) from a graded work folder."""
    import shutil

    from course.grading.snapshot import FOLDER
    from course.sandbox import HOME_DIR, KERNEL_DIR

    for name in (KERNEL_DIR, HOME_DIR, FOLDER):
        path = os.path.join(workdir, name)
        if os.path.islink(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)  # fd-based: safe against links planted inside


def _last_words(log) -> str:
    """The last error line a dead kernel wrote (on its stderr, in ``log``), or what to try."""
    if log is None or not hasattr(log, "seek"):
        return "check that `python -m ipykernel` runs for this Python (the kernel's own output went to the log)"
    log.seek(0)
    lines = [line.strip() for line in log.read().decode("utf-8", "replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    if errors or lines:
        return (errors or lines)[-1][:300]
    return "it wrote nothing; check that `python -m ipykernel` runs for this Python"


#: what copy_submission takes from a submission's folder
COPY_LIMIT = 100 << 20
_SKIP = {".git", ".ipynb_checkpoints", "__pycache__", ".kernel", ".home", ".ddp-verify"}


def copy_submission(src, dest, limit: int = COPY_LIMIT) -> None:
    """Copy the regular files of the folder ``src`` into ``dest`` (no links, no hidden machinery, ``limit`` bytes)."""
    import shutil

    total = 0
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in _SKIP and not os.path.islink(os.path.join(root, d))]
        rel = os.path.relpath(root, src)
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            if name.endswith(".ipynb") and holds_hidden_tests(path):
                continue  # a source notebook graded as it is: its hidden tests must not reach the kernel
            total += os.path.getsize(path)
            if total > limit:
                return
            shutil.copyfile(path, os.path.join(dest, rel, name))
