"""Synthetic fault injection: labelled logs for the failure classes the recorded corpora lack.

    .venv/bin/python bench/make_injected.py      # writes bench/corpus_injected/, deterministic

Each log is one of the embedded trainer's real healthy or failed runs of ``bench/corpus`` (its
metrics.jsonl, verl's FileLogger format), with the metrics of a fault written over it from a
step on: numbers a verl 0.9 run logs under that fault (``response/aborted_ratio`` of aborted
rollouts, ``response_length/clip_ratio`` of cut answers, a gradient norm growing before a
collapse ...). They are SYNTHETIC: they test that the rules read the signs right and act the
right way, not that the signs look exactly so on a real engine. Labels: ``labels.yaml``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "bench" / "corpus"
OUT = ROOT / "bench" / "corpus_injected"

Row = dict[str, Any]


def _load(run: str) -> list[Row]:
    rows = [json.loads(line) for line in (SRC / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] >= 1 and "critic/score/mean" in r["data"]]


def _write(name: str, rows: list[Row]) -> None:
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    with (d / "metrics.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({"step": r["step"], "data": r["data"]}, sort_keys=True) + "\n")


def _with_timing(rows: list[Row]) -> list[Row]:
    """A healthy verl 0.9 run logs no aborted rollouts and a steady rollout time: add both."""
    for r in rows:
        r["data"].setdefault("response/aborted_ratio", 0.0)
        r["data"].setdefault("timing_s/gen", round(12.0 + 0.5 * math.sin(r["step"]), 3))
    return rows


def _with_batch(rows: list[Row]) -> list[Row]:
    """A verl 0.9 GRPO step's batch: 16 sequences (4 prompts x 4 answers) of 24 prompt and 8 response tokens
    on average (what verl logs as prompt_length/mean, response_length/mean and perf/total_num_tokens)."""
    for r in rows:
        r["data"].update({"prompt_length/mean": 24.0, "response_length/mean": 8.0, "perf/total_num_tokens": 16 * 32.0})
    return rows


def _from(rows: list[Row], step: int, change: Callable[[int, dict[str, Any]], None]) -> list[Row]:
    for r in rows:
        if r["step"] >= step:
            change(r["step"], r["data"])
    return rows


def rollout_failure(s: int, d: dict[str, Any]) -> None:
    """The rollout engine crashed at step 40: 60% of the rollouts come back empty, fast."""
    d["response/aborted_ratio"] = 0.6
    d["timing_s/gen"] = 2.0
    d["response_length/min"] = 0.0
    d["critic/score/mean"] *= 0.4   # (a trainer that scores aborted rollouts as 0)
    d["critic/score/min"] = 0.0


def groups_dropped(s: int, d: dict[str, Any]) -> None:
    """From step 40 the rollout engine returns one request in 16 empty, and verl 0.9.1 drops the whole prompt
    group of each (its agent loop fails on the empty response): 12 sequences a step, none logged as aborted."""
    d["perf/total_num_tokens"] = 12 * 32.0


def rollout_blip(s: int, d: dict[str, Any]) -> None:
    """One step with 20% aborted (a tool server restarted): no restart is needed."""
    if s == 50:
        d["response/aborted_ratio"] = 0.2


def dead_after_learning(s: int, d: dict[str, Any]) -> None:
    """The run learned for 30 steps, then died: one score (0) for every response, zero gradient."""
    d["critic/score/mean"] = d["critic/score/max"] = d["critic/score/min"] = 0.0
    d["actor/grad_norm"] = 0.0
    d["actor/pg_loss"] = 0.0
    d["critic/advantages/mean"] = 0.0


def dead_from_start(s: int, d: dict[str, Any]) -> None:
    """A broken reward function from step 1: every response scores 0, nothing to learn."""
    dead_after_learning(s, d)


def truncation(s: int, d: dict[str, Any]) -> None:
    """Answers grow into the cap from step 30: the cut share climbs from its usual ~0.4 to ~0.95."""
    d["response_length/clip_ratio"] = min(0.95, 0.45 + 0.05 * (s - 29))


def grad_growth(s: int, d: dict[str, Any]) -> None:
    """The gradient norm compounds x1.2 a step from step 30; at step 50 the policy collapses."""
    d["actor/grad_norm"] = d["actor/grad_norm"] * 1.2 ** (s - 29)
    if s >= 50:
        d["actor/reward_kl_penalty"] = 0.5 + 0.3 * (s - 50)
        d["critic/score/mean"] = 0.0
        d["critic/score/max"] = 0.0
        d["actor/entropy"] = d["actor/entropy"] * 3.0


def mismatch(s: int, d: dict[str, Any]) -> None:
    """The rollout engine drifts from the trainer (a precision bug) from step 30: the probability
    difference grows x1.15 a step from 0.001; at step 50 the policy collapses as in grad_growth."""
    d["training/rollout_probs_diff_mean"] = 0.001 * 1.15 ** (s - 29)
    if s >= 50:
        d["actor/reward_kl_penalty"] = 0.5 + 0.3 * (s - 50)
        d["critic/score/mean"] = 0.0
        d["critic/score/max"] = 0.0
        d["actor/entropy"] = d["actor/entropy"] * 3.0


def main() -> None:
    runs = {
        "infra_rollout_failure_at_40": _from(_with_timing(_load("default_seed1")), 40, rollout_failure),
        "infra_groups_dropped_from_40": _from(_with_batch(_with_timing(_load("default_seed3"))), 40, groups_dropped),
        "infra_rollout_blip_healthy": _from(_with_timing(_load("default_seed2")), 50, rollout_blip),
        "dead_after_learning_at_30": _from(_load("default_seed2"), 30, dead_after_learning),
        "dead_from_start": _from(_load("default_seed3"), 1, dead_from_start),
        "truncation_from_30": _from(_load("default_seed3"), 30, truncation),
        "grad_growth_then_collapse_at_50": _from(_load("default_seed1"), 30, grad_growth),
        "mismatch_rising_then_collapse_at_50": _from(_load("default_seed2"), 30, mismatch),
        # The watchdog starts watching a run that collapsed long before (lr 20x from step 1): the
        # first step it sees is 30, with no healthy step to judge against.
        "broken_before_watching": [r for r in _load("lr_20x_collapse") if r["step"] >= 30],
    }
    for name, rows in runs.items():
        _write(name, rows)
        print(f"{name}: {len(rows)} steps")


if __name__ == "__main__":
    main()
