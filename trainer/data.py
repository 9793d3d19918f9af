"""The task: a synthetic GSM8K-like arithmetic set in verl's parquet format, and its reader.

Rows look like verl's ``examples/data_preprocess/gsm8k.py`` output: ``data_source``,
``prompt`` (a chat list), ``ability``, ``reward_model {style: rule, ground_truth}`` and
``extra_info``. Answers end in ``#### N`` and are scored by verl's own
``verl.utils.reward_score.gsm8k.compute_score``, so any verl-format parquet with
gsm8k-style ground truth trains here too. Offline mode adds a ``response`` column (and
optionally a stored ``reward``).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DATA_SOURCE = "tiny_arith"
OPS = ("+", "-")


class DataError(ValueError):
    """A dataset file is unusable; the message names the file, row and column."""


@dataclass(frozen=True)
class Example:
    """One prompt with what is needed to score (and, offline, train on) it."""

    prompt: str
    """Prompt text as the model sees it (chat messages rendered)."""
    ground_truth: str
    """gsm8k-style ground truth (the number after ####)."""
    data_source: str
    """verl's data_source (validation metrics are keyed by it)."""
    response: str | None = None
    """Offline mode: the pre-collected response."""
    reward: float | None = None
    """Offline mode: a stored score (None: score with the rule)."""


def solve(a: int, op: str, b: int) -> int:
    """The answer of ``a op b``."""
    return a + b if op == "+" else a - b


def question(a: int, op: str, b: int) -> str:
    """The user message of a problem (short: the model is char-level)."""
    return f"{a}{op}{b}=?"


def solution(a: int, op: str, b: int) -> str:
    """The reference response in GSM8K's ``#### N`` form."""
    return f"#### {solve(a, op, b)}"


def synthetic_rows(n_train: int, n_val: int, max_operand: int = 9, seed: int = 0,
                   heldout: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Deterministic verl-format rows over the finite problem space ``a op b``, a, b in 0..max_operand.

    By default validation is a fixed sample of the same space the training rows cycle
    through (a tiny model cannot generalise arithmetic to unseen pairs in minutes, and
    the product is about optimisation stability, not generalisation); ``heldout=True``
    keeps validation problems out of training instead.
    """
    problems = [(a, op, b) for a in range(max_operand + 1) for op in OPS for b in range(max_operand + 1)]
    random.Random(seed).shuffle(problems)
    if heldout:
        if n_val >= len(problems):
            raise ValueError(f"data.val_size={n_val} leaves no training problems out of {len(problems)}")
        val, train_pool = problems[:n_val], problems[n_val:]
    else:
        train_pool = problems
        val = random.Random(seed + 1).sample(problems, min(n_val, len(problems)))
    train = [train_pool[i % len(train_pool)] for i in range(n_train)]

    def row(split: str, i: int, p: tuple[int, str, int]) -> dict[str, Any]:
        a, op, b = p
        return {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question(a, op, b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(solve(a, op, b))},
            "extra_info": {"split": split, "index": i, "question": question(a, op, b),
                           "answer": solution(a, op, b)},
        }

    return {"train": [row("train", i, p) for i, p in enumerate(train)],
            "val": [row("test", i, p) for i, p in enumerate(val)]}


def write_parquet(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as parquet (atomically: temp file + rename)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pd.DataFrame(list(rows)).to_parquet(tmp, index=False)
    tmp.replace(path)
    return path


def write_synthetic(out_dir: str | Path, n_train: int, n_val: int, max_operand: int = 9,
                    seed: int = 0, heldout: bool = False) -> tuple[Path, Path]:
    """Write train.parquet and test.parquet of the synthetic task (skipped when already there)."""
    out = Path(out_dir)
    train, val = out / "train.parquet", out / "test.parquet"
    if not (train.exists() and val.exists()):
        rows = synthetic_rows(n_train, n_val, max_operand, seed, heldout)
        write_parquet(rows["train"], train)
        write_parquet(rows["val"], val)
    return train, val


def render_prompt(prompt: Any) -> str:
    """Chat list (or a plain string) -> the text the model reads; ends with a newline before the answer."""
    if isinstance(prompt, str):
        return prompt + "\n"
    parts = []
    for msg in prompt:
        content = msg.get("content") if isinstance(msg, dict) else None
        if content is None:
            raise DataError(f"prompt message without content: {msg!r}")
        parts.append(str(content))
    return "\n".join(parts) + "\n"


def load_examples(path: str | Path, prompt_key: str = "prompt", response_key: str | None = None,
                  reward_key: str | None = None) -> list[Example]:
    """Read a verl-format parquet; ``response_key`` set: offline rows (the column is required)."""
    import pandas as pd

    path = Path(path)
    try:
        df = pd.read_parquet(path)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read parquet ({exc})") from exc
    for col in (prompt_key, "reward_model"):
        if col not in df.columns:
            raise DataError(f"{path}: missing column {col!r} (columns: {', '.join(df.columns)})")
    if response_key and response_key not in df.columns:
        raise DataError(f"{path}: offline mode needs column {response_key!r}")
    out = []
    for i, row in enumerate(df.to_dict("records")):
        rm = row["reward_model"]
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise DataError(f"{path}: row {i}: reward_model has no ground_truth")
        reward = None
        if response_key and reward_key and reward_key in row and row[reward_key] is not None:
            value = float(row[reward_key])
            reward = None if math.isnan(value) else value
        out.append(Example(
            prompt=render_prompt(row[prompt_key] if not hasattr(row[prompt_key], "tolist")
                                 else row[prompt_key].tolist()),
            ground_truth=str(rm["ground_truth"]),
            data_source=str(row.get("data_source") or "unknown"),
            response=str(row[response_key]) if response_key else None,
            reward=reward,
        ))
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def score(response: str, ground_truth: str) -> float:
    """verl's gsm8k rule score (1.0 for the right ``#### N``, else 0.0)."""
    from verl.utils.reward_score.gsm8k import compute_score

    return float(compute_score(response, ground_truth))


def offline_rows(n: int, p_correct: float = 0.5, max_operand: int = 9, seed: int = 0,
                 with_reward: bool = True) -> list[dict[str, Any]]:
    """Pre-collected prompt/response pairs (a fraction right, the rest off by a little), for offline mode."""
    rng = random.Random(seed)
    base = synthetic_rows(n, 1, max_operand, seed)["train"]
    rows = []
    for r in base:
        truth = int(r["reward_model"]["ground_truth"])
        ok = rng.random() < p_correct
        answer = truth if ok else truth + rng.choice([-2, -1, 1, 2])
        row = dict(r, response=f"#### {answer}")
        if with_reward:
            row["reward"] = 1.0 if ok else 0.0
        rows.append(row)
    return rows


class BatchSampler:
    """Deterministic data order: a seeded permutation per epoch; state is (epoch, position).

    Checkpointing the two integers and the seed reproduces the order exactly, and
    ``skip(n)`` moves past batches (rollback with skip_batches).
    """

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        if n < batch_size:
            raise ValueError(f"dataset of {n} rows is smaller than data.train_batch_size={batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.position = 0, 0
        self._perm: list[int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Whole batches per epoch (the tail is dropped, like verl's drop_last)."""
        return self.n // self.batch_size

    def _permutation(self) -> list[int]:
        if self._perm is None:
            idx = list(range(self.n))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(idx)
            self._perm = idx
        return self._perm

    def next(self) -> tuple[int, list[int]]:
        """(epoch of the batch, row indices) and advance."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        start = self.position * self.batch_size
        batch = self._permutation()[start:start + self.batch_size]
        epoch = self.epoch
        self.position += 1
        return epoch, batch

    def skip(self, n_batches: int) -> None:
        """Advance past ``n_batches`` batches without using them."""
        for _ in range(max(0, n_batches)):
            self.next()

    def state_dict(self) -> dict[str, int]:
        """Checkpointable state."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (epoch, position); a different dataset size or batch size keeps position by epoch."""
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["position"]), None
        if int(state.get("n", self.n)) != self.n or int(state.get("batch_size", self.batch_size)) != self.batch_size:
            log.warning("data sampler state from a different dataset/batch size; keeping its epoch and position")
            self.position = min(self.position, self.steps_per_epoch)
