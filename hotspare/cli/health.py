"""``hotspare health`` / ``cordon`` / ``drain`` / ``uncordon``: read and steer the device registry.

One module registers all four subcommands. It imports no torch: these are quick operator commands.
Exit codes: 0 done (or nothing to do), 2 a bad device name, an unknown device or a move the
lifecycle does not allow, 1 the registry file or Slurm failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from typing import Any

from hotspare.errors import ConfigError, HotspareError
from hotspare.health import lifecycle, slurm as slurm_mod
from hotspare.health.lifecycle import State
from hotspare.health.reconcile import SlurmReconciler
from hotspare.health.registry import DEFAULT_PATH, ENV_PATH, DeviceRecord, Registry
from hotspare.health.types import node_of

STATES_HELP = "\n".join(f"  {s.value:<12} {lifecycle.MEANING[s]}" for s in State)

EPILOG = f"""\
device states:
{STATES_HELP}

moves (who may make them; 'rule' is the health rule engine, K = diagnostics passes, default 2):
{lifecycle.table_text()}

registry: --db PATH, else ${ENV_PATH}, else {DEFAULT_PATH}. One JSON file
shared by the coordinator and these commands; every write is locked and atomic.

Slurm: where this host is part of a Slurm cluster (scontrol on PATH and $SLURM_CONF,
/etc/slurm/slurm.conf, $SLURM_JOB_ID or $SLURM_CLUSTER_NAME), a device leaving service drains its
node in Slurm (State=DRAIN Reason="hotspare: ..."), and the node is resumed when its last such
device returns to service. hotspare never resumes a node someone else drained. The registry change
is written first; Slurm follows it, and a failure is recorded and retried (--sync-slurm; hotspare
run retries periodically). --slurm on makes any Slurm failure an error (exit 1); --slurm off leaves
Slurm alone (default: ${slurm_mod.ENV_MODE} or auto).
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", metavar="PATH", default=None,
                   help=f"registry file (default: ${ENV_PATH} or {DEFAULT_PATH})")
    p.add_argument("--slurm", choices=slurm_mod.MODES, default=None,
                   help=f"drain/resume nodes in Slurm: auto (when this host is in a Slurm cluster), "
                        f"on, off (default: ${slurm_mod.ENV_MODE} or auto)")


def _wrap(text: str) -> str:
    return textwrap.fill(text, 96)


def register(subparsers: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "health", help="every device's lifecycle state, reason and last readings",
        description=_wrap("Show the health registry: each device's state, since when, why, its "
                          "last readings and the rank/job on it. With DEVICE (or NODE) arguments, "
                          "show those devices in full, with their transition history."),
        epilog=EPILOG, formatter_class=fmt)
    p.add_argument("devices", nargs="*", metavar="DEVICE|NODE",
                   help="show only these devices (NODE/KINDINDEX) or all devices of these nodes")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--sync-slurm", action="store_true",
                   help="first re-apply the registry to Slurm (drain/resume nodes), e.g. after a "
                        "failed scontrol call")
    _common(p)
    p.set_defaults(func=run_health)

    p = subparsers.add_parser(
        "cordon", help="stop new work on a device (its node is drained in Slurm)",
        description=_wrap("Cordon a device: no new work is placed on it; what runs there keeps "
                          "running (hotspare drain moves it off). A device already cordoned, "
                          "draining, quarantined or retired is left as it is."),
        epilog=EPILOG, formatter_class=fmt)
    p.add_argument("device", metavar="DEVICE", help="NODE/KINDINDEX, e.g. host1/gpu0")
    p.add_argument("--reason", required=True, help="why, shown in 'hotspare health' and Slurm")
    _common(p)
    p.set_defaults(func=run_move, move="cordon")

    p = subparsers.add_parser(
        "drain", help="cordon a device and move its work off to a spare",
        description=_wrap("Drain a device: cordon it (if it is not yet) and mark its rank to be "
                          "moved to a spare at the next step boundary. After the rank has left, the "
                          "coordinator quarantines it for diagnostics."),
        epilog=EPILOG, formatter_class=fmt)
    p.add_argument("device", metavar="DEVICE", help="NODE/KINDINDEX, e.g. host1/gpu0")
    p.add_argument("--reason", default="drained by operator", help="why (default: %(default)r)")
    _common(p)
    p.set_defaults(func=run_move, move="drain")

    p = subparsers.add_parser(
        "uncordon", help="return a cordoned (or draining, or suspect) device to service",
        description=_wrap("Return a device to service: cordoned -> healthy; draining -> cordoned "
                          "-> healthy (cancels the drain); suspect -> healthy. A quarantined device "
                          "returns only by passing diagnostics K times in a row; a retired one "
                          "never."),
        epilog=EPILOG, formatter_class=fmt)
    p.add_argument("device", metavar="DEVICE", help="NODE/KINDINDEX, e.g. host1/gpu0")
    p.add_argument("--reason", default="uncordoned by operator", help="why (default: %(default)r)")
    _common(p)
    p.set_defaults(func=run_move, move="uncordon")


