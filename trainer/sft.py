"""SFT warm start: teach the tiny model the ``#### N`` format until it is sometimes right.

PPO needs a policy that already earns reward now and then (10-40% accuracy); the SFT
model is then the reference policy and the init of actor and critic. The result is
cached under ``$PPO_WATCHDOG_CACHE`` (default ``~/.cache/ppo-watchdog``) keyed by a hash
of every setting that shapes it, so a second run skips it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ppo_watchdog.trainer import data as data_mod
from ppo_watchdog.trainer.model import CharTokenizer, build_policy, load_policy, save_policy

log = logging.getLogger(__name__)

SFT_JSON = "sft.json"


@dataclass(frozen=True)
class SFTSettings:
    """Everything that shapes the SFT model (hashed into the cache key)."""

    train_files: str
    """Training parquet (its answers become the SFT targets)."""
    n_layer: int = 2
    """Transformer layers."""
    n_embd: int = 128
    """Hidden size."""
    n_head: int = 4
    """Attention heads."""
    n_positions: int = 32
    """Longest prompt + response."""
    max_prompt_length: int = 16
    """Prompt tokens kept."""
    max_response_length: int = 10
    """Response tokens kept."""
    steps: int = 100
    """Optimizer steps (few on purpose: ~20% accuracy on the default task leaves PPO room to lift it)."""
    batch_size: int = 64
    """Examples per step."""
    lr: float = 2e-3
    """AdamW learning rate."""
    seed: int = 0
    """Init and order seed."""

    def key(self) -> str:
        """Cache key: sha256 of the settings and the training file's content."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        path = Path(self.train_files)
        if path.exists():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()[:16]


def cache_root() -> Path:
    """``$PPO_WATCHDOG_CACHE`` or ``~/.cache/ppo-watchdog``."""
    return Path(os.environ.get("PPO_WATCHDOG_CACHE") or Path.home() / ".cache" / "ppo-watchdog")


def sft_loss(policy: torch.nn.Module, tokenizer: CharTokenizer, prompts: list[str], targets: list[str],
             s: SFTSettings) -> torch.Tensor:
    """Mean token cross-entropy of the targets (+EOS) given the prompts."""
    from ppo_watchdog.trainer.model import response_logits
    from ppo_watchdog.trainer.ppo import encode_prompts, encode_responses, response_mask_of

    p_ids, p_mask = encode_prompts(tokenizer, prompts, s.max_prompt_length)
    r_ids = encode_responses(tokenizer, targets, s.max_response_length)
    r_mask = response_mask_of(r_ids, tokenizer.eos_id) * (r_ids != tokenizer.pad_id).float()
    ids = torch.cat([p_ids, r_ids], dim=1)
    mask = torch.cat([p_mask, r_mask.long()], dim=1)
    logits = response_logits(policy, ids, mask, r_ids.shape[1])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), r_ids.reshape(-1), reduction="none")
    return (ce * r_mask.reshape(-1)).sum() / r_mask.sum()


@torch.no_grad()
def accuracy(policy: torch.nn.Module, tokenizer: CharTokenizer, examples: list[data_mod.Example],
             max_prompt_length: int, max_response_length: int, batch: int = 256) -> float:
    """Greedy-decoding accuracy under verl's gsm8k score."""
    from ppo_watchdog.trainer.ppo import encode_prompts, generate

    policy.eval()
    total = 0.0
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        ids, mask = encode_prompts(tokenizer, [e.prompt for e in chunk], max_prompt_length)
        out = generate(policy, ids, mask, max_response_length, tokenizer.eos_id, tokenizer.pad_id, greedy=True)
        rows = out.tolist()
        total += sum(data_mod.score(tokenizer.decode(r), e.ground_truth) for r, e in zip(rows, chunk, strict=True))
    return total / max(len(examples), 1)


def train_sft(s: SFTSettings, out_dir: Path, val_examples: list[data_mod.Example] | None = None,
              progress: bool = True) -> dict[str, float]:
    """Train and save the SFT model to ``out_dir``; returns {"loss", "val_acc"}."""
    from tqdm import tqdm

    examples = data_mod.load_examples(s.train_files)
    tokenizer = CharTokenizer()
    policy = build_policy(tokenizer.vocab_size, s.n_positions, s.n_layer, s.n_embd, s.n_head, seed=s.seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=s.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(s.seed)
    policy.train()
    loss = torch.tensor(float("nan"))
    bar = tqdm(range(s.steps), desc="SFT warm start", disable=None if progress else True, leave=False)
    for _ in bar:
        idx = torch.randint(len(examples), (s.batch_size,), generator=gen).tolist()
        batch = [examples[i] for i in idx]
        loss = sft_loss(policy, tokenizer, [e.prompt for e in batch], [f"#### {e.ground_truth}" for e in batch], s)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.detach().item():.3f}")
    result = {"loss": loss.detach().item()}
    if val_examples:
        result["val_acc"] = accuracy(policy, tokenizer, val_examples, s.max_prompt_length, s.max_response_length)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_policy(policy, tokenizer, tmp)
    (tmp / SFT_JSON).write_text(json.dumps({"settings": asdict(s), **result}, indent=2))
    # Rename last: a half-written cache entry is never mistaken for a finished one.
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return result


def ensure_sft(s: SFTSettings, val_files: str | None = None, progress: bool = True) -> tuple[Path, dict[str, float]]:
    """The cached SFT model directory for these settings, training it first when missing."""
    out = cache_root() / f"sft-{s.key()}"
    if (out / SFT_JSON).exists():
        info = json.loads((out / SFT_JSON).read_text())
        log.info("SFT warm start from cache %s", out)
        return out, {k: v for k, v in info.items() if k != "settings"}
    out.parent.mkdir(parents=True, exist_ok=True)
    val = data_mod.load_examples(val_files) if val_files else None
    log.info("SFT warm start: training %d steps into %s", s.steps, out)
    return out, train_sft(s, out, val, progress)


def load_sft(path: Path) -> tuple[torch.nn.Module, CharTokenizer]:
    """The SFT model and tokenizer."""
    return load_policy(path)
