"""The checks of ``exercises/ex4-torchrun/elastic.ipynb``, under the names its test cells call: ``graders.elastic.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

#: public name -> the module of this package that defines it
EXPORTS = {
    "check_elastic_grow": "checks",
    "check_elastic_shrink": "checks",
    "try_elastic": "checks",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
