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

#: Config keys (verl's Hydra names) the embedded trainer can change at a step boundary.
LIVE_KEYS = (
    "algorithm.kl_ctrl.kl_coef",
    "actor_rollout_ref.actor.optim.lr",
    "critic.optim.lr",
    "actor_rollout_ref.actor.ppo_epochs",
    "critic.ppo_epochs",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
)

#: verl's resume keys (the embedded trainer's too): a relaunch from a checkpoint sets both.
RESUME_MODE_KEY = "trainer.resume_mode"
RESUME_PATH_KEY = "trainer.resume_from_path"

#: Keys verl reads that its Hydra config does not declare (a plain ``key=value`` is refused as "not in
#: struct"): written ``++key=value``. ``critic.ppo_infer_max_token_len_per_gpu`` is a CriticConfig field
#: (workers/config/critic.py) absent from critic.yaml, and what bounds the v1 critic engine's memory.
FORCE_ADD_KEYS = frozenset({"critic.ppo_infer_max_token_len_per_gpu"})

#: verl's PPO clip: ``clip_ratio`` and the two bounds that win over it. verl 0.9 defaults all three
#: to 0.2 (trainer/config/actor/actor.yaml) and its policy loss reads ``clip_ratio_low`` /
#: ``clip_ratio_high`` first (trainer/ppo/core_algos.py, compute_policy_loss_vanilla): a change of
#: ``clip_ratio`` alone changes nothing, so every writer of it moves the bounds too
#: (:func:`moved_clip_bounds`).
CLIP_RATIO_KEY = "actor_rollout_ref.actor.clip_ratio"
CLIP_LOW_KEY = "actor_rollout_ref.actor.clip_ratio_low"
CLIP_HIGH_KEY = "actor_rollout_ref.actor.clip_ratio_high"
VERL_CLIP_DEFAULT = 0.2


def moved_clip_bounds(old: float | None, new: float, low: float | None,
                      high: float | None) -> tuple[float | None, float | None]:
    """The clip bounds once ``clip_ratio`` moves from ``old`` to ``new``: each scaled by new / old.

    Symmetric bounds equal to ``clip_ratio`` (verl's default) land on ``new``; an asymmetric
    clip-higher setting (DAPO's 0.2 / 0.28) keeps its ratio instead of being flattened. A bound
    of None follows ``clip_ratio`` by itself and stays None; with no usable ``old`` the bounds
    become ``new``.
    """
    if old is None or not old > 0 or not math.isfinite(old):
        return (None if low is None else float(new), None if high is None else float(new))
    scale = float(new) / float(old)
    return (None if low is None else float(low) * scale, None if high is None else float(high) * scale)


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
    fallbacks: tuple[str, ...] = field(default_factory=tuple)
    """Keys of other catalog metrics that stand in when neither the key nor an alias is logged:
    verl logs the KL to the reference as ``actor/kl_loss`` when the KL is a loss term
    (``use_kl_loss``) instead of a reward penalty (``use_kl_in_reward``)."""
    needs: str = ""
    """The verl setting that makes verl log this metric, for the warning about rules that cannot fire."""


#: The derived count of sequences a step trained on (see :func:`derive`).
SEQUENCES_KEY = "derived/num_sequences"
_SEQUENCE_PARTS = ("perf/total_num_tokens", "prompt_length/mean", "response_length/mean")

_KL_NEEDS = ("algorithm.use_kl_in_reward=True (KL in the reward: actor/reward_kl_penalty) or "
             "actor_rollout_ref.actor.use_kl_loss=True (KL loss: actor/kl_loss)")
_CRITIC_NEEDS = "a critic (algorithm.adv_estimator=gae); GRPO-style runs have none"

