"""Helpers to run real local jobs from tests and benchmarks."""
from hotspare.testing.local import JobResult, run_job

__all__ = ["JobResult", "run_job"]
