"""Admission and quarantine checks on CPU devices: a healthy node passes with real worker processes
and a real gloo all-reduce; faults injected into the checks' own code paths (a corrupted matmul
element, a flipped memory bit) are caught; peers that disagree are named."""
import json
import os
import shutil
import stat
import textwrap

import pytest
import torch

from hotspare.errors import ConfigError
from hotspare.health.checks import DeviceReport, run_admission
from hotspare.health.checks.admission import CHECKS, parse_injections
from hotspare.health.checks.burnin import burn_in
from hotspare.health.checks.dcgm import dcgm_diag, parse_diag
from hotspare.health.checks.inventory import compare, slower_than_peers
from hotspare.health.checks.memory import PATTERNS, memory_test
from hotspare.health.checks.result import CheckCancelled


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_admission_on_two_cpu_devices_passes_with_real_processes():
    lines = []
    # margin 0.5, not the default 0.2: these two "devices" share two cores with other test runs
    reports = run_admission(2, kind="cpu", node="t1", margin=0.5, progress=lines.append)
    assert [r.device for r in reports] == ["t1/cpu0", "t1/cpu1"]
    for r in reports:
        assert r.passed, r.reasons
        assert [c.name for c in r.results] == list(CHECKS)
        by = {c.name: c for c in r.results}
        assert by["burn-in"].measurements["bad_elements"] == 0
        assert by["burn-in"].measurements["max_err_over_tol"] < 1
        assert by["memory"].measurements["wrong_words"] == 0
        coll = by["collective"].measurements
        assert (coll["world"], coll["backend"], coll["wrong_elements"]) == (2, "gloo", 0)
        assert coll["busbw_gbps"] > 0
        assert by["inventory"].measurements["torch"] == torch.__version__
        again = DeviceReport.from_dict(json.loads(json.dumps(r.to_dict())))
        assert again.passed and again.to_dict() == r.to_dict()
    assert any(line.startswith("[cpu1] collective: pass") for line in lines)
    assert lines[-1] == "[cpu1] admission: PASS"


def test_burn_in_catches_a_corrupted_matmul_result():
    ok = burn_in("t1/cpu0", n=128, reps=3)
    assert ok.passed and ok.measurements["gflops"] > 0
    bad = burn_in("t1/cpu0", n=128, reps=3, inject="bitflip")   # flips bit 22 of C[42, 25] in rep 3
    assert not bad.passed
    assert bad.measurements["bad_elements"] == 1
    assert "first in rep 3 at [42, 25]" in bad.detail and "beyond the float64 reference" in bad.detail


def test_memory_test_catches_a_flipped_bit_in_every_pattern():
    ok = memory_test("t1/cpu0", nbytes=1 << 20)
    assert ok.passed and ok.measurements["passes"] == 68
    bad = memory_test("t1/cpu0", nbytes=1 << 20, inject="bitflip")
    assert not bad.passed
    assert bad.measurements["wrong_by_pattern"] == {p: 1 for p in PATTERNS}
    assert "at byte offset 524288: wrote 0x00000000, read 0x00002000 (bit 13 flipped)" in bad.detail


def test_a_set_stop_event_ends_burn_in_and_memory_test_part_way(monkeypatch):
    import threading
    stop, mms = threading.Event(), []
    real_mm = torch.mm

    def counting_mm(*a, **k):      # set the stop during the 5th multiply of a 10-minute burn-in
        mms.append(1)
        if len(mms) == 5:
            stop.set()
        return real_mm(*a, **k)
    monkeypatch.setattr(torch, "mm", counting_mm)
    with pytest.raises(CheckCancelled, match="burn-in cancelled"):
        burn_in("t1/cpu0", n=64, reps=1, seconds=600, stop=stop)
    assert len(mms) == 5            # the warm-up and four checked reps: it stopped at the next one
    monkeypatch.undo()
    with pytest.raises(CheckCancelled, match="memory test cancelled"):
        memory_test("t1/cpu0", nbytes=1 << 20, stop=stop)
    assert memory_test("t1/cpu0", nbytes=1 << 20, stop=threading.Event()).passed


def test_inventory_names_the_odd_device_and_fails_both_of_two_that_disagree():
    base = {"torch": "2.13.0", "cpu_model": "Xeon", "logical_cores": 64}
    facts = {f"n/cpu{i}": dict(base, device=f"n/cpu{i}") for i in range(3)}
    facts["n/cpu2"]["torch"] = "2.12.0"
    r = compare(facts)
    assert r["n/cpu0"].passed and r["n/cpu1"].passed
    assert not r["n/cpu2"].passed and "torch='2.12.0' but cpu0='2.13.0'" in r["n/cpu2"].detail
    two = compare({d: facts[d] for d in ("n/cpu0", "n/cpu2")})
    assert not two["n/cpu0"].passed and not two["n/cpu2"].passed


