"""Tiny local assets for real verl on CPU, built without the hub (``python -m ppo_watchdog.trainer.verl_cpu.assets DIR``).

- ``model/``: a randomly initialised ``Qwen2ForCausalLM`` (2 layers, hidden 32, about 27k
  parameters, tied embeddings) with a ``GenerationConfig``, and its tokenizer;
- the tokenizer: byte-level BPE without merges (the 256 GPT-2 byte characters plus
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) with a ChatML template. Two traps avoided:
  transformers 5 rebuilds any qwen2 tokenizer as byte-level BPE (a character vocabulary would
  silently lose its whitespace), and verl refuses a Qwen tokenizer whose ``"\\n"`` is not exactly
  one token (verl/utils/tokenizer/continuous_token.py:556-558, verl 0.9.1);
- ``data/train.parquet``, ``data/val.parquet``: the layout of verl's
  ``examples/data_preprocess/gsm8k.py`` (data_source, prompt as chat messages, ability,
  reward_model.ground_truth, extra_info) over small additions;
- ``reward.py``: a dense custom reward (``reward.custom_reward_function.path``): verl's gsm8k
  scorer gives a random model 0 everywhere, so advantages and gradients would be exactly 0.

Deterministic for a seed; ``build`` skips what exists (a ``.complete`` stamp per directory).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_watchdog.trainer.byte_tokenizer import byte_level_tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DATA_SOURCE = "openai/gsm8k"
SUFFIX = ' Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k prompt suffix

REWARD_PY = '''"""Dense reward for the tiny verl CPU run (built by ppo_watchdog.trainer.verl_cpu.assets): the share of the
response that is digits, plus 1 for the right answer. A random model gets a spread of scores, so
PPO's advantages and gradients are not zero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    text = str(solution_str)
    digits = sum(c.isdigit() for c in text) / max(len(text), 1)
    right = 1.0 if str(ground_truth) in text.split("####")[-1] else 0.0
    return float(digits + right)
'''


@dataclass(frozen=True)
class Assets:
    """Where the built assets are."""

    root: Path
    """The directory they were built in."""

    @property
    def model(self) -> Path:
        """The model and tokenizer directory (``actor_rollout_ref.model.path``, ``critic.model.path``)."""
        return self.root / "model"

    @property
    def train(self) -> Path:
        return self.root / "data" / "train.parquet"

    @property
    def val(self) -> Path:
        return self.root / "data" / "val.parquet"

    @property
    def reward(self) -> Path:
        """The dense reward's file (``reward.custom_reward_function.path``)."""
        return self.root / "reward.py"


def build_tokenizer(out: Path) -> None:
    """Write a byte-level Qwen2 tokenizer (tokenizer.json + tokenizer_config.json) to ``out``."""
    fast = byte_level_tokenizer(SPECIALS)
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    # verl's Qwen handling (continuous tokens, chat boundaries) keys off the class name.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["model_max_length"] = 512
    cfg_path.write_text(json.dumps(cfg, indent=2))


def chat_answer(tok: Any) -> Callable[[int, int], str]:
    """The supervised text of one prompt of :func:`build_data`: its ChatML prompt, ``#### a+b`` and the end."""
    def text(a: int, b: int) -> str:
        prompt = tok.apply_chat_template([{"role": "user", "content": f"{a}+{b}=?"}], tokenize=False,
                                         add_generation_prompt=True)
        return f"{prompt}#### {a + b}<|im_end|>"
    return text


def build_model(out: Path, seed: int = 0, sft_steps: int = 0) -> None:
    """Write a random 2-layer Qwen2 (fp32, tied embeddings) and its tokenizer to ``out``; with
    ``sft_steps`` warm-start it on the task's chat-formatted answers, as an RL run starts from an SFT
    model (peaked, mostly well-formed answers that end): the random model's answers are near-uniform
    bytes cut at max_response_length, which leaves entropy, truncation and collapse nothing to show."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok: Any = AutoTokenizer.from_pretrained(str(out))
    ids = tok.encode("\n", add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"{out}: the tokenizer splits '\\n' into {ids}; verl needs one token")
    torch.manual_seed(seed)
    eos, pad = int(tok.convert_tokens_to_ids("<|im_end|>")), int(tok.convert_tokens_to_ids("<|endoftext|>"))
    settings: dict[str, Any] = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
                                    torch_dtype="float32")
    cfg = Qwen2Config(**settings)
    model = Qwen2ForCausalLM(cfg)
    if sft_steps > 0:
        from ppo_watchdog.trainer.trl_glue.assets import sft

        torch.set_num_threads(1)  # a tiny model: more threads only contend
        sft(model, tok, sft_steps, seed, text=chat_answer(tok))
    model.save_pretrained(str(out))
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=True).save_pretrained(str(out))


def _row(a: int, b: int, split: str, i: int) -> dict[str, Any]:
    """One prompt ``a+b=?`` in the layout of verl's gsm8k preprocessing."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}+{b}=?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": i, "answer": f"#### {a + b}", "question": f"{a}+{b}=?"},
    }


def build_data(out: Path, n_train: int = 256, n_val: int = 16, seed: int = 0) -> None:
    """Write train/val parquet in the layout of verl's gsm8k preprocessing."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        rows = [_row(rng.randint(0, 9), rng.randint(0, 9), split, i) for i in range(n)]
        pd.DataFrame(rows).to_parquet(out / f"{split}.parquet")


def build_grid(out: Path) -> Path:
    """Every prompt ``a+b=?`` with a and b in 0-9, once each (100 rows): a validation set that measures the
    whole task, not a sample of it. Returns the parquet's path."""
    import pandas as pd

    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([_row(a, b, "val", 10 * a + b) for a in range(10) for b in range(10)]).to_parquet(out)
    return out


def build(root: Path | str, seed: int = 0, sft_steps: int = 0) -> Assets:
    """Build (or reuse) every asset under ``root`` (the model warm-started for ``sft_steps``); returns where they are."""
    a = Assets(Path(root))
    a.root.mkdir(parents=True, exist_ok=True)
    if not (a.model / ".complete").exists():
        build_model(a.model, seed, sft_steps)
        (a.model / ".complete").touch()
    if not (a.root / "data" / ".complete").exists():
        build_data(a.root / "data", seed=seed)
        (a.root / "data" / ".complete").touch()
    if not a.reward.exists():
        a.reward.write_text(REWARD_PY)
    return a


if __name__ == "__main__":  # python -m ppo_watchdog.trainer.verl_cpu.assets DIR
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m ppo_watchdog.trainer.verl_cpu.assets DIR\n")
        raise SystemExit(2)
    build(sys.argv[1])
