"""A run's report: KL, reward, value loss, lr and kl_coef over steps, with the watchdog's actions.

Markers show where a decision fired (colour by outcome); rollbacks are shaded from the
step rolled back to until the step it left. The PNG is matplotlib (Agg backend, no
display); the HTML is self-contained (the PNG inline as base64 plus the decision table),
so it can be mailed or attached to a ticket as one file.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_watchdog.core.pricing import cost_text
from ppo_watchdog.core.summary import sentence
from ppo_watchdog.protocol import rundir

#: (verl key, panel title) in panel order.
PANELS: tuple[tuple[str, str], ...] = (
    ("actor/reward_kl_penalty", "KL to reference (mean)"),
    ("critic/score/mean", "reward (score mean)"),
    ("critic/vf_loss", "value loss"),
    ("actor/lr", "actor lr"),
    ("actor/reward_kl_penalty_coeff", "kl_coef"),
)
_OUTCOME_COLOUR = {"applied": "tab:green", "failed": "tab:red", "pending": "tab:orange", "skipped": "tab:gray",
                   "advised": "tab:purple", "waiting": "tab:blue", "denied": "tab:brown"}


class ReportError(ValueError):
    """Nothing to report (no metrics), or an unsupported output type; names the path."""


@dataclass
class Segment:
    """A stretch of the run in file order; a new one starts where steps go back (restart, rollback)."""

    steps: list[int]
    """Steps in this stretch."""
    data: list[dict[str, Any]]
    """The records' data."""


def segments(records: Sequence[dict[str, Any]]) -> list[Segment]:
    """Split metric records (file order) into stretches at every step that goes back."""
    out: list[Segment] = []
    for rec in records:
        step, data = int(rec.get("step", 0)), dict(rec.get("data", {}))
        seg = out[-1] if out else None
        if seg is not None and step > seg.steps[-1]:
            seg.steps.append(step)
            seg.data.append(data)
        elif seg is not None and step == seg.steps[-1] and not (set(seg.data[-1]) & set(data)):
            seg.data[-1] = {**seg.data[-1], **data}  # verl logs validation on its own line
        else:
            out.append(Segment([step], [data]))
    return out


