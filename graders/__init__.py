"""Checks for the ddp-course exercises: one module per exercise, built on :mod:`graders.core`."""

from graders.core import CheckFailed, passed, run_job

__all__ = ["CheckFailed", "passed", "run_job"]
