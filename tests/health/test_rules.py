"""The health rules, scripted without devices: readings in, verdicts and reasons out."""
import dataclasses
import random
import re
from pathlib import Path

import pytest

from hotspare.errors import ConfigError
from hotspare.health import rules_doc
from hotspare.health import types as T
from hotspare.health.conditions import CHOICES, METRIC_KINDS
from hotspare.health.rulefile import load_rules, loads_rules
from hotspare.health.rules import FleetState, Policy, apply_fleet_policies, breaker_allows, evaluate, repeat_offender, worst
from hotspare.health.types import Reading, Verdict

DEV = "node1/gpu0"
POLL = 15.0
RULES = load_rules()

NOMINAL = {
    T.TEMP_C: 60, T.MEM_TEMP_C: 65, T.THERMAL_MARGIN_C: 25, T.CLOCK_EVENT_REASONS: 0, T.POWER_W: 400.0,
    T.ECC_SBE_VOLATILE: 3, T.ECC_DBE_VOLATILE: 0, T.REMAP_PENDING: False, T.REMAP_FAILED: False,
    T.PCIE_GEN: 5, T.PCIE_GEN_MAX: 5, T.PCIE_WIDTH: 16, T.PCIE_WIDTH_MAX: 16, T.PCIE_REPLAY: 7,
    T.NVLINK_CRC_ERRORS: 2, T.NVLINK_REPLAY_ERRORS: 1, T.NVLINK_RECOVERY_ERRORS: 0, T.XIDS: (),
    T.RECOVERY_ACTION: "none",
}
RUNTIME = {T.STEP_COMPUTE_S: 0.1, T.STEP_COMM_S: 0.02, T.STRAGGLER_SCORE: 1.0, T.NONFINITE: False,
           T.FINGERPRINT_MISMATCH: False}


def polls(n=41, change=None, start=0.0, device=DEV, source="nvml", base=NOMINAL, rank=1):
    """``n`` readings POLL seconds apart; ``change(i, n)`` returns the metrics that differ at poll i."""
    out = []
    for i in range(n):
        m = dict(base)
        m.update((change or (lambda i, n: {}))(i, n))
        out.append(Reading(device, start + i * POLL, source, m, rank))
    return out


def last(k, **metrics):
    """A change that sets ``metrics`` on the last ``k`` polls."""
    return lambda i, n: metrics if i >= n - k else {}


def ramp(metric, per_poll, from_value=0):
    return lambda i, n: {metric: from_value + per_poll * i}


def fired(history, now=None, rules=RULES):
    now = history[-1].time if now is None else now
    return {v.rule: v for v in evaluate(rules, history, now)}


