"""The host RAM a sharded job's buddy snapshots take is said before step 0, and a job whose
snapshots would not fit in a host's available RAM refuses to start, saying what to change
(hotspare/sharded/memory.py); the coordinator's closing line says so, not "a bug"."""
import pytest

from hotspare.sharded.memory import ENV_RAM, available_bytes, plan
from hotspare.testing.inproc import run_inproc

MiB = 1 << 20


def test_each_rank_holds_two_copies_of_its_predecessors_shard_and_its_logs():
    p = plan(shard=[12 * MiB, 12 * MiB, 24 * MiB, 12 * MiB], log=[4 * MiB, 4 * MiB, 8 * MiB, 4 * MiB],
             avail=[-1] * 4, per_host=2, stride=2, every=3)
    # rank 0 keeps rank 2's copies (stride 2: the buddy is on the next host): a snapshot every 3
    # steps, so up to 3 logs and one arriving
    assert p.need == [2 * 24 * MiB + 4 * 8 * MiB, 2 * 12 * MiB + 4 * 4 * MiB,
                      2 * 12 * MiB + 4 * 4 * MiB, 2 * 12 * MiB + 4 * 4 * MiB]
    assert [h[:2] for h in p.hosts] == [(0, p.need[0] + p.need[1]), (2, p.need[2] + p.need[3])]
    assert p.refusal is None                       # available RAM unknown: nothing refused


def test_a_host_whose_snapshots_do_not_fit_refuses_with_what_to_change():
    p = plan(shard=[10 * MiB] * 4, log=[2 * MiB] * 4, avail=[100 * MiB, 100 * MiB, 40 * MiB, 60 * MiB],
             per_host=2, stride=2, every=1)
    assert p.hosts[0][2] == 100 * MiB and p.hosts[1][2] == 40 * MiB      # the least any rank there saw
    assert p.refusal is not None and "ranks 2..3" in p.refusal and "48.0 MiB" in p.refusal
    assert "only 40.0 MiB is available" in p.refusal and "more ranks" in p.refusal
    assert p.hosts[1][1] == 2 * (2 * 10 + 2 * 2) * MiB == 48 * MiB
    assert plan([10 * MiB] * 4, [2 * MiB] * 4, [48 * MiB] * 4, 2, 2, 1).refusal is None    # exactly fits


def test_the_host_ram_comes_from_meminfo_or_the_override(monkeypatch):
    monkeypatch.delenv(ENV_RAM, raising=False)
    assert available_bytes() > 0
    monkeypatch.setenv(ENV_RAM, "12345")
    assert available_bytes() == 12345


ARGS = ["--model", "tiny", "--steps", "3", "--corpus-bytes", "200000", "--fsdp"]


def test_fsdp_job_says_its_snapshot_ram_and_refuses_to_start_when_it_does_not_fit():
    r = run_inproc(ARGS, spares=1, env={ENV_RAM: str(64 * 1024)})
    assert r.code != 0
    rep = r.report
    assert rep["outcome"] == "stopped" and rep["steps_completed"] == 0, rep["message"]
    assert rep["message"].startswith("rank ") and "refused to start the job: the buddy snapshots" in rep["message"]
    assert "only 0.1 MiB is available there" in rep["message"] and "more ranks" in rep["message"]
    assert "MiB per rank" in rep["message"] and "looks like a bug" not in r.output
    # (rank 0 also prints the cost before it refuses; the job may be stopped, by another rank's
    # refusal, before that line is out: the closing line carries the figures)


def test_before_step_0_the_optimizers_state_is_counted_as_its_first_step_will_make_it():
    # A shard before step 0 holds the parameters only: AdamW's two moments, made by its first
    # step, would double the snapshot after the RAM check let the job start.
    import torch
    from hotspare.sharded.memory import state_per_param, unmade_state_bytes
    model = torch.nn.Linear(10, 10)                      # 110 float32 parameters: 440 bytes
    cases = [(torch.optim.AdamW(model.parameters()), 2), (torch.optim.Adam(model.parameters(), amsgrad=True), 3),
             (torch.optim.SGD(model.parameters(), lr=0.1), 0), (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 1),
             (torch.optim.RMSprop(model.parameters(), momentum=0.9, centered=True), 3)]
    for opt, tensors in cases:
        assert state_per_param(opt) == tensors and unmade_state_bytes(opt) == 440 * tensors, type(opt)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    opt.step()                                           # its state exists now: it is in the shard
    assert unmade_state_bytes(opt) == 0 and unmade_state_bytes(None) == 0
    made = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    assert made == 440 * state_per_param(opt)
