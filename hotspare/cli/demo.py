"""``hotspare demo``: a job with an injected failure, recovered, verified against a clean run."""
from __future__ import annotations

import argparse

DESCRIPTION = """\
Run the example GPT (examples/gpt_stdlib.py) twice on CPU workers with gloo:
  1. NPROC ranks + 1 warm spare, with rank 2 SIGKILLed in the middle of step KILL_STEP;
  2. the same job without the fault.
Then check the oracle: both runs must end with bitwise-identical model and optimizer state
(sha256 digest), with zero lost and zero repeated steps. Exit status 0 when they do."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="failover demo: kill a rank mid-run, recover, verify bitwise",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="training ranks (default: 4)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    p.add_argument("--kill-step", type=int, default=60, help="step at which rank 2 is killed (default: 60)")
    p.add_argument("--model", default="1m", choices=["tiny", "1m", "5m"], help="model preset (default: 1m)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotspare.testing import run_job
    if args.nproc < 3 or not 0 <= args.kill_step < args.steps:
        print("hotspare demo: error: needs --nproc >= 3 and 0 <= --kill-step < --steps", flush=True)
        return 2
    common = ["--model", args.model, "--steps", str(args.steps)]
    fault = f"kill:rank=2:step={args.kill_step}"
    print(f"=== run 1/2: {args.nproc} ranks + 1 warm spare, injecting {fault}", flush=True)
    faulted = run_job(common, nproc=args.nproc, spares=1, inject=[fault], stream=True)
    print("\n=== run 2/2: the same job without the fault", flush=True)
    clean = run_job(common, nproc=args.nproc, spares=1, stream=True)
    if faulted.report is None or clean.report is None:
        print("\nhotspare demo: a run produced no report (see its output above)")
        return 1
    f, c = faulted.report, clean.report
    lost = sum(x["lost_steps"] or 0 for x in f["failures"])
    downtime = [x["downtime_s"] for x in f["failures"] if x["downtime_s"] is not None]
    ok = (faulted.code == clean.code == 0 and f["final_state_digest"] == c["final_state_digest"]
          and f["failures_total"] >= 1 and lost == 0 and f["steps_repeated"] == 0)
    print("\n=== verdict")
    print(f"failures injected / recovered from memory : {f['failures_total']} / {f['recovered_zero_loss']}")
    print(f"lost steps / repeated steps               : {lost} / {f['steps_repeated']}")
    print(f"downtime per failure                      : {', '.join(f'{d:.2f} s' for d in downtime) or 'n/a'}")
    print(f"final digest with the failure             : {f['final_state_digest']}")
    print(f"final digest without it                   : {c['final_state_digest']}")
    print("RESULT: digests match bit for bit, nothing lost, nothing repeated" if ok else "RESULT: MISMATCH")
    return 0 if ok else 1
