"""A coordinator's health desk and a node agent, linked over real sockets in this process: a
cordoned device drains, its node runs two diagnostics passes in check worker processes, and it
comes back healthy. Prints what happened as JSON, with whether this process imported torch."""
import json
import os
import queue
import sys
import time

import hotspare.cli.run  # noqa: F401 - the launcher's modules, imported as `hotspare run` does
from hotspare.agent import NodeAgent
from hotspare.coordinator import events as ev
from hotspare.coordinator.coordinator import Coordinator  # noqa: F401
from hotspare.coordinator.health import HealthMonitor
from hotspare.coordinator.nodes import NodeEndpoint, Nodes
from hotspare.health.registry import Registry
from hotspare.health.rulefile import load_rules

db, secret = sys.argv[1], b"s" * 32
devices = ["n1/cpu0", "n1/cpu1"]
events: queue.Queue = queue.Queue()
nodes, lines = Nodes(), []
desk = HealthMonitor(load_rules(), Registry(db), devices, log=lines.append)
desk.attach(nodes.tell)
endpoint = NodeEndpoint(events, secret, owner=nodes.owner)
agent = NodeAgent([sys.executable, "-c", "pass"], dict(os.environ), coordinator=endpoint.address, secret=secret,
                  node="n1", devices=devices, spawn="exec")
deadline = time.time() + 120
while time.time() < deadline:
    e = events.get(timeout=max(0.01, deadline - time.time()))
    if isinstance(e, ev.NodeConnected):
        node = nodes.add(e.hello, e.channel)
        desk.node_connected(node.name, node.devices)
        desk.cordon(devices[1], "too hot", "temp-limit", time.time())
        desk.device_released(devices[1])
    elif isinstance(e, ev.DeviceChecked):
        desk.checked(e)
        if not desk.pending():
            break
agent.shutdown(grace=0.0)
endpoint.close()
print(json.dumps({"state": Registry(db).get(devices[1]).state.value, "lines": lines,
                  "torch": "torch" in sys.modules}))
