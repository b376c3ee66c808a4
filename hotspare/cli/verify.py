"""``hotspare verify -- script.py ARGS``: is this script safe under hotspare? Checked before a long run.

Runs the script a few times on this machine and compares every rank's state object by object
(hotspare/runtime/objdigest.py writes it at the job's end when HOTSPARE_VERIFY_OUT is set):

1. fault-free under ``hotspare run`` -- the reference;
2. the same under plain ``torchrun``: hotspare must not change the script's arithmetic;
3. with seeded faults: SIGKILLs at rank 0, another rank, the first and the last step, and a hang.

Then one verdict per object: "equal", or what differs, where, and what to change. The judging
(``judge``) is a pure function of the runs' digests and reports.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

DESCRIPTION = """\
Check a training script against hotspare's step contract before a long run. It runs the script
(with ARGS: make it short, a few dozen steps) on NPROC CPU ranks:
  1. once under `hotspare run` without faults: the reference;
  2. once under plain `torchrun`: hotspare must give the same state;
  3. KILLS more times under `hotspare run`, each with one fault drawn from SEED: a SIGKILL of
     rank 0, of another rank at the first step, of the last rank at the last step, a hang
     (SIGSTOP, fenced), then random kills.
After each run every rank writes the digest of each object of its state: what job.track was
given, every nn.Module, optimizer, LR scheduler and GradScaler the script built even if not
tracked (named by the script's variable that holds it), the random generators and each
job.loader's position. Every object of every rank is compared with the fault-free run.

The verdict is one line per object: "equal", or e.g.
  rank 1's AveragedModel `ema` differs after a failover at step 4 (kill:rank=1:step=4): it is not
  tracked, so the replacement starts it anew: pass it to job.track(ema=ema)
Exit status 0 only when every object is equal on every rank in every run and every fault was
recovered with nothing lost; 1 otherwise; 2 for bad arguments."""

EXAMPLES = """\
examples:
  hotspare verify -- examples/mlp_accum.py --steps 24
  hotspare verify --nproc 2 --kills 2 --seed 3 -- train.py --max-steps 20 --batch-size 8
  hotspare verify --keep /tmp/verify -- train.py --epochs 1      # keep every run's digests and output"""

UNSEEDED = ("rng/python", "rng/numpy")      # differ between any two runs unless the script seeds them


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a script against the step contract: fault-free, torchrun and "
                                      "killed runs compared object by object",
                       description=DESCRIPTION, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="training ranks (default: 4)")
    p.add_argument("--kills", type=int, default=4, metavar="N",
                   help="runs with a fault (default: 4: rank 0 mid-run, the first step, the last step, a hang)")
    p.add_argument("--seed", type=int, default=0, help="seed of the faults' ranks and steps (default: 0)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default: 300)")
    p.add_argument("--no-torchrun", action="store_true", help="skip the run under plain torchrun")
    p.add_argument("--keep", metavar="DIR", help="keep each run's digests and output under DIR")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------------------- runs
@dataclass
class Run:
    label: str                                   # "fault-free", "torchrun", or the fault's spec
    code: int
    ranks: dict[int, dict[str, Any]]             # rank -> {object name -> entry} (objdigest.py)
    report: dict[str, Any] | None = None         # hotspare run's report; None under torchrun
    output: str = ""
    fault: tuple[str, int, int] | None = None    # (kind, rank, step)

    def problems(self, world: int) -> list[str]:
        """What is wrong with the run itself (not its state)."""
        out = []
        if self.code != 0:
            out.append(f"exit {self.code}: {_last_error(self.output)}")
        missing = sorted(set(range(world)) - set(self.ranks))
        if missing and self.code == 0:
            out.append(f"rank(s) {missing} wrote no digests: did the script leave `job.steps`/`job.epochs` "
                       "before their end (a `break`)?")
        rep = self.report
        if rep is not None:
            want = 0 if self.fault is None else 1
            failures = rep.get("failures", [])
            exits = {f.get("step") for f in failures if f.get("cause") == "exited"}
            if rep.get("failures_total", 0) > want and len(exits) == 1 and len(failures) - want >= world:
                out.append(f"every rank left the job at step {exits.pop()} before `job.steps`/`job.epochs` "
                           f"ended (a `break` out of the loop?), and hotspare counted {rep['failures_total']} "
                           "failures for it")
            elif rep.get("failures_total", 0) > want:
                what = "; ".join(f"rank {f.get('rank')} {f.get('cause')} at step {f.get('step', '?')}"
                                 + (f" ({f['error']})" if f.get("cause") == "hang" and f.get("error") else "")
                                 for f in failures)
                why = ("collectives or long work that only some ranks run inside a step (a rank-0-only "
                       "evaluation) look like a hang; if the script has none, report it as hotspare's bug")
                out.append(f"{rep['failures_total']} failure(s) for {want} fault(s): a rank that was not "
                           f"failing was fenced ({what}): {why}{_fenced_stacks(self.output)}")
            if rep.get("recovered_zero_loss") != rep.get("failures_total") or rep.get("steps_repeated"):
                out.append("a step was lost or repeated")
        return out


