"""Trainer configuration: nested dataclasses named after verl's Hydra keys.

``cfg.get("algorithm.kl_ctrl.kl_coef")`` and ``cfg.set(...)`` address fields by the
same dotted keys verl uses, so an override that works here (``key=value`` on the
command line, in Hydra's grammar, or in control.json) works on a real verl run unchanged.
Only stdlib, yaml, the protocol's Hydra helpers and the fault schedule's parser are
imported: a bad config fails before torch loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppo_watchdog.protocol import hydra


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key and the value."""

    def __init__(self, message: str, key: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.errors: list[ConfigError] = [self]
        """Every problem found (one, or all of a :func:`raise_all`)."""


def raise_all(errors: Sequence[ConfigError]) -> None:
    """Raise one ConfigError carrying every problem (its message lists them, one a line)."""
    if not errors:
        return
    if len(errors) == 1:
        raise errors[0]
    first = errors[0]
    err = ConfigError(f"{len(errors)} config errors:\n" + "\n".join(f"  {e}" for e in errors), first.key, first.value)
    err.errors = list(errors)
    raise err


@dataclass
class DataConfig:
    """``data.*``: the task, its files and batch shapes."""

    train_files: str = ""
    """verl-format parquet for training; empty: generate the synthetic arithmetic task in the cache."""
    val_files: str = ""
    """verl-format parquet for validation; empty: the synthetic task's validation split."""
    train_batch_size: int = 128
    """Prompts per PPO step."""
    val_batch_size: int = 256
    """Prompts per validation forward (greedy decoding)."""
    max_prompt_length: int = 16
    """Prompt tokens kept (left-truncated, left-padded)."""
    max_response_length: int = 8
    """Most tokens sampled per response (EOS included; ``#### -9`` + EOS is 8)."""
    prompt_key: str = "prompt"
    """Column holding the chat list of the prompt."""
    train_size: int = 512
    """Synthetic task: number of training problems."""
    val_size: int = 128
    """Synthetic task: number of validation problems."""
    max_operand: int = 9
    """Synthetic task: operands are drawn from 0..max_operand (10*10*2 = 200 problems)."""
    val_heldout: bool = False
    """Synthetic task: keep validation problems out of training (default: a fixed sample of the same space)."""
    data_seed: int = 0
    """Synthetic task: seed of the generator (independent of trainer.seed)."""
    offline: bool = False
    """Offline RLHF: train on the stored responses in train_files instead of sampling new ones."""
    response_key: str = "response"
    """Offline mode: column holding the pre-collected response text."""
    reward_key: str = "reward"
    """Offline mode: column holding a stored score; missing or null -> scored with gsm8k rules."""


@dataclass
class ModelConfig:
    """``actor_rollout_ref.model.*``: the tiny GPT-2 built from scratch."""

    path: str = ""
    """Directory of a saved model + tokenizer to start from; empty: SFT warm start (cached)."""
    n_layer: int = 2
    """Transformer layers."""
    n_embd: int = 128
    """Hidden size."""
    n_head: int = 4
    """Attention heads."""


@dataclass
class OptimConfig:
    """``*.optim.*``: AdamW settings."""

    lr: float = 1e-5
    """Learning rate (live: param_groups and the scheduler's base_lrs)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps of the LambdaLR schedule (0: constant)."""
    clip_grad: float | None = None
    """Max global grad norm: verl 0.9's key (its engine clips with ``optim.clip_grad`` and never reads
    ``actor.grad_clip``); None: the component's ``grad_clip``."""


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor.*``: the policy update (verl's ActorConfig names)."""

    strategy: str = "fsdp"
    """verl's strategy name; the embedded trainer runs one CPU process whatever it says."""
    ppo_mini_batch_size: int = 64
    """Prompts per optimizer step."""
    ppo_micro_batch_size_per_gpu: int = 64
    """Prompts per forward/backward (gradient accumulation; does not change the update)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    clip_ratio: float = 0.2
    """PPO clip epsilon; also the low/high bounds unless they are set."""
    clip_ratio_low: float | None = None
    """Lower clip bound (None: clip_ratio)."""
    clip_ratio_high: float | None = None
    """Upper clip bound (None: clip_ratio)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages."""
    entropy_coeff: float = 0.05
    """Entropy bonus coefficient. 0.05 keeps rollouts exploring on the 99-token char vocabulary;
    the KL penalty (algorithm.kl_ctrl.kl_coef) is what holds it in check: with kl_coef 1e-4 and a
    3-5x lr the bonus wins, token entropy runs to ~3 nats (near uniform) within ~20 steps and
    reward falls (bench/README.md). 0.03 and below do not blow up within 100 steps."""
    use_kl_loss: bool = False
    """Add a KL-to-reference loss term to the policy loss."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss (verl kl_penalty names)."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    loss_agg_mode: str = "token-mean"
    """verl agg_loss mode."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4))
    """Actor optimizer."""


@dataclass
class RolloutConfig:
    """``actor_rollout_ref.rollout.*``: sampling."""

    temperature: float = 1.0
    """Sampling temperature of rollouts (validation is greedy)."""
    n: int = 1
    """Responses per prompt."""


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref.*``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape and initial weights."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""


@dataclass
class CriticConfig:
    """``critic.*``: the value model (SFT body + value head)."""

    ppo_mini_batch_size: int = 64
    """Prompts per critic optimizer step."""
    ppo_micro_batch_size_per_gpu: int = 64
    """Prompts per critic forward/backward."""
    ppo_epochs: int = 1
    """Critic passes over each batch."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    grad_clip: float = 1.0
    """Max critic grad norm."""
    loss_agg_mode: str = "token-mean"
    """verl agg_loss mode of the value loss."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Critic optimizer."""


@dataclass
class KLCtrlConfig:
    """``algorithm.kl_ctrl.*``: the KL-in-reward controller."""

    type: str = "fixed"
    """fixed | adaptive."""
    kl_coef: float = 0.1
    """KL penalty coefficient (the controller's ``.value``; live). 0.1 keeps a healthy run's KL mean
    under the watchdog's 0.1 threshold on the default task (max 0.08 in 100 steps; 0.05: 0.07 by
    step 100, 2 steps above 0.1) and holds the entropy bonus in check (see entropy_coeff)."""
    target_kl: float = 0.05
    """Adaptive controller target."""
    horizon: int = 10000
    """Adaptive controller horizon."""


@dataclass
class AlgorithmConfig:
    """``algorithm.*``: advantages, KL in reward, reward shaping."""

    gamma: float = 1.0
    """Discount."""
    lam: float = 1.0
    """GAE lambda."""
    adv_estimator: str = "gae"
    """Advantage estimator (gae needs the critic)."""
    use_kl_in_reward: bool = True
    """Subtract kl_coef * KL(policy || reference) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty: kl|abs|mse|low_var_kl."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """KL controller."""
    reward_clip: list[float] = field(default_factory=lambda: [-2.0, 2.0])
    """Scores are clipped to [low, high] before the KL penalty (the seed's [-2, 2])."""


@dataclass
class TrainerSection:
    """``trainer.*``: the run."""

    total_epochs: int = 25
    """Passes over the training set."""
    total_training_steps: int | None = None
    """Stop after this many steps (None: total_epochs * steps per epoch)."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: off; save_epoch_freq still applies)."""
    save_epoch_freq: int = 5
    """Checkpoint every N epochs (0: off)."""
    test_freq: int = 10
    """Validate every N steps (0: never); also before step 1 and at the end."""
    val_before_train: bool = True
    """Validate before the first step."""
    run_dir: str = "runs/default"
    """Run directory (metrics.jsonl, events.jsonl, control.json, checkpoints/)."""
    resume_mode: str = "auto"
    """auto: newest complete checkpoint in run_dir; disable: start fresh; resume_path: resume_from_path."""
    resume_from_path: str = ""
    """Checkpoint directory (global_step_N) for resume_mode=resume_path."""
    resume_skip_batches: int = 0
    """With resume_mode=resume_path: move the data past this many batches after loading (a rollback
    by restart that skips the batches which led to a spike). Not a verl key; the watchdog passes it
    for one launch only, because run.json names it (``skip_batches_key``)."""
    seed: int = 1
    """Seed of every random choice (sampling, data order, init)."""
    metrics_port: int = 0
    """Prometheus /metrics port on ``metrics_addr`` (0: off; -1: any free port, written to run.json)."""
    metrics_addr: str = "127.0.0.1"
    """Bind address of /metrics (0.0.0.0 to let a Prometheus on another machine scrape it)."""
    faults: str = ""
    """Fault schedule, e.g. "kl_collapse@20,lr_spike@30:x20,nan@45,oom@60,hang@80:30,crash@90"."""
    oom_retry_live: bool = False
    """On OOM shrink the micro batch and retry in process instead of saving and exiting 75."""
    memory_budget_tokens: int | None = None
    """Simulated memory: tokens per micro batch above which a real torch.OutOfMemoryError is raised."""
    max_actor_ckpt_to_keep: int | None = None
    """Keep this many complete checkpoints (None: all)."""
    logger: list[str] = field(default_factory=lambda: ["console", "file"])
    """verl's logger list: with run_dir_protocol=false the metrics go only through these (verl's
    Tracking); otherwise the run dir's metrics.jsonl is always written and this is not used."""
    project_name: str = "ppo-watchdog"
    """verl's project name."""
    experiment_name: str = "tiny-arith"
    """verl's experiment name."""
    num_threads: int = 1
    """torch CPU threads."""
    progress: bool = True
    """Show progress bars (stderr)."""
    default_local_dir: str = ""
    """verl's checkpoint directory (global_step_N/ and latest_checkpointed_iteration.txt); empty:
    run_dir/checkpoints."""
    run_dir_protocol: bool = True
    """Speak the watchdog's run-directory protocol (run.json, events.jsonl, control.json, manifests).
    false: behave like an unmodified verl run, for testing the watchdog's zero-patch mode: metrics
    only through verl's own Tracking (``trainer.logger``, the file backend honouring
    VERL_FILE_LOGGER_PATH), checkpoints in verl's manifest-less layout under default_local_dir and
    resumed as verl does (the checkpoint's lr wins, the KL controller restarts from the config), no
    control.json, no signal handlers, and an out-of-memory error raised out with exit code 1."""


@dataclass
class Config:
    """The whole trainer config (verl's top-level Hydra groups)."""

    data: DataConfig = field(default_factory=DataConfig)
    """data.*"""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """actor_rollout_ref.*"""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """critic.*"""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """algorithm.*"""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    """trainer.*"""

    def __post_init__(self) -> None:
        self.validate()

    # -- cross-field checks --------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming every value that is out of range or cannot work with another."""
        raise_all(self.problems())

    def problems(self) -> list[ConfigError]:
        """Every value that is out of range or cannot work with another (named by key), in config order."""
        found: list[ConfigError] = []
        bad = found.append
        d, a, c, al, t = self.data, self.actor_rollout_ref.actor, self.critic, self.algorithm, self.trainer
        positive = {
            "data.train_batch_size": d.train_batch_size,
            "data.max_response_length": d.max_response_length,
            "data.max_prompt_length": d.max_prompt_length,
            "actor_rollout_ref.actor.ppo_mini_batch_size": a.ppo_mini_batch_size,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": a.ppo_micro_batch_size_per_gpu,
            "actor_rollout_ref.actor.ppo_epochs": a.ppo_epochs,
            "critic.ppo_mini_batch_size": c.ppo_mini_batch_size,
            "critic.ppo_micro_batch_size_per_gpu": c.ppo_micro_batch_size_per_gpu,
            "critic.ppo_epochs": c.ppo_epochs,
            "actor_rollout_ref.rollout.n": self.actor_rollout_ref.rollout.n,
        }
        for key, value in positive.items():
            if value < 1:
                bad(ConfigError(f"{key} must be >= 1, got {value!r}", key, value))
        rollout_bs = d.train_batch_size * self.actor_rollout_ref.rollout.n
        # Same rule as verl: whole mini batches per batch, whole micro batches per mini batch,
        # otherwise gradient accumulation would weight some samples twice.
        for prefix, mini, micro in (
            ("actor_rollout_ref.actor", a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu),
            ("critic", c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu),
        ):
            if min(rollout_bs, mini, micro) < 1:
                continue  # said above: a batch size below 1
            if rollout_bs % mini:
                bad(ConfigError(
                    f"data.train_batch_size * rollout.n ({rollout_bs}) must be divisible by "
                    f"{prefix}.ppo_mini_batch_size ({mini})", f"{prefix}.ppo_mini_batch_size", mini))
            if mini % micro:
                bad(ConfigError(
                    f"{prefix}.ppo_mini_batch_size ({mini}) must be divisible by "
                    f"{prefix}.ppo_micro_batch_size_per_gpu ({micro})",
                    f"{prefix}.ppo_micro_batch_size_per_gpu", micro))
        choices: tuple[tuple[str, str, tuple[str, ...]], ...] = (
            ("trainer.resume_mode", t.resume_mode, ("auto", "disable", "resume_path")),
            ("algorithm.kl_ctrl.type", al.kl_ctrl.type, ("fixed", "adaptive")),
            ("algorithm.adv_estimator", al.adv_estimator, ("gae",)),
            ("algorithm.kl_penalty", al.kl_penalty, ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")),
            ("actor_rollout_ref.actor.kl_loss_type", a.kl_loss_type,
             ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "low_var_kl+")),
            ("actor_rollout_ref.actor.loss_agg_mode", a.loss_agg_mode,
             ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")),
        )
        for ckey, choice, allowed in choices:
            if choice not in allowed:
                bad(ConfigError(f"{ckey} must be one of {', '.join(allowed)}; got {choice!r}", ckey, choice))
        if t.resume_skip_batches < 0:
            bad(ConfigError(f"trainer.resume_skip_batches must be >= 0, got {t.resume_skip_batches!r}",
                              "trainer.resume_skip_batches", t.resume_skip_batches))
        if t.resume_mode == "resume_path" and not t.resume_from_path:
            bad(ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path",
                              "trainer.resume_from_path", t.resume_from_path))
        if len(al.reward_clip) != 2 or al.reward_clip[0] > al.reward_clip[1]:
            bad(ConfigError(f"algorithm.reward_clip must be [low, high] with low <= high, got {al.reward_clip!r}",
                              "algorithm.reward_clip", al.reward_clip))
        if al.kl_ctrl.type == "adaptive" and al.kl_ctrl.horizon <= 0:
            bad(ConfigError("algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller",
                              "algorithm.kl_ctrl.horizon", al.kl_ctrl.horizon))
        for key, lr in (("actor_rollout_ref.actor.optim.lr", a.optim.lr), ("critic.optim.lr", c.optim.lr)):
            if not lr >= 0:
                bad(ConfigError(f"{key} must be >= 0, got {lr!r}", key, lr))
        if not -1 <= t.metrics_port <= 65535:
            bad(ConfigError(f"trainer.metrics_port must be 0 (off), -1 (any free port) or 1..65535, got "
                              f"{t.metrics_port!r}", "trainer.metrics_port", t.metrics_port))
        if not t.metrics_addr:
            bad(ConfigError("trainer.metrics_addr must be an address to bind, e.g. 127.0.0.1",
                              "trainer.metrics_addr", t.metrics_addr))
        if d.offline and not d.train_files:
            bad(ConfigError("data.offline=true needs data.train_files (a parquet with responses)",
                              "data.train_files", d.train_files))
        for leaf, number in self.to_flat().items():
            if isinstance(number, float) and not math.isfinite(number):
                bad(ConfigError(f"{leaf} must be a finite number, got {number!r}", leaf, number))
        for leaf, coef in (("algorithm.kl_ctrl.kl_coef", al.kl_ctrl.kl_coef),
                           ("actor_rollout_ref.actor.kl_loss_coef", a.kl_loss_coef),
                           ("actor_rollout_ref.actor.entropy_coeff", a.entropy_coeff)):
            if coef < 0:  # a negative coefficient pays the policy for leaving the reference / for certainty
                bad(ConfigError(f"{leaf} must be >= 0, got {coef!r}", leaf, coef))
        for key, clip in (("actor_rollout_ref.actor.clip_ratio", a.clip_ratio),
                          ("actor_rollout_ref.actor.clip_ratio_low", a.clip_ratio_low),
                          ("actor_rollout_ref.actor.clip_ratio_high", a.clip_ratio_high)):
            if clip is not None and not 0 < clip <= 1:
                bad(ConfigError(f"{key} must be in (0, 1], got {clip!r}", key, clip))
        if t.faults:
            # Checked here, before torch loads: a bad schedule is a configuration the trainer refuses
            # (exit 2, the supervisor gives up), not a crash in the loop that a restart would repeat.
            from ppo_watchdog.trainer.faults import FaultSchedule

            try:
                FaultSchedule.parse(t.faults)
            except ValueError as exc:
                bad(ConfigError(str(exc), "trainer.faults", t.faults))
        model = self.actor_rollout_ref.model
        if model.n_head < 1 or model.n_embd % model.n_head:
            bad(ConfigError("actor_rollout_ref.model.n_embd must be divisible by n_head",
                              "actor_rollout_ref.model.n_head", model.n_head))
        return found

    # -- dotted keys ---------------------------------------------------------------------
    def to_flat(self) -> dict[str, Any]:
        """Every leaf as ``{dotted.key: value}``."""
        return flatten(self)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (JSON/YAML-serialisable)."""
        return dataclasses.asdict(self)

    def get(self, key: str) -> Any:
        """The value at a dotted key; ConfigError (with the closest key) when unknown."""
        obj, name = _resolve(self, key)
        return getattr(obj, name)

    def set(self, key: str, value: Any, validate: bool = True) -> Any:
        """Set a dotted key (value coerced to the field's type); returns the stored value.

        The old value is restored when the result fails validation, so a bad live
        override never leaves the config half-changed.
        """
        obj, name = _resolve(self, key)
        coerced = _coerce(key, value, _field_types(type(obj))[name])
        old = getattr(obj, name)
        setattr(obj, name, coerced)
        if validate:
            try:
                self.validate()
            except ConfigError:
                setattr(obj, name, old)
                raise
        return coerced

    def settings_hash(self, keys: Iterable[str]) -> str:
        """Short sha256 of some keys' values (cache keys)."""
        payload = json.dumps({k: self.get(k) for k in sorted(keys)}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested dataclass as a flat dict of dotted keys."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = list(value) if isinstance(value, list) else value
    return out


_KNOWN_KEYS: list[str] | None = None


def known_keys() -> list[str]:
    """All dotted keys of the config."""
    global _KNOWN_KEYS
    if _KNOWN_KEYS is None:
        _KNOWN_KEYS = sorted(flatten(Config()))
    return _KNOWN_KEYS


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.0)
    # A near miss on the last component (lr vs optim.lr) is likelier than whole-key similarity.
    tail = [k for k in known_keys() if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    hint = (tail or close or ["?"])[0]
    return ConfigError(f"unknown config key {key!r}; closest known key: {hint!r}", key)


def _resolve(root: Any, key: str) -> tuple[Any, str]:
    parts = key.split(".")
    obj = root
    for part in parts[:-1]:
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            raise _unknown(key)
        obj = getattr(obj, part)
    if not dataclasses.is_dataclass(obj) or parts[-1] not in {f.name for f in dataclasses.fields(obj)}:
        raise _unknown(key)
    if dataclasses.is_dataclass(getattr(obj, parts[-1])):
        raise ConfigError(f"config key {key!r} is a group, not a value; set one of its fields", key)
    return obj, parts[-1]


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Coerce ``value`` to the annotated type ``tp``; ConfigError naming key and value."""
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(key, v, args[0]) if args else v for v in value]
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError("not a boolean")
        if tp is int:
            if isinstance(value, bool):
                raise ValueError("a boolean is not an integer")
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("not an integer")
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError("a boolean is not a number")
            return float(value)
        if tp is str:
            if isinstance(value, (list, dict)):
                raise ValueError(f"a {type(value).__name__} is not a string")
            return "" if value is None else str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key {key!r}: cannot use {value!r} as {getattr(tp, '__name__', tp)} ({exc})",
                          key, value) from exc
    return value


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` in Hydra's grammar (``+key=`` and ``++key=`` accepted) -> (key, value as Hydra reads it)."""
    try:
        ov = hydra.parse(text)
    except hydra.OverrideError as exc:
        raise ConfigError(str(exc), text) from None
    if ov.kind == "delete":
        raise ConfigError(f"override {text!r}: every key of the embedded trainer's config is required; "
                          f"set {ov.key}=VALUE instead of deleting it", ov.key)
    return ov.key, ov.value


def apply_mapping(cfg: Config, mapping: Mapping[str, Any], prefix: str = "", source: str = "") -> list[ConfigError]:
    """Apply a nested mapping (a YAML config file) onto ``cfg`` without validating; returns every key it refused."""
    errors: list[ConfigError] = []
    for k, v in mapping.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            errors += apply_mapping(cfg, v, key + ".", source)
            continue
        try:
            cfg.set(key, v, validate=False)
        except ConfigError as exc:
            errors.append(ConfigError(f"{source}: {exc}" if source else str(exc), exc.key, exc.value))
    return errors


def _finish(cfg: Config, errors: list[ConfigError]) -> Config:
    """Raise every problem at once: the refused keys, then the values that do not fit (of the keys that were set)."""
    refused = {e.key for e in errors}
    raise_all(errors + [p for p in cfg.problems() if p.key not in refused])
    return cfg


def load_config(overrides: Iterable[str] = (), config_file: str | Path | None = None) -> Config:
    """Defaults, then a YAML file (yaml.safe_load), then ``key=value`` overrides; validated once at the end.

    Every bad key and value is reported together (one :class:`ConfigError` whose ``errors`` lists them).
    """
    cfg = Config()
    errors: list[ConfigError] = []
    if config_file is not None:
        path = Path(config_file)
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not YAML ({exc})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot be read as text ({exc})") from None
        except RecursionError:  # PyYAML recurses once per nesting level
            raise ConfigError(f"{path}: YAML nested too deeply (hundreds of levels)") from None
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{path}: top level must be a mapping")
        errors += apply_mapping(cfg, doc, source=str(path))
    for text in overrides:
        try:
            key, value = parse_override(text)
            cfg.set(key, value, validate=False)
        except ConfigError as exc:
            errors.append(exc)
    return _finish(cfg, errors)


def from_dict(doc: Mapping[str, Any]) -> Config:
    """A Config from a nested dict (e.g. the snapshot in run.json)."""
    cfg = Config()
    return _finish(cfg, apply_mapping(cfg, doc))


USAGE = """usage: python -m ppo_watchdog.trainer [--config FILE.yaml] [key=value ...]

The embedded PPO trainer. Keys are verl's Hydra keys (algorithm.kl_ctrl.kl_coef,
actor_rollout_ref.actor.optim.lr, trainer.run_dir, ...); a leading '+' is accepted.
Exit codes: 0 finished or stopped (state saved), 75 out of memory (state saved), 2 bad config.
"""


def split_cli(args: Iterable[str]) -> tuple[str | None, list[str]]:
    """``[--config FILE] key=value ...`` -> (config file or None, overrides)."""
    args = list(args)
    config_file: str | None = None
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            if i + 1 >= len(args):
                raise ConfigError("--config needs a file", "--config")
            config_file = args[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option {arg!r} (overrides are key=value)", arg)
        else:
            overrides.append(arg)
        i += 1
    return config_file, overrides
