"""Health rules as data: one device's recent readings in, verdicts with reasons out; fleet policies.

Pure: no torch, no sockets, no clocks, no files: ``parse_rules`` takes rules files' texts, which
``hotspare.health.rulefile`` reads (``load_rules``: the packaged defaults and a user's file).
The caller keeps each device's history window (``RuleSet.trim`` says what to keep) and passes ``now``,
so the same readings always give the same verdicts, and the simulator can replay them::

    rules = load_rules()                                   # the defaults, or load_rules("my_rules.toml")
    history[dev] = rules.trim(history[dev] + [reading], now)
    verdict = worst(evaluate(rules, history[dev], now))    # None: nothing fired
    final = apply_fleet_policies(verdicts_of_all_devices, FleetState(fleet_size, remediations), now,
                                 rules.policy)

A rule is ``name``, ``when`` (a condition, see ``hotspare.health.conditions``), ``held`` (the condition
must hold on that many consecutive readings that report the rule's metrics), ``action``,
``trust_memory``, a ``reason`` template and ``ref`` (the row of the reference table it implements).
The default rules are ``default_rules.toml`` next to this file; docs/HEALTH.md ("Rules") shows them.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hotspare.errors import ConfigError
from hotspare.health import conditions as C
from hotspare.health.types import (ACTIONS, FAILOVER, MIGRATE, QUARANTINE, RETIRE, SEVERITY, WATCH,
                                   Reading, Verdict)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser is on PyPI as tomli
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]


# Actions that take a device out of service on the health service's own initiative.
REMEDIATIONS = (MIGRATE, FAILOVER, QUARANTINE)      # what the repeat-offender rule counts and escalates
GATED = (MIGRATE, FAILOVER, QUARANTINE, RETIRE)     # what the circuit breaker limits
_UNTRUSTED_OK = (FAILOVER, QUARANTINE, RETIRE)      # actions that may say trust_memory = false


# ---------------------------------------------------------------------------- policy
@dataclass(frozen=True, kw_only=True)
class Policy:
    """Fleet-level knobs; the ``[policy]`` table of a rules file sets them."""
    stale_after_s: float = field(default=300.0, metadata={
        "doc": "a rule fires only when its newest reading is at most this old (s before `now`)"})
    breaker_max_share: float = field(default=0.5, metadata={
        "doc": "circuit breaker: at most this share of the fleet remediated ... (NVSentinel: 50%)"})
    breaker_window_s: float = field(default=300.0, metadata={
        "doc": "... within this sliding window, s (NVSentinel: 5 min)"})
    offender_count: int = field(default=5, metadata={
        "doc": "repeat offender: a device remediated this many times ... (NVSentinel: 5)"})
    offender_window_s: float = field(default=7 * 24 * 3600.0, metadata={
        "doc": "... within this window, s, is retired (NVSentinel: 7 days)"})
    straggler_score_min: float = field(default=0.75, metadata={
        "doc": "`policy.straggler_score_min` in rules: a straggler score below it is slow "
               "(nvidia-resiliency-ext default)"})
    monitor_wedged_periods: float = field(default=6.0, metadata={
        "doc": "`policy.monitor_wedged_periods` in rules: a telemetry call hung this many poll periods "
               "means a wedged driver (reported from 3 periods on: 'watch, then cordon')"})

    def constants(self) -> dict[str, float]:
        """The values conditions and reasons may name as ``policy.<field>``."""
        return {f"policy.{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


def _policy_from(table: Mapping[str, Any], sources: Mapping[str, str]) -> Policy:
    names = {f.name: f for f in dataclasses.fields(Policy)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = f"{sources.get(key, '<policy>')}: [policy] {key}"
        if key not in names:
            raise ConfigError(f"{where}: unknown setting; known: {', '.join(names)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where} = {value!r}: must be a number")
        if key == "offender_count":
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where} = {value!r}: must be a whole number >= 1")
        elif key == "breaker_max_share":
            if not 0 < value <= 1:
                raise ConfigError(f"{where} = {value!r}: must be a share of the fleet in (0, 1], e.g. 0.5")
        elif key.endswith("_s") and value <= 0:
            raise ConfigError(f"{where} = {value!r}: must be a positive number of seconds")
        values[key] = float(value) if key != "offender_count" else value
    return Policy(**values)


# ---------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    name: str
    when: str
    action: str
    reason: str
    trust_memory: bool = True
    held: int = 1
    ref: str = ""
    source: str = ""                 # the file(s) that defined it, for messages
    condition: Any = field(default=None, compare=False, repr=False)   # conditions' syntax tree
    template: tuple = field(default=(), compare=False, repr=False)

    @functools.cached_property
    def metrics(self) -> frozenset:
        """The metrics the condition reads; the readings that report any of them are the ones it looks at."""
        return C.metrics_of(self.condition)

    def fires(self, history: Sequence[Reading], now: float, stale_after_s: float) -> str | None:
        """The rendered reason when the rule fires on ``history`` (oldest first) at ``now``, else None."""
        positions: list[int] = []          # the last ``held`` readings that report its metrics, oldest first
        for k in range(len(history) - 1, -1, -1):
            if not self.metrics.isdisjoint(history[k].metrics):
                positions.append(k)
                if len(positions) == self.held:
                    break
        positions.reverse()
        if len(positions) < self.held:
            return None
        last = positions[-1]
        if history[last].time < now - stale_after_s:
            return None
        witness: list = []
        for k in positions[-self.held:]:
            if C.truth(self.condition, history, k, now, witness if k == last else []) is not True:
                return None
        r = history[last]
        specials = {"held": self.held, "rule": self.name, "when": self.when, "device": r.device,
                    "rank": "?" if r.rank is None else r.rank}
        return C.render(self.template, history, last, now, witness, specials)


@dataclass(frozen=True)
class HistoryNeed:
    """What a device's history window must hold for ``evaluate`` to see everything the rules read."""
    readings: int        # the newest this many readings that report each metric ...
    seconds: float       # ... and every reading of the last this many seconds, plus one older per metric


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...]
    policy: Policy = field(default_factory=Policy)
    sources: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [r.name for r in self.rules]

    def rule(self, name: str) -> Rule:
        for r in self.rules:
            if r.name == name:
                return r
        raise ConfigError(f"no rule named {name!r}; rules: {', '.join(self.names())}")

    def history_needed(self) -> HistoryNeed:
        need = self.__dict__.get("_need")           # computed once: the rules never change
        if need is None:
            readings = max((r.held + C.uses_delta(r.condition) for r in self.rules), default=1)
            seconds = max((C.rate_window_s(r.condition) for r in self.rules), default=0.0)
            need = HistoryNeed(readings=readings, seconds=seconds)
            object.__setattr__(self, "_need", need)
        return need

    def trim(self, history: Sequence[Reading], now: float) -> list[Reading]:
        """The part of ``history`` (oldest first) the rules can still read at ``now``; evaluating the
        trimmed window gives the same verdicts as the full one (a test checks it)."""
        need = self.history_needed()
        cutoff = now - need.seconds
        kept_per_metric: dict[str, int] = {}
        baseline: set[str] = set()
        keep = []
        for r in reversed(history):
            k = r.time > cutoff
            for m in r.metrics:
                n = kept_per_metric.get(m, 0)
                if n < need.readings:
                    k = True
                elif r.time <= cutoff and m not in baseline:
                    k = True                       # the increase into the rate window starts here
                if r.time <= cutoff:
                    baseline.add(m)
                kept_per_metric[m] = n + 1
            if k:
                keep.append(r)
        keep.reverse()
        return keep


