"""PPO on the tiny model with verl's own math (``verl.trainer.ppo.core_algos``).

Stages, as in verl's RayPPOTrainer.fit: rollout (sample responses), score, old and
reference log-probs, values, KL penalty in the reward (``algorithm.kl_ctrl``), GAE,
then the actor update (clipped policy loss, entropy bonus, optional KL loss) and the
critic update (clipped value loss), each over ppo_epochs x mini batches with micro
batches as gradient accumulation. Losses use ``agg_loss`` with the mini batch's global
token count (``global_batch_info``), so the update does not depend on the micro-batch
size. No file or process I/O here: the loop owns that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.workers.config import ActorConfig as VerlActorConfig

from ppo_watchdog.trainer.config import ActorConfig, AlgorithmConfig, CriticConfig
from ppo_watchdog.trainer.model import CharTokenizer, Critic, response_logits, response_values

#: A hook called before every micro batch with (n_tokens, what): the memory budget's check.
MicroBatchHook = Callable[[int, str], None]


@dataclass
class Rollout:
    """One batch of prompts with responses and everything PPO computes on them."""

    input_ids: torch.Tensor
    """(B, P+R) left-padded prompt then right-padded response."""
    attention_mask: torch.Tensor
    """(B, P+R) 1 on prompt tokens and on response tokens up to and including EOS."""
    responses: torch.Tensor
    """(B, R) response token ids."""
    response_mask: torch.Tensor
    """(B, R) float mask of valid response tokens."""
    scores: torch.Tensor
    """(B,) task scores after reward clipping."""
    rollout_log_prob: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(B, R) log-probs of the sampled tokens as the sampler computed them (incremental decoding with
    a KV cache, like a rollout engine); empty offline."""
    old_log_prob: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(B, R) log-probs of the policy that sampled, recomputed by the trainer in one forward pass."""
    ref_log_prob: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(B, R) log-probs of the reference (SFT) policy."""
    values: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(B, R) critic values."""
    token_level_rewards: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(B, R) score at the last token minus the KL penalty."""
    advantages: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(B, R) whitened GAE advantages."""
    returns: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    """(B, R) GAE returns."""
    texts: list[str] = field(default_factory=list)
    """Decoded responses."""

    @property
    def batch_size(self) -> int:
        return int(self.responses.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.responses.shape[1])


# -- rollout ------------------------------------------------------------------------------
def encode_prompts(tokenizer: CharTokenizer, prompts: Sequence[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-truncate and left-pad prompts to one length (verl pads prompts on the left)."""
    encoded = [tokenizer.encode(p)[-max_len:] for p in prompts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e):] = 1
    return ids, mask


def encode_responses(tokenizer: CharTokenizer, texts: Sequence[str], max_len: int) -> torch.Tensor:
    """Response texts + EOS, truncated to max_len, right-padded (offline mode and SFT)."""
    out = torch.full((len(texts), max_len), tokenizer.pad_id, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = (tokenizer.encode(t) + [tokenizer.eos_id])[:max_len]
        out[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def response_mask_of(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1.0 on tokens up to and including the first EOS (all tokens when there is none)."""
    is_eos = (responses == eos_id).long()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_eos).float()


@torch.no_grad()
def generate(policy: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new: int,
             eos_id: int, pad_id: int, temperature: float = 1.0, generator: torch.Generator | None = None,
             greedy: bool = False, log_probs_out: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Sample (or greedily decode) up to ``max_new`` tokens; after EOS a row is padded.

    ``log_probs_out``, when given, receives the (B, R) log-probs of the chosen tokens as computed
    while sampling (what verl's rollout engine reports as ``rollout_log_probs``).
    """
    ids, mask = prompt_ids, prompt_mask
    batch = ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool)
    out = torch.full((batch, max_new), pad_id, dtype=torch.long)
    logp = torch.zeros((batch, max_new))
    past = None
    for t in range(max_new):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if past is None:
            res = policy(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        else:
            res = policy(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:],
                         past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[:, -1, :].float()
        if greedy:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        if log_probs_out is not None:
            lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, nxt[:, None]).squeeze(-1)
            logp[:, t] = torch.where(done, torch.zeros_like(lp), lp)
        out[:, t] = nxt
        done |= nxt == eos_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        # Keep attending to the EOS token itself; pads after it are masked out.
        mask = torch.cat([mask, (~done | (nxt == eos_id)).long()[:, None]], dim=1)
        if bool(done.all()):
            out = out[:, :max_new]
            break
    if log_probs_out is not None:
        log_probs_out.append(logp)
    return out


def rollout_mismatch(ro: Rollout) -> dict[str, float]:
    """verl's training-inference mismatch metric (``verl.utils.debug.metrics``): how far the
    sampler's token probabilities are from the trainer's recomputed ones; {} offline."""
    if ro.rollout_log_prob.numel() == 0:
        return {}
    from verl.protocol import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    m = calculate_debug_metrics(DataProto.from_dict(tensors={
        "rollout_log_probs": ro.rollout_log_prob, "old_log_probs": ro.old_log_prob,
        "response_mask": ro.response_mask, "responses": ro.responses,
    }))
    return {"training/rollout_probs_diff_mean": float(m["training/rollout_probs_diff_mean"])}


def assemble(tokenizer: CharTokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             responses: torch.Tensor, scores: torch.Tensor, texts: list[str]) -> Rollout:
    """Concatenate prompt and response into model inputs with masks."""
    rmask = response_mask_of(responses, tokenizer.eos_id)
    return Rollout(
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, rmask.long()], dim=1),
        responses=responses, response_mask=rmask, scores=scores, texts=texts,
    )