# One reading history per default rule, built to make that rule fire.
SCENARIOS = {
    "recovery-reset-or-reboot": polls(change=last(1, recovery_action="gpu_reset")),
    "recovery-drain": polls(change=last(1, recovery_action="drain_p2p")),
    "gpu-lost": polls(change=last(1, xids=(79,))),
    "ecc-uncorrectable": polls(change=last(1, ecc_dbe_volatile=1)),
    "xid-uncorrectable-ecc": polls(change=last(1, xids=(48,))),
    "xid-uncontained": polls(change=last(1, xids=(95,))),
    "xid-contained": polls(change=last(1, xids=(94,))),
    "xid-reset-required": polls(change=last(1, xids=(119,))),
    "row-remap-pending": polls(change=last(1, remap_pending=True)),
    "xid-remap-event": polls(change=last(1, xids=(63,))),
    "row-remap-failed": polls(change=last(1, remap_failed=True)),
    "xid-remap-failure": polls(change=last(1, xids=(64,))),
    "ecc-correctable-rate": polls(change=ramp(T.ECC_SBE_VOLATILE, 1)),                # 4/min for 10 min
    "xid-sbe-storm": polls(change=last(1, xids=(92,))),
    "nvlink-replay-sustained": polls(change=ramp(T.NVLINK_RECOVERY_ERRORS, 1)),       # 4/min for 10 min
    "nvlink-replay": polls(change=last(1, nvlink_replay_errors=2)),
    "nvlink-crc-critical": polls(change=ramp(T.NVLINK_CRC_ERRORS, 2000)),             # 8000/min
    "nvlink-crc": polls(change=last(1, nvlink_crc_errors=3)),
    "xid-nvlink": polls(change=last(1, xids=(74,))),
    "xid-nvlink-sw": polls(change=last(1, xids=(155,))),
    "pcie-replay-sustained": polls(change=ramp(T.PCIE_REPLAY, 5)),                    # 20/min for 10 min
    "pcie-replay-rate": polls(change=last(1, pcie_replay=7 + 20)),                    # 20 in the last minute
    "pcie-width-degraded": polls(change=last(4, pcie_width=8)),
    "pcie-gen-degraded": polls(change=last(4, pcie_gen=3)),
    "hw-clock-slowdown": polls(change=last(4, clock_event_reasons=0x40)),
    "sw-thermal-slowdown": polls(change=last(4, clock_event_reasons=0x20)),
    "sw-power-cap": polls(change=last(1, clock_event_reasons=0x4)),
    "thermal-margin": polls(change=last(2, thermal_margin_c=-3)),
    "temp-limit": polls(change=last(2, temp_c=92)),
    "xid-application": polls(change=last(1, xids=(13,))),
    "xid-recovery-info": polls(change=last(1, xids=(154,))),
    "xid-unlisted": polls(change=last(1, xids=(8,))),
    "monitor-unresponsive": polls(n=3, base={}, change=last(1, monitor_unresponsive="poll() has not returned after 45 s",
                                                            monitor_stalled_periods=3.0)),
    "monitor-wedged": polls(n=3, base={}, change=last(1, monitor_unresponsive="poll() has not returned after 90 s",
                                                      monitor_stalled_periods=6.0)),
    "device-error": polls(change=last(1, device_error="nvmlDeviceGetPowerUsage: Unknown Error")),
    "straggler": polls(n=10, base=RUNTIME, source="runtime", change=last(5, straggler_score=0.6)),
    "nonfinite": polls(n=3, base=RUNTIME, source="runtime", change=last(1, nonfinite=True)),
    "fingerprint-mismatch": polls(n=3, base=RUNTIME, source="runtime", change=last(1, fingerprint_mismatch=True)),
}


def test_every_default_rule_has_a_scenario():
    assert sorted(SCENARIOS) == sorted(RULES.names())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_default_rule_fires_on_its_scenario_with_its_action_and_a_filled_in_reason(name):
    rule = RULES.rule(name)
    v = fired(SCENARIOS[name])[name]
    assert (v.device, v.action, v.trust_memory, v.rank) == (DEV, rule.action, rule.trust_memory, 1)
    assert v.reason and "n/a" not in v.reason and "{" not in v.reason


@pytest.mark.parametrize("base,source", [(NOMINAL, "nvml"), (RUNTIME, "runtime")])
def test_nominal_readings_fire_nothing(base, source):
    history = polls(base=base, source=source)
    assert evaluate(RULES, history, history[-1].time) == []
    assert evaluate(RULES, [], 0.0) == [] and worst([]) is None


def test_reasons_carry_the_observed_values():
    assert fired(SCENARIOS["temp-limit"])["temp-limit"].reason == "GPU temperature 92 C for 2 polls (temp_c >= 90)"
    assert fired(SCENARIOS["ecc-uncorrectable"])["ecc-uncorrectable"].reason.startswith("1 new uncorrectable")
    assert fired(SCENARIOS["xid-reset-required"])["xid-reset-required"].reason.startswith("Xid 119:")
    assert "reasons 0x40" in fired(SCENARIOS["hw-clock-slowdown"])["hw-clock-slowdown"].reason
    assert "x8 of x16 for 4 polls" in fired(SCENARIOS["pcie-width-degraded"])["pcie-width-degraded"].reason
    assert "8000/min" in fired(SCENARIOS["nvlink-crc-critical"])["nvlink-crc-critical"].reason
    assert "score 0.6" in fired(SCENARIOS["straggler"])["straggler"].reason
    assert "below 0.75" in fired(SCENARIOS["straggler"])["straggler"].reason


def test_the_injected_thermal_fault_of_the_cpu_tests_migrates():
    history = polls(n=5, change=last(2, temp_c=92))
    v = worst(evaluate(RULES, history, history[-1].time))
    assert (v.action, v.rule, v.trust_memory) == (T.MIGRATE, "temp-limit", True)