METRICS: tuple[Metric, ...] = (
    Metric(
        "actor/reward_kl_penalty", "ppo_kl_mean", "kl",
        "Mean per-token KL of the policy to the reference policy: the reward penalty (use_kl_in_reward), "
        "else the KL loss term (use_kl_loss).",
        aliases=("critic/kl",), fallbacks=("actor/kl_loss",), needs=_KL_NEEDS,
    ),
    Metric(
        "actor/reward_kl_penalty_std", "ppo_kl_std", "kl_std",
        "Standard deviation of the step KL mean over the last 10 steps (step-to-step movement; the "
        "rules compute the same as std(kl, 10), so verl runs, which log no KL std, are judged alike).",
    ),
    Metric(
        "actor/reward_kl_penalty_coeff", "ppo_kl_coef", "kl_coef",
        "Current KL coefficient: of the reward penalty (algorithm.kl_ctrl), else of the KL loss term.",
        aliases=("critic/kl_coeff",), fallbacks=("actor/kl_coef",), needs=_KL_NEEDS,
    ),
    Metric("actor/kl_loss", "ppo_kl_loss", "kl_loss", "KL loss term (use_kl_loss).",
           needs="actor_rollout_ref.actor.use_kl_loss=True"),
    Metric("actor/kl_coef", "ppo_kl_loss_coef", "kl_loss_coef", "Coefficient of the KL loss term.",
           needs="actor_rollout_ref.actor.use_kl_loss=True"),
    Metric("actor/ppo_kl", "ppo_policy_kl", "ppo_kl", "Approximate KL between the old and the updated policy."),
    Metric("actor/pg_loss", "ppo_policy_loss", "pg_loss", "Clipped PPO policy-gradient loss."),
    Metric("actor/pg_clipfrac", "ppo_policy_clipfrac", "pg_clipfrac", "Fraction of tokens whose ratio was clipped."),
    Metric(
        "actor/entropy", "ppo_entropy", "entropy",
        "Mean per-token entropy of the policy.", aliases=("actor/entropy_loss",),
    ),
    Metric("actor/grad_norm", "ppo_actor_grad_norm", "grad_norm", "Actor gradient norm before clipping."),
    Metric("actor/lr", "ppo_actor_lr", "lr", "Actor learning rate."),
    Metric("critic/vf_loss", "ppo_value_loss", "vf_loss", "Clipped value-function loss.", needs=_CRITIC_NEEDS),
    Metric("critic/vf_clipfrac", "ppo_value_clipfrac", "vf_clipfrac", "Fraction of values that were clipped.", needs=_CRITIC_NEEDS),
    Metric("critic/grad_norm", "ppo_critic_grad_norm", "critic_grad_norm", "Critic gradient norm before clipping.", needs=_CRITIC_NEEDS),
    Metric("critic/lr", "ppo_critic_lr", "critic_lr", "Critic learning rate.", needs=_CRITIC_NEEDS),
    Metric("critic/score/mean", "ppo_score_mean", "reward", "Mean task score (reward-function output) per sequence."),
    Metric("critic/rewards/mean", "ppo_reward_mean", "rewards", "Mean sequence reward after the KL penalty."),
    Metric("critic/score/max", "ppo_score_max", "reward_max", "Highest task score in the batch."),
    Metric("critic/score/min", "ppo_score_min", "reward_min", "Lowest task score in the batch."),
    Metric("critic/advantages/mean", "ppo_advantage_mean", "advantages", "Mean advantage (GAE)."),
    Metric("critic/returns/mean", "ppo_return_mean", "returns", "Mean return (GAE target of the critic)."),
    Metric("critic/values/mean", "ppo_value_mean", "values", "Mean value estimate of the critic.", needs=_CRITIC_NEEDS),
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
        "response_length/min", "ppo_response_length_min_tokens", "response_length_min",
        "Shortest response in the batch, in tokens (0: an empty or aborted response).", unit="short",
    ),
    # verl 0.9 separates rollouts its engine aborted (response length 0: an engine, tool or
    # environment failure, a timeout) from the rest (trainer/ppo/metric_utils.py).
    Metric(
        "response/aborted_ratio", "ppo_response_aborted_ratio", "aborted_ratio",
        "Fraction of responses the rollout aborted (empty: the engine, a tool or the environment failed).",
        needs="verl 0.9 or newer (response/aborted_ratio)",
    ),
    Metric(
        "response_length_non_aborted/mean", "ppo_response_length_non_aborted_tokens", "response_length_ok",
        "Mean length of the responses that were not aborted, in tokens.", unit="short",
    ),
    Metric(
        "response_length_non_aborted/max", "ppo_response_length_non_aborted_max_tokens", "response_length_ok_max",
        "Longest response that was not aborted, in tokens.", unit="short",
    ),
    Metric(
        "response_length_non_aborted/min", "ppo_response_length_non_aborted_min_tokens", "response_length_ok_min",
        "Shortest response that was not aborted, in tokens.", unit="short",
    ),
    Metric(
        "response_length_non_aborted/clip_ratio", "ppo_response_non_aborted_clip_ratio", "response_clip_ratio_ok",
        "Fraction of the responses that were not aborted cut at max_response_length.",
    ),
    # verl logs no count of the batch's sequences; normalize_data (ppo_watchdog.sources.ingest) derives it.
    Metric(
        SEQUENCES_KEY, "ppo_batch_sequences", "sequences",
        "Sequences trained on in the step, derived: perf/total_num_tokens / (prompt_length/mean + "
        "response_length/mean) (the total counts each sequence's prompt and response tokens).",
        needs="verl's perf/total_num_tokens, prompt_length/mean and response_length/mean",
    ),
    Metric("timing_s/gen", "ppo_rollout_seconds", "gen_time", "Wall time of the step's rollout (generation).",
           unit="s", aliases=("timing/gen",)),
    Metric(
        "perf/throughput", "ppo_throughput_tokens_per_second", "throughput",
        "Tokens processed per second per device.", unit="short",
    ),
    Metric("perf/time_per_step", "ppo_step_duration_seconds", "step_time", "Wall time of the last step.", unit="s",
           aliases=("timing_s/step",)),
    Metric(
        "training/rollout_probs_diff_mean", "ppo_rollout_probs_diff_mean", "rollout_probs_diff",
        "Mean absolute difference of token probabilities between the rollout engine and the trainer "
        "(training-inference mismatch; verl's FAQ calls above 0.01 bad).",
        needs="a verl that logs rollout/training probability differences (calculate_log_probs)",
    ),
    Metric(
        "training/rollout_probs_diff_max", "ppo_rollout_probs_diff_max", "rollout_probs_diff_max",
        "Largest absolute difference of a token's probability between the rollout engine and the trainer.",
        needs="a verl that logs rollout/training probability differences (calculate_log_probs)",
    ),
    Metric(
        "training/rollout_probs_diff_std", "ppo_rollout_probs_diff_std", "rollout_probs_diff_std",
        "Standard deviation of the per-token rollout vs trainer probability difference.",
        needs="a verl that logs rollout/training probability differences (calculate_log_probs)",
    ),
    # verl 0.9's rollout correction (algorithm.rollout_correction, trainer/ppo/rollout_corr_helper.py):
    # how far the rollout policy is from the trainer's, measured on the batch.
    Metric(
        "rollout_corr/kl", "ppo_rollout_corr_kl", "rollout_corr_kl",
        "KL between the rollout engine's and the trainer's token distributions (verl's rollout correction).",
        needs="algorithm.rollout_correction (verl 0.9)",
    ),
    Metric(
        "rollout_corr/log_ppl_abs_diff", "ppo_rollout_corr_log_ppl_abs_diff", "rollout_corr_log_ppl_diff",
        "Absolute difference of the log perplexities under the rollout engine and the trainer.",
        needs="algorithm.rollout_correction (verl 0.9)",
    ),
    Metric(
        "rollout_corr/chi2_token", "ppo_rollout_corr_chi2_token", "rollout_corr_chi2",
        "Chi-squared divergence per token between rollout and trainer (importance-weight variance).",
        needs="algorithm.rollout_correction (verl 0.9)",
    ),
    Metric("training/global_step", "ppo_global_step", "step", "Global training step."),
    Metric("training/epoch", "ppo_epoch", "epoch", "Training epoch."),
    Metric(
        "val-core/reward/mean@1", "ppo_val_score", "val_score",
        "Validation score (accuracy for rule-scored tasks), measured every trainer.test_freq steps.",
        needs="trainer.test_freq > 0 and data.val_files",
    ),
)