def _fenced_stacks(output: str, most: int = 60) -> str:
    """Where a fenced rank was: the stacks its threads printed (faulthandler, on the SIGUSR1
    the coordinator sends before it fences), as the run's output has them."""
    lines = output.splitlines()
    keep, inside = [], False
    for line in lines:
        if line.lstrip().startswith(("Thread 0x", "Current thread 0x")):
            inside = True
        elif inside and not line.lstrip().startswith("File "):
            inside = False
        if inside:
            keep.append("      " + line.strip())
    if not keep:
        return ""
    cut = f"\n      ... {len(keep) - most} more lines" if len(keep) > most else ""
    return "\n    where the fenced rank was (its threads' stacks):\n" + "\n".join(keep[:most]) + cut


def _last_error(output: str) -> str:
    """The line of a run's output that says best why it failed: the script's exception, else the
    launcher's "job stopped ..." line, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for marks in (("Error:", "Exception:", "error:"), ("job stopped", "STOP ", "timed out")):
        found = [ln for ln in lines if any(m in ln for m in marks)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else "(no output)"


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def _fresh(d: str) -> str:
    """``d``, made if missing, without the digests of an earlier run (``--keep`` reused)."""
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(d):
        if name.startswith("rank") and name.endswith(".json"):
            os.remove(os.path.join(d, name))
    return d


def _read_digests(d: str) -> dict[int, dict[str, Any]]:
    out = {}
    for name in os.listdir(d):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                data = json.load(f)
            out[int(data["rank"])] = data["objects"]
    return out


def run_hotspare(script: str, args: list[str], nproc: int, fault: str | None, timeout: float,
                 out: str) -> Run:
    from hotspare.testing import run_job
    try:
        r = run_job(args, nproc=nproc, spares=1, inject=[fault] if fault else [], script=script,
                    timeout=timeout, env={"HOTSPARE_VERIFY_OUT": _fresh(out)})
        code, report, output = r.code, r.report, r.output
    except subprocess.TimeoutExpired as e:
        code, report, output = 124, None, f"hotspare run timed out after {timeout:.0f} s\n{_text(e.stdout)}"
    kind = None
    if fault:
        f = dict(kv.split("=") for kv in fault.split(":")[1:])
        kind = (fault.split(":")[0], int(f["rank"]), int(f["step"]))
    return Run(fault or "fault-free", code, _read_digests(out), report, output, kind)


def run_torchrun(script: str, args: list[str], nproc: int, timeout: float, out: str) -> Run:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))          # torchrun's --master-port 0 does not reach the workers
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "HOTSPARE_VERIFY_OUT": _fresh(out)}
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                               "--master-port", str(port), script, *args],
                              capture_output=True, text=True, timeout=timeout, env=env)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, output = 124, f"torchrun timed out after {timeout:.0f} s\n{_text(e.stdout)}"
    return Run("torchrun", code, _read_digests(out), None, output)


def fault_plan(steps: int, world: int, kills: int, seed: int) -> list[str]:
    """The faults, rank 0 first: rank 0 mid-run, rank 1 at the first step, the last rank at the
    last step, a hang, then random kills; steps and the hang's rank drawn from ``seed``."""
    rng = random.Random(seed)
    last = max(steps - 1, 0)
    mid = lambda: rng.randrange(1, last) if last > 1 else 0          # noqa: E731
    plan = [f"kill:rank=0:step={mid()}", f"kill:rank={1 % world}:step=0",
            f"kill:rank={world - 1}:step={last}", f"hang:rank={rng.randrange(world)}:step={mid()}"]
    while len(plan) < kills:
        plan.append(f"kill:rank={rng.randrange(world)}:step={rng.randrange(steps)}")
    return plan[:kills]


# ---------------------------------------------------------------------------------------- judging
CAVEATED = "the run's report has a CAVEAT"


