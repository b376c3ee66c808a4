"""``hotspare run``: launch a training script torchrun-style, with warm spares and failover."""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import sys
import time

from hotspare.errors import ConfigError

DESCRIPTION = """\
Run a training script on NPROC worker processes plus SPARES warm spares, torchrun-style.

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) plus hotspare's own (HOTSPARE_AGENT, HOTSPARE_WORKER_ID,
HOTSPARE_ROLE). When a worker dies, the survivors keep their memory, a warm spare takes the
lost rank, receives the training state from a healthy peer, and training continues from the
last committed step: no checkpoint reload, no lost step. The script uses hotspare.init(),
job.ddp(), job.track() and job.steps() (see examples/gpt_stdlib.py); it runs unchanged under
plain torchrun too."""

EPILOG = """\
examples:
  hotspare run --nproc 4 --spares 1 -- examples/gpt_stdlib.py --steps 200
  hotspare run --nproc 4 --spares 1 --inject kill:rank=2:step=60 --report report.json \\
      -- examples/gpt_stdlib.py --steps 200

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


MAX_DEVICES = 4096      # simulated device slots of one node: each is polled every --telemetry-period


def _finite(text: str) -> float:
    """An argparse type: a finite number (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def node_slots() -> int:
    """How many workers + spares this node holds without --oversubscribe: one per GPU, or on a
    CPU-only node four per core (they share the cores, as the test suite's 4 + 1 on 2 cores do)."""
    try:
        import torch
        gpus = torch.cuda.device_count()
    except Exception:   # noqa: BLE001 -- no usable CUDA: a CPU node
        gpus = 0
    return gpus or 4 * (os.cpu_count() or 1)


def register(sub: argparse._SubParsersAction) -> None:
    from hotspare.testing.faults.grammar import GRAMMAR
    p = sub.add_parser("run", help="launch a fault-tolerant training job (torchrun-style)",
                       description=DESCRIPTION, epilog=EPILOG.format(grammar=GRAMMAR),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=1, metavar="N",
                   help="training ranks (worker processes) to run; NPROC + SPARES may not exceed this node's "
                        "slots (one per GPU, or 4 per CPU core) without --oversubscribe (default: 1)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more workers + spares than this node's slots")
    p.add_argument("--spares", type=int, default=1, metavar="S",
                   help="warm spare processes kept ready to take over a lost rank (default: 1)")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="inject a real fault, e.g. kill:rank=2:step=60 (repeatable; grammar below)")
    p.add_argument("--allow-inject", action="store_true",
                   help="load the fault-injection plug-in (tests, drills) so that `hotspare inject` may arm "
                        "faults in this running job; implied by --inject. Without it the job refuses them")
    p.add_argument("--report", metavar="FILE", help="write a JSON report of the run here")
    p.add_argument("--log-every", type=int, default=0, metavar="K",
                   help="print a progress line every K steps (default: about 20 lines per run)")
    p.add_argument("--hang-floor", type=_finite, default=2.0, metavar="SECONDS",
                   help="a rank is hung when no step commits for max(FLOOR, FACTOR x median step "
                        "time); it is then fenced (SIGKILL) and replaced (default: 2.0)")
    p.add_argument("--hang-factor", type=_finite, default=10.0, metavar="FACTOR",
                   help="see --hang-floor (default: 10). Until the first step commits the step time "
                        "is taken to be FLOOR; a slow rank that still commits steps is never fenced")
    p.add_argument("--join-timeout", type=_finite, default=5.0, metavar="SECONDS",
                   help="time allowed to form a generation's process group; a member that dies "
                        "while it forms costs at most this long (default: 5.0)")
    g = p.add_argument_group("last resort: persistent checkpoints (read only when no copy survives in memory)")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="where to write asynchronous checkpoints (torch.distributed.checkpoint, atomic, "
                        "verified on load); also where a job stopped for lack of capacity leaves its last one")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="write a checkpoint every STEPS committed steps (needs --checkpoint-dir)")
    g.add_argument("--checkpoint-seconds", type=_finite, default=0, metavar="SECONDS",
                   help="write a checkpoint at most every SECONDS (needs --checkpoint-dir)")
    g.add_argument("--resume", metavar="DIR",
                   help="start from the newest valid checkpoint in DIR instead of step 0 (a newer one that "
                        "does not verify is refused and named in the log and the report)")
    g.add_argument("--checkpoint-key", metavar="FILE",
                   help="the secret that signs and verifies checkpoints (HMAC-SHA256); kept outside every "
                        "checkpoint directory, mode 0600, made on first use; the same file must be used to "
                        "--resume (default: $HOTSPARE_CHECKPOINT_KEY, else ~/.config/hotspare/checkpoint.key)")
    c = p.add_argument_group("capacity")
    c.add_argument("--max-replacements", type=int, default=None, metavar="N",
                   help="processes that may be started to replace lost ranks or refill the spare pool "
                        "over the job's life (default: no limit)")
    c.add_argument("--capacity-wait", type=_finite, default=60.0, metavar="SECONDS",
                   help="when a rank is lost and nothing can replace it, wait this long, then stop "
                        "cleanly after writing a last checkpoint (default: 60)")
    h = p.add_argument_group("health service (docs/HEALTH.md)")
    h.add_argument("--telemetry", choices=("auto", "nvml", "simulated", "off"), default="auto",
                   help="device telemetry: NVML on NVIDIA GPUs; 'simulated' devices on CPU machines, "
                        "driven by health --inject faults; auto picks NVML when it can read a GPU (default: auto)")
    h.add_argument("--telemetry-period", type=_finite, default=5.0, metavar="SECONDS",
                   help="how often device telemetry is polled (default: 5)")
    h.add_argument("--devices", type=int, default=None, metavar="N",
                   help="device slots on this node (simulated telemetry); each worker and spare holds one, "
                        "cordoned ones take no new work (default: NPROC + SPARES)")
    h.add_argument("--health-rules", metavar="FILE",
                   help="a rules file overriding the defaults by rule name (see docs/HEALTH.md, Rules)")
    h.add_argument("--health-db", metavar="FILE",
                   help="the device registry (lifecycle states, readings) shared with `hotspare health`; "
                        "default: $HOTSPARE_HEALTH_DB, else ~/.hotspare/health.json for real GPUs and a "
                        "file of this run only for simulated devices. Under Slurm, a cordoned device "
                        "drains its node (scontrol) until it is back in service")
    h.add_argument("--admission", choices=("off", "small", "full"), default="off",
                   help="admission checks before devices take work (inventory, burn-in against a float64 "
                        "reference, throughput vs peers, memory patterns, all-reduce bandwidth; see "
                        "`hotspare check admission`); a device that fails is quarantined and gets no "
                        "worker (default: off)")
    h.add_argument("--fingerprint-every", type=int, default=10, metavar="STEPS",
                   help="health vote every STEPS steps: the ranks compare parameter fingerprints (silent "
                        "data corruption) and agree where a live migration pauses. 1 checks every step "
                        "before its update, so a corrupt replica never reaches the others (strict; costs "
                        "one tiny all-reduce per step); with N > 1 a corruption is caught within N steps "
                        "but may reach the healthy replicas' updates first. 0: no fingerprint (votes "
                        "every 10 steps only for migrations) (default: 10)")
    p.add_argument("--local-nodes", type=int, default=1, metavar="K",
                   help="run K node agents on this host, each holding its share of the device slots, as K "
                        "hosts would: placement, spares and failover then cross agents over the same "
                        "protocol a multi-host job uses (default: 1)")
    p.add_argument("--spawn", choices=("fork", "exec"), default="fork",
                   help="how workers and spares start: fork them from a zygote process that has already "
                        "imported torch (milliseconds each instead of seconds; they are still separate "
                        "processes, each its own session), or exec a fresh interpreter for each "
                        "(default: fork)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of the rendezvous store (default: 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0,
                   help="port of the rendezvous store (default: 0, a free port)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="the secret that authenticates every control connection (node agents, workers, "
                        "`hotspare inject`): a file only you can read (chmod 600) holding at least 32 "
                        "characters, the same on every host of a job. Default: a fresh random secret for "
                        "this job, kept in memory (docs/SECURITY.md)")
    p.add_argument("script", help="the training script (a .py file)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def _validate(args: argparse.Namespace) -> list:
    from hotspare.testing.faults.grammar import parse
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1 (got {args.nproc}): it is the number of training ranks")
    if args.spares < 0:
        raise ConfigError(f"--spares must be 0 or more (got {args.spares})")
    slots = node_slots()
    if args.nproc + args.spares > slots and not args.oversubscribe:
        raise ConfigError(f"--nproc {args.nproc} + --spares {args.spares} is more than this node's {slots} "
                          "process slots (one per GPU, or 4 per CPU core): lower them, or pass --oversubscribe "
                          "if you mean it")
    if not 0 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port must be 0 (any free port) or a port 1-65535 (got {args.master_port})")
    if args.join_timeout <= 0:
        raise ConfigError("--join-timeout must be > 0 seconds")
    if args.hang_floor <= 0 or args.hang_factor < 1:
        raise ConfigError("--hang-floor must be > 0 seconds and --hang-factor >= 1")
    if (args.checkpoint_every or args.checkpoint_seconds) and not args.checkpoint_dir:
        raise ConfigError("--checkpoint-every/--checkpoint-seconds need --checkpoint-dir DIR")
    if args.checkpoint_every < 0 or args.checkpoint_seconds < 0:
        raise ConfigError("--checkpoint-every and --checkpoint-seconds must be >= 0")
    if args.max_replacements is not None and args.max_replacements < 0:
        raise ConfigError("--max-replacements must be 0 or more")
    if args.capacity_wait < 0:
        raise ConfigError("--capacity-wait must be >= 0 seconds")
    _checkpoint_config(args)
    if args.telemetry_period <= 0:
        raise ConfigError("--telemetry-period must be > 0 seconds")
    if args.fingerprint_every < 0:
        raise ConfigError("--fingerprint-every must be 0 (off) or a number of steps")
    if args.devices is not None and args.devices > MAX_DEVICES:
        raise ConfigError(f"--devices {args.devices}: at most {MAX_DEVICES} simulated device slots on one node")
    if args.devices is not None and args.devices < args.nproc + args.spares:
        raise ConfigError(f"--devices {args.devices} is fewer than --nproc + --spares = "
                          f"{args.nproc + args.spares}: every worker and spare needs a device slot")
    if args.health_rules:
        from hotspare.health.rules import load_rules
        args.rules = load_rules(args.health_rules)     # refuse a bad rules file before starting
    if args.local_nodes < 1:
        raise ConfigError(f"--local-nodes must be at least 1 (got {args.local_nodes})")
    slots = args.devices or args.nproc + args.spares
    if args.telemetry != "off" and args.local_nodes > slots:
        raise ConfigError(f"--local-nodes {args.local_nodes} is more than the {slots} device slots: "
                          "each node agent needs at least one (raise --devices)")
    if args.log_every < 0:
        raise ConfigError(f"--log-every must be 0 (automatic) or more (got {args.log_every})")
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script!r} not found: give the path of a training script, "
                          "e.g. hotspare run --nproc 4 -- examples/gpt_stdlib.py")
    if args.script_args and args.script_args[0] == "--":
        args.script_args = args.script_args[1:]
    return [parse(spec, world_size=args.nproc) for spec in args.inject]


