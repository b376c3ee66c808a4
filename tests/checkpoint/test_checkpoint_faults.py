"""Checkpoints that cannot be trusted, with real jobs: a planted pickle, a damaged newest
checkpoint (all ranks lost, and --resume), a bad sidecar, a path outside the job's directory,
an unusable checkpoint directory. Each ends well: refused before anything is deserialised, the
newest valid older checkpoint used and named, or a clear error at start."""
import json
import os
import pickle
import queue
import subprocess
import sys
import time

import pytest
import torch

from hotspare.checkpoint import CheckpointError, save
from hotspare.testing.inproc import fault_free, run_inproc
from hotspare.testing.local import EXAMPLE, REPO

# dcp.save(no_dist=True) warns that it assumes one process: that is the design.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ARGS = ["--model", "tiny", "--steps", "40"]
SCRIPTS = REPO / "tests" / "scripts"


@pytest.fixture(scope="module")
def reference():
    r = fault_free(ARGS)
    assert r.code == 0, r.output
    return r.digest


class _Payload:
    """Unpickling this writes the marker file: what a planted .metadata would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _two_checkpoints(tmp_path):
    """Checkpoints of steps 10 and 20 of the tiny example (30 steps, every 10)."""
    first = run_inproc(["--model", "tiny", "--steps", "30"], extra=["--checkpoint-dir", str(tmp_path),
                                                                 "--checkpoint-every", "10"])
    assert first.code == 0, first.output
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000010", "step-000000020"]
    return tmp_path / "step-000000020", tmp_path / "step-000000010"


def test_a_planted_pickle_in_metadata_never_runs_and_resume_takes_the_older_checkpoint(tmp_path, reference):
    ckpts = tmp_path / "ckpts"
    newest, older = _two_checkpoints(ckpts)
    marker = tmp_path / "payload-ran"
    (newest / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    r = run_inproc(ARGS, extra=["--resume", str(ckpts)])
    assert not marker.exists(), "the planted pickle ran"
    assert r.code == 0, r.output
    assert r.digest == reference                              # 10 -> 40 recomputed, bit for bit
    assert ".metadata was changed after writing" in r.output
    assert "falls back to the older checkpoint of step 10" in r.output
    (fallback,) = r.report["checkpoint_fallbacks"]
    assert fallback["refused"] == str(newest) and fallback["step"] == 10
    # Both planted: nothing to resume from, a clear error at start, and still nothing ran.
    (older / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", "--nproc", "2", "--resume", str(ckpts),
                           "--", str(EXAMPLE), *ARGS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no valid checkpoint" in proc.stderr, proc.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_resume_with_a_bad_sidecar_is_an_error_for_that_checkpoint_not_a_silent_other_step(tmp_path, reference):
    newest, _ = _two_checkpoints(tmp_path)
    side = json.loads((newest / "hotspare.json").read_text())
    side["step"] = 25                                         # edited: no longer what its writer signed
    (newest / "hotspare.json").write_text(json.dumps(side))
    r = run_inproc(ARGS, extra=["--resume", str(tmp_path)])
    assert r.code == 0 and r.digest == reference, r.output
    assert "not signed with this job's checkpoint key" in r.output
    assert r.report["checkpoint_fallbacks"][0]["refused"] == str(newest)
    # Naming that checkpoint itself is an error, not another step.
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", "--nproc", "2", "--resume", str(newest),
                           "--", str(EXAMPLE), *ARGS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not signed" in proc.stderr, proc.stderr


@pytest.mark.parametrize("nproc, spares", [pytest.param(4, 1, marks=pytest.mark.slow),
                                           (2, 2)])   # (2, 2): warm spares restore at once
def test_every_rank_lost_with_the_newest_checkpoint_damaged_falls_back_to_the_older_one(tmp_path, nproc, spares):
    # Rank 0 damages step 20's tensor file at step 25; every rank dies at step 27.
    env = {"CORRUPT_AT": "25", "CORRUPT_STEP": "20"}
    script, args = SCRIPTS / "corrupt_newest.py", ["40"]
    clean = run_inproc(args, nproc=nproc, spares=spares, script=script, env={**env, "CORRUPT": "0"})
    assert clean.code == 0, clean.output
    try:     # --hang-floor 10: rank 0 may wait in step 25 for a slow write of step 20 (a loaded machine)
        r = run_inproc(args, nproc=nproc, spares=spares, script=script, env=env,
                    inject=[f"kill:rank={k}:step=27" for k in range(nproc)],
                    extra=["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "10", "--hang-floor", "10"])
    except subprocess.TimeoutExpired as e:       # a restart loop: show where it went round
        out = e.output.decode() if isinstance(e.output, bytes) else (e.output or "")
        pytest.fail(f"the job did not end within {e.timeout} s:\n{out[-6000:]}")
    assert r.code == 0, r.output
    assert r.digest == clean.digest
    assert "refused" in r.output and "falling back to the older checkpoint of step 10" in r.output
    assert r.output.count("RECOVER") == 1                      # one restore, not a restart loop
    assert {f["target_step"] for f in r.report["failures"]} == {10}
    (fallback,) = r.report["checkpoint_fallbacks"]
    assert fallback["refused"].endswith("step-000000020") and fallback["step"] == 10
    assert "changed after writing" in fallback["reason"]


def test_a_checkpoint_report_outside_the_job_directory_is_refused(tmp_path):
    from hotspare.coordinator import Coordinator, CoordinatorSettings, Ledger
    from hotspare.coordinator.events import WorkerSaid
    from hotspare.coordinator.nodes import Nodes, Worker
    from hotspare.policy.decide import ClusterView
    planted = tmp_path / "planted" / "step-000000005"
    planted.mkdir(parents=True)
    ours = tmp_path / "ckpts"
    ours.mkdir()
    os.symlink(planted, ours / "step-000000005")               # a link inside that leads outside
    lines = []
    nodes = Nodes()
    nodes.workers["w0"] = Worker("w0", "n", "active", 0, None)
    coord = Coordinator(nodes, queue.Queue(), ClusterView(world_size=1, target_spares=0), Ledger({}),
                        CoordinatorSettings(checkpoint_dir=str(ours)), log=lines.append)
    coord.view.generation = 1                  # the reports are of generation 1, a formed one
    for path in (planted, ours / "step-000000005"):
        coord.events.put(WorkerSaid("w0", {"type": "checkpointed", "gen": 1, "rank": 0, "step": 5,
                                           "path": str(path)}, 0.0))
        coord.step(poll=10)
    assert coord.view.checkpoint is None and coord.ledger.checkpoints == []
    assert sum("refused w0's report" in line for line in lines) == 2, lines


def test_a_worker_restores_only_inside_its_checkpoint_directory_and_writes_only_there(tmp_path):
    from hotspare.protocol.workerenv import JobEnv
    from hotspare.runtime.persist import Persister
    from hotspare.runtime.state import StateRegistry
    reg = StateRegistry()
    reg.add("model", torch.nn.Linear(2, 2))
    elsewhere = tmp_path / "elsewhere"
    t = {"x": torch.zeros(1)}
    info = save(str(elsewhere), 3, t, {}, "fp")
    p = Persister(reg, env=JobEnv(checkpoint_dir=str(tmp_path / "ours")))
    with pytest.raises(CheckpointError, match="outside the job's checkpoint directory"):
        p.restore(info.path)
    # a last checkpoint goes where the worker's contract says; no message can name another place
    assert os.path.dirname(p.save_now(3).path) == str(tmp_path / "ours")


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_an_unusable_checkpoint_dir_is_refused_at_start(tmp_path, kind):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    where = blocker if kind == "file" else blocker / "ckpts"
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", "--nproc", "2", "--checkpoint-dir", str(where),
                           "--checkpoint-every", "5", "--", str(EXAMPLE), *ARGS],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--checkpoint-dir {where}" in proc.stderr and ("not a directory" in proc.stderr
                                                           or "cannot be written" in proc.stderr), proc.stderr
    assert "START" not in proc.stdout


def test_a_checkpoint_write_that_fails_mid_run_is_said_and_training_goes_on(tmp_path, capsys):
    from hotspare.protocol.workerenv import JobEnv
    from hotspare.runtime.persist import Persister
    from hotspare.runtime.state import StateRegistry
    reg = StateRegistry()
    reg.add("model", torch.nn.Linear(2, 2))
    where = tmp_path / "ckpts"
    p = Persister(reg, env=JobEnv(checkpoint_dir=str(where), checkpoint_every=1))
    p.after_commit(0)
    deadline = time.monotonic() + 60
    while not (where / "LATEST").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    where.rename(tmp_path / "moved")
    where.write_text("the directory became a file")         # e.g. storage remounted under the job
    err, step = "", 1
    while "training goes on" not in err and time.monotonic() < deadline:
        p.after_commit(step)                                  # never raises: rank 0 lives on
        err += capsys.readouterr().err
        step += 1
        time.sleep(0.01)
    assert "cannot create the checkpoint directory" in err and "training goes on" in err, err
