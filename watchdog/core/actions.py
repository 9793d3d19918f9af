"""What a rule can ask for: set a config key, roll back, restart, checkpoint, pause, stop, notify.

Actions are plain data. The rules engine only decides; the controller (``watchdog``'s
actuator) carries them out: a live ``set`` through control.json, a restart-only ``set``
by relaunching with the override, a rollback to the last known-good checkpoint.

Only known tunable keys may be set (:data:`TUNABLE_KEYS`): a typo in a rule file must
fail the rule check, not silently write an override the trainer ignores. One key is not
verl's: ``kl_coef`` is the coefficient of the KL term the run actually has (the reward
penalty's ``algorithm.kl_ctrl.kl_coef``, or the KL loss's ``actor_rollout_ref.actor.kl_loss_coef``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ppo_watchdog.protocol import catalog
from ppo_watchdog.protocol.inputs import short_repr


@dataclass(frozen=True)
class TunableKey:
    """A config key (verl's Hydra name) a rule may change."""

    key: str
    """verl's Hydra key."""
    live: bool
    """True when the embedded trainer applies it at a step boundary; False: restart with an override."""
    integer: bool = False
    """Values are whole numbers (results of scale/add are rounded)."""
    metric: str | None = None
    """Catalog short name whose value is the key's current value, when one is logged."""
    metric_first: bool = False
    """The logged metric is the truth, over the config and the overrides (an adaptive KL controller
    or a fault moves the KL coefficient away from what was configured)."""
    verl_default: float | None = None
    """verl's own default (verl/trainer/config), what a run uses when its command does not set the key."""


_INTEGER_KEYS = {
    "actor_rollout_ref.actor.ppo_epochs",
    "critic.ppo_epochs",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
}
_METRIC_OF = {
    "algorithm.kl_ctrl.kl_coef": "kl_coef",
    "actor_rollout_ref.actor.optim.lr": "lr",
    "critic.optim.lr": "critic_lr",
    "actor_rollout_ref.actor.kl_loss_coef": "kl_loss_coef",
}
_METRIC_FIRST = {"algorithm.kl_ctrl.kl_coef"}
#: verl 0.9's defaults (actor/actor.yaml, critic/critic.yaml, ppo_trainer.yaml).
_VERL_DEFAULTS = {
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "critic.optim.lr": 1e-5,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "critic.ppo_epochs": 1,
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
}
KL_COEF = "kl_coef"
"""Not a verl key: the coefficient of whichever KL term the run logs (:func:`resolve_key`)."""
KL_LOSS_METRIC = "actor/kl_loss"


def resolve_key(key: str, signals: Mapping[str, str]) -> str:
    """The verl key a rule's key means for this run: ``kl_coef`` is ``algorithm.kl_ctrl.kl_coef``
    (KL in the reward) unless the run's KL signal is verl's KL loss (``use_kl_loss``), whose
    coefficient is ``actor_rollout_ref.actor.kl_loss_coef``; every other key is itself."""
    if key != KL_COEF:
        return key
    if signals.get("kl") == KL_LOSS_METRIC:
        return "actor_rollout_ref.actor.kl_loss_coef"
    return "algorithm.kl_ctrl.kl_coef"
#: Keys no trainer changes mid-run (they shape batches, buffers or the rollout engine's
#: memory): the controller applies them by restart with a Hydra override + resume.
RESTART_KEYS: tuple[TunableKey, ...] = (
    TunableKey("data.train_batch_size", live=False, integer=True),
    TunableKey("actor_rollout_ref.actor.ppo_mini_batch_size", live=False, integer=True),
    TunableKey("critic.ppo_mini_batch_size", live=False, integer=True),
    TunableKey("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", live=False, integer=True),
    TunableKey("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", live=False, integer=True),
    TunableKey("actor_rollout_ref.rollout.gpu_memory_utilization", live=False, verl_default=0.5),
    # Token budgets of verl's dynamic batch sizes (use_dynamic_bsz), and the critic engine's in the
    # v1 trainer (trainer_base.py sets its max_token_len_per_gpu from ppo_infer_max_token_len_per_gpu).
    TunableKey("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", live=False, integer=True, verl_default=16384),
    TunableKey("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", live=False, integer=True),
    TunableKey("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", live=False, integer=True),
    TunableKey("critic.ppo_max_token_len_per_gpu", live=False, integer=True, verl_default=32768),
    TunableKey("critic.ppo_infer_max_token_len_per_gpu", live=False, integer=True, verl_default=32768),
    # verl 0.9 clips gradients with the optimizer's clip_grad (workers/engine/fsdp/transformer_impl.py,
    # optimizer_step); actor.grad_clip and critic.grad_clip are accepted and never read.
    TunableKey("actor_rollout_ref.actor.optim.clip_grad", live=False, verl_default=1.0),
    TunableKey("critic.optim.clip_grad", live=False, verl_default=1.0),
    TunableKey("critic.cliprange_value", live=False),
    TunableKey("algorithm.gamma", live=False),
    TunableKey("algorithm.lam", live=False),
)
TUNABLE_KEYS: dict[str, TunableKey] = {
    **{
        k: TunableKey(k, live=True, integer=k in _INTEGER_KEYS, metric=_METRIC_OF.get(k),
                      metric_first=k in _METRIC_FIRST, verl_default=_VERL_DEFAULTS.get(k))
        for k in catalog.LIVE_KEYS
    },
    **{t.key: t for t in RESTART_KEYS},
    KL_COEF: TunableKey(KL_COEF, live=True, metric="kl_coef", metric_first=True, verl_default=0.001),
}

SET_OPS = ("scale", "add", "to")

#: Keys whose values are fractions in (0, 1]: clip ranges, discount and GAE factors, a GPU's memory share.
_UNIT_SUFFIXES = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "cliprange_value", "gamma", "lam",
                  "gpu_memory_utilization")

