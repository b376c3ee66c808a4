"""The run's dashboard over real HTTP: without the token a request gets nothing but the login;
a state-changing request without it is refused and logged; a wrong token is refused and logged;
with it the page, its script, the records so far and the live stream (replay, then each new
record) come through; logged in, the dashboard stays read-only."""
import http.client
import json
import urllib.parse

import pytest

from hotspare.coordinator import events as ev
from hotspare.errors import ConfigError
from hotspare.observe.dashboard import Dashboard, dashboard_token

T = 1796300000.0


@pytest.fixture
def dash():
    said = []
    d = Dashboard("127.0.0.1", 0, dashboard_token(b"s" * 32), said.append)
    d.said = said
    d(ev.record("run_start", T, {"job": {"script": "train.py"}, "schema": ev.SCHEMA}))
    d(ev.record("failure", T + 1, {"rank": 2, "worker": "w2", "step": 15, "kind": "SIGKILL"}))
    yield d
    d.close()


def request(d, method, path, body=None, cookie=None):
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
    headers = {"Content-Type": "application/x-www-form-urlencoded"} if body is not None else {}
    if cookie:
        headers["Cookie"] = cookie
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    return r, r.read().decode(), conn


def login(d, token):
    r, _, _ = request(d, "POST", "/login", urllib.parse.urlencode({"token": token}))
    return r


def test_without_the_token_there_is_nothing_but_the_login(dash):
    r, _, _ = request(dash, "GET", "/")
    assert r.status == 303 and r.getheader("Location") == "/login"
    for path in ("/events", "/api/records", "/app.js"):
        r, body, _ = request(dash, "GET", path)
        assert r.status == 401 and "SIGKILL" not in body, path
    r, body, _ = request(dash, "GET", "/login")
    assert r.status == 200 and 'name="token"' in body and r.getheader("X-Frame-Options") == "DENY"


def test_a_state_changing_request_without_the_token_is_refused_and_logged(dash):
    for method, path in (("POST", "/cordon"), ("DELETE", "/devices/n0-gpu1"), ("PUT", "/drain")):
        r, _, _ = request(dash, method, path, body="device=n0/gpu1")
        assert r.status == 403
    refused = [line for line in dash.said if line.endswith("not logged in")]
    assert [line.split(" from ")[0] for line in refused] == [
        "DASHBOARD refused POST /cordon", "DASHBOARD refused DELETE /devices/n0-gpu1", "DASHBOARD refused PUT /drain"]
    assert all(" from 127.0.0.1:" in line for line in refused)
    r = login(dash, "not-the-token")
    assert r.status == 401 and r.getheader("Set-Cookie") is None
    assert any("refused a login from 127.0.0.1" in line for line in dash.said)


def test_with_the_token_the_page_the_records_and_the_live_stream_come_through(dash):
    r = login(dash, dashboard_token(b"s" * 32))
    assert r.status == 303
    cookie = r.getheader("Set-Cookie").split(";")[0]
    assert "HttpOnly" in r.getheader("Set-Cookie") and "SameSite=Strict" in r.getheader("Set-Cookie")
    r, body, _ = request(dash, "GET", "/", cookie=cookie)
    assert r.status == 200 and '<script src="/app.js">' in body
    r, body, _ = request(dash, "GET", "/app.js", cookie=cookie)
    assert r.status == 200 and "EventSource" in body
    r, body, _ = request(dash, "GET", "/api/records", cookie=cookie)
    assert [rec["kind"] for rec in json.loads(body)] == ["run_start", "failure"]

    conn = http.client.HTTPConnection("127.0.0.1", dash.port, timeout=10)
    conn.request("GET", "/events", headers={"Cookie": cookie})
    stream = conn.getresponse()
    assert stream.getheader("Content-Type") == "text/event-stream"
    lines = [stream.fp.readline() for _ in range(4 + 3)]        # the replay: two records, then its marker
    assert lines[4:6] == [b"event: replayed\n", b"data: the records so far were sent\n"]
    dash(ev.record("recovered", T + 2, {"rank": 2, "worker": "w2", "step": 15, "downtime_s": 0.3}))
    lines = lines[:4] + [stream.fp.readline() for _ in range(2)]    # and the new one
    kinds = [json.loads(line[6:])["kind"] for line in lines if line.startswith(b"data: ")]
    assert kinds == ["run_start", "failure", "recovered"]
    conn.close()

    r, _, _ = request(dash, "POST", "/cordon", body="device=n0/gpu1", cookie=cookie)
    assert r.status == 405 and any("read-only" in line for line in dash.said)