@dataclass
class Verdict:
    name: str                         # the object's name in the digests
    what: str                         # e.g. "AveragedModel `ema` (not tracked)"
    findings: list[str] = field(default_factory=list)
    note: str = ""                    # why it was not compared

    @property
    def equal(self) -> bool:
        return not self.findings

    @property
    def caveated(self) -> bool:
        """Every difference is one the run's own report does not vouch for (a CAVEAT)."""
        return bool(self.findings) and all(CAVEATED in f for f in self.findings)


def _what(name: str, entry: dict[str, Any]) -> str:
    if entry["how"] == "per-rank":
        kind = name.split("/", 1)
        label = {"rng/torch": "torch's generator", "rng/python": "Python's random",
                 "rng/numpy": "numpy's generator"}.get(name)
        if label:
            return label
        return f"torch.Generator `{kind[1]}`" if kind[0] == "generator" else f"job.loader `{name}` position"
    var = entry.get("var") or name
    tag = "" if entry["how"] == "tracked" else " (not tracked)"
    return f"{entry['type']} `{var}`{tag}"


def _differing(ref: dict[int, dict], other: dict[int, dict], name: str) -> tuple[list[int], list[str]]:
    """Ranks where object ``name`` differs, and the parts that differ."""
    ranks, parts = [], set()
    for r in sorted(ref):
        a, b = ref[r].get(name), other.get(r, {}).get(name)
        if a is None or b is None or a["digest"] == b["digest"]:
            continue
        ranks.append(r)
        parts.update(k for k, v in a.get("parts", {}).items() if b.get("parts", {}).get(k) != v)
    return ranks, sorted(parts)


def _counter(entry: dict[str, Any] | None) -> tuple[str, int] | None:
    info = (entry or {}).get("info", {})
    return next(iter(info.items()), None)


def _is_cause(entry: dict[str, Any]) -> bool:
    """Whether a difference of this object can explain others: state hotspare does not replicate
    (not tracked, per-rank) or a scheduler's counter; a model or optimizer follows from them."""
    return entry["how"] != "tracked" or (_counter(entry) or ("",))[0] == "last_epoch"


def _kill_finding(run: Run, name: str, entry: dict, ranks: list[int], parts: list[str], world: int,
                  causes: list[str]) -> str:
    kind, lost, step = run.fault
    where = f"after a failover at step {step} ({run.label})"
    what = _what(name, entry)
    var = entry.get("var") or name
    on = "every rank" if len(ranks) == world else f"rank(s) {', '.join(map(str, ranks))}"
    parts_txt = f" (its {' and '.join(parts)})" if parts else ""
    caveat = next((c for c in (run.report or {}).get("caveats") or () if c.get("rank") == lost), None)
    if causes and not _is_cause(entry):
        said = f" ({CAVEATED} for rank {lost})" if caveat is not None else ""
        return f"differs on {on} {where}, a consequence of {', '.join(causes)}{said}"
    if ranks == [lost]:
        if entry["how"] == "untracked":
            return (f"rank {lost}'s {entry['type']} `{var}` differs {where}: it is not tracked, so the replacement "
                    f"started it anew: pass it to job.track({var}={var})")
        if entry["how"] == "per-rank" and name.startswith("rng/"):
            said = f" ({CAVEATED} for it)" if caveat is not None else ""
            return (f"rank {lost}'s {what} differs {where}: that rank drew random numbers after its gradient "
                    "exchange (e.g. a rank-0 evaluation iterating a shuffled DataLoader after the backward or "
                    "between steps), which its replacement did not: move that work to the top of the loop body "
                    "(before `with step:`), where a replacement runs it again, or give it its own "
                    f"torch.Generator{said}")
        if caveat is not None:
            return (f"rank {lost}'s {what} differs {where}{parts_txt}: the script changes its per-rank state after "
                    f"the gradient exchange ({', '.join(caveat.get('parts', []))}; {CAVEATED} for "
                    "it), which a replacement cannot receive when the rank dies before its next exchange: do that "
                    "work (an EMA update, an evaluation) at the top of the loop body, before `with step:`")
        return f"rank {lost}'s {what} differs {where}{parts_txt}: hotspare lost it; please report this as a bug"
    counter = _counter(entry)
    if counter is not None:
        ref_n = counter[1]
        got = [_counter(run.ranks.get(r, {}).get(name)) for r in ranks]
        more = [c[1] for c in got if c is not None and c[1] > ref_n]
        if more:
            return (f"the {what} differs on {on} {where}: it stepped {max(more)} times, {ref_n} without the "
                    f"fault: a `{var}.step()` after the `with step:` block ran for the failed attempt too "
                    "(a failure inside the block is recovered and the block left as if done): move it into "
                    "the step block")
    advice = "move what updates it into the `with step:` block"
    if entry["how"] == "untracked":
        advice += f" and pass it to job.track({var}={var})"
    return (f"the {what} differs on {on} {where}{parts_txt}: code after the `with step:` block (or between "
            f"steps) ran for the failed attempt too, or it depends on something not tracked: {advice}")


