"""The rules engine: a pure function (rules, window, state, step) -> (decisions, new state).

Per rule, a small state machine in the manner of Prometheus alerting rules::

    inactive --cond--> pending --held `for` steps, cooldown over--> firing --clear held
        ^                 |                                           |  keep_firing_for--> resolved
        +----not cond-----+                                           +-- cond, repeat, cooldown over: fire again

All durations are training steps, measured on a monotonic *clock* kept in the state:
it advances by the step difference when the run moves forward and by one when the run
is rewound (a rollback or resume re-trains earlier step numbers). So cooldowns, budgets
and ``for`` count steps actually trained, and fires recorded before a rollback still
count against the budget afterwards, which is how repeated rollbacks escalate.

A run that logs every few steps (TRL's ``logging_steps``, 10 by default) gives one record, one look
at the run, per logging window, and each look is the same kind of evidence as one step of a run that
logs every step (a chance dip shows on a record as it does on a step). So the engine counts ``for`` at
the run's cadence (``Window.cadence``, the spacing of its records, as its window functions do): ``for:
N`` is N records, N steps of a run that logs every step, 10N steps of one that logs every 10. Where
the spacing is irregular (a missed line, a resume), the condition must still be seen on ``min(N,
MIN_LOOKS)`` records in a row (:data:`MIN_LOOKS`). Cooldowns, budgets and ``step`` stay in training steps:
they measure compute spent, not evidence.

A fire over budget (more than ``budget.max`` fires within ``budget.window`` steps)
becomes an ``escalate`` decision whose actions are the budget's escalation (default:
pause + notify) instead of the rule's own. A rule whose expression fails (a metric the
run does not log, too little data) is marked unhealthy with the error, keeps its state,
and the other rules carry on. Nothing here does I/O or reads a clock, so live runs,
``watchdog replay`` and rule unit tests all give the same decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

from ppo_watchdog.core.actions import Action, NotifyAction
from ppo_watchdog.core.rulefile import Rule, RuleSet
from ppo_watchdog.core.series import Window
from ppo_watchdog.core.vocabulary import DecisionKind, RuleStatus
from ppo_watchdog.protocol import catalog

log = logging.getLogger(__name__)

ENGINE_STATE_VERSION = 1

#: The records in a row a condition must be seen true on before its ``for`` is met, where ``for`` is at
#: least this many steps (fewer: that many records). Three: a healthy noisy run shows a condition
#: on one record by chance, on two now and then (a 1-in-10 look twice is 1 in 100), three in a row
#: about never (1 in 1,000), while a failure stays failed and is seen on every look.
MIN_LOOKS = 3
INACTIVE, PENDING, FIRING, RESOLVED = RuleStatus.INACTIVE, RuleStatus.PENDING, RuleStatus.FIRING, RuleStatus.RESOLVED
STATUSES = tuple(s.value for s in RuleStatus)
DECISION_KINDS = tuple(k.value for k in DecisionKind)


class _SurelyTrue:
    """The type of :data:`SURELY_TRUE` (one object, compared by identity)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SURELY_TRUE"


SURELY_TRUE = _SurelyTrue()
"""A verdict of :func:`evaluate`'s ``verdicts``: the rule's condition is true at this step, without raising."""

Verdict = bool | str | _SurelyTrue
"""What :func:`evaluate`'s ``verdicts`` say of one rule at one step (see there)."""