#: The largest learning rate set: an Adam step moves each weight by about lr, and a pretrained model's weights
#: are a few hundredths; at 1 every step replaces them, which no fine-tuning remedy means.
MAX_LR = 1.0
#: The largest KL coefficient set: at 100, a KL of 0.01 nats costs a whole reward of 1, so the policy can no
#: longer move for any reward; past it a coefficient is a typo or a runaway, not a remedy.
MAX_KL_COEF = 100.0
#: The largest entropy coefficient set: at 1 the entropy bonus weighs as much as the policy loss itself.
MAX_ENTROPY_COEF = 1.0
#: The largest whole number set (batch sizes, token budgets, epochs): what a signed 32-bit count holds;
#: no batch, budget or epoch count is near it.
MAX_COUNT = 2**31 - 1
_CEILINGS = {"lr": MAX_LR, "kl_coef": MAX_KL_COEF, "kl_loss_coef": MAX_KL_COEF, "entropy_coeff": MAX_ENTROPY_COEF}


def value_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``key``'s value (None when it can): every value a rule, the controller or
    a trainer sets is finite, whole for whole-number keys, from 1 to :data:`MAX_COUNT` for batch sizes and
    epochs, in (0, :data:`MAX_LR`] for learning rates, in (0, 1] for clip ranges and fractions, never negative,
    and at most :data:`MAX_KL_COEF` for KL coefficients and :data:`MAX_ENTROPY_COEF` for the entropy's."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key} must be a number, got {short_repr(value, 40)}"
    if not math.isfinite(value):
        return f"{key} must be a finite number, got {value!r}"
    t = TUNABLE_KEYS.get(key)
    if t is not None and t.integer:
        if float(value) != int(value) or not 1 <= value <= MAX_COUNT:
            return f"{key} must be a whole number from 1 to {MAX_COUNT:,}, got {value!r}"
        return None
    leaf = key.rsplit(".", 1)[-1]
    if leaf in _UNIT_SUFFIXES:
        return None if 0 < value <= 1 else f"{key} must be in (0, 1], got {value!r}"
    if leaf == "lr":
        return None if 0 < value <= MAX_LR else f"{key} must be in (0, {MAX_LR:g}], got {value!r}"
    if value < 0:
        return f"{key} must be >= 0, got {value!r}"
    ceiling = _CEILINGS.get(leaf)
    return None if ceiling is None or value <= ceiling else f"{key} must be at most {ceiling:g}, got {value!r}"


