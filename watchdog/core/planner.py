"""The one planner: what a decision becomes (journal entries and the values they set).

Pure: a decision and a :class:`PlanContext` in, :class:`Planned` entries out. The live
controller journals them, ``watchdog replay`` prints them and ``watchdog eval`` prices
them, so the three can never disagree on "from -> to", on micro-batch snapping, or on
which change needs a relaunch.

Where a set starts from (:func:`current_value`): for a key whose logged metric is the
truth (the KL coefficient: an adaptive controller or a fault moves it away from the
config) the metric; else the desired override, the trainer's config, the logged metric,
and last verl's own default for the key (what verl runs with when the command does not
set it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from watchdog.core.actions import (
    KL_COEF,
    TUNABLE_KEYS,
    CheckpointAction,
    NotifyAction,
    PauseAction,
    RollbackAction,
    SetAction,
    resolve_key,
    value_problem,
)
from watchdog.core.engine import Decision
from watchdog.core.vocabulary import DecisionKind

log = logging.getLogger(__name__)

MICRO_BATCH_KEYS = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
)
MINI_BATCH_OF = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_mini_batch_size",
}
#: What "a human is needed" becomes (``--on-escalate``): wait paused, stop with a verdict, or carry on alerted.
ON_ESCALATE = ("pause", "stop", "continue")


@dataclass(frozen=True)
class PlanContext:
    """What the planner knows about the run when it plans a decision."""

    overrides: Mapping[str, Any] = field(default_factory=dict)
    """Desired overrides so far (verl keys), including those of decisions planned earlier."""
    latest: Mapping[str, float] = field(default_factory=dict)
    """The newest logged value of each metric, by catalog short name."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The trainer's config snapshot (nested or dotted)."""
    live_keys: Sequence[str] = ()
    """Keys the trainer changes at a step boundary; every other set needs a relaunch."""
    signals: Mapping[str, str] = field(default_factory=dict)
    """The verl key each short name is read from (``kl``: ``actor/kl_loss`` picks the KL loss coefficient)."""
    on_escalate: str = "pause"
    """What a pause for a human becomes: ``pause``, ``stop`` (end the run, verdict) or ``continue``."""


@dataclass
class Planned:
    """One journal entry to write for a decision."""

    kind: str
    """live_set | restart | rollback | command | notify | stop."""
    payload: dict[str, Any]
    """What the actuator needs to carry it out (``set``: key -> new value, ``from``: key -> old value)."""

    @property
    def relaunch(self) -> bool:
        """True when carrying it out stops and relaunches the trainer."""
        return self.kind in ("restart", "rollback")


# -- values ----------------------------------------------------------------------------


def config_value(cfg: Mapping[str, Any], dotted: str) -> Any | None:
    """A dotted key from a nested (or already flat) config snapshot."""
    if dotted in cfg:
        return cfg[dotted]
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def current_value(key: str, ctx: PlanContext) -> float | None:
    """The value a ``set`` of ``key`` starts from (see the module docstring for the order)."""
    t = TUNABLE_KEYS.get(key)
    logged = _number(ctx.latest.get(t.metric)) if t is not None and t.metric else None
    if t is not None and t.metric_first and logged is not None:
        return logged
    for v in (ctx.overrides.get(key), config_value(ctx.config, key)):
        if (n := _number(v)) is not None:
            return n
    # 0 is skipped: old verl consoles print lr with 3 decimals ("actor/lr:0.000").
    if logged is not None and logged != 0:
        return logged
    return t.verl_default if t is not None else None


def snap_micro_batch(value: int, mini_batch: int | None) -> int:
    """The largest micro-batch <= ``value`` that divides the mini batch (the trainer insists), at least 1."""
    value = max(1, int(value))
    if not mini_batch or mini_batch < 1:
        return value
    while value > 1 and mini_batch % value:
        value -= 1
    return value


def settle_value(key: str, new: float, config: Mapping[str, Any]) -> float | int:
    """A computed value as the trainer takes it: micro batches snapped to divide the mini batch,
    epochs whole and at least 1."""
    if key in MICRO_BATCH_KEYS:
        mini = _number(config_value(config, MINI_BATCH_OF[key]))
        return snap_micro_batch(int(round(new)), int(mini) if mini is not None else None)
    t = TUNABLE_KEYS.get(key)
    if t is not None and t.integer:
        return max(1, int(round(new))) if key.endswith("ppo_epochs") else int(round(new))
    return float(new)


