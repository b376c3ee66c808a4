"""The service's SQLite state: what a restarted service reads back."""
from hotspare.service import db as states
from hotspare.service.db import StateDB


def test_jobs_hosts_and_a_jobs_state_survive_reopening(tmp_path):
    db = StateDB(tmp_path)
    db.host("a", ["a/cpu0"], False, "idle")
    job = db.next_job_id()
    db.submit(job, {"script": "/x.py", "args": [], "nodes": 1, "nproc_per_node": 1, "spares": 0})
    assert db.start_if_queued(job, {"hosts": ["a"], "spare_hosts": []}, {"host": "10.0.0.1", "port": 1234, "pid": 99})
    db.save_state(job, {"format": 1, "view": {"generation": 2}})
    db.event("placed", job)
    db.close()
    again = StateDB(tmp_path)
    (row,) = again.jobs((states.RUNNING,))
    assert row.id == job == "j1" and row.placement == {"hosts": ["a"], "spare_hosts": []}
    assert row.store["port"] == 1234 and again.load_state(job) == {"format": 1, "view": {"generation": 2}}
    assert again.hosts()[0]["name"] == "a" and again.next_job_id() == "j2"
    again.ended(job, states.FINISHED, 0, "", {"steps_completed": 3})
    assert again.load_state(job) is None and again.report(job) == {"steps_completed": 3}
    assert [what for _, _, what in again.events(job)] == ["placed"]


def test_a_restarted_service_shows_every_host_gone_until_its_agent_registers(tmp_path, secret_file):
    from hotspare.protocol import auth
    from hotspare.service.service import Service
    db = StateDB(tmp_path)
    db.host("a", ["a/cpu0"], False, "job j1")
    db.close()
    svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, str(tmp_path), log=lambda line: None)
    try:
        assert [(h["name"], h["state"]) for h in svc.db.hosts()] == [("a", "gone")]
    finally:
        svc.stop()
