"""``python -m course.sandbox run --workdir W [options] -- CMD ...``: the sandbox wrapper (:mod:`course.sandbox.wrapper`)."""

import sys

from course.sandbox.wrapper import main

sys.exit(main())
