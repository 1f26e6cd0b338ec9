"""Where ``ddp-course k8s-job`` lived before :mod:`course.instructor.autograde.k8s`: the pods of Jobs written
before the move run ``python -m course.instructor.k8s preflight`` first, so that still works."""

import sys

from course.instructor.autograde.k8s import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
