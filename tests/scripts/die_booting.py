"""The example GPT, except that the spares named in DIE_BOOTING (e.g. "w4") SIGKILL themselves
while they boot, before hotspare.init(): a spare lost on its way up."""
import os
import runpy
import signal
import sys

if os.environ.get("HOTSPARE_ROLE") == "spare" and \
        os.environ.get("HOTSPARE_WORKER_ID") in os.environ.get("DIE_BOOTING", "").split(","):
    os.kill(os.getpid(), signal.SIGKILL)
example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "gpt_stdlib.py")
sys.argv[0] = example
runpy.run_path(example, run_name="__main__")