_RULE_KEYS = ("name", "when", "action", "reason", "trust_memory", "held", "ref", "enabled")
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def _compile(table: Mapping[str, Any], sources: tuple[str, ...], policy: Policy, known: Sequence[str]) -> Rule:
    name = table["name"]
    src = sources[0] if len(sources) == 1 else f"{sources[0]}, overridden in {', '.join(sources[1:])}"
    where = f"{src}: rule {name!r}"

    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{where}: {msg}")

    for key in ("when", "action", "reason"):
        if key not in table:
            hint = ""
            if name not in known and known:
                close = difflib.get_close_matches(name, list(known), n=1)
                hint = (f" (to override the default rule {close[0]!r}, use its exact name)" if close
                        else " (a new rule needs when, action and reason)")
            raise bad(f"missing '{key}'{hint}")
    when, action, reason = table["when"], table["action"], table["reason"]
    if not isinstance(when, str) or not when.strip():
        raise bad("'when' must be a non-empty string such as \"temp_c >= 90\"")
    if action not in ACTIONS:
        raise bad(f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
    if not isinstance(reason, str) or not reason.strip():
        raise bad("'reason' must be a non-empty string: it is what the operator reads")
    trust = table.get("trust_memory", True)
    if not isinstance(trust, bool):
        raise bad(f"trust_memory must be true or false, not {trust!r}")
    if not trust and action not in _UNTRUSTED_OK:
        raise bad(f"trust_memory = false with action {action!r}: the state must then come from a replica, "
                  f"so the action must be one of {', '.join(_UNTRUSTED_OK)} (migrate copies from this device)")
    held = table.get("held", 1)
    if isinstance(held, bool) or not isinstance(held, int) or not 1 <= held <= 10_000:
        raise bad(f"held must be a whole number of readings >= 1, not {held!r}")
    ref = table.get("ref", "")
    if not isinstance(ref, str):
        raise bad(f"ref must be a string such as \"§6 row 4\", not {ref!r}")
    try:
        condition = C.parse_condition(when, policy.constants())
    except C.ConditionError as e:
        raise bad(f"when = {when!r}: {e}") from None
    if held > 1 and C.rate_window_s(condition):
        raise bad(f"held = {held} with rate(): a rate already averages over its window; lengthen the window instead")
    try:
        template = C.parse_template(reason, policy.constants())
    except C.ConditionError as e:
        raise bad(f"reason = {reason!r}: {e}") from None
    return Rule(name=name, when=when, action=action, reason=reason, trust_memory=trust, held=held,
                ref=ref, source=src, condition=condition, template=template)


# ---------------------------------------------------------------------------- loading
@dataclass
class _Doc:
    source: str
    policy: dict
    rules: list
    replace: bool


def _read_doc(text: str, source: str) -> _Doc:
    if tomllib is None:
        raise ConfigError("reading rules files needs Python 3.11 (tomllib) or `pip install tomli` on 3.10")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    unknown = set(data) - {"policy", "rule", "replace_defaults"}
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(sorted(map(repr, unknown)))}; "
                          "a rules file has [policy], [[rule]] tables and replace_defaults = true|false")
    replace = data.get("replace_defaults", False)
    if not isinstance(replace, bool):
        raise ConfigError(f"{source}: replace_defaults must be true or false, not {replace!r}")
    policy = data.get("policy", {})
    if not isinstance(policy, dict):
        raise ConfigError(f"{source}: 'policy' must be a table: [policy]")
    rules = data.get("rule", [])
    if not isinstance(rules, list):
        raise ConfigError(f"{source}: rules are an array of tables: write [[rule]], not [rule]")
    seen: set[str] = set()
    for k, table in enumerate(rules):
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: rule #{k + 1} must be a [[rule]] table")
        name = table.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"{source}: rule #{k + 1} needs name = \"...\" (lower case, digits, '-', '_', '.'), "
                              f"got {name!r}")
        extra = set(table) - set(_RULE_KEYS)
        if extra:
            raise ConfigError(f"{source}: rule {name!r}: unknown key(s) {', '.join(sorted(map(repr, extra)))}; "
                              f"a rule has {', '.join(_RULE_KEYS)}")
        if "enabled" in table and not isinstance(table["enabled"], bool):
            raise ConfigError(f"{source}: rule {name!r}: enabled must be true or false")
        if name in seen:
            raise ConfigError(f"{source}: rule {name!r} appears twice; names must be unique within a file")
        seen.add(name)
    return _Doc(source, policy, rules, replace)


