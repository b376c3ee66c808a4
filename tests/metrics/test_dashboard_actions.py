"""Cordon, drain and uncordon from the coordinator service's dashboard, over real HTTP against a
real service (in this process) with a real agent (hosta, two device slots): without the token an
action is refused and logged; logged in, it is refused (and logged) without the session's nonce,
from another origin, with a body that is not the one the page sends, and without the
confirmation; confirmed, it moves the device in the service's registry, placement stops giving
the device work, and the dashboard's next cluster record shows it."""
import time

import pytest

from svcdash import DEVICE, Cluster

from hotspare.observe.dashboard import MAX_BODY


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("dashboard-actions"))
    try:
        c.pool.start_agent("hosta", devices=2)
        c.shown(DEVICE, "healthy")
        yield c
    finally:
        c.close()


def confirmed(action: str, target: str = DEVICE, **more) -> dict:
    return {"action": action, "target": target, "confirm": target, **more}


def test_without_the_token_an_action_is_refused_and_logged(cluster):
    for cookie in (None, "hotspare_session=not-a-session"):
        status, body = cluster.act(confirmed("cordon"), cookie=cookie)
        assert status == 403 and "log in first" in body
    cluster.said.wait_for(r"DASHBOARD refused POST /api/action from 127\.0\.0\.1:\d+: not logged in", 5)
    assert cluster.state() in ("healthy", "no record")


def test_logged_in_an_action_needs_the_nonce_the_origin_and_the_pages_body(cluster):
    cookie, nonce = cluster.login()
    _, other_nonce = cluster.login()
    port = cluster.dash.port
    refusals = [
        (dict(fields=confirmed("cordon"), cookie=cookie), 403, "nonce"),
        (dict(fields=confirmed("cordon"), cookie=cookie, nonce=other_nonce), 403, "nonce"),
        (dict(fields=confirmed("cordon"), cookie=cookie, nonce=nonce, Origin="http://evil.example"), 403, "origin"),
        (dict(fields=confirmed("cordon"), cookie=cookie, nonce=nonce, **{"Content-Type": "text/plain"}), 415, "json"),
        (dict(fields=confirmed("cordon", reason="x" * MAX_BODY), cookie=cookie, nonce=nonce), 413, "bytes"),
        (dict(fields=confirmed("retire"), cookie=cookie, nonce=nonce), 400, "action must be"),
        (dict(fields={**confirmed("cordon"), "force": True}, cookie=cookie, nonce=nonce), 400, "not 'force'"),
        (dict(fields=confirmed("cordon", "hostz/cpu9"), cookie=cookie, nonce=nonce), 409, "no host or device"),
        (dict(fields=confirmed("cordon", reason="a\nb"), cookie=cookie, nonce=nonce), 400, "printable"),
    ]
    for kw, code, why in refusals:
        status, body = cluster.act(**kw)
        assert status == code and why in body["message"], (kw, status, body)
    r, body = cluster.request("POST", "/api/action", "{not json", {"Cookie": cookie, "X-Hotspare-Nonce": nonce,
                                                                    "Content-Type": "application/json"})
    assert r.status == 400
    logged = [line for line in cluster.said.lines if line.startswith("DASHBOARD refused POST /api/action")]
    assert len(logged) >= len(refusals) + 1
    assert cluster.state() in ("healthy", "no record")
    same = cluster.act(confirmed("cordon"), cookie=cookie, nonce=nonce, Origin=f"http://127.0.0.1:{port}")
    assert same[0] == 200, same                     # the page's own origin is fine
    cluster.act(confirmed("uncordon"), cookie=cookie, nonce=nonce)


def test_without_the_confirmation_an_action_is_refused_with_a_clear_message(cluster):
    cookie, nonce = cluster.login()
    status, body = cluster.act({"action": "drain", "target": DEVICE}, cookie=cookie, nonce=nonce)
    assert status == 400 and "confirm" in body["message"]
    for confirm in ("", "yes", True, "hosta"):
        status, body = cluster.act({**confirmed("drain"), "confirm": confirm}, cookie=cookie, nonce=nonce)
        assert status == 400 and body["message"].startswith(f"drain {DEVICE} not confirmed"), body
    assert cluster.state() in ("healthy", "no record")
    cluster.said.wait_for(r"refused POST /api/action from 127\.0\.0\.1:\d+: drain hosta/cpu1 not confirmed", 5)


