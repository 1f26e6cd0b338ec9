"""A job's backend under another name, so a check can tell code that joins with ``course.backend()`` from code
that names a fixed backend: on a CPU grader both would be gloo.

torch takes a backend per device type: ``init_process_group("cpu:gloo,cuda:ddpcourse")`` makes a group that runs
gloo for CPU tensors and, for CUDA tensors, the backend registered as ``ddpcourse``, here torch's own
``FakeProcessGroup`` (:func:`prepare_alias`, called in each rank before the student's code; a CPU grader has no
CUDA tensor for it to carry). In a job whose ``course.backend()`` answers that name:

* a default group made with ``course.backend()`` says ``"cpu:gloo,cuda:ddpcourse"``; one made with a fixed
  ``"gloo"`` or ``"cpu:gloo"`` says so;
* a later group that takes the default's backend (``new_group()`` with no backend: nccl on a GPU machine, where it
  runs no collective on CPU tensors) carries the stand-in for CUDA tensors, set when the group was made;
  one made with a backend of its own for CPU tensors (``"gloo"``, ``"cpu:gloo"``, ``"cpu:gloo,cuda:gloo"``) does
  not, whatever its name in torch's Python registry says.

(The alias was plain ``"cpu:gloo"`` before: a group rightly made with ``backend="cpu:gloo"`` then looked like one
that took the default's, and lost its points.)
"""

from __future__ import annotations

import os

from course.envnames import BACKEND_ENV

#: the backend for CUDA tensors that a gloo job's default group is named with (a stand-in: no rank has a GPU there)
STAND_IN = "ddpcourse"
#: the name a gloo job's ``course.backend()`` gives in :func:`backend_alias`
GLOO_ALIAS = f"cpu:gloo,cuda:{STAND_IN}"
#: the alias where this torch cannot make the stand-in (none of the versions the course supports): it tells a fixed
#: "gloo" apart, but not a group made with "cpu:gloo" from one that took the default's
PLAIN_ALIAS = "cpu:gloo"
try:
    from torch._C._distributed_c10d import FakeProcessGroup as _FAKE
except ImportError:  # pragma: no cover
    _FAKE = None


def _make_stand_in(rank: int, size: int, options=None):
    """torch's fake process group (its constructor moved between versions)."""
    make = getattr(_FAKE, "_create_internal", None)
    if make is not None:
        return make(rank, size, options) if options is not None else make(rank, size)
    return _FAKE(rank, size)


def _stand_in_works() -> bool:
    try:
        return _FAKE is not None and _make_stand_in(0, 1) is not None
    except Exception:  # noqa: BLE001 - any failure: use the plain alias
        return False


def check_policy(asked: str = "gloo") -> str:
    """The backend policy a check's job runs under: ``asked``, unless ``DDP_COURSE_CHECK_BACKEND`` names another
    for every check (benchmarks/gpu_check.py: every check on auto)."""
    return os.environ.get("DDP_COURSE_CHECK_BACKEND") or asked


def backend_alias(policy: str = "gloo") -> tuple[dict, str | None]:
    """``(env, name)``: the ``env`` for :func:`course.checks.run` with which ``course.backend()`` in the ranks of a
    gloo job answers ``name`` (:data:`GLOO_ALIAS`); ``({}, None)`` where the job may run another backend (the
    check's ``policy`` is not gloo, or ``DDP_COURSE_CHECK_BACKEND`` asks for another). The ranks must call
    :func:`prepare_alias` before any code that joins with that name."""
    if check_policy(policy) != "gloo":
        return {}, None
    name = GLOO_ALIAS if _stand_in_works() else PLAIN_ALIAS
    return {BACKEND_ENV: name}, name


def _stand_in(common_opts, backend_opts):
    """The backend the alias names for CUDA tensors: torch's fake process group (never used on a CPU grader)."""
    try:
        return _make_stand_in(common_opts.group_rank, common_opts.group_size, backend_opts)
    except TypeError:  # a torch whose fake group takes no options
        return _make_stand_in(common_opts.group_rank, common_opts.group_size)


def prepare_alias() -> None:
    """In a rank (before the student's code): make the name :func:`backend_alias` gave joinable. A no-op in a job
    without the alias, and when the stand-in is registered already."""
    import torch.distributed as dist

    if os.environ.get(BACKEND_ENV) != GLOO_ALIAS:
        return
    if STAND_IN not in dist.Backend.backend_list:
        dist.Backend.register_backend(STAND_IN, _stand_in, extended_api=True, devices=["cuda"])


def gloo_for_cpu(name: str | None) -> bool:
    """Whether a backend name, as ``dist.get_backend`` gives it, runs gloo for CPU tensors: ``"gloo"``,
    ``"cpu:gloo"``, ``"cpu:gloo,cuda:..."``."""
    if not name:
        return False
    if ":" not in name:
        return name.lower() == "gloo"
    devices = dict(part.split(":", 1) for part in name.lower().split(",") if ":" in part)
    return devices.get("cpu") == "gloo"
