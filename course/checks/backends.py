"""A job's backend under another name, so a check can tell code that joins with ``course.backend()`` from code
that names a fixed backend: on a CPU grader both would be gloo.

torch spells gloo for CPU tensors ``"cpu:gloo"`` too (``init_process_group("cpu:gloo")`` makes the same gloo
group, and ``get_backend()`` then says ``"cpu:gloo"``). In a job whose ``course.backend()`` answers that, a
process group made with ``course.backend()`` says ``"cpu:gloo"`` and one made with a fixed ``"gloo"`` says
``"gloo"``."""

from __future__ import annotations

import os

from course.envnames import BACKEND_ENV

#: the name a gloo job's ``course.backend()`` gives in :func:`backend_alias`
GLOO_ALIAS = "cpu:gloo"


def check_policy(asked: str = "gloo") -> str:
    """The backend policy a check's job runs under: ``asked``, unless ``DDP_COURSE_CHECK_BACKEND`` names another
    for every check (benchmarks/gpu_check.py: every check on auto)."""
    return os.environ.get("DDP_COURSE_CHECK_BACKEND") or asked


def backend_alias(policy: str = "gloo") -> tuple[dict, str | None]:
    """``(env, name)``: the ``env`` for :func:`course.checks.run` with which ``course.backend()`` in the ranks of a
    gloo job answers ``name`` (:data:`GLOO_ALIAS`); ``({}, None)`` where the job may run another backend (the
    check's ``policy`` is not gloo, or ``DDP_COURSE_CHECK_BACKEND`` asks for another)."""
    return ({BACKEND_ENV: GLOO_ALIAS}, GLOO_ALIAS) if check_policy(policy) == "gloo" else ({}, None)
