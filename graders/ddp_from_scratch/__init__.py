"""The checks of ``exercises/ex2-ddp-basics/ddp_from_scratch.ipynb``, under the names its test cells call: ``graders.ddp_from_scratch.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

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
__getattr__, __dir__ = lazy(__name__, EXPORTS)
