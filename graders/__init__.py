"""The course's own checks, written on the check API :mod:`course.checks`: one subpackage per exercise notebook,
named after it (``graders.parallelism`` for ``parallelism.ipynb`` ... ``graders.find_the_hang``), and
``graders.common`` for what several notebooks' checks share.

How it works: a test cell calls a check by the name its notebook's package offers, e.g.
``graders.ddp_basics.check_sampler_shards(ShardSampler)``; the grader re-runs exactly such calls in its trusted
verifier (:mod:`course.grading.checkcalls`). A check makes sure the answer is written, runs a harness on real ranks
with :func:`course.checks.run` (known mistakes named there), and compares what the ranks observed with a
single-process reference. A notebook's package holds its checks (``checks``, and a module per part that grows
large: ``sampler``, ``precision``, ``zero``, ...) and, where that grows large, what runs on the ranks and the
references (``harness``; exercise 4: ``graders.common.torchrun_model``, ``graders.elastic.story``). Its
``__init__`` lists the public names (``EXPORTS``) and imports the module holding one when it is first asked for.
Exercise 4's checks judge runs of the student's script under real torchrun (:mod:`course.checks.torchrun`).
"""