def rollback_spans(events: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """(to_step, from_step) of every rollback event."""
    out = []
    for e in events:
        if e.get("kind") == "rollback" and e.get("to_step") is not None:
            out.append((int(e["to_step"]), int(e.get("from_step") or e["to_step"])))
    return out


#: The KL panel's reference line (the default pack's KL level for "high").
KL_LINE = 0.1


def clipped_top(values: Sequence[float], line: float = KL_LINE) -> float | None:
    """The top of a panel's axis that keeps ``line`` and the run's ordinary values readable when a few
    spikes would flatten them on a linear axis; None when every value fits (no clipping needed).

    Ordinary is the 90th percentile: a spike (NaN-adjacent blow-up, a divergence) is a handful of steps.
    """
    finite = sorted(v for v in values if v == v and abs(v) != float("inf"))
    if not finite:
        return None
    p90 = finite[min(len(finite) - 1, int(0.9 * len(finite)))]
    top = max(p90, line) * 2.0
    return top if finite[-1] > top else None


def render_png(run_dir: Path | str, decisions: Sequence[dict[str, Any]], out: Path | str,
               restarts: Sequence[tuple[int, int]] = ()) -> Path:
    """Write the report figure; ``restarts`` adds (to_step, from_step) spans for rollbacks done by restart."""
    import matplotlib.pyplot as plt

    out = Path(out)
    fig = build_figure(run_dir, decisions, restarts)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def build_figure(run_dir: Path | str, decisions: Sequence[dict[str, Any]],
                 restarts: Sequence[tuple[int, int]] = ()) -> Any:
    """The report's matplotlib figure (one panel per metric of :data:`PANELS`, top to bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = rundir.read_jsonl(run_dir / rundir.METRICS).records
    if not records:
        raise ReportError(f"{run_dir / rundir.METRICS}: no metrics to report")
    events = rundir.read_jsonl(run_dir / rundir.EVENTS).records
    segs = segments(records)
    spans = rollback_spans(events) + list(restarts)
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(10, 2.1 * len(PANELS)), sharex=True)
    for ax, (key, title) in zip(axes, PANELS, strict=False):
        for i, seg in enumerate(segs):
            pts = [(s, d[key]) for s, d in zip(seg.steps, seg.data, strict=False) if isinstance(d.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts, strict=False)
                ax.plot(xs, ys, lw=1.2, color="tab:blue", alpha=0.35 if i < len(segs) - 1 else 1.0)
        for lo, hi in spans:
            ax.axvspan(lo, hi, color="tab:red", alpha=0.12, lw=0)
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
        if key == "actor/reward_kl_penalty":
            ax.axhline(KL_LINE, color="tab:red", ls="--", lw=0.8)
            _clip_spikes(ax, [(s, d[key]) for seg in segs for s, d in zip(seg.steps, seg.data, strict=False)
                              if isinstance(d.get(key), (int, float))])
    for d in decisions:
        if d.get("kind") == "resolve" or d.get("status") == "skipped":
            continue
        colour = _OUTCOME_COLOUR.get(d.get("status", ""), "black")
        for ax in axes:
            ax.axvline(d["step"], color=colour, lw=0.8, alpha=0.7)
        axes[0].annotate(d["rule"], (d["step"], 1.0), xycoords=("data", "axes fraction"), rotation=90,
                         fontsize=6, va="top", ha="right", color=colour)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"run {run_dir.name}: red bands = rolled back, lines = watchdog actions", fontsize=10)
    fig.tight_layout()
    return fig


def _clip_spikes(ax: Any, points: Sequence[tuple[int, float]]) -> None:
    """A linear axis clipped above the ordinary values, so one spike does not flatten the KL line and
    everything under it; each clipped point is marked at the top edge with its value."""
    top = clipped_top([v for _, v in points])
    if top is None:
        return
    low = min(0.0, min(v for _, v in points if v == v and abs(v) != float("inf")))
    ax.set_ylim(low, top)
    spikes = [(s, v) for s, v in points if v > top]
    ax.plot([s for s, _ in spikes], [top] * len(spikes), ls="none", marker="^", color="tab:red", ms=6,
            clip_on=False, label="spike (off the axis)")
    for s, v in spikes[:5]:  # a few labels are enough: the markers show every one
        ax.annotate(f"{v:.3g} @ {s}", (s, top), textcoords="offset points", xytext=(4, -10), fontsize=6,
                    color="tab:red")
    ax.set_title(f"axis clipped at {top:.3g}: {len(spikes)} step(s) above it marked", fontsize=7, loc="right")


def render_html(run_dir: Path | str, decisions: Sequence[dict[str, Any]], out: Path | str,
                restarts: Sequence[tuple[int, int]] = ()) -> Path:
    """Write a self-contained HTML report (figure inline + decision table)."""
    out = Path(out)
    buf = out.with_suffix(".tmp.png")
    render_png(run_dir, decisions, buf, restarts)
    png = base64.b64encode(buf.read_bytes()).decode()
    buf.unlink()
    rows = []
    for d in decisions:
        # The measured values first, the $param thresholds after them (a stable sort keeps each group's order).
        ins = d.get("inputs", {})
        inputs = json.dumps(dict(sorted(ins.items(), key=lambda kv: str(kv[0]).startswith("$"))))
        rows.append(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
                d["step"], d["rule"], d["kind"], sentence(d), inputs, d["status"], cost_text(d.get("journal", [])),
                d.get("outcome", ""))) + "</tr>"
        )
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>watchdog report: {html.escape(Path(run_dir).name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:left}}</style></head><body>
<h1>Run {html.escape(Path(run_dir).name)}</h1>
<p>{len(decisions)} decisions. Red bands: steps rolled back; vertical lines: actions
(green applied, red failed, orange pending).</p>
<img alt="metrics" src="data:image/png;base64,{png}">
<h2>Decisions</h2>
<table><tr><th>step</th><th>rule</th><th>kind</th><th>what happened</th><th>inputs</th><th>status</th><th>cost</th><th>outcome</th></tr>
{''.join(rows)}
</table></body></html>
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    rundir.atomic_write_bytes(out, doc.encode())
    return out


def write_report(run_dir: Path | str, decisions: Sequence[dict[str, Any]], out: Path | str,
                 restarts: Sequence[tuple[int, int]] = ()) -> Path:
    """PNG or HTML by the output's suffix."""
    out = Path(out)
    if out.suffix.lower() == ".png":
        return render_png(run_dir, decisions, out, restarts)
    if out.suffix.lower() in (".html", ".htm"):
        return render_html(run_dir, decisions, out, restarts)
    raise ReportError(f"{out}: the report is .png or .html")


def restart_spans(decisions: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """(resume_step, decision step) for restarts that went back to an earlier checkpoint."""
    out = []
    for d in decisions:
        for j in d.get("journal", []):
            rs = (j.get("result") or {}).get("resume_step")
            if j.get("kind") == "restart" and rs is not None and rs < d["step"]:
                out.append((int(rs), int(d["step"])))
    return out
