"""The checks of ``exercises/ex2-ddp-basics/ddp_in_practice.ipynb``, under the names its test cells call: ``graders.ddp_in_practice.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_accumulation": "checks",
    "check_amp_step": "precision",
    "check_amp_sync": "precision",
    "check_clip": "precision",
    "check_hardest": "hardest",
    "check_load_checkpoint": "checks",
    "check_no_sync": "checks",
    "check_uneven": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
