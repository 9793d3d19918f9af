"""Replay a recorded run through a rule set: what would have fired, and what it would have set.

The engine is the same pure function the daemon runs live; replay only feeds it the
recorded steps one at a time (a :class:`~watchdog.series.Window` grown incrementally,
the engine state carried from step to step) and records every decision. Config values
a ``set`` action would change come from the log itself where verl logs them
(``kl_coef`` from ``actor/reward_kl_penalty_coeff``, ``lr`` from ``actor/lr``), else from
what the caller passes (``--set KEY=VALUE``, or the run directory's run.json), else from
the previous simulated action on that key. Nothing is written anywhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer import catalog
from watchdog import engine as _engine
from watchdog.actions import TUNABLE_KEYS, SetAction

log = logging.getLogger(__name__)

#: Config keys (verl Hydra names) whose current value verl logs, by catalog short name.
LOGGED_CONFIG: dict[str, str] = {k: t.metric for k, t in TUNABLE_KEYS.items() if t.metric is not None}


@dataclass
class ReplayDecision:
    """One decision of the replayed timeline, JSON-ready."""

    step: int
    """Training step the decision was taken at."""
    rule: str
    """Rule name."""
    kind: str
    """``fire``, ``escalate`` or ``resolve``."""
    severity: str
    """The rule's severity."""
    message: str
    """The engine's message."""
    inputs: dict[str, float]
    """Metric values the condition read (short name -> value)."""
    actions: list[dict[str, Any]]
    """Each action's ``to_json()``; a ``set`` also carries ``from`` and ``to`` when the current value is known."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "rule": self.rule, "kind": self.kind, "severity": self.severity,
            "message": self.message, "inputs": _json_floats(self.inputs), "actions": self.actions,
        }


@dataclass
class ReplayResult:
    """The timeline of a replay and how much it covered."""

    decisions: list[ReplayDecision] = field(default_factory=list)
    """Every decision in step order."""
    steps: int = 0
    """Steps evaluated."""
    first_step: int | None = None
    """First step evaluated."""
    last_step: int | None = None
    """Last step evaluated."""
    unhealthy: dict[str, str] = field(default_factory=dict)
    """Rules that could not be evaluated at the last step (a metric the log lacks ...): name -> error."""

    def counts(self) -> dict[str, dict[str, int]]:
        """Decisions per rule and kind, e.g. ``{"kl_high": {"fire": 8, "resolve": 1}}``."""
        out: dict[str, dict[str, int]] = {}
        for d in self.decisions:
            out.setdefault(d.rule, {}).setdefault(d.kind, 0)
            out[d.rule][d.kind] += 1
        return out

    def to_json(self) -> list[dict[str, Any]]:
        return [d.to_json() for d in self.decisions]


def _json_floats(d: Mapping[str, float]) -> dict[str, Any]:
    # JSON has no NaN/inf; strings keep them visible and the document strict.
    return {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in d.items()}


def replay(
    records: Sequence[Mapping[str, Any]],
    rules: Any,
    events: Sequence[Mapping[str, Any]] = (),
    config: Mapping[str, Any] | None = None,
    window_size: int | None = None,
) -> ReplayResult:
    """Evaluate ``rules`` after every recorded step; returns the decision timeline.

    ``records`` are deduplicated FileLogger records (``watchdog.ingest.read_records``);
    ``events`` are run events, delivered to the window once their step is reached
    (:func:`watchdog.engine.run_series` drives the engine; this adds the would-set values);
    ``config`` gives current values for keys the log does not carry.
    """
    known: dict[str, float] = {}
    for k, v in (config or {}).items():
        try:
            known[k] = float(v)
        except (TypeError, ValueError):
            log.debug("config %s=%r is not numeric; ignored for replay", k, v)
    ordered = sorted(records, key=lambda r: int(r["step"]))
    logged = {int(r["step"]): catalog.to_short(r.get("data") or {}) for r in ordered}
    # Events without a step (or before the first record) are delivered first, then in step order.
    evs = sorted(events, key=lambda e: e["step"] if isinstance(e.get("step"), int) else -1)
    result = ReplayResult()
    seen: set[int] = set()
    final: _engine.EngineState | None = None
    for sr in _engine.run_series(rules, ordered, evs, size=window_size):
        final = sr.state
        if sr.step not in seen:  # run_series may evaluate the last step once more for late events
            seen.add(sr.step)
            result.steps += 1
        for key, short in LOGGED_CONFIG.items():
            v = logged.get(sr.step, {}).get(short)
            # 0 is skipped: old verl consoles print lr with 3 decimals ("actor/lr:0.000"),
            # and scaling a zero shows nothing useful anyway.
            if v is not None and math.isfinite(v) and v != 0:
                known[key] = v
        for d in sr.decisions:
            acts: list[dict[str, Any]] = []
            for a in d.actions:
                j = dict(a.to_json())
                j["text"] = a.describe()
                if isinstance(a, SetAction) and a.key in known:
                    new = a.apply(known[a.key])
                    j["from"], j["to"] = known[a.key], new
                    known[a.key] = new
                acts.append(j)
            result.decisions.append(
                ReplayDecision(d.step, d.rule, d.kind, d.severity, d.message, dict(d.inputs), acts)
            )
        if result.first_step is None:
            result.first_step = sr.step
        result.last_step = sr.step
    if final is not None:
        result.unhealthy = {n: rs.last_error or "" for n, rs in final.rules.items() if rs.health != "ok"}
    return result


def config_from_run_json(info: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten run.json's config snapshot (nested or dotted) into dotted keys."""
    cfg = info.get("config", {})
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", cfg if isinstance(cfg, Mapping) else {})
    return out
