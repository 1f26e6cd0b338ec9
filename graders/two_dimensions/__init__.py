"""The checks of ``exercises/ex3-syncbn-sharding/two_dimensions.ipynb``, under the names its test cells call: ``graders.two_dimensions.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_mesh_gradients": "checks",
    "check_mesh_losses": "checks",
    "check_mesh_prediction": "checks",
    "check_mesh_training": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
