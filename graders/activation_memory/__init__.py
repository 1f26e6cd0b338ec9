"""The checks of ``exercises/ex3-syncbn-sharding/activation_memory.ipynb``, under the names its test cells call: ``graders.activation_memory.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_checkpoint_gradients": "checks",
    "check_checkpoint_plan": "checks",
    "check_saved_bytes": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