# ---------------------------------------------------------------------------- held for N readings
def test_a_one_off_blip_does_not_fire_a_held_rule_and_a_held_condition_does():
    assert "temp-limit" not in fired(polls(change=last(1, temp_c=95)))
    blips = polls(change=lambda i, n: {T.TEMP_C: 95} if i in (n - 3, n - 1) else {})
    assert "temp-limit" not in fired(blips)
    for k, fires in ((3, False), (4, True), (9, True)):
        assert ("hw-clock-slowdown" in fired(polls(change=last(k, clock_event_reasons=0x8)))) is fires
    assert "straggler" not in fired(polls(n=10, base=RUNTIME, source="runtime", change=last(4, straggler_score=0.5)))


def test_held_counts_the_readings_that_report_the_metric_so_other_sources_do_not_break_the_run():
    nvml = polls(n=6, change=last(4, clock_event_reasons=0x40))
    runtime = polls(n=6, base=RUNTIME, source="runtime", start=1.0)
    missing = [Reading(DEV, 2.0 + k * POLL, "nvml", {T.TEMP_C: 60}, 1) for k in range(6)]  # a poll without it
    mixed = sorted(nvml + runtime + missing, key=lambda r: r.time)
    assert "hw-clock-slowdown" in fired(mixed, now=mixed[-1].time)


def test_the_slowdown_bits_must_all_be_hardware_ones_and_the_power_cap_is_ignored():
    history = polls(change=last(6, clock_event_reasons=0x4 | 0x1))
    got = fired(history)
    assert set(got) == {"sw-power-cap"} and worst(list(got.values())).action == T.IGNORE


# ---------------------------------------------------------------------------- counters
def test_delta_of_a_counter_and_its_reset():
    reset = polls(n=3, change=lambda i, n: {T.ECC_DBE_VOLATILE: (5, 0, 0)[i]})      # 5 -> 0: a reset, no error
    assert "ecc-uncorrectable" not in fired(reset)
    after = polls(n=4, change=lambda i, n: {T.ECC_DBE_VOLATILE: (5, 5, 0, 1)[i]})  # then one new error
    assert fired(after)["ecc-uncorrectable"].reason.startswith("1 new")
    across = polls(n=2, change=lambda i, n: {T.ECC_DBE_VOLATILE: (5, 2)[i]})       # reset, then 2 errors
    assert fired(across)["ecc-uncorrectable"].reason.startswith("2 new")
    flat = polls(n=3, change=lambda i, n: {T.ECC_DBE_VOLATILE: 4})                 # errors from long ago
    assert "ecc-uncorrectable" not in fired(flat)


def test_delta_needs_a_previous_reading():
    assert "ecc-uncorrectable" not in fired(polls(n=1, change=lambda i, n: {T.ECC_DBE_VOLATILE: 9}))


def test_rate_per_minute_over_a_window_counts_across_resets():
    # 10 replays per poll = 40/min; a reset in the middle must not turn into a huge negative or positive step
    values = [100 + 10 * i for i in range(5)] + [0, 10, 20, 30, 40]
    history = polls(n=10, change=lambda i, n: {T.PCIE_REPLAY: values[i]})
    now = history[-1].time
    v = fired(history, now)["pcie-replay-rate"]
    assert v.reason.startswith("PCIe replays at 40/min")                  # last 60 s: 4 increments of 10
    assert "pcie-replay-sustained" not in fired(history, now)             # 90/min over 600 s... = 9/min
    # the window slides: a minute of silence later the rate has gone
    quiet = history + [Reading(DEV, now + 61, "nvml", {**NOMINAL, T.PCIE_REPLAY: 40}, 1)]
    assert "pcie-replay-rate" not in fired(quiet)


def test_rate_is_conservative_at_start_up():
    # 20 replays within one poll, but only 15 s of history: 20 in the last minute is 20/min, not 80/min
    history = polls(n=2, change=lambda i, n: {T.PCIE_REPLAY: (0, 20)[i]})
    assert fired(history)["pcie-replay-rate"].reason.startswith("PCIe replays at 20/min")


# ---------------------------------------------------------------------------- xids
def test_xid_membership_and_worst_picks_the_gravest():
    got = fired(polls(change=last(1, xids=(13, 79, 8))))
    assert {"gpu-lost", "xid-application", "xid-unlisted"} <= set(got)
    assert got["xid-unlisted"].reason.startswith("Xid 8:")                # only the unlisted code
    w = worst(list(got.values()))
    assert (w.rule, w.action, w.trust_memory) == ("gpu-lost", T.FAILOVER, False)