@dataclass(frozen=True)
class Decision:
    """What the engine decided for one rule at one step."""

    rule: str
    """Rule name."""
    step: int
    """Training step evaluated."""
    kind: str
    """A :class:`DecisionKind`: fire | escalate | resolve."""
    actions: list[Action]
    """What to do (empty for resolve)."""
    inputs: dict[str, float]
    """Values of the metrics and function calls of the expression, for the audit log."""
    severity: str
    """The rule's severity."""
    message: str
    """One line for people."""
    divergence: bool = False
    """The rule marks checkpoints taken while it fires as not known-good."""
    urgent: bool = False
    """A relaunch this decision needs goes at once (divergence and OOM), not at the next checkpoint."""
    repeat: int = 1
    """Which fire this is within the rule's budget (1: the first); a growing ``set`` compounds by it."""
    signals: dict[str, str] = field(default_factory=dict)
    """The verl key each metric the rule read came from (``kl``: ``actor/kl_loss`` in a GRPO run)."""
    escalate: list[Action] = field(default_factory=list)
    """What runs instead when the fire's remedy is exhausted: every ``set`` of it is already at its
    bound, so sending it would change nothing (:func:`ppo_watchdog.core.planner.plan_decision`). The
    rule's budget escalation; a rule without a budget only tells a human."""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dict (NaN inputs stay floats; the store stringifies them)."""
        return {
            "rule": self.rule, "step": self.step, "kind": self.kind,
            "actions": [a.to_json() for a in self.actions], "inputs": dict(self.inputs),
            "severity": self.severity, "message": self.message, "divergence": self.divergence,
            "urgent": self.urgent, "repeat": self.repeat, "signals": dict(self.signals),
            "escalate": [a.to_json() for a in self.escalate],
        }


@dataclass(frozen=True)
class RuleState:
    """The engine's memory of one rule."""

    status: str = INACTIVE
    """inactive | pending | firing | resolved."""
    since: int | None = None
    """Clock at which the condition started holding (pending or firing)."""
    looks: int = 0
    """Evaluations in a row at which the condition held, counted up to :data:`MIN_LOOKS`."""
    clear_since: int | None = None
    """Clock at which the clear condition started holding while firing."""
    last_fire: int | None = None
    """Clock of the last fire or escalation (cooldown)."""
    last_fire_step: int | None = None
    """Training step of the last fire or escalation."""
    fires: tuple[int, ...] = ()
    """Clocks of recent fires (budget); older than any budget window are dropped."""
    fire_count: int = 0
    """Fires and escalations over the engine's life."""
    escalated_at: int | None = None
    """Clock of the last escalation: a rule escalates at most once per budget window."""
    health: str = "ok"
    """ok | unhealthy."""
    last_error: str | None = None
    """The last evaluation error (kept after recovery, for `rules explain`)."""

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from a fresh rule's (from_json fills in the rest): a daemon writes every
        run's state every tick, and most rules of most runs are at rest."""
        if self is _INITIAL or self == _INITIAL:  # (identity first: most rules of most runs are the one object)
            return {}
        full = {
            "status": self.status, "since": self.since, "looks": self.looks, "clear_since": self.clear_since,
            "last_fire": self.last_fire, "last_fire_step": self.last_fire_step, "fires": list(self.fires),
            "fire_count": self.fire_count, "escalated_at": self.escalated_at,
            "health": self.health, "last_error": self.last_error,
        }
        return {k: v for k, v in full.items() if v != _INITIAL_JSON[k]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RuleState:
        if not d:
            return _INITIAL  # (the one object: to_json and the engine's at-rest checks test identity first)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"engine state: unknown rule-state key(s) {sorted(unknown)}")
        if d.get("status", INACTIVE) not in STATUSES:
            raise ValueError(f"engine state: bad rule status {d.get('status')!r}")
        return cls(**{**d, "fires": tuple(int(x) for x in d.get("fires", ()))})


@dataclass(frozen=True)
class EngineState:
    """Everything the engine remembers between evaluations of one run (persisted by the daemon)."""

    clock: int = 0
    """Steps trained so far as the engine counts them (monotonic, also across rollbacks)."""
    last_step: int | None = None
    """Step of the last evaluation."""
    event_seq: int = 0
    """Sequence number of the newest window event already seen (``event()`` counts later ones)."""
    rules: Mapping[str, RuleState] = field(default_factory=dict)
    """Per-rule state by name."""
    version: int = ENGINE_STATE_VERSION
    """Format version of to_json."""

    def rule(self, name: str) -> RuleState:
        """State of one rule (inactive when never evaluated)."""
        return self.rules.get(name, _INITIAL)

    def firing(self) -> list[str]:
        """Names of rules now firing."""
        return [n for n, s in self.rules.items() if s.status == FIRING]

    def acknowledge(self, names: Iterable[str] | None = None) -> EngineState:
        """Forget fire budgets and escalations (all rules, or ``names``): a human resumed the run.

        Without this, a rule that escalated stays over budget for its whole window, so a
        problem that recurs right after the human's resume would get no remedy at all.
        """
        pick = set(self.rules) if names is None else set(names)
        rules = {n: replace(s, fires=(), escalated_at=None) if n in pick else s for n, s in self.rules.items()}
        return replace(self, rules=rules)

    def to_json(self) -> dict[str, Any]:
        return {**self._head_json(), "rules": {n: dict(r) for n, r in self._rules_part().items()}}

    def to_json_text(self, encode: Callable[[Any], str]) -> str:
        """:meth:`to_json` as JSON text by ``encode`` (a JSON encoder), the rules' part encoded once per rules
        mapping: a daemon writes every run's state at every tick, and :func:`evaluate` keeps the mapping (and
        this) while no rule changes, which is most steps of most runs."""
        memo = self.__dict__.get("_rules_text")
        if memo is None or memo[0] is not encode:
            memo = self.__dict__["_rules_text"] = (encode, encode(self._rules_part()))
        head = encode(self._head_json())
        return f'{head[:-1]}, "rules": {memo[1]}}}'  # (the head's closing brace moved past the rules)

    def _head_json(self) -> dict[str, Any]:
        return {"version": self.version, "clock": self.clock, "last_step": self.last_step,
                "event_seq": self.event_seq}

    def _rules_part(self) -> dict[str, dict[str, Any]]:
        """The rules' part of :meth:`to_json`, built once per rules mapping and shared: never changed."""
        rules = self.__dict__.get("_rules_json")
        if rules is None:
            rules = self.__dict__["_rules_json"] = {n: s.to_json() for n, s in sorted(self.rules.items())}
        return rules

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EngineState:
        """Inverse of to_json; ValueError on another version or a malformed document."""
        if not isinstance(d, Mapping):
            raise ValueError(f"engine state must be an object, got {type(d).__name__}")
        if d.get("version") != ENGINE_STATE_VERSION:
            raise ValueError(f"engine state version {d.get('version')!r} is not {ENGINE_STATE_VERSION}")
        unknown = set(d) - {"version", "clock", "last_step", "event_seq", "rules"}
        if unknown:
            raise ValueError(f"engine state: unknown key(s) {sorted(unknown)}")
        rules = {str(n): RuleState.from_json(s) for n, s in dict(d.get("rules", {})).items()}
        return cls(int(d.get("clock", 0)), d.get("last_step"), int(d.get("event_seq", 0)), rules)


_INITIAL = RuleState()
_INITIAL_JSON: dict[str, Any] = {
    "status": _INITIAL.status, "since": None, "looks": 0, "clear_since": None, "last_fire": None, "last_fire_step": None,
    "fires": [], "fire_count": 0, "escalated_at": None, "health": _INITIAL.health, "last_error": None,
}


def _advance(state: EngineState, step: int) -> int:
    if state.last_step is None:
        return state.clock + 1
    if step > state.last_step:
        return state.clock + (step - state.last_step)
    if step < state.last_step:
        return state.clock + 1  # rewound: one more step trained, on an earlier step number
    return state.clock


#: Per rule pack (a RuleSet or tuple, by identity; the pack is kept alive here so its id is not
#: reused): (names, one (name, enabled, condition, rule) per rule). A daemon evaluates one pack for
#: thousands of runs a tick; unpacking its rules once saves attribute reads per rule and step.
_PLANS: dict[int, tuple[object, tuple[str, ...], tuple[tuple[str, bool, Any, Rule], ...]]] = {}
_PLANS_MAX = 64


def _plan(rules: RuleSet | Iterable[Rule]) -> tuple[tuple[str, ...], tuple[tuple[str, bool, Any, Rule], ...]]:
    hit = _PLANS.get(id(rules))
    if hit is not None and hit[0] is rules:
        return hit[1], hit[2]
    plan = tuple((r.name, r.enabled, r.expr.fn, r) for r in rules)
    names = tuple(p[0] for p in plan)
    if isinstance(rules, (RuleSet, tuple)):  # immutable: the plan stays true
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[id(rules)] = (rules, names, plan)
    return names, plan


def evaluate(
    rules: RuleSet | Iterable[Rule], window: Window, state: EngineState, step: int,
    verdicts: Sequence[Verdict] | None = None,
) -> tuple[list[Decision], EngineState]:
    """Evaluate every enabled rule at ``step``; returns the decisions and the new state.

    ``verdicts`` (:class:`ppo_watchdog.core.screen.Screen`'s, over many runs at once), per rule: True where its condition
    is known to be false at this step without raising, :data:`SURELY_TRUE` where it is known to be true without
    raising, the text of the MissingDataError it is known to raise (as ``RuleState.last_error`` records it), or
    False. A condition known true or false is not evaluated, nor that of a rule at rest that fails again as it
    did; a rule pending or firing still steps on it (its clear condition, its ``for``, its cooldown)."""
    clock = _advance(state, step)
    seq = state.event_seq
    decisions: list[Decision] = []
    names, plan = _plan(rules)
    old = state.rules
    if len(old) == len(names) and tuple(old) == names:  # the last evaluation's mapping: its states in plan order
        aligned = True
        olds: Iterable[RuleState] = old.values()
    else:
        aligned = False
        get = old.get
        olds = [get(name, _INITIAL) for name in names]
    changed: dict[str, RuleState] | None = None  # (made when a rule changes: most steps none does)
    for (name, enabled, fn, rule), rs, verdict in zip(plan, olds, verdicts or repeat(False, len(plan)), strict=True):
        if rs is _INITIAL and enabled:  # never fired, healthy: the commonest state, one identity test
            if verdict is True:
                continue
            try:
                cond = True if verdict is SURELY_TRUE else fn(window, step, seq)
            except Exception as exc:  # noqa: BLE001 - a broken rule must not stop the others; recorded
                new = _failed(rule, rs, exc, step)
            else:
                if not cond:
                    continue  # (stays the same object: nothing to record)
                new = _transition(rule, rs, True, None, window, step, clock, seq, decisions)
        elif not enabled:
            continue
        elif rs.status == INACTIVE and rs.since is None:
            # At rest, the common case (most rules of most runs), inlined: _step_rule's first branch.
            if verdict and verdict is not True and verdict == rs.last_error and rs.health != "ok":
                continue  # it fails again as it did (_failed would keep it as it is)
            try:
                cond = False if verdict is True else True if verdict is SURELY_TRUE else fn(window, step, seq)
            except Exception as exc:  # noqa: BLE001 - a broken rule must not stop the others; recorded
                new = _failed(rule, rs, exc, step)
            else:
                if cond:
                    new = _transition(rule, rs if rs.health == "ok" else replace(rs, health="ok"), True, None,
                                      window, step, clock, seq, decisions)
                else:
                    new = rs if rs.health == "ok" else replace(rs, health="ok")
        else:
            new = _step_rule(rule, rs, window, step, clock, seq, decisions, verdict)
        if new is not rs:
            if changed is None:
                changed = {}
            changed[name] = new
    # Nothing changed: the previous mapping serves again (it has these names, in this order).
    if aligned:
        new_rules = old if changed is None else {**old, **changed}
    else:
        new_rules = dict(zip(names, olds, strict=True))
        if changed is not None:
            new_rules.update(changed)
    # The window functions' results and the windows' values they shared are of no use once the step
    # is judged (the next append clears them anyway): a daemon keeps a window per run between ticks.
    window.cache.clear()
    # EngineState(clock, step, event_seq, new_rules), without the frozen dataclass's five
    # object.__setattr__ calls: the same fields, set once on a new object (a third of the time).
    after: EngineState = _new_state(EngineState)
    after.__dict__.update(clock=clock, last_step=step, event_seq=max(window.event_seq, seq), rules=new_rules,
                          version=ENGINE_STATE_VERSION)
    if new_rules is old:  # (to_json's and to_json_text's memos: the same rules, the same JSON)
        memo = state.__dict__
        if "_rules_json" in memo:
            after.__dict__["_rules_json"] = memo["_rules_json"]
        if "_rules_text" in memo:
            after.__dict__["_rules_text"] = memo["_rules_text"]
    return decisions, after


_new_state = object.__new__


def _failed(rule: Rule, rs: RuleState, exc: Exception, step: int) -> RuleState:
    msg = f"{type(exc).__name__}: {exc}"
    if rs.health != "unhealthy" or rs.last_error != msg:
        log.debug("rule %s unhealthy at step %s: %s", rule.name, step, msg)
        return replace(rs, health="unhealthy", last_error=msg)
    return rs


def _step_rule(
    rule: Rule, rs: RuleState, w: Window, step: int, clock: int, seq: int, out: list[Decision],
    verdict: Verdict = False,
) -> RuleState:
    """A rule pending, firing or resolved, at ``step``; its condition evaluated unless ``verdict`` (see
    :func:`evaluate`) says what it is."""
    try:
        cond = False if verdict is True else True if verdict is SURELY_TRUE else bool(rule.expr.fn(w, step, seq))
        clearing = None
        if rs.status == FIRING:
            clearing = bool(rule.clear.fn(w, step, seq)) if rule.clear is not None else not cond
    except Exception as exc:  # noqa: BLE001 - a broken rule must not stop the others; recorded
        return _failed(rule, rs, exc, step)
    if rs.health != "ok":
        rs = replace(rs, health="ok")
    return _transition(rule, rs, cond, clearing, w, step, clock, seq, out)


def _transition(
    rule: Rule, rs: RuleState, cond: bool, clearing: bool | None, w: Window, step: int, clock: int, seq: int,
    out: list[Decision],
) -> RuleState:
    status = rs.status
    looks = min(rs.looks + 1, MIN_LOOKS) if cond else 0
    if status == FIRING:
        if clearing:
            since = rs.clear_since if rs.clear_since is not None else clock
            if clock - since >= rule.keep_firing_for:
                out.append(_decision(rule, DecisionKind.RESOLVE, step, w, seq, (), resolve=True))
                return replace(rs, status=RESOLVED, since=None, looks=0, clear_since=None)
            held_since = rs.since if cond else None
            if rs.clear_since == since and rs.since == held_since and rs.looks == looks:
                return rs
            return replace(rs, clear_since=since, since=held_since, looks=looks)
        # ``since`` tracks the current unbroken run of true steps, so a repeat fire also
        # needs the condition to have held ``for`` steps (not just one step after a dip).
        run_since = (rs.since if rs.since is not None else clock) if cond else None
        if rs.clear_since is not None or rs.since != run_since or rs.looks != looks:
            rs = replace(rs, clear_since=None, since=run_since, looks=looks)
        if (
            cond and rule.repeat and rs.last_fire is not None
            and clock > rs.last_fire and clock - rs.last_fire >= rule.cooldown
            and run_since is not None and _held(rule, clock - run_since, looks, w.cadence)
        ):
            return _fire(rule, rs, w, step, clock, seq, out)
        return rs

    if not cond:
        return rs if status == INACTIVE and rs.since is None else replace(rs, status=INACTIVE, since=None, looks=0)
    if status != PENDING:
        rs = replace(rs, status=PENDING, since=clock, looks=looks)
    elif rs.looks != looks:
        rs = replace(rs, looks=looks)
    cooled = rs.last_fire is None or clock - rs.last_fire >= rule.cooldown
    if _held(rule, clock - rs.since, looks, w.cadence) and cooled:  # type: ignore[operator]
        return _fire(rule, rs, w, step, clock, seq, out)
    return rs


def _held(rule: Rule, since: int, looks: int, cadence: int) -> bool:
    """Whether a condition true on every record of the last ``since`` steps (0: seen on this record only),
    ``looks`` records in a row, meets the rule's ``for`` at the run's ``cadence``: each record stands for
    ``cadence`` steps, so ``for: N`` is N records whatever the logging interval."""
    need = max(rule.for_, 1)
    return since + cadence >= need * cadence and looks >= min(need, MIN_LOOKS)


def _fire(rule: Rule, rs: RuleState, w: Window, step: int, clock: int, seq: int, out: list[Decision]) -> RuleState:
    b = rule.budget
    fires = rs.fires
    if b is not None:
        fires = tuple(c for c in fires if c > clock - b.window)
        if b.progress is not None and rs.last_fire is not None and clock - rs.last_fire >= b.progress:
            fires = ()  # the run trained ``progress`` steps without this cause: it recovered
        if len(fires) >= b.max:
            if rs.escalated_at is not None and clock - rs.escalated_at < b.window:
                # Already escalated in this window: a human has been called; do not repeat
                # the alert every cooldown (EngineState.acknowledge re-arms it on resume).
                # A pending rule stays pending (no fire, so no resolve will follow either).
                return rs if rs.fires == fires else replace(rs, fires=fires)
            recovery = f" without {b.progress} steps of recovery between them" if b.progress else ""
            esc = tuple(
                NotifyAction(f"budget exhausted: {b.max} fires within {b.window} steps{recovery}")
                if isinstance(a, NotifyAction) and not a.message else a
                for a in b.escalate
            )
            out.append(_decision(rule, DecisionKind.ESCALATE, step, w, seq, esc))
            return replace(
                rs, status=FIRING, clear_since=None, fires=fires, last_fire=clock, last_fire_step=step,
                fire_count=rs.fire_count + 1, escalated_at=clock,
            )
        fires = fires + (clock,)
    out.append(_decision(rule, DecisionKind.FIRE, step, w, seq, rule.actions, repeat=max(1, len(fires))))
    return replace(
        rs, status=FIRING, clear_since=None, fires=fires, last_fire=clock, last_fire_step=step,
        fire_count=rs.fire_count + 1,
    )


def _decision(
    rule: Rule, kind: str, step: int, w: Window, seq: int, actions: Sequence[Action], resolve: bool = False,
    repeat: int = 1,
) -> Decision:
    expr = rule.clear if resolve and rule.clear is not None else rule.expr
    inputs = expr.input_values(w, step, seq)
    shown = ", ".join(f"{k}={v:.4g}" for k, v in list(inputs.items())[:4])
    what = {
        "fire": "fired" if repeat == 1 else f"fired (repeat {repeat})", "resolve": "resolved",
        "escalate": f"escalated (budget {rule.budget.max if rule.budget else 0} fires"
        f" per {rule.budget.window if rule.budget else 0} steps exhausted)",
    }[kind]
    signals = {m: w.sources[m] for m in sorted(rule.expr.metrics) if m in w.sources}
    # Where a metric stands in for another (the KL loss for the KL penalty), say so.
    read = ", ".join(f"{m} = {k}" for m, k in signals.items() if catalog.BY_SHORT[m].key != k)
    msg = (f"{rule.name} {what} at step {step}: {expr.source}" + (f" [{shown}]" if shown else "")
           + (f" ({read})" if read else ""))
    escalate: list[Action] = []
    if kind == DecisionKind.FIRE:
        escalate = list(rule.budget.escalate) if rule.budget is not None else [NotifyAction()]
        escalate = [NotifyAction(f"remedy exhausted: {rule.name}'s sets are at their bounds and would change "
                                 "nothing") if isinstance(a, NotifyAction) and not a.message else a for a in escalate]
    return Decision(rule.name, step, kind, list(actions), inputs, rule.severity, msg, rule.divergence,
                    rule.urgent or rule.divergence, repeat, signals, escalate)


# -- blind rules ------------------------------------------------------------------------

#: Records after which a metric no rule has seen yet counts as not logged by the run.
BLIND_AFTER_STEPS = 3


def blind_rules(rules: Iterable[Rule], seen: Iterable[str]) -> dict[str, list[str]]:
    """Metrics some rule reads that the run never logged (short name -> the rules reading it)."""
    have = set(seen)
    out: dict[str, list[str]] = {}
    for rule in rules:
        if not rule.enabled:
            continue
        read = rule.expr.required | (rule.clear.required if rule.clear is not None else frozenset())
        for m in sorted(read - have):
            out.setdefault(m, []).append(rule.name)
    return out


def describe_blind(blind: Mapping[str, Sequence[str]]) -> list[str]:
    """One line per missing signal: which rules are blind to it and the verl setting that logs it
    (metrics one setting turns on together, KL and its coefficient, share a line)."""
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for short, names in sorted(blind.items(), key=lambda kv: (kv[0] != "kl", kv[0])):
        m = catalog.BY_SHORT.get(short)
        metrics, rules = groups.setdefault(m.needs if m is not None and m.needs else short, ([], []))
        metrics.append(short)
        rules += [n for n in names if n not in rules]
    lines = []
    for needs, (metrics, rules) in groups.items():
        first = catalog.BY_SHORT.get(metrics[0])
        keys = [first.key, *first.aliases, *first.fallbacks] if first is not None else [metrics[0]]
        what = "no KL to the reference" if metrics[0] == "kl" else f"no {metrics[0]}"
        hint = f"; verl logs it with {needs}" if first is not None and first.needs else ""
        lines.append(f"this run logs {what} ({' or '.join(keys)}): rule(s) {', '.join(rules)} "
                     f"are blind to it{hint}")
    return lines


# -- drivers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """One evaluation of a replay: the step, its decisions and the state after it."""

    step: int
    decisions: list[Decision]
    state: EngineState
    sources: Mapping[str, str] = field(default_factory=dict)
    """The verl key each short name was read from, as of this step."""


def run_series(
    rules: RuleSet | Sequence[Rule],
    records: Iterable[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]] = (),
    size: int | None = None,
    state: EngineState | None = None,
) -> Iterator[StepResult]:
    """Replay a recorded run: evaluate after every record (FileLogger ``{"step", "data"}``).

    Records are taken in the order written (a resumed run's rewritten steps replace the
    old ones). Each event is delivered before the first evaluation at or after its step,
    in order; events left after the last record get one final evaluation at that step
    (an OOM usually ends a run's log).
    """
    rules = tuple(rules)
    w = Window(size if size is not None else max((r.max_window for r in rules), default=1) + 1,
               frozenset().union(*(r.metrics for r in rules)))
    st = state or EngineState()
    pending = list(events)
    i = 0
    step = None
    for rec in records:
        step = int(rec["step"])
        w.append_record(rec)
        while i < len(pending) and (pending[i].get("step") is None or int(pending[i]["step"]) <= step):
            w.add_event(pending[i])
            i += 1
        decisions, st = evaluate(rules, w, st, step)
        yield StepResult(step, decisions, st, w.sources)
    if i < len(pending) and step is not None:
        w.add_events(pending[i:])
        decisions, st = evaluate(rules, w, st, step)
        yield StepResult(step, decisions, st, w.sources)


def evidence_text(inputs: Mapping[str, Any], limit: int = 6) -> str:
    """A decision's inputs for a table cell: the measured values first (at most ``limit``), then the
    ``$param`` thresholds they were compared with, so the evidence is what a narrow cell keeps."""
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    measured = [f"{k}={fmt(v)}" for k, v in inputs.items() if not str(k).startswith("$")]
    thresholds = [f"{k}={fmt(v)}" for k, v in inputs.items() if str(k).startswith("$")]
    text = ", ".join(measured[:limit]) + (f", ... ({len(measured) - limit} more)" if len(measured) > limit else "")
    if thresholds:
        text += ("; " if text else "") + "thresholds " + ", ".join(thresholds)
    return text
