"""``python -m hotspare.agent.runscript SCRIPT ARGS``: run a worker's script in a fresh
interpreter (``hotspare run --spawn exec``) the way a forked worker runs it (agent/zygote.py):
as ``python SCRIPT ARGS`` would, with the script's exit status, its non-daemon threads joined and
its ``atexit`` handlers run, and then ``os._exit``, so gloo's threads cannot abort the process
during interpreter teardown."""
import os
import sys

from hotspare.agent.zygote import flush, run_script

if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m hotspare.agent.runscript SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    code = run_script(sys.argv[1], sys.argv[2:])
    flush()
    os._exit(code)
