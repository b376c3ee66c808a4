"""One line of text per event record, for ``hotspare events`` (the record itself is the
machine-readable form: ``--json``)."""
from __future__ import annotations

import time
from typing import Any, Callable


def _failure(d: dict[str, Any]) -> str:
    return f"rank {d['rank']} ({d['worker'] or 'no worker'}) {d['kind']} at step {d['step']}"


def _failover(d: dict[str, Any]) -> str:
    src = "the checkpoint" if d["recovery_path"] == "checkpoint" else f"rank {d['source_rank']}"
    return (f"rank {d['rank']} -> {d.get('replacement') or 'its survivor'} by {d['recovery_path']}: state of step "
            f"{d['target_step']} from {src}, gen {d['generation']}, lost steps {d['lost_steps']}: {d['reason']}")


def _recovered(d: dict[str, Any]) -> str:
    phases = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in (d.get("phases_s") or {}).items()
                       if v is not None)
    return (f"rank {d['rank']} ({d['kind']}): every rank committed again; downtime {d['downtime_s']:.3f} s "
            f"({phases}), lost steps {d['lost_steps']}, {d['bytes_transferred'] / 1e6:.1f} MB moved")


def _said(d: dict[str, Any]) -> str:
    m = d["msg"]
    if m.get("type") == "commit":
        extra = " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in (m.get("metrics") or {}).items())
        return f"step {m['step']} {extra} {m.get('dt', 0) * 1000:.0f} ms gen {m.get('gen')}".replace("  ", " ")
    fields = " ".join(f"{k}={v}" for k, v in m.items() if k not in ("v", "type", "traceback"))[:200]
    return f"{d['worker']} says {m.get('type')} {fields}"


def _readings(d: dict[str, Any]) -> str:
    return ", ".join(f"{r['device']} " + " ".join(f"{k}={v}" for k, v in list(r["metrics"].items())[:4])
                     for r in d["readings"])[:300]


def _end(d: dict[str, Any]) -> str:
    return (f"{d['outcome']} (exit {d['exit_code']}): {d['steps_completed']} steps, {d['failures_total']} "
            f"failure(s), {d['recovered_zero_loss']} recovered with zero lost steps, {d['steps_lost']} lost, "
            f"{d['steps_repeated']} repeated" + (f": {d['message']}" if d.get("message") else ""))


def _cluster(d: dict[str, Any]) -> str:
    out = [f"{x['device']} {x['state']}" for x in d["devices"] if x["state"] != "healthy"]
    return (f"{len(d['hosts'])} host(s), {len(d['devices'])} device(s), "
            + (f"{', '.join(out)}, the rest healthy" if out else "all healthy"))[:300]


_SUMMARY: dict[str, Callable[[dict[str, Any]], str]] = {
    "failure": _failure, "failover": _failover, "recovered": _recovered,
    "unrecovered": lambda d: _failure(d) + ": not recovered, the job stopped",
    "generation": lambda d: (f"gen {d['gen']}: {d['members']} of {d['world_size']} ranks"
                             + (f", {d['lost_steps']} steps lost" if d["lost_steps"] else "")
                             + (", restored from a checkpoint" if d["restore"] else "")),
    "worker_said": _said, "readings": _readings, "run_end": _end,
    "run_start": lambda d: f"{d['job'].get('script', '')} {' '.join(d['job'].get('args', []))} "
                           f"({d['job'].get('nproc')} ranks, {d['job'].get('spares')} spares; schema {d['schema']})",
    "migration": lambda d: (f"rank {d['rank']} off {d['device']} -> {d['spare']}: {d['outcome']}"
                            + (f", downtime {d['downtime_s']:.3f} s" if d.get("downtime_s") is not None else "")),
    "health_event": lambda d: (f"{d['device']}" + (f" (rank {d['rank']})" if d.get("rank") is not None else "")
                               + f": {d['action']} by {d['rule']}: {d['reason']}"),
    "checkpoint_fallback": lambda d: f"refused {d.get('refused')}: {d.get('reason')}; used step {d.get('step')}",
    "node_connected": lambda d: f"{d['node']}: agent pid {d['hello'].get('pid')}, devices "
                                f"{', '.join(d['hello'].get('devices') or []) or 'none'}",
    "devices": lambda d: ", ".join(f"{x['device']} {x['state']}" for x in d["devices"]),
    "spares": lambda d: f"{d['ready']} ready, {d['starting']} starting",
    "worker_exited": lambda d: f"{d['worker']} exited with {d['code']}",
    "worker_started": lambda d: f"{d['worker']} started, pid {d['pid']}",
    "fault_injected": lambda d: f"{d['fault']} into {d['worker']}",
    "cluster": _cluster,        # the coordinator service's hosts and devices (its dashboard's stream)
}

# shown only with --all: one line per step or per telemetry poll
CHATTY = frozenset({"readings"})


def chatty(rec: dict[str, Any]) -> bool:
    return rec["kind"] in CHATTY or (rec["kind"] == "worker_said" and rec["data"]["msg"].get("type") == "commit")


def line(rec: dict[str, Any], start: float | None) -> str:
    """``HH:MM:SS.mmm +SECONDS kind summary`` (SECONDS since the run started, when known)."""
    t = rec["t"]
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
    rel = f"{t - start:+9.3f}s" if start is not None else " " * 11
    fmt = _SUMMARY.get(rec["kind"])
    try:
        text = fmt(rec["data"]) if fmt else " ".join(f"{k}={v}" for k, v in rec["data"].items())[:300]
    except (KeyError, TypeError, ValueError):      # a record of an older schema: its fields as they are
        text = " ".join(f"{k}={v}" for k, v in rec["data"].items())[:300]
    return f"{stamp} {rel}  {rec['kind']:<18} {text}"