def test_an_xid_counts_only_in_the_reading_that_reports_it():
    history = polls(change=lambda i, n: {T.XIDS: (79,)} if i == n - 2 else {})
    assert "gpu-lost" not in fired(history)


def test_the_unlisted_xid_rule_knows_every_code_the_other_rules_name():
    unlisted = RULES.rule("xid-unlisted").when
    named = set()
    for r in RULES.rules:
        m = re.fullmatch(r"xids in \{([\d, ]+)\}", r.when)
        if m:
            named |= {int(c) for c in m.group(1).split(",")}
    listed = {int(c) for c in re.search(r"\{([\d, ]+)\}", unlisted).group(1).split(",")}
    assert named == listed


def test_xids_of_several_readings_and_stale_readings():
    history = polls(change=last(1, xids=(95,)))
    assert "xid-uncontained" in fired(history, now=history[-1].time + RULES.policy.stale_after_s)
    assert fired(history, now=history[-1].time + RULES.policy.stale_after_s + 1) == {}


# ---------------------------------------------------------------------------- missing values, bad input
def test_missing_or_malformed_values_never_fire_and_never_crash():
    odd = [Reading(DEV, 0.0, "nvml", {T.TEMP_C: "hot", T.XIDS: "79", T.CLOCK_EVENT_REASONS: 1.5,
                                      T.ECC_DBE_VOLATILE: float("nan"), T.RECOVERY_ACTION: 3}, 1),
           Reading(DEV, 15.0, "nvml", {T.TEMP_C: None, T.XIDS: [79, "x"], T.ECC_DBE_VOLATILE: 4,
                                       T.RECOVERY_ACTION: None}, 1)]
    assert fired(odd) == {}
    negated = loads_rules('[[rule]]\nname="cool"\nwhen="not (temp_c >= 90)"\naction="watch"\nreason="x"',
                          defaults=False)
    assert evaluate(negated, [Reading(DEV, 0.0, "nvml", {T.POWER_W: 1.0})], 0.0) == []   # unknown, not true
    assert [v.rule for v in evaluate(negated, [Reading(DEV, 0.0, "nvml", {T.TEMP_C: 50})], 0.0)] == ["cool"]


def test_evaluate_refuses_a_history_that_mixes_devices():
    with pytest.raises(ConfigError, match="one device"):
        evaluate(RULES, polls(n=1) + polls(n=1, device="node1/gpu1", start=15), 15.0)


# ---------------------------------------------------------------------------- worst
def test_worst_is_order_independent_and_never_trusts_memory_a_rule_distrusts():
    vs = [Verdict(DEV, T.MIGRATE, "b", "rb"), Verdict(DEV, T.MIGRATE, "a", "ra"), Verdict(DEV, T.WATCH, "c", "rc")]
    assert worst(vs) == worst(vs[::-1]) and worst(vs).rule == "a"
    q = Verdict(DEV, T.QUARANTINE, "q", "rq")
    f = Verdict(DEV, T.FAILOVER, "ecc", "re", trust_memory=False)
    w = worst([f, q])
    assert (w.action, w.rule, w.trust_memory) == (T.QUARANTINE, "q", False) and "untrusted: ecc" in w.reason
    other = Verdict("node2/gpu0", T.FAILOVER, "ecc", "re", trust_memory=False)
    assert worst([q, other]).trust_memory is True                          # another device's memory


# ---------------------------------------------------------------------------- determinism, trimming
def test_same_readings_same_verdicts():
    lost = dataclasses.replace(SCENARIOS["gpu-lost"][-1], time=601.0)
    history = SCENARIOS["hw-clock-slowdown"] + [lost]
    a = evaluate(RULES, history, 700.0)
    assert a == evaluate(RULES, list(history), 700.0) == evaluate(load_rules(), history, 700.0)
    assert a == evaluate(RULES, history[::-1], 700.0)                       # sorted by time inside


