"""The student's side: a workspace of their own (:mod:`.workspace`), the lab's settings (:mod:`.labconfig`),
and a self-check that says what the grader will say (:mod:`.check`, ``ddp-course check``)."""
