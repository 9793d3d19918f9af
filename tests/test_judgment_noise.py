"""The default pack's evidence against the run's own noise, its word to a human before a remedy for a drift,
and the two failures it used to miss (a run collapsed before the first look, a long stretch at the length cap).

Each run here is drawn with a seeded generator in verl's metric keys and replayed through the default pack;
each test states the regime in numbers and what a PPO engineer expects the watchdog to do with it.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ppo_watchdog.core.replay import replay
from ppo_watchdog.core.rulefile import default_rules_paths, load_rules

IRREVERSIBLE = {"rollback", "relaunch", "restart", "pause", "stop"}


@pytest.fixture(scope="module")
def pack() -> Any:
    return load_rules(default_rules_paths())


def _acts(result: Any) -> list[tuple[int, str, str]]:
    return [(d.step, d.rule, p.kind) for d in result.decisions for p in d.planned if p.kind in IRREVERSIBLE]


def _fires(result: Any, rule: str) -> list[int]:
    return [d.step for d in result.decisions if d.rule == rule and d.kind == "fire"]


def _record(step: int, score: float, kl: float, entropy: float, length: float, grad_norm: float, *,
            top: float) -> dict[str, Any]:
    """One step in verl's keys: the batch's scores lie in [0, ``top``]."""
    return {"step": step, "data": {
        "critic/score/mean": score, "critic/score/max": top, "critic/score/min": 0.0, "actor/kl_loss": kl,
        "actor/entropy": entropy, "response_length/mean": length, "actor/grad_norm": grad_norm,
    }}


def small_batch_run(seed: int, *, steps: int = 120, kl_jump_at: int | None = None,
                    reward_at_jump: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """A GRPO run of 2 prompts x 4 answers a step: a score of 0-1 that swings with sd 0.15 around 0.5,
    a KL loss that grows smoothly from 0.04 to 0.08, and from ``kl_jump_at`` on a KL that doubled to a new
    high, with the scores of the jump step and the one after it set to ``reward_at_jump``."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        kl = 0.04 + 0.04 * step / steps + rng.gauss(0, 0.003)
        score = min(1.0, max(0.0, rng.gauss(0.5, 0.15)))
        if kl_jump_at is not None and step >= kl_jump_at:
            kl = 0.2 + 0.01 * (step - kl_jump_at)
        if reward_at_jump is not None and kl_jump_at is not None and step in (kl_jump_at, kl_jump_at + 1):
            score = reward_at_jump[step - kl_jump_at]
        records.append(_record(step, score, kl, 0.4 + rng.gauss(0, 0.01), 200 + rng.gauss(0, 5),
                               0.3 + rng.gauss(0, 0.03), top=1.0))
    return records


def test_a_kl_rise_confirmed_only_by_a_dip_within_the_runs_noise_is_not_rolled_back(pack: Any) -> None:
    # Late in a healthy run, the KL doubles to a new high and holds there, and the two scores of that moment
    # are below every one of the five before them, less than one standard deviation of the run's own
    # step-to-step swing (0.15) under their median: two noisy batches, not damage.
    rows = small_batch_run(3, kl_jump_at=100)
    five_before = [r["data"]["critic/score/mean"] for r in rows[94:99]]
    dip = (min(five_before) - 0.02, min(five_before) - 0.04)
    result = replay(small_batch_run(3, kl_jump_at=100, reward_at_jump=dip), pack)
    assert max(dip) < min(five_before)  # the old count-based confirmation holds ...
    assert [a for a in _acts(result) if a[1] == "kl_explosion"] == []  # ... and is no longer evidence


def test_the_same_kl_rise_with_a_fall_far_beyond_the_noise_is_rolled_back(pack: Any) -> None:
    result = replay(small_batch_run(3, kl_jump_at=100, reward_at_jump=(0.0, 0.0)), pack)
    assert (101, "kl_explosion", "rollback") in _acts(result)


def one_prompt_run(*, spike_scores: tuple[float, float]) -> list[dict[str, Any]]:
    """A GRPO run of ONE prompt x 4 answers a step on a 1-2 reward (sd of a step's score ~0.22 around
    1.75), a KL loss of ~0.03 with a few-answer swing, and at step 100 one batch whose 4 answers are
    empty: its KL estimate leaps to 5.9 nat; the next batch's is still 0.69, then back to 0.03. The
    scores of steps 100 and 101 are ``spike_scores``."""
    rng = random.Random(4)
    records = []
    for step in range(1, 141):
        kl = max(0.0, 0.03 + rng.gauss(0, 0.01))
        score = sum(1.0 + (rng.random() < 0.75) for _ in range(4)) / 4
        if step in (100, 101):
            kl = (5.9, 0.69)[step - 100]
            score = spike_scores[step - 100]
        records.append(_record(step, score, kl, 0.5 + rng.gauss(0, 0.02), 2.5 + rng.gauss(0, 0.2), 10 + rng.gauss(0, 2),
                               top=2.0))
    return records


def test_one_batch_that_carries_both_the_kl_leap_and_the_score_fall_is_not_rolled_back(pack: Any) -> None:
    # With one prompt a step, the KL estimate and the score of a step come from the same 4 answers: the
    # batch of empty answers that scores 0 is the batch whose KL leaps. The next batch scores as usual
    # (1.5): the fall is one batch's, not a second, independent sign. The mean of the two scores, 0.75,
    # is 4 standard deviations under the median; each score on its own is not.
    assert _acts(replay(one_prompt_run(spike_scores=(0.0, 1.5)), pack)) == []


def test_the_same_kl_leap_with_both_batches_scoring_zero_is_rolled_back(pack: Any) -> None:
    assert (101, "kl_explosion", "rollback") in _acts(replay(one_prompt_run(spike_scores=(0.0, 0.0)), pack))


