"""The PPO update must not depend on the micro-batch size (gradient accumulation is exact)."""

from __future__ import annotations

import copy

import pytest
import torch

from ppo_watchdog.trainer import ppo
from ppo_watchdog.trainer.config import ActorConfig, CriticConfig
from ppo_watchdog.trainer.model import CharTokenizer, Critic, build_policy

torch.set_num_threads(1)

BATCH, MINI = 8, 4


def _setup() -> tuple[torch.nn.Module, Critic, ppo.Rollout]:
    """A tiny float64 policy/critic and one real rollout with uneven response lengths."""
    tok = CharTokenizer()
    policy = build_policy(tok.vocab_size, n_positions=32, n_layer=1, n_embd=16, n_head=2, seed=0).double()
    ref = copy.deepcopy(policy)
    with torch.no_grad():  # a reference that differs from the policy so the KL terms are non-zero
        for p in ref.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    critic = Critic(policy).double()
    with torch.no_grad():
        critic.value_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    prompts = [f"{a}+{b}=?\n" for a, b in zip(range(BATCH), range(3, 3 + BATCH), strict=True)]
    p_ids, p_mask = ppo.encode_prompts(tok, prompts, 16)
    responses = ppo.generate(policy, p_ids, p_mask, 6, tok.eos_id, tok.pad_id,
                             generator=torch.Generator().manual_seed(3))
    # force uneven lengths so token-mean weighting across micro batches matters
    responses[0, 1] = tok.eos_id
    responses[0, 2:] = tok.pad_id
    scores = torch.tensor([float(i % 3 == 0) for i in range(BATCH)], dtype=torch.float64)
    ro = ppo.assemble(tok, p_ids, p_mask, responses, scores, [""] * BATCH)
    ro.response_mask = ro.response_mask.double()
    ro.old_log_prob = ppo.log_probs(policy, ro, BATCH)
    ro.ref_log_prob = ppo.log_probs(ref, ro, BATCH)
    ro.values = ppo.values_of(critic, ro, BATCH)
    ppo.apply_kl_penalty(ro, type("K", (), {"value": 0.1, "update": lambda *a, **k: None})(), "kl", True)
    ppo.compute_advantages(ro, 1.0, 0.95)
    return policy, critic, ro


def _actor_after(micro: int, policy: torch.nn.Module, ro: ppo.Rollout, agg: str) -> tuple[list[torch.Tensor], dict]:
    model = copy.deepcopy(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = ActorConfig(ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=micro, ppo_epochs=2,
                      entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, loss_agg_mode=agg)
    res = ppo.update_actor(model, opt, ro, cfg)
    return [p.detach().clone() for p in model.parameters()], res.metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_actor_update_gives_the_same_parameters_for_micro_batch_1_2_and_full(agg: str) -> None:
    policy, _, ro = _setup()
    before = [p.detach().clone() for p in policy.parameters()]
    ref_params, ref_metrics = _actor_after(MINI, policy, ro, agg)
    assert any(not torch.equal(a, b) for a, b in zip(before, ref_params, strict=True)), "the update must change something"
    for micro in (1, 2):
        params, metrics = _actor_after(micro, policy, ro, agg)
        for a, b in zip(ref_params, params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
            # clipfrac and ppo_kl are float32 means inside verl; the losses are float64 here
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6, abs=1e-9), key


def test_critic_update_gives_the_same_parameters_for_micro_batch_1_and_full() -> None:
    _, critic, ro = _setup()
    out = []
    for micro in (MINI, 1):
        model = copy.deepcopy(critic)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        res = ppo.update_critic(model, opt, ro, CriticConfig(ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=micro,
                                                             cliprange_value=0.2))
        out.append(([p.detach().clone() for p in model.parameters()], res.metrics))
    for a, b in zip(out[0][0], out[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert out[0][1]["critic/vf_loss"] == pytest.approx(out[1][1]["critic/vf_loss"], rel=1e-9)
    assert out[0][1]["critic/vf_loss"] > 0


def test_a_non_finite_loss_skips_the_optimizer_step_and_says_why() -> None:
    policy, _, ro = _setup()
    model = copy.deepcopy(policy)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    res = ppo.update_actor(model, opt, ro, ActorConfig(ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2),
                           poison=True)
    assert len(res.skipped) == BATCH // MINI and all("nan" in s for s in res.skipped)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_micro_batch_hook_sees_every_micro_batch_and_can_raise_a_real_oom() -> None:
    from ppo_watchdog.trainer.faults import MemoryBudget

    policy, critic, ro = _setup()
    seen: list[tuple[int, str]] = []
    cfg = ActorConfig(ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2)
    ppo.update_actor(copy.deepcopy(policy), torch.optim.SGD(policy.parameters(), lr=0.0), ro, cfg,
                     before_micro=lambda n, what: seen.append((n, what)))
    assert len(seen) == BATCH // 2 and {w for _, w in seen} == {"actor"}
    assert sum(n for n, _ in seen) == int(ro.attention_mask.sum())
    budget = MemoryBudget(max(n for n, _ in seen) - 1)
    with pytest.raises(torch.OutOfMemoryError):
        ppo.update_actor(copy.deepcopy(policy), torch.optim.SGD(policy.parameters(), lr=0.0), ro, cfg,
                         before_micro=budget.check)