def _registry(args: argparse.Namespace) -> tuple[Registry, SlurmReconciler | None]:
    """The registry, and the reconciler that brings Slurm in line with it (None: Slurm off)."""
    mode = args.slurm or slurm_mod.mode_from_env()
    reg = Registry(args.db)
    return reg, SlurmReconciler.from_mode(reg, mode)


def _fail(cmd: str, e: Exception) -> int:
    print(f"hotspare {cmd}: error: {e}", file=sys.stderr)
    return 2 if isinstance(e, ValueError) else 1


def _notes(notes: list[str]) -> None:
    for note in notes:
        print(note, file=sys.stderr if "warning" in note else sys.stdout)


# --- cordon / drain / uncordon ------------------------------------------------------------------
def run_move(args: argparse.Namespace) -> int:
    cmd = args.move
    try:
        reg, slurm = _registry(args)
        before = reg.get(args.device)
        if cmd == "uncordon" and before.state is State.QUARANTINED:
            raise ConfigError(
                f"{args.device} is quarantined ({before.reason}): it returns to service only after "
                f"passing the quarantine diagnostics {reg.passes_required} times in a row "
                f"({before.diagnostics_passes} so far), which the coordinator runs while it is "
                f"quarantined")
        after = getattr(reg, cmd)(args.device, reason=args.reason, actor="operator")
    except (HotspareError, ValueError) as e:
        return _fail(cmd, e)
    new = _new_transitions(before, after)
    if not new:
        print(f"{args.device} is already {after.state} (since {_ago(after.since)}: {after.reason}); "
              f"nothing to do")
    else:
        print(f"{args.device}: {' -> '.join([new[0].src.value] + [t.dst.value for t in new])} "
              f"({args.reason})")
    if slurm is not None:     # the change is written; Slurm follows it, outside the registry's lock
        try:
            _notes(slurm.reconcile([node_of(args.device)]).notes)
        except slurm_mod.SlurmError as e:
            return _fail(cmd, e)
    return 0


def _new_transitions(before: DeviceRecord, after: DeviceRecord) -> list[lifecycle.Transition]:
    """The transitions ``after`` has that ``before`` had not (the history is capped, so match the
    last known one rather than count)."""
    if not before.history:
        return list(after.history)
    last = before.history[-1]
    for i in range(len(after.history) - 1, -1, -1):
        if after.history[i] == last:
            return list(after.history[i + 1:])
    return list(after.history)


# --- health ---------------------------------------------------------------------------------
def run_health(args: argparse.Namespace) -> int:
    notes: list[str] = []
    try:
        reg, slurm = _registry(args)
        if args.sync_slurm:
            if slurm is None:
                raise ConfigError("--sync-slurm: the Slurm integration is off here (use --slurm on "
                                  "to force it)")
            notes += slurm.reconcile().notes
        records = reg.devices()
        if args.devices:
            records = _select(reg, records, args.devices)
        slurm_states = _slurm_states(slurm, records, notes)
    except (HotspareError, ValueError) as e:
        return _fail("health", e)
    if args.json:
        print(json.dumps({"registry": str(reg.path), "revision": reg.revision(),
                          "devices": [r.to_json() for r in records],
                          "slurm": {n: {"state": s.state, "reason": s.reason}
                                    for n, s in slurm_states.items()},
                          "slurm_reconcile": {n: {"want": s.want, "error": s.error, "time": s.time}
                                              for n, s in reg.slurm_status().items()}}, indent=2))
        return 0
    _notes(notes)
    if not records:
        print(f"no devices in {reg.path} yet: devices appear when the coordinator, a telemetry "
              f"source or a check registers them")
        return 0
    if args.devices:
        print("\n\n".join(_detail(r, reg) for r in records))
    else:
        print(_table(records, reg))
    for node, s in sorted(slurm_states.items()):
        if s.drained or any(r.node == node and r.state in lifecycle.OUT_OF_SERVICE for r in records):
            print(f"slurm: node {node} {s.state}" + (f" ({s.reason})" if s.reason else ""))
    for node, st in reg.slurm_status().items():
        if st.error:
            print(f"slurm: node {node}: the last reconcile failed ({_ago(st.time)}): {st.error}")
    print(f"\nregistry {reg.path}, revision {reg.revision()}; "
          f"slurm {'on' if slurm and slurm.strict else 'auto' if slurm else 'off'}")
    return 0


