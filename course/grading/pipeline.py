"""The grading pipeline, defined once: what ``ddp-course grade`` and ``ddp-course autograde`` both run.

After the locked cells are restored (nbgrader's autograde restores them from its
gradebook; ``ddp-course grade`` from the source notebook, :func:`course.grading.restore.restore`),
every notebook goes through :data:`GRADING_STEPS`, in order, with the settings
:func:`configure` puts into the traitlets config:

1. :class:`~course.grading.execute.SandboxedExecute`: the sandboxed, bounded kernel;
2. nbgrader's ``IgnorePattern``: a stderr output made only of warnings does not zero a cell;
3. :class:`VerifyTests`: the trusted verifier's verdicts replace the test cells' outputs, each failing
   one saying first which earlier cell timed out or raised (:func:`course.grading.causes.explain_failures`);
4. nbgrader's ``LimitOutput``: very long outputs are cut, as nbgrader always does.

Then the test cells are scored by nbgrader's rules: by SaveAutoGrades into the
gradebook (autograde), by :func:`course.grading.scoring.score_notebook` (grade),
both through ``nbgrader.utils.determine_grade``. The nbgrader config that
``ddp-course init`` writes imports :data:`GRADING_STEPS` and calls :func:`configure`,
so the two verbs cannot drift apart.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from nbconvert.preprocessors import Preprocessor
from nbgrader.preprocessors import IgnorePattern, LimitOutput
from traitlets import Bool, Float, List, Unicode
from traitlets.config import Config

from course.grading import verifier
from course.grading.causes import explain_failures
from course.grading.cells import OTHER_CELL_TIMEOUT, TEST_CELL_TIMEOUT, Timeouts
from course.grading.execute import SandboxedExecute, copy_submission
from course.grading.notebook import Execution

#: A stderr output made only of warning lines (Python's "file:12: UserWarning: ..." with its
#: indented source line, torch's C++ "[W... file.cpp:45] ..."): nbgrader's IgnorePattern drops
#: it. Anything else on stderr still zeroes the cell, as nbgrader intends.
WARNINGS_ONLY = (
    r"\A(?:(?:"
    r"[^\n]*:\d+: \w*Warning: [^\n]*"
    r"|(?:\[rank\d+\]:)?\[W[^\]\n]*\][^\n]*"
    r"|[ \t]+[^\n]*"
    r"|[ \t]*"
    r")(?:\n|\Z))+\Z"
)


class VerifyTests(Preprocessor):
    """Step 3 of the grading pipeline, after SandboxedExecute: re-run every test cell's checks in the trusted
    verifier and rewrite the test cells' outputs to its verdicts; a failing test cell's message starts with
    the earlier cells that timed out or raised (:func:`course.grading.causes.explain_failures`).

    ``resources["ddp_course"]`` gets the ``verdicts`` and more ``notes`` (the verifier's sandbox,
    when the kernel's was not reported; the test cells graded from their own output).
    """

    enabled = Bool(True, help="nbconvert runs a preprocessor only when enabled.").tag(config=True)
    hide = List(Unicode(), help="Paths the verifier's ranks must not see (besides the course folder).").tag(config=True)
    cell_timeout = Float(TEST_CELL_TIMEOUT, help="Seconds the verifier may spend on one test cell.").tag(config=True)

    def preprocess(self, nb, resources):
        from course.grading.execute import remove_machinery
        from course.grading.kernel import course_paths

        workdir = resources.get("metadata", {}).get("path") or os.getcwd()
        state = resources.setdefault("ddp_course", {})
        notes = state.setdefault("notes", [])
        verifier_box: list[str] = []
        verdicts = verifier.verify_notebook(nb, workdir, hide=[*self.hide, *course_paths(self.config)],
                                   cell_timeout=self.cell_timeout, log=verifier_box.append)
        verifier.apply_verdicts(nb, verdicts)
        explain_failures(nb)  # the cause (an answer cell that timed out or raised) before what the test missed
        for line in verifier_box:
            self.log.info(line)
        for line in verifier.summary(verdicts):
            self.log.warning(line)
        remove_machinery(workdir)
        state["verdicts"] = [v.__dict__ for v in verdicts]
        state["notes"] = list(dict.fromkeys(notes + (verifier_box if not notes else []) + verifier.summary(verdicts)))
        return nb, resources


#: the steps every graded notebook goes through, in order (after its locked cells are restored)
GRADING_STEPS: list[type[Preprocessor]] = [SandboxedExecute, IgnorePattern, VerifyTests, LimitOutput]


def configure(
    c: Config,
    *,
    test_timeout: float = TEST_CELL_TIMEOUT,
    other_timeout: float = OTHER_CELL_TIMEOUT,
    kernel_name: str | None = None,
    hide: list[str] | tuple[str, ...] = (),
) -> Config:
    """Put the pipeline's settings into ``c`` (an nbgrader config, or a fresh one for ``ddp-course grade``).

    ``test_timeout`` and ``other_timeout``: seconds a test cell (real multi-rank jobs; the verifier
    gets as long again) and any other cell may run. ``hide``: paths neither the kernel nor the
    verifier's ranks may see (an nbgrader course folder is hidden anyway).
    """
    timeouts = Timeouts(float(test_timeout), float(other_timeout))
    c.Execute.timeout_func = timeouts.for_cell
    # Stop the kernel as soon as its last cell has run: a graceful exit (the kernel, then its
    # rank launcher) adds 3-5 s to every submission and runs nothing that grading needs.
    c.Execute.shutdown_kernel = "immediate"
    if kernel_name:
        c.Execute.kernel_name = kernel_name
    c.VerifyTests.cell_timeout = float(test_timeout)
    c.IgnorePattern.enabled = True
    c.IgnorePattern.pattern = WARNINGS_ONLY
    if hide:
        c.SandboxKernelManager.hide = [str(p) for p in hide]
        c.VerifyTests.hide = [str(p) for p in hide]
    # nbgrader gives a test cell 0 points if it wrote anything on stderr, and torch warns a lot
    # (deprecations, gloo hostname lookups): kernels inherit this environment, so library
    # warnings stay quiet. Any other stderr still fails the cell.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return c


def run(nb, submission_dir: str | Path, config: Config) -> Execution:
    """Run :data:`GRADING_STEPS` on ``nb`` (restored, outputs cleared) outside nbgrader: ``ddp-course grade``.

    The submission's folder is copied into a fresh work folder (regular files only, at most
    100 MB; no notebook holding hidden tests), where the kernel runs, as nbgrader's autograde
    runs it in its own copy. Returns an :class:`Execution` whose ``notes`` say how isolated the
    run was and which test cells were graded from their own output.
    """
    workdir = tempfile.mkdtemp(prefix="ddp-course-grade-")
    try:
        copy_submission(submission_dir, workdir)
        resources = {"metadata": {"path": workdir}}
        with tempfile.TemporaryFile() as kernel_log:
            for step_class in GRADING_STEPS:
                step = step_class(config=config)
                if isinstance(step, SandboxedExecute):
                    step.kernel_log = kernel_log
                nb, resources = step(nb, resources)
        state = resources.get("ddp_course", {})
        ran = {i for i, cell in enumerate(nb.cells)
               if cell.get("cell_type") == "code" and cell.get("execution_count") is not None}
        found = {v["grade_id"]: {"check": v["check"], "package": v["package"], "levels": v["levels"]}
                 for v in state.get("verdicts", []) if v.get("levels")}
        return Execution(nb, ran, state.get("stopped", ""), list(dict.fromkeys(state.get("notes", []))), found)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
