"""The health service's decisions without processes: the per-step vote, the fault grammar, and
what the pure policy does with a verdict (migrate, fail over, defer, report, stop)."""
import pytest
import torch

from hotspare.testing.faults.grammar import parse
from hotspare.errors import ConfigError
from hotspare.policy.decide import (Cordon, FailureCause, FormGeneration, HealthVerdict, Pause, Paused, Stop,
                                    StepFailed, WorkerExited, decide)
from hotspare.runtime.vote import fingerprint, nonfinite_verdict, row, scale_and_check, tally
from hotspare.policy.phase import JobPhase
from test_policy import feed, running_view


# ---------------------------------------------------------------- the vote
def table(fps, pause=()):
    world = len(fps)
    return sum(row(world, r, fps[r], r in pause) for r in range(world))


def test_one_flipped_bit_changes_the_fingerprint_even_in_odd_sized_tensors():
    ts = [torch.randn(7, 3), torch.randn(5), torch.zeros(0)]
    base = fingerprint(ts)
    for i in range(2):
        flipped = [x.clone() for x in ts]
        flipped[i].view(-1).view(torch.int32)[-1] ^= 1 << 30
        assert fingerprint(flipped) != base
    assert fingerprint([t.clone() for t in ts]) == base


def test_vote_names_the_minority_replica():
    r = tally(table([5, 5, 9, 5]), step=12, with_fingerprint=True)
    assert r.failed and r.suspects == (2,) and r.kind == "fingerprint" and "3/4" in r.detail


def test_vote_without_a_majority_trusts_no_copy():
    r = tally(table([1, 1, 2, 2]), step=3, with_fingerprint=True)
    assert r.suspects == (0, 1, 2, 3) and "no majority" in r.detail


def test_fingerprint_is_ignored_on_steps_without_a_vote():
    assert not tally(table([1, 2, 3, 4]), step=3, with_fingerprint=False).failed


def test_nan_on_some_ranks_is_a_fault_on_every_rank_it_is_the_model():
    r = nonfinite_verdict(torch.tensor([0.0, 1.0, 0.0, 0.0]), step=7)
    assert r.suspects == (1,) and r.kind == "nonfinite" and "step 7" in r.detail
    assert not nonfinite_verdict(torch.ones(4), step=7).failed


