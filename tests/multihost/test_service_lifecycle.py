"""The coordinator service across network namespaces, as an operator drives it with the CLI: one
host serves three jobs one after another, and a job cancelled (`hotspare cancel`) while it waits
for that host never starts there (its agent never hears of it, no worker of it runs).

Slow (CI runs -m slow)."""
import pytest

from hotspare.testing.local import EXAMPLE

pytestmark = pytest.mark.slow
SHORT = ["--model", "tiny", "--steps", "3"]


def test_one_host_serves_job_after_job_and_a_cancelled_job_never_reaches_it(cluster):
    agent = cluster.start_agent("hostb")
    first = cluster.submit(1, 2, 0, str(EXAMPLE), SHORT)
    waiting = cluster.submit(1, 2, 0, str(EXAMPLE), SHORT)
    done = cluster.client("cancel", waiting)
    assert done.returncode == 0 and f"job {waiting} cancelled" in done.stdout, done.stderr
    rows = [cluster.wait_job(first, timeout=180)[0]]
    rows += [cluster.wait_job(cluster.submit(1, 2, 0, str(EXAMPLE), SHORT), timeout=180)[0] for _ in range(2)]
    assert [r["state"] for r in rows] == ["finished"] * 3, cluster.log.text()
    assert all(r["placement"]["hosts"] == ["hostb"] for r in rows)
    row = cluster.status(waiting)["jobs"][0]
    assert row["state"] == "cancelled" and row["placement"] is None
    assert f"job {waiting}" not in agent.text() and f"[{waiting}] placed" not in cluster.log.text()
    hosts = {h["name"]: h["state"] for h in cluster.status()["hosts"]}
    assert hosts == {"hostb": "idle"}, cluster.log.text()
    assert cluster.worker_pids("hostb") == [] and cluster.worker_pids("hostb", role="spare") == []
