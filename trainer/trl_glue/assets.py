"""Tiny local assets for TRL on CPU, built without the hub (``python -m ppo_watchdog.trainer.trl_glue.assets DIR``).

- a randomly initialised ``Qwen2ForCausalLM`` (2 layers, hidden 64, tied embeddings, fp32) with a
  ``GenerationConfig``;
- warm-started by a short supervised pass on the arithmetic task (:func:`sft`: ``a+b=`` -> the sum
  and ``<|im_end|>``), so the policy starts peaked and mostly well-formed, as an RL run's SFT model
  does: an entropy bonus or an lr far too high then visibly spreads it out or collapses it;
- its tokenizer: byte-level BPE without merges (GPT-2's 256 byte characters plus
  ``<|endoftext|>`` and ``<|im_end|>``), so any text round-trips and every byte is one token.
  transformers 5 rebuilds a qwen2 tokenizer as byte-level BPE anyway; a character vocabulary
  would silently lose its whitespace.

The prompts and the reward live in :mod:`ppo_watchdog.trainer.trl_glue.task`. Deterministic for a seed;
:func:`build` skips a directory that holds a complete build (a ``.complete`` stamp).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from ppo_watchdog.trainer.byte_tokenizer import byte_level_tokenizer

SPECIALS = ("<|endoftext|>", "<|im_end|>")
STAMP = ".complete"


def build_tokenizer(out: Path) -> None:
    """Write a byte-level tokenizer (tokenizer.json + tokenizer_config.json) to ``out``."""
    byte_level_tokenizer(SPECIALS, model_max_length=512).save_pretrained(str(out))


def sft(model: object, tok: object, steps: int, seed: int = 0, lr: float = 3e-3, batch: int = 64,
        text: Callable[[int, int], str] | None = None) -> float:
    """Train ``model`` on ``a+b=<sum><|im_end|>`` (or ``text(a, b)``) for ``steps`` steps (causal LM loss);
    returns the last loss."""
    import random

    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)  # type: ignore[attr-defined]
    model.train()  # type: ignore[attr-defined]
    loss = torch.tensor(0.0)
    for _ in range(steps):
        texts = []
        for _ in range(batch):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            texts.append(text(a, b) if text is not None else f"{a}+{b}={a + b}<|im_end|>")
        enc = tok(texts, return_tensors="pt", padding=True)  # type: ignore[operator]
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss  # type: ignore[operator]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()  # type: ignore[attr-defined]
    return float(loss.detach())


def _token_id(tok: object, token: str) -> int:
    """The id of one token (convert_tokens_to_ids answers a list for a list)."""
    found = tok.convert_tokens_to_ids(token)  # type: ignore[attr-defined]
    if not isinstance(found, int):
        raise RuntimeError(f"tokenizer: {token!r} is not one token ({found!r})")
    return found


def build(out: Path | str, seed: int = 0, hidden: int = 64, layers: int = 2, sft_steps: int = 300) -> Path:
    """Write the tiny model (warm-started for ``sft_steps``) and its tokenizer to ``out`` (skipped when
    already built); returns ``out``."""
    out = Path(out)
    if (out / STAMP).exists():
        return out
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    eos, pad = _token_id(tok, "<|im_end|>"), _token_id(tok, "<|endoftext|>")
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=eos,
                      pad_token_id=pad, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    if sft_steps > 0:
        torch.set_num_threads(1)  # a tiny model: more threads only contend (2 cores, shared)
        sft(model, tok, sft_steps, seed)
    model.save_pretrained(str(out))
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=True).save_pretrained(str(out))
    (out / STAMP).write_text("")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m ppo_watchdog.trainer.trl_glue.assets DIR\n")
        raise SystemExit(2)
    build(sys.argv[1])
