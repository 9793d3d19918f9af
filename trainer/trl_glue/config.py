"""The TRL run's settings under verl's key names, read from ``key=value`` arguments.

The watchdog speaks verl's Hydra keys: its rules set ``actor_rollout_ref.actor.optim.lr``, a
relaunch appends ``trainer.resume_mode=resume_path trainer.resume_from_path=...`` and the
batch-skip key run.json names. So the entry point takes the same words and maps each onto
the TRL knob with that meaning (:data:`KEYS`); what has no verl name is ``trl.<field>``, passed
to ``GRPOConfig`` / ``RLOOConfig`` as it is. Every argument is parsed by Hydra's own grammar
(:mod:`ppo_watchdog.protocol.hydra`); an unknown key or a bad value is a :class:`TRLConfigError`
naming it (the entry point exits 2).

TRL's own names for the same knobs (:data:`TRL_NAMES`: ``learning_rate``, ``beta``,
``per_device_train_batch_size``, ``num_generations`` ...) are accepted beside verl's, here, in
control.json and in a relaunch's arguments, and read as the verl key; the watchdog itself writes
verl's. :func:`from_trl` reads a trainer a user's own script built back into the same settings.

Two meanings differ from verl's and are said here once:

- the mini batch is the step's completions (``data.train_batch_size`` x ``rollout.n``): TRL
  makes one optimizer step per generation batch, so ``ppo_micro_batch_size_per_gpu`` must
  divide it and sets ``per_device_train_batch_size`` (the rest is gradient accumulation);
- the KL coefficient is TRL's ``beta``: GRPO puts the KL in the loss (verl's
  ``actor.kl_loss_coef``, logged as ``actor/kl_loss``), RLOO subtracts it from the reward
  (verl's ``algorithm.kl_ctrl.kl_coef``, logged as ``actor/reward_kl_penalty``), so the
  default pack's ``kl_coef`` resolves to the right key for each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import hydra

GRPO, RLOO = "grpo", "rloo"
ALGORITHMS = (GRPO, RLOO)

ACTOR_LR = "actor_rollout_ref.actor.optim.lr"
KL_LOSS_COEF = "actor_rollout_ref.actor.kl_loss_coef"
KL_COEF = "algorithm.kl_ctrl.kl_coef"
ENTROPY_COEFF = "actor_rollout_ref.actor.entropy_coeff"
CLIP_RATIO = "actor_rollout_ref.actor.clip_ratio"
CLIP_LOW = "actor_rollout_ref.actor.clip_ratio_low"
CLIP_HIGH = "actor_rollout_ref.actor.clip_ratio_high"
PPO_EPOCHS = "actor_rollout_ref.actor.ppo_epochs"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
MINI = "actor_rollout_ref.actor.ppo_mini_batch_size"
SKIP_KEY = "trainer.resume_skip_batches"


#: The learning rate's bound (exclusive). TRL trains with AdamW, whose step moves each weight by about the lr
#: whatever the gradient's scale: at 1 a single step rewrites every weight of the pretrained model. RL fine-tuning
#: runs at 1e-7 to 1e-4; a value at or past 1 is a typo (a missing ``e-``), refused before a step is spent on it.
MAX_LR = 1.0


class TRLConfigError(ValueError):
    """A key or value the TRL entry point cannot run with; the message names it."""


@dataclass
class TRLRun:
    """One TRL run's settings (verl's names in the comments: the key each field is read from)."""

    algorithm: str = GRPO
    """``trainer.algorithm``: ``grpo`` (GRPOTrainer) or ``rloo`` (RLOOTrainer)."""
    model_path: str = ""
    """``actor_rollout_ref.model.path``: a local model directory with its tokenizer (no hub)."""
    train_files: str = ""
    """``data.train_files``: JSONL of ``{"prompt": ...}`` rows; empty: the built-in arithmetic prompts."""
    train_batch_size: int = 2
    """``data.train_batch_size``: prompts per step."""
    n: int = 4
    """``actor_rollout_ref.rollout.n``: completions per prompt (TRL's ``num_generations``)."""
    max_response_length: int = 16
    """``data.max_response_length``: TRL's ``max_completion_length``."""
    temperature: float = 1.0
    """``actor_rollout_ref.rollout.temperature``."""
    lora_rank: int = 0
    """``actor_rollout_ref.model.lora_rank``: train a LoRA adapter of this rank (peft's ``r``); 0 trains every weight.
    With an adapter, TRL's reference policy is the base model with the adapter off (no second copy)."""
    lora_alpha: int = 16
    """``actor_rollout_ref.model.lora_alpha``: peft's ``lora_alpha`` (the adapter's scale is alpha / rank)."""
    target_modules: str = "all-linear"
    """``actor_rollout_ref.model.target_modules``: peft's ``target_modules`` (``all-linear``, or comma-separated names)."""
    lr: float = 1e-5
    """``actor_rollout_ref.actor.optim.lr``: TRL's ``learning_rate``."""
    lr_scheduler: str = "constant"
    """``trl.lr_scheduler_type``-like: ``actor_rollout_ref.actor.optim.lr_scheduler_type`` (constant, linear, cosine)."""
    clip_grad: float = 1.0
    """``actor_rollout_ref.actor.optim.clip_grad``: TRL's ``max_grad_norm``."""
    beta: float = 0.04
    """The KL coefficient (``beta``): ``actor.kl_loss_coef`` for GRPO, ``algorithm.kl_ctrl.kl_coef`` for RLOO."""
    entropy_coeff: float = 0.0
    """``actor_rollout_ref.actor.entropy_coeff``: GRPO's entropy bonus (RLOO has none)."""
    clip_ratio: float = 0.2
    """``actor_rollout_ref.actor.clip_ratio``: TRL's ``epsilon``."""
    clip_ratio_low: float | None = None
    """``actor.clip_ratio_low``: TRL's ``epsilon`` when set (wins over clip_ratio, as in verl)."""
    clip_ratio_high: float | None = None
    """``actor.clip_ratio_high``: TRL's ``epsilon_high`` when set."""
    ppo_epochs: int = 1
    """``actor_rollout_ref.actor.ppo_epochs``: TRL's ``num_iterations`` (clip bites only above 1)."""
    micro_batch: int | None = None
    """``actor.ppo_micro_batch_size_per_gpu``: completions per forward/backward (default: the whole step)."""
    total_training_steps: int = 20
    """``trainer.total_training_steps``: TRL's ``max_steps``."""
    save_freq: int = 5
    """``trainer.save_freq``: a checkpoint every N steps (0: none but the last)."""
    max_ckpt_to_keep: int | None = None
    """``trainer.max_actor_ckpt_to_keep``: keep the newest N (the one resumed from is never pruned)."""
    seed: int = 0
    """``trainer.seed``."""
    resume_mode: str = "auto"
    """``trainer.resume_mode``: auto (newest complete checkpoint), disable, resume_path."""
    resume_from_path: str = ""
    """``trainer.resume_from_path``: the checkpoint to resume from (resume_mode=resume_path)."""
    resume_skip_batches: int = 0
    """``trainer.resume_skip_batches``: steps' worth of prompts to skip after a resume_path checkpoint."""
    faults: str = ""
    """``ppo_watchdog.trainer.faults``: injected faults, ``kind@step[:arg]`` (trainer/faults.py; TRL: lr_spike,
    nan_weights, oom, hang, crash)."""
    metrics_port: int = 0
    """``trainer.metrics_port``: serve /metrics on 127.0.0.1 (0 off, -1 any free port)."""
    num_threads: int = 1
    """``trainer.num_threads``: torch threads (CPU)."""
    reward: str = "digits"
    """``trainer.reward``: the toy task's reward, ``digits`` (dense: share of digits + 1 for the right sum) or
    ``exact`` (1 for the right sum, else 0)."""
    trl: dict[str, Any] = field(default_factory=dict)
    """``trl.<field>=value``: any other GRPOConfig / RLOOConfig field, as TRL names it."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise TRLConfigError(f"trainer.algorithm={self.algorithm!r}: one of {', '.join(ALGORITHMS)}")
        if self.reward not in ("digits", "exact"):
            raise TRLConfigError(f"trainer.reward={self.reward!r}: one of digits, exact")
        if not self.model_path:
            raise TRLConfigError("actor_rollout_ref.model.path: required (a local model directory with its tokenizer)")
        if self.lora_rank < 0 or self.lora_alpha < 1 or not self.target_modules.strip():
            raise TRLConfigError(f"actor_rollout_ref.model.lora_rank={self.lora_rank!r}, lora_alpha={self.lora_alpha!r}, "
                                 f"target_modules={self.target_modules!r}: rank >= 0 (0: no adapter), alpha >= 1, "
                                 "target_modules named")
        if not 0 < self.lr < MAX_LR:  # (NaN fails too)
            raise TRLConfigError(f"{ACTOR_LR}={self.lr!r}: must be a number > 0 and < {MAX_LR:g}")
        if not math.isfinite(self.clip_grad) or self.clip_grad <= 0:
            raise TRLConfigError(f"actor_rollout_ref.actor.optim.clip_grad={self.clip_grad!r}: must be a finite number > 0")
        if not math.isfinite(self.beta) or self.beta < 0:
            raise TRLConfigError(f"{self.kl_key}={self.beta!r}: must be a finite number >= 0")
        for key, bound in ((CLIP_RATIO, self.clip_ratio), (CLIP_LOW, self.clip_ratio_low), (CLIP_HIGH, self.clip_ratio_high)):
            if bound is not None and not 0 < bound < 1:
                raise TRLConfigError(f"{key}={bound!r}: must be in (0, 1)")
        if self.algorithm == RLOO and self.entropy_coeff != 0:
            # RLOO's loss has no entropy term: a bonus asked for would silently do nothing.
            raise TRLConfigError(f"{ENTROPY_COEFF}={self.entropy_coeff!r}: RLOOTrainer has no entropy bonus (use 0)")
        for key, value in (("data.train_batch_size", self.train_batch_size), ("actor_rollout_ref.rollout.n", self.n),
                           (PPO_EPOCHS, self.ppo_epochs), ("trainer.total_training_steps", self.total_training_steps),
                           ("data.max_response_length", self.max_response_length)):
            if value < 1:
                raise TRLConfigError(f"{key}={value!r}: must be >= 1")
        if self.n < 2:
            raise TRLConfigError(f"actor_rollout_ref.rollout.n={self.n}: group baselines need at least 2 completions")
        micro = self.micro
        if micro < 1 or self.completions_per_step % micro:
            # TRL accumulates gradients over whole micro batches of one generation batch.
            raise TRLConfigError(f"{MICRO}={micro}: must divide the step's {self.completions_per_step} completions "
                                 f"(data.train_batch_size x rollout.n)")
        if self.resume_mode not in ("auto", "disable", "resume_path"):
            raise TRLConfigError(f"trainer.resume_mode={self.resume_mode!r}: auto, disable or resume_path")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise TRLConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        if self.resume_skip_batches < 0 or self.save_freq < 0:
            raise TRLConfigError("trainer.resume_skip_batches and trainer.save_freq must be >= 0")
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            raise TRLConfigError(f"trainer.max_actor_ckpt_to_keep={self.max_ckpt_to_keep}: must be >= 1 (or null)")

    # -- derived ------------------------------------------------------------------------------
    @property
    def completions_per_step(self) -> int:
        """Completions one optimizer step trains on (the mini batch)."""
        return self.train_batch_size * self.n

    @property
    def micro(self) -> int:
        """Completions per forward/backward pass."""
        return self.micro_batch if self.micro_batch is not None else self.completions_per_step

    @property
    def kl_key(self) -> str:
        """The verl key of this run's KL coefficient (GRPO: KL loss; RLOO: KL in the reward)."""
        return KL_LOSS_COEF if self.algorithm == GRPO else KL_COEF

    @property
    def epsilon(self) -> float:
        """TRL's ``epsilon`` (the low bound): clip_ratio_low when set, else clip_ratio."""
        return self.clip_ratio_low if self.clip_ratio_low is not None else self.clip_ratio

    @property
    def epsilon_high(self) -> float:
        """TRL's ``epsilon_high``: clip_ratio_high when set, else clip_ratio."""
        return self.clip_ratio_high if self.clip_ratio_high is not None else self.clip_ratio

    def verl_config(self) -> dict[str, Any]:
        """The run's settings under verl's keys (run.json's config): what the watchdog's rules,
        planner and relaunches read (current values, micro-batch snapping, pruning)."""
        actor: dict[str, Any] = {
            "optim": {"lr": self.lr, "clip_grad": self.clip_grad, "lr_scheduler_type": self.lr_scheduler},
            "entropy_coeff": self.entropy_coeff, "clip_ratio": self.clip_ratio, "ppo_epochs": self.ppo_epochs,
            "ppo_mini_batch_size": self.completions_per_step, "ppo_micro_batch_size_per_gpu": self.micro,
            "use_kl_loss": self.algorithm == GRPO and self.beta != 0,
        }
        if self.clip_ratio_low is not None:
            actor["clip_ratio_low"] = self.clip_ratio_low
        if self.clip_ratio_high is not None:
            actor["clip_ratio_high"] = self.clip_ratio_high
        if self.algorithm == GRPO:
            actor["kl_loss_coef"] = self.beta
        model: dict[str, Any] = {"path": self.model_path}
        if self.lora_rank:
            model.update(lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, target_modules=self.target_modules)
        cfg: dict[str, Any] = {
            "actor_rollout_ref": {"model": model, "actor": actor,
                                  "rollout": {"n": self.n, "temperature": self.temperature}},
            "algorithm": {"adv_estimator": self.algorithm, "use_kl_in_reward": self.algorithm == RLOO and self.beta != 0},
            "data": {"train_files": self.train_files, "train_batch_size": self.train_batch_size,
                     "max_response_length": self.max_response_length},
            "trainer": {"algorithm": self.algorithm, "total_training_steps": self.total_training_steps,
                        "save_freq": self.save_freq, "seed": self.seed},
        }
        if self.algorithm == RLOO:
            cfg["algorithm"]["kl_ctrl"] = {"type": "fixed", "kl_coef": self.beta}
        if self.max_ckpt_to_keep is not None:
            # Named as verl names it: the watchdog then hard-links known-good checkpoints out of reach.
            cfg["trainer"]["max_actor_ckpt_to_keep"] = self.max_ckpt_to_keep
        if self.trl:
            cfg["trl"] = dict(self.trl)
        return cfg


#: verl key -> TRLRun field, for the keys the entry point reads.
KEYS: dict[str, str] = {
    "trainer.algorithm": "algorithm",
    "actor_rollout_ref.model.path": "model_path",
    "actor_rollout_ref.model.lora_rank": "lora_rank",
    "actor_rollout_ref.model.lora_alpha": "lora_alpha",
    "actor_rollout_ref.model.target_modules": "target_modules",
    "data.train_files": "train_files",
    "data.train_batch_size": "train_batch_size",
    "actor_rollout_ref.rollout.n": "n",
    "data.max_response_length": "max_response_length",
    "actor_rollout_ref.rollout.temperature": "temperature",
    ACTOR_LR: "lr",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "lr_scheduler",
    "actor_rollout_ref.actor.optim.clip_grad": "clip_grad",
    ENTROPY_COEFF: "entropy_coeff",
    CLIP_RATIO: "clip_ratio",
    CLIP_LOW: "clip_ratio_low",
    CLIP_HIGH: "clip_ratio_high",
    PPO_EPOCHS: "ppo_epochs",
    MICRO: "micro_batch",
    "trainer.total_training_steps": "total_training_steps",
    "trainer.save_freq": "save_freq",
    "trainer.max_actor_ckpt_to_keep": "max_ckpt_to_keep",
    "trainer.seed": "seed",
    "trainer.resume_mode": "resume_mode",
    "trainer.resume_from_path": "resume_from_path",
    SKIP_KEY: "resume_skip_batches",
    "trainer.faults": "faults",
    "trainer.metrics_port": "metrics_port",
    "trainer.num_threads": "num_threads",
    "trainer.reward": "reward",
}
#: Keys a relaunch may carry that mean nothing to a TRL run (the pack sets them for any PPO run):
#: accepted and ignored, so an OOM remedy's critic micro batch does not make the relaunch fail.
IGNORED = frozenset({"critic.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_mini_batch_size",
                     "actor_rollout_ref.actor.use_kl_loss", "algorithm.use_kl_in_reward"})
_FIELDS = {f.name: f for f in dataclasses.fields(TRLRun)}
#: The beta of TRL, read as the KL key of the run's trainer (:attr:`TRLRun.kl_key`).
BETA = "beta"
#: TRL's name (a GRPOConfig / RLOOConfig field) -> the verl key of the same knob (``beta``: :data:`BETA`).
TRL_NAMES: dict[str, str] = {
    "learning_rate": ACTOR_LR,
    "lr_scheduler_type": "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "max_grad_norm": "actor_rollout_ref.actor.optim.clip_grad",
    "epsilon": CLIP_RATIO,
    "epsilon_high": CLIP_HIGH,
    "entropy_coef": ENTROPY_COEFF,
    "num_iterations": PPO_EPOCHS,
    "per_device_train_batch_size": MICRO,
    "num_generations": "actor_rollout_ref.rollout.n",
    "max_completion_length": "data.max_response_length",
    "temperature": "actor_rollout_ref.rollout.temperature",
    "max_steps": "trainer.total_training_steps",
    "save_steps": "trainer.save_freq",
    "save_total_limit": "trainer.max_actor_ckpt_to_keep",
    "seed": "trainer.seed",
}


def verl_key(key: str, algorithm: str) -> str:
    """The verl key ``key`` means: itself, or the verl key of a TRL name (``beta``: the trainer's KL key)."""
    if key == BETA:
        return KL_LOSS_COEF if algorithm == GRPO else KL_COEF
    return TRL_NAMES.get(key, key)


def _coerce(key: str, name: str, value: Any) -> Any:
    kind = str(_FIELDS[name].type)
    if value is None:
        if "None" in kind:
            return None
        raise TRLConfigError(f"{key}=null: a value is required")
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
            raise TRLConfigError(f"{key}={value!r}: must be a whole number")
        return int(value)
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TRLConfigError(f"{key}={value!r}: must be a number")
        return float(value)
    if kind.startswith("str"):
        return str(value)
    return value


def parse_args(args: Sequence[str]) -> TRLRun:
    """A :class:`TRLRun` from ``key=value`` arguments (the last of a key wins); TRLConfigError naming the bad one."""
    fields: dict[str, Any] = {}
    trl: dict[str, Any] = {}
    beta: dict[str, float] = {}
    for arg in args:
        try:
            ov = hydra.parse(arg)
        except hydra.OverrideError as exc:
            raise TRLConfigError(str(exc)) from None
        key = ov.key if ov.key == BETA else TRL_NAMES.get(ov.key, ov.key)
        if key.startswith("trl.") and (key[4:] in TRL_NAMES or key[4:] == BETA):
            # A knob the glue sets under verl's key, named through trl.: checked as that key (a
            # ``trl.learning_rate=abc`` is a configuration error, never a crash in the first step; a
            # ``trl.max_steps=-5`` never overrides the run's length unchecked).
            key = key[4:] if key[4:] == BETA else TRL_NAMES[key[4:]]
        if ov.kind == "delete":
            raise TRLConfigError(f"{arg}: deleting a key is not supported")
        if key.startswith("trl."):
            trl[key[4:]] = ov.value
        elif key in (KL_LOSS_COEF, KL_COEF, BETA):
            if isinstance(ov.value, bool) or not isinstance(ov.value, (int, float)):
                raise TRLConfigError(f"{key}={ov.value!r}: must be a number")
            beta[key] = float(ov.value)
        elif key in KEYS:
            fields[KEYS[key]] = _coerce(key, KEYS[key], ov.value)
        elif key in IGNORED:
            continue
        else:
            raise TRLConfigError(f"{key}: unknown key (known: {', '.join(sorted([*KEYS, KL_LOSS_COEF, KL_COEF]))}, "
                                 f"TRL's names {', '.join(sorted([*TRL_NAMES, BETA]))}, "
                                 "and trl.<GRPOConfig/RLOOConfig field>)")
    algorithm = fields.get("algorithm", GRPO)
    own = KL_LOSS_COEF if algorithm == GRPO else KL_COEF
    other = KL_COEF if algorithm == GRPO else KL_LOSS_COEF
    if other in beta and own not in beta and beta[other] != 0:
        # The pack resolves kl_coef by the KL signal the run logs; the other key means another KL term.
        raise TRLConfigError(f"{other}={beta[other]!r}: {algorithm.upper()} has its KL as "
                             f"{'a loss term' if algorithm == GRPO else 'a reward penalty'}: set {own}")
    if own in beta or BETA in beta:
        fields["beta"] = beta.get(own, beta.get(BETA))
    return TRLRun(**fields, trl=trl)


def _value(v: Any) -> Any:
    """A TrainingArguments value as a plain one (its enums: their value)."""
    return getattr(v, "value", v)


def from_trl(trainer: Any, args: Sequence[str] = ()) -> TRLRun:
    """The settings of a GRPOTrainer / RLOOTrainer a script built, under verl's keys, then ``args``
    (``key=value``: a relaunch's overrides and resume) over them; TRLConfigError naming a bad one."""
    from trl import RLOOTrainer

    a = trainer.args
    algorithm = RLOO if isinstance(trainer, RLOOTrainer) else GRPO
    n, micro = int(a.num_generations), int(a.per_device_train_batch_size)
    completions = micro * int(a.gradient_accumulation_steps) * int(getattr(a, "world_size", 1) or 1)
    steps = int(a.max_steps)
    if steps <= 0:  # by epochs: what transformers will count (each prompt n times; a generation reused num_iterations)
        rows = len(trainer.train_dataset) if trainer.train_dataset is not None else completions
        steps = max(1, math.ceil(float(a.num_train_epochs) * rows * n / completions) * int(a.num_iterations))
    save = float(a.save_steps or 0)
    name = getattr(getattr(trainer.model, "config", None), "_name_or_path", "") or type(trainer.model).__name__
    settings: dict[str, Any] = {
        "trainer.algorithm": algorithm, "actor_rollout_ref.model.path": str(name),
        "data.train_batch_size": max(1, completions // n), "actor_rollout_ref.rollout.n": n, MICRO: micro,
        "data.max_response_length": int(a.max_completion_length), "actor_rollout_ref.rollout.temperature": float(a.temperature),
        ACTOR_LR: float(a.learning_rate), "actor_rollout_ref.actor.optim.lr_scheduler_type": str(_value(a.lr_scheduler_type)),
        "actor_rollout_ref.actor.optim.clip_grad": float(a.max_grad_norm), verl_key(BETA, algorithm): float(a.beta),
        CLIP_RATIO: float(a.epsilon), PPO_EPOCHS: int(a.num_iterations), "trainer.total_training_steps": steps,
        # A fractional save_steps is a share of the run (transformers' meaning); none: only the last step.
        "trainer.save_freq": (0 if str(_value(a.save_strategy)) != "steps" else
                              int(save) if save >= 1 else max(1, round(save * steps))),
        "trainer.max_actor_ckpt_to_keep": a.save_total_limit, "trainer.seed": int(a.seed),
    }
    if a.epsilon_high is not None and float(a.epsilon_high) != float(a.epsilon):
        settings[CLIP_HIGH] = float(a.epsilon_high)
    if algorithm == GRPO:
        settings[ENTROPY_COEFF] = float(getattr(a, "entropy_coef", 0.0) or 0.0)
    return parse_args([hydra.format_override(k, v) for k, v in settings.items()] + list(args))


def checkpoint_root(run_dir: Path | str) -> Path:
    """Where the run's protocol checkpoints go: ``run_dir/checkpoints``."""
    from ppo_watchdog.protocol import rundir

    return Path(run_dir) / rundir.CHECKPOINTS