# -- log-probs and values -----------------------------------------------------------------
def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def log_probs(policy: nn.Module, ro: Rollout, micro: int, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs of the responses under ``policy``, (B, R)."""
    parts = []
    for s in _chunks(ro.batch_size, micro):
        logits = response_logits(policy, ro.input_ids[s], ro.attention_mask[s], ro.response_length, temperature)
        parts.append(verl_F.logprobs_from_logits(logits, ro.responses[s]))
    return torch.cat(parts)


@torch.no_grad()
def values_of(critic: Critic, ro: Rollout, micro: int) -> torch.Tensor:
    """Critic values (B, R), masked to valid response tokens."""
    parts = [response_values(critic, ro.input_ids[s], ro.attention_mask[s], ro.response_length)
             for s in _chunks(ro.batch_size, micro)]
    return torch.cat(parts) * ro.response_mask


# -- rewards and advantages -----------------------------------------------------------------
def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The sequence score placed on its last valid token (verl's reward manager does the same)."""
    out = torch.zeros_like(response_mask)
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)
    out[torch.arange(out.shape[0]), last] = scores.to(out.dtype)
    return out


def apply_kl_penalty(ro: Rollout, kl_ctrl: Any, kl_penalty: str, use_kl_in_reward: bool) -> dict[str, float]:
    """verl's apply_kl_penalty: rewards = scores - beta * KL; updates the controller; returns KL metrics."""
    scores = token_level_scores(ro.scores, ro.response_mask)
    kld: torch.Tensor = core_algos.kl_penalty(ro.old_log_prob, ro.ref_log_prob,  # type: ignore[arg-type]
                                              kl_penalty=kl_penalty)
    kld = kld * ro.response_mask
    beta = float(kl_ctrl.value)
    ro.token_level_rewards = scores - beta * kld if use_kl_in_reward else scores
    per_seq = verl_F.masked_mean(kld, mask=ro.response_mask, axis=-1)
    current_kl = float(per_seq.mean())
    if use_kl_in_reward:
        kl_ctrl.update(current_kl=current_kl, n_steps=ro.batch_size)
    # The KL std (actor/reward_kl_penalty_std) is over steps, not sequences: see StepStd.
    return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


class StepStd:
    """Population std of a per-step value over the last ``steps`` steps (this one included).

    The KL "std" of the seed's targets (mean < 0.05, std < 0.02) is how much the batch KL
    mean moves from step to step, not its spread over sequences: the per-sequence std of a
    short-response policy runs ~3-4x the mean even in a healthy run (a few sequences carry
    most of the KL), so a 0.02 target on it would fire on every run. Over steps it is the
    watchdog's ``std(kl, 10)``, which needs nothing verl does not log.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._values: list[float] = []

    def push(self, value: float) -> float:
        """Add this step's value; returns the std of the window (0.0 for a single value)."""
        self._values = [*self._values, value][-self.steps:]
        n = len(self._values)
        mean = sum(self._values) / n
        return math.sqrt(sum((v - mean) ** 2 for v in self._values) / n)

    def state(self) -> list[float]:
        """The values in the window, oldest first (checkpointed, so a resume logs what a straight run would)."""
        return list(self._values)

    def load(self, values: Sequence[float]) -> None:
        """Restore the window from :meth:`state`."""
        self._values = [float(v) for v in values][-self.steps:]


