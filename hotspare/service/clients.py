"""The requests of `hotspare submit`, `status`, `cancel` and `inject` to the coordinator service,
each served on the link thread that read it (``Service`` inherits them: they read and change the
same database, runners and queue under the service's lock)."""
from __future__ import annotations

import queue
import time
from typing import Any

from hotspare.coordinator import events as ev
from hotspare.errors import ConfigError, ProtocolError
from hotspare.health.lifecycle import IN_SERVICE
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import Message, make
from hotspare.service import db as states
from hotspare.service.jobargs import run_config
from hotspare.service.priority import policy_of

MAX_QUEUED = 1000
JOB_ANSWER_S = 10.0       # a running job answers an operator command within this long


class Wake:
    """Look at the queue again (a job was submitted or a job ended)."""


class Clients:
    """The service's answers to its clients (mixed into ``Service``, whose state they use)."""

    def _client(self, ch: Channel, msg: Message) -> None:
        origin = f"{msg['operator'][:64]!r} from {auth.peer(ch)}"
        try:
            reply = self._answer(msg["command"], msg["args"], origin)
        except (ConfigError, ProtocolError, KeyError, TypeError, ValueError) as e:
            reply = make("control_reply", ok=False, message=str(e))
            self.log(f"CLIENT  refused {msg['command'][:32]!r} from {origin}: {e}")
        try:
            ch.send(reply)
        except OSError:
            pass
        ch.close()

    def _answer(self, command: str, args: dict[str, Any], origin: str) -> Message:
        if command == "submit":
            return self._submit(args, origin)
        if command == "status":
            jobs = [j.describe() for j in self.db.jobs()]
            job = args.get("job")
            if job is not None:
                jobs = [j for j in jobs if j["id"] == job]
                if not jobs:
                    raise ConfigError(f"no job {str(job)[:64]!r}")
            return make("control_reply", ok=True, message=f"{len(jobs)} job(s)", jobs=jobs, hosts=self._hosts(),
                        report=self.db.report(job) if job is not None else None)
        if command == "cancel":
            return self._cancel(str(args["job"]), origin)
        if command == "inject":
            return self._to_job(str(args["job"]), {"type": "inject", "spec": str(args["spec"])[:1000]}, origin)
        raise ConfigError(f"unknown command {command[:32]!r}: submit, status, cancel or inject")

    def _cancel(self, job: str, origin: str) -> Message:
        """One transaction with placement's commit: a queued job is cancelled in the database (and
        a placement under way then finds it so and starts nothing); a placed one is told to stop."""
        with self._lock:
            runner = self.runners.get(job)
            if runner is not None:
                runner.cancel(origin)
            elif not self.db.cancel_if_queued(job, f"cancelled by {origin} before it was placed"):
                row = self.db.job(job)
                raise ConfigError(f"no job {job[:64]!r}" if row is None else f"job {job} has {row.state}")
            else:
                self.db.event(f"cancelled by {origin} while queued", job)
        self.log(f"CLIENT  {origin} cancelled {job}")
        return make("control_reply", ok=True, message=f"job {job} cancelled")

    def _hosts(self) -> list[dict[str, Any]]:
        """Every host the service knows, with its devices out of service (the registry's)."""
        out = {r.device: r.state.value for r in self.registry.devices() if r.state not in IN_SERVICE}
        return [{**h, "out_of_service": {d: out[d] for d in h["devices"] if d in out}} for h in self.db.hosts()]

    def _to_job(self, job: str, msg: Message, origin: str) -> Message:
        """An operator command for a running job's coordinator (``Coordinator.command``); its answer."""
        with self._lock:
            runner = self.runners.get(job)
        if runner is None:
            row = self.db.job(job)
            raise ConfigError(f"no job {job[:64]!r}" if row is None else f"job {job} is not running ({row.state})")
        answer: "queue.Queue[Message]" = queue.Queue()
        runner.events.put(ev.OperatorCommand(msg, origin, answer.put, time.time()))
        try:
            return answer.get(timeout=JOB_ANSWER_S)
        except queue.Empty:
            raise ConfigError(f"job {job} did not answer within {JOB_ANSWER_S:g} s") from None

    def _submit(self, args: dict[str, Any], origin: str) -> Message:
        request = {"script": str(args["script"]), "args": [str(a) for a in args["args"]],
                   "nodes": int(args["nodes"]), "nproc_per_node": int(args["nproc_per_node"]),
                   "spares": int(args["spares"]), "run_args": [str(a) for a in args.get("run_args", [])]}
        if not 1 <= request["nodes"] <= 4096 or not 1 <= request["nproc_per_node"] <= 4096:
            raise ConfigError("--nodes and --nproc-per-node must be 1..4096")
        if len(self.db.jobs((states.QUEUED,))) >= MAX_QUEUED:
            raise ConfigError(f"{MAX_QUEUED} jobs are queued already")
        policy = policy_of(args, request["nodes"] * request["nproc_per_node"])
        if policy.elastic is not None:       # the job runs over virtual ranks and may shrink (run_config)
            request["elastic"] = policy.elastic
        from hotspare.service.checks import service_preflight
        cfg = run_config(request, self.host, self.secret_file, self.allow_inject)
        if policy.preemptible and not cfg.checkpoint.checkpoint_dir:
            raise ConfigError("--preemptible needs --checkpoint-dir (an absolute path every host and the service "
                              "see, shared storage): a job paused to lend its devices keeps its state there")
        service_preflight(cfg)               # refuse a bad job now
        with self._lock:
            job = self.db.next_job_id()
            self.db.submit(job, request, policy)
            self.db.event(f"submitted by {origin} ({policy.short()})", job)
        self.log(f"[{job}] submitted by {origin}: {request['nodes']} node(s) x {request['nproc_per_node']} + "
                 f"{request['spares']} spare(s), {policy.short()}: {request['script']}")
        self.pool_events.put(Wake())
        return make("control_reply", ok=True, message=f"submitted {job}", job=job)
