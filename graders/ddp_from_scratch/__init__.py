"""The checks of ``exercises/ex2-ddp-basics/ddp_from_scratch.ipynb``, under the names its test cells call: ``graders.ddp_from_scratch.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

import importlib

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_broadcast": "checks",
    "check_bucketed": "checks",
    "check_buckets": "checks",
    "check_naive": "checks",
    "check_overlap": "checks",
    "check_step_cost": "cost",
    "check_step_plan": "cost",
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