def _build(docs: Sequence[_Doc]) -> RuleSet:
    policy_table: dict[str, Any] = {}
    policy_src: dict[str, str] = {}
    merged: dict[str, tuple[dict, tuple[str, ...]]] = {}
    known: list[str] = []
    for doc in docs:
        if doc.replace:
            merged = {}
        known = list(merged)                       # names a later file can override
        policy_table.update(doc.policy)
        policy_src.update({k: doc.source for k in doc.policy})
        for table in doc.rules:
            name = table["name"]
            if name in merged:
                base, srcs = merged[name]
                merged[name] = ({**base, **table}, srcs + (doc.source,))
            else:
                merged[name] = (dict(table), (doc.source,))
    policy = _policy_from(policy_table, policy_src)
    # Disabled rules are compiled too, so a typo in a name being disabled is caught.
    compiled = [(_compile(t, srcs, policy, known), t.get("enabled", True)) for t, srcs in merged.values()]
    rules = tuple(rule for rule, enabled in compiled if enabled)
    return RuleSet(rules=rules, policy=policy, sources=tuple(d.source for d in docs))


def parse_rules(texts: Sequence[tuple[str, str]]) -> RuleSet:
    """The rule set of rules files' texts, ``(text, source)`` each, in order: a later one
    overrides an earlier one by rule name (see ``hotspare.health.rulefile.load_rules``). Pure: the
    caller reads the files. Any mistake raises ``ConfigError`` naming the source."""
    return _build([_read_doc(text, source) for text, source in texts])