def test_trimmed_history_gives_the_same_verdicts_as_the_full_one():
    need = RULES.history_needed()
    assert need.readings >= 5 and need.seconds == 600.0
    rng = random.Random(4)
    for trial in range(25):
        history, t = [], 0.0
        sbe = replay = crc = 0
        for _ in range(rng.randint(1, 120)):
            t += rng.choice((0.0, 1.0, 5.0, 15.0, 40.0))
            if rng.random() < 0.3:
                m = dict(RUNTIME, straggler_score=rng.choice((0.5, 1.0)), nonfinite=rng.random() < 0.05)
                history.append(Reading(DEV, t, "runtime", m, 1))
                continue
            sbe += rng.choice((0, 0, 1, 5))
            replay = 0 if rng.random() < 0.05 else replay + rng.choice((0, 3, 20))
            crc += rng.choice((0, 1, 3000))
            m = dict(NOMINAL, temp_c=rng.choice((60, 95)), clock_event_reasons=rng.choice((0, 0x40, 0x20)),
                     ecc_sbe_volatile=sbe, pcie_replay=replay, nvlink_crc_errors=crc,
                     ecc_dbe_volatile=rng.choice((0, 0, 0, 1)), xids=rng.choice(((), (), (79,), (13,))))
            for k in rng.sample(sorted(m), rng.randint(0, 3)):             # sometimes a metric is missing
                del m[k]
            history.append(Reading(DEV, t, "nvml", m, 1))
        for now in (t, t + 30.0, t + 400.0):
            trimmed = RULES.trim(history, now)
            assert evaluate(RULES, trimmed, now) == evaluate(RULES, history, now), (trial, now)
        assert len(RULES.trim(history, t + 10_000)) <= 2 * need.readings * len(METRIC_KINDS)


# ---------------------------------------------------------------------------- rule files
def test_every_metric_of_the_vocabulary_has_a_kind():
    metrics = {v for k, v in vars(T).items() if k.isupper() and isinstance(v, str) and v not in T.ACTIONS}
    assert metrics == set(METRIC_KINDS)
    assert set(CHOICES[T.RECOVERY_ACTION]) >= {"none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"}


def test_default_rules_cite_their_reference_row_and_policy_matches_the_dataclass():
    for r in RULES.rules:
        assert re.match(r"§(6 rows? \d+|1\.3)", r.ref), r.name
        assert r.action in T.ACTIONS
        assert r.trust_memory or r.action in (T.FAILOVER, T.QUARANTINE, T.RETIRE)
    assert RULES.policy == Policy()


USER = """
[policy]
breaker_max_share = 0.25

[[rule]]
name = "temp-limit"            # a default rule: only the keys given change
when = "temp_c >= 85"

[[rule]]
name = "sw-power-cap"
enabled = false

[[rule]]
name = "hbm-hot"               # a new rule
when = "mem_temp_c >= 95"
action = "watch"
reason = "HBM at {mem_temp_c} C"
"""


