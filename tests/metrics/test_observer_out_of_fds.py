"""The launcher out of file descriptors (EMFILE on every open, as under a connection flood):
the observer cannot read the device registry nor open the file a sink writes to, yet every
event the coordinator handles still reaches the stream, nothing escapes into the coordinator,
each trouble is said once on stderr, and the device states come back once files open again."""
import contextlib
import errno
import json
import os
import queue
import resource

import pytest

from hotspare.coordinator import Coordinator, Ledger
from hotspare.coordinator import events as ev
from hotspare.coordinator.health import HealthMonitor
from hotspare.coordinator.nodes import Nodes
from hotspare.health.registry import Registry
from hotspare.health.rulefile import load_rules
from hotspare.observe.observer import Observer
from hotspare.observe.stream import EventFile, read
from hotspare.policy.view import ClusterView

T = 1796300000.0


@contextlib.contextmanager
def out_of_file_descriptors():
    """This process may open no more files (its soft RLIMIT_NOFILE at its lowest free descriptor)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_observer_out_of_file_descriptors_keeps_the_events_flowing_and_says_so_once(tmp_path, capsys):
    registry = Registry(tmp_path / "health.json")
    registry.ensure("n0/cpu0")
    desk = HealthMonitor(load_rules(), registry, ["n0/cpu0"], log=lambda line: None)
    logged: list[str] = []
    coord = Coordinator(Nodes(job="j"), queue.Queue(), ClusterView(world_size=2, target_spares=1),
                        Ledger({"script": "train.py", "nproc": 2}), log=logged.append)
    stream = EventFile(str(tmp_path / "events.jsonl"))
    each = tmp_path / "each.jsonl"

    def appending(rec):                 # a sink that opens its file for every record
        with open(each, "a") as f:
            f.write(json.dumps(rec) + "\n")

    seen, now = [], [T]
    obs = Observer(coord.ledger, coord.view, [stream, appending, seen.append], health=desk,
                   clock=lambda: now[0], nodes=coord.nodes).install(coord)
    obs.start(coord.ledger.settings)
    assert [r["data"]["devices"] for r in seen if r["kind"] == "devices"] == [
        [{"device": "n0/cpu0", "state": "healthy", "reason": "registered"}]]
    registry.cordon("n0/cpu0", "operator: a fan is loud")        # seen at the next registry poll

    with out_of_file_descriptors():
        with pytest.raises(OSError) as refused:
            open(registry.path)
        assert refused.value.errno == errno.EMFILE
        for i in range(5):              # each one a second and a half later: each polls the registry
            now[0] += 1.5
            coord.handle(ev.AgentRefused("n0", "spawn", f"no such device {i}", now[0]))
    assert len(logged) == 5 and not obs.broken and obs.sinks == [stream, appending, seen.append]
    refusals = [r["data"]["message"] for r in seen if r["kind"] == "agent_refused"]
    assert refusals == [f"no such device {i}" for i in range(5)]
    assert [r["kind"] for r in seen].count("devices") == 1          # no device states while unreadable

    now[0] += 1.5                       # files open again: the next event brings the cordon
    coord.handle(ev.AgentRefused("n0", "spawn", "no such device 5", now[0]))
    assert seen[-1]["kind"] == "devices" and seen[-1]["data"]["devices"][0]["state"] == "cordoned"

    registry.uncordon("n0/cpu0", "fan replaced")    # changed: the next poll must read the file again
    with out_of_file_descriptors():     # the run ends while out of descriptors once more
        obs.close(0, {"outcome": "completed"})
    assert obs.closed and seen[-1]["kind"] == "run_end" and seen[-1]["data"]["outcome"] == "completed"
    stream.close()

    on_disk = read(str(tmp_path / "events.jsonl"))
    assert [r["data"]["message"] for r in on_disk if r["kind"] == "agent_refused"] == \
        [f"no such device {i}" for i in range(6)]
    assert on_disk[-1]["kind"] == "run_end"
    each_kinds = [json.loads(line)["kind"] for line in each.read_text().splitlines()]
    assert each_kinds.count("agent_refused") == 1 and "run_end" not in each_kinds   # only what came with files

    err = capsys.readouterr().err.splitlines()
    unreadable = [line for line in err if "cannot read the device registry" in line]
    assert len(unreadable) == 2 and "Too many open files" in unreadable[0], err     # once per episode
    assert len([line for line in err if "event sink" in line and "want of a resource" in line]) == 2, err
    assert any("reads the device registry again" in line for line in err), err
    assert any("takes records again" in line for line in err), err
    assert not any("stops" in line or "dropped" in line for line in err), err
