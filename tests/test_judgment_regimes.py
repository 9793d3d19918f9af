"""The default pack on the regimes real GRPO runs bring: no KL term, small groups, sparse logging.

A healthy GRPO run with ``beta`` 0 (TRL's default) and 4 completions of each of 2 prompts a step, at
90% accuracy, has a batch in which every group scored alike (all right) on most steps: its advantages,
loss and gradient are then exactly zero. Logged every 10 steps (transformers' ``logging_steps``
default), each record holds the window's mean score and the gradient norm of its last step only.
The runs here are drawn from that model with a seeded generator, the way TRL's callback writes them
(``ppo_watchdog.protocol.catalog.trl_metrics`` keys), and replayed through the default pack.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import pytest

from ppo_watchdog.core.engine import EngineState, evaluate
from ppo_watchdog.core.replay import replay
from ppo_watchdog.core.rulefile import RuleSet, default_rules_paths, load_rules, parse_rules
from ppo_watchdog.core.series import Window

#: What a person has to agree to: the actions that cost the run its progress or its process.
IRREVERSIBLE = {"rollback", "relaunch", "restart", "pause", "stop"}


def grpo_run(seed: int, *, every: int, steps: int = 300, prompts: int = 2, group: int = 4,
             accuracy: float = 0.9, dies_at: int | None = None) -> list[dict[str, Any]]:
    """A GRPO run with no KL term, logged every ``every`` steps as TRL logs it.

    Each prompt has its own difficulty (a Beta draw with mean ``accuracy``: most easy, some hard);
    a group's completions are right with that probability. From ``dies_at`` on, every answer is
    wrong (the policy collapsed onto a wrong answer), its entropy a fortieth of what it was.
    """
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    window: list[dict[str, float]] = []
    grad = 0.0
    for step in range(1, steps + 1):
        dead = dies_at is not None and step >= dies_at
        scores: list[float] = []
        uniform = 0
        for _ in range(prompts):
            p = 0.0 if dead else rng.betavariate(accuracy * 2, (1 - accuracy) * 2)
            g = [1.0 if rng.random() < p else 0.0 for _ in range(group)]
            uniform += len(set(g)) == 1
            scores += g
        zero_std = uniform / prompts
        grad = 0.0 if zero_std == 1.0 else abs(rng.gauss(0.25, 0.08))  # beta 0: no KL gradient either
        entropy = 0.35 * math.exp(-step / 600) + rng.gauss(0, 0.02)
        window.append({
            "critic/score/mean": statistics.fmean(scores), "critic/score/std": statistics.pstdev(scores),
            "actor/entropy": entropy / 40 if dead else max(0.05, entropy),
            "response_length/mean": max(20.0, 180 + rng.gauss(0, 15)), "response_length/clip_ratio": 0.0,
            "trl/frac_reward_zero_std": zero_std, "actor/lr": 1e-6,
        })
        if step % every == 0:
            data = {k: statistics.fmean(w[k] for w in window) for k in window[0]}
            data["actor/grad_norm"] = grad  # transformers logs the last optimizer step's norm, not a mean
            records.append({"step": step, "data": data})
            window = []
    return records


@pytest.fixture(scope="module")
def pack() -> Any:
    return load_rules(default_rules_paths())


def _acts(result: Any) -> list[tuple[int, str, str]]:
    return [(d.step, d.rule, p.kind) for d in result.decisions for p in d.planned if p.kind in IRREVERSIBLE]


@pytest.mark.parametrize("every", [1, 5, 10])
def test_a_healthy_grpo_run_whose_groups_often_all_score_alike_is_never_rolled_back(pack: Any, every: int) -> None:
    for seed in range(20):
        result = replay(grpo_run(seed, every=every), pack)
        assert _acts(result) == [], f"seed {seed}, logged every {every} steps"


@pytest.mark.parametrize("every", [1, 5, 10])
def test_a_healthy_grpo_run_that_solves_its_batches_is_not_called_dead(pack: Any, every: int) -> None:
    for seed in range(20):
        result = replay(grpo_run(seed, every=every), pack)
        assert [d.step for d in result.decisions if d.rule == "dead_run"] == [], f"seed {seed}, every {every}"


# Windows and ``for`` count records at the run's cadence (``Window.cadence``): the same evidence, so the
# same catch, whether the run logs every step or every 20.
@pytest.mark.parametrize("every", [1, 5, 10, 20])
def test_a_grpo_run_that_dies_after_learning_is_rolled_back(pack: Any, every: int) -> None:
    for seed in range(5):
        result = replay(grpo_run(seed, every=every, dies_at=150, steps=400), pack)
        first = (_acts(result) or [(0, "", "")])[0]
        assert first[2] == "rollback" and first[1] in {"dead_after_learning", "reward_collapse"}, (seed, every, first)
        # No earlier than the death, and within 8 records of it (dead_after_learning's 5 and the record
        # that straddles the death).
        assert 150 <= first[0] <= 150 + every * 8, (seed, every, first)


FOR_5 = """
version: 1
rules:
  - name: low
    description: the score below 0 for 5 steps
    expr: reward < 0
    for: 5
    actions: [notify]
"""


@pytest.mark.parametrize(("every", "fires_at"), [(1, 5), (2, 10), (10, 50), (20, 100)])
def test_for_counts_records_at_the_logging_cadence(every: int, fires_at: int) -> None:
    parsed, errors = parse_rules(FOR_5, "for5.yaml")
    assert errors == []
    rules = RuleSet(tuple(parsed))
    w, st, fired = Window(1000), EngineState(), []
    for step in range(every, 400, every):
        w.append(step, {"reward": -1.0})
        out, st = evaluate(rules, w, st, step)
        fired += [d.step for d in out]
    # for: 5 is 5 records: 5 steps of a run that logs every step, 100 of one that logs every 20.
    assert fired[:1] == [fires_at]


def test_for_needs_three_records_in_a_row_where_the_spacing_is_irregular() -> None:
    parsed, _ = parse_rules(FOR_5, "for5.yaml")
    rules = RuleSet(tuple(parsed))
    w, st, fired = Window(1000), EngineState(), []
    # A run at cadence 1 that skipped 4 lines: 5 steps of evidence, on two records only.
    for step in [*range(1, 20), 24, 25, 26]:
        w.append(step, {"reward": -1.0 if step >= 19 else 1.0})
        out, st = evaluate(rules, w, st, step)
        fired += [d.step for d in out]
    assert w.cadence == 1 and fired == [25], fired  # 19 and 24 span 6 steps; the third look is 25
