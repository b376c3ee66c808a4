"""``hotspare run``: launch a training script torchrun-style, with warm spares and failover."""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import time

from hotspare.config.preflight import Preflight, preflight
from hotspare.config import RunConfig, add_arguments, from_namespace
from hotspare.errors import ConfigError
from hotspare.protocol.workerenv import without_contract
from hotspare.service.build import control_plane, injecting, job_env

DESCRIPTION = """\
Run a training script on NPROC worker processes plus SPARES warm spares, torchrun-style.

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) plus hotspare's own (HOTSPARE_AGENT, HOTSPARE_WORKER_ID,
HOTSPARE_ROLE, HOTSPARE_BACKEND, ...; docs/CONFIG.md lists every flag and variable). When a
worker dies, the survivors keep their memory, a warm spare takes the lost rank, receives the
training state from a healthy peer, and training continues from the last committed step: no
checkpoint reload, no lost step. The script uses hotspare.init(), job.ddp(), job.track() and
job.steps() (see examples/gpt_stdlib.py); it runs unchanged under plain torchrun too."""

EPILOG = """\
examples:
  hotspare run --nproc 4 --spares 1 -- examples/gpt_stdlib.py --steps 200
  hotspare run --nproc 4 --spares 1 --inject kill:rank=2:step=60 --report report.json \\
      -- examples/gpt_stdlib.py --steps 200
  hotspare run --nproc 8 --spares 1 --backend nccl --checkpoint-dir ckpts --checkpoint-every 500 \\
      -- train.py

{grammar}

checkpoints are signed: each holds the sha256 of its every file and an HMAC-SHA256 under the key
in --checkpoint-key FILE (default $HOTSPARE_CHECKPOINT_KEY, else ~/.config/hotspare/checkpoint.key,
made 0600 on first use; refused when group or others can read it; never inside a checkpoint
directory). A checkpoint that does not verify is never read: the job falls back to the newest
one that does and says so (docs/CHECKPOINTS.md).

signals: SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) with --checkpoint-dir: every rank
leaves its step, the lowest survivor writes a last checkpoint from memory, the report is
written, and the launcher exits 143 (SIGTERM) or 130 (SIGINT) within about 20 s plus the
workers' shutdown. Without --checkpoint-dir, or on a second signal, it stops at once.

exit status: 0 when training finished; 1 when the job stopped (the last line says why);
2 for bad command-line input; 143 / 130 after SIGTERM / SIGINT."""


def register(sub: argparse._SubParsersAction) -> None:
    from hotspare.config.preflight import injection
    p = sub.add_parser("run", help="launch a fault-tolerant training job (torchrun-style)",
                       description=DESCRIPTION, epilog=EPILOG.format(grammar=injection().GRAMMAR),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, RunConfig)       # every flag is declared once, in hotspare/config/run.py
    from hotspare.observe.wiring import add_observe_arguments
    add_observe_arguments(p)          # --metrics, --events, --dashboard (docs/OBSERVABILITY.md)
    p.set_defaults(func=run)


