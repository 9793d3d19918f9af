"""``watchdog eval``: a rule pack judged on labelled runs, the way the live controller would act.

A labels file (``labels.yaml``, the schema of ``../shared/testdata/verl-logs/``) says what
happens in each recorded run::

    version: 1
    logs:
      - file: run_a.txt            # verl console log, FileLogger JSONL, metrics.jsonl or a run dir
        verdict: healthy           # healthy | failure | fragment
      - file: run_b.txt
        verdict: failure
        onset: 3                   # the failure starts here (the log's own step numbers)
        deadline: 7                # a good pack has acted by here
        expect: rollback           # rollback (or a pause that stops the damage) | alert (any notify)
                                   # | restart (a fresh trainer from the latest checkpoint, never a rollback)
        save_freq: 10              # optional: checkpoint every N steps (pricing; default --save-freq)
        startup_s: 240             # optional: a relaunch's start-up (default --startup-s)

Every log is replayed through the same engine (:func:`ppo_watchdog.core.engine.run_series`) and the
same planner (:func:`ppo_watchdog.core.planner.plan_decision`) and pricing
(:mod:`ppo_watchdog.core.pricing`) as the live controller. Verdicts:

- healthy: passes when nothing rolls it back or pauses it, and a zero-patch run (every
  ``set`` a relaunch, deferred to the next checkpoint and merged) would pay at most one
  relaunch per 100 steps (at least one allowed per run);
- failure: passes when the first action of the expected kind falls in ``[onset - 2,
  deadline]`` and nothing rolled back or paused it before ``onset - 2`` (a false action); an
  infrastructure failure (``expect: restart``) also fails on any rollback: mending the weights
  does not mend a broken rollout engine;
- fragment: too short to judge (replayed, not scored).

A corpus has headline figures (:meth:`CorpusScore.headline`): the failures detected on time, the
lead time from the first warning (any action, an alert included, at most ``LEAD_HORIZON`` steps
before it) to the onset, median and worst,
false rollbacks and pauses per 1,000 healthy steps (healthy runs, and failures before
``onset - 2``), zero-patch relaunches per 100 steps of the healthy runs, and sets that would have
changed nothing (none may be sent: :func:`ppo_watchdog.core.planner.plan_decision`). Beside them,
each rule's fires on those same healthy steps (:meth:`CorpusScore.rule_rates`): how often, per 1,000
healthy steps, and what each fire became in the evaluated mode (:data:`FIRE_KINDS`), so a rule that
cries wolf shows even when its cry is only an alert.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.core import engine
from ppo_watchdog.core.planner import PlanContext, Planned, plan_decision
from ppo_watchdog.core.pricing import DEFAULT_STARTUP_S, CostModel, RelaunchPolicy, Waiting, release
from ppo_watchdog.core.rulefile import MAX_FILE_BYTES, RuleError, RuleSet, YamlReader
from ppo_watchdog.core.vocabulary import DecisionKind
from ppo_watchdog.protocol import catalog, inputs
from ppo_watchdog.sources import ingest

LABELS_VERSION = 1
VERDICTS = ("healthy", "failure", "fragment")
EXPECTS = ("rollback", "alert", "restart")
MODES = ("embedded", "verl")
#: Steps before the labelled onset at which an action still counts as on time (labels.yaml's header).
EARLY_STEPS = 2
#: How far before the onset an action counts as a warning of it (lead time); earlier ones are about something else.
LEAD_HORIZON = 30
#: What a rule's fire became in the evaluated mode, strongest first: a fire that plans several entries
#: (a pause also notifies, a rollback carries its sets) counts as the strongest of them. The first four
#: interrupt the run at once (``restart``: a relaunch now, urgent or for a fresh rollout engine);
#: ``relaunch_set``: a tuning set that waits for the next checkpoint's relaunch (merged with others,
#: dropped if its rule stops firing: priced by the relaunch budget); ``none``: planned nothing (a set
#: left to verl's adaptive KL controller).
FIRE_KINDS = ("rollback", "restart", "stop", "pause", "relaunch_set", "live_set", "notify", "checkpoint", "none")
_LABEL_KEYS = ("file", "verdict", "onset", "deadline", "expect", "failure", "algorithm", "model", "task",
               "kl_key", "notes", "save_freq", "startup_s")


class LabelsError(ValueError):
    """A labels file is invalid; ``errors`` lists every problem with its file and line."""

    def __init__(self, errors: Sequence[RuleError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class Label:
    """What one recorded run is, as its labels entry says."""

    file: Path
    """The recorded run (resolved against the labels file's folder)."""
    verdict: str
    """healthy | failure | fragment."""
    onset: int | None = None
    """First step of the failure."""
    deadline: int | None = None
    """Last step by which a good pack has acted."""
    expect: str = "rollback"
    """rollback | alert."""
    save_freq: int | None = None
    """Checkpoint every N steps (pricing); None: the evaluation's default."""
    startup_s: float | None = None
    """Start-up of a relaunch (pricing); None: the evaluation's default."""
    notes: str = ""
    """Free text."""
    source: str = ""
    """labels file:line."""


def load_labels(path: Path | str) -> list[Label]:
    """Read and validate a labels file; :class:`LabelsError` lists every problem at once."""
    path = Path(path)
    try:
        text = inputs.read_text(path, MAX_FILE_BYTES, stream_ok=True)
    except (OSError, UnicodeDecodeError) as exc:
        raise LabelsError([RuleError(str(path), 1, 1, f"cannot read labels file: {inputs.reason(exc)}")]) from exc
    r = YamlReader(str(path))
    root = r.compose(text)
    if root is None:
        if not r.errors:
            r.error(None, "empty labels file: expected 'version: 1' and 'logs:'")
        raise LabelsError(r.errors)
    top = r.mapping(root, "labels file", ("version", "logs"), required=("version", "logs"))
    out: list[Label] = []
    if top is not None and "version" in top and r.scalar(top["version"][1]) != LABELS_VERSION:
        r.error(top["version"][1], f"unsupported labels version {r.scalar(top['version'][1])!r} "
                                   f"(this watchdog reads {LABELS_VERSION})")
    for i, node in enumerate((r.sequence(top["logs"][1], "logs") or []) if top and "logs" in top else []):
        label = _label(r, node, i, path.parent)
        if label is not None:
            out.append(label)
    if r.errors:
        raise LabelsError(r.errors)
    return out


def _label(r: YamlReader, node: Any, i: int, base: Path) -> Label | None:
    where = f"logs[{i}]"
    m = r.mapping(node, where, _LABEL_KEYS, required=("file", "verdict"))
    if m is None or "file" not in m or "verdict" not in m:
        return None
    file = r.string(m["file"][1], f"{where}.file")
    verdict = r.scalar(m["verdict"][1])
    if verdict not in VERDICTS:
        r.error(m["verdict"][1], f"{where}.verdict must be one of {', '.join(VERDICTS)}, got {verdict!r}")
        return None
    ints = {k: r.integer(m[k][1], f"{where}.{k}") if k in m else None for k in ("onset", "deadline", "save_freq")}
    expect = r.scalar(m["expect"][1]) if "expect" in m else "rollback"
    if expect not in EXPECTS:
        r.error(m["expect"][1], f"{where}.expect must be one of {', '.join(EXPECTS)}, got {expect!r}")
        return None
    startup = r.number(m["startup_s"][1], f"{where}.startup_s") if "startup_s" in m else None
    if verdict == "failure":
        for k in ("onset", "deadline"):
            if k not in m:
                r.error(node, f"{where}: a failure needs {k!r}")
        if ints["onset"] is not None and ints["deadline"] is not None and ints["deadline"] < ints["onset"]:
            r.error(m["deadline"][1], f"{where}.deadline {ints['deadline']} is before the onset {ints['onset']}")
            return None
    if file is None or any(k in m and ints[k] is None for k in ints) or ("startup_s" in m and startup is None):
        return None
    if verdict == "failure" and (ints["onset"] is None or ints["deadline"] is None):
        return None
    target = (base / file).resolve()
    if not target.exists():
        r.error(m["file"][1], f"{where}.file: {target} does not exist")
        return None
    notes = r.scalar(m["notes"][1]) if "notes" in m else ""
    return Label(target, verdict, ints["onset"], ints["deadline"], expect, ints["save_freq"], startup,
                 " ".join(str(notes).split()), f"{r.file}:{node.start_mark.line + 1}")


# -- one log -------------------------------------------------------------------------


@dataclass(frozen=True)
class Act:
    """One action the pack took on a log (after planning)."""

    step: int
    rule: str
    kind: str
    """rollback | restart | pause | stop | notify."""
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "rule": self.rule, "kind": self.kind, "detail": self.detail}


