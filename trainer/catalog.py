"""The one catalog of metric names.

Every per-step metric the product speaks of appears here once, with three names:

- ``key``: verl's own metric key, as verl's trackers log it (``actor/reward_kl_penalty``).
- ``prom``: the Prometheus metric name the trainer (or the verl glue) exposes.
- ``short``: the short name rules use in their expressions (``kl``).

The trainer, the exporter, the rules engine, the dashboards and the alert rules all
import these names, so renaming a metric breaks the build rather than a dashboard in
production. ``aliases`` lists older verl keys that mean the same thing (verl renamed
``critic/kl`` to ``actor/reward_kl_penalty``); readers map them onto the current key.

This module imports nothing heavy: the watchdog imports it without torch.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: Label every exported per-run series carries.
RUN_LABEL = "run"


@dataclass(frozen=True)
class Metric:
    """One per-step training metric under its three names."""

    key: str
    """verl's metric key, as written to ``metrics.jsonl`` and verl's console log."""
    prom: str
    """Prometheus metric name (a gauge labelled with ``run``)."""
    short: str
    """Short name for rule expressions."""
    help: str
    """One sentence for Prometheus HELP text and ``watchdog rules explain``."""
    unit: str = ""
    """Unit, for dashboards (Grafana unit id, e.g. ``s`` or ``short``)."""
    aliases: tuple[str, ...] = field(default_factory=tuple)
    """Older verl keys with the same meaning."""


METRICS: tuple[Metric, ...] = (
    Metric(
        "actor/reward_kl_penalty", "ppo_kl_mean", "kl",
        "Mean per-token KL of the policy to the reference policy (the penalty in the reward).",
        aliases=("critic/kl",),
    ),
    Metric(
        "actor/reward_kl_penalty_std", "ppo_kl_std", "kl_std",
        "Standard deviation of the step KL mean over the last 10 steps (step-to-step movement; the "
        "rules compute the same as std(kl, 10), so verl runs, which log no KL std, are judged alike).",
    ),
    Metric(
        "actor/reward_kl_penalty_coeff", "ppo_kl_coef", "kl_coef",
        "Current KL coefficient of the reward penalty (algorithm.kl_ctrl).",
        aliases=("critic/kl_coeff",),
    ),
    Metric("actor/kl_loss", "ppo_kl_loss", "kl_loss", "KL loss term (use_kl_loss)."),
    Metric("actor/kl_coef", "ppo_kl_loss_coef", "kl_loss_coef", "Coefficient of the KL loss term."),
    Metric("actor/ppo_kl", "ppo_policy_kl", "ppo_kl", "Approximate KL between the old and the updated policy."),
    Metric("actor/pg_loss", "ppo_policy_loss", "pg_loss", "Clipped PPO policy-gradient loss."),
    Metric("actor/pg_clipfrac", "ppo_policy_clipfrac", "pg_clipfrac", "Fraction of tokens whose ratio was clipped."),
    Metric(
        "actor/entropy", "ppo_entropy", "entropy",
        "Mean per-token entropy of the policy.", aliases=("actor/entropy_loss",),
    ),
    Metric("actor/grad_norm", "ppo_actor_grad_norm", "grad_norm", "Actor gradient norm before clipping."),
    Metric("actor/lr", "ppo_actor_lr", "lr", "Actor learning rate."),
    Metric("critic/vf_loss", "ppo_value_loss", "vf_loss", "Clipped value-function loss."),
    Metric("critic/vf_clipfrac", "ppo_value_clipfrac", "vf_clipfrac", "Fraction of values that were clipped."),
    Metric("critic/grad_norm", "ppo_critic_grad_norm", "critic_grad_norm", "Critic gradient norm before clipping."),
    Metric("critic/lr", "ppo_critic_lr", "critic_lr", "Critic learning rate."),
    Metric("critic/score/mean", "ppo_score_mean", "reward", "Mean task score (reward-function output) per sequence."),
    Metric("critic/rewards/mean", "ppo_reward_mean", "rewards", "Mean sequence reward after the KL penalty."),
    Metric("critic/score/max", "ppo_score_max", "reward_max", "Highest task score in the batch."),
    Metric("critic/score/min", "ppo_score_min", "reward_min", "Lowest task score in the batch."),
    Metric("critic/advantages/mean", "ppo_advantage_mean", "advantages", "Mean advantage (GAE)."),
    Metric("critic/returns/mean", "ppo_return_mean", "returns", "Mean return (GAE target of the critic)."),
    Metric("critic/values/mean", "ppo_value_mean", "values", "Mean value estimate of the critic."),
    Metric(
        "response_length/mean", "ppo_response_length_tokens", "response_length",
        "Mean response length in tokens.", unit="short",
    ),
    Metric(
        "response_length/max", "ppo_response_length_max_tokens", "response_length_max",
        "Longest response in the batch, in tokens.", unit="short",
    ),
    Metric(
        "response_length/clip_ratio", "ppo_response_clip_ratio", "response_clip_ratio",
        "Fraction of responses cut at max_response_length.",
    ),
    Metric(
        "perf/throughput", "ppo_throughput_tokens_per_second", "throughput",
        "Tokens processed per second per device.", unit="short",
    ),
    Metric("perf/time_per_step", "ppo_step_duration_seconds", "step_time", "Wall time of the last step.", unit="s"),
    Metric("training/global_step", "ppo_global_step", "step", "Global training step."),
    Metric("training/epoch", "ppo_epoch", "epoch", "Training epoch."),
    Metric(
        "val-core/reward/mean@1", "ppo_val_score", "val_score",
        "Validation score (accuracy for rule-scored tasks), measured every trainer.test_freq steps.",
    ),
)

BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}
BY_SHORT: dict[str, Metric] = {m.short: m for m in METRICS}
BY_PROM: dict[str, Metric] = {m.prom: m for m in METRICS}
_ALIASES: dict[str, str] = {a: m.key for m in METRICS for a in m.aliases}

# verl writes validation metrics per data source: ``val-core/<data_source>/reward/mean@1``
# (newer) or ``val/test_score/<data_source>`` (older). Both land on ``val_score``.
_VAL_PATTERNS = (
    re.compile(r"^val-core/.+/(reward|acc)/mean@\d+$"),
    re.compile(r"^val/test_score/.+$"),
)


@functools.lru_cache(maxsize=4096)
def canonical_key(key: str) -> str | None:
    """The catalog key for a verl key (current, aliased or per-data-source), else None."""
    if key in BY_KEY:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    if any(p.match(key) for p in _VAL_PATTERNS):
        return "val-core/reward/mean@1"
    return None


def lookup(name: str) -> Metric | None:
    """Find a metric by short name, verl key (or alias) or Prometheus name."""
    if name in BY_SHORT:
        return BY_SHORT[name]
    if name in BY_PROM:
        return BY_PROM[name]
    key = canonical_key(name)
    return BY_KEY[key] if key else None


def to_short(data: Mapping[str, object]) -> dict[str, float]:
    """Map one step's verl-keyed record onto short names, dropping unknown and non-numeric keys.

    Where a record carries both a current key and its alias, the current key wins.
    """
    out: dict[str, float] = {}
    exact: set[str] = set()
    for raw, value in data.items():
        key = canonical_key(raw)
        if key is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        short = BY_KEY[key].short
        if short in exact and raw != key:
            continue
        out[short] = float(value)
        if raw == key:
            exact.add(short)
    return out


def names(kind: str = "short") -> Iterable[str]:
    """All names of one kind: ``short``, ``key`` or ``prom``."""
    return (getattr(m, kind) for m in METRICS)


def is_finite(value: float) -> bool:
    """True for a real, finite number."""
    return not (math.isnan(value) or math.isinf(value))