def test_confirmed_cordon_drain_uncordon_move_the_device_in_the_services_registry(cluster):
    cookie, nonce = cluster.login()

    def free_devices():
        return [h.devices for h in cluster.pool.svc.free_hosts() if h.name == "hosta"][0]
    assert free_devices() == ("hosta/cpu0", "hosta/cpu1")
    status, body = cluster.act(confirmed("cordon", reason="fan noise"), cookie=cookie, nonce=nonce)
    assert status == 200 and body["moved"] == [{"device": DEVICE, "from": "healthy", "to": "cordoned"}], body
    rec = cluster.registry.get(DEVICE)
    assert (rec.state.value, rec.actor) == ("cordoned", "operator") and rec.reason.startswith("fan noise")
    assert free_devices() == ("hosta/cpu0",)               # placement gives it no new work
    cluster.said.wait_for(r"DASHBOARD cordon hosta/cpu1 by 127\.0\.0\.1:\d+: hosta/cpu1 healthy -> cordoned "
                          r"\(fan noise\)", 5)
    cluster.shown(DEVICE, "cordoned")

    status, body = cluster.act(confirmed("drain"), cookie=cookie, nonce=nonce)
    assert status == 200 and cluster.state() == "draining"
    cluster.shown(DEVICE, "draining")
    status, body = cluster.act(confirmed("uncordon"), cookie=cookie, nonce=nonce)
    assert status == 200 and body["moved"][0]["from"] == "draining" and cluster.state() == "healthy"
    assert free_devices() == ("hosta/cpu0", "hosta/cpu1")
    cluster.shown(DEVICE, "healthy")

    status, body = cluster.act(confirmed("cordon", "hosta"), cookie=cookie, nonce=nonce)     # a whole host
    assert status == 200 and [m["device"] for m in body["moved"]] == ["hosta/cpu0", "hosta/cpu1"]
    assert cluster.pool.svc.free_hosts()[0].devices == ()
    status, body = cluster.act(confirmed("uncordon", "hosta"), cookie=cookie, nonce=nonce)
    assert status == 200 and cluster.state("hosta/cpu0") == cluster.state() == "healthy"


def test_a_quarantined_device_is_not_uncordoned_from_the_dashboard(cluster):
    cookie, nonce = cluster.login()
    cluster.registry.ensure("hosta/cpu0")
    cluster.registry.quarantine("hosta/cpu0", "test: diagnostics due", actor="operator")
    try:
        status, body = cluster.act(confirmed("uncordon", "hosta/cpu0"), cookie=cookie, nonce=nonce)
        assert status == 409 and "quarantined" in body["message"] and "diagnostics" in body["message"], body
        assert cluster.state("hosta/cpu0") == "quarantined"
    finally:
        for _ in range(cluster.registry.passes_required):
            cluster.registry.diagnostics_passed("hosta/cpu0")
    assert cluster.state("hosta/cpu0") == "healthy"


@pytest.mark.slow
def test_a_drain_from_the_dashboard_moves_a_running_rank_to_the_spare(tmp_path):
    """A job of the service (2 ranks on hosta, a warm spare on the spare host hostb): draining rank 1's
    device from the dashboard live-migrates the rank off it at a step boundary, as `hotspare
    drain` does; the dashboard's stream carries the job's migration, and the device ends out of
    the job, quarantined for its diagnostics (or back after passing them)."""
    c = Cluster(tmp_path)
    try:
        c.pool.start_agent("hosta", devices=2)
        c.pool.start_agent("hostb", devices=1, spare=True)
        job = c.pool.submit(steps=400, per_node=2, spares=1)

        def placed():
            gens = [r for r in c.dash.snapshot() if r["kind"] == "generation" and r.get("job") == job]
            commits = [r for r in c.dash.snapshot() if r["kind"] == "worker_said" and r.get("job") == job]
            return gens and commits and {p["rank"]: p["device"] for p in gens[-1]["data"]["placement"]}
        deadline = time.monotonic() + 180
        while not (where := placed()):
            assert time.monotonic() < deadline, c.pool.log.text()[-3000:]
            time.sleep(0.3)
        device = where[1]
        cookie, nonce = c.login()
        status, body = c.act(confirmed("drain", device, reason="fan replacement"), cookie=cookie, nonce=nonce)
        assert status == 200 and body["moved"][-1]["to"] == "draining", body
        row = c.pool.wait_ended(job, timeout=300)
        assert row["state"] == "finished", (row, c.pool.log.text()[-3000:])
        report = c.pool.request("status", job=job)["report"]
        (m,) = report["migrations"]
        assert (m["rank"], m["device"], m["rule"], m["outcome"], m["lost_steps"]) == (
            1, device, "operator-drain", "migrated", 0), m
        assert report["steps_lost"] == 0 and report["steps_repeated"] == 0
        assert [r["data"]["device"] for r in c.dash.snapshot() if r["kind"] == "migration"
                and r.get("job") == job] == [device]
        history = [t.dst.value for t in c.registry.get(device).history]
        assert history[:3] == ["cordoned", "draining", "quarantined"], history
    finally:
        c.close()
