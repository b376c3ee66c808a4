"""The in-process launcher (hotspare/testing/inproc.py) is `hotspare run` itself: the same
report, the workers' own lines in the output, and nothing of the job left in the test process."""
import os
import signal

from hotspare.testing.inproc import fault_free, run_inproc

ARGS = ["--model", "tiny", "--steps", "40"]


def test_a_job_run_in_process_leaves_the_test_process_as_it_found_it():
    env, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    r = run_inproc(ARGS, inject=["kill:rank=1:step=5"])
    assert r.code == 0 and r.report["failures_total"] == 1 and r.report["recovered_zero_loss"] == 1
    assert r.digest == fault_free(ARGS).digest                 # bitwise, as hotspare run's own
    assert "finished 40 steps" in r.output                      # a worker's line (through the zygote)
    assert "recovered with zero lost steps: 1/1 (100%)" in r.output   # the launcher's
    assert dict(os.environ) == env
    assert {s: signal.getsignal(s) for s in handlers} == handlers
