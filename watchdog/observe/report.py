"""A run's report: its metrics over steps with the watchdog's decisions.

report.html is one self-contained page (style, script and data inline; nothing is fetched when it is
opened, so it can be mailed or attached to a ticket as one file): a header card (command, outcome,
duration, steps), interactive charts against step (KL, reward, validation score, entropy, response length,
value loss, lr, kl_coef; the kept timeline apart from the branches a rollback abandoned; log axes where a
spike would flatten the rest) and the decisions in words (:func:`decision_text`). report.png is a static
matplotlib figure of the same run (Agg backend, no display): rollbacks shaded from the step rolled back to
until the step it left, decisions as lines coloured by outcome.
"""

from __future__ import annotations

import html
import json
import math
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_watchdog.core.pricing import duration_text
from ppo_watchdog.core.summary import sentence
from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol.runinfo import RunInfo

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


def shown_in_history(d: Mapping[str, Any]) -> bool:
    """Decisions ``watchdog history`` lists without --all, the report and ``status``: not resolves, not no-ops
    (a dropped or covered set is shown: what was not done, and why, is part of the record)."""
    return d["kind"] != "resolve" and d["outcome"] not in ("no action", "resolved")


def decision_text(d: Mapping[str, Any]) -> str:
    """A decision in words for the report and ``status``: its step and rule, then the rule's sentence and what was
    done, advised or held about it (``ppo_watchdog.core.summary.sentence``, the one renderer)."""
    said, bare = sentence(d), f"{d['rule']} at step {d['step']}: "
    return f"step {d['step']}, {d['rule']}: {said[len(bare):] if said.startswith(bare) else said}"


#: (verl keys, panel title, log axis) in panel order: the first key a run logs is drawn. Log axes where one
#: spike is orders of magnitude above the ordinary values (KL) or the values are scales (lr, kl_coef).
HTML_PANELS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("actor/reward_kl_penalty", "actor/kl_loss"), "KL to reference (mean)", True),
    (("critic/score/mean", "critic/rewards/mean"), "reward (score mean)", False),
    (("val-core/reward/mean@1",), "validation score", False),
    (("actor/entropy",), "entropy", False),
    (("response_length/mean",), "response length (tokens)", False),
    (("critic/vf_loss",), "value loss", False),
    (("actor/lr",), "actor lr", True),
    (("actor/reward_kl_penalty_coeff", "actor/kl_coef"), "kl_coef", True),
)


def timelines(segs: Sequence[Segment], key: str) -> tuple[list[tuple[int, float | None]],
                                                          list[list[tuple[int, float | None]]],
                                                          list[tuple[int, str]]]:
    """(the kept timeline, the abandoned branches, the non-finite values) of ``key``.

    A step is abandoned when a later stretch starts at or before it (a rollback or a restart trained from
    there again); what is left is the timeline the run kept. A non-finite value is None in its line (a gap)
    and listed apart with its text (``nan``, ``inf``)."""
    kept: list[tuple[int, float | None]] = []
    branches: list[list[tuple[int, float | None]]] = []
    bad: list[tuple[int, str]] = []
    for i, seg in enumerate(segs):
        later = min((s.steps[0] for s in segs[i + 1:]), default=None)
        branch: list[tuple[int, float | None]] = []
        for step, data in zip(seg.steps, seg.data, strict=True):
            v = data.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            finite = math.isfinite(v)
            point = (step, float(v) if finite else None)
            if later is not None and step >= later:
                branch.append(point)
            else:
                kept.append(point)
                if not finite:
                    bad.append((step, str(v)))
        if branch:
            branches.append(branch)
    kept.sort(key=lambda p: p[0])
    return kept, branches, bad