@dataclass(frozen=True)
class SetAction:
    """Change a config key: scale, add to or set it, then clamp to [min, max]."""

    key: str
    """Tunable key (see TUNABLE_KEYS)."""
    op: str
    """scale | add | to."""
    value: float
    """Factor, increment or new value."""
    min: float | None = None
    """Lower bound of the result."""
    max: float | None = None
    """Upper bound of the result (the cap that keeps repeated raising safe)."""
    grow: bool = False
    """Compound the scale with each repeat of the same cause: the n-th fire within the rule's
    budget scales by ``value ** n`` (x0.5, then x0.25, then x0.125): a remedy that was too weak
    once is made stronger, not repeated."""

    kind = "set"

    def __post_init__(self) -> None:
        if self.op not in SET_OPS:
            raise ValueError(f"set {self.key}: op must be one of {SET_OPS}, got {self.op!r}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"set {self.key}: min {self.min} > max {self.max}")

    @property
    def live(self) -> bool:
        """True when the trainer applies the key at a step boundary."""
        t = TUNABLE_KEYS.get(self.key)
        return bool(t and t.live)

    def factor(self, repeat: int = 1) -> float:
        """The scale of the ``repeat``-th fire (1-based): ``value``, or ``value ** repeat`` when growing."""
        if not self.grow:
            return self.value
        try:
            return math.pow(self.value, max(1, repeat))
        except OverflowError:  # (x10 compounded over hundreds of fires): infinite, which no value may be
            return math.inf

    def apply(self, current: float, repeat: int = 1) -> float:
        """The new value from the current one (clamped; whole numbers for integer keys)."""
        if self.op == "scale":
            new = current * self.factor(repeat)
        elif self.op == "add":
            new = current + self.value
        else:
            new = self.value
        if self.min is not None:
            new = max(new, self.min)
        if self.max is not None:
            new = min(new, self.max)
        t = TUNABLE_KEYS.get(self.key)
        integer = t is not None and t.integer and math.isfinite(new)
        if integer:
            new = float(round(new))
            # Rounding must not step back over a bound (e.g. min 1 with 0.6 -> 1, not 1 -> 0).
            if self.min is not None and new < self.min:
                new = float(math.ceil(self.min))
            if self.max is not None and new > self.max:
                new = float(math.floor(self.max))
        if self.op in ("scale", "add") and math.isfinite(current) and (new - current) * self._direction() < 0:
            # The bounds limit how far a rule moves a key; they never move it the other way: a
            # run that starts above a raise's max (kl_coef 0.1 against max 0.02) stays where it is.
            new = current
        return int(new) if integer else new

    def _direction(self) -> float:
        """+1 when the op raises the value, -1 when it lowers it, 0 when it keeps it."""
        step = self.value - 1.0 if self.op == "scale" else self.value
        return float((step > 0) - (step < 0))

    def describe(self) -> str:
        """One line: ``set algorithm.kl_ctrl.kl_coef x1.2 (max 0.02)``."""
        sym = {"scale": "x", "add": "+" if self.value >= 0 else "", "to": "= "}[self.op]
        bounds = [f"min {_fmt(self.min)}"] if self.min is not None else []
        bounds += [f"max {_fmt(self.max)}"] if self.max is not None else []
        bounds += ["growing"] if self.grow else []
        tail = f" ({', '.join(bounds)})" if bounds else ""
        return f"set {self.key} {sym}{_fmt(self.value)}{tail}"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": "set", "key": self.key, "op": self.op, "value": self.value}
        if self.min is not None:
            d["min"] = self.min
        if self.max is not None:
            d["max"] = self.max
        if self.grow:
            d["grow"] = True
        return d


@dataclass(frozen=True)
class RollbackAction:
    """Restore the last known-good checkpoint; optionally skip the batches that led to the spike."""

    skip_batches: int = 0
    """Data batches to skip after the restored step (the ones that preceded the divergence)."""

    kind = "rollback"

    def __post_init__(self) -> None:
        if self.skip_batches < 0:
            raise ValueError(f"rollback: skip_batches must be >= 0, got {self.skip_batches}")

    def describe(self) -> str:
        return "rollback to last known-good" + (f", skip {self.skip_batches} batches" if self.skip_batches else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": "rollback", "skip_batches": self.skip_batches}


@dataclass(frozen=True)
class RestartAction:
    """Stop the trainer and start it again from its latest checkpoint, weights as they are.

    Not a rollback: the policy is not suspected, the machinery around it is (a crashed or hung
    rollout engine, a tool or environment server that errors). A fresh process brings up a fresh
    rollout engine; the latest checkpoint, known-good or not, keeps what the run learned.
    """

    reason: str = ""
    """Why, for the journal and the alert."""

    kind = "restart"

    def describe(self) -> str:
        return "restart from the latest checkpoint" + (f": {self.reason}" if self.reason else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": "restart", "reason": self.reason}


@dataclass(frozen=True)
class CheckpointAction:
    """Ask the trainer to save a checkpoint now."""

    kind = "checkpoint"

    def describe(self) -> str:
        return "checkpoint"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "checkpoint"}


@dataclass(frozen=True)
class PauseAction:
    """Pause the trainer until a human resumes it."""

    reason: str = ""
    """Why, for the alert and the audit log."""

    kind = "pause"

    def describe(self) -> str:
        return "pause" + (f": {self.reason}" if self.reason else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": "pause", "reason": self.reason}


@dataclass(frozen=True)
class StopAction:
    """End the run with a verdict that names the cause (nothing left to try that could help)."""

    reason: str = ""
    """The verdict: what was wrong, for the journal, the alert and ``watchdog status``."""

    kind = "stop"

    def describe(self) -> str:
        return "stop" + (f": {self.reason}" if self.reason else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": "stop", "reason": self.reason}


@dataclass(frozen=True)
class NotifyAction:
    """Alert a human (webhook and log)."""

    message: str = ""
    """Alert text (the rule's description when empty)."""

    kind = "notify"

    def describe(self) -> str:
        return "notify" + (f": {self.message}" if self.message else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": "notify", "message": self.message}


Action = SetAction | RollbackAction | RestartAction | CheckpointAction | PauseAction | StopAction | NotifyAction

ACTION_KINDS = ("set", "rollback", "restart", "checkpoint", "pause", "stop", "notify")


def action_from_json(d: dict[str, Any]) -> Action:
    """Inverse of ``to_json`` (for persisted decisions); ValueError on an unknown kind."""
    kind = d.get("kind")
    if kind == "set":
        return SetAction(d["key"], d["op"], float(d["value"]), d.get("min"), d.get("max"), bool(d.get("grow", False)))
    if kind == "rollback":
        return RollbackAction(int(d.get("skip_batches", 0)))
    if kind == "restart":
        return RestartAction(str(d.get("reason", "")))
    if kind == "stop":
        return StopAction(str(d.get("reason", "")))
    if kind == "checkpoint":
        return CheckpointAction()
    if kind == "pause":
        return PauseAction(str(d.get("reason", "")))
    if kind == "notify":
        return NotifyAction(str(d.get("message", "")))
    raise ValueError(f"unknown action kind {kind!r} in {d!r}")


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"