def test_a_program_reads_the_stream_with_the_token_as_a_bearer_token_and_nothing_else(dash):
    def get(path, authorization):
        conn = http.client.HTTPConnection("127.0.0.1", dash.port, timeout=10)
        conn.request("GET", path, headers={"Authorization": authorization})
        r = conn.getresponse()
        return r, (r.read().decode() if path != "/events" else r.fp.readline().decode()), conn
    token = dashboard_token(b"s" * 32)
    r, body, _ = get("/api/records", f"Bearer {token}")
    assert r.status == 200 and [rec["kind"] for rec in json.loads(body)] == ["run_start", "failure"]
    r, first, conn = get("/events", f"Bearer {token}")
    assert r.status == 200 and json.loads(first[6:])["kind"] == "run_start"
    conn.close()
    for path in ("/events", "/api/records"):
        for authorization in (f"Bearer {token[:-1]}x", "Bearer ", f"Basic {token}"):
            r, body, _ = get(path, authorization)
            assert r.status == 401 and "SIGKILL" not in body, (path, authorization)
    wrong = [line for line in dash.said if line.startswith("DASHBOARD refused GET")]
    assert [line.split(" from ")[0] for line in wrong] == ["DASHBOARD refused GET /events"] * 3 + [
        "DASHBOARD refused GET /api/records"] * 3
    assert [line.rsplit(": ", 1)[1] for line in wrong] == ["wrong token", "wrong token", "not logged in"] * 2
    r, _, _ = get("/", f"Bearer {token}")                       # not the page: that takes a login
    assert r.status == 303 and r.getheader("Location") == "/login"
    conn = http.client.HTTPConnection("127.0.0.1", dash.port, timeout=10)
    conn.request("POST", "/cordon", body="device=n0/gpu1", headers={"Authorization": f"Bearer {token}"})
    assert conn.getresponse().status == 403


def test_a_wildcard_address_is_refused():
    from hotspare.observe.metrics import parse_address
    with pytest.raises(ConfigError, match="--dashboard 0.0.0.0:8080: .*not a wildcard"):
        parse_address("0.0.0.0:8080", "--dashboard")


def test_the_service_dashboard_keeps_its_last_jobs_and_logins_only():
    from hotspare.observe.dashboard import JOBS_KEPT, SESSIONS_KEPT
    d = Dashboard("127.0.0.1", 0, dashboard_token(b"s" * 32), lambda line: None)
    try:
        jobs = [f"j{i}" for i in range(1, JOBS_KEPT + 3)]
        for i, job in enumerate(jobs):
            t = T + 10 * i
            d({**ev.record("run_start", t, {"job": {"script": "train.py"}, "schema": ev.SCHEMA}), "job": job})
            d({**ev.record("failure", t + 1, {"rank": 1, "worker": f"{job}.w1", "step": 3, "kind": "killed"}), "job": job})
            d({**ev.record("readings", t + 2, {"node": "hosta", "readings": []}), "job": job})
        d(ev.record("cluster", T + 100, {"hosts": [], "devices": []}))
        kept = d.snapshot()
        assert {r["job"] for r in kept if "job" in r} == set(jobs[-JOBS_KEPT:])
        assert [r["kind"] for r in kept if r.get("job") == jobs[-1]] == ["run_start", "failure", "readings"]
        assert kept[-1]["kind"] == "cluster"
        sessions = [d.login(dashboard_token(b"s" * 32)) for _ in range(SESSIONS_KEPT + 1)]
        assert not d.valid(sessions[0]) and d.valid(sessions[1]) and d.valid(sessions[-1])
        assert d.nonce(sessions[-1]) != d.nonce(sessions[-2])
    finally:
        d.close()