def compute_advantages(ro: Rollout, gamma: float, lam: float) -> None:
    """GAE with verl's compute_gae_advantage_return (whitened advantages)."""
    ro.advantages, ro.returns = core_algos.compute_gae_advantage_return(
        token_level_rewards=ro.token_level_rewards, values=ro.values, response_mask=ro.response_mask,
        gamma=gamma, lam=lam)


# -- updates ----------------------------------------------------------------------------------
def verl_actor_config(actor: ActorConfig) -> VerlActorConfig:
    """verl's (frozen) ActorConfig, constructed anew each update so live changes take effect.

    clip_ratio_low/high default to 0.2 in verl and win over clip_ratio, so all three are set.
    """
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    return VerlActorConfig(
        strategy=actor.strategy, rollout_n=1, ppo_mini_batch_size=actor.ppo_mini_batch_size,
        ppo_micro_batch_size_per_gpu=actor.ppo_micro_batch_size_per_gpu, clip_ratio=actor.clip_ratio,
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode, entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type, ppo_epochs=actor.ppo_epochs,
        use_torch_compile=False,
    )


@dataclass
class UpdateResult:
    """What one actor or critic update did."""

    metrics: dict[str, float]
    """Averaged metrics (verl keys)."""
    skipped: list[str] = field(default_factory=list)
    """Why optimizer steps were skipped (non-finite loss or grad norm), one entry per skip."""


def _global_info(mask: torch.Tensor, loss_scale_factor: int | None = None) -> dict[str, Any]:
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum().item()), "global_batch_size": int(mask.shape[0]),
            "loss_scale_factor": loss_scale_factor}


def clip_norm(cfg: ActorConfig | CriticConfig) -> float:
    """The grad-norm clip in force: ``optim.clip_grad`` (verl 0.9's key), else the older ``grad_clip``."""
    return float(cfg.optim.clip_grad) if cfg.optim.clip_grad is not None else float(cfg.grad_clip)