def header(run_dir: Path, run: Any, segs: Sequence[Segment], events: Sequence[Mapping[str, Any]],
           decisions: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The header card's (label, text) rows: command, outcome, duration, steps, actions, settings changed.

    ``run`` is the store's record of the run (its phase, command, times, overrides) or None for a run
    directory alone (then run.json and the events say what they can)."""
    info = RunInfo.read(run_dir)
    command = list(getattr(run, "command", None) or info.command or [])
    phase = str(getattr(run, "phase", "") or "")
    code = getattr(run, "exit_code", None)
    outcome = (phase or "not known to a watchdog store") + (f" (trainer exit code {code})" if code not in (None, 0)
                                                            else "")
    stamps = [float(e["ts"]) for e in events if isinstance(e.get("ts"), (int, float))]
    start = getattr(run, "created", None) or (min(stamps) if stamps else None)
    end = getattr(run, "updated", None) or (max(stamps) if stamps else None)
    duration = duration_text(round(end - start)) if start and end and end >= start else "not known"
    trained = sum(len(s.steps) for s in segs)
    last = max((st for s in segs for st in s.steps), default=0)
    kept = len({st for s in segs for st in s.steps})
    again = trained - kept
    shown = [d for d in decisions if shown_in_history(d)]
    rows = [("command", shlex.join(command) if command else "not recorded"), ("outcome", outcome),
            ("duration", duration),
            ("steps", f"{last} (records of {trained} steps trained; {again} trained again after a rollback or "
                      "restart)" if again else f"{last}"),
            ("decisions", f"{len(shown)} acted on or advised, {len(decisions) - len(shown)} resolves and no-ops")]
    overrides = getattr(run, "overrides", None) or {}
    if overrides:
        rows.append(("settings now", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in sorted(overrides.items()))))
    if start:
        rows.append(("started", time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(start))))
    return rows


def log_axis(values: Sequence[float | None]) -> bool:
    """Whether a panel that may be logarithmic should be: every value above 0 (a scale: lr, kl_coef), or a spike
    20x the median of the positive values (a KL explosion, which a linear axis would show as a flat line and one
    peak; the steps at 0 or below are left out of its line and said on hover)."""
    finite = [v for v in values if v is not None]
    positive = sorted(v for v in finite if v > 0)
    if not positive:
        return False
    return len(positive) == len(finite) or positive[-1] > 20 * positive[len(positive) // 2]


def page_data(run_dir: Path | str, decisions: Sequence[Mapping[str, Any]],
              restarts: Sequence[tuple[int, int]] = ()) -> dict[str, Any]:
    """What the page's script draws: the panels a run logs (kept, abandoned, non-finite), the rolled-back
    spans and the decisions' marks, all against step."""
    run_dir = Path(run_dir)
    records = rundir.read_jsonl(run_dir / rundir.METRICS).records
    if not records:
        raise ReportError(f"{run_dir / rundir.METRICS}: no metrics to report")
    segs = segments(records)
    logged = {k for s in segs for d in s.data for k in d}
    panels = []
    for keys, title, log in HTML_PANELS:
        # The key as logged: verl's own name, an alias, or a per-data-source name (val-core/<source>/...).
        key = next((k for want in keys for k in ([want] if want in logged else sorted(logged))
                    if k == want or catalog.canonical_key(k) == want), None)
        if key is None:
            continue
        kept, branches, bad = timelines(segs, key)
        if not kept and not branches and not bad:
            continue
        panels.append({"key": key, "title": title, "log": log and log_axis([v for _, v in kept + sum(branches, [])]),
                       "kept": kept, "branches": branches, "bad": bad})
    steps = [st for s in segs for st in s.steps]
    events = rundir.read_jsonl(run_dir / rundir.EVENTS).records
    marks = [{"step": int(d["step"]), "rule": d["rule"], "status": str(d.get("status", "")),
              "colour": _OUTCOME_CSS.get(str(d.get("status")), "#333"), "text": decision_text(d)}
             for d in decisions if shown_in_history(d)]
    return {"panels": panels, "spans": sorted(set(rollback_spans(events)) | set(restarts)), "marks": marks,
            "xmin": min(steps), "xmax": max(steps), "segments": segs, "events": events}


_OUTCOME_CSS = {"applied": "#2ca02c", "failed": "#d62728", "pending": "#ff7f0e", "skipped": "#7f7f7f",
                "advised": "#9467bd", "waiting": "#1f77b4", "denied": "#8c564b"}


def render_html(run_dir: Path | str, decisions: Sequence[dict[str, Any]], out: Path | str,
                restarts: Sequence[tuple[int, int]] = (), run: Any = None) -> Path:
    """Write the self-contained HTML report: a header card, interactive charts against step (script and style
    inline: nothing is fetched when it is opened) and the decisions in words."""
    from ppo_watchdog.observe.report_script import SCRIPT, STYLE

    run_dir = Path(run_dir)
    data = page_data(run_dir, decisions, restarts)
    segs, events = data.pop("segments"), data.pop("events")
    e = html.escape
    card = "".join(f'<dt>{e(k)}</dt><dd class="{e(k)}{" outcome-" + e(v.split()[0]) if k == "outcome" else ""}">'
                   f"{e(v)}</dd>" for k, v in header(run_dir, run, segs, events, decisions))
    items = "".join(f'<li data-step="{int(m["step"])}"><span class="st" style="background:{m["colour"]}">'
                    f'{e(m["status"])}</span>{e(m["text"])}</li>' for m in data["marks"])
    missing = [t for _, t, _ in HTML_PANELS if t not in {p["title"] for p in data["panels"]}]
    # JSON inside <script>: "<" escaped so no value can close the element.
    payload = json.dumps(data, allow_nan=False).replace("<", "\\u003c")
    name = e(run_dir.name)
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>watchdog report: {name}</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'">
<style>{STYLE}</style></head><body>
<h1>Run {name}</h1>
<dl class="card">{card}</dl>
<h2>Metrics against step</h2>
<div class="legend">
<span><svg width="28" height="10"><line x1="0" y1="5" x2="28" y2="5" stroke="#1f77b4" stroke-width="2"/></svg> kept timeline</span>
<span><svg width="28" height="10"><line x1="0" y1="5" x2="28" y2="5" stroke="#999" stroke-width="1.5" stroke-dasharray="4 3"/></svg> abandoned branch (trained again after a rollback or restart)</span>
<span><svg width="16" height="12"><rect width="16" height="12" fill="#d62728" opacity=".18"/></svg> steps rolled back</span>
<span><svg width="10" height="12"><line x1="5" y1="0" x2="5" y2="12" stroke="#2ca02c" stroke-width="1.5" stroke-dasharray="2 2"/></svg> a decision (colour: its status)</span>
<span><svg width="10" height="8"><path d="M1,0L9,0L5,7Z" fill="#d62728"/></svg> NaN or inf</span>
<button id="reset">zoom out</button><span class="muted">drag across a chart to zoom, double-click to zoom out</span>
</div>
<div class="charts" id="charts"></div>
<p class="muted">{e("Not logged by this run: " + ", ".join(missing) + ".") if missing else ""}</p>
<h2>Decisions</h2>
{f'<ol class="decisions">{items}</ol>' if items else '<p class="muted">The watchdog took no action in this run.</p>'}
<div class="tip" id="tip"></div>
<script type="application/json" id="report-data">{payload}</script>
<script>{SCRIPT}</script>
</body></html>
"""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rundir.atomic_write_bytes(out, doc.encode())
    return out


def write_report(run_dir: Path | str, decisions: Sequence[dict[str, Any]], out: Path | str,
                 restarts: Sequence[tuple[int, int]] = (), run: Any = None) -> Path:
    """PNG or HTML by the output's suffix; ``run`` (the store's record) fills the HTML's header card."""
    out = Path(out)
    if out.suffix.lower() == ".png":
        return render_png(run_dir, decisions, out, restarts)
    if out.suffix.lower() in (".html", ".htm"):
        return render_html(run_dir, decisions, out, restarts, run)
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
