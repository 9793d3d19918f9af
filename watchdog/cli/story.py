"""A run's story in words: the end-of-run summary of ``watchdog run`` and what ``watchdog history RUN`` prints.

A header (outcome, steps, duration, the values the watchdog changed from -> to, the first and last validation
score, the actions counted from the journal), then one line per decision that acted, was advised or waits for a
person: its step, rule and sentence (:func:`ppo_watchdog.core.summary.sentence`). Resolves and decisions that
did nothing (covered by a rollback in progress, left out) only with ``all_decisions``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.control.actuator import duration_text
from ppo_watchdog.control.store import Phase, RunRecord
from ppo_watchdog.core.summary import key_word, number, sentence
from ppo_watchdog.core.vocabulary import ActionStatus, DecisionKind, DecisionStatus, JournalKind
from ppo_watchdog.protocol import catalog


@dataclass
class Story:
    """What :func:`story` found: the header's facts, the lines, and the same as JSON."""

    header: list[str]
    """Outcome, steps and duration; values changed; validation; counts."""
    lines: list[str] = field(default_factory=list)
    """One per decision shown."""
    data: dict[str, Any] = field(default_factory=dict)
    """The same facts for ``--json``."""


def acted(d: Mapping[str, Any]) -> bool:
    """A decision ``watchdog history`` shows without ``--all``: one with a journal entry (done, advised, waiting,
    denied, failed) or one of the watchdog's own that did something itself (a stop by signal); not a resolve, not
    one that planned nothing (left out, covered by a rollback in progress: its status ``skipped``)."""
    return d["kind"] != DecisionKind.RESOLVE and (bool(d.get("journal")) or d["status"] != DecisionStatus.SKIPPED)


def counts(decisions: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The actions carried out, from the journal (one source, so the header agrees with the lines): rollbacks
    (in process or by relaunch), relaunches (every trainer the watchdog started again), live changes, pauses,
    stops, alerts; advised and waiting apart."""
    out = {"rollbacks": 0, "relaunches": 0, "live_changes": 0, "pauses": 0, "stops": 0, "alerts": 0,
           "advised": 0, "waiting": 0, "denied": 0, "failed": 0}
    for d in decisions:
        for j in d.get("journal") or []:
            kind, status, payload = j["kind"], j["status"], j.get("payload") or {}
            if status == ActionStatus.ADVISED:
                out["advised"] += 1
            elif status == ActionStatus.AWAITING:
                out["waiting"] += 1
            elif status == ActionStatus.DENIED:
                out["denied"] += 1
            elif status == ActionStatus.FAILED:
                out["failed"] += 1
            elif status == ActionStatus.DONE:
                handed = (j.get("result") or {}).get("handed_to") is not None
                if kind == JournalKind.ROLLBACK and not handed:
                    out["rollbacks"] += 1
                elif kind == JournalKind.RESTART:
                    out["relaunches"] += 1
                    out["rollbacks"] += "skip_batches" in payload  # a rollback carried out by relaunch
                elif kind == JournalKind.LIVE_SET:
                    out["live_changes"] += 1
                elif kind == JournalKind.COMMAND and (payload.get("command") or {}).get("kind") == "pause":
                    out["pauses"] += 1
                elif kind == JournalKind.STOP:
                    out["stops"] += 1
                elif kind == JournalKind.NOTIFY:
                    out["alerts"] += 1
    return out


def changed_values(run: RunRecord, decisions: Sequence[Mapping[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """Each key the watchdog changed: (its value before the first change, its value now)."""
    first: dict[str, Any] = {}
    for d in decisions:
        for j in d.get("journal") or []:
            if j["status"] != ActionStatus.DONE:
                continue
            for k, v in ((j.get("payload") or {}).get("from") or {}).items():
                first.setdefault(k, v)
    return {k: (first.get(k), v) for k, v in run.overrides.items() if first.get(k) != v}


def validation(run_dir: str | Path) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """(step, score) of the first and the last validation the run logged, None when it logged none."""
    from ppo_watchdog.sources.ingest import read_records

    try:
        records = read_records(run_dir)
    except (OSError, ValueError):
        return None
    seen = []
    for r in records:
        v = catalog.to_short(r.get("data") or {}).get("val_score")
        if v is not None:
            seen.append((int(r["step"]), float(v)))
    return (seen[0], seen[-1]) if seen else None


def outcome_text(run: RunRecord, decisions: Sequence[Mapping[str, Any]]) -> str:
    """The run's end in words: finished, or stopped or failed and why (its newest escalation's outcome)."""
    if run.phase == Phase.FINISHED:
        return "finished"
    ended = [d for d in decisions if d["kind"] == DecisionKind.ESCALATE]
    why = (ended[-1]["outcome"] or ended[-1]["message"]) if ended else ""
    return f"{run.phase}: {why}" if why else str(run.phase)


def story(run: RunRecord, decisions: Sequence[Mapping[str, Any]], all_decisions: bool = False,
          now: float | None = None) -> Story:
    """The run's header and one line per decision shown (:func:`acted`, or all with ``all_decisions``)."""
    end = run.updated if run.phase in (Phase.FINISHED, Phase.STOPPED, Phase.FAILED) else (now or time.time())
    seconds = max(0.0, end - run.created) if run.created else 0.0
    steps = f"{run.last_step} steps" if run.last_step is not None else "no step trained"
    outcome = outcome_text(run, decisions)
    advised = any(j["status"] == ActionStatus.ADVISED for d in decisions for j in d.get("journal") or [])
    header = [f"run {run.run_id}: {outcome}; {steps} in {duration_text(round(seconds))}"
              + ("; advise mode: what the watchdog would have done, nothing carried out" if advised else "")]
    changed = changed_values(run, decisions)
    if changed:
        header.append("changed: " + ", ".join(
            f"{key_word(k)} {number(a)} -> {number(b)}" if a is not None else f"{key_word(k)} -> {number(b)}"
            for k, (a, b) in changed.items()))
    val = validation(run.run_dir)
    if val is not None:
        (s0, v0), (s1, v1) = val
        header.append(f"validation score {number(v0)} at step {s0}, {number(v1)} at step {s1}")
    n = counts(decisions)
    said = [f"{n[k]} {k.replace('_', ' ')}" for k in n if n[k]]
    header.append("actions: " + (", ".join(said) if said else "none"))
    shown = [d for d in decisions if all_decisions or acted(d)]
    lines = [f"step {d['step']:>5}  {d['rule']}: {sentence(d)}" for d in shown]
    if not all_decisions and len(shown) < len(decisions):
        lines.append(f"({len(decisions) - len(shown)} more decision(s) that did nothing or resolved: --all)")
    data = {"run": run.run_id, "outcome": outcome, "phase": run.phase, "last_step": run.last_step,
            "seconds": round(seconds, 1), "changed": {k: {"from": a, "to": b} for k, (a, b) in changed.items()},
            "validation": {"first": {"step": val[0][0], "score": val[0][1]},
                           "last": {"step": val[1][0], "score": val[1][1]}} if val else None,
            "actions": n,
            "decisions": [{"id": d["id"], "step": d["step"], "rule": d["rule"], "kind": d["kind"],
                           "status": d["status"], "sentence": sentence(d)} for d in shown]}
    return Story(header, lines, data)
