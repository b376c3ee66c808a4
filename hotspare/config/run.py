"""The configuration of ``hotspare run``: every flag declared once, here.

``RunConfig`` nests one section per concern; each field is a flag (``hotspare.config.schema``),
so the parser, its ``--help`` and docs/CONFIG.md are generated from these declarations and a
config built in code is checked as one parsed from flags. The checks here are pure: what
needs the host (its slots, CUDA, the script, the checkpoint key, a rules file) is checked by
``hotspare.config.preflight`` before anything starts.
"""
from __future__ import annotations

import dataclasses

from hotspare.config.schema import Section, finite, option, section
from hotspare.errors import ConfigError
from hotspare.protocol.workerenv import BACKENDS

MAX_DEVICES = 4096      # simulated device slots of one node: each is polled every --telemetry-period
_KW = {"frozen": True, "kw_only": True}


@dataclasses.dataclass(**_KW)
class LaunchConfig(Section):
    TITLE = None
    nproc: int = option(1, flags=("--nproc", "--nproc-per-node"), parse=int, metavar="N", at_least=1,
                        why=": it is the number of training ranks",
                        help="training ranks (worker processes) to run; NPROC + SPARES may not exceed this "
                             "node's slots (one per GPU, or 4 per CPU core) without --oversubscribe")
    oversubscribe: bool = option(kind="switch", help="allow more workers + spares than this node's slots")
    backend: str = option("gloo", choices=BACKENDS,
                          help="the process-group backend of every generation, passed to the workers "
                               "(HOTSPARE_BACKEND): gloo, or nccl for CUDA tensors (only where "
                               "torch.cuda.is_available())")
    local_nodes: int | None = option(None, parse=int, metavar="K", at_least=0,
                              default_text="1, or 0 with --remote-nodes",
                              help="run K node agents on this host, each holding its share of the device "
                                   "slots, as K hosts would: placement, spares and failover then cross agents "
                                   "over the same protocol a multi-host job uses")
    spawn: str = option("fork", choices=("fork", "exec"),
                        help="how workers and spares start: fork them from a zygote process that has already "
                             "imported torch (milliseconds each instead of seconds; they are still separate "
                             "processes, each its own session), or exec a fresh interpreter for each")
    master_addr: str | None = option(None, default_text="127.0.0.1, or the --listen address",
                                     help="address the rendezvous store listens on (and the workers reach it at)")
    master_port: int = option(0, parse=int, default_text="0, a free port", help="port of the rendezvous store")
    secret_file: str | None = option(None, metavar="FILE", default_text="a fresh random secret for this job, "
                                     "kept in memory (docs/SECURITY.md)",
                                     help="the secret that authenticates every control connection (node "
                                          "agents, workers, `hotspare inject`): a file only you can read "
                                          "(chmod 600) holding at least 32 characters, the same on every "
                                          "host of a job")
    report: str | None = option(None, metavar="FILE", help="write a JSON report of the run here")
    log_every: int = option(0, parse=int, metavar="K", at_least=0, default_text="0, about 20 lines per run",
                            help="print a progress line every K steps")

    def validate(self) -> None:
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be 0 (any free port) or a port 1-65535 (got {self.master_port})")