def test_a_user_file_overrides_disables_and_adds_rules_by_name(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text(USER)
    rules = load_rules(path)
    assert rules.policy.breaker_max_share == 0.25 and rules.policy.breaker_window_s == 300.0
    assert "sw-power-cap" not in rules.names() and len(rules.names()) == len(RULES.names())
    temp = rules.rule("temp-limit")
    assert (temp.when, temp.held, temp.action) == ("temp_c >= 85", 2, T.MIGRATE)
    assert str(path) in temp.source
    got = fired(polls(change=last(2, temp_c=86, mem_temp_c=96, clock_event_reasons=0x4)), rules=rules)
    assert got["temp-limit"].reason == "GPU temperature 86 C for 2 polls (temp_c >= 85)"
    assert got["hbm-hot"].reason == "HBM at 96 C" and "sw-power-cap" not in got


def test_a_user_file_can_replace_the_defaults(tmp_path):
    rules = loads_rules("replace_defaults = true\n" + USER.split("[[rule]]", 3)[-1].join(["[[rule]]", ""]))
    assert rules.names() == ["hbm-hot"]


def test_a_typo_in_an_overridden_rule_name_is_reported_with_the_right_name():
    with pytest.raises(ConfigError, match="'temp-limt'.*override the default rule 'temp-limit'"):
        loads_rules('[[rule]]\nname = "temp-limt"\nwhen = "temp_c >= 80"', source="user.toml")
    with pytest.raises(ConfigError, match="'sw-powr-cap'.*'sw-power-cap'"):
        loads_rules('[[rule]]\nname = "sw-powr-cap"\nenabled = false', source="user.toml")


def test_a_missing_rules_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read rules file"):
        load_rules(tmp_path / "nope.toml")


def rule(when='temp_c >= 90', action='"migrate"', extra=""):
    return f'[[rule]]\nname = "r1"\nwhen = "{when}"\naction = {action}\nreason = "hot"\n{extra}'


@pytest.mark.parametrize("text,message", [
    (rule(when="temp >= 90"), r"unknown metric 'temp'; did you mean 'temp_c'"),
    (rule(action='"evacuate"'), r"unknown action 'evacuate'; use one of ignore, watch"),
    (rule(when="temp_c => 90"), r"unexpected '=' at column 8"),
    (rule(when="temp_c >> 90"), r"expected a metric, function or value at column 9"),
    (rule(when="temp_c 90"), r"'temp_c' \(a number\) is not a condition on its own"),
    (rule(when="temp_c > 90 90"), r"unexpected 90 at column 13; join conditions with 'and' / 'or'"),
    (rule(when="delta(temp_c) > 0"), r"delta\(\) needs a counter"),
    (rule(when="rate(pcie_replay) > 1"), r"a window in seconds"),
    (rule(when="max(temp_c) > 1"), r"unknown function 'max'"),
    (rule(when="temp_c & 0x4"), r"'&' needs a bitmask metric"),
    (rule(when="temp_c"), r"'temp_c' \(a number\) is not a condition on its own; compare it"),
    (rule(when="xids == 79"), r"compare xids with 'in'"),
    (rule(when="recovery_action in {'gpu_rest'}"), r"recovery_action is never 'gpu_rest'"),
    (rule(when="recovery_action > 1"), r"'>' needs numbers"),
    (rule(when="1 < 2"), r"compares two constants"),
    (rule(when="temp_c >= policy.max_temp"), r"unknown constant 'policy.max_temp'"),
    (rule(when="__import__('os')"), r"unknown function '__import__'"),
    (rule(when="__import__('os').system('true')"), r"unexpected '\.' at column 17"),
    (rule(when="temp_c >= 90; x"), r"unexpected ';'"),
    (rule(when="rate(pcie_replay, '60') > 1"), r"expected a window in seconds"),
    (rule(when="not " * 60 + "remap_pending"), r"more than 50 deep"),
    (rule(extra="held = 0"), r"held must be a whole number"),
    (rule(when="rate(pcie_replay, 60) > 1", extra="held = 3"), r"held = 3 with rate\(\)"),
    (rule(extra="trust_memory = false"), r"trust_memory = false with action 'migrate'"),
    (rule(extra="trust_mem = false"), r"unknown key\(s\) 'trust_mem'"),
    (rule(extra='reason2 = "x"'), r"unknown key\(s\) 'reason2'"),
    ('[[rule]]\nname = "r1"\nwhen = "temp_c > 1"\naction = "watch"', r"rule 'r1': missing 'reason'"),
    ('[[rule]]\nname = "r1"\nwhen = "temp_c > 1"\naction = "watch"\nreason = "{tmp}"', r"unknown metric 'tmp'"),
    ('[[rule]]\nname = "r1"\nwhen = "temp_c > 1"\naction = "watch"\nreason = "a { b"', r"unmatched '\{'"),
    (rule() + "\n" + rule(), r"rule 'r1' appears twice"),
])
def test_malformed_rules_are_rejected_with_the_rule_the_file_and_the_fix(text, message):
    with pytest.raises(ConfigError) as e:
        loads_rules(text, source="my_rules.toml", defaults=False)
    assert "my_rules.toml" in str(e.value)
    assert re.search(message, str(e.value)), str(e.value)
    if "appears twice" not in message:
        assert "rule 'r1'" in str(e.value)


@pytest.mark.parametrize("text,message", [
    ("[rule]\nname = 'r1'", r"write \[\[rule\]\]"),
    ("rules = []", r"unknown top-level key\(s\) 'rules'"),
    ("[[rule]]\nname = 'R 1'", r"rule #1 needs name"),
    ("[policy]\nbreaker_share = 0.5", r"\[policy\] breaker_share: unknown setting"),
    ("[policy]\nbreaker_max_share = 1.5", r"must be a share of the fleet in \(0, 1\]"),
    ("[policy]\noffender_count = 2.5", r"whole number"),
    ("[[rule]\nname = 'r1'", r"not valid TOML"),
])
def test_malformed_files_are_rejected(text, message):
    with pytest.raises(ConfigError, match=message) as e:
        loads_rules(text, source="my_rules.toml", defaults=False)
    assert "my_rules.toml" in str(e.value)


# ---------------------------------------------------------------------------- circuit breaker
def test_breaker_trips_at_the_share_and_recovers_after_the_window():
    recent = [(0.0, "n/gpu0"), (10.0, "n/gpu1")]
    ok, why = breaker_allows(recent[:1], 4, 20.0, 0.5, 300.0)
    assert ok and "closed: 1 of 4 devices" in why
    ok, why = breaker_allows(recent, 4, 20.0, 0.5, 300.0)
    assert not ok and "open: 2 of 4 devices" in why and "limit 2 (50% of the fleet)" in why
    assert breaker_allows(recent, 4, 20.0, 0.5, 300.0, device="n/gpu1")[0]       # already counted
    assert not breaker_allows(recent, 4, 299.5, 0.5, 300.0)[0]                   # t=0 still inside
    assert breaker_allows(recent, 4, 300.5, 0.5, 300.0)[0]                       # t=0 aged out
    assert breaker_allows([], 1, 0.0, 0.5, 300.0)[0]                              # a one-device fleet
    assert not breaker_allows([(0.0, "a")], 1, 1.0, 0.5, 300.0)[0]
    with pytest.raises(ConfigError):
        breaker_allows([], 0, 0.0, 0.5, 300.0)


def test_fleet_policies_downgrade_what_the_breaker_stops_in_a_deterministic_order():
    vs = [Verdict(f"n/gpu{i}", T.MIGRATE, "temp-limit", f"hot {i}") for i in range(4)]
    vs.append(Verdict("n/gpu3", T.FAILOVER, "gpu-lost", "lost", trust_memory=False))
    out = apply_fleet_policies(vs, FleetState(fleet_size=4), 100.0, Policy())
    actions = [(v.device, v.action) for v in out]
    # failover first (most severe), then by device name: gpu3 and gpu0 are admitted, gpu3's migrate too
    assert actions == [("n/gpu0", T.MIGRATE), ("n/gpu1", T.WATCH), ("n/gpu2", T.WATCH),
                       ("n/gpu3", T.MIGRATE), ("n/gpu3", T.FAILOVER)]
    assert out[1].rule == "circuit-breaker" and "Would have migrated n/gpu1: temp-limit: hot 1" in out[1].reason
    shuffled = apply_fleet_policies(vs[::-1], FleetState(fleet_size=4), 100.0, Policy())
    assert sorted(shuffled, key=repr) == sorted(out, key=repr)
    # watch and ignore pass untouched and cost nothing
    calm = [Verdict("n/gpu0", T.WATCH, "nvlink-crc", "x"), Verdict("n/gpu1", T.IGNORE, "sw-power-cap", "y")]
    assert apply_fleet_policies(calm, FleetState(1, [(99.0, "n/gpu9")]), 100.0) == calm


def test_breaker_counts_remediations_the_fleet_already_made():
    fleet = FleetState(fleet_size=10, remediations=[(t, f"n/gpu{t:.0f}") for t in (0.0, 1.0, 2.0, 3.0, 4.0)])
    v = Verdict("n/gpu7", T.QUARANTINE, "r", "bad")
    assert apply_fleet_policies([v], fleet, 100.0, Policy())[0].action == T.WATCH
    assert apply_fleet_policies([v], fleet, 304.5, Policy())[0].action == T.QUARANTINE


# ---------------------------------------------------------------------------- repeat offender
def test_repeat_offender():
    day = 86400.0
    assert repeat_offender([0, day, 2 * day, 3 * day, 4 * day], 5 * day, 5, 7 * day)
    assert not repeat_offender([0, day, 2 * day, 3 * day], 5 * day, 5, 7 * day)
    assert not repeat_offender([0, day, 2 * day, 3 * day, 4 * day], 7 * day, 5, 7 * day)   # t=0 aged out


def test_the_fifth_remediation_within_a_week_retires_the_device():
    day = 86400.0
    past = [(d * day, DEV) for d in (1, 2, 3, 4)] + [(d * day, "n/other") for d in (1, 2, 3, 4)]
    v = Verdict(DEV, T.MIGRATE, "temp-limit", "GPU temperature 92 C", rank=1)
    (out,) = apply_fleet_policies([v], FleetState(100, past), 5 * day, Policy())
    assert (out.action, out.rule, out.rank) == (T.RETIRE, "repeat-offender", 1)
    assert "5 remediations of node1/gpu0 within 7 d (limit 5)" in out.reason and "temp-limit" in out.reason
    (later,) = apply_fleet_policies([v], FleetState(100, past), 8.5 * day, Policy())
    assert later.action == T.MIGRATE                                           # days 1 aged out
    watch = dataclasses.replace(v, action=T.WATCH)
    assert apply_fleet_policies([watch], FleetState(100, past), 5 * day)[0] == watch
    strict = Policy(offender_count=2, offender_window_s=day)
    assert apply_fleet_policies([v], FleetState(100, [(4.5 * day, DEV)]), 5 * day, strict)[0].action == T.RETIRE


# ---------------------------------------------------------------------------- purity, docs
def test_the_rule_engine_imports_no_torch_no_sockets_does_no_io_and_never_evals():
    health = Path(__file__).resolve().parents[2] / "hotspare" / "health"
    pure = ["rules.py", "lifecycle.py", "records.py", *(f"conditions/{p.name}" for p in (health / "conditions").glob("*.py"))]
    assert len(pure) >= 6, pure
    for name in pure:
        src = (health / name).read_text()
        assert not re.search(r"^\s*(import|from)\s+(torch|socket|subprocess|threading|os|shutil|importlib|pathlib)\b",
                             src, re.M), name
        assert not re.search(r"(?<![.\w])(eval|exec|compile|open)\(|\.read_text\(|\.write_text\(", src), name


def test_the_doc_generator_checks_and_updates_a_document(tmp_path, capsys):
    doc = tmp_path / "HEALTH.md"
    doc.write_text(f"# x\n\n{rules_doc.BEGIN}\nold\n{rules_doc.END}\n\nafter\n")
    assert rules_doc.main(["--check-doc", str(doc)]) == 1
    assert rules_doc.main(["--update-doc", str(doc)]) == 0
    assert rules_doc.main(["--check-doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| `gpu-lost` | `xids in {79}` | 1 | failover | **no** | §6 row 3 |" in text and text.endswith("after\n")
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nname = "temp-limit"\nwhen = "temp >= 1"\n')
    assert rules_doc.main([str(bad)]) == 2 and "did you mean 'temp_c'" in capsys.readouterr().err


def test_the_docs_show_the_rules_generated_from_the_data():
    doc = Path(__file__).resolve().parents[2] / "docs" / "HEALTH.md"
    text = doc.read_text(encoding="utf-8")
    assert rules_doc.update_doc(text, RULES) == text, (
        "docs/HEALTH.md is stale: run python -m hotspare.health.rules_doc --update-doc docs/HEALTH.md")
    for name in RULES.names():
        assert f"`{name}`" in text


def test_evaluating_only_the_touched_rules_keeps_every_rule_that_distrusts_memory():
    # A hot device that also reported Xid 79 (memory not to be trusted); then a runtime reading.
    nvml = polls(n=5, change=lambda i, n: {T.TEMP_C: 92, **({T.XIDS: (79,)} if i == n - 1 else {})})
    runtime = Reading(DEV, nvml[-1].time + 1, "runtime", dict(RUNTIME), 1)
    history = nvml + [runtime]
    now = runtime.time
    full = {v.rule for v in evaluate(RULES, history, now)}
    assert {"temp-limit", "gpu-lost"} <= full
    touched = {v.rule for v in evaluate(RULES, history, now, touched=runtime.metrics)}
    # temp-limit saw nothing new (it was judged when its readings came); gpu-lost distrusts memory
    assert "temp-limit" not in touched and "gpu-lost" in touched
    assert not worst(evaluate(RULES, history, now, touched=runtime.metrics)).trust_memory
    # every rule is judged exactly as in a full evaluation when it is evaluated at all
    for metrics in (runtime.metrics, nvml[-1].metrics, {T.TEMP_C: 1}):
        some = {v.rule: v for v in evaluate(RULES, history, now, touched=metrics)}
        everything = {v.rule: v for v in evaluate(RULES, history, now)}
        assert all(everything[name] == v for name, v in some.items())
        assert {r.name for r in RULES.rules if r.name in everything and
                (not r.trust_memory or not r.metrics.isdisjoint(metrics))} == set(some)
