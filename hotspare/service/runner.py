"""One job of the coordinator service, driven by a thread of its own.

A ``JobRunner`` builds the job the way ``hotspare run`` does (``hotspare.service.build``: the
typed configuration, the worker contract, the ledger, the view and the ``Coordinator``) and
runs its event loop. The job's state (``hotspare.coordinator.persist``) goes to the database
each time its membership changes, and at least every ``SAVE_EVERY_S`` while it trains, so a
restarted service resumes it (``resume``): it waits a lease and a margin for the job's node
agents to re-register, takes in what they replay, declares the nodes that did not come back
lost (their ranks fail over as usual), then carries on.
"""
from __future__ import annotations

import argparse
import queue
import threading
import time
from typing import Any, Callable

from hotspare.config import RunConfig, add_arguments, from_namespace
from hotspare.coordinator import events as ev
from hotspare.coordinator import persist
from hotspare.errors import ConfigError
from hotspare.protocol.messages import make
from hotspare.service import db as states
from hotspare.service.db import StateDB

SAVE_EVERY_S = 1.0
START_TIMEOUT_S = 60.0
REJOIN_SLACK_S = 1.0      # beyond lease + margin, for the agents' reconnection attempts


def run_config(request: dict[str, Any], listen_host: str, secret_file: str) -> RunConfig:
    """The job's typed configuration from a ``submit`` request: its own flags (as `hotspare run`
    takes them), the world size, and the service's part (the hosts are remote, the store binds
    the service's address, the service's secret)."""
    parser = argparse.ArgumentParser(prog="hotspare submit", add_help=False, exit_on_error=False)
    add_arguments(parser, RunConfig)
    world = int(request["nodes"]) * int(request["nproc_per_node"])
    argv = [*request["run_args"], "--nproc", str(world), "--spares", str(int(request["spares"])),
            "--local-nodes", "0", "--remote-nodes", str(int(request["nodes"])), "--listen", f"{listen_host}:0",
            "--secret-file", secret_file, "--telemetry", "off", "--", request["script"], *request["args"]]
    try:
        ns, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"the job's flags: {e}") from None
    if unknown:
        raise ConfigError(f"the job's flags: unrecognized {' '.join(unknown)[:200]}")
    return from_namespace(RunConfig, ns)


