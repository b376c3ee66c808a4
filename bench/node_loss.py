"""Node loss across hosts: how long until a lost host is declared lost, and how long training
stands still per node failure, on 3 network namespaces (2 worker hosts + 1 spare host, 4 ranks,
2 spares, the tiny GPT), side by side with a single-host process kill.

    sudo python bench/node_loss.py                  # ~3 minutes on 2 vCPUs (root: namespaces)
    sudo python bench/node_loss.py --repeats 3 --lease 3 --margin 1

Three cases, each run `--repeats` times:
- host killed: every process of one worker host SIGKILLed (its agent, zygote, 2 workers); the
  kernel closes their sockets, so the coordinator sees the node link close: detection is a
  connection close, not a timeout;
- host cut off: its bridge port taken down (no FIN, no RST: a dead NIC, a switch port, power
  lost), so only the lease can tell: detection is lease + margin after the last renewal; the
  cut-off agent fences its own workers when its lease runs out (also measured);
- one process killed on one host (`--inject kill:rank=2:step=100`, 3 local agents): the
  baseline the two node failures are compared with.
Detection is measured outside hotspare (the kill or cut, to the launcher's log line declaring
the node lost, both on this process's clock); "recovery" is hotspare's own report of the time
from that detection to the first committed step of the new generation (state from a survivor
on another host); downtime = detection + recovery.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hotspare.testing import run_job  # noqa: E402
from hotspare.testing.hostjob import HostJob  # noqa: E402
from hotspare.testing.netns import Hosts, unavailable  # noqa: E402

STEPS, AT = 300, 100


def multihost(net: Hosts, secret: str, how: str, lease: float, margin: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job = HostJob(net, secret, os.path.join(tmp, "r.json"), ["--model", "tiny", "--steps", str(STEPS)],
                      extra=["--node-lease", str(lease), "--lease-margin", str(margin), "--log-every", "10",
                             "--hang-floor", str(10 * (lease + margin))])
        cut = False
        try:
            job.log.wait_for(rf"step\s+{AT}/", 120)
            t0 = time.time()
            if how == "kill":
                net.kill_all(net["hostb"].ns, signal.SIGKILL)
                t_lost, _ = job.log.wait_for(r"NODE    hostb: the link to its agent closed", 30)
                fenced = None
            else:
                net.cut("hostb")
                cut = True
                t_fence, _ = job.agent_logs["hostb"].wait_for(r"FENCE ", 30)
                t_lost, _ = job.log.wait_for(r"NODE    hostb: no lease renewal", 30)
                fenced = t_fence - t0
                net.heal("hostb")
                cut = False
            code, report = job.finish()
        finally:
            if cut:
                net.heal("hostb")
            job.stop()
    assert code == 0 and report["failures_total"] == 2 and report["steps_repeated"] == 0, job.log.text()
    recovery = max(f["downtime_s"] for f in report["failures"])
    return {"detect": t_lost - t0, "recovery": recovery, "downtime": t_lost - t0 + recovery, "fence": fenced,
            "digest": report["final_state_digest"]}


def single_host() -> dict:
    result = run_job(["--model", "tiny", "--steps", str(STEPS)], nproc=4, spares=2,
                     inject=[f"kill:rank=2:step={AT}"], extra=["--local-nodes", "3"])
    assert result.code == 0, result.output
    f = result.report["failures"][0]
    return {"detect": f["detection_latency_s"], "recovery": f["downtime_s"] - f["detection_latency_s"],
            "downtime": f["downtime_s"], "fence": None, "digest": result.digest}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--lease", type=float, default=3.0)
    p.add_argument("--margin", type=float, default=1.0)
    args = p.parse_args()
    why = unavailable()
    if why:
        print(f"bench/node_loss.py: {why}", file=sys.stderr)
        return 2
    net = Hosts(["hosta", "hostb", "hostc"])
    rows: dict[str, list[dict]] = {"one process killed (one host)": [], "host killed (link closes)": [],
                                   f"host cut off (lease {args.lease:g} s + margin {args.margin:g} s)": []}
    names = list(rows)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            secret = os.path.join(tmp, "job.secret")
            with open(secret, "w") as f:
                f.write(os.urandom(32).hex())
            os.chmod(secret, 0o600)
            for _ in range(args.repeats):       # interleaved, so drift of this machine hits every case alike
                rows[names[0]].append(single_host())
                rows[names[1]].append(multihost(net, secret, "kill", args.lease, args.margin))
                rows[names[2]].append(multihost(net, secret, "cut", args.lease, args.margin))
    finally:
        net.close()
    digests = {r["digest"] for rs in rows.values() for r in rs}
    print(f"\n{STEPS} steps of the tiny GPT, 4 ranks + 2 spares, fault at step {AT}; median of {args.repeats}; "
          f"every run bitwise equal: {len(digests) == 1}")
    print(f"{'case':44} {'detect s':>9} {'recovery s':>11} {'downtime s':>11} {'fenced s':>9} {'x baseline':>11}")
    base = statistics.median(r["downtime"] for r in rows[names[0]])
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None
               for k in ("detect", "recovery", "downtime", "fence")}
        fence = f"{med['fence']:9.2f}" if med["fence"] is not None else f"{'-':>9}"
        print(f"{name:44} {med['detect']:9.3f} {med['recovery']:11.3f} {med['downtime']:11.3f} {fence} "
              f"{med['downtime'] / base:10.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