def _check(flat, scale, found=None):
    found = torch.zeros(1) if found is None else found
    scale_and_check(flat, scale, found)
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_pass_scales_like_ddps_multiply_and_flags_nonfinite_gradients_through_a_sentinel(dtype):
    torch.manual_seed(0)
    g = torch.randn(300_001).to(dtype)
    for scale in (1 / 3, 0.25, 1.0):
        flat = g.clone()
        found = _check(flat, scale)
        assert torch.equal(flat, g.clone().mul_(scale)), "not the bits of DDP's multiply"
        assert float(found) == 0 and torch.isfinite(flat[0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        flat = g.clone()
        flat[123_456] = bad
        found = _check(flat, 0.25)
        assert float(found) > 0 and torch.isnan(flat[0])                      # the sentinel is set
        assert torch.equal(flat[1:123_456], g[1:123_456] * 0.25)              # nothing else touched
    # A later bucket of the same step carries the sentinel too (the flag accumulates).
    later = g.clone()
    found = _check(later, 0.25, torch.ones(1))
    assert torch.isnan(later[0]) and torch.equal(later[1:], g[1:] * 0.25)
    # Summed with finite buckets (the reduction), the sentinel makes every rank's first element NaN.
    ranks = [g.clone(), g.clone(), g.clone()]
    ranks[1][7] = float("nan")
    flags = [_check(r, 1 / 3) for r in ranks]
    assert [float(f) > 0 for f in flags] == [False, True, False]
    assert torch.isnan(sum(ranks)[0]) and not torch.isfinite(sum(ranks)[1:8]).all()
    assert float(_check(torch.zeros(0, dtype=dtype), 0.5)) == 0


def test_fingerprints_of_any_64_bit_value_cross_the_float32_table_exactly():
    fps = [-(1 << 63), (1 << 63) - 1, -1, 0x1234_5678_9ABC_DEF0]
    t = table(fps)
    from hotspare.runtime.vote import _fp_of
    assert [_fp_of(t, r) for r in range(4)] == fps


def test_one_rank_asked_to_pause_pauses_everyone_at_the_same_step():
    r = tally(table([4] * 4, pause={3}), step=9, with_fingerprint=True)
    assert r.pause and not r.failed


# ---------------------------------------------------------------- the fault grammar
@pytest.mark.parametrize("spec,kind,params,step", [
    ("thermal:rank=1:temp=92", "thermal", {"temp": 92.0}, None),
    ("ecc:rank=0:kind=uncorrectable:step=4", "ecc", {"kind": "uncorrectable"}, 4),
    ("xid:rank=2:code=79", "xid", {"code": 79}, None),
    ("slow:rank=1:factor=1.5", "slow", {"factor": 1.5}, None),
    ("corrupt:rank=3", "corrupt", {}, None),
    ("nan:rank=1:step=8", "nan", {}, 8),
])
def test_health_faults_parse(spec, kind, params, step):
    f = parse(spec, world_size=4)
    assert (f.kind, f.params, f.step) == (kind, params, step)
    assert parse(str(f), world_size=4).params == params


@pytest.mark.parametrize("spec,message", [
    ("thermal:rank=1", "missing temp"),
    ("thermal:rank=1:temp=hot", "temp must be a number"),
    ("ecc:rank=1:kind=bad", "kind must be one of correctable, uncorrectable"),
    ("slow:rank=1:factor=0.5", "factor must be > 1"),
    ("nan:rank=1", "missing step"),
    ("corrupt:rank=9", "rank 9 does not exist"),
    ("kill:rank=1:step=3:temp=4", "go with health faults only"),
    ("thermal:rank=1:temp=90:code=3", "thermal takes rank, step, temp"),
])
def test_bad_health_faults_say_what_to_fix(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse(spec, world_size=4)


# ---------------------------------------------------------------- the policy
def verdict(action="migrate", rank=1, trust=True, rule="temp-limit", step=None, worker=""):
    return HealthVerdict(f"host/cpu{rank}", rank, action, "too hot", trust, rule, step, worker)


def test_migrate_pauses_the_generation_and_cordons_the_device():
    v = running_view()
    d = feed(v, verdict())
    pause, cordon = d.actions
    assert pause == Pause(1, 1, "s0", "host/cpu1", d.reason, "temp-limit")
    assert cordon == Cordon("host/cpu1", "too hot", "temp-limit")
    assert "live-migrating it to spare s0" in d.reason and v.phase is JobPhase.RECOVERING
    # a second verdict meanwhile does not start a second migration
    assert feed(v, verdict()).actions == ()


def test_when_all_ranks_paused_the_spare_takes_the_rank_by_direct_handoff():
    v = running_view()
    feed(v, verdict())
    for r in range(3):
        assert feed(v, Paused(f"w{r}", r, 1, 20)).actions == ()
    d = feed(v, Paused("w3", 3, 1, 20))
    form = next(a for a in d.actions if isinstance(a, FormGeneration))
    assert form.members == {0: "w0", 1: "s0", 2: "w2", 3: "w3"} and form.target == 20
    assert form.handoff_from == "w1" and form.receivers == () and form.replacements == {1: "s0"}
    assert v.phase is JobPhase.RUNNING and v.generation == 2 and v.migrating is None
    assert not any(v.reforms.values()), "a migration is not a failed re-form"


def test_a_failure_during_the_pause_supersedes_the_migration():
    v = running_view()
    feed(v, verdict(rank=1))
    feed(v, Paused("w0", 0, 1, 20))
    feed(v, WorkerExited("w2", -9, "was killed by SIGKILL"))
    feed(v, Paused("w1", 1, 1, 20))
    d = feed(v, Paused("w3", 3, 1, 20))
    form = next(a for a in d.actions if isinstance(a, FormGeneration))
    assert form.handoff_from is None and form.replacements == {2: "s0"} and 2 in form.receivers


def test_untrusted_memory_is_fenced_and_never_the_source():
    v = running_view()
    d = feed(v, verdict("failover", rank=2, trust=False, rule="ecc-uncorrectable"))
    fence, cordon = d.actions
    assert fence.ranks == (2,) and (fence.cause, fence.rule) == (FailureCause.HEALTH, "ecc-uncorrectable") and cordon.device == "host/cpu2"
    # survivors report; the fenced rank reported too (a vote failure) but is not used until it is gone
    for r in range(4):
        feed(v, StepFailed(f"w{r}", r, 1, 9))
    assert decide(v, StepFailed("w0", 0, 1, 9)).reason.startswith("waiting for fenced rank(s) [2]")
    d = feed(v, WorkerExited("w2", -9, "was killed by SIGKILL"))
    form = next(a for a in d.actions if isinstance(a, FormGeneration))
    assert form.source != 2 and form.replacements == {2: "s0"}


def test_without_a_spare_a_migration_is_only_reported():
    v = running_view(spares=0)
    d = feed(v, verdict())
    assert d.actions == () and "no warm spare is ready: reported only" in d.reason
    assert v.phase is JobPhase.RUNNING


def test_watch_and_ignore_take_no_action():
    v = running_view()
    assert feed(v, verdict("watch")).actions == () and feed(v, verdict("ignore")).actions == ()


def test_a_verdict_for_an_idle_device_only_cordons_it():
    v = running_view()
    d = feed(v, HealthVerdict("host/cpu7", None, "quarantine", "Xid 64", False, "xid-remap-failure"))
    assert d.actions == (Cordon("host/cpu7", "Xid 64", "xid-remap-failure"),)


def test_a_health_failure_that_follows_the_rank_to_a_new_device_stops_the_job():
    v = running_view()
    feed(v, verdict("failover", rank=1, trust=False, rule="nonfinite", step=12, worker="w1"))
    for r in range(4):
        feed(v, StepFailed(f"w{r}", r, 1, 11))
    feed(v, WorkerExited("w1", -9, "was killed by SIGKILL"))
    assert v.members[1] == "s0"
    d = feed(v, verdict("failover", rank=1, trust=False, rule="nonfinite", step=12, worker="s0"))
    (stop,) = d.actions
    assert isinstance(stop, Stop) and "numerical problem in the script" in stop.message
