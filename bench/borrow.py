"""A lost rank replaced by a borrowed device, against an idle warm spare: how long training stands still.

    sudo python bench/borrow.py                  # ~5 minutes on 2 vCPUs (root: namespaces)
    sudo python bench/borrow.py --repeats 3

On 3 network namespaces (1 device slot each), the service runs j1 (production, 2 ranks on hosta
and hostb, the tiny GPT for --steps); hostb dies at step --at (SIGKILL to everything on it). Three
ways the lost rank is replaced, alternated in each repeat:
- spare:    hostc is a spare host (`agent --spare`), j1 has a warm spare there (`--spares 1`);
- idle:     hostc is an idle host of the pool, j1 has no spare: the service lends it at once, a
            cold spare starts there;
- borrowed: hostc runs j2 (best-effort, --preemptible, 1 rank): j2 is paused (a signed checkpoint),
            hostc is lent to j1, a cold spare starts there; hostb's agent is then restarted and
            j2 resumes there from its checkpoint.
Printed per run: j1's downtime (the report's: fault to first committed step after) and its
phases; for the lender, the pause (asked to requeued) and the resume (placed again to its first
committed step, from its log with --log-every 1); and whether every run ends with j1's digest of
the untouched run and no step lost. Ratios are to the warm spare's downtime of the same repeat.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hotspare.testing.local import EXAMPLE  # noqa: E402
from hotspare.testing.netns import Hosts, unavailable  # noqa: E402
from hotspare.testing.servicejob import ServiceCluster, new_secret_file  # noqa: E402

MODES = ("spare", "idle", "borrowed")


def one_run(net: Hosts, secret: str, mode: str, steps: int, at: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ServiceCluster(net, secret, os.path.join(tmp, "state"))
        try:
            cluster.start_agent("hosta", devices=1)
            cluster.start_agent("hostb", devices=1)
            cluster.start_agent("hostc", devices=1, spare=mode == "spare")
            high = cluster.submit(2, 1, 1 if mode == "spare" else 0, str(EXAMPLE),
                                  ["--model", "tiny", "--steps", str(steps)],
                                  run_args=["--priority", "production", "--log-every", "10"])
            cluster.log.wait_for(rf"\[{high}\] placed", 60)
            low = None
            if mode == "borrowed":
                low = cluster.submit(1, 1, 0, str(EXAMPLE), ["--model", "tiny", "--steps", str(3 * steps)],
                                     run_args=["--priority", "best-effort", "--preemptible", "--checkpoint-dir",
                                               os.path.join(tmp, "ck"), "--log-every", "1"])
                cluster.log.wait_for(rf"\[{low}\] step\s+{at}/", 120)
            cluster.log.wait_for(rf"\[{high}\] step\s+{at}/", 120)
            net.kill_all(net["hostb"].ns)
            cluster.log.wait_for(rf"\[{high}\] RESUMED rank 1", 120)
            out: dict = {}
            if low is not None:
                cluster.start_agent("hostb", devices=1)
                t_placed, _ = cluster.log.wait_for(rf"\[{low}\] placed: ranks on hostb", 120)
                row, report = cluster.wait_job(low, timeout=300)
                resumed = [t for t, line in _after(cluster.log, t_placed) if f"[{low}] step" in line]
                (pause,) = report["pauses"]
                out.update(pause_s=pause["pause_s"], low_lost=pause["lost_steps"], low_ok=row["state"] == "finished",
                           low_digest=report["final_state_digest"],
                           resume_s=(resumed[0] - t_placed) if resumed else None)
            row, report = cluster.wait_job(high)
            (failure,) = report["failures"]
            out.update(mode=mode, ok=row["state"] == "finished", digest=report["final_state_digest"],
                       lost=report["steps_lost"], downtime_s=failure["downtime_s"], phases=failure["phases_s"],
                       path=failure["recovery_path"])
            return out
        finally:
            cluster.close()


def _after(out, t0: float):
    with out._cond:
        return [(t, line) for t, line in out.lines if t >= t0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--at", type=int, default=100, help="hostb dies when j1 logs this step")
    args = ap.parse_args()
    why = unavailable()
    if why is not None:
        print(f"bench/borrow.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    net = Hosts(["hosta", "hostb", "hostc"])
    secret = new_secret_file()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for i in range(args.repeats):
            this = {m: one_run(net, secret, m, args.steps, args.at) for m in MODES}
            for m in MODES:
                runs[m].append(this[m])
                ratios[m].append(this[m]["downtime_s"] / this["spare"]["downtime_s"])
                r = this[m]
                extra = (f"; lender paused in {r['pause_s']:.2f} s ({r['low_lost']} step(s) lost), resumed "
                         f"{r['resume_s']:.2f} s after it was placed again, finished {r['low_ok']}"
                         if m == "borrowed" else "")
                print(f"[{i + 1}/{args.repeats}] {m:<8} downtime {r['downtime_s']:.2f} s (x{ratios[m][-1]:.2f} the "
                      f"warm spare's), decide {r['phases']['decide']:.2f} s, path {r['path']}, lost {r['lost']}"
                      + extra, flush=True)
    finally:
        net.close()
    same = len({r["digest"] for m in MODES for r in runs[m]}) == 1 and all(r["lost"] == 0 for m in MODES
                                                                           for r in runs[m])
    lenders = runs["borrowed"]
    print("\nmedian downtime of j1 (fault to first committed step), ratio to the warm spare's:")
    for m in MODES:
        print(f"  {m:<8} {statistics.median(r['downtime_s'] for r in runs[m]):6.2f} s   "
              f"x{statistics.median(ratios[m]):.2f}")
    print(f"lender: median pause {statistics.median(r['pause_s'] for r in lenders):.2f} s, median resume "
          f"{statistics.median(r['resume_s'] for r in lenders):.2f} s, steps lost {sum(r['low_lost'] for r in lenders)}, "
          f"same digest every time {len({r['low_digest'] for r in lenders}) == 1}")
    print(f"j1: same digest in every run and 0 steps lost: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