@dataclass
class Pricing:
    """What the run paid for its actions in one mode (relaunches deferred and merged as live)."""

    mode: str
    relaunches: int = 0
    """Trainer stops and starts (rollbacks by restart, urgent restarts, tuning relaunches)."""
    tuning_relaunches: int = 0
    """Of them, relaunches made only for tuning sets (at a checkpoint, merged)."""
    seconds: float = 0.0
    """Wall time they cost: start-up plus steps trained again."""
    steps_lost: int = 0
    """Steps trained again."""
    live_sets: int = 0
    """Sets applied live (free)."""
    deferred: int = 0
    """Tuning sets that waited for a checkpoint."""
    merged: int = 0
    """Waiting sets that shared a relaunch with another."""
    dropped: int = 0
    """Waiting sets dropped because their rule stopped firing."""

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class LogScore:
    """How the pack did on one labelled log."""

    label: Label
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    passed: bool = True
    reason: str = ""
    """Why it failed, or what it did right, in one line."""
    first_false: Act | None = None
    """The first rollback or pause of a healthy run (or before a failure's onset - 2)."""
    detected: Act | None = None
    """The first action of the expected kind (failures)."""
    warned: Act | None = None
    """The first action of any kind (an alert included) from ``LEAD_HORIZON`` steps before the onset to
    the deadline (failures)."""
    rollbacks: int = 0
    restarts: int = 0
    """Restarts from the latest checkpoint for a failed rollout machinery (``restart`` actions)."""
    pauses: int = 0
    """Pauses and stops (the run waits for, or is ended for, a human)."""
    alerts: int = 0
    noop_sets: int = 0
    """Planned sets that would leave their key where it is (sent, they would change nothing)."""
    set_decisions: int = 0
    zero_patch: Pricing = field(default_factory=lambda: Pricing("verl"))
    """What an unmodified verl run would pay (the healthy verdict's relaunch budget)."""
    priced: Pricing = field(default_factory=lambda: Pricing("embedded"))
    """What a run in the evaluated mode pays."""
    kl_source: str | None = None
    """The KL to the reference the run logs (its verl key), None when it logs none."""
    blind: dict[str, list[str]] = field(default_factory=dict)
    """Metrics rules read that the log lacks."""
    acts: list[Act] = field(default_factory=list)
    healthy_fires: dict[str, dict[str, int]] = field(default_factory=dict)
    """Rule -> :data:`FIRE_KINDS` kind -> its fires (and escalations) on healthy steps (:meth:`healthy_at`)."""

    @property
    def sets_per_100(self) -> float:
        return 100.0 * self.set_decisions / max(1, self.steps)

    @property
    def delay(self) -> int | None:
        if self.detected is None or self.label.onset is None:
            return None
        return self.detected.step - self.label.onset

    @property
    def lead(self) -> int | None:
        """Steps from the first warning to the onset (negative: the first warning came after it)."""
        if self.warned is None or self.label.onset is None:
            return None
        return self.label.onset - self.warned.step

    @property
    def trained(self) -> int:
        """Training steps the log spans, from its first step to its last: its records where it logs every
        step, ten times as many where it logs every 10 (TRL's ``logging_steps``)."""
        if self.first_step is None or self.last_step is None:
            return self.steps
        return max(self.steps, self.last_step - self.first_step + 1)

    @property
    def healthy_steps(self) -> int:
        """Training steps of this log judged as healthy (:meth:`healthy_at`): all of a healthy run, a failure's
        before ``onset - 2``."""
        if self.label.verdict == "healthy":
            return self.trained
        if self.label.verdict == "failure" and self.label.onset is not None and self.first_step is not None:
            return max(0, min(self.trained, self.label.onset - EARLY_STEPS - self.first_step))
        return 0

    def healthy_at(self, step: int) -> bool:
        """Whether ``step`` is one of the :attr:`healthy_steps`: an action there is a false one."""
        if self.label.verdict == "healthy":
            return True
        return self.label.verdict == "failure" and self.label.onset is not None and step < self.label.onset - EARLY_STEPS

    @property
    def relaunch_allowance(self) -> int:
        """Zero-patch relaunches a healthy run may pay: one per 100 training steps, at least one."""
        return max(1, self.trained // 100)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.label.file.name, "verdict": self.label.verdict, "passed": self.passed, "reason": self.reason,
            "onset": self.label.onset, "deadline": self.label.deadline, "expect": self.label.expect,
            "steps": self.steps, "first_step": self.first_step, "last_step": self.last_step,
            "first_false": self.first_false.to_json() if self.first_false else None,
            "detected": self.detected.to_json() if self.detected else None, "delay": self.delay,
            "warned": self.warned.to_json() if self.warned else None, "lead": self.lead,
            "rollbacks": self.rollbacks, "restarts": self.restarts, "pauses": self.pauses, "alerts": self.alerts,
            "noop_sets": self.noop_sets, "healthy_steps": self.healthy_steps,
            "set_decisions": self.set_decisions, "sets_per_100_steps": round(self.sets_per_100, 2),
            "zero_patch": self.zero_patch.to_json(), "priced": self.priced.to_json(),
            "relaunch_allowance": self.relaunch_allowance, "kl_source": self.kl_source, "blind": self.blind,
            "actions": [a.to_json() for a in self.acts], "healthy_fires": self.healthy_fires,
        }