#: Keys only a real verl (0.9) run logs: the embedded trainer's rollouts never abort, it times no
#: separate generation phase and runs no rollout correction, so it writes none of these.
VERL_ONLY_KEYS = frozenset({
    "response/aborted_ratio", "response_length_non_aborted/mean", "response_length_non_aborted/max",
    "response_length_non_aborted/min", "response_length_non_aborted/clip_ratio", "response_length/min",
    "timing_s/gen", "training/rollout_probs_diff_max", "training/rollout_probs_diff_std", "rollout_corr/kl",
    "rollout_corr/log_ppl_abs_diff", "rollout_corr/chi2_token", SEQUENCES_KEY,
})


def derive(data: dict[str, float]) -> None:
    """Add the values the catalog derives from a step's keys (in place): the batch's sequence count, from
    verl's token total and its mean prompt and response lengths, where the step logs all three."""
    tokens, prompt, response = (data.get(k) for k in _SEQUENCE_PARTS)
    if tokens is not None and prompt is not None and response is not None and prompt + response > 0:
        data.setdefault(SEQUENCES_KEY, tokens / (prompt + response))


BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}
BY_SHORT: dict[str, Metric] = {m.short: m for m in METRICS}
BY_PROM: dict[str, Metric] = {m.prom: m for m in METRICS}
_ALIASES: dict[str, str] = {a: m.key for m in METRICS for a in m.aliases}

