"""The worker environment contract (hotspare/protocol/workerenv.py): the launcher writes the
job's part, the agent completes it per worker, the runtime reads it back; a malformed value is
a ConfigError naming its variable."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hotspare.checkpoint import CheckpointError, load_key, save
from hotspare.errors import ConfigError
from hotspare.protocol.workerenv import PREFIX, JobEnv, WorkerEnv, without_contract
from hotspare.runtime.persist import Persister
from hotspare.runtime.state import StateRegistry

REPO = Path(__file__).resolve().parents[2]
JOB = JobEnv(backend="nccl", join_timeout_s=2.5, fingerprint_every=1, checkpoint_dir="/ck", checkpoint_every=7,
             checkpoint_seconds=30.0, checkpoint_key="/keys/k", resume_dir="/old", faults=True)
GOOD = WorkerEnv.of(JOB, agent="127.0.0.1:4000", worker="w3", role="spare", device="n0/gpu1").to_env()


def test_the_contract_round_trips_through_the_environment():
    worker = WorkerEnv.of(JOB, agent="127.0.0.1:4000", worker="w3", role="spare", device="n0/gpu1")
    assert WorkerEnv.from_env(worker.to_env()) == worker
    assert JobEnv.from_env(JOB.to_env()) == JOB == worker.job()
    assert WorkerEnv.from_env({**os.environ, **worker.to_env()}) == worker     # other variables are ignored
    plain = WorkerEnv(agent="h:1", worker="w0")
    assert "HOTSPARE_DEVICE" not in plain.to_env() and WorkerEnv.from_env(plain.to_env()) == plain


def test_an_unmanaged_process_has_no_contract():
    assert WorkerEnv.from_env({"RANK": "0", "WORLD_SIZE": "2"}) is None
    assert JobEnv.from_env({}) == JobEnv()          # the job's part alone takes its defaults


def test_every_field_has_its_own_variable_and_a_meaning():
    described = WorkerEnv.describe()
    assert len({var for var, *_ in described}) == len(dataclasses.fields(WorkerEnv)) == len(described)
    for var, field, writer, doc in described:
        assert var.startswith(PREFIX) and writer and len(doc) > 10, field
    # The names the runtime codes against.
    assert {"agent", "worker", "role", "device", "backend", "join_timeout_s", "fingerprint_every", "checkpoint_dir",
            "checkpoint_every", "checkpoint_seconds", "checkpoint_key", "resume_dir", "faults"} == \
        {f.name for f in dataclasses.fields(WorkerEnv)}


@pytest.mark.parametrize("var, raw", [
    ("HOTSPARE_JOIN_TIMEOUT", "soon"), ("HOTSPARE_JOIN_TIMEOUT", "nan"), ("HOTSPARE_JOIN_TIMEOUT", "0"),
    ("HOTSPARE_JOIN_TIMEOUT", "-1"), ("HOTSPARE_FINGERPRINT_EVERY", "1.5"), ("HOTSPARE_FINGERPRINT_EVERY", "-1"),
    ("HOTSPARE_CHECKPOINT_EVERY", "often"), ("HOTSPARE_CHECKPOINT_SECONDS", "inf"), ("HOTSPARE_FAULTS", "yes"),
    ("HOTSPARE_BACKEND", "mpi"), ("HOTSPARE_ROLE", "boss"), ("HOTSPARE_AGENT", "no-port"), ("HOTSPARE_WORKER_ID", ""),
])
def test_a_malformed_variable_is_a_config_error_naming_it(var, raw):
    with pytest.raises(ConfigError, match=re.escape(var)):
        WorkerEnv.from_env({**GOOD, var: raw})


def test_a_missing_required_variable_is_named():
    env = dict(GOOD)
    del env["HOTSPARE_WORKER_ID"]
    with pytest.raises(ConfigError, match="HOTSPARE_WORKER_ID is not set"):
        WorkerEnv.from_env(env)


@pytest.mark.parametrize("field, value", [("fingerprint_every", "10"), ("join_timeout_s", True),
                                          ("checkpoint_dir", 3), ("faults", 1)])
def test_a_value_of_the_wrong_type_is_refused_where_it_is_built(field, value):
    with pytest.raises(ConfigError, match=WorkerEnv.variables()[field]):
        JobEnv(**{field: value})


def test_a_child_inherits_no_stale_contract():
    env = {**GOOD, "PATH": "/bin", "HOTSPARE_RUN_DIR": "/runs", "HOTSPARE_WORKER_TOKEN": "t"}
    assert without_contract(env) == {"PATH": "/bin", "HOTSPARE_RUN_DIR": "/runs", "HOTSPARE_WORKER_TOKEN": "t"}


def test_the_launcher_and_agent_write_the_contract_the_worker_reads(tmp_path):
    out = tmp_path / "contract.json"
    ckpts = tmp_path / "ckpts"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOTSPARE_RESUME_DIR": "/stale", "HOTSPARE_FAULTS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", "--nproc", "1", "--spares", "0",
                           "--join-timeout", "7", "--fingerprint-every", "3", "--checkpoint-dir", str(ckpts),
                           "--checkpoint-every", "5", "--", str(REPO / "tests" / "scripts" / "workerenv_dump.py"),
                           str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert out.exists(), proc.stdout + proc.stderr
    seen = json.loads(out.read_text())
    contract = seen["contract"]
    assert contract["worker"] == "w0" and contract["role"] == "active" and contract["device"]
    assert (contract["backend"], contract["join_timeout_s"], contract["fingerprint_every"]) == ("gloo", 7.0, 3)
    assert (contract["checkpoint_dir"], contract["checkpoint_every"]) == (str(ckpts), 5)
    assert contract["checkpoint_key"] == os.path.abspath(os.environ["HOTSPARE_CHECKPOINT_KEY"])
    assert contract["resume_dir"] is None and contract["faults"] is False     # the caller's stale ones are gone
    assert "HOTSPARE_WORKER_TOKEN" in seen["names"] and "HOTSPARE_PEER_KEY" in seen["names"]


def _registry() -> StateRegistry:
    reg = StateRegistry()
    reg.add("model", torch.nn.Linear(2, 2))
    return reg


def test_the_persister_reads_its_directories_and_key_from_the_contract(tmp_path):
    key = tmp_path / "keys" / "k"
    env = JobEnv(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, checkpoint_key=str(key),
                 resume_dir=str(tmp_path / "old"))
    p = Persister(_registry(), env=env)
    info = p.save_now(4)
    assert key.exists() and info.step == 4          # signed with the contract's key file, made on first use
    assert p.restore(info.path) == 4
    default_key = Persister(_registry(), env=dataclasses.replace(env, checkpoint_key=None))
    with pytest.raises(CheckpointError, match="not signed"):
        default_key.restore(info.path)              # so it was not signed with the default key
    theirs = save(str(tmp_path / "old"), 1, {"x": torch.zeros(1)}, {}, "fp", key=load_key(str(key)))
    with pytest.raises(CheckpointError, match="different model"):
        p.restore(theirs.path)                      # inside --resume DIR: verified, then refused as another model
    unmanaged = Persister(_registry(), env=None)
    with pytest.raises(CheckpointError, match="outside the job's checkpoint directory"):
        unmanaged.restore(info.path)
    assert unmanaged.after_commit(0) is None        # no directory, no periodic writes


def test_the_persister_reads_this_process_s_contract_when_given_none(tmp_path, monkeypatch):
    for var in WorkerEnv.variables().values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOTSPARE_AGENT", "127.0.0.1:1")
    monkeypatch.setenv("HOTSPARE_WORKER_ID", "w0")
    monkeypatch.setenv("HOTSPARE_CHECKPOINT_DIR", str(tmp_path / "ck"))
    assert Persister(_registry()).directory == str(tmp_path / "ck")
    monkeypatch.setenv("HOTSPARE_CHECKPOINT_EVERY", "often")
    with pytest.raises(ConfigError, match="HOTSPARE_CHECKPOINT_EVERY"):
        Persister(_registry())
