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

:mod:`~course.grading.cells` says which cell is which and how long each may run;
:mod:`~course.grading.notebook` reads and plainly executes notebooks;
:mod:`~course.grading.inprocess` executes trusted notebooks fast, in this process (tests).
"""
