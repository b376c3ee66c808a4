"""Many SIGKILL runs of the ordinary example scripts: is a healthy survivor ever fenced, and what
does a failure cost each script?

    python bench/kill_runs.py                  # 40 runs, ~5 min on 2 cores
    python bench/kill_runs.py --runs 200 --seed 3
    python bench/kill_runs.py --generated 20 --seed 5   # 20 generated scripts (~1-2 min each)

Each run draws a script (examples/cnn_loader.py, mlp_accum.py, amp_text.py, buffers_dropout.py),
a rank and a step from a seeded generator and runs it under `hotspare run --nproc 4 --spares 1`
with that one rank SIGKILLed at that step. A run is clean when it exits 0 with exactly one
failure (the killed rank: a second one is a survivor fenced), recovered from memory, nothing
lost or repeated, and the final digests (replicated and per rank) of the same script's
fault-free run. Prints one JSON line per run, then per script: runs, clean runs, and the
downtime's median and range. Exit 1 when any run was not clean.

With `--generated N`, the runs are N ordinary scripts composed from seeds S, S+1, ... by
hotspare/testing/scriptgen.py (BatchNorm, dropout, accumulation, a scheduler in or after the
block, an EMA, a GAN-like pair, unused parameters, rank-0 evaluation inside and between steps,
job.loader, early stopping, a GradScaler), each run fault-free, under plain torchrun and with
one seeded SIGKILL, and compared object by object on every rank as `hotspare verify` does. A
run's JSON line names the objects that differ and the issue-#28 cases its features touch; the
summary counts clean runs per feature.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hotspare.testing import run_job  # noqa: E402
from hotspare.testing.local import ORDINARY_SCRIPTS as SCRIPTS, REPO  # noqa: E402
from hotspare.testing.scriptgen import FEATURES, compose, kill_of, open_cases, write  # noqa: E402


def faults_of(name: str, rank: int, step: int, reference: dict) -> tuple[list[str], dict]:
    """What is wrong with a kill run of `name`, against its fault-free `reference` report; and
    the run's report."""
    args, steps = SCRIPTS[name]
    r = run_job(args, script=REPO / "examples" / f"{name}.py", inject=[f"kill:rank={rank}:step={step}"])
    rep = r.report or {}
    wrong = []
    if r.code != 0:
        wrong.append(f"exit {r.code}")
    if rep.get("failures_total") != 1:
        wrong.append(f"{rep.get('failures_total')} failures for 1 kill: "
                     + "; ".join(f"rank {f['rank']} {f['cause']}" for f in rep.get("failures", [])))
    if rep.get("recovered_zero_loss") != rep.get("failures_total") or rep.get("steps_repeated"):
        wrong.append("a step lost or repeated")
    if rep.get("final_state_digest") != reference["final_state_digest"]:
        wrong.append("replicated state differs from the fault-free run")
    if rep.get("rank_digests") != reference["rank_digests"]:
        wrong.append("per-rank state differs from the fault-free run")
    if rep.get("steps_completed") != steps:
        wrong.append(f"{rep.get('steps_completed')} of {steps} steps")
    return wrong, rep


def generated(n: int, seed: int, world: int = 4) -> int:
    """``n`` generated compositions from ``seed`` on: fault-free, torchrun and one seeded kill each."""
    import tempfile
    from hotspare.cli.verify import check
    runs = {f: 0 for f in FEATURES}
    clean = {f: 0 for f in FEATURES}
    bad = 0
    for i in range(n):
        comp = compose(seed + i)
        specs: list[str] = []
        plan = kill_of(comp, world)

        def faults(steps: int) -> list[str]:
            specs.extend(plan(steps))
            return specs
        with tempfile.TemporaryDirectory() as tmp:
            script = write(comp, tmp)
            verdicts, problems = check(str(script), comp.args, world, os.path.join(tmp, "runs"), faults=faults,
                                       timeout=600)
        wrong = problems + [f"{v.what}: {f}" for v in verdicts for f in dict.fromkeys(v.findings)]
        bad += bool(wrong)
        for f in comp.features:
            runs[f] += 1
            clean[f] += not wrong
        print(json.dumps({"run": i, "script": comp.name, "fault": specs, "issue_28_cases": open_cases(comp),
                          "wrong": wrong}), flush=True)
    print(f"\n{'feature':<14} {'runs':>5} {'clean':>6}")
    for f in FEATURES:
        print(f"{f:<14} {runs[f]:>5} {clean[f]:>6}")
    print(f"\n{n - bad} of {n} generated scripts clean; {bad} not")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=40, help="kill runs (default: 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn script, rank and step")
    p.add_argument("--generated", type=int, metavar="N",
                   help="run N scripts generated from --seed on (hotspare/testing/scriptgen.py) instead")
    a = p.parse_args(argv)
    if a.generated is not None:
        return generated(a.generated, a.seed)

    rng = random.Random(a.seed)
    references: dict[str, dict] = {}
    downtimes: dict[str, list[float]] = {n: [] for n in SCRIPTS}
    clean: dict[str, int] = {n: 0 for n in SCRIPTS}
    runs: dict[str, int] = {n: 0 for n in SCRIPTS}
    for i in range(a.runs):
        name = rng.choice(sorted(SCRIPTS))
        args, steps = SCRIPTS[name]
        rank, step = rng.randrange(4), rng.randrange(1, steps - 1)
        if name not in references:
            ref = run_job(args, script=REPO / "examples" / f"{name}.py")
            if ref.code != 0 or ref.report["failures_total"] != 0:
                print(f"the fault-free run of {name} failed:\n{ref.output}", file=sys.stderr)
                return 1
            references[name] = ref.report
        wrong, rep = faults_of(name, rank, step, references[name])
        runs[name] += 1
        clean[name] += not wrong
        downtimes[name] += [f["downtime_s"] for f in rep.get("failures", []) if f.get("downtime_s") is not None]
        print(json.dumps({"run": i, "script": name, "rank": rank, "step": step, "wrong": wrong,
                          "downtime_s": [f.get("downtime_s") for f in rep.get("failures", [])]}), flush=True)
    print(f"\n{'script':<16} {'runs':>5} {'clean':>6} {'downtime median':>16} {'range':>14}")
    for n in SCRIPTS:
        d = downtimes[n]
        span = f"{min(d):.2f}-{max(d):.2f} s" if d else "-"
        med = f"{statistics.median(d):.2f} s" if d else "-"
        print(f"{n:<16} {runs[n]:>5} {clean[n]:>6} {med:>16} {span:>14}")
    bad = sum(runs.values()) - sum(clean.values())
    print(f"\n{sum(clean.values())} of {a.runs} runs clean; {bad} not")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
