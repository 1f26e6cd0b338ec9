"""The checks of ``exercises/ex2-ddp-basics/ddp_basics.ipynb``, under the names its test cells call: ``graders.ddp_basics.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

import importlib

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_checkpoint": "checks",
    "check_cleanup": "checks",
    "check_sampler_order": "sampler",
    "check_sampler_shards": "sampler",
    "check_sampler_training": "sampler",
    "check_set_epoch": "checks",
    "check_setup": "checks",
    "check_training": "checks",
    "make_net": "checks",
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
