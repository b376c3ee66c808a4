"""A minimal managed worker for the agent-link tests: says hello and ready, answers each
probe with a ``reducing`` message and an abort with ``failed``, reports that step 5 begins once it is watched (armed
faults) and step 6 once the agent says go, exits 0 on release. A real process on a real control channel."""
import os
import sys

from hotspare.protocol.auth import worker_connect
from hotspare.protocol.messages import make

worker = os.environ["HOTSPARE_WORKER_ID"]
ch = worker_connect(os.environ["HOTSPARE_AGENT"], worker, os.environ["HOTSPARE_ROLE"])   # proves its token
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "HOTSPARE_DEVICE")}
ch.send(make("ready", worker=worker, committed=-1, device=os.environ.get("HOTSPARE_DEVICE", ""), env=env))
while True:
    msg = ch.recv()
    if msg is None or msg["type"] == "release":
        sys.exit(0)
    if msg["type"] == "probe":
        ch.send(make("reducing", gen=msg["gen"], rank=int(os.environ["RANK"]), step=7))
    if msg["type"] == "abort":        # as a real worker does: leave the generation, say where it is
        ch.send(make("failed", gen=msg["gen"], rank=int(os.environ["RANK"]), committed=-1, error="aborted"))
    if msg["type"] == "watch" and msg["steps"]:   # a fault trigger: wait for the agent's go
        ch.send(make("step", gen=1, rank=int(os.environ["RANK"]), step=5, wait=1))
    if msg["type"] == "go" and msg["wait"] == 1:   # ... and only then go on to step 6
        ch.send(make("step", gen=1, rank=int(os.environ["RANK"]), step=6))
