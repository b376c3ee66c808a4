"""Two jobs lose a rank at the same moment and race for the last borrowable host, through the
service's own lending path (its lock, its queue of decisions, its promises): real threads, a real
database; the jobs are stand-ins (no workers). One is served, the other waits; the host is
promised once; the lender is paused once; nothing of higher priority is ever touched."""
import threading
from types import SimpleNamespace

from hotspare.policy.phase import JobPhase
from hotspare.protocol import auth
from hotspare.service.hostlife import Agent, HostPhase, HostState
from hotspare.service.lending import ShortOf
from hotspare.service.priority import CLASSES, JobPolicy
from hotspare.service.service import Service, _Host


class StandIn:
    """What the service reads and calls of a job's runner."""

    def __init__(self, job, priority, preemptible, hosts):
        self.job, self.policy, self.nodes = job, JobPolicy(CLASSES[priority], preemptible), list(hosts)
        self.pausing, self.started_at, self.spare_hosts, self.loans = None, 0.0, {}, []
        self.coord = SimpleNamespace(view=SimpleNamespace(phase=JobPhase.RECOVERING))

    def pause(self, loan):
        assert self.pausing is None, "paused twice"
        self.pausing = loan
        self.loans.append(loan)

    def note_loan(self, loan):
        self.loans.append(loan)

    def shrinkable(self):
        return None, ()                # not elastic: a lender is paused

    def regrow_slots(self):
        return 0


def test_two_failures_racing_for_the_last_borrowable_host_one_is_served_the_other_waits(tmp_path, secret_file):
    svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, str(tmp_path / "state"),
                  log=lambda line: None)
    try:
        jobs = {"j1": StandIn("j1", "production", False, ["a", "b"]),
                "j2": StandIn("j2", "production", False, ["d", "e"]),
                "j3": StandIn("j3", "research", False, ["f"]),            # not preemptible: never lends
                "low": StandIn("low", "best-effort", True, ["c"])}
        for job, r in jobs.items():
            svc.runners[job] = r
            for host in r.nodes:
                svc.hosts[host] = _Host(Agent(host, (f"{host}/cpu0",), False, 1, False), None,
                                        HostState(HostPhase.BUSY, job))
        go = threading.Barrier(2)

        def fail(job):
            go.wait()
            svc._short(ShortOf(job, 1, len(jobs[job].nodes), 0.0))

        threads = [threading.Thread(target=fail, args=(j,)) for j in ("j1", "j2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        (loan,) = jobs["low"].loans                               # paused once, for one borrower
        assert loan.hosts == ("c",) and loan.lender == "low" and loan.borrower in ("j1", "j2")
        assert list(svc._promised) == ["c"] and svc._promised["c"][0].borrower == loan.borrower
        loser = "j2" if loan.borrower == "j1" else "j1"
        assert jobs[loser].loans == [] and jobs["j3"].loans == [] and jobs["j3"].pausing is None
        assert svc._said_waiting[loser].startswith(f"{loser} (production) is short of 1 device slot(s)")
        svc._lend()                                               # decided again: still not given twice
        assert jobs[loser].loans == [] and list(svc._promised) == ["c"]
    finally:
        svc.stop()
