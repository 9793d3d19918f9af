"""PPO math: verl's GAE against a plain loop, the KL penalty, masks, and verl config traps."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from verl.trainer.ppo import core_algos

from ppo_watchdog.trainer import ppo
from ppo_watchdog.trainer.config import ActorConfig, AlgorithmConfig
from ppo_watchdog.trainer.loop import _smaller_micro

torch.set_num_threads(1)


def gae_plain(rewards: list[float], values: list[float], n_valid: int, gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Textbook GAE for one sequence, one token at a time (terminal value 0 after the last valid token)."""
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(n_valid)):
        next_v = values[t + 1] if t + 1 < n_valid else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    returns = [a + v for a, v in zip(adv, values, strict=True)]
    return adv, returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_verl_gae_matches_a_plain_per_token_loop(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(0)
    batch, length = 5, 7
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    lengths = [7, 3, 1, 5, 6]
    mask = torch.zeros(batch, length, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rewards, values = rewards * mask, values * mask
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    raw_adv = torch.zeros_like(rewards)
    for i, n in enumerate(lengths):
        a, r = gae_plain(rewards[i].tolist(), values[i].tolist(), n, gamma, lam)
        raw_adv[i] = torch.tensor(a, dtype=torch.float64)
        # returns are not whitened: they must match the loop exactly on valid tokens
        assert ret[i, :n].tolist() == pytest.approx(r[:n], rel=1e-12, abs=1e-12)
    # advantages come back whitened over the valid tokens
    valid = raw_adv[mask.bool()]
    whitened = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    assert adv[mask.bool()].tolist() == pytest.approx(whitened.tolist(), rel=1e-6, abs=1e-6)


def _rollout(scores: list[float], lengths: list[int], length: int = 4) -> ppo.Rollout:
    mask = torch.zeros(len(scores), length)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ro = ppo.Rollout(input_ids=torch.zeros(len(scores), length, dtype=torch.long),
                     attention_mask=mask.long(), responses=torch.zeros(len(scores), length, dtype=torch.long),
                     response_mask=mask, scores=torch.tensor(scores))
    return ro


def test_score_lands_on_the_last_valid_token() -> None:
    ro = _rollout([1.0, 0.5], [2, 4])
    tls = ppo.token_level_scores(ro.scores, ro.response_mask)
    assert tls.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]]


def test_kl_penalty_subtracts_beta_times_kl_per_token_and_reports_the_sequence_mean() -> None:
    ro = _rollout([1.0, 0.0], [2, 4])
    ro.old_log_prob = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-0.5, -0.5, -0.5, -0.5]])
    ro.ref_log_prob = torch.tensor([[-1.2, -1.4, 0.0, 0.0], [-0.5, -0.7, -0.5, -0.9]])
    ctrl = core_algos.FixedKLController(kl_coef=0.5)
    m = ppo.apply_kl_penalty(ro, ctrl, "kl", use_kl_in_reward=True)
    kl = [[0.2, 0.4, 0.0, 0.0], [0.0, 0.2, 0.0, 0.4]]
    expected = [[-0.5 * kl[0][0], 1.0 - 0.5 * kl[0][1], 0.0, 0.0], [0.0, -0.1, 0.0, -0.2]]
    assert ro.token_level_rewards.tolist() == [pytest.approx(r, abs=1e-6) for r in expected]
    seq = [0.3, 0.15]  # per-sequence masked means
    assert m["actor/reward_kl_penalty"] == pytest.approx(sum(seq) / 2)
    assert "actor/reward_kl_penalty_std" not in m  # over steps, not sequences: ppo.StepStd
    assert m["actor/reward_kl_penalty_coeff"] == 0.5


def test_kl_std_is_the_population_std_of_the_step_means_over_the_last_n_steps() -> None:
    window = ppo.StepStd(3)
    assert window.push(0.04) == 0.0
    assert window.push(0.06) == pytest.approx(0.01)
    window.push(0.5)
    assert window.push(0.5) == pytest.approx(statistics.pstdev([0.06, 0.5, 0.5]))  # 0.04 has left the window
    saved = window.state()
    window.load([])
    assert window.push(0.5) == 0.0
    window.load(saved)
    assert window.push(0.06) == pytest.approx(statistics.pstdev([0.5, 0.5, 0.06]))


def test_adaptive_kl_controller_raises_its_value_when_kl_is_above_target() -> None:
    algo = AlgorithmConfig()
    algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon = "adaptive", 0.1, 0.01, 100
    ctrl = ppo.kl_controller(algo)
    ro = _rollout([0.0, 0.0], [4, 4])
    ro.old_log_prob = torch.zeros(2, 4)
    ro.ref_log_prob = torch.full((2, 4), -1.0)
    ppo.apply_kl_penalty(ro, ctrl, "kl", use_kl_in_reward=True)
    # proportional error clipped to 0.2, n_steps = batch size 2, horizon 100
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 100))


def test_response_mask_keeps_tokens_up_to_and_including_the_first_eos() -> None:
    eos = 1
    responses = torch.tensor([[5, 6, eos, 0, 0], [5, 6, 7, 8, 9], [eos, 0, 0, 0, 0]])
    assert ppo.response_mask_of(responses, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_setting_clip_ratio_alone_moves_verl_low_and_high_bounds_too() -> None:
    cfg = ActorConfig(clip_ratio=0.05)
    v = ppo.verl_actor_config(cfg)
    assert (v.clip_ratio, v.clip_ratio_low, v.clip_ratio_high) == (0.05, 0.05, 0.05)
    cfg.clip_ratio_high = 0.28
    assert ppo.verl_actor_config(cfg).clip_ratio_high == 0.28


def test_clipped_policy_loss_from_verl_clips_large_ratios() -> None:
    cfg = ppo.verl_actor_config(ActorConfig(clip_ratio=0.2))
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(2.0), math.log(0.5)]])  # ratios 2 and 0.5
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, metrics = core_algos.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config=cfg)
    # token 1: min(2*1, 1.2*1) -> -1.2 ; token 2: max(-0.5*-1, -0.8*-1) ... -A*clip = 0.8
    assert float(loss) == pytest.approx((-1.2 + 0.8) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)


@pytest.mark.parametrize("micro,mini,expected", [(8, 8, 4), (4, 12, 2), (6, 12, 3), (3, 12, 1), (1, 8, None)])
def test_oom_shrinks_the_micro_batch_to_a_divisor_of_the_mini_batch(micro: int, mini: int, expected: int | None) -> None:
    assert _smaller_micro(micro, mini) == expected