def host_port(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (``[v6]:PORT`` for IPv6) -> (addr, port)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{text!r} is not ADDR:PORT (e.g. 10.0.0.1:29400)")
    return host, int(port)


@dataclasses.dataclass(**_KW)
class HostsConfig(Section):
    TITLE = "many hosts: remote node agents (docs/DEPLOY.md)"
    listen: str | None = option(None, metavar="ADDR:PORT",
                                help="listen here for `hotspare agent --coordinator ADDR:PORT` of other hosts "
                                     "(an address of this host on the job's private network, not 0.0.0.0); "
                                     "the rendezvous store listens on the same address")
    remote_nodes: int = option(0, parse=int, metavar="K", at_least=0,
                               help="wait for K remote node agents (needs --listen and --secret-file) before "
                                    "placing ranks and spares on them")
    node_lease: float = option(3.0, parse=finite, metavar="SECONDS", above=0, at_most=3600,
                               help="the lease of a remote node (its agent renews it 6 times per lease): one whose "
                                    "renewals stop is declared lost after SECONDS + --lease-margin, its ranks failed over to "
                                    "spares elsewhere; its agent kills its own workers after SECONDS (self-"
                                    "fencing). A node whose link closes is lost at once")
    lease_margin: float = option(1.0, parse=finite, metavar="SECONDS", at_least=0,
                                 help="how much longer than the lease the launcher waits before declaring a node "
                                      "lost: time for the cut-off agent to have fenced its workers")

    def validate(self) -> None:
        if self.listen is not None:
            host, _ = host_port(self.listen)
            if host in ("0.0.0.0", "::", ""):
                raise ConfigError(f"--listen {self.listen}: give this host's address on the job's private "
                                  "network, not a wildcard (the rendezvous store is not authenticated)")
        if self.remote_nodes and self.listen is None:
            raise ConfigError("--remote-nodes needs --listen ADDR:PORT for their agents to connect to")


@dataclasses.dataclass(**_KW)
class FaultConfig(Section):
    TITLE = "fault injection (testing; the grammar is below)"
    inject: tuple[str, ...] = option(kind="append", metavar="SPEC",
                                     help="inject a real fault, e.g. kill:rank=2:step=60 (repeatable)")
    allow_inject: bool = option(False, kind="switch",
                                help="load the fault-injection plug-in (tests, drills) so that `hotspare inject` "
                                     "may arm faults in this running job; implied by --inject. Without it the "
                                     "job refuses them")


@dataclasses.dataclass(**_KW)
class CapacityConfig(Section):
    TITLE = "spares and capacity"
    spares: int = option(1, parse=int, metavar="S", at_least=0,
                         help="warm spare processes kept ready to take over a lost rank")
    max_replacements: int | None = option(None, parse=int, metavar="N", at_least=0, default_text="no limit",
                                          help="processes that may be started to replace lost ranks or refill "
                                               "the spare pool over the job's life")
    capacity_wait: float = option(60.0, parse=finite, metavar="SECONDS", at_least=0,
                                  help="when a rank is lost and nothing can replace it, wait this long, then "
                                       "stop cleanly after writing a last checkpoint")
    elastic: int | None = option(None, parse=int, metavar="MIN", at_least=1, default_text="not elastic",
                                 help="a script over job.virtual_ranks may shrink to MIN ranks: a lost rank with "
                                      "no ready spare hands its virtual ranks to the survivors (same samples, same "
                                      "global batch, bitwise), and the job grows back when a spare is ready "
                                      "(docs/CONTRACT.md, Elastic jobs)")


@dataclasses.dataclass(**_KW)
class HangConfig(Section):
    TITLE = "hang detection and group formation"
    hang_floor: float = option(2.0, parse=finite, metavar="SECONDS", above=0,
                               help="a rank is hung when no step commits for max(FLOOR, FACTOR x median step "
                                    "time); it is then fenced (SIGKILL) and replaced")
    hang_factor: float = option(10.0, parse=finite, metavar="FACTOR", at_least=1,
                                help="see --hang-floor. Until the first step commits the step time is taken to "
                                     "be FLOOR; a slow rank that still commits steps is never fenced")
    join_timeout: float = option(5.0, parse=finite, metavar="SECONDS", above=0,
                                 help="time allowed to form a generation's process group; a member that dies "
                                      "while it forms costs at most this long")


@dataclasses.dataclass(**_KW)
class CheckpointConfig(Section):
    TITLE = "last resort: persistent checkpoints (read only when no copy survives in memory)"
    checkpoint_dir: str | None = option(None, metavar="DIR",
                                        help="where to write asynchronous checkpoints (torch.distributed."
                                             "checkpoint, atomic, verified on load); also where a job stopped "
                                             "for lack of capacity leaves its last one")
    checkpoint_every: int = option(0, parse=int, metavar="STEPS", at_least=0,
                                   help="write a checkpoint every STEPS committed steps (needs --checkpoint-dir)")
    checkpoint_seconds: float = option(0.0, parse=finite, metavar="SECONDS", at_least=0,
                                       help="write a checkpoint at most every SECONDS (needs --checkpoint-dir)")
    resume: str | None = option(None, metavar="DIR",
                                help="start from the newest valid checkpoint in DIR instead of step 0 (a newer "
                                     "one that does not verify is refused and named in the log and the report)")
    checkpoint_key: str | None = option(None, metavar="FILE",
                                        default_text="$HOTSPARE_CHECKPOINT_KEY, else "
                                                     "~/.config/hotspare/checkpoint.key",
                                        help="the secret that signs and verifies checkpoints (HMAC-SHA256); kept "
                                             "outside every checkpoint directory, mode 0600, made on first use; "
                                             "the same file must be used to --resume")

    def validate(self) -> None:
        if (self.checkpoint_every or self.checkpoint_seconds) and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every/--checkpoint-seconds need --checkpoint-dir DIR")


@dataclasses.dataclass(**_KW)
class HealthConfig(Section):
    TITLE = "health service (docs/HEALTH.md)"
    telemetry: str = option("auto", choices=("auto", "nvml", "simulated", "off"),
                            help="device telemetry: NVML on NVIDIA GPUs; 'simulated' devices on CPU machines, "
                                 "driven by health --inject faults; auto picks NVML when it can read a GPU")
    telemetry_period: float = option(5.0, parse=finite, metavar="SECONDS", above=0,
                                     help="how often device telemetry is polled")
    devices: int | None = option(None, parse=int, metavar="N", at_least=1, default_text="NPROC + SPARES",
                                 help="device slots on this node (simulated telemetry); each worker and spare "
                                      "holds one, cordoned ones take no new work")
    health_rules: str | None = option(None, metavar="FILE",
                                      help="a rules file overriding the defaults by rule name (see "
                                           "docs/HEALTH.md, Rules)")
    health_db: str | None = option(None, metavar="FILE",
                                   default_text="$HOTSPARE_HEALTH_DB, else ~/.hotspare/health.json for real GPUs "
                                                "and a file of this run only for simulated devices",
                                   help="the device registry (lifecycle states, readings) shared with `hotspare "
                                        "health`. Under Slurm, a cordoned device drains its node (scontrol) until "
                                        "it is back in service")
    admission: str = option("off", choices=("off", "small", "full"),
                            help="admission checks before devices take work (inventory, burn-in against a float64 "
                                 "reference, throughput vs peers, memory patterns, all-reduce bandwidth; see "
                                 "`hotspare check admission`); a device that fails is quarantined and gets no "
                                 "worker")
    fingerprint_every: int = option(10, parse=int, metavar="STEPS", at_least=0,
                                    help="health vote every STEPS steps: the ranks compare parameter fingerprints "
                                         "(silent data corruption) and agree where a live migration pauses. 1 "
                                         "checks every step before its update, so a corrupt replica never reaches "
                                         "the others (strict; costs one tiny all-reduce per step); with N > 1 a "
                                         "corruption is caught within N steps but may reach the healthy "
                                         "replicas' updates first. 0: no fingerprint (votes every 10 steps only "
                                         "for migrations)")

    def validate(self) -> None:
        if self.devices is not None and self.devices > MAX_DEVICES:
            raise ConfigError(f"--devices {self.devices}: at most {MAX_DEVICES} simulated device slots on one node")


@dataclasses.dataclass(**_KW)
class RunConfig(Section):
    """Everything ``hotspare run`` is told: the script and one section per concern."""
    launch: LaunchConfig = section(LaunchConfig)
    capacity: CapacityConfig = section(CapacityConfig)
    hang: HangConfig = section(HangConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    health: HealthConfig = section(HealthConfig)
    hosts: HostsConfig = section(HostsConfig)
    faults: FaultConfig = section(FaultConfig)
    script: str = option(kind="positional", help="the training script (a .py file)")
    script_args: tuple[str, ...] = option(kind="remainder", help="arguments for the script")

    @property
    def slots(self) -> int:
        """Device slots of the job: --devices, else one per worker and spare."""
        return self.health.devices or self.launch.nproc + self.capacity.spares

    @property
    def local_nodes(self) -> int:
        """Node agents the launcher runs itself: --local-nodes, else 1 (0 when remote ones come)."""
        if self.launch.local_nodes is not None:
            return self.launch.local_nodes
        return 0 if self.hosts.remote_nodes else 1

    @property
    def store_addr(self) -> str:
        """Where the rendezvous store listens: --master-addr, else the --listen address, else loopback."""
        if self.launch.master_addr is not None:
            return self.launch.master_addr
        return host_port(self.hosts.listen)[0] if self.hosts.listen else "127.0.0.1"

    def validate(self) -> None:
        if self.local_nodes + self.hosts.remote_nodes < 1:
            raise ConfigError("--local-nodes 0 needs --remote-nodes K: some node must run the workers")
        if self.hosts.remote_nodes and not self.local_nodes and self.health.telemetry in ("nvml", "simulated"):
            raise ConfigError(f"--telemetry {self.health.telemetry} with --remote-nodes and no --local-nodes: each "
                              "remote agent polls its own host (GPU slots: NVML, cpu slots: simulated); use "
                              "--telemetry auto (or off)")
        if self.hosts.remote_nodes and self.launch.secret_file is None:
            raise ConfigError("--remote-nodes needs --secret-file FILE: the remote agents prove the same secret")
        nproc, spares = self.launch.nproc, self.capacity.spares
        if self.health.devices is not None and self.health.devices < nproc + spares:
            raise ConfigError(f"--devices {self.health.devices} is fewer than --nproc + --spares = "
                              f"{nproc + spares}: every worker and spare needs a device slot")
        if self.health.telemetry != "off" and self.local_nodes > self.slots:
            raise ConfigError(f"--local-nodes {self.local_nodes} is more than the {self.slots} device "
                              "slots: each node agent needs at least one (raise --devices)")