def _checkpoint_config(args: argparse.Namespace) -> None:
    """The checkpoint directory must be usable and the key safe before anything starts; a
    --resume checkpoint is verified (MAC, file digests; nothing deserialised) and, if the newest
    does not verify, the newest older one that does is taken and named."""
    from hotspare.checkpoint import CheckpointError, key_path, load_key, newest_valid, verify, within
    args.checkpoint_fallbacks = []
    if args.checkpoint_dir:
        _usable_dir(args.checkpoint_dir)
    key = key_path(args.checkpoint_key)
    for flag, where in (("--checkpoint-dir", args.checkpoint_dir), ("--resume", args.resume)):
        if where and within(key, [where]):
            raise ConfigError(f"the checkpoint key {key} lies inside {flag} {where}: whoever can write "
                              "checkpoints there could read it; keep it elsewhere (--checkpoint-key FILE)")
    args.key_file = key
    os.environ["HOTSPARE_CHECKPOINT_KEY"] = key     # what messages name; the workers inherit it
    try:
        args.key = load_key(key)   # also signs the last checkpoint of a job that stops for capacity
    except ConfigError:
        if args.checkpoint_dir or args.resume:
            raise
        args.key = None            # no checkpoints asked for: a job without a usable key still runs
    if not args.resume:
        return
    try:
        if os.path.isfile(os.path.join(args.resume, "hotspare.json")):
            args.resume_path = verify(args.resume, args.key).path       # that one, or an error
            return
        if not os.path.isdir(args.resume):
            raise CheckpointError("the path does not exist; pass the directory the job wrote checkpoints to")
        info, refused = newest_valid(args.resume, args.key)
    except CheckpointError as e:
        raise ConfigError(f"--resume {args.resume}: {e}") from None
    if info is None:
        why = "; ".join(reason for _, reason in refused) or "it holds no complete checkpoint (step-<N> folder)"
        raise ConfigError(f"--resume {args.resume}: no valid checkpoint: {why}")
    args.resume_path = info.path
    for path, reason in refused:
        args.checkpoint_fallbacks.append({"refused": path, "reason": reason, "used": info.path, "step": info.step})


