"""``hotspare agent``: the node agent of one host of a multi-host job (docs/DEPLOY.md)."""
from __future__ import annotations

import argparse
import os
import socket
import sys

from hotspare.errors import ConfigError, ProtocolError

COORDINATOR_ENV = "HOTSPARE_COORDINATOR"

DESCRIPTION = """\
The node agent of one host. It proves the shared secret to --coordinator, runs the workers
and spares placed on this host, and renews this node's lease.

At a coordinator service (`hotspare coordinator`) it joins the service's pool and works for
each job placed on it in turn (--spare: this host holds spares of jobs whose ranks run
elsewhere). When the service goes away (a crash, a restart) the workers train on; the agent
keeps what they report, reconnects, and replays it to the restarted service.

At a `hotspare run --listen ADDR:PORT --remote-nodes K` launcher it is one of the job's K
nodes and ends with the job.

Either way, when the lease cannot be renewed because the link is down (no answer at all from
the coordinator's host), the agent kills its own workers as the lease runs out, before their
ranks can be handed to spares elsewhere, and exits with status 3."""

EPILOG = """\
example (the launcher on 10.0.0.1, this host 10.0.0.2; the same secret file and script path on both):
  hotspare agent --coordinator 10.0.0.1:29400 --secret-file ~/.hotspare/job.secret --devices cpu:2

under srun (SLURM_JOB_ID and SLURM_STEP_ID set), the defaults come from Slurm's environment:
  --name     SLURMD_NODENAME when the step runs one task per node; SLURMD_NODENAME.SLURM_LOCALID
             (vm.0, vm.1, ...) on every node when it runs more tasks than nodes
  --devices  one slot per GPU of the task (SLURM_GPUS_PER_TASK), else per GPU of the node
             (SLURM_GPUS_ON_NODE, one agent task per node), else per CPU of the task
             (SLURM_CPUS_PER_TASK, srun -c N), else cpu:1; slots are named NODE/cpuI whatever
             backs them, and a worker's LOCAL_RANK is its slot's index
  the agent logs what it took from where. In a batch script (examples/slurm/hotspare.sbatch):
    HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)      # the launcher's node
    export HOTSPARE_COORDINATOR=$(getent ahostsv4 "$HEAD" | awk 'NR == 1 {print $1}'):29400
    srun --ntasks-per-node 1 -c 2 hotspare agent --secret-file ~/.hotspare/job.secret

exit status: 0 when the job ended; 3 when this node fenced itself (lease expired);
2 for bad input or a refused connection."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run the node agent of one host of a multi-host job",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator", default=None, metavar="ADDR:PORT",
                   help=f"the launcher's node endpoint (hotspare run --listen); default: ${COORDINATOR_ENV}")
    p.add_argument("--secret-file", required=True, metavar="FILE",
                   help="the job secret, the same file as the launcher's --secret-file (mode 0600)")
    p.add_argument("--devices", default=None, metavar="cpu:N|gpu|none",
                   help="device slots of this host; each worker or spare placed here holds one (default "
                        "cpu:1; under srun, from Slurm's environment: see below). gpu: every GPU NVML sees, "
                        "polled by NVML; cpu slots get SIMULATED telemetry")
    p.add_argument("--name", default=None, help="this node's name in the job (default: the host name; under "
                                                "srun, the Slurm node's: see below); a host that was "
                                                "declared lost must come back under a new one")
    p.add_argument("--spare", action="store_true",
                   help="at a coordinator service (hotspare coordinator): this host holds the warm spares of "
                        "jobs whose ranks run elsewhere")
    p.add_argument("--spawn", choices=("fork", "exec"), default="fork",
                   help="fork workers from a zygote that imported torch, or exec each (as hotspare run)")
    p.add_argument("--allow-inject", action="store_true",
                   help="load the fault-injection plug-in (testing): the launcher's --inject faults fire on this "
                        "host's workers, device faults on its simulated telemetry")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotspare.agent.remote import parse_devices, serve
    from hotspare.agent.slurm_env import agent_defaults
    from hotspare.protocol import auth
    try:
        coordinator = args.coordinator or os.environ.get(COORDINATOR_ENV)
        if not coordinator:
            raise ConfigError(f"give --coordinator ADDR:PORT (or export {COORDINATOR_ENV}=ADDR:PORT)")
        if ":" not in coordinator:
            raise ConfigError(f"--coordinator {coordinator!r}: give ADDR:PORT")
        defaults = agent_defaults(os.environ, socket.gethostname())
        name = args.name or defaults.name
        devices = args.devices or defaults.devices
        if args.name is None and defaults.name_from != "the host name":
            _say(name, f"node name {name} from {defaults.name_from}")
        if args.devices is None and defaults.devices_from != "the default":
            _say(name, f"devices {devices} from {defaults.devices_from}")
        secret = auth.load_secret(args.secret_file)
        return serve(coordinator, secret, name, parse_devices(devices, name), spawn=args.spawn,
                     spare=args.spare, allow_inject=args.allow_inject)
    except (ConfigError, ProtocolError) as e:
        print(f"hotspare agent: error: {e}", file=sys.stderr)
        return 2


def _say(name: str, line: str) -> None:
    print(f"hotspare agent {name}: {line}", file=sys.stderr, flush=True)
