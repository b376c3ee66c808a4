"""`hotspare events --dashboard` against the coordinator service's dashboard (the real service in
this process, a real agent, a real job of the example GPT; the CLI as its own process): it
follows one job's records, as the dashboard holds them, from its run_start to its run_end and
says the job ended; --kind filters as on a file; a request without the token is refused and
logged, and so is the CLI with another secret; it ends when the service stops, and on Ctrl-C.
Against a run's dashboard (in this process, fed records): the token file, the run's end, and a
record longer than the line limit skipped, never held."""
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from svcdash import Cluster

from hotspare.coordinator.events import check_record
from hotspare.observe import text

HOTSPARE = [sys.executable, "-m", "hotspare", "events"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class Follower:
    """``hotspare events ARGS`` running: its stdout line by line, its stderr in a file."""

    def __init__(self, args: list[str], tmp: Path):
        self.err_path = tmp / f"events-{secrets.token_hex(4)}.err"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([*HOTSPARE, *args], stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()

    def wait_for(self, word: str, timeout: float) -> None:
        """Until a line holds ``word``."""
        with self._seen:
            if not self._seen.wait_for(lambda: any(word in line for line in self.lines) or self.proc.poll() is not None,
                                       timeout) or not any(word in line for line in self.lines):
                raise AssertionError(f"no line with {word!r}: {self.lines[-5:]}\n{self.err_path.read_text()}")

    def wait(self, timeout: float) -> tuple[int, list[str], str]:
        """Its exit status, every line it printed, its stderr."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hotspare events still running after {timeout:.0f} s:\n"
                                 + "\n".join(self.lines[-20:]) + f"\n{self.err_path.read_text()}") from None
        self._reader.join(10)
        self.proc.stdout.close()
        return code, self.lines, self.err_path.read_text()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("events-follow"))
    try:
        c.pool.start_agent("hosta", devices=2)
        c.tmp = tmp_path_factory.mktemp("followers")
        c.address = f"127.0.0.1:{c.dash.port}"
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def job(service):
    """A job of the service, followed live from its submission to its end (text lines)."""
    job = service.pool.submit(steps=12, per_node=2)
    f = Follower(["--follow", "--dashboard", service.address, "--secret-file", str(service.secret_file),
                  "--job", job], service.tmp)
    code, lines, err = f.wait(240)
    service.followed = (code, lines, err)
    assert service.pool.wait_ended(job)["state"] == "finished"
    return job


def kept(service, job: str) -> list[dict]:
    return [r for r in service.dash.snapshot() if r.get("job") == job]


def test_following_a_job_prints_its_records_as_the_file_mode_does_until_it_ends(service, job):
    code, lines, err = service.followed
    assert code == 0 and f"job {job} ended" in err, (code, err, lines[-5:])
    want = [r for r in kept(service, job) if not text.chatty(r)]
    start = want[0]["t"]
    assert want[0]["kind"] == "run_start" and want[-1]["kind"] == "run_end"
    # the file mode's printer, line for line (live, a record may come after one stamped later: the
    # dashboard's replay is in time order, the live stream in the order the records were made)
    assert sorted(lines) == sorted(text.line(r, start) for r in want), "\n".join(lines)
    assert " run_start " in lines[0] and " run_end " in lines[-1], lines
    assert any(r["kind"] == "generation" for r in want) and not any(line.startswith("[") for line in lines)


def test_kind_filters_and_json_prints_the_records_themselves(service, job):
    f = Follower(["--follow", "--dashboard", service.address, "--secret-file", str(service.secret_file),
                  "--job", job, "--json", "--kind", "generation", "--kind", "run_end"], service.tmp)
    code, lines, err = f.wait(60)
    assert code == 0 and f"job {job} ended" in err, (code, err)
    got = [check_record(json.loads(line)) for line in lines]
    assert got == [r for r in kept(service, job) if r["kind"] in ("generation", "run_end")]
    assert got[-1]["kind"] == "run_end" and got[-1]["data"]["exit_code"] == 0

    f = Follower(["--dashboard", service.address, "--secret-file", str(service.secret_file), "--kind",
                  "run_start"], service.tmp)                 # no --follow: what the dashboard keeps, every job's
    code, lines, err = f.wait(60)
    assert code == 0 and lines and all(" run_start " in line for line in lines), (code, err, lines)
    assert any(line.startswith(f"[{job}] ") for line in lines), lines


def test_without_the_token_the_stream_is_refused_and_logged(service, tmp_path):
    r, body = service.request("GET", "/events")
    assert r.status == 401 and "run_start" not in body
    service.said.wait_for(r"DASHBOARD refused GET /events from 127\.0\.0\.1:\d+: not logged in", 5)
    other = tmp_path / "other-secret"
    other.write_text(secrets.token_hex(32))
    other.chmod(0o600)
    f = Follower(["--follow", "--dashboard", service.address, "--secret-file", str(other)], service.tmp)
    code, lines, err = f.wait(60)
    assert code == 2 and "refused the token" in err and lines == [], (code, err, lines)
    service.said.wait_for(r"DASHBOARD refused GET /events from 127\.0\.0\.1:\d+: wrong token", 5)


def test_it_ends_when_the_service_stops_and_on_ctrl_c(tmp_path):
    c = Cluster(tmp_path)
    try:
        args = ["--follow", "--dashboard", f"127.0.0.1:{c.dash.port}", "--secret-file", str(c.secret_file)]
        stopped, interrupted = Follower(args, tmp_path), Follower(args, tmp_path)
        for f in (stopped, interrupted):
            f.wait_for(" cluster ", 60)                  # the service's cluster record: it is following
        assert stopped.lines[0].endswith(" cluster            0 host(s), 0 device(s), all healthy"), stopped.lines
        interrupted.proc.send_signal(signal.SIGINT)
        code, _, err = interrupted.wait(30)
        assert code == 130 and "interrupted" in err and "Traceback" not in err, err
    finally:
        c.close()
    code, _, err = stopped.wait(30)
    assert code == 0 and "closed: its service (or run) stopped" in err, (code, err)


def test_a_runs_dashboard_with_its_token_file_until_the_run_ends_a_huge_record_skipped(tmp_path):
    from hotspare.coordinator import events as ev
    from hotspare.observe.dashboard import Dashboard, dashboard_token
    from hotspare.observe.remote import MAX_LINE

    token = dashboard_token(secrets.token_bytes(32))
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    said = []
    dash = Dashboard("127.0.0.1", 0, token, said.append)
    t0 = 1796300000.0
    try:
        dash(ev.record("run_start", t0, {"job": {"script": "train.py", "nproc": 4, "spares": 1}, "schema": ev.SCHEMA}))
        f = Follower(["--follow", "--dashboard", dash.address, "--token-file", str(token_file)], tmp_path)
        f.wait_for(" run_start ", 60)
        dash(ev.record("health_event", t0 + 1, {"device": "n0/gpu2", "action": "fence", "rule": "xid",
                                                "reason": "x" * (MAX_LINE + 10)}))
        dash(ev.record("failure", t0 + 2, {"rank": 2, "worker": "w2", "step": 15, "kind": "SIGKILL"}))
        dash(ev.record("run_end", t0 + 3, {"exit_code": 0, "outcome": "finished", "steps_completed": 20,
                                           "failures_total": 1, "recovered_zero_loss": 1, "steps_lost": 0,
                                           "steps_repeated": 0}))
        code, lines, err = f.wait(60)
    finally:
        dash.close()
    assert code == 0 and "the run ended" in err, (code, err)
    assert "longer than 1048576 bytes was skipped" in err and "1 record(s) longer" in err, err
    assert [line.split()[2] for line in lines] == ["run_start", "failure", "run_end"], lines
    assert lines[1].endswith("rank 2 (w2) SIGKILL at step 15") and "+2.000s" in lines[1], lines
