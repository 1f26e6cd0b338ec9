"""The sandbox: run a submission's code (its kernel, its ranks, the verifier's re-run of its checks) isolated.

How it works: the grader opens a :class:`Sandbox` per submission and wraps each command
line it starts there (``Sandbox.command``) in ``python -m course.sandbox run ... -- CMD``;
that wrapper isolates ``CMD`` and supervises it; when grading ends the sandbox kills
everything it started and gives the folder back. An autograde worker may fork these
processes from a warm zygote instead of exec'ing them.

* :mod:`course.sandbox.box`: the grader's side, :class:`Sandbox` (a uid, a cgroup and
  a work folder per submission);
* :mod:`course.sandbox.wrapper`: ``python -m course.sandbox run ... -- CMD``, the
  process that isolates ``CMD`` (namespaces, mounts, rlimits, uid) and supervises it;
* :mod:`course.sandbox.zygote`: an autograde worker's warm zygote, which forks the
  kernels and verifiers (the wrapper's code runs in the fork, then the role) with
  torch and the rest already imported;
* :mod:`course.sandbox.linux`: the Linux pieces both use (namespaces, mounts,
  cgroups, killing by uid);
* :mod:`course.sandbox.limits`: :class:`Limits`, what a sandbox may use.

Owns: isolation, nothing about what runs inside (the Jupyter kernel manager is grading's,
:mod:`course.grading.kernel`; what a zygote preloads, its user says). May import: only the
bottom layer (:mod:`course.proc`, :mod:`course.envnames`, :mod:`course.paths`), never the
launcher, grading or the instructor's verbs. Inside, one way: box and wrapper use linux
and limits, never each other; the zygote uses the wrapper (``wrapper.configure(exec_hook=...)``).
Entry points: :class:`Sandbox`, :class:`Limits`, ``python -m course.sandbox run``,
:class:`course.sandbox.zygote.Zygote`.
"""

from course.envnames import TOKEN_ENV
from course.proc import kill_tree, make_undumpable
from course.sandbox.box import (
    HOME_DIR,
    KERNEL_DIR,
    UID_RANGE,
    UIDS_ENV,
    Sandbox,
    default_hidden,
    describe,
    python_flags,
    python_paths,
    uid_range,
)
from course.sandbox.limits import GiB, Limits, MiB
from course.sandbox.linux import (
    kill_uid,
    marked_processes,
    namespaces_available,
    rootless_available,
    uid_processes,
)

__all__ = [
    "HOME_DIR", "KERNEL_DIR", "TOKEN_ENV", "UID_RANGE", "UIDS_ENV", "GiB", "Limits", "MiB", "Sandbox",
    "default_hidden", "describe", "kill_tree", "kill_uid", "make_undumpable", "marked_processes",
    "namespaces_available", "python_flags", "python_paths", "rootless_available", "uid_processes", "uid_range",
]

