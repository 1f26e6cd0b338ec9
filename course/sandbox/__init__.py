"""The sandbox: run a submission's code (its kernel, its ranks, the verifier's re-run of its checks) isolated.

* :mod:`course.sandbox.box`: the grader's side, :class:`Sandbox` (a uid, a cgroup and
  a work folder per submission);
* :mod:`course.sandbox.wrapper`: ``python -m course.sandbox run ... -- CMD``, the
  process that isolates ``CMD`` (namespaces, mounts, rlimits, uid) and supervises it;
* :mod:`course.sandbox.zygote`: an autograde worker's warm zygote, which forks the
  kernels and verifiers (the wrapper's code runs in the fork, then the role) with
  torch and the rest already imported;
* :mod:`course.sandbox.linux`: the Linux pieces both use (namespaces, mounts,
  cgroups, killing process trees);
* :mod:`course.sandbox.limits`: :class:`Limits`, what a sandbox may use.

Dependencies run one way: box and wrapper use linux and limits, never each other;
the zygote uses the wrapper (its exec hook) and box uses the zygote.
"""

from course.envnames import TOKEN_ENV
from course.proc import kill_tree, make_undumpable
from course.sandbox.box import (
    HOME_DIR,
    KERNEL_DIR,
    UID_RANGE,
    Sandbox,
    default_hidden,
    describe,
    python_flags,
    python_paths,
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
    "HOME_DIR", "KERNEL_DIR", "TOKEN_ENV", "UID_RANGE", "GiB", "Limits", "MiB", "Sandbox",
    "default_hidden", "describe", "kill_tree", "kill_uid", "make_undumpable", "marked_processes",
    "namespaces_available", "python_flags", "python_paths", "rootless_available", "uid_processes",
]

