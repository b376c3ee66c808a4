"""A degrading device under a sharded job (simulated telemetry: a thermal fault): the FSDP rank is
live-migrated. The pause rides in the sharded step gate (hotspare/sharded/pause.py), every rank
leaves once the same step is committed, and the migrating rank hands its own shard, optimizer
state and per-rank state to the spare directly: the run ends bitwise equal to the fault-free one,
with no step lost or repeated and no failure, and the spare's shard came from the migrating
rank's own memory (not from its buddy's snapshot)."""
import re

import pytest
import torch

from hotspare.testing.inproc import fault_free, run_inproc

STEPS = 16
ARGS = ["--model", "tiny", "--steps", str(STEPS), "--corpus-bytes", "200000", "--fsdp"]
FAST = ["--telemetry", "simulated", "--telemetry-period", "0.2"]


@pytest.mark.slow   # ~40 s here (the fault-free reference and the migrated run); run by .ci/run
def test_thermal_live_migrates_an_fsdp_rank_with_its_own_shard(tmp_path):
    reference = fault_free(ARGS, extra=FAST)
    assert reference.code == 0 and reference.report["failures_total"] == 0, reference.output[-5000:]
    db = tmp_path / "health.json"
    r = run_inproc(ARGS, inject=["thermal:rank=1:temp=92:step=3"], extra=[*FAST, "--health-db", str(db)])
    assert r.code == 0, r.output[-5000:]
    rep = r.report
    assert rep["final_state_digest"] == reference.digest, "the migrated run diverged from the fault-free run"
    assert rep["steps_completed"] == STEPS and rep["steps_repeated"] == 0
    assert rep["failures_total"] == 0, "a live migration is not a failure"
    (m,) = rep["migrations"]
    assert (m["rank"], m["rule"], m["outcome"], m["lost_steps"]) == (1, "temp-limit", "migrated", 0), m
    assert m["bytes_transferred"] > 0 and "handed over directly" in r.output
    handed = re.findall(r"rank (\d+): shard of step (\d+) handed over from the migrating rank's own memory", r.output)
    assert len(handed) == 1 and handed[0][0] == "1", r.output[-6000:]
    assert int(handed[0][1]) == m["target_step"] < STEPS - 1, (handed, m)
    assert "restored from rank" not in r.output, "the shard came from a buddy, not the rank's own memory"


class _Gather:
    """A group whose all-gather puts the other ranks' rows (their per-rank state and their byte
    of the vote) beside this rank's: rank 0 of 4."""

    def __init__(self, others):
        self.others = others

    def all_gather(self, out, mine):
        n = mine.numel()
        out[:n] = mine
        for r, pause in self.others.items():
            out[r * n:(r + 1) * n - 1] = r
            out[(r + 1) * n - 1] = int(pause)
        return type("Work", (), {"wait": lambda self: None})()


def test_a_pause_asked_on_any_rank_is_agreed_in_the_gate_of_that_step():
    # The vote rides in the gate's gather of the per-rank rows: one byte per rank, no collective
    # of its own; the rows themselves come out as without it.
    from hotspare.runtime.rankstate import RowTable
    from hotspare.sharded.pause import PauseVote
    agreed, asked = [], []
    vote = PauseVote(lambda: bool(asked), agreed.append)

    class State:
        def capture(self):
            return torch.full((5,), 9, dtype=torch.uint8)

    rows = RowTable(State())
    for step, others, mine in [(7, {1: False, 2: True, 3: False}, False), (8, {1: 0, 2: 0, 3: 0}, False),
                               (9, {1: 0, 2: 0, 3: 0}, True)]:
        asked[:] = [1] if mine else []
        rows.begin(_Gather(others), 4, step, flag=vote.flag())
        vote.judge(step, rows.finish())
        table = rows.rows_for(step).view(4, 5)
        assert table[0].tolist() == [9] * 5 and table[3].tolist() == [3] * 5
    assert agreed == [7, 9]
    rows.begin(_Gather({1: 0, 2: 0, 3: 0}), 4, 10)          # no flag: the rows alone, nothing to judge
    assert rows.finish() is None and rows.rows_for(10).numel() == 20
