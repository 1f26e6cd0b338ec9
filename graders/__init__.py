"""The course's own checks: one module per exercise (``graders.ex1`` ... ``graders.ex4``), written on
the check API :mod:`course.checks`; ex4 runs its scripts with the launcher's
:mod:`course.launcher.torchrun`.

A test cell calls them as ``graders.ex2.check_sampler(make_loader)``: the grader re-runs exactly such
calls in its trusted verifier (:mod:`course.grading.checkcalls`)."""