# -- decisions -------------------------------------------------------------------------


def plan_sets(actions: Sequence[Any], ctx: PlanContext, repeat: int = 1, rule: str = "") -> tuple[dict[str, Any],
                                                                                                  dict[str, float]]:
    """The new value (and the old) of every ``set`` among ``actions``; unknown starting values are skipped."""
    sets: dict[str, Any] = {}
    old: dict[str, float] = {}
    for a in actions:
        if not isinstance(a, SetAction):
            continue
        key = resolve_key(a.key, ctx.signals)
        cur = current_value(key, PlanContext({**ctx.overrides, **sets}, ctx.latest, ctx.config))
        if cur is None:
            log.warning("rule %s: no current value for %s; skipping the set", rule, key)
            continue
        new = settle_value(key, a.apply(cur, repeat), ctx.config)
        problem = value_problem(key, new)
        if problem:  # never written: a trainer would take a NaN kl_coef or a negative batch as given
            log.error("rule %s: %s (from %r); the set is not made", rule, problem, cur)
            continue
        old.setdefault(key, cur)
        sets[key] = new
    return sets, old


def plan_decision(decision: Decision, ctx: PlanContext) -> list[Planned]:
    """Journal entries for one engine decision."""
    if decision.kind == DecisionKind.RESOLVE:
        return []
    rule, severity, message = decision.rule, decision.severity, decision.message
    base = {"rule": rule, "step": decision.step}
    actions = list(decision.actions)
    if decision.kind == DecisionKind.ESCALATE and not actions:
        actions = [PauseAction()]  # the default escalation: wait for a human (a pause also alerts)
    sets, old = plan_sets(actions, ctx, decision.repeat, rule)
    out: list[Planned] = []
    for action in actions:
        if isinstance(action, CheckpointAction):
            out.append(Planned("command", {**base, "command": {"id": "", "kind": "checkpoint"}}))
        elif isinstance(action, PauseAction):
            out += _pause(base, action.reason or message, severity, ctx.on_escalate)
        elif isinstance(action, NotifyAction):
            out.append(Planned("notify", {**base, "severity": severity or "warning",
                                          "summary": f"{rule}: {action.message or message}",
                                          "description": message}))
    rollback = next((a for a in actions if isinstance(a, RollbackAction)), None)
    if rollback is not None:
        # The sets follow the rollback (a restored checkpoint brings back the old lr / kl_coef).
        out.insert(0, Planned("rollback", {**base, "skip_batches": rollback.skip_batches, "set": sets,
                                           "from": old}))
    elif sets:
        live = {k: v for k, v in sets.items() if k in ctx.live_keys}
        restart = [k for k in sets if k not in ctx.live_keys]
        if restart:
            out.insert(0, Planned("restart", {**base, "set": sets, "from": old, "resume": "latest",
                                              "urgent": bool(getattr(decision, "urgent", False)),
                                              "reason": f"{rule}: {', '.join(restart)} need a restart"}))
        else:
            out.insert(0, Planned("live_set", {**base, "set": live, "from": old}))
    return out


def _pause(base: dict[str, Any], reason: str, severity: str, on_escalate: str) -> list[Planned]:
    """A pause for a human, as the run's escalation policy has it."""
    rule = base["rule"]
    if on_escalate == "stop":
        return [Planned("stop", {**base, "verdict": f"{rule}: {reason}"}),
                Planned("notify", {**base, "severity": severity or "critical",
                                   "summary": f"{rule}: training stopped, nothing left to try", "description": reason})]
    if on_escalate == "continue":
        return [Planned("notify", {**base, "severity": severity or "critical",
                                   "summary": f"{rule}: a human is needed (the run carries on)",
                                   "description": reason})]
    return [Planned("command", {**base, "command": {"id": "", "kind": "pause"}, "pause": True}),
            Planned("notify", {**base, "severity": severity or "critical",
                               "summary": f"{rule}: training paused, a human is needed", "description": reason})]


__all__ = [
    "KL_COEF", "MICRO_BATCH_KEYS", "MINI_BATCH_OF", "ON_ESCALATE", "PlanContext", "Planned", "config_value",
    "current_value", "plan_decision", "plan_sets", "settle_value", "snap_micro_batch",
]
