"""Replay a recorded run through a rule set: what would have fired, and what it would have set.

The engine is the same pure function the daemon runs live; replay only feeds it the
recorded steps one at a time (a :class:`~ppo_watchdog.core.series.Window` grown incrementally,
the engine state carried from step to step) and records every decision. What each
decision would do comes from :func:`ppo_watchdog.core.planner.plan_decision`, the live controller's
own planner: values a ``set`` starts from are the log's own where verl logs them
(``kl_coef`` from ``actor/reward_kl_penalty_coeff``, ``lr`` from ``actor/lr``), else what the
caller passes (``--set KEY=VALUE``, or the run directory's run.json), else verl's default;
each planned set becomes the desired value later decisions start from, as it would live.
Nothing is written anywhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_watchdog.core import engine as _engine
from ppo_watchdog.core.actions import resolve_key
from ppo_watchdog.core.planner import PlanContext, Planned, plan_decision
from ppo_watchdog.core.summary import action_phrase, evidence
from ppo_watchdog.protocol import catalog
from ppo_watchdog.protocol.events import Event, outside_message, past_the_end

log = logging.getLogger(__name__)


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
    planned: list[Planned] = field(default_factory=list)
    """What the live controller would journal for it (:func:`ppo_watchdog.core.planner.plan_decision`)."""
    signals: dict[str, str] = field(default_factory=dict)
    """The verl key each metric the rule read came from."""
    sentence: str = ""
    """What the rule saw and what the watchdog would do, in words (:mod:`ppo_watchdog.core.summary`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "rule": self.rule, "kind": self.kind, "severity": self.severity,
            "message": self.message, "sentence": self.sentence, "inputs": _json_floats(self.inputs), "actions": self.actions,
            "signals": self.signals, "planned": [{"kind": p.kind, **_plan_json(p.payload)} for p in self.planned],
        }


def _plan_json(payload: Mapping[str, Any]) -> dict[str, Any]:
    return {k: payload[k] for k in ("set", "from", "skip_batches", "urgent", "verdict") if k in payload}


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
    blind: dict[str, list[str]] = field(default_factory=dict)
    """Metrics some rule reads that the log never has (short name -> rules): ``ppo_watchdog.core.engine.describe_blind``."""
    ignored: list[str] = field(default_factory=list)
    """Events left out because their step lies past the run's end, one ``file:line: ...`` message each."""

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
    live_keys: Sequence[str] = catalog.LIVE_KEYS,
    on_escalate: str = "pause",
) -> ReplayResult:
    """Evaluate ``rules`` after every recorded step; returns the decision timeline.

    ``records`` are deduplicated FileLogger records (``ppo_watchdog.sources.ingest.read_records``);
    ``events`` are run events, delivered to the window once their step is reached
    (:func:`ppo_watchdog.core.engine.run_series` drives the engine; the planner adds what each would do);
    ``config`` gives current values for keys the log does not carry; ``live_keys``: what the
    trainer changes in process (empty for a zero-patch verl run: every set is a relaunch).
    """
    ordered = sorted(records, key=lambda r: int(r["step"]))
    logged = {int(r["step"]): catalog.to_short(r.get("data") or {}) for r in ordered}
    result = ReplayResult()
    last = int(ordered[-1]["step"]) if ordered else None
    inside, outside = past_the_end([e if isinstance(e, Event) else Event(e) for e in events], last)
    if last is not None:
        result.ignored = [outside_message(e, last) for e in outside]
    # Events without a step (or before the first record) are delivered first, then in step order.
    evs = sorted(inside, key=lambda e: e["step"] if isinstance(e.get("step"), int) else -1)
    seen: set[int] = set()
    final: _engine.EngineState | None = None
    latest: dict[str, float] = {}
    overrides: dict[str, Any] = {}
    cfg = dict(config or {})
    by_name = {r.name: r for r in rules}
    for sr in _engine.run_series(rules, ordered, evs, size=window_size):
        final = sr.state
        if sr.step not in seen:  # run_series may evaluate the last step once more for late events
            seen.add(sr.step)
            result.steps += 1
        latest.update(logged.get(sr.step, {}))
        for d in sr.decisions:
            ctx = PlanContext(overrides, latest, cfg, live_keys, {**sr.sources, **d.signals}, on_escalate)
            planned = plan_decision(d, ctx)
            for p in planned:
                overrides.update(p.payload.get("set", {}))
            said = evidence(by_name.get(d.rule), d.kind, d.step, d.inputs, d.message)
            would = "; ".join(f"would {action_phrase(p.kind, p.payload, done=False)}" for p in planned)
            result.decisions.append(ReplayDecision(
                d.step, d.rule, d.kind, d.severity, d.message, dict(d.inputs), _described(d.actions, planned, ctx.signals),
                planned, dict(d.signals), f"{said}: {would}" if would else said))
        if result.first_step is None:
            result.first_step = sr.step
        result.last_step = sr.step
    if final is not None:
        result.unhealthy = {n: rs.last_error or "" for n, rs in final.rules.items() if rs.health != "ok"}
    result.blind = _engine.blind_rules(rules, {k for row in logged.values() for k in row})
    return result


def _described(actions: Sequence[Any], planned: Sequence[Planned], signals: Mapping[str, str]) -> list[dict[str, Any]]:
    """Each action's JSON with its text, and ``from``/``to`` for a set the planner could value."""
    new: dict[str, Any] = {}
    old: dict[str, Any] = {}
    for p in planned:
        new.update(p.payload.get("set", {}))
        old.update(p.payload.get("from", {}))
    out = []
    for a in actions:
        j = dict(a.to_json())
        j["text"] = a.describe()
        key = resolve_key(a.key, signals) if j["kind"] == "set" else None
        if key in new and key in old:
            j["from"], j["to"] = old[key], new[key]
            if key != a.key:
                j["resolved_key"] = key  # kl_coef: the KL term this run has
        out.append(j)
    return out


def flatten_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a config snapshot (run.json's, nested or dotted) into dotted keys."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", cfg)
    return out