def _usable_dir(path: str) -> None:
    """Refuse a --checkpoint-dir that is a file, cannot be made, or cannot be written."""
    import tempfile
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--checkpoint-dir {path} is not a directory: name a directory (it is made if "
                          "missing)")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hotspare-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {path} cannot be written ({e.strerror or e}): choose a writable "
                          "directory") from None


def run(args: argparse.Namespace) -> int:
    try:
        faults = _validate(args)
    except ConfigError as e:
        print(f"hotspare run: error: {e}", file=sys.stderr)
        return 2

    from hotspare.coordinator import Coordinator, Ledger
    from hotspare.coordinator.nodes import NodeEndpoint, Nodes
    from hotspare.policy.decide import ClusterView

    t0 = time.time()

    def log(line: str) -> None:
        print(f"[hotspare {time.time() - t0:7.2f}s] {line}", flush=True)

    from hotspare.pg.bound_store import master_store
    from hotspare.protocol import auth
    try:
        secret = auth.load_secret(args.secret_file) if args.secret_file else auth.new_secret()
    except ConfigError as e:
        print(f"hotspare run: error: {e}", file=sys.stderr)
        return 2
    # The launcher hosts the rendezvous store, so it outlives any worker; on --master-addr only.
    store = master_store(args.master_addr, args.master_port)
    env = dict(os.environ)
    env.update(WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR=args.master_addr,
               MASTER_PORT=str(store.port), ROLE_WORLD_SIZE=str(args.nproc), GROUP_WORLD_SIZE="1", GROUP_RANK="0",
               TORCHELASTIC_RUN_ID="hotspare", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HOTSPARE_JOIN_TIMEOUT"] = str(args.join_timeout)
    checkpoint_dir = os.path.abspath(args.checkpoint_dir or "hotspare-checkpoints")
    # Workers write (and restore) only inside these, signed with the key file named here.
    env.update(HOTSPARE_CHECKPOINT_DIR=checkpoint_dir, HOTSPARE_CHECKPOINT_KEY=args.key_file)
    if args.checkpoint_dir:
        env.update(HOTSPARE_CHECKPOINT_EVERY=str(args.checkpoint_every),
                   HOTSPARE_CHECKPOINT_SECONDS=str(args.checkpoint_seconds))
    if args.resume:
        env["HOTSPARE_RESUME_DIR"] = os.path.abspath(args.resume)
    env["HOTSPARE_FINGERPRINT_EVERY"] = str(args.fingerprint_every)
    events: queue.Queue = queue.Queue()
    try:
        health, source, poller = _health_service(args, events, log)
    except ConfigError as e:
        print(f"hotspare run: error: {e}", file=sys.stderr)
        return 2
    settings = {"script": args.script, "args": args.script_args, "nproc": args.nproc,
                "spares": args.spares, "inject": [str(f) for f in faults],
                "checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
                "resume": args.resume, "hang_floor_s": args.hang_floor, "hang_factor": args.hang_factor}
    ledger = Ledger(settings)
    ledger.checkpoint_fallbacks.extend(args.checkpoint_fallbacks)
    view = ClusterView(world_size=args.nproc, target_spares=args.spares,
                       resume=getattr(args, "resume_path", None), replacements_left=args.max_replacements,
                       capacity_wait=args.capacity_wait)
    # Fault injection is a testing plug-in, loaded only when asked for (hotspare.testing.faults).
    injecting = bool(faults) or args.allow_inject
    plugins = []
    if injecting:
        from hotspare.testing.faults import CoordinatorFaults
        plugins.append(CoordinatorFaults(faults))
    coord = Coordinator(Nodes(usable=health.usable if health else (lambda d: True)), events, view, ledger,
                        log=log, log_every=args.log_every or 0,
                        hang_floor=args.hang_floor, hang_factor=args.hang_factor,
                        join_timeout=args.join_timeout,
                        checkpoint_dir=checkpoint_dir, health=health, plugins=plugins,
                        checkpoint_key=args.key)
    # This host's node agents talk to the coordinator over TCP, as remote agents would.
    endpoint = NodeEndpoint(events, secret, owner=coord.nodes.owner)
    agents = _agents(args, env, endpoint.address, secret, health.devices if health else None,
                     _device_fault(source, log) if source is not None else None, injecting)
    log(f"job: {args.nproc} rank(s) + {args.spares} warm spare(s): {' '.join([args.script, *args.script_args])}")
    for note in args.checkpoint_fallbacks:
        log(f"CHECKPOINT refused {note['refused']}: {note['reason']}")
    if args.checkpoint_fallbacks:
        log(f"CHECKPOINT --resume falls back to the older checkpoint of step {args.checkpoint_fallbacks[0]['step']} "
            f"({args.resume_path})")
    forked = all(agent.zygote is not None for agent in agents)
    log("spawn: workers and spares fork from a zygote that imported torch once (--spawn exec: fresh "
        "interpreters)" if forked else "spawn: each worker and spare starts as a fresh interpreter")
    from hotspare.coordinator.control import ControlServer
    control = ControlServer(events, secret, describe={"script": args.script, "nproc": args.nproc})
    log(f"control: {control.address}" + (" (hotspare inject SPEC sends a fault to this job)" if injecting
                                          else " (faults refused: no --allow-inject)"))
    try:
        coord.start(nodes=len(agents))
    except ConfigError as e:
        control.close()
        print(f"hotspare run: error: {e}", file=sys.stderr)
        coord.stop_nodes(grace=0.0)
        for agent in agents:
            agent.close()
        endpoint.close()
        return 2
    if poller is not None:
        poller.start()
    stop_signals = _StopSignals(events, graceful=bool(args.checkpoint_dir))
    try:
        code = coord.run()
    except (KeyboardInterrupt, _Interrupted) as e:
        signame, code = (e.signame, e.code) if isinstance(e, _Interrupted) else ("SIGINT", 130)
        what = "interrupted by the user" if signame == "SIGINT" else f"terminated by {signame}"
        extra = "" if args.checkpoint_dir else " (no --checkpoint-dir: no last checkpoint was written)"
        ledger.outcome, ledger.message = "interrupted", f"{what}{extra}"
    finally:
        stop_signals.ignore_term()
        if poller is not None:
            poller.stop()
        control.close()
        # Released workers end by themselves (barrier, os._exit); after Ctrl-C nobody told them to.
        coord.stop_nodes(grace={"interrupted": 0.0, "preempted": 5.0}.get(ledger.outcome, 10.0))
        for agent in agents:
            agent.close()
        endpoint.close()
    if health is not None:    # after Ctrl-C or SIGTERM, running diagnostics stop at once (the device stays quarantined)
        health.close(cancel=ledger.outcome in ("interrupted", "preempted"))
        ledger.devices = [{"device": r.device, "state": r.state.value, "reason": r.reason}
                          for r in health.registry.devices() if r.device in health.devices]
    ledger.nodes = coord.nodes.describe()
    report = ledger.report()
    _summary(log, report, code)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
        log(f"report written to {args.report}")
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


def _agents(args, env: dict[str, str], coordinator: str, secret: bytes, devices: list[str] | None,
            device_fault, injecting: bool) -> list:
    """The node agents of this host: one, or ``--local-nodes`` K, each with a contiguous share
    of the device slots; with the fault plug-in when ``injecting`` (``device_fault``: how it
    drives the simulated telemetry)."""
    import socket

    from hotspare.agent import NodeAgent
    cmd = [sys.executable, args.script, *args.script_args]
    k = args.local_nodes
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
        agents.append(NodeAgent(cmd, node_env, coordinator=coordinator, secret=secret,
                                node=host if k == 1 else f"{host}-{i}",
                                devices=share, spawn=args.spawn, faults=faults))
    return agents


def _health_service(args, events: "queue.Queue", log):
    """The telemetry source, its poller (feeding the coordinator's queue) and the monitor."""
    if args.telemetry == "off":
        return None, None, None
    import tempfile

    from hotspare.coordinator.health import HealthMonitor
    from hotspare.health.registry import ENV_PATH, Registry
    from hotspare.health.rules import load_rules
    from hotspare.health.telemetry import NvmlSource, Poller, SimulatedSource

    slots = args.devices or args.nproc + args.spares
    if args.telemetry in ("auto", "nvml"):
        source = NvmlSource()
        ok, why = source.status()
        if not ok:
            if args.telemetry == "nvml":
                raise SystemExit(f"hotspare run: error: --telemetry nvml: {why}")
            source = SimulatedSource(slots)
            source.fallback_reason = why
    else:
        source = SimulatedSource(slots)
    devices = source.devices()[:slots] if source.name == "simulated" else source.devices()
    db = args.health_db or os.environ.get(ENV_PATH)
    if db is None and source.name == "simulated":   # simulated devices are this run's own
        db = os.path.join(tempfile.mkdtemp(prefix="hotspare-health-"), "health.json")
    registry = Registry(db, slurm="auto")             # real devices: the node's shared registry
    db = str(registry.path)
    rules = getattr(args, "rules", None) or load_rules()

    def reset(device: str) -> None:        # what a GPU reset does to the simulated device
        if isinstance(source, SimulatedSource):
            source.clear(device)

    def diagnose(device: str, stop) -> tuple[bool, str]:
        from hotspare.coordinator.health import diagnose_device
        return diagnose_device(device, source, rules, stop=stop)

    monitor = HealthMonitor(rules, registry, devices, log=log, diagnose=diagnose, reset=reset)
    if args.admission != "off":
        _admit(args.admission, devices, registry, log)
    from hotspare.coordinator.events import Readings
    poller = Poller(source, lambda readings: events.put(Readings(readings, time.time())),
                    period_s=args.telemetry_period)
    log(f"health: telemetry {source.status()[1]}; rules {', '.join(rules.sources)}; device registry {db} "
        f"(hotspare health --db {db})")
    return monitor, source, poller


def _admit(size: str, devices: list[str], registry, log) -> None:
    """Admission checks of this node's devices; a failing one is quarantined before any work."""
    from hotspare.health.checks.admission import run_admission
    from hotspare.health.types import node_of
    kind = "gpu" if "/gpu" in devices[0] else "cpu"
    log(f"ADMISSION {len(devices)} {kind} device(s), size {size}")
    try:
        reports = run_admission(len(devices), size=size, kind=kind, node=node_of(devices[0]),
                                progress=lambda line: None)
    except ConfigError as e:
        raise ConfigError(f"--admission: {e}") from None
    for report in reports:
        if report.passed:
            log(f"ADMISSION {report.device}: pass")
        else:
            reason = "; ".join(report.reasons)
            registry.quarantine(report.device, f"failed admission: {reason}", actor="rule:admission")
            log(f"ADMISSION {report.device}: FAIL ({reason}): quarantined, it gets no work")


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
    else:
        log(f"job stopped after {report['steps_completed']} committed steps ({n} failure(s)): "
            f"{report['message'].splitlines()[0] if report['message'] else 'see above'}")
