"""Writes the worker contract it was started with (WorkerEnv.from_env) as JSON to argv[1], and
the HOTSPARE_* variable names it sees; never calls hotspare.init()."""
import dataclasses
import json
import os
import sys

from hotspare.protocol.workerenv import WorkerEnv

env = WorkerEnv.from_env(os.environ)
with open(sys.argv[1], "w") as f:
    json.dump({"contract": dataclasses.asdict(env) if env else None,
               "names": sorted(k for k in os.environ if k.startswith("HOTSPARE_"))}, f)