# -- verl's own Prometheus monitoring (RL-Insight) ----------------------------------------------
#
# With ``trainer.logger=[...,rl_insight]`` and VERL_RL_INSIGHT_ENABLE=1, verl's RLInsightLogger
# (verl/utils/tracking.py, RLInsightLogger.log) sends every logged metric as a gauge named
# ``key.replace("/", "_")``; the RL-Insight hub exports it with the ``rl_insight_monitor_``
# prefix and the labels ``project`` and ``experiment_name`` (verl's trainer.project_name and
# trainer.experiment_name), e.g. ``rl_insight_monitor_actor_pg_clipfrac`` and the step ruler
# ``rl_insight_monitor_training_global_step`` (rl-insight docs/monitor/metric-name-catalog.md).
# The same numbers as the catalog's gauges, so the Prometheus source reads them as they are
# (``watchdog run --source rl_insight``). What has no RL-Insight series: a metric verl does
# not log (``actor/reward_kl_penalty_std``, computed by the rules), and ``val-core/...@1``,
# whose name ("-", "@") is not a Prometheus name as verl sends it.

RL_INSIGHT_PREFIX = "rl_insight_monitor_"
#: The RL-Insight label that tells runs apart (verl's ``trainer.experiment_name``).
RL_INSIGHT_RUN_LABEL = "experiment_name"
_PROM_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def rl_insight_name(key: str) -> str | None:
    """The RL-Insight series of a verl key, or None where the name RLInsightLogger makes is no
    Prometheus name."""
    name = RL_INSIGHT_PREFIX + key.replace("/", "_")
    return name if _PROM_NAME.match(name) else None


#: RL-Insight series name -> catalog metric (its key and, for older verl, its aliases).
BY_RL_INSIGHT: dict[str, Metric] = {
    n: m for m in METRICS for n in (rl_insight_name(k) for k in (m.key, *m.aliases)) if n is not None
}
#: Where a short name may also be read from another metric's key (rank 2: after its key and aliases).
_FALLBACK_OF: dict[str, tuple[str, ...]] = {}
for _m in METRICS:
    for _f in _m.fallbacks:
        _FALLBACK_OF[_f] = (*_FALLBACK_OF.get(_f, ()), _m.short)
EXACT, ALIAS, FALLBACK = 0, 1, 2

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


@functools.lru_cache(maxsize=4096)
def sources_of(raw: str) -> tuple[tuple[str, int], ...]:
    """The short names a verl key feeds, each with its rank: EXACT (the metric's own key, or a
    per-data-source validation key), ALIAS (an older name) or FALLBACK (another metric standing in)."""
    key = canonical_key(raw)
    out = [(BY_KEY[key].short, EXACT if raw == key or raw not in _ALIASES else ALIAS)] if key else []
    out += [(short, FALLBACK) for short in _FALLBACK_OF.get(key or "", ())]
    return tuple(out)


_PLANS: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {}
_PLANS_MAX = 256


