"""``hotspare check``: admission and quarantine diagnostics of this node's devices.

Progress goes to stderr as each check finishes; the verdict (a table, or JSON with ``--json``)
goes to stdout. Exit status: 0 every device passed, 1 some device failed, 2 bad input.
Torch is imported only once a check runs, so ``--help`` stays instant.
"""
from __future__ import annotations

import argparse
import json
import sys

from hotspare.errors import ConfigError

ADMISSION_EPILOG = """\
checks, per device (each device runs in a process of its own):
  inventory   torch/Python versions, CPU model and feature flags, cores; for GPUs also name,
              memory, compute capability, driver and CUDA versions. Must match the peers' majority.
  burn-in     float32 matmuls, every element checked against a float64 reference computed
              by numpy on the host, within the worst-case rounding bound gamma_n*(|A|@|B|)
  throughput  burn-in GFLOP/s (best rep) at least (1 - margin) x the median of its peers
  memory      zeros, ones, walking ones/zeros, address and inverted address patterns, read
              back exactly
  collective  all-reduce among the devices (gloo; NCCL on GPUs), results exact
  bandwidth   all-reduce bus bandwidth at least (1 - margin) x the median of its peers

CPU devices are one core each ("<node>/cpu<i>"); GPUs are "<node>/gpu<i>" in PCI bus order.

examples:
  hotspare check admission                       # every GPU here, or 2 CPU devices
  hotspare check admission --devices 4 --size full --json > admission.json
  hotspare check admission --inject burnin:cpu1  # prove the burn-in catches a corrupt result

exit status: 0 all devices passed, 1 a device failed, 2 bad input"""

QUARANTINE_EPILOG = """\
checks, per device, one device at a time:
  burn-in     the admission burn-in, run for at least --burn-seconds
  memory      the pattern test over a larger buffer
  dcgm-diag   dcgmi diag -r LEVEL -i INDEX for GPUs where DCGM is installed (needs
              nv-hostengine); "dcgmi not installed, skipped" elsewhere, the checks above still run

examples:
  hotspare check quarantine gpu3                 # or node-07/gpu3, on node-07 itself
  hotspare check quarantine gpu0 gpu1 --dcgm-level 3 --size full --json
  hotspare check quarantine cpu1 --burn-seconds 10

exit status: 0 all devices passed, 1 a device failed, 2 bad input"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=("small", "full"), default="small",
                   help="how hard to test: small takes seconds (default), full takes minutes")
    p.add_argument("--json", action="store_true", help="print the reports as JSON on stdout")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="give up on a device's checks after S seconds (default: by size)")
    p.add_argument("--inject", action="append", metavar="CHECK:DEVICE", default=[],
                   help="for testing the checks themselves: corrupt one burn-in result (burnin) "
                        "or flip one bit in the memory test (memory) on DEVICE, e.g. burnin:cpu1")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="admission and quarantine diagnostics of this node's devices",
        description="Run multi-stage device checks: 'admission' before a device takes work,\n"
                    "'quarantine' (deeper) before a cordoned device returns to the pool.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    a = sub.add_parser("admission", help="inventory, burn-in, memory and collective checks of the node's devices",
                       description="Admission checks of this node's devices, before they take work.",
                       epilog=ADMISSION_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--devices", type=int, metavar="N",
                   help="check the first N devices (default: every GPU, or 2 CPU devices without GPUs)")
    a.add_argument("--kind", choices=("auto", "gpu", "cpu"), default="auto",
                   help="device kind (default auto: GPUs when CUDA sees any)")
    a.add_argument("--margin", type=float, default=0.2, metavar="F",
                   help="fail a device whose throughput or bandwidth is more than F below its "
                        "peers' median (default 0.2 = 20%%)")
    _common(a)
    a.set_defaults(func=run_admission_cmd)
    q = sub.add_parser("quarantine", help="deeper diagnostics of named devices (longer burn-in, DCGM)",
                       description="Quarantine diagnostics of the named devices of this node.",
                       epilog=QUARANTINE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("devices", nargs="+", metavar="DEVICE", help="device names: gpu3, cpu1 or NODE/gpu3")
    q.add_argument("--dcgm-level", type=int, choices=(1, 2, 3, 4), default=2,
                   help="dcgmi diag level: 1 seconds, 2 minutes (default), 3-4 up to hours")
    q.add_argument("--burn-seconds", type=float, metavar="S",
                   help="run the burn-in for at least S seconds (default: by size)")
    _common(q)
    q.set_defaults(func=run_quarantine_cmd)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _finish(reports, args) -> int:
    if args.json:
        print(json.dumps({"passed": all(r.passed for r in reports),
                          "devices": [r.to_dict() for r in reports]}, indent=2))
    else:
        for r in reports:
            print(f"{r.device}: {'PASS' if r.passed else 'FAIL'} ({r.stage})")
            for c in r.results:
                print(f"  {c.line()}")
    return 0 if reports and all(r.passed for r in reports) else 1


def run_admission_cmd(args: argparse.Namespace) -> int:
    try:
        if args.devices is not None and args.devices < 1:
            raise ConfigError(f"--devices {args.devices}: check at least 1 device")
        if not 0 <= args.margin < 1:
            raise ConfigError(f"--margin {args.margin}: a fraction in [0, 1), e.g. 0.2")
        if args.timeout is not None and args.timeout <= 0:
            raise ConfigError(f"--timeout {args.timeout}: must be > 0 seconds")
        from hotspare.health.checks.admission import run_admission
        reports = run_admission(args.devices, size=args.size, kind=args.kind, margin=args.margin,
                                timeout_s=args.timeout, inject=args.inject)
    except ConfigError as e:
        print(f"hotspare check admission: error: {e}", file=sys.stderr)
        return 2
    return _finish(reports, args)


def run_quarantine_cmd(args: argparse.Namespace) -> int:
    try:
        if args.timeout is not None and args.timeout <= 0:
            raise ConfigError(f"--timeout {args.timeout}: must be > 0 seconds")
        from hotspare.health.checks.quarantine import run_quarantine
        reports = run_quarantine(args.devices, size=args.size, dcgm_level=args.dcgm_level,
                                 burn_seconds=args.burn_seconds, timeout_s=args.timeout, inject=args.inject)
    except ConfigError as e:
        print(f"hotspare check quarantine: error: {e}", file=sys.stderr)
        return 2
    return _finish(reports, args)
