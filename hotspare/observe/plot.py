"""``hotspare report REPORT --plot OUT.png``: the run in two panels.

Top: the script's loss (``job.log(loss=...)``, from rank 0's commits in the event stream)
against wall time, each failure marked where its fault struck (red), its recovery where every
rank committed again (green), the downtime between them shaded. Without a ``loss`` metric the
committed step is drawn instead. Bottom: each failure's downtime split into its phases (from
the report). matplotlib is imported here only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

PHASE_COLORS = {"detect": "#c0392b", "decide": "#e67e22", "rebuild_groups": "#8e44ad",
                "transfer_state": "#2471a3", "first_committed_step": "#27ae60"}


def _curve(records: list[dict[str, Any]]) -> tuple[str, list[float], list[float]]:
    """(what, times, values): rank 0's loss per committed step, or the committed step itself."""
    commits = [r for r in records if r["kind"] == "worker_said" and r["data"]["msg"].get("type") == "commit"
               and r["data"]["msg"].get("rank") == 0]
    with_loss = [r for r in commits if isinstance((r["data"]["msg"].get("metrics") or {}).get("loss"), (int, float))]
    if with_loss:
        return "loss", [r["t"] for r in with_loss], [r["data"]["msg"]["metrics"]["loss"] for r in with_loss]
    return "committed step", [r["t"] for r in commits], [r["data"]["msg"]["step"] for r in commits]


def plot_run(report: dict[str, Any], records: list[dict[str, Any]] | None, out: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    failures = report.get("failures") or []
    ratios = [3, max(1.2, 0.5 * len(failures) + 0.8)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": ratios})
    start = next((r["t"] for r in records or () if r["kind"] == "run_start"), None)
    if records:
        what, ts, vs = _curve(records)
        t0 = start if start is not None else (ts[0] if ts else 0.0)
        top.plot([t - t0 for t in ts], vs, color="#34495e", lw=1.2, label=f"{what} (rank 0, per committed step)")
        hit = [r for r in records if r["kind"] == "failure"]
        back = {(r["data"]["worker"], r["data"]["step"]): r for r in records if r["kind"] == "recovered"}
        for i, f in enumerate(hit, 1):
            d = f["data"]
            struck = f["t"] - (d.get("detection_latency_s") or 0.0) - t0
            top.axvline(struck, color="#c0392b", lw=1.2, ls="--", label="fault" if i == 1 else None)
            rec = back.get((d["worker"], d["step"]))
            label = f"#{i} rank {d['rank']} {d['kind']} @ step {d['step']}"
            if rec is not None:
                r_t = rec["t"] - t0
                top.axvspan(struck, r_t, color="#c0392b", alpha=0.15, lw=0,
                            label="downtime (the report's: fault to every rank committed)" if i == 1 else None)
                top.axvline(r_t, color="#27ae60", lw=1.2, label="recovered (every rank committed)" if i == 1 else None)
                label += f"\ndowntime {rec['data']['downtime_s']:.2f} s, lost steps {rec['data']['lost_steps']}"
            top.annotate(label, xy=(struck, 1.0), xycoords=("data", "axes fraction"), xytext=(4, -4),
                         textcoords="offset points", va="top", fontsize=8, color="#c0392b")
        top.set_xlabel("wall time since the run started (s)")
        top.set_ylabel(what)
        top.legend(loc="lower left", fontsize=8, framealpha=0.9)
        top.grid(alpha=0.3)
    else:
        top.text(0.5, 0.5, "no event stream: the loss curve comes from REPORT.events.jsonl\n"
                 "(hotspare run --report writes it beside the report)", ha="center", va="center",
                 transform=top.transAxes, color="#7f8c8d")
        top.set_xticks([])
        top.set_yticks([])
    job = report.get("job") or {}
    top.set_title(title or f"{Path(str(job.get('script', 'run'))).name}: {report.get('steps_completed')} steps, "
                  f"{len(failures)} failure(s), {report.get('recovered_zero_loss')} recovered with zero lost steps, "
                  f"{report.get('steps_lost')} lost, {report.get('steps_repeated')} repeated", fontsize=10)

    if failures:
        names = []
        for i, f in enumerate(failures):
            left = 0.0
            for phase, color in PHASE_COLORS.items():
                seconds = (f.get("phases_s") or {}).get(phase)
                if seconds:
                    bottom.barh(i, seconds, height=0.55, left=left, color=color,
                                label=phase.replace("_", " ") if i == 0 else None)
                    left += seconds
            total = f.get("downtime_s")
            bottom.text(left, i, f"  {total:.3f} s" if total is not None else "  not recovered",
                        va="center", fontsize=8)
            names.append(f"#{i + 1} rank {f['rank']} {f['kind']}\n@ step {f['step']} ({f.get('recovery_path')})")
        bottom.set_yticks(range(len(failures)), names, fontsize=8)
        bottom.set_ylim(len(failures) - 0.4, -0.6)
        bottom.set_xlabel("downtime by phase (s)")
        bottom.set_xlim(0, max(0.05, max((f.get("downtime_s") or 0) for f in failures)) * 1.25)
        bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=8, ncol=5, frameon=False)
        bottom.grid(axis="x", alpha=0.3)
    else:
        bottom.text(0.5, 0.5, "no failures", ha="center", va="center", transform=bottom.transAxes)
        bottom.set_xticks([])
        bottom.set_yticks([])
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