def judge(ref: Run, others: list[Run], world: int) -> tuple[list[Verdict], list[str]]:
    """One verdict per object of the fault-free run, and the problems of the runs themselves."""
    problems = [f"{run.label}: {p}" for run in [ref, *others] for p in run.problems(world)]
    names = sorted({n for objs in ref.ranks.values() for n in objs})
    sample = {n: next(objs[n] for objs in ref.ranks.values() if n in objs) for n in names}
    verdicts = {n: Verdict(n, _what(n, sample[n])) for n in names}
    torchrun = next((r for r in others if r.fault is None), None)
    if torchrun is not None and torchrun.code == 0 and (ref.code != 0 or len(ref.ranks) < world):
        problems.insert(0, "the fault-free run under hotspare did not finish where plain torchrun did: "
                           "hotspare cannot run this script as it is; the error above says why (if it blames "
                           "the script, check it against docs/CONTRACT.md; if not, report it as a bug)")
    skip = {n for n in UNSEEDED if n in names}
    if torchrun is not None and torchrun.ranks:
        skip = {n for n in skip if _differing(ref.ranks, torchrun.ranks, n)[0]}
    for n in skip:
        verdicts[n].note = "not compared: the script does not seed it, so it differs between any two runs"
    for run in others:
        if not run.ranks:
            continue
        diffs = {n: _differing(ref.ranks, run.ranks, n) for n in names if n not in skip}
        diffs = {n: d for n, d in diffs.items() if d[0]}
        missing = sorted({n for objs in run.ranks.values() for n in objs} - set(names))
        if missing and ref.ranks:
            problems.append(f"{run.label}: objects the fault-free run does not have: {', '.join(missing)}")
        if run.fault is None:                 # plain torchrun: no fault at all
            fenced = ref.report and ref.report.get("failures_total", 0) > 0
            for n, (ranks, parts) in diffs.items():
                why = ("the fault-free run under hotspare fenced a rank that was not failing (above)" if fenced
                       else "hotspare changed the arithmetic of this script; please report it as a bug")
                on = "every rank" if len(ranks) == world else f"rank(s) {', '.join(map(str, ranks))}"
                verdicts[n].findings.append(f"differs from plain torchrun on {on} without any fault: {why}")
            continue
        causes = [_what(n, sample[n]) for n in diffs if _is_cause(sample[n])]
        for n, (ranks, parts) in diffs.items():
            own = _what(n, sample[n])
            finding = _kill_finding(run, n, sample[n], ranks, parts, world, [c for c in causes if c != own])
            if verdicts[n].findings and verdicts[n].findings[0].startswith("differs from plain torchrun"):
                finding = (f"differs on rank(s) {', '.join(map(str, ranks))} after a failover at step "
                           f"{run.fault[2]} ({run.label}) too: fix its difference from torchrun first")
            verdicts[n].findings.append(finding)
    problems += [p for run in [ref, *others] for p in _split_replicas(run, sample, world)]
    return list(verdicts.values()), problems


def _split_replicas(run: Run, sample: dict[str, dict], world: int) -> list[str]:
    """Replicated state that differs between the ranks of one run: its replicas diverged."""
    out = []
    for n, entry in sample.items():
        if entry["how"] != "tracked" or entry["type"] == "Generator":
            continue
        part = "parameters" if "parameters" in entry.get("parts", {}) else None
        seen = {r: (objs.get(n, {}).get("parts", {}).get(part) if part else objs.get(n, {}).get("digest"))
                for r, objs in sorted(run.ranks.items())}
        if len(set(seen.values())) > 1:
            groups: dict[Any, list[int]] = {}
            for r, d in seen.items():
                groups.setdefault(d, []).append(r)
            split = " / ".join(",".join(map(str, g)) for g in groups.values())
            out.append(f"{run.label}: the replicas of {_what(n, entry)} differ from each other at the end "
                       f"(ranks that agree: {split}): every rank must hold the same replicated state; under "
                       "plain torchrun a script's own bug, under hotspare with torchrun agreeing, hotspare's")
    return out


