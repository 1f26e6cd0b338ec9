"""Grading: one pipeline that ``ddp-course grade`` and ``ddp-course autograde`` (nbgrader) both run.

The steps, in order (:mod:`course.grading.pipeline` defines them once):

1. **restore** the locked cells (tests, hidden tests) from the source notebook
   (:mod:`~course.grading.restore`; nbgrader's autograde restores them from its gradebook);
2. **execute** the notebook in a sandboxed kernel with bounded cells, where no check runs
   and no hidden test reaches (:mod:`~course.grading.execute`), while a hook records what
   each test cell's checks are given (:mod:`~course.grading.snapshot`);
3. **verify**: a trusted process re-runs every test cell's check calls
   (:mod:`~course.grading.checkcalls`) on the recorded objects and writes its verdicts
   into the test cells (:mod:`~course.grading.verifier`);
4. **score** each test cell by nbgrader's rules (:mod:`~course.grading.scoring`;
   nbgrader's SaveAutoGrades applies the same rules into the gradebook).

:mod:`~course.grading.kernel` is the Jupyter kernel manager of step 2 (the kernel in a
sandbox, the recording hook installed, forked from a zygote when there is one);
:mod:`~course.grading.cells` says which cell is which and how long each may run;
:mod:`~course.grading.notebook` reads notebooks and holds what an execution produced;
:mod:`~course.grading.inprocess` runs trusted notebooks fast, in this process (tests).

Owns: the grading of one notebook, from restore to score. May import: the bottom layer,
the sandbox and the launcher; never the instructor's verbs or the check API (the verifier
finds checks by name). Entry points: :func:`course.grading.grade.grade_notebook` (the
``grade`` verb), :data:`course.grading.pipeline.GRADING_STEPS` and
:func:`course.grading.pipeline.configure` (what nbgrader's autograde runs),
:class:`course.grading.kernel.SandboxKernelManager`.
"""
