"""The checks of ``exercises/ex2-ddp-basics/ddp_basics.ipynb``, under the names its test cells call: ``graders.ddp_basics.<name>(...)``.

Each name lives in one module of this package (the table below) and is imported when first asked for, so a rank
that unpickles one harness imports that module alone.
"""

from __future__ import annotations

from graders.common.exports import lazy

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
__getattr__, __dir__ = lazy(__name__, EXPORTS)
