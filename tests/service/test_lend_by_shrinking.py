"""An elastic lender shrinks through the service's own lending path (its lock, its host
lifecycle, its promises): real threads, a real database; the jobs are stand-ins (no workers).
The fault model: a production job loses a rank in a full pool; the elastic best-effort job
lends one host by shrinking. The host leaves the lender at once (releasing: never placed on by
it again, its agent's words no longer routed to it), the lender is told to shrink off it (never
paused), the host goes to the borrower once its agent released it, and a host that is idle
later goes back to the lender, which runs shrunk, so it grows back."""
import queue
from types import SimpleNamespace

from hotspare.policy.phase import JobPhase
from hotspare.protocol import auth
from hotspare.service import hostlife as life
from hotspare.service.hostlife import Agent, HostPhase, HostState
from hotspare.service.lending import ShortOf
from hotspare.service.priority import CLASSES, JobPolicy
from hotspare.service.service import Service, _Host


class Link:
    """An agent's link: what the service sends it."""

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


class StandIn:
    def __init__(self, job, priority, preemptible, hosts, elastic=None):
        self.job, self.policy, self.nodes = job, JobPolicy(CLASSES[priority], preemptible, elastic), list(hosts)
        self.pausing, self.started_at, self.spare_hosts, self.loans = None, 0.0, {}, []
        self.coord = SimpleNamespace(view=SimpleNamespace(phase=JobPhase.RECOVERING))
        self.cfg = SimpleNamespace(script="train.py", script_args=[])
        self.worker_env, self.telemetry_period, self.events = {}, 0.0, queue.Queue()
        self.shrunk_off, self.ranks, self.regrow, self.returned = [], {h: 1 for h in hosts}, 0, set()

    def pause(self, loan):
        self.pausing = loan
        self.loans.append(loan)

    def note_loan(self, loan):
        self.loans.append(loan)

    def shrinkable(self):
        return (self.policy.elastic, tuple(sorted(self.ranks.items()))) if self.policy.elastic else (None, ())

    def regrow_slots(self):
        return self.regrow - len(self.returned)      # (the runner: hosts given back with no spare yet)

    def shrink_off(self, loan, channels):
        self.loans.append(loan)
        self.shrunk_off.append((loan, channels))


def test_an_elastic_lender_shrinks_off_one_host_which_goes_to_the_borrower_then_a_free_host_comes_back_to_it(
        tmp_path, secret_file):
    svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, str(tmp_path / "state"),
                  log=lambda line: None)
    try:
        jobs = {"j1": StandIn("j1", "production", False, ["a", "b"]),
                "low": StandIn("low", "best-effort", True, ["c", "d"], elastic=1)}
        links = {}
        for job, r in jobs.items():
            svc.runners[job] = r
            for host in r.nodes:
                links[host] = Link()
                svc.hosts[host] = _Host(Agent(host, (f"{host}/cpu0",), False, 1, False), links[host],
                                        HostState(HostPhase.BUSY, job))
        svc._short(ShortOf("j1", 1, 2, 0.0))
        low, j1 = jobs["low"], jobs["j1"]
        ((loan, channels),) = low.shrunk_off
        assert low.pausing is None and loan.lender_gives == "shrink" and loan.hosts == ("c",)
        assert channels == {"c": links["c"]} and j1.loans == [loan] == low.loans
        assert svc.hosts["c"].state == HostState(HostPhase.RELEASING, "low", svc.hosts["c"].state.since)
        assert svc._route("c") is svc.pool_events                 # its agent's words no longer reach the lender
        assert list(svc._promised) == ["c"]
        svc._lend()                                                # decided again: never given twice
        assert len(low.shrunk_off) == 1 and list(svc._promised) == ["c"]

        svc._apply("c", life.Released("low"))                      # the agent ended the lender's worker there
        with svc._lock:
            svc._honour_loans()
        assert svc.hosts["c"].state.phase is HostPhase.BUSY and svc.hosts["c"].state.job == "j1"
        assert [m["type"] for m in links["c"].sent] == ["assign"] and j1.spare_hosts == {"c": 1}
        assert "c" not in svc._promised

        low.regrow = 1                                             # it runs shrunk, a replacement waits
        svc.hosts["e"] = _Host(Agent("e", ("e/cpu0",), False, 1, False), Link(), HostState(HostPhase.IDLE))
        svc.hosts["c2"] = _Host(Agent("c2", ("c2/cpu0",), False, 1, False), Link(), HostState(HostPhase.IDLE))
        with svc._lock:
            svc._give_back()
        assert svc.hosts["c2"].state.phase is HostPhase.BUSY and svc.hosts["c2"].state.job == "low"
        assert low.spare_hosts == {"c2": 1} and svc.hosts["e"].state.phase is HostPhase.IDLE
        with svc._lock:
            svc._give_back()                                       # c2 is on its way: e is not given too
        assert svc.hosts["e"].state.phase is HostPhase.IDLE and low.returned == {"c2"}
    finally:
        svc.stop()


def test_a_lender_without_elastic_is_paused_as_before(tmp_path, secret_file):
    svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, str(tmp_path / "state"),
                  log=lambda line: None)
    try:
        jobs = {"j1": StandIn("j1", "production", False, ["a", "b"]),
                "low": StandIn("low", "best-effort", True, ["c", "d"])}
        for job, r in jobs.items():
            svc.runners[job] = r
            for host in r.nodes:
                svc.hosts[host] = _Host(Agent(host, (f"{host}/cpu0",), False, 1, False), Link(),
                                        HostState(HostPhase.BUSY, job))
        svc._short(ShortOf("j1", 1, 2, 0.0))
        low = jobs["low"]
        assert low.shrunk_off == [] and low.pausing is not None and low.pausing.lender_gives == "pause"
        assert svc.hosts["c"].state.phase is HostPhase.BUSY          # released only when the paused job ends
    finally:
        svc.stop()
