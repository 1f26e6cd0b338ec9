"""The checks of ``exercises/ex1-parallelism/pipeline.ipynb``, under the names its test cells call: ``graders.pipeline.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_pipeline_gradients": "checks",
    "check_pipeline_prediction": "checks",
    "check_pipeline_schedule": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