def test_a_relaunch_from_the_start_is_not_judged_by_the_entropy_of_the_branch_it_abandoned(pack: Any) -> None:
    # TRL GRPO at lr 1e-2 (bench/trl_stability.py, lr_high seed 2): the first launch collapsed to an entropy of
    # 0.03 and was rolled back to the initial weights; the relaunch at a sane lr trains as a healthy run does
    # (its own numbers below). Its entropy is 20x the collapsed branch's lowest, and its small batch's scores dip
    # below their median now and then: judged against a policy that no longer exists, it was "blowing up", and
    # the budget of rollbacks ran out on a healthy run.
    collapsed = [{"step": step, "data": {
        "critic/score/mean": 1.5 if step == 1 else 0.0, "critic/score/max": 2.0 if step == 1 else 0.0,
        "critic/score/min": 1.0 if step == 1 else 0.0, "actor/entropy": 0.6 if step == 1 else 0.03,
        "actor/kl_loss": 0.0 if step == 1 else 7.0, "response_length/mean": 3.0 if step == 1 else 16.0,
    }} for step in range(1, 4)]
    scores = (1.5, 1.5, 1.375, 1.25, 1.375, 1.325, 1.75, 1.333, 1.375, 1.5)
    entropy = (0.622, 0.535, 0.586, 0.67, 0.653, 0.713, 0.467, 0.555, 0.609, 0.576)
    kls = (0.0, 0.001, 0.005, 0.007, 0.003, 0.003, 0.01, 0.003, 0.001, 0.008)
    relaunch = [{"step": i + 1, "data": {
        "critic/score/mean": scores[i], "critic/score/max": 2.0, "critic/score/min": 1.0, "actor/entropy": entropy[i],
        "actor/kl_loss": kls[i], "response_length/mean": 2.5,
    }} for i in range(10)]
    result = replay(collapsed + relaunch, pack)  # (the collapsed branch's own decisions leave with it)
    assert _fires(result, "early_entropy_blowup") == [] and _acts(result) == []


def kl_runaway_run(*, steps: int = 300, start: int = 100, gain: float = 0.0) -> list[dict[str, Any]]:
    """A KL that grows 2% a step from ``start`` (0.04 -> ~2 nat by step 300) while the score holds at 0.6
    (sd 0.05), rising by ``gain`` over the run. Entropy and length do not move: no sign of damage."""
    rng = random.Random(7)
    records = []
    for step in range(1, steps + 1):
        kl = 0.04 * (1.02 ** max(0, step - start)) + rng.gauss(0, 0.002)
        records.append({"step": step, "data": {
            "critic/score/mean": 0.6 + gain * step / steps + rng.gauss(0, 0.05), "critic/score/max": 1.0,
            "critic/score/min": 0.0, "actor/kl_loss": kl, "actor/entropy": 0.4 + rng.gauss(0, 0.01),
            "response_length/mean": 200 + rng.gauss(0, 5), "actor/grad_norm": 0.3 + rng.gauss(0, 0.03),
        }})
    return records


def test_a_kl_runaway_with_no_gain_in_the_score_tells_a_human_at_once_and_rolls_nothing_back(pack: Any) -> None:
    result = replay(kl_runaway_run(), pack)
    told = _fires(result, "kl_runaway")
    assert told, [(d.step, d.rule) for d in result.decisions]
    # Told within 100 steps of the start of the climb (the KL is 7x its level by then), before any remedy.
    assert told[0] <= 200
    assert _acts(result) == []
    decision = next(d for d in result.decisions if d.rule == "kl_runaway")
    assert decision.inputs["min(kl, 3)"] > 0.2  # the numbers it fired on travel with it


def test_a_kl_that_grows_while_the_score_rises_is_learning_and_stays_quiet(pack: Any) -> None:
    result = replay(kl_runaway_run(gain=0.6), pack)
    assert _fires(result, "kl_runaway") == []


def test_a_run_collapsed_before_the_first_look_is_told_to_a_human(pack: Any) -> None:
    # The watchdog's first record: KL 3.2 nat from the reference and an entropy of 0.004 nat a token: the
    # policy answers one way, far from where it started; nothing healthy to compare with or go back to.
    rng = random.Random(1)
    rows = [{"step": step, "data": {
        "critic/score/mean": 0.05 + rng.gauss(0, 0.01), "critic/score/max": 0.4, "critic/score/min": 0.0,
        "actor/kl_loss": 3.2 + rng.gauss(0, 0.1), "actor/entropy": 0.004, "response_length/mean": 40.0,
        "actor/grad_norm": 0.2,
    }} for step in range(60, 90)]
    result = replay(rows, pack)
    assert _fires(result, "never_healthy")[:1] == [62]  # its third record
    assert _acts(result) == []  # an alert only: no state of this run is known to be good


def test_a_long_stretch_at_the_length_cap_with_a_dip_under_half_still_alerts(pack: Any) -> None:
    # Half to nine tenths of the answers cut at the cap for 60 steps, one step in five at 0.45: the
    # stretch is saturated although no 10 steps in a row are all at half or more.
    rng = random.Random(2)
    rows = [{"step": step, "data": {
        "critic/score/mean": 0.4 + rng.gauss(0, 0.05), "critic/score/max": 1.0, "critic/score/min": 0.0,
        "response_length/mean": 900.0, "response_length/max": 1024.0,
        "response_length/clip_ratio": 0.45 if step % 5 == 0 or step <= 20 and step % 3 == 0 else 0.6 + 0.3 * rng.random(),
        "actor/entropy": 0.4, "actor/grad_norm": 0.3,
    }} for step in range(1, 80)]
    result = replay(rows, pack)
    assert _fires(result, "truncation"), [(d.step, d.rule) for d in result.decisions]
