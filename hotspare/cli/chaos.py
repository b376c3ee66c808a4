"""``hotspare chaos``: a seeded random fault schedule against the example, judged bit for bit."""
from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = """\
Chaos soak. Runs the example GPT (examples/gpt_stdlib.py) with a seeded random schedule of
real faults -- SIGKILLs, hangs (SIGSTOP, fenced by the hang detector), abrupt exits with a
status, two ranks killed in one step, the replacement killed while it receives the state, a
survivor killed while the next generation forms -- then runs the same steps without faults and
compares the final digests. Prints: faults injected, recovered from memory, recovered from
checkpoint, steps lost, steps repeated, digest match, total downtime. Exit 0 when the digests
match and no step was lost or repeated."""

EPILOG = """\
examples:
  hotspare chaos --faults 8 --steps 400 --seed 1         # ~2 minutes here (the test suite's soak)
  hotspare chaos --duration 1800 --seed 7 --model 1m     # a long soak, for manual runs"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="chaos soak: random real faults, verified against a fault-free run",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default: 0)")
    p.add_argument("--faults", type=int, default=8, help="fault events to inject (default: 8)")
    p.add_argument("--steps", type=int, default=0,
                   help="training steps (default: derived from --duration, or 400)")
    p.add_argument("--duration", type=float, default=0, metavar="SECONDS",
                   help="aim the faulted run at about this long: the step count is calibrated from a "
                        "short fault-free run; with no --faults given, one fault per 15 s")
    p.add_argument("--nproc", type=int, default=4, help="training ranks (default: 4)")
    p.add_argument("--spares", type=int, default=1, help="warm spares (default: 1)")
    p.add_argument("--model", default="tiny", choices=["tiny", "1m", "5m"], help="model preset (default: tiny)")
    p.add_argument("--hang-floor", type=float, default=2.0, help="hang threshold floor in seconds (default: 2)")
    p.add_argument("--local-nodes", type=int, default=1, metavar="K",
                   help="node agents on this host (hotspare run --local-nodes): faults and spares then "
                        "cross agents (default: 1)")
    p.add_argument("--report", metavar="FILE", help="write the faulted run's JSON report here")
    p.add_argument("--log", metavar="FILE", help="write the faulted run's full output here")
    p.add_argument("--health", action="store_true",
                   help="also inject health signals (thermal -> live migration; uncorrectable ECC, "
                        "Xid 79, a flipped parameter bit, NaN gradients -> failover from a replica), "
                        "on simulated telemetry polled every 0.2 s")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotspare.cli.progress import Progress
    calibrate = not args.steps and args.duration > 0
    with Progress("chaos", total=2 + calibrate, unit="runs") as bar:      # (calibration,) faulted, fault-free
        return _soak(args, bar)


def _soak(args: argparse.Namespace, bar) -> int:
    import json

    from hotspare.testing import run_job
    from hotspare.testing.chaos import HEALTH_KINDS, KINDS, make_schedule

    def say(line: str) -> None:
        bar.print(f"[chaos] {line}")

    if args.nproc < 3 or args.faults < 1 or args.steps < 0 or args.duration < 0 or args.local_nodes < 1:
        print("hotspare chaos: error: needs --nproc >= 3, --faults >= 1, --local-nodes >= 1, non-negative "
              "--steps/--duration", file=sys.stderr)
        return 2
    extra = ["--hang-floor", str(args.hang_floor), "--log-every", "100000", "--local-nodes", str(args.local_nodes)]
    kinds = KINDS
    if args.health:
        kinds = tuple(k for pair in zip(HEALTH_KINDS, KINDS) for k in pair) + KINDS[len(HEALTH_KINDS):]
        # enough device slots that cordoned devices (in quarantine for a few seconds) never starve
        # the spare pool
        # a vote every step: the bitwise oracle holds for silent corruption only if it is caught
        # before the gradient average spreads it (see --fingerprint-every)
        extra += ["--telemetry", "simulated", "--telemetry-period", "0.2", "--fingerprint-every", "1",
                  "--devices", str(args.nproc + args.spares + 2)]
    steps = args.steps
    if not steps and args.duration:
        cal = run_job(["--model", args.model, "--steps", "30"], nproc=args.nproc, spares=0, extra=extra)
        bar.advance()
        step_s = (cal.report or {}).get("median_step_time_s") or 0.05
        faults = args.faults if "--faults" in sys.argv else max(1, int(args.duration // 15))
        args.faults = faults
        steps = max(4 * (faults + 1), int((args.duration - 3.0 * faults) / step_s))
        say(f"calibrated: {1000 * step_s:.0f} ms/step -> {steps} steps for ~{args.duration:.0f} s")
    steps = steps or 400
    try:
        sched = make_schedule(args.seed, steps, args.faults, args.nproc, kinds)
    except ValueError as e:
        print(f"hotspare chaos: error: {e}", file=sys.stderr)
        return 2
    common = ["--model", args.model, "--steps", str(steps)]
    say(f"seed {args.seed}: {len(sched.events)} fault events ({sched.faults} faults) over {steps} steps:")
    for (step, kind) in sched.events:
        say(f"  step {step:>6}: {kind}")
    t0 = time.time()
    faulted = run_job(common, nproc=args.nproc, spares=args.spares, inject=sched.specs, extra=extra,
                      timeout=max(600, 20 * steps))
    bar.advance()
    say(f"faulted run: exit {faulted.code} in {time.time() - t0:.0f} s")
    if args.log:
        with open(args.log, "w") as out:
            out.write(faulted.output)
    clean = run_job(common, nproc=args.nproc, spares=args.spares, extra=extra, timeout=max(600, 20 * steps))
    bar.advance()
    say(f"fault-free run: exit {clean.code}")
    if faulted.report is None or clean.report is None or faulted.code or clean.code:
        print(faulted.output[-6000:], file=sys.stderr)
        say("RESULT: a run failed (its output is above)")
        return 1
    f = faulted.report
    if args.report:
        with open(args.report, "w") as out:
            json.dump(f, out, indent=2)
    match = f["final_state_digest"] == clean.report["final_state_digest"]
    downtime = sum({x["generation"]: x["downtime_s"] or 0 for x in f["failures"]}.values())
    downtime += sum(m["downtime_s"] or 0 for m in f.get("migrations", []))
    rows = [
        ("faults injected", sched.faults),
        ("failures seen", f["failures_total"]),
        ("recovered from memory", f["recovered_zero_loss"]),
        ("recovered from checkpoint", f["recovered_from_checkpoint"]),
        ("live migrations", f.get("migrations_total", 0)),
        ("steps lost", f["steps_lost"]),
        ("steps repeated", f["steps_repeated"]),
        ("digest match", "yes" if match else "NO"),
        ("total downtime", f"{downtime:.1f} s"),
        ("wall time (faulted / clean)", f"{f['wall_time_s']:.0f} s / {clean.report['wall_time_s']:.0f} s"),
    ]
    for name, value in rows:
        print(f"  {name:<28} {value}")
    ok = match and f["steps_lost"] == 0 and f["steps_repeated"] == 0
    if not ok:
        print("\n".join(faulted.output.splitlines()[-40:]), file=sys.stderr)
    say("RESULT: " + ("digest matches the fault-free run, no step lost or repeated" if ok else "FAILED"))
    return 0 if ok else 1
