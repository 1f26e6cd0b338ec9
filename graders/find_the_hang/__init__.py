"""The checks of ``exercises/ex4-torchrun/find_the_hang.ipynb``, under the names its test cells call: ``graders.find_the_hang.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_diagnosis": "checks",
    "check_diagnosis_early": "checks",
    "check_diagnosis_metric": "checks",
    "check_diagnosis_shapes": "checks",
    "check_diagnosis_uneven": "checks",
    "check_fix": "checks",
    "check_fix_early": "checks",
    "check_fix_metric": "checks",
    "check_fix_shapes": "checks",
    "check_fix_uneven": "checks",
    "try_it": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
