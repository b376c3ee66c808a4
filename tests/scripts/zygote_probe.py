"""What a worker forked by the zygote sees of itself, written as JSON to argv[1]; then argv[2]
says how it ends: ok, exit:N, raise, sleep, or thread (a non-daemon thread that must be joined)."""
import atexit
import json
import os
import sys
import threading
import time

preloaded = "torch" in sys.modules      # before this script imported anything heavy
out, how = sys.argv[1], sys.argv[2]
with open(out, "w") as f:
    json.dump({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
               "env": {k: os.environ.get(k) for k in ("PROBE", "RANK", "HOME")}, "ppid": os.getppid(),
               "leads_session": os.getsid(0) == os.getpid(), "preloaded": preloaded}, f)
atexit.register(lambda: open(out + ".atexit", "w").close())


def fail_here():
    raise ValueError("a bug in the script")


if how.startswith("exit:"):
    sys.exit(int(how.split(":")[1]))
elif how == "raise":
    fail_here()
elif how == "sleep":
    time.sleep(600)
elif how == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), open(out + ".thread", "w").close())).start()
