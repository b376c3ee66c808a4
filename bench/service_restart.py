"""The coordinator service killed (kill -9) and restarted mid-run: does training stand still?

    sudo python bench/service_restart.py                 # ~2 minutes on 2 vCPUs (root: namespaces)
    sudo python bench/service_restart.py --repeats 3 --away 5

On 3 network namespaces (2 worker hosts, 1 spare host; 4 ranks, 1 spare, the tiny GPT for
--steps), the same job is run by the service twice per repeat, alternated: once untouched, once
with the service SIGKILLed at step --at and started again --away seconds later. Printed:
- the job's wall time (submit to finished) with the kill against without: the ratio says
  whether the workers stood still while no coordinator ran (1.0: they did not);
- about how many steps the workers trained while the service was away (what the agents
  replayed before they said ``resumed``; the log has every 10th step);
- the restarted service's time to have every node re-registered and resumed;
- whether both runs end with the same digest and no step lost or repeated.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hotspare.testing.local import EXAMPLE  # noqa: E402
from hotspare.testing.netns import Hosts, unavailable  # noqa: E402
from hotspare.testing.servicejob import ServiceCluster, new_secret_file  # noqa: E402


def one_run(net: Hosts, secret: str, steps: int, at: int | None, away: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ServiceCluster(net, secret, os.path.join(tmp, "state"))
        try:
            for host in ("hosta", "hostb"):
                cluster.start_agent(host)
            cluster.start_agent("hostc", spare=True)
            t0 = time.time()
            job = cluster.submit(2, 2, 1, str(EXAMPLE), ["--model", "tiny", "--steps", str(steps)],
                                 run_args=["--log-every", "10"])
            out: dict = {}
            if at is not None:
                cluster.log.wait_for(rf"\[{job}\] step\s+{at}/", 120)
                cluster.kill_service()
                time.sleep(away)
                restarted = cluster.start_service()
                t_up, _ = restarted.wait_for(r"coordinator service on", 30)
                t_res = max(restarted.wait_for(rf"NODE    {host}: resumed", 30)[0]
                            for host in ("hosta", "hostb", "hostc"))
                out["resume_s"] = t_res - t_up
                # what the agents replayed reached the job before their "resumed": the steps trained
                # while no service ran
                replayed = [int(m[1]) for t, line in restarted.lines if t <= t_res
                            and (m := re.search(r"step\s+(\d+)/", line))]
                out["trained_away"] = max(replayed) - at if replayed else 0
            row, report = cluster.wait_job(job)
            out["wall_s"] = time.time() - t0
            out.update(ok=row["state"] == "finished", digest=report["final_state_digest"],
                       lost=report["steps_lost"], repeated=report["steps_repeated"],
                       steps=report["steps_completed"])
            return out
        finally:
            cluster.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--at", type=int, default=100, help="kill the service when this step is logged")
    ap.add_argument("--away", type=float, default=3.0, help="seconds the service stays dead")
    args = ap.parse_args()
    why = unavailable()
    if why is not None:
        print(f"bench/service_restart.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    net = Hosts(["hosta", "hostb", "hostc"])
    secret = new_secret_file()
    ratios, resumes, rows = [], [], []
    try:
        for i in range(args.repeats):
            plain = one_run(net, secret, args.steps, None, 0.0)
            killed = one_run(net, secret, args.steps, args.at, args.away)
            ratio = killed["wall_s"] / plain["wall_s"]
            ratios.append(ratio)
            resumes.append(killed["resume_s"])
            rows.append((plain, killed))
            print(f"[{i + 1}/{args.repeats}] wall {plain['wall_s']:.1f} s untouched, {killed['wall_s']:.1f} s with the "
                  f"service dead {args.away:g} s from step {args.at} (x{ratio:.3f}); ~{killed['trained_away']} steps "
                  f"trained while it was away (the agents' replay, logged every 10); every node resumed {killed['resume_s']:.2f} s after the restart; "
                  f"same digest {plain['digest'] == killed['digest']}, lost {killed['lost']}, "
                  f"repeated {killed['repeated']}", flush=True)
    finally:
        net.close()
    print(f"\nmedian wall ratio (service killed / untouched): {statistics.median(ratios):.3f}; median time to "
          f"resume every node: {statistics.median(resumes):.2f} s; all equal: "
          f"{all(p['digest'] == k['digest'] and k['lost'] == 0 and k['repeated'] == 0 for p, k in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
