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

How hard a remedy cuts: a set's ``scale`` applies to the value in force (the cuts before it
included); with ``grow: true`` the n-th fire of a rule within its budget scales by ``scale ** n``,
so lr x0.5 is x0.5, x0.25, x0.125 of the value before each (x0.0156 in all), and a set without it
repeats its factor (kl_leap's lr x0.1: x0.001 after three). A divergence that recurs after a rollback,
whichever divergence rule catches it, is planned as the n-th rewind of that trouble (the controller
passes ``Decision.repeat``; ``RunController._recurrence``), and its rollback goes further back.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_watchdog.core.actions import (
    KL_COEF,
    TUNABLE_KEYS,
    CheckpointAction,
    NotifyAction,
    PauseAction,
    RestartAction,
    RollbackAction,
    SetAction,
    StopAction,
    resolve_key,
    value_problem,
)
from ppo_watchdog.core.engine import Decision
from ppo_watchdog.core.vocabulary import DecisionKind
from ppo_watchdog.protocol import catalog

log = logging.getLogger(__name__)

ACTOR_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"
LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
REF_MICRO = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
MICRO_BATCH_KEYS = (ACTOR_MICRO, CRITIC_MICRO)
MINI_BATCH_OF = {
    ACTOR_MICRO: "actor_rollout_ref.actor.ppo_mini_batch_size",
    CRITIC_MICRO: "critic.ppo_mini_batch_size",
}
#: Every micro-batch key verl checks against a share of the batch (training: the mini batch; the
#: log-prob passes: the whole batch), with the Ulysses sequence-parallel size of its role.
_SHARE_OF: dict[str, tuple[str, str]] = {
    ACTOR_MICRO: ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    CRITIC_MICRO: ("critic.ppo_mini_batch_size", "critic.ulysses_sequence_parallel_size"),
    LOG_PROB_MICRO: ("data.train_batch_size", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    REF_MICRO: ("data.train_batch_size", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
}
ROLLOUT_N = "actor_rollout_ref.rollout.n"
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
    world_size: int | None = None
    """GPUs the trainer's data-parallel ranks spread over (a verl run: a micro batch must divide each
    rank's share); None: one process (the embedded trainer: it must divide the mini batch)."""


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


def _lookup(cfg: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in a nested (or already flat) config snapshot."""
    if dotted in cfg:
        return True, cfg[dotted]
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def config_value(cfg: Mapping[str, Any], dotted: str) -> Any | None:
    """A dotted key from a nested (or already flat) config snapshot."""
    return _lookup(cfg, dotted)[1]


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
    """The largest micro-batch <= ``value`` that divides ``mini_batch`` (the trainer insists), at least 1."""
    value = max(1, int(value))
    if not mini_batch or mini_batch < 1:
        return value
    # The divisors in pairs (i, mini_batch // i) up to its square root: a share of 2**31 - 1 (a prime, from a
    # hostile run.json) takes 46,341 steps, not two billion.
    best, i = 1, 1
    while i * i <= mini_batch:
        if mini_batch % i == 0:
            for d in (i, mini_batch // i):
                if best < d <= value:
                    best = d
        i += 1
    return best


def micro_batch_share(key: str, config: Mapping[str, Any], world_size: int | None) -> int | None:
    """What a micro batch of ``key`` must divide, or None when unknown.

    One process (``world_size`` None, the embedded trainer): the mini batch. verl: each
    data-parallel rank's share, ``batch x rollout.n / (world_size / ulysses_sp)``, where the
    batch is the mini batch for the PPO updates (workers/engine_workers.py, train_mini_batch:
    ``mini_batch_size // dp``; workers/engine/utils.py, prepare_micro_batches: that share must
    be divisible by ``micro_batch_size_per_gpu``) and the whole train batch for the log-prob
    passes. A share verl itself would reject (not a whole number) is None: nothing to snap to.
    """
    batch_key, sp_key = _SHARE_OF.get(key, (MINI_BATCH_OF.get(key, ""), ""))
    batch = _number(config_value(config, batch_key)) if batch_key else None
    if world_size is None:
        return int(batch) if key in MINI_BATCH_OF and batch is not None and batch >= 1 else None
    if batch is None:
        # A zero-patch run's config is its command's overrides only: verl's interpolations and defaults.
        batch = _number(_verl_default(batch_key, config))
    if batch is None or batch < 1:
        return None
    n = _number(config_value(config, ROLLOUT_N)) or 1.0
    sp = _number(config_value(config, sp_key)) if sp_key else None
    dp, rest = divmod(int(world_size), int(sp or 1))
    total = int(batch) * int(n)
    if dp < 1 or rest or total % dp:
        return None
    return total // dp


#: Where verl's config takes a key from when it is not set (critic/critic.yaml interpolates the actor's
#: mini batch), and verl's own value at the end of that chain (actor/actor.yaml, data/legacy_data.yaml).
_VERL_FALLBACK = {"critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size"}
_VERL_BATCH_DEFAULTS = {"actor_rollout_ref.actor.ppo_mini_batch_size": 256, "data.train_batch_size": 1024}


def _verl_default(key: str, config: Mapping[str, Any]) -> Any:
    """What verl's config resolves an unset ``key`` to: its interpolation's source, else verl's default."""
    src = _VERL_FALLBACK.get(key)
    if src is not None:
        v = config_value(config, src)
        return v if v is not None else _verl_default(src, config)
    return _VERL_BATCH_DEFAULTS.get(key)


def settle_value(key: str, new: float, config: Mapping[str, Any], world_size: int | None = None) -> float | int:
    """A computed value as the trainer takes it: micro batches snapped to divide their share of the
    batch (:func:`micro_batch_share`), epochs whole and at least 1."""
    if key in _SHARE_OF:
        return snap_micro_batch(int(round(new)), micro_batch_share(key, config, world_size))
    t = TUNABLE_KEYS.get(key)
    if t is not None and t.integer:
        return max(1, int(round(new))) if key.endswith("ppo_epochs") else int(round(new))
    return float(new)


def snap_sets(sets: Mapping[str, Any], config: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
    """``sets`` with every micro batch rounded down to one its share of the batch divides."""
    return {k: (snap_micro_batch(int(v), micro_batch_share(k, config, world_size)) if k in _SHARE_OF else v)
            for k, v in sets.items()}


def clip_bound_sets(overrides: Mapping[str, Any], config: Mapping[str, Any],
                    defaults: Mapping[str, float] | None = None) -> dict[str, float]:
    """The clip bounds a relaunch must pass with an overridden ``clip_ratio`` (empty when none).

    verl's ``clip_ratio_low`` / ``clip_ratio_high`` win over ``clip_ratio`` (see
    :data:`ppo_watchdog.protocol.catalog.CLIP_RATIO_KEY`), so a relaunch that passed ``clip_ratio``
    alone would change nothing. Each bound moves by the same factor as ``clip_ratio`` moved from
    the run's config (:func:`~ppo_watchdog.protocol.catalog.moved_clip_bounds`): symmetric bounds
    land on the new value, clip-higher keeps its asymmetry. A bound the overrides set already
    stays; one the config holds as None follows ``clip_ratio`` by itself (the embedded
    trainer). ``defaults``: a bound's value where the config does not hold it (verl's 0.2 for a
    zero-patch run, whose config is only its command's overrides).
    """
    new = _number(overrides.get(catalog.CLIP_RATIO_KEY))
    if new is None:
        return {}
    defaults = defaults or {}
    base = _number(config_value(config, catalog.CLIP_RATIO_KEY))
    if base is None:
        base = defaults.get(catalog.CLIP_RATIO_KEY)
    bounds: list[float | None] = []
    for key in (catalog.CLIP_LOW_KEY, catalog.CLIP_HIGH_KEY):
        # Held as None: follows clip_ratio by itself. Not held at all: verl's default, where given.
        bounds.append(_number(config_value(config, key)) if _holds(config, key) else defaults.get(key))
    low, high = catalog.moved_clip_bounds(base, new, bounds[0], bounds[1])
    return {k: v for k, v in ((catalog.CLIP_LOW_KEY, low), (catalog.CLIP_HIGH_KEY, high))
            if v is not None and k not in overrides}


def _holds(cfg: Mapping[str, Any], dotted: str) -> bool:
    """True when the config has ``dotted`` at all (even as None)."""
    return _lookup(cfg, dotted)[0]


# -- out of memory ---------------------------------------------------------------------

#: A token budget of verl's dynamic batching is lowered by this factor per OOM.
OOM_TOKEN_FACTOR = 0.75
#: vLLM's share of a GPU is lowered by this factor per rollout OOM (0.5 -> 0.4), down to the floor.
OOM_GPU_MEMORY_FACTOR, GPU_MEMORY_FLOOR = 0.8, 0.05
GPU_MEMORY_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"
ACTOR_TOKENS = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
LOG_PROB_TOKENS = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_TOKENS = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
CRITIC_TOKENS = "critic.ppo_max_token_len_per_gpu"
CRITIC_ENGINE_TOKENS = "critic.ppo_infer_max_token_len_per_gpu"
#: verl 0.9's defaults of what an OOM remedy reads (trainer/config: ppo_trainer, actor, critic,
#: rollout, data); the interpolated ones (log-prob token budgets: the actor's) are resolved in code.
_OOM_DEFAULTS: dict[str, Any] = {
    ACTOR_TOKENS: 16384, CRITIC_TOKENS: 32768, CRITIC_ENGINE_TOKENS: 32768, GPU_MEMORY_KEY: 0.5,
    "actor_rollout_ref.actor.use_dynamic_bsz": False, "trainer.use_v1": True,
    "data.max_prompt_length": 512, "data.max_response_length": 512, "algorithm.adv_estimator": "gae",
}


def _setting(key: str, config: Mapping[str, Any], overrides: Mapping[str, Any], default: Any = None) -> Any:
    """A key's value in force: the overrides, the config, then ``default`` / verl's own default."""
    if key in overrides:
        return overrides[key]
    v = config_value(config, key)
    if v is not None:
        return v
    return default if default is not None else _OOM_DEFAULTS.get(key)


def run_has_critic(config: Mapping[str, Any]) -> bool:
    """verl's ``need_critic`` (trainer/ppo/utils.py): ``critic.enable`` if set, else ``adv_estimator == gae``."""
    enable = config_value(config, "critic.enable")
    if enable is not None:
        return bool(enable)
    return str(_setting("algorithm.adv_estimator", config, {})).lower() == "gae"


def _lower_tokens(key: str, config: Mapping[str, Any], overrides: Mapping[str, Any],
                  default: Any = None) -> dict[str, Any]:
    """A dynamic-batching token budget x :data:`OOM_TOKEN_FACTOR`, never below the longest sequence
    (verl asserts ``max_token_len >= max_seq_len``, utils/seqlen_balancing.py)."""
    cur = _number(_setting(key, config, overrides, default))
    floor = int(_number(_setting("data.max_prompt_length", config, overrides)) or 0) + \
        int(_number(_setting("data.max_response_length", config, overrides)) or 0)
    if cur is None or cur <= floor:
        return {}
    return {key: max(floor, int(cur * OOM_TOKEN_FACTOR))}


def _lower_micro(key: str, config: Mapping[str, Any], overrides: Mapping[str, Any], world_size: int | None,
                 failed_mb: int | None) -> dict[str, Any]:
    """A micro batch one smaller, snapped to divide its share of the batch; unchanged when a rule
    already lowered it below the size that failed."""
    cur = _number(_setting(key, config, overrides))
    if cur is None:
        return {}
    if failed_mb is not None and key in overrides and int(cur) < int(failed_mb):
        return {key: int(cur)}
    return {key: snap_micro_batch(int(cur) - 1, micro_batch_share(key, config, world_size))}


def oom_remedy(site: str | None, config: Mapping[str, Any], overrides: Mapping[str, Any],
               world_size: int | None = None, failed_mb: int | None = None) -> dict[str, Any]:
    """What a relaunch after an out-of-memory error sets: the knob of the pass that ran out.

    ``site`` is the pass (:data:`ppo_watchdog.protocol.oom.SITES`; None when the traceback did not
    say). For a verl run (``world_size`` known), verl 0.9.1's knobs:

    - the actor update: ``actor.ppo_micro_batch_size_per_gpu`` (snapped to divide each rank's
      share, :func:`micro_batch_share`), or with ``use_dynamic_bsz`` its ``ppo_max_token_len_per_gpu``;
    - the log-prob passes: ``rollout.`` / ``ref.log_prob_micro_batch_size_per_gpu``, or with
      dynamic batching their ``log_prob_max_token_len_per_gpu``;
    - the critic: in the v1 trainer its engine always batches by tokens with
      ``critic.ppo_infer_max_token_len_per_gpu`` (trainer/ppo/v1/trainer_base.py copies it into the
      engine's ``max_token_len_per_gpu``; ``critic.ppo_micro_batch_size_per_gpu`` is only
      validated), so that one; the legacy trainer (``trainer.use_v1=false``) its micro batch or
      ``ppo_max_token_len_per_gpu``;
    - the rollout (vLLM): ``rollout.gpu_memory_utilization`` x :data:`OOM_GPU_MEMORY_FACTOR`;
    - unknown: the actor update's knob and the critic's.

    One process (``world_size`` None, the embedded trainer): both PPO micro batches, as before.
    Pure: the config, the overrides in force and the failed micro batch in, the sets out.
    """
    if world_size is None:
        out: dict[str, Any] = {}
        for key in MICRO_BATCH_KEYS:
            out.update(_lower_micro(key, config, overrides, None, failed_mb))
        return out
    actor_dyn = bool(_setting("actor_rollout_ref.actor.use_dynamic_bsz", config, overrides))

    def dyn(key: str) -> bool:
        v = _setting(key, config, overrides)
        return actor_dyn if v is None else bool(v)

    def actor() -> dict[str, Any]:
        return _lower_tokens(ACTOR_TOKENS, config, overrides) if actor_dyn else \
            _lower_micro(ACTOR_MICRO, config, overrides, world_size, failed_mb)

    def critic() -> dict[str, Any]:
        if bool(_setting("trainer.use_v1", config, overrides)):
            return _lower_tokens(CRITIC_ENGINE_TOKENS, config, overrides)
        if dyn("critic.use_dynamic_bsz"):
            return _lower_tokens(CRITIC_TOKENS, config, overrides)
        return _lower_micro(CRITIC_MICRO, config, overrides, world_size, failed_mb)

    def log_prob(micro: str, tokens: str, dyn_key: str) -> dict[str, Any]:
        if dyn(dyn_key):
            return _lower_tokens(tokens, config, overrides, _setting(ACTOR_TOKENS, config, overrides))
        return _lower_micro(micro, config, overrides, world_size, failed_mb)

    if site == "rollout":
        cur = _number(_setting(GPU_MEMORY_KEY, config, overrides))
        if cur is None or cur <= GPU_MEMORY_FLOOR:
            return {}
        return {GPU_MEMORY_KEY: round(max(GPU_MEMORY_FLOOR, cur * OOM_GPU_MEMORY_FACTOR), 3)}
    if site == "log_prob":
        return log_prob(LOG_PROB_MICRO, LOG_PROB_TOKENS, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz")
    if site == "ref_log_prob":
        return log_prob(REF_MICRO, REF_TOKENS, "actor_rollout_ref.ref.log_prob_use_dynamic_bsz")
    if site == "actor_update":
        return actor()
    if site in ("critic_update", "critic_values"):
        return critic()
    return {**actor(), **(critic() if run_has_critic(config) else {})}


# -- decisions -------------------------------------------------------------------------

KL_CTRL_TYPE = "algorithm.kl_ctrl.type"
KL_CTRL_COEF = "algorithm.kl_ctrl.kl_coef"


def adaptive_kl(config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> bool:
    """True when verl's adaptive KL controller moves the reward penalty's coefficient itself."""
    v = (overrides or {}).get(KL_CTRL_TYPE, config_value(config, KL_CTRL_TYPE))
    return str(v).lower() == "adaptive"


def unchanged(old: float, new: float) -> bool:
    """True when a set would leave the key where it is (equal to a part in a billion: float noise)."""
    return new == old or abs(new - old) <= 1e-9 * max(abs(new), abs(old))


def plan_sets(actions: Sequence[Any], ctx: PlanContext, repeat: int = 1, rule: str = "",
              tuning: bool = False) -> tuple[dict[str, Any], dict[str, float]]:
    """The new value (and the old) of every ``set`` among ``actions`` that moves its key.

    Unknown starting values are skipped, and so is a set that would change nothing (the key at
    or past its bound already: :meth:`SetAction.apply` never moves a key the other way). With
    ``tuning`` (a decision of a rule that is not a divergence), a set of the reward penalty's
    coefficient is left out when verl's adaptive KL controller owns it: the controller steers it
    to its own ``target_kl`` every step, and a watchdog nudging it too would fight it.
    """
    sets, old, _ = _plan_sets(actions, ctx, repeat, rule, tuning)
    return sets, old


def remedy_exhausted(actions: Sequence[Any], ctx: PlanContext, repeat: int = 1, tuning: bool = False) -> bool:
    """True when ``actions`` hold sets, at least one could be valued, and none would move its key:
    the remedy has nothing left to give (every key at or past its bound)."""
    sets, _, valued = _plan_sets(actions, ctx, repeat, "", tuning, quiet=True)
    return valued > 0 and not sets


def _plan_sets(actions: Sequence[Any], ctx: PlanContext, repeat: int, rule: str, tuning: bool,
               quiet: bool = False) -> tuple[dict[str, Any], dict[str, float], int]:
    """:func:`plan_sets`, and how many sets could be valued (moving their key or not)."""
    sets: dict[str, Any] = {}
    old: dict[str, float] = {}
    valued = 0
    say = log.debug if quiet else log.warning
    for a in actions:
        if not isinstance(a, SetAction):
            continue
        key = resolve_key(a.key, ctx.signals)
        if tuning and key == KL_CTRL_COEF and adaptive_kl(ctx.config, ctx.overrides):
            (log.debug if quiet else log.info)(
                "rule %s: %s is steered by verl's adaptive KL controller; the tuning set is left out", rule, key)
            continue
        cur = current_value(key, PlanContext({**ctx.overrides, **sets}, ctx.latest, ctx.config))
        if cur is None:
            say("rule %s: no current value for %s; skipping the set", rule, key)
            continue
        new = settle_value(key, a.apply(cur, repeat), ctx.config, ctx.world_size)
        problem = value_problem(key, new)
        if problem:  # never written: a trainer would take a NaN kl_coef or a negative batch as given
            (log.debug if quiet else log.error)("rule %s: %s (from %r); the set is not made", rule, problem, cur)
            continue
        valued += 1
        if unchanged(cur, float(new)):
            continue  # at its bound already: a set that changes nothing is never sent
        old.setdefault(key, cur)
        sets[key] = new
    return sets, old, valued


def left_out_reason(decision: Decision, ctx: PlanContext) -> str:
    """Why a fired decision plans nothing, when it is the adaptive KL controller's doing (else ""): every set
    of a tuning rule is the reward penalty's coefficient, which the controller owns (:func:`plan_sets`)."""
    if decision.kind != DecisionKind.FIRE or decision.divergence or decision.urgent:
        return ""
    keys = [resolve_key(a.key, ctx.signals) for a in decision.actions if isinstance(a, SetAction)]
    if keys and all(k == KL_CTRL_COEF for k in keys) and adaptive_kl(ctx.config, ctx.overrides):
        return (f"left out: {KL_CTRL_COEF} is steered by verl's adaptive KL controller "
                f"({KL_CTRL_TYPE}=adaptive); a tuning rule does not set it")
    return ""


def plan_decision(decision: Decision, ctx: PlanContext) -> list[Planned]:
    """Journal entries for one engine decision."""
    if decision.kind == DecisionKind.RESOLVE:
        return []
    rule, severity, message = decision.rule, decision.severity, decision.message
    base = {"rule": rule, "step": decision.step}
    actions = list(decision.actions)
    tuning = not decision.divergence and not decision.urgent
    if decision.kind == DecisionKind.FIRE and remedy_exhausted(actions, ctx, decision.repeat, tuning):
        # Every set of the remedy is at its bound: sending it would change nothing, and a rollback
        # with nothing gentler after it replays the same steps. The remedy is exhausted: escalate.
        log.info("rule %s: its remedy is exhausted (every set at its bound); escalating", rule)
        actions = [PauseAction() if isinstance(a, PauseAction) and a.reason == "budget exhausted" else a
                   for a in (getattr(decision, "escalate", None) or [NotifyAction()])]
        base = {**base, "exhausted": True}
        message = f"{message} [remedy exhausted: every set at its bound]"
    if decision.kind == DecisionKind.ESCALATE and not actions:
        actions = [PauseAction()]  # the default escalation: wait for a human (a pause also alerts)
    sets, old = plan_sets(actions, ctx, decision.repeat, rule, tuning)
    out: list[Planned] = []
    for action in actions:
        if isinstance(action, CheckpointAction):
            out.append(Planned("command", {**base, "command": {"id": "", "kind": "checkpoint"}}))
        elif isinstance(action, PauseAction):
            out += _pause(base, action.reason or message, severity, ctx.on_escalate)
        elif isinstance(action, StopAction):
            out += _pause(base, action.reason or message, severity, "stop")
        elif isinstance(action, NotifyAction):
            out.append(Planned("notify", {**base, "severity": severity or "warning",
                                          "summary": f"{rule}: {action.message or message}",
                                          "description": message}))
    rollback = next((a for a in actions if isinstance(a, RollbackAction)), None)
    restart = next((a for a in actions if isinstance(a, RestartAction)), None)
    if rollback is None and restart is not None:
        # The trainer's machinery failed, not its policy: the latest checkpoint (known-good or not)
        # in a fresh process, at once; sets of the same decision go with it.
        out.insert(0, Planned("restart", {**base, "set": sets, "from": old, "resume": "latest", "urgent": True,
                                          "fresh_engine": True,
                                          "reason": f"{rule}: {restart.reason or 'restart from the latest checkpoint'}"}))
    elif rollback is not None:
        # The sets follow the rollback (a restored checkpoint brings back the old lr / kl_coef).
        out.insert(0, Planned("rollback", {**base, "skip_batches": rollback.skip_batches, "set": sets,
                                           "from": old}))
    elif sets:
        live = {k: v for k, v in sets.items() if k in ctx.live_keys}
        by_relaunch = [k for k in sets if k not in ctx.live_keys]
        if by_relaunch:
            out.insert(0, Planned("restart", {**base, "set": sets, "from": old, "resume": "latest",
                                              "urgent": bool(getattr(decision, "urgent", False)),
                                              "reason": f"{rule}: {', '.join(by_relaunch)} need a restart"}))
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
    "KL_COEF", "KL_CTRL_COEF", "MICRO_BATCH_KEYS", "MINI_BATCH_OF", "ON_ESCALATE", "PlanContext", "Planned", "clip_bound_sets",
    "config_value", "current_value", "micro_batch_share", "oom_remedy", "plan_decision", "plan_sets",
    "settle_value", "snap_micro_batch", "snap_sets", "adaptive_kl", "left_out_reason", "remedy_exhausted", "unchanged",
]