def test_a_device_slower_than_its_peers_median_is_flagged():
    v = slower_than_peers({"a": 100.0, "b": 96.0, "c": 70.0}, 0.2, "matmul", "GFLOP/s")
    assert v["a"] is None and v["b"] is None
    assert "29% below the median of its 2 peer(s), 98 GFLOP/s" in v["c"]


def test_injection_specs_are_checked():
    devs = ["t1/cpu0", "t1/cpu1"]
    assert parse_injections(["burnin:cpu1", "memory:t1/cpu1"], devs) == {"t1/cpu1": {"burnin", "memory"}}
    with pytest.raises(ConfigError, match="CHECK:DEVICE"):
        parse_injections(["disk:cpu1"], devs)
    with pytest.raises(ConfigError, match="not one of the devices"):
        parse_injections(["burnin:cpu7"], devs)
    with pytest.raises(ConfigError, match="injection"):
        burn_in("t1/cpu0", n=8, reps=1, inject="typo")


# dcgmi's text layout: a table of | test | result | rows, explanations in | Warning | / | Error | rows.
DIAG_FAIL = textwrap.dedent("""\
    Successfully ran diagnostic for group.
    +---------------------------+------------------------------------------------+
    | Diagnostic                | Result                                         |
    +===========================+================================================+
    |-----  Deployment  --------+------------------------------------------------|
    | Denylist                  | Pass                                           |
    | Persistence Mode          | Pass                                           |
    | Page Retirement/Row Remap | Fail                                           |
    | Error                     | GPU 0 had uncorrectable memory errors and row  |
    |                           | remapping failed.                              |
    +-----  Hardware  ----------+------------------------------------------------+
    | GPU Memory                | Pass - All                                     |
    | Diagnostic                | Skip - All                                     |
    +-----  Stress  ------------+------------------------------------------------+
    | Targeted Power            | Warn - GPU: 0                                  |
    +---------------------------+------------------------------------------------+
""")


def test_dcgm_diag_output_is_parsed():
    passed, rows = parse_diag(DIAG_FAIL, 226)
    assert not passed
    assert rows["fail"] == ["Page Retirement/Row Remap: Fail"]
    assert rows["notes"] == ["Error: GPU 0 had uncorrectable memory errors and row remapping failed."]
    assert len(rows["pass"]) == 3 and rows["skip"] == ["Diagnostic: Skip - All"]
    assert rows["warn"] == ["Targeted Power: Warn - GPU: 0"]
    clean = DIAG_FAIL.replace("| Fail    ", "| Pass    ")
    assert parse_diag(clean, 0)[0] and not parse_diag(clean, 1)[0]


def test_dcgm_diag_absent_is_skipped_and_a_stand_in_binary_is_run(tmp_path, monkeypatch):
    cat = shutil.which("cat")
    monkeypatch.setenv("PATH", str(tmp_path))
    r = dcgm_diag("t1/gpu0", 0, level=1)
    assert r.passed and r.skipped and r.detail == "dcgmi not installed, skipped"
    # a stand-in for the dcgmi binary: checks its arguments, prints a failing report, exits 226
    fake = tmp_path / "dcgmi"
    report = tmp_path / "report.txt"
    report.write_text(DIAG_FAIL)
    fake.write_text(f'#!/bin/sh\n[ "$*" = "diag -r 1 -i 3" ] || exit 9\n{cat} {report}\nexit 226\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    r = dcgm_diag("t1/gpu3", 3, level=1)
    assert not r.passed and "Page Retirement/Row Remap: Fail" in r.detail and "row remapping failed" in r.detail
    assert r.measurements["returncode"] == 226
    cpu = dcgm_diag("t1/cpu0", None, level=1)
    assert cpu.skipped and "GPUs only" in cpu.detail
    assert os.environ["PATH"] == str(tmp_path)


def test_workers_that_overrun_the_timeout_are_killed_and_every_check_fails_saying_so():
    reports = run_admission(2, kind="cpu", node="t1", timeout_s=0.3, progress=lambda line: None)
    for r in reports:
        assert not r.passed
        assert [c.name for c in r.results] == list(CHECKS)
        assert any("timed out after 0.3 s" in why for why in r.reasons), r.reasons
