"""``hotspare agent``: the node agent of one host of a multi-host job (docs/DEPLOY.md)."""
from __future__ import annotations

import argparse
import socket
import sys

from hotspare.errors import ConfigError, ProtocolError

DESCRIPTION = """\
Join a running `hotspare run --listen ADDR:PORT --remote-nodes K` as one of its K nodes: prove
the job secret, learn the job (script, arguments, rendezvous address) from the launcher, run
the workers and spares it places here, and renew this node's lease. When the lease cannot be
renewed (the link is down), the agent kills its own workers as the lease runs out, before the
launcher hands their ranks to spares elsewhere, and exits with status 3."""

EPILOG = """\
example (the launcher on 10.0.0.1, this host 10.0.0.2; the same secret file and script path on both):
  hotspare agent --coordinator 10.0.0.1:29400 --secret-file ~/.hotspare/job.secret --devices cpu:2

exit status: 0 when the job ended; 3 when this node fenced itself (lease expired);
2 for bad input or a refused connection."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run the node agent of one host of a multi-host job",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator", required=True, metavar="ADDR:PORT",
                   help="the launcher's node endpoint (hotspare run --listen)")
    p.add_argument("--secret-file", required=True, metavar="FILE",
                   help="the job secret, the same file as the launcher's --secret-file (mode 0600)")
    p.add_argument("--devices", default="cpu:1", metavar="cpu:N|gpu|none",
                   help="device slots of this host; each worker or spare placed here holds one (default cpu:1). "
                        "gpu: every GPU NVML sees, polled by NVML; cpu slots get SIMULATED telemetry")
    p.add_argument("--name", default=None, help="this node's name in the job (default: the host name); a "
                                                "host that was declared lost must come back under a new one")
    p.add_argument("--spawn", choices=("fork", "exec"), default="fork",
                   help="fork workers from a zygote that imported torch, or exec each (as hotspare run)")
    p.add_argument("--allow-inject", action="store_true",
                   help="load the fault-injection plug-in (testing): the launcher's --inject faults fire on this "
                        "host's workers, device faults on its simulated telemetry")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotspare.agent.remote import parse_devices, serve
    from hotspare.protocol import auth
    name = args.name or socket.gethostname()
    try:
        if ":" not in args.coordinator:
            raise ConfigError(f"--coordinator {args.coordinator!r}: give ADDR:PORT")
        secret = auth.load_secret(args.secret_file)
        return serve(args.coordinator, secret, name, parse_devices(args.devices, name), spawn=args.spawn,
                     allow_inject=args.allow_inject)
    except (ConfigError, ProtocolError) as e:
        print(f"hotspare agent: error: {e}", file=sys.stderr)
        return 2