def evaluate(rules: RuleSet, history: Sequence[Reading], now: float,
             touched: Iterable[str] | None = None) -> list[Verdict]:
    """Every rule that fires on one device's recent readings (oldest first), in rule-file order.

    ``touched``: the metrics of the reading just added, when the caller evaluated the rules as
    each earlier reading arrived. Only the rules that read one of them are evaluated (the others
    saw nothing new), and every rule that distrusts the device's memory, so that ``worst`` never
    lets a verdict read memory another rule distrusts. The runtime's per-window step timings
    then cost a quarter of a full evaluation.

    Pure: nothing is remembered between calls. A rule looks at the readings that report any metric it
    reads (sources may interleave: NVML polls and the runtime's per-step reports); ``held = N`` needs the
    condition on each of the last N of them; a newest such reading older than ``policy.stale_after_s``
    fires nothing. Per-reading events (``xids``, ``nonfinite``, ``fingerprint_mismatch``) count for as long
    as their reading is the newest to report that metric, so a source should report them on every reading
    (an empty tuple, False) — then each event yields verdicts until the next reading.
    """
    if not history:
        return []
    hist = sorted(history, key=lambda r: r.time)        # stable: equal times keep the caller's order
    device = hist[-1].device
    for r in hist:
        if r.device != device:
            raise ConfigError(f"evaluate() takes one device's readings; got {device!r} and {r.device!r}: "
                              "keep one history window per device")
    rank = next((r.rank for r in reversed(hist) if r.rank is not None), None)
    out = []
    touched = None if touched is None else frozenset(touched)
    for rule in rules.rules:
        if touched is not None and rule.trust_memory and rule.metrics.isdisjoint(touched):
            continue
        reason = rule.fires(hist, now, rules.policy.stale_after_s)
        if reason is not None:
            out.append(Verdict(device=device, action=rule.action, rule=rule.name, reason=reason,
                               trust_memory=rule.trust_memory, rank=rank))
    return out


def worst(verdicts: Sequence[Verdict]) -> Verdict | None:
    """The most severe verdict (types.SEVERITY), or None for none.

    Ties: a verdict that distrusts memory first, then by device, then by rule name, so the answer does not
    depend on the order of ``verdicts``. If another verdict for the same device distrusts its memory, the
    result does too (never read memory that any rule distrusts), and its reason says which rule.
    """
    if not verdicts:
        return None
    best = min(verdicts, key=lambda v: (-SEVERITY[v.action], v.trust_memory, v.device, v.rule, v.reason))
    if best.trust_memory:
        distrust = sorted(v.rule for v in verdicts if v.device == best.device and not v.trust_memory)
        if distrust:
            best = dataclasses.replace(best, trust_memory=False,
                                       reason=f"{best.reason} (memory untrusted: {', '.join(distrust)})")
    return best


# ---------------------------------------------------------------------------- fleet policies
@dataclass(frozen=True)
class FleetState:
    """What the fleet policies need to know, kept by the caller (the registry)."""
    fleet_size: int                                    # devices in the pool, in service or spare
    remediations: Sequence[tuple[float, str]] = ()     # (time, device) of every executed health remediation
    # (migrate, failover, quarantine, retire that the health service started); both policies read it