def render(verdicts: list[Verdict], problems: list[str]) -> str:
    width = max((len(v.what) for v in verdicts), default=10)
    lines = []
    for v in verdicts:
        if v.equal:
            lines.append(f"  {v.what:<{width}}  {v.note or 'equal'}")
        else:
            lines.append(f"  {v.what:<{width}}  DIFFERS")
            lines += [f"      - {f}" for f in dict.fromkeys(v.findings)]
    first = [f if v.what in f else f"{v.what} {f}" for v in verdicts for f in dict.fromkeys(v.findings)
             if ", a consequence of " not in f and not f.endswith("fix its difference from torchrun first")]
    if first:
        lines.append("what to change first (the rest follows from these):" if len(first) < sum(
            len(v.findings) for v in verdicts) else "what to change:")
        lines += [f"  - {f}" for f in dict.fromkeys(first)]
    if problems:
        lines.append("the runs themselves:")
        lines += [f"  - {p}" for p in problems]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- command
def check(script: str, args: list[str], nproc: int, base: str, *, kills: int = 4, seed: int = 0,
          faults: Callable[[int], list[str]] | None = None, timeout: float = 300, torchrun: bool = True,
          keep: bool = False, say: Callable[[str], None] = lambda msg: None) -> tuple[list[Verdict], list[str]]:
    """Run ``script`` fault-free, under torchrun and with ``faults`` (default: ``fault_plan``),
    each run's digests under ``base``; return ``judge``'s verdicts and problems. ``faults`` maps
    the number of steps the fault-free run took to the fault specs."""
    ref = run_hotspare(script, args, nproc, None, timeout, os.path.join(base, "fault-free"))
    steps = (ref.report or {}).get("steps_completed") or 0
    say(f"  fault-free under hotspare: exit {ref.code}, {steps} steps, {len(ref.ranks)} ranks' digests")
    others: list[Run] = []
    if torchrun:
        t = run_torchrun(script, args, nproc, timeout, os.path.join(base, "torchrun"))
        say(f"  plain torchrun: exit {t.code}, {len(t.ranks)} ranks' digests")
        others.append(t)
    if ref.code != 0 or len(ref.ranks) < nproc:
        say("the fault-free run did not finish with every rank's digests: no fault runs")
        if others and others[0].code != 0:
            say(f"  (under plain torchrun too: {_last_error(others[0].output)}: a bug of the script itself)")
    else:
        for i, spec in enumerate(fault_plan(steps, nproc, kills, seed) if faults is None else faults(steps)):
            r = run_hotspare(script, args, nproc, spec, timeout, os.path.join(base, f"fault{i}"))
            rep = r.report or {}
            say(f"  {spec}: exit {r.code}, {rep.get('failures_total', '?')} failure(s), "
                f"{rep.get('recovered_zero_loss', '?')} recovered with zero lost steps")
            others.append(r)
    for r in [ref, *others] if keep else []:
        label = r.label.replace(":", "_").replace("=", "")
        with open(os.path.join(base, f"output-{label}.txt"), "w") as f:
            f.write(r.output)
    return judge(ref, others, nproc)


def run(a: argparse.Namespace) -> int:
    script = a.script
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not os.path.isfile(script):
        print(f"hotspare verify: error: no script {script!r}; usage: hotspare verify [options] -- script.py ARGS")
        return 2
    if a.nproc < 2 or a.kills < 0 or a.timeout <= 0:
        print("hotspare verify: error: needs --nproc >= 2 (a failover needs survivors), --kills >= 0, --timeout > 0")
        return 2
    say = lambda msg: print(msg, flush=True)             # noqa: E731
    say(f"hotspare verify: {script} {' '.join(args)} on {a.nproc} ranks")
    with contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory(prefix="hotspare-verify-") as base:
        verdicts, problems = check(script, args, a.nproc, base, kills=a.kills, seed=a.seed, timeout=a.timeout,
                                   torchrun=not a.no_torchrun, keep=bool(a.keep), say=say)
    say("\nverdict, object by object (every rank, every run, against the fault-free run):")
    say(render(verdicts, problems))
    ok = all(v.equal for v in verdicts) and not problems and verdicts
    say("\nRESULT: " + ("every object equal on every rank in every run: the script keeps hotspare's contract"
                        if ok else "NOT SAFE: see above"))
    return 0 if ok else 1