class JobRunner:
    def __init__(self, job: str, cfg: RunConfig, db: StateDB, store: dict[str, Any], lease: float, margin: float,
                 log: Callable[[str], None], on_end: Callable[["JobRunner"], None]):
        from hotspare.cli.preflight import preflight
        self.job, self.cfg, self.db, self.store = job, cfg, db, store
        self.lease, self.margin = lease, margin
        self.events: "queue.Queue" = queue.Queue()
        self.log = lambda line: log(f"[{job}] {line}")
        self._on_end = on_end
        self.pre = preflight(cfg)
        from hotspare.service.build import control_plane
        self.ledger, self.coord = control_plane(cfg, self.pre, self.events, None, self.log, job=job)
        self.coord.command("cancel", self._cancel)
        self.coord.journal = lambda: self._save(force=True)
        self.nodes: list[str] = []          # where it was placed, in placement order
        self._saved_key: Any = None
        self._saved_at = 0.0
        self.code: int | None = None
        self.cancelled = False
        self.spare_hosts: dict[str, int] = {}   # host -> the spare slots it holds for this job (0: a rank host)
        self.worker_env = self._worker_env(int(cfg.launch.nproc // max(1, cfg.hosts.remote_nodes)))

    def _worker_env(self, per_node: int) -> dict[str, str]:
        """What every worker of this job gets, on whichever host: torchrun's variables, the
        rendezvous store, and the job's part of the worker contract."""
        from hotspare.checkpoint.auth import ENV_KEY
        from hotspare.service.build import job_env
        world = str(self.cfg.launch.nproc)
        return {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": str(per_node), "ROLE_WORLD_SIZE": world,
                "GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": self.job,
                "MASTER_ADDR": str(self.store["host"]), "MASTER_PORT": str(self.store["port"]),
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", ENV_KEY: self.pre.key_file,
                **job_env(self.cfg, self.pre).to_env()}

    def spare_slots(self) -> int:
        return sum(self.spare_hosts.values())

    # ------------------------------------------------------------------ life
    def start(self, nodes: list[str], resume: dict[str, Any] | None = None) -> None:
        self.nodes = list(nodes)
        threading.Thread(target=self._run, args=(resume,), name=f"job-{self.job}", daemon=True).start()

    def cancel(self, origin: str) -> None:
        """From any thread: the job stops (its workers are ended) as soon as its thread sees it."""
        self.events.put(ev.OperatorCommand({"type": "cancel"}, origin, lambda reply: None, time.time()))

    def _cancel(self, msg, origin: str):
        self.cancelled = True
        self.coord.stop(f"cancelled by {origin}")
        return make("control_reply", ok=True, message=f"job {self.job} cancelled")

    def _run(self, resume: dict[str, Any] | None) -> None:
        coord = self.coord
        state, message = states.STOPPED, ""
        try:
            if resume is None:
                coord.start(nodes=len(self.nodes), timeout=START_TIMEOUT_S)
            else:
                self._rejoin(resume)
            while not coord.over():
                coord.step()
                self._save()
            code = coord.exit_code if coord.exit_code is not None else 1
            if self.ledger.outcome == "finished":
                state = states.FINISHED
            elif self.cancelled:
                state = states.CANCELLED
            message = self.ledger.message
        except ConfigError as e:
            code, message = 2, str(e)
            self.log(f"job could not start: {e}")
        except Exception as e:                 # one job's failure must not end the service
            code, message = 1, f"{type(e).__name__}: {e}"
            self.log(f"job failed in the coordinator: {message}")
        coord.stop_nodes(grace=10.0)
        self.ledger.nodes = coord.nodes.describe()
        report = self.ledger.report()
        self.code = code
        self.db.ended(self.job, state, code, message, report)
        self.log(f"job {state} (exit status {code})" + (f": {message.splitlines()[0]}" if message else ""))
        self._on_end(self)

    # ------------------------------------------------------------------ persistence
    def _save(self, force: bool = False) -> None:
        v, n = self.coord.view, self.coord.nodes
        key = (v.generation, v.phase, tuple(sorted(v.members.items())), tuple(v.ready_spares), v.starting,
               tuple(sorted(v.lost)), tuple(sorted(v.reports.items())), tuple(sorted(v.done)), v.stopping,
               len(n.workers), sum(w.exit_code is not None for w in n.workers.values()),
               len(self.ledger.failures), len(self.ledger.migrations), tuple(n.detached()))
        now = time.time()
        if force or key != self._saved_key or now - self._saved_at >= SAVE_EVERY_S:
            self.db.save_state(self.job, persist.capture(self.coord))
            self._saved_key, self._saved_at = key, now

    def _rejoin(self, state: dict[str, Any]) -> None:
        """After a restart: the saved state back in, then the agents' re-registrations and what
        they replay; nodes not back within a lease and a margin are lost."""
        coord = self.coord
        waiting = persist.restore(coord, state)
        self.log(f"resumed from the database at generation {coord.view.generation} ({coord.view.phase}); "
                 f"waiting up to {self.lease + self.margin + REJOIN_SLACK_S:.1f} s for node(s) "
                 f"{', '.join(waiting) or '-'} to re-register")
        deadline = time.time() + self.lease + self.margin + REJOIN_SLACK_S
        deferred = []
        while coord.nodes.detached() and time.time() < deadline:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if isinstance(event, (ev.NodeConnected, ev.NodeLost)):
                coord.handle(event)
            else:
                deferred.append(event)
        for name in coord.nodes.detached():
            self.log(f"NODE    {name}: did not re-register within {self.lease + self.margin:g} s of the "
                     "restart: declared lost")
            coord.handle(ev.NodeLost(name, None, time.time()))  # type: ignore[arg-type]
        for event in deferred:
            coord.handle(event)
        self._save(force=True)
        coord.resume()