def _dur(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)} {unit}"
    return f"{seconds:g} s"


def breaker_allows(recent_actions: Sequence[tuple[float, str]], fleet_size: int, now: float,
                   max_share: float, window_s: float, *, device: str | None = None) -> tuple[bool, str]:
    """May the health service take one more device out of service now? ``(allowed, reason)``.

    Counts distinct devices remediated within ``window_s`` before ``now`` (later timestamps count too: clocks
    of different hosts disagree). The budget is ``floor(max_share * fleet_size)``, at least 1 so a one-device
    fleet can still be protected. ``device`` already counted in the window costs nothing more. The window
    slides, so the breaker closes again by itself once old remediations age out.
    """
    if fleet_size < 1:
        raise ConfigError(f"fleet_size must be >= 1, got {fleet_size}")
    if not 0 < max_share <= 1:
        raise ConfigError(f"max_share must be in (0, 1], got {max_share}")
    devices = {d for t, d in recent_actions if t > now - window_s}
    budget = max(1, math.floor(max_share * fleet_size + 1e-9))
    n = len(devices)
    facts = (f"{n} of {fleet_size} devices remediated in the last {_dur(window_s)}, "
             f"limit {budget} ({max_share:.0%} of the fleet)")
    if device is not None and device in devices:
        return True, f"circuit breaker: {device} is already counted; {facts}"
    if n < budget:
        return True, f"circuit breaker closed: {facts}"
    return False, (f"circuit breaker open: {facts}; a fleet-wide cause (cooling, power, driver, a bad rule) "
                   "is likelier than that many bad devices")


def repeat_offender(remediation_times: Sequence[float], now: float, count: int, window_s: float) -> bool:
    """True when at least ``count`` remediations fall within ``window_s`` before ``now``."""
    return sum(1 for t in remediation_times if t > now - window_s) >= count


_VERB = {MIGRATE: "migrated", FAILOVER: "failed over", QUARANTINE: "quarantined", RETIRE: "retired"}


def apply_fleet_policies(verdicts: Sequence[Verdict], fleet: FleetState, now: float,
                         policy: Policy | None = None) -> list[Verdict]:
    """The verdicts after the repeat-offender rule and the circuit breaker, same order as given.

    1. Repeat offender: a migrate/failover/quarantine for a device with ``offender_count`` remediations in
       ``offender_window_s`` (this one included) becomes ``retire``.
    2. Circuit breaker: migrate/failover/quarantine/retire verdicts are admitted most severe first (then by
       device, rule) while ``breaker_allows``; the rest become ``watch`` with the breaker's reason. A dying
       worker is still replaced by the core failover path: the breaker only limits what the health service
       does on its own initiative.
    The caller records each executed remediation in ``fleet.remediations``.
    """
    policy = policy or Policy()
    out = list(verdicts)
    for k, v in enumerate(out):
        if v.action not in REMEDIATIONS:
            continue
        times = [t for t, d in fleet.remediations if d == v.device] + [now]
        if repeat_offender(times, now, policy.offender_count, policy.offender_window_s):
            n = sum(1 for t in times if t > now - policy.offender_window_s)
            out[k] = dataclasses.replace(
                v, action=RETIRE, rule="repeat-offender",
                reason=(f"repeat offender: {n} remediations of {v.device} within {_dur(policy.offender_window_s)} "
                        f"(limit {policy.offender_count}); retire it for repair. This time: {v.rule}: {v.reason}"))
    recent = list(fleet.remediations)
    order = sorted(range(len(out)), key=lambda k: (-SEVERITY[out[k].action], out[k].trust_memory,
                                                   out[k].device, out[k].rule))
    for k in order:
        v = out[k]
        if v.action not in GATED:
            continue
        ok, why = breaker_allows(recent, fleet.fleet_size, now, policy.breaker_max_share,
                                 policy.breaker_window_s, device=v.device)
        if ok:
            recent.append((now, v.device))
        else:
            out[k] = dataclasses.replace(v, action=WATCH, rule="circuit-breaker",
                                         reason=f"{why}. Would have {_VERB[v.action]} {v.device}: {v.rule}: {v.reason}")
    return out

