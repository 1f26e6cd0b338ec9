"""The checks of ``exercises/ex4-torchrun/torchrun.ipynb``, under the names its test cells call: ``graders.torchrun.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

import importlib

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_atomic_checkpoint": "checks",
    "check_checkpoint_rank0": "checks",
    "check_ddp_training": "checks",
    "check_destroy": "checks",
    "check_multinode_ranks": "checks",
    "check_restart_resume": "checks",
    "check_standalone_ranks": "checks",
    "try_restart": "checks",
}
__all__ = sorted(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
