"""The built-in toy task of the TRL entry point: arithmetic prompts and a dense reward.

A random tiny model scores a spread of rewards on it, so group advantages (GRPO, RLOO) and
gradients are not zero and a few steps visibly learn: the reward is the share of the
completion that is digits, plus 1 when the completion starts with the right sum.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def prompts(n: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt": "3+4=", "answer": "7"}``, deterministic for ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def load_prompts(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a JSONL file, each an object with a string ``prompt`` (ValueError naming the line)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{n}: expected an object with a string 'prompt'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def digits_reward(completions: list[str], answer: list[str] | None = None, **_: Any) -> list[float]:
    """Share of digits in each completion, plus 1 when it starts with the row's ``answer``."""
    out = []
    for i, text in enumerate(completions):
        text = str(text)
        share = sum(c.isdigit() for c in text) / max(len(text), 1)
        right = 1.0 if answer is not None and answer[i] and text.strip().startswith(str(answer[i])) else 0.0
        out.append(share + right)
    return out


def exact_reward(completions: list[str], answer: list[str] | None = None, **_: Any) -> list[float]:
    """1 when a completion starts with the row's ``answer``, else 0: a verifiable reward, as in RL on
    math. A group whose completions are all right (or all wrong) scores alike: zero GRPO advantage."""
    return [1.0 if answer is not None and answer[i] and str(text).strip().startswith(str(answer[i])) else 0.0
            for i, text in enumerate(completions)]


#: ``trainer.reward`` -> the reward function.
REWARDS = {"digits": digits_reward, "exact": exact_reward}