def _select(reg: Registry, records: list[DeviceRecord], wanted: list[str]) -> list[DeviceRecord]:
    out = []
    for w in wanted:
        if "/" in w:
            out.append(reg.get(w))          # raises UnknownDevice with suggestions
        else:
            hits = [r for r in records if r.node == w]
            if not hits:
                nodes = sorted({r.node for r in records})
                raise ConfigError(f"no device of node {w!r} in the health registry {reg.path} "
                                  f"(nodes: {', '.join(nodes) or 'none'})")
            out += hits
    seen: set[str] = set()
    return [r for r in out if not (r.device in seen or seen.add(r.device))]


def _slurm_states(slurm: SlurmReconciler | None, records: list[DeviceRecord], notes: list[str]) -> dict[str, Any]:
    if slurm is None or not records:
        return {}
    try:
        return slurm.slurm.states(sorted({r.node for r in records}))
    except slurm_mod.SlurmError as e:
        if slurm.strict:
            raise
        notes.append(f"slurm: warning: cannot read node states: {e}")
        return {}


def _ago(t: float, now: float | None = None) -> str:
    s = max(0.0, (time.time() if now is None else now) - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


# The metrics worth a glance in the table, in order, with how to show them.
_SUMMARY = [
    ("temp_c", lambda v: f"{v:g}C"),
    ("thermal_margin_c", lambda v: f"margin {v:g}C"),
    ("ecc_dbe_volatile", lambda v: f"dbe {v}"),
    ("ecc_sbe_volatile", lambda v: f"sbe {v}"),
    ("xids", lambda v: f"xid {','.join(map(str, v))}" if v else ""),
    ("remap_pending", lambda v: "remap pending" if v else ""),
    ("remap_failed", lambda v: "remap FAILED" if v else ""),
    ("straggler_score", lambda v: f"straggler {v:.2f}" if isinstance(v, float) else f"straggler {v}"),
    ("nonfinite", lambda v: "nan/inf" if v else ""),
    ("fingerprint_mismatch", lambda v: "fingerprint MISMATCH" if v else ""),
    ("recovery_action", lambda v: f"recovery {v}" if v and v != "none" else ""),
]


def _summary(r: DeviceRecord, limit: int = 4) -> str:
    last = r.last_reading
    if last is None:
        return "-"
    merged: dict[str, Any] = {}
    for reading in sorted(r.readings.values(), key=lambda x: x.time):
        merged.update(reading.metrics)
    parts = []
    for key, show in _SUMMARY:
        if key in merged:
            try:
                text = show(merged[key])
            except (TypeError, ValueError):
                text = f"{key}={merged[key]}"
            if text:
                parts.append(text)
    if not parts:
        parts = [f"{k}={v}" for k, v in list(merged.items())[:limit]]
    return f"{', '.join(parts[:limit])} ({last.source}, {_ago(last.time)})"


def _table(records: list[DeviceRecord], reg: Registry) -> str:
    rows = [("DEVICE", "STATE", "SINCE", "REASON", "LAST READINGS", "RANK/JOB")]
    for r in records:
        state = r.state.value
        if r.state is State.QUARANTINED:
            state += f" {r.diagnostics_passes}/{reg.passes_required}"
        reason = r.reason if len(r.reason) <= 48 else r.reason[:47] + "~"
        job = "-" if r.rank is None else f"{r.rank}/{r.job or '?'}"
        rows.append((r.device, state, _ago(r.since), reason, _summary(r), job))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]
                     for row in rows)


def _detail(r: DeviceRecord, reg: Registry) -> str:
    lines = [f"{r.device}  (node {r.node})",
             f"  state        {r.state.value} since {_ago(r.since)}, by {r.actor}: {r.reason}",
             f"  meaning      {lifecycle.MEANING[r.state]}",
             f"  rank/job     {'-' if r.rank is None else f'rank {r.rank} of job {r.job}'}"]
    if r.state is State.QUARANTINED:
        lines.append(f"  diagnostics  {r.diagnostics_passes}/{reg.passes_required} passes in a row")
    if r.remediations:
        lines.append(f"  remediations {len(r.remediations)}, the last {_ago(r.remediations[-1])}")
    for src, x in sorted(r.readings.items()):
        metrics = ", ".join(f"{k}={v}" for k, v in x.metrics.items())
        lines.append(f"  reading      {src}, {_ago(x.time)}: "
                     + "\n               ".join(textwrap.wrap(metrics, 80) or ["-"]))
    allowed = ", ".join(f"{m.dst.value}" for m in lifecycle.allowed_from(r.state)) or "none (terminal)"
    lines.append(f"  may move to  {allowed}")
    if r.history:
        lines.append("  history")
        for t in r.history[-20:]:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t.time))
            lines.append(f"    {stamp}  {t.src.value:>11} -> {t.dst.value:<11} {t.actor}: {t.reason}")
    return "\n".join(lines)