def _fail(e: ConfigError) -> int:
    print(f"hotspare run: error: {e}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, *, zygote=None) -> int:
    """``hotspare run``. ``zygote``: a running ``agent.zygote.Zygote`` the agents fork workers
    from (the in-process test harness's, shared by its jobs), instead of starting their own."""
    try:
        cfg = from_namespace(RunConfig, args)
        from hotspare.observe.wiring import check_observe_arguments
        check_observe_arguments(args)
        pre = preflight(cfg)
    except ConfigError as e:
        return _fail(e)
    from hotspare.checkpoint.auth import ENV_KEY
    os.environ[ENV_KEY] = pre.key_file     # what this process's messages name (hotspare.checkpoint.auth)

    from hotspare.coordinator.nodes import NodeEndpoint

    t0 = time.time()

    def log(line: str) -> None:
        print(f"[hotspare {time.time() - t0:7.2f}s] {line}", flush=True)

    from hotspare.pg.bound_store import master_store
    from hotspare.protocol import auth
    launch = cfg.launch
    try:
        secret = auth.load_secret(launch.secret_file) if launch.secret_file else auth.new_secret()
    except ConfigError as e:
        return _fail(e)
    # The launcher hosts the rendezvous store, so it outlives any worker; on --master-addr only.
    store = master_store(cfg.store_addr, launch.master_port)
    # The workers inherit this environment, less any stale worker contract, plus torchrun's
    # variables and the job's part of the contract (the agents add each worker's own part).
    env = without_contract(os.environ)
    env.update(WORLD_SIZE=str(launch.nproc), LOCAL_WORLD_SIZE=str(launch.nproc), MASTER_ADDR=cfg.store_addr,
               MASTER_PORT=str(store.port), ROLE_WORLD_SIZE=str(launch.nproc), GROUP_WORLD_SIZE="1", GROUP_RANK="0",
               TORCHELASTIC_RUN_ID="hotspare", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(job_env(cfg, pre).to_env())
    events: queue.Queue = queue.Queue()
    try:
        health, source, poller, reconciler = _health_service(cfg, pre, events, log)
    except ConfigError as e:
        return _fail(e)
    ledger, coord = control_plane(cfg, pre, events, health, log)
    from hotspare.observe.wiring import observe
    try:
        watch = observe(args, cfg.launch.report, coord, ledger, health, log, secret)
    except ConfigError as e:
        return _fail(e)
    # This host's node agents talk to the coordinator in-process (protocol/local.py): no port.
    # Remote agents connect to the --listen endpoint (below).
    endpoint = NodeEndpoint(events, secret, owner=coord.nodes.owner, listen=False)
    agents = _agents(cfg, env, endpoint, secret, health.devices if health else None,
                     _device_fault(source, log) if source is not None else None, injecting(cfg), zygote)
    remote = _remote_endpoint(cfg, env, events, secret, coord, log)
    log(f"job: {launch.nproc} rank(s) + {cfg.capacity.spares} warm spare(s): "
        f"{' '.join([cfg.script, *cfg.script_args])}")
    for note in pre.fallbacks:
        log(f"CHECKPOINT refused {note['refused']}: {note['reason']}")
    if pre.fallbacks:
        log(f"CHECKPOINT --resume falls back to the older checkpoint of step {pre.fallbacks[0]['step']} "
            f"({pre.resume_path})")
    forked = all(agent.zygote is not None for agent in agents)
    log("spawn: workers and spares fork from a zygote that imported torch once (--spawn exec: fresh "
        "interpreters)" if forked else "spawn: each worker and spare starts as a fresh interpreter")
    from hotspare.coordinator.control import ControlServer
    control = ControlServer(events, secret, describe={"script": cfg.script, "nproc": launch.nproc})
    log(f"control: {control.address}" + (" (hotspare inject SPEC sends a fault to this job)" if injecting(cfg)
                                          else " (faults refused: no --allow-inject)"))
    try:
        coord.start(nodes=len(agents) + cfg.hosts.remote_nodes, timeout=REMOTE_WAIT_S if remote else 30.0)
    except ConfigError as e:
        control.close()
        print(f"hotspare run: error: {e}", file=sys.stderr)
        coord.stop_nodes(grace=0.0)
        for agent in agents:
            agent.close()
        endpoint.close()
        if remote is not None:
            remote.close()
        if watch is not None:
            watch.close(2, ledger.report())
        return 2
    if poller is not None:
        poller.start()
    if reconciler is not None:
        reconciler.start(log=log)
    graceful = bool(cfg.checkpoint.checkpoint_dir)
    stop_signals = _StopSignals(events, graceful=graceful)
    try:
        code = coord.run()
    except (KeyboardInterrupt, _Interrupted) as e:
        signame, code = (e.signame, e.code) if isinstance(e, _Interrupted) else ("SIGINT", 130)
        what = "interrupted by the user" if signame == "SIGINT" else f"terminated by {signame}"
        extra = "" if graceful else " (no --checkpoint-dir: no last checkpoint was written)"
        ledger.outcome, ledger.message = "interrupted", f"{what}{extra}"
    finally:
        stop_signals.ignore_term()
        if poller is not None:
            poller.stop()
        control.close()
        # Device checks still running on the nodes finish first, unless the job was cut short.
        coord.finish_checks(0.0 if ledger.outcome in ("interrupted", "preempted") else 30.0)
        # Released workers end by themselves (barrier, os._exit); after Ctrl-C nobody told them to.
        coord.stop_nodes(grace={"interrupted": 0.0, "preempted": 5.0}.get(ledger.outcome, 10.0))
        for agent in agents:
            agent.close()
        endpoint.close()
        if remote is not None:
            remote.close()
        if reconciler is not None:       # the job's last registry changes reach Slurm
            reconciler.stop(log=log)
    if health is not None:    # after Ctrl-C or SIGTERM, running diagnostics stopped at once (the device stays quarantined)
        ledger.devices = [{"device": r.device, "state": r.state.value, "reason": r.reason}
                          for r in health.registry.devices() if r.device in health.devices]
    ledger.nodes = coord.nodes.describe()
    report = ledger.report()
    if watch is not None:
        watch.close(code, report)     # the stream's last records; /metrics stops
    _summary(log, report, code)
    if cfg.launch.report:
        with open(cfg.launch.report, "w") as f:
            json.dump(report, f, indent=2)
        log(f"report written to {cfg.launch.report}")
    return code


class _Interrupted(Exception):
    def __init__(self, signame: str, code: int):
        super().__init__(signame)
        self.signame, self.code = signame, code


class _StopSignals:
    """SIGTERM and SIGINT while the job runs: with a checkpoint directory the first one becomes
    a "preempt" event (the coordinator has a survivor write a last checkpoint, then stops);
    without one, or the second time, the launcher stops at once (``_Interrupted``)."""

    def __init__(self, events: "queue.Queue", graceful: bool):
        self.events, self.graceful, self.seen = events, graceful, False
        from hotspare.coordinator.events import Preempt
        self._preempt = Preempt       # imported here, never inside the signal handler
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        name, code = signal.Signals(signum).name, 128 + signum
        if self.graceful and not self.seen:
            self.seen = True
            self.events.put(self._preempt(name, code, time.time()))
            return
        raise _Interrupted(name, code)

    def ignore_term(self) -> None:
        """While the job winds down: SIGTERM waits for the report, Ctrl-C still interrupts."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _agents(cfg: RunConfig, env: dict[str, str], endpoint, secret: bytes, devices: list[str] | None,
            device_fault, injecting: bool, zygote=None) -> list:
    """The node agents of this host: one, or ``--local-nodes`` K, each with a contiguous share
    of the device slots; with the fault plug-in when ``injecting`` (``device_fault``: how it
    drives the simulated telemetry)."""
    import socket

    from hotspare.agent import NodeAgent
    from hotspare.protocol.local import local_pair
    from hotspare.protocol.messages import make
    cmd = [sys.executable, cfg.script, *cfg.script_args]
    k = cfg.local_nodes
    host = socket.gethostname()
    agents = []
    for i in range(k):
        share = None if devices is None else devices[len(devices) * i // k: len(devices) * (i + 1) // k]
        node_env = dict(env)
        if k > 1:       # torchrun's view of a node: its index among the nodes, and its own size
            node_env.update(GROUP_RANK=str(i), GROUP_WORLD_SIZE=str(k))
            if share:
                node_env["LOCAL_WORLD_SIZE"] = str(len(share))
        faults = None
        if injecting:
            from hotspare.testing.faults import AgentFaults
            faults = AgentFaults(device_fault)
        node = host if k == 1 else f"{host}-{i}"
        mine, theirs = local_pair(node)
        agents.append(NodeAgent(cmd, node_env, coordinator=endpoint.address, secret=secret, node=node,
                                devices=share, spawn=cfg.launch.spawn, faults=faults, uplink=mine,
                                zygote=zygote if cfg.launch.spawn == "fork" else None))
        endpoint.attach(theirs, make("agent_hello", node=node, pid=os.getpid(), devices=list(share or []),
                                     device_faults=faults is not None and faults.device_faults, proof=""))
    return agents


REMOTE_WAIT_S = 120.0     # remote agents may be started by hand after the launcher
def _remote_endpoint(cfg: RunConfig, env: dict[str, str], events: "queue.Queue", secret: bytes, coord, log):
    """The --listen endpoint for `hotspare agent` on other hosts (None without --listen)."""
    if cfg.hosts.listen is None:
        return None
    from hotspare.config.run import host_port
    from hotspare.coordinator.remote import remote_endpoint
    from hotspare.service.build import remote_job_env
    h = cfg.hosts
    job = remote_job_env(env)
    host, port = host_port(h.listen)
    period = cfg.health.telemetry_period if cfg.health.telemetry != "off" else 0.0
    remote = remote_endpoint(events, secret, coord.nodes.owner, host, port, h.node_lease, h.lease_margin,
                             os.path.abspath(cfg.script), list(cfg.script_args), job, log, telemetry_period=period)
    log(f"nodes: waiting for {h.remote_nodes} remote agent(s) on {remote.address} (hotspare agent "
        f"--coordinator {remote.address} --secret-file FILE); node lease {h.node_lease:g} s + margin "
        f"{h.lease_margin:g} s; rendezvous store on {cfg.store_addr}")
    return remote


def _health_service(cfg: RunConfig, pre: Preflight, events: "queue.Queue", log):
    """The health desk, the telemetry source of this host's node agents and its poller (feeding
    the coordinator's queue; None without local node agents) and the Slurm reconciler (None
    where Slurm is off). Remote hosts' devices join the desk as their agents connect; each agent
    polls its own host and sends the readings up (hotspare.agent.telemetry)."""
    h = cfg.health
    if h.telemetry == "off":
        return None, None, None, None
    import tempfile

    from hotspare.health.registry import ENV_PATH, Registry
    from hotspare.health.telemetry import NvmlSource, Poller, SimulatedSource
    from hotspare.service.build import health_desk

    slots, remote = cfg.slots, bool(cfg.hosts.remote_nodes)
    source = None
    if not cfg.local_nodes:
        pass                        # no node agent here: every device is a remote host's
    elif h.telemetry in ("auto", "nvml"):
        source = NvmlSource()
        ok, why = source.status()
        if not ok:
            if h.telemetry == "nvml":
                raise SystemExit(f"hotspare run: error: --telemetry nvml: {why}")
            source = SimulatedSource(slots)
            source.fallback_reason = why
    else:
        source = SimulatedSource(slots)
    devices = [] if source is None else source.devices()[:slots] if source.name == "simulated" else source.devices()
    db = h.health_db or os.environ.get(ENV_PATH)
    if db is None and (source is None or source.name == "simulated"):   # simulated devices are this run's own
        db = os.path.join(tempfile.mkdtemp(prefix="hotspare-health-"), "health.json")
    registry = Registry(db)             # real devices: the node's shared registry
    db = str(registry.path)
    # Slurm follows the registry (drain a node with a device out of service): reconciled in the
    # background, outside the registry's lock, within a second of a change and every 30 s.
    from hotspare.health.reconcile import SlurmReconciler
    from hotspare.health.slurm import mode_from_env
    reconciler = SlurmReconciler.from_mode(registry, mode_from_env())

    def reset(device: str) -> None:        # what a GPU reset does to the simulated device
        if isinstance(source, SimulatedSource):
            source.clear(device)

    # Admission and quarantine diagnostics run on the node agents (hotspare.agent.checks).
    monitor = health_desk(cfg, pre, registry, log, devices, poll=source.poll if source is not None else None,
                          reset=reset, adopt=remote)
    from hotspare.coordinator.events import Readings
    poller = None if source is None else Poller(source, lambda readings: events.put(Readings(readings, time.time())),
                                                period_s=h.telemetry_period)
    here = f"telemetry {source.status()[1]}" if source is not None else "no node agent on this host"
    if remote:
        here += (f"; remote hosts: each agent polls its own devices every {h.telemetry_period:g} s and runs their "
                 "admission and quarantine checks")
        if not (h.health_db or os.environ.get(ENV_PATH)):
            here += " (this run's registry only: --health-db FILE keeps their record across jobs)"
    log(f"health: {here}; rules {', '.join(monitor.rules.sources)}; device registry {db} (hotspare health --db {db})")
    return monitor, source, poller, reconciler


def _device_fault(source, log):
    def apply(device: str, fault) -> None:
        if not hasattr(source, "apply"):
            log(f"FAULT   {fault}: the {source.name} telemetry of {device} cannot be driven; ignored")
            return
        source.apply(device, fault.kind, **fault.params)
    return apply


def _summary(log, report: dict, code: int) -> None:
    n = report["failures_total"]
    share = report["zero_loss_share"]
    if code == 0:
        digest = report["final_state_digest"] or "replicas DIFFER"
        log(f"done: {report['steps_completed']} steps in {report['wall_time_s']:.1f} s, "
            f"median step {1000 * (report['median_step_time_s'] or 0):.0f} ms, {n} failure(s), "
            f"recovered with zero lost steps: {report['recovered_zero_loss']}/{n}"
            + (f" ({100 * share:.0f}%)" if share is not None else "")
            + f", from checkpoint: {report['recovered_from_checkpoint']} ({report['steps_lost']} steps "
              f"recomputed), steps repeated {report['steps_repeated']}, final digest {digest[:16]}")
        for c in report.get("caveats") or ():
            log(f"CAVEAT  the recovery of rank {c['rank']} at step {c['step']} may not be bitwise exact: {c['detail']}")
    else:
        log(f"job stopped after {report['steps_completed']} committed steps ({n} failure(s)): "
            f"{report['message'].splitlines()[0] if report['message'] else 'see above'}")
