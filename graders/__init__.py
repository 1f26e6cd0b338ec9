"""The course's own checks: one module per exercise (``graders.ex1`` ... ``graders.ex4``), written on
the check API :mod:`course.checks`.

How it works: a test cell calls a check as ``graders.ex2_sampler.check_sampler_shards(ShardSampler)``; the grader
re-runs exactly such calls in its trusted verifier (:mod:`course.grading.checkcalls`). A check makes
sure the answer is written, runs a harness on real ranks with :func:`course.checks.run` (known
mistakes named there), and compares what the ranks observed with a single-process reference.
An exercise module holds its checks, their verdicts and data; where that grows large, what runs on
the ranks and the references live next to it in ``exN_model`` (``graders.ex2_model``,
``graders.ex2_practice_model``, ``graders.ex3_model``, ``graders.ex3_fsdp_model``). Exercise 4's
checks judge runs of the student's script under real torchrun (:mod:`course.checks.torchrun`)."""
