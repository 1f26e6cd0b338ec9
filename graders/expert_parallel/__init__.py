"""The checks of ``exercises/ex1-parallelism/expert_parallel.ipynb``, under the names its test cells call: ``graders.expert_parallel.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_moe_dispatch": "checks",
    "check_moe_gradients": "checks",
    "check_moe_outputs": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