def _finite_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, grad_clip: float,
                 loss_value: float, what: str, skipped: list[str]) -> float:
    """Clip and step unless the loss or the grad norm is non-finite (then skip, like verl)."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=grad_clip))
    if not math.isfinite(loss_value) or not math.isfinite(grad_norm):
        skipped.append(f"{what}: loss={loss_value} grad_norm={grad_norm}")
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return grad_norm


def update_actor(policy: nn.Module, optimizer: torch.optim.Optimizer, ro: Rollout, cfg: ActorConfig,
                 temperature: float = 1.0, before_micro: MicroBatchHook | None = None,
                 poison: bool = False) -> UpdateResult:
    """PPO policy update: ppo_epochs x mini batches; micro batches accumulate gradients."""
    vcfg = verl_actor_config(cfg)
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    params = [p for p in policy.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n_updates, skipped = 0, list[str]()
    policy.train()
    for _ in range(cfg.ppo_epochs):
        for mini in _chunks(ro.batch_size, cfg.ppo_mini_batch_size):
            mask_mini = ro.response_mask[mini]
            info = _global_info(mask_mini)
            vcfg.global_batch_info.clear()
            vcfg.global_batch_info.update(info)
            optimizer.zero_grad(set_to_none=True)
            acc: dict[str, float] = {"actor/pg_loss": 0.0, "actor/entropy": 0.0, "actor/pg_clipfrac": 0.0,
                                     "actor/ppo_kl": 0.0, "actor/kl_loss": 0.0}
            total_loss = 0.0
            for micro in _chunks(mini.stop - mini.start, cfg.ppo_micro_batch_size_per_gpu):
                s = slice(mini.start + micro.start, mini.start + micro.stop)
                mask = ro.response_mask[s]
                if before_micro is not None:
                    before_micro(int(ro.attention_mask[s].sum()), "actor")
                logits = response_logits(policy, ro.input_ids[s], ro.attention_mask[s], ro.response_length,
                                         temperature)
                log_prob = verl_F.logprobs_from_logits(logits, ro.responses[s])
                pg_loss, pg_metrics = loss_fn(
                    old_log_prob=ro.old_log_prob[s], log_prob=log_prob, advantages=ro.advantages[s],
                    response_mask=mask, loss_agg_mode=cfg.loss_agg_mode, config=vcfg)
                entropy = core_algos.agg_loss(verl_F.entropy_from_logits(logits), mask, cfg.loss_agg_mode, **info)
                loss = pg_loss - cfg.entropy_coeff * entropy
                if cfg.use_kl_loss:
                    kld = core_algos.kl_penalty(log_prob, ro.ref_log_prob[s],  # type: ignore[arg-type]
                                               kl_penalty=cfg.kl_loss_type)
                    kl_loss = core_algos.agg_loss(kld, mask, cfg.loss_agg_mode, **info)
                    loss = loss + cfg.kl_loss_coef * kl_loss
                    acc["actor/kl_loss"] += kl_loss.detach().item()
                if poison:
                    loss = loss * float("nan")
                loss.backward()
                # Each micro loss is already its share of the mini-batch loss (global token count),
                # so sums give mini-batch values; per-micro means are weighted by token share.
                share = float(mask.sum()) / max(info["batch_num_tokens"], 1)
                total_loss += loss.detach().item()
                acc["actor/pg_loss"] += pg_loss.detach().item()
                acc["actor/entropy"] += entropy.detach().item()
                acc["actor/pg_clipfrac"] += pg_metrics["actor/pg_clipfrac"] * share
                acc["actor/ppo_kl"] += pg_metrics["actor/ppo_kl"] * share
            grad_norm = _finite_step(params, optimizer, clip_norm(cfg), total_loss, "actor", skipped)
            acc["actor/grad_norm"] = grad_norm
            for k, v in acc.items():
                sums[k] = sums.get(k, 0.0) + v
            n_updates += 1
    metrics = {k: v / max(n_updates, 1) for k, v in sums.items()}
    if not cfg.use_kl_loss:
        metrics.pop("actor/kl_loss", None)
    else:
        metrics["actor/kl_coef"] = cfg.kl_loss_coef
    return UpdateResult(metrics, skipped)


def update_critic(critic: Critic, optimizer: torch.optim.Optimizer, ro: Rollout, cfg: CriticConfig,
                  before_micro: MicroBatchHook | None = None) -> UpdateResult:
    """Clipped value-loss update with verl's compute_value_loss."""
    params = [p for p in critic.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n_updates, skipped = 0, list[str]()
    critic.train()
    for _ in range(cfg.ppo_epochs):
        for mini in _chunks(ro.batch_size, cfg.ppo_mini_batch_size):
            info = _global_info(ro.response_mask[mini])
            optimizer.zero_grad(set_to_none=True)
            acc = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0}
            for micro in _chunks(mini.stop - mini.start, cfg.ppo_micro_batch_size_per_gpu):
                s = slice(mini.start + micro.start, mini.start + micro.stop)
                mask = ro.response_mask[s]
                if before_micro is not None:
                    before_micro(int(ro.attention_mask[s].sum()), "critic")
                vpreds = response_values(critic, ro.input_ids[s], ro.attention_mask[s], ro.response_length)
                vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                    vpreds=vpreds, returns=ro.returns[s], values=ro.values[s], response_mask=mask,
                    cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, **info)
                vf_loss.backward()
                share = float(mask.sum()) / max(info["batch_num_tokens"], 1)
                acc["critic/vf_loss"] += vf_loss.detach().item()
                acc["critic/vf_clipfrac"] += vf_clipfrac.detach().item() * share
            acc["critic/grad_norm"] = _finite_step(params, optimizer, clip_norm(cfg), acc["critic/vf_loss"],
                                                   "critic", skipped)
            for k, v in acc.items():
                sums[k] = sums.get(k, 0.0) + v
            n_updates += 1
    return UpdateResult({k: v / max(n_updates, 1) for k, v in sums.items()}, skipped)


def data_metrics(ro: Rollout) -> dict[str, float]:
    """verl's compute_data_metrics subset: score, rewards, advantages, returns, values, lengths."""
    mask = ro.response_mask
    lengths = mask.sum(-1)
    return {
        "critic/score/mean": float(ro.scores.mean()),
        "critic/score/max": float(ro.scores.max()),
        "critic/score/min": float(ro.scores.min()),
        "critic/rewards/mean": float(ro.token_level_rewards.sum(-1).mean()),
        "critic/advantages/mean": float(verl_F.masked_mean(ro.advantages, mask)),
        "critic/returns/mean": float(verl_F.masked_mean(ro.returns, mask)),
        "critic/values/mean": float(verl_F.masked_mean(ro.values, mask)),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= ro.response_length).float().mean()),
    }


def kl_controller(algo: AlgorithmConfig) -> Any:
    """verl's KL controller for algorithm.kl_ctrl (its coefficient is ``.value``)."""
    return core_algos.get_kl_controller(algo.kl_ctrl)