@dataclass(frozen=True)
class EvalConfig:
    """How logs are priced when their labels do not say."""

    mode: str = "verl"
    """Mode priced in the ``priced`` column: embedded (live sets free) or verl (zero-patch: every set a relaunch)."""
    save_freq: int = 10
    """Checkpoint every N steps."""
    startup_s: float = DEFAULT_STARTUP_S
    """A relaunch's start-up, seconds."""
    relaunch_every: int = 100
    """Steps between two tuning relaunches, at least (as the live controller's ``tuning_relaunch_every``)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.save_freq < 1:
            raise ValueError(f"save_freq must be >= 1, got {self.save_freq}")


class _Ledger:
    """One mode's bookkeeping over a replay: live sets, deferred tuning relaunches, urgent relaunches."""

    def __init__(self, mode: str, live_keys: Sequence[str], cost: CostModel, save_freq: int,
                 policy: RelaunchPolicy) -> None:
        self.p = Pricing(mode)
        self.live_keys = live_keys
        self.cost = cost
        self.save_freq = save_freq
        self.policy = policy
        self.overrides: dict[str, Any] = {}
        self.waiting: list[Waiting] = []
        self.last_ckpt: int | None = None
        self.last_tuning: int | None = None
        self.in_process_rollback = mode == "embedded"
        self.noop_sets = 0

    def plan(self, d: engine.Decision, ctx: PlanContext) -> list[Planned]:
        """The decision planned in this mode, from the values this mode's run would have by now."""
        return plan_decision(d, PlanContext({**self.overrides, **self._waiting_sets()}, ctx.latest,
                                            ctx.config, self.live_keys, ctx.signals, ctx.on_escalate))

    def _waiting_sets(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for w in self.waiting:
            out.update(w.sets)
        return out

    def book(self, planned: Sequence[Planned], step: int, clock: int, firing: Iterable[str]) -> None:
        for p in planned:
            sets = p.payload.get("set", {})
            old = p.payload.get("from", {})
            self.noop_sets += sum(1 for k, v in sets.items() if k in old and _same(old[k], v))
            if p.kind == "live_set":
                self.p.live_sets += 1
                self.overrides.update(sets)
            elif p.kind == "restart" and p.payload.get("urgent") is False:
                self.waiting.append(Waiting(self.p.deferred, p.payload["rule"], step, sets))
                self.p.deferred += 1
            elif p.relaunch:
                rel = release(self.waiting, firing=firing, checkpoint_step=self.last_ckpt, clock=clock,
                              last_tuning_relaunch=self.last_tuning, policy=self.policy, relaunching=True)
                self.p.dropped += len(rel.dropped)
                self.overrides.update({**rel.merged(), **sets})
                self.waiting = []
                lost = self._since_ckpt(step)
                if p.kind == "rollback" and self.in_process_rollback:
                    self.p.seconds += lost * self.cost.step_time_s  # restored in process: no start-up
                else:
                    self._relaunch(lost)
                self.p.steps_lost += lost

    def after_step(self, step: int, clock: int, firing: Iterable[str]) -> None:
        if step > 0 and step % self.save_freq == 0:
            self.last_ckpt = step
        if not self.waiting:
            return
        rel = release(self.waiting, firing=firing, checkpoint_step=self.last_ckpt, clock=clock,
                      last_tuning_relaunch=self.last_tuning, policy=self.policy)
        self.p.dropped += len(rel.dropped)
        self.waiting = list(rel.keep)
        if rel.carry:
            self.overrides.update(rel.merged())
            self.p.merged += len(rel.carry) - 1
            self.p.tuning_relaunches += 1
            self.last_tuning = clock
            self._relaunch(self._since_ckpt(step))

    def _since_ckpt(self, step: int) -> int:
        return max(0, step - (self.last_ckpt if self.last_ckpt is not None else 0))

    def _relaunch(self, lost: int) -> None:
        c = self.cost.relaunch(lost)
        self.p.relaunches += 1
        self.p.seconds += c.seconds


def evaluate_log(label: Label, rules: RuleSet, cfg: EvalConfig) -> LogScore:
    """Replay one labelled log through the pack and score it by its label."""
    res = ingest.read_run(label.file)
    score = LogScore(label)
    records = res.records
    times = [t for r in records if isinstance(t := r["data"].get("perf/time_per_step", r["data"].get("timing_s/step")),
                                               (int, float)) and math.isfinite(t) and t > 0]
    cost = CostModel(label.startup_s if label.startup_s is not None else cfg.startup_s,
                     statistics.median(times) if times else 0.0)
    save_freq = label.save_freq or cfg.save_freq
    policy = RelaunchPolicy(cfg.relaunch_every)
    verl = _Ledger("verl", (), cost, save_freq, policy)
    own = _Ledger(cfg.mode, () if cfg.mode == "verl" else catalog.LIVE_KEYS, cost, save_freq, policy)

    latest: dict[str, float] = {}
    logged = {int(r["step"]): r for r in records}
    seen_steps: set[int] = set()
    seen_metrics: set[str] = set()
    for sr in engine.run_series(rules, records, sorted(res.events, key=_event_step)):
        row = catalog.to_short(logged[sr.step]["data"]) if sr.step in logged else {}
        latest.update(row)
        seen_metrics |= set(row)
        if sr.step not in seen_steps:
            seen_steps.add(sr.step)
            score.steps += 1
            score.first_step = sr.step if score.first_step is None else score.first_step
            score.last_step = sr.step
        firing = sr.state.firing()
        for d in sr.decisions:
            ctx = PlanContext({}, latest, {}, (), {**sr.sources, **d.signals})
            if d.kind != "resolve" and any(a.kind == "set" for a in d.actions):
                score.set_decisions += 1
            planned = verl.plan(d, ctx)
            _score_actions(score, d, planned)
            verl.book(planned, sr.step, sr.state.clock, firing)
            own_planned = own.plan(d, ctx)
            own.book(own_planned, sr.step, sr.state.clock, firing)
            if d.kind != DecisionKind.RESOLVE and score.healthy_at(d.step):
                kinds = score.healthy_fires.setdefault(d.rule, {})
                kind = fire_kind(own_planned)
                kinds[kind] = kinds.get(kind, 0) + 1
        verl.after_step(sr.step, sr.state.clock, firing)
        own.after_step(sr.step, sr.state.clock, firing)
        score.kl_source = sr.sources.get("kl", score.kl_source)
    score.zero_patch, score.priced = verl.p, own.p
    score.noop_sets = max(verl.noop_sets, own.noop_sets)
    score.blind = engine.blind_rules(rules, seen_metrics)
    _verdict(score)
    return score


def _same(a: Any, b: Any) -> bool:
    try:
        fa, fb = float(a), float(b)
    except (TypeError, ValueError):
        return a == b
    return fa == fb or abs(fa - fb) <= 1e-9 * max(abs(fa), abs(fb))


def _event_step(e: Mapping[str, Any]) -> int:
    return e["step"] if isinstance(e.get("step"), int) else -1


def fire_kind(planned: Sequence[Planned]) -> str:
    """What one fire became (its strongest planned entry), one of :data:`FIRE_KINDS`."""
    kinds: set[str] = set()
    for p in planned:
        if p.kind == "command":
            kinds.add(p.payload.get("command", {}).get("kind", "none"))
        elif p.kind == "restart":
            kinds.add("relaunch_set" if p.payload.get("urgent") is False else "restart")
        else:
            kinds.add(p.kind)
    return next((k for k in FIRE_KINDS if k in kinds), "none")


def _score_actions(score: LogScore, d: engine.Decision, planned: Sequence[Planned]) -> None:
    for p in planned:
        kind = {"rollback": "rollback", "stop": "stop", "notify": "notify"}.get(p.kind)
        if p.kind == "command" and p.payload.get("command", {}).get("kind") == "pause":
            kind = "pause"
        if p.kind == "restart" and p.payload.get("fresh_engine"):
            kind = "restart"
        if kind is None:
            continue
        act = Act(d.step, d.rule, kind, p.payload.get("summary", "") or p.payload.get("verdict", ""))
        score.acts.append(act)
        if kind == "rollback":
            score.rollbacks += 1
        elif kind == "restart":
            score.restarts += 1
        elif kind in ("pause", "stop"):
            score.pauses += 1
        else:
            score.alerts += 1


def _verdict(score: LogScore) -> None:
    lab = score.label
    drastic = [a for a in score.acts if a.kind in ("rollback", "pause", "stop")]
    if lab.verdict == "fragment":
        score.reason = "fragment: replayed, not scored"
        return
    if lab.verdict == "healthy":
        # A restart of a healthy run is a false action too (its cost is in the relaunches).
        false_acts = [a for a in score.acts if a.kind in ("rollback", "restart", "pause", "stop")]
        score.first_false = false_acts[0] if false_acts else None
        over = score.zero_patch.relaunches > score.relaunch_allowance
        score.passed = score.first_false is None and not over
        if score.first_false is not None:
            f = score.first_false
            score.reason = f"healthy run: {f.kind} by {f.rule} at step {f.step}"
        elif over:
            score.reason = (f"healthy run: {score.zero_patch.relaunches} zero-patch relaunches in {score.steps} "
                            f"steps (allowed {score.relaunch_allowance})")
        else:
            score.reason = "no rollback or pause; relaunches within budget"
        return
    assert lab.onset is not None and lab.deadline is not None
    early = lab.onset - EARLY_STEPS
    false = [a for a in drastic if a.step < early]
    if lab.expect == "restart":
        # Rolling the policy back does not mend a broken rollout engine: any rollback is wrong here.
        false = [a for a in score.acts if a.kind == "rollback" or (a.kind in ("pause", "stop") and a.step < early)]
    score.first_false = false[0] if false else None
    wanted = {"rollback": drastic, "alert": [*drastic, *(a for a in score.acts if a.kind in ("notify", "restart"))],
              "restart": [a for a in score.acts if a.kind == "restart"]}[lab.expect]
    on_time = sorted((a for a in wanted if a.step >= early), key=lambda a: a.step)
    score.detected = on_time[0] if on_time else None
    warnings = sorted((a for a in score.acts if lab.onset - LEAD_HORIZON <= a.step <= lab.deadline),
                      key=lambda a: a.step)
    score.warned = warnings[0] if warnings else None
    ok = score.detected is not None and score.detected.step <= lab.deadline
    score.passed = ok and score.first_false is None
    if score.first_false is not None:
        f = score.first_false
        score.reason = (f"policy {f.kind} by {f.rule} at step {f.step} on a failure of the rollout machinery"
                        if lab.expect == "restart" and f.step >= early else
                        f"false {f.kind} by {f.rule} at step {f.step}, before the onset {lab.onset}")
    elif score.detected is None:
        score.reason = f"no {lab.expect} at all (onset {lab.onset}, deadline {lab.deadline})"
    elif not ok:
        score.reason = f"{lab.expect} only at step {score.detected.step}, after the deadline {lab.deadline}"
    else:
        score.reason = f"{score.detected.kind} by {score.detected.rule} at step {score.detected.step}"


# -- a corpus ------------------------------------------------------------------------


@dataclass
class CorpusScore:
    """Every log's score and the summary."""

    scores: list[LogScore]
    rules: tuple[str, ...] = ()
    """Rule files of the pack."""
    config: EvalConfig = field(default_factory=EvalConfig)
    rule_names: tuple[str, ...] = ()
    """The pack's rules (each gets a row in :meth:`rule_rates`, fired or not)."""

    @property
    def judged(self) -> list[LogScore]:
        return [s for s in self.scores if s.label.verdict != "fragment"]

    @property
    def passed(self) -> bool:
        """Every judged log passed, and no set that would change nothing was planned."""
        return all(s.passed for s in self.judged) and not any(s.noop_sets for s in self.scores)

    def headline(self) -> dict[str, Any]:
        """The corpus's headline figures (see the module docstring); lead times in steps."""
        fail = [s for s in self.judged if s.label.verdict == "failure"]
        healthy = [s for s in self.judged if s.label.verdict == "healthy"]
        detected = [s for s in fail if s.passed]
        leads = [s.lead for s in fail if s.lead is not None]
        h_steps = self.healthy_steps
        false = sum(1 for s in self.judged for a in s.acts if a.kind in ("rollback", "pause", "stop", "restart")
                    and s.healthy_at(a.step))
        hl_steps = sum(s.trained for s in healthy)
        return {
            "failures": len(fail), "detected": len(detected),
            "detection_rate": round(len(detected) / len(fail), 3) if fail else None,
            "lead_median": statistics.median(leads) if leads else None, "lead_worst": min(leads) if leads else None,
            "healthy_steps": h_steps, "false_actions": false,
            "false_per_1000_healthy_steps": round(1000.0 * false / h_steps, 2) if h_steps else None,
            "healthy_run_steps": hl_steps,
            "relaunches_per_100_healthy_steps": round(100.0 * sum(s.zero_patch.relaunches for s in healthy)
                                                      / hl_steps, 2) if hl_steps else None,
            "noop_sets": sum(s.noop_sets for s in self.scores),
        }

    @property
    def healthy_steps(self) -> int:
        """Healthy steps of the judged logs: the denominator of every rate per 1,000 healthy steps."""
        return sum(s.healthy_steps for s in self.judged)

    def rule_rates(self) -> list[dict[str, Any]]:
        """Each rule's fires on healthy steps, per 1,000 healthy steps, and what they became; most fires first."""
        total: dict[str, dict[str, int]] = {name: {} for name in self.rule_names}
        for s in self.judged:
            for rule, kinds in s.healthy_fires.items():
                into = total.setdefault(rule, {})
                for kind, n in kinds.items():
                    into[kind] = into.get(kind, 0) + n
        h = self.healthy_steps
        rows = []
        for rule, kinds in total.items():
            fires = sum(kinds.values())
            rows.append({"rule": rule, "fires": fires,
                         "per_1000_healthy_steps": round(1000.0 * fires / h, 2) if h else None,
                         "actions": {k: kinds[k] for k in FIRE_KINDS if k in kinds}})
        return sorted(rows, key=lambda r: (-r["fires"], r["rule"]))

    def headline_text(self) -> str:
        """The headline figures in one line."""
        h = self.headline()
        det = f"detected {h['detected']}/{h['failures']}" if h["failures"] else "no failures"
        lead = (f"lead time median {h['lead_median']:g}, worst {h['lead_worst']:+d} steps"
                if h["lead_median"] is not None else "lead time -")
        fal = "-" if h["false_per_1000_healthy_steps"] is None else f"{h['false_per_1000_healthy_steps']:g}"
        rel = "-" if h["relaunches_per_100_healthy_steps"] is None else f"{h['relaunches_per_100_healthy_steps']:g}"
        return (f"{det}; {lead}; false rollbacks/pauses {fal} per 1000 healthy steps ({h['healthy_steps']}); "
                f"zero-patch relaunches {rel} per 100 healthy-run steps; sets that changed nothing {h['noop_sets']}")

    def summary(self) -> str:
        j = self.judged
        healthy = [s for s in j if s.label.verdict == "healthy"]
        fail = [s for s in j if s.label.verdict == "failure"]
        frag = len(self.scores) - len(j)
        noop = sum(s.noop_sets for s in self.scores)
        return (f"{sum(s.passed for s in j)}/{len(j)} logs passed: healthy {sum(s.passed for s in healthy)}/"
                f"{len(healthy)}, failures {sum(s.passed for s in fail)}/{len(fail)}"
                + (f"; {frag} fragment(s) replayed, not scored" if frag else "")
                + (f"; {noop} set(s) that would change nothing" if noop else ""))

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "summary": self.summary(), "headline": self.headline(),
                "rule_rates": {"healthy_steps": self.healthy_steps, "rules": self.rule_rates()},
                "rules": list(self.rules), "config": self.config.__dict__, "logs": [s.to_json() for s in self.scores]}


def evaluate_corpus(labels: Sequence[Label], rules: RuleSet, cfg: EvalConfig,
                    progress: Callable[[Label], None] | None = None) -> CorpusScore:
    """Score every labelled log; ``progress`` is called before each."""
    scores = []
    for label in labels:
        if progress is not None:
            progress(label)
        scores.append(evaluate_log(label, rules, cfg))
    return CorpusScore(scores, rules.sources, cfg, tuple(rules.names))
