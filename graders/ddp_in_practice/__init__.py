"""The checks of ``exercises/ex2-ddp-basics/ddp_in_practice.ipynb``, under the names its test cells call: ``graders.ddp_in_practice.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

import importlib

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_accumulation": "checks",
    "check_amp_step": "precision",
    "check_amp_sync": "precision",
    "check_clip": "precision",
    "check_evaluate": "checks",
    "check_load_checkpoint": "checks",
    "check_no_sync": "checks",
    "check_uneven": "checks",
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