def _plan(keys: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(raw key, short name) pairs to_short takes from a record of these keys, all values numeric."""
    chosen: dict[str, tuple[int, str]] = {}
    for raw in keys:
        for short, r in sources_of(raw):
            if chosen.get(short, (3, ""))[0] <= r:
                continue
            chosen[short] = (r, raw)
    return tuple((raw, short) for short, (_, raw) in chosen.items())


def to_short(data: Mapping[str, object], sources: dict[str, str] | None = None) -> dict[str, float]:
    """Map one step's verl-keyed record onto short names, dropping unknown and non-numeric keys.

    Where a record carries several keys for one short name, the best-ranked wins: the current
    key over an older alias over a fallback (``actor/reward_kl_penalty`` over ``critic/kl`` over
    ``actor/kl_loss``). ``sources``, when given, receives the verl key each short name came from.
    """
    # A trainer logs the same keys line after line: which raw key feeds which short name is worked
    # out once per key set (as if every value were numeric) and replayed; a line whose chosen
    # values are not all plain floats takes the general path below.
    keys = tuple(data)
    plan = _PLANS.get(keys)
    if plan is None:
        plan = _PLANS[keys] = _plan(keys)
        if len(_PLANS) > _PLANS_MAX:
            _PLANS.clear()
    fast: dict[str, float] = {}
    for raw, short in plan:
        value = data[raw]
        if type(value) is not float:
            break
        fast[short] = value
    else:
        if sources is not None:
            for raw, short in plan:
                sources[short] = raw
        return fast
    out: dict[str, float] = {}
    rank: dict[str, int] = {}
    for raw, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for short, r in sources_of(raw):
            if rank.get(short, 3) <= r:
                continue
            out[short] = float(value)
            rank[short] = r
            if sources is not None:
                sources[short] = raw
    return out


def names(kind: str = "short") -> Iterable[str]:
    """All names of one kind: ``short``, ``key`` or ``prom``."""
    return (getattr(m, kind) for m in METRICS)


def is_finite(value: float) -> bool:
    """True for a real, finite number."""
    return not (math.isnan(value) or math.isinf(value))


# -- Hugging Face TRL (GRPOTrainer, RLOOTrainer) ------------------------------------------------
#
# TRL logs one dict a logging step (transformers' Trainer.log: trainer_state.json's ``log_history``,
# printed on the console, passed to callbacks' ``on_log``). The TRL glue's callback and the readers of a
# user's TRL logs (``ppo_watchdog.sources.ingest``) put it under verl's keys with this one mapping.

#: TRL log name -> verl key, the same for both trainers (the KL is mapped by :func:`trl_metrics`).
TRL_KEYS: dict[str, str] = {
    "entropy": "actor/entropy",
    "reward": "critic/score/mean",
    "reward_std": "critic/score/std",
    "grad_norm": "actor/grad_norm",
    "learning_rate": "actor/lr",
    "completions/mean_length": "response_length/mean",
    "completions/max_length": "response_length/max",
    "completions/min_length": "response_length/min",
    "completions/clipped_ratio": "response_length/clip_ratio",
    "clip_ratio/region_mean": "actor/pg_clipfrac",
    "entropy_coef": "actor/entropy_coeff",
    "epoch": "training/epoch",
}
#: Prefix of TRL's own values kept beside the verl keys (``trl/kl``), so nothing it logged is lost.
TRL_PREFIX = "trl/"


def trl_metrics(logs: Mapping[str, object], kl_in_reward: bool = False, beta: float | None = None) -> dict[str, float]:
    """One step of TRL's logs under verl's keys, plus each TRL value as ``trl/<name>``.

    The KL goes where the trainer computes it: GRPO's k3 KL is a loss term (``actor/kl_loss``, coefficient
    ``actor/kl_coef``), RLOO's is subtracted from the reward (``kl_in_reward``: ``actor/reward_kl_penalty``,
    ``actor/reward_kl_penalty_coeff``); the coefficient only when ``beta`` is known (TRL does not log it).
    TRL logs no KL while beta is 0. The policy loss is TRL's ``policy_loss`` when it logs one (entropy bonus
    on), else ``loss`` (which then includes beta x KL, as TRL computes it)."""
    out: dict[str, float] = {}
    for key, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[TRL_PREFIX + key] = float(value)
        if key in TRL_KEYS:
            out[TRL_KEYS[key]] = float(value)
    if TRL_PREFIX + "kl" in out:
        kl_key, coef_key = (("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff") if kl_in_reward
                            else ("actor/kl_loss", "actor/kl_coef"))
        out[kl_key] = out[TRL_PREFIX + "kl"]
        if beta is not None:
            out[coef_key] = float(beta)
    loss = out.get(TRL_PREFIX + "policy_loss", out.get(TRL_PREFIX + "loss"))
    if loss is not None:
        out["actor/pg_loss"] = loss
    return out
