"""`hotspare report` and `hotspare events` refuse what they cannot read and say what to give."""
import os
import subprocess
import sys

HOTSPARE = [sys.executable, "-m", "hotspare"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_a_file_that_is_not_a_report_or_a_stream_of_a_newer_schema_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"steps": 3}')
    r = subprocess.run([*HOTSPARE, "report", str(bad)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "is not a hotspare run report" in r.stderr
    newer = tmp_path / "x.events.jsonl"
    newer.write_text('{"schema": 99, "kind": "failure", "t": 1.0, "data": {}}\n')
    r = subprocess.run([*HOTSPARE, "events", str(newer)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "upgrade hotspare" in r.stderr
    r = subprocess.run([*HOTSPARE, "events", "--follow", "--wait", "0.5", str(tmp_path / "none.json")],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "no event stream at" in r.stderr and "none.events.jsonl" in r.stderr


def test_metrics_on_a_wildcard_address_is_refused_before_anything_starts(tmp_path):
    r = subprocess.run([*HOTSPARE, "run", "--nproc", "2", "--spares", "0", "--metrics", "0.0.0.0:9464", "--",
                        "examples/gpt_stdlib.py"], capture_output=True, text=True, env=ENV, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 2 and "not a wildcard" in r.stderr, r.stdout + r.stderr
