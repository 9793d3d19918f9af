"""An out-of-memory error ends a run with exit 75 after saving the last completed step.

``Trainer.save_after_oom`` (trainer/loop.py): a memory budget or an injected ``oom`` fault
saves the deep snapshot taken before the step; a real OOM without either saves the live
weights when no optimizer stepped yet, and nothing (the last periodic checkpoint stands)
when the weights are half-updated. The OOMs below are fault injection, named as such: a
forward hook raising ``torch.OutOfMemoryError`` where a CUDA allocator would, with no
budget configured, so the run takes the path of a real one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir
from ppo_watchdog.trainer.config import load_config
from ppo_watchdog.trainer.loop import Trainer, optimizer_steps


def _trainer(tiny_sft: Any, run: Path, *extra: str, steps: int = 4) -> Trainer:
    return Trainer(load_config([*tiny_sft.overrides(run, steps), *extra]), argv=["test"])


def _oom_in_update_at(trainer: Trainer, module: nn.Module, step: int) -> None:
    """Injected fault: ``module``'s first gradient-enabled forward at ``step`` raises a CUDA-style OOM."""

    def hook(mod: nn.Module, args: Any) -> None:
        if trainer.global_step == step and torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected in a test)")

    module.register_forward_pre_hook(hook)


def _metrics(run: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: r["data"] for r in rundir.read_jsonl(run / rundir.METRICS).records}


def _oom_checkpoints(run: Path) -> list[int]:
    return [e["step"] for e in rundir.iter_events(run, ["checkpoint"]) if e["reason"] == "oom"]


def test_a_real_oom_before_any_optimizer_step_saves_the_last_step_and_the_restart_matches_an_unbroken_run(
    tiny_sft: Any, tmp_path: Path
) -> None:
    whole = _trainer(tiny_sft, tmp_path / "whole")
    assert whole.run() == 0

    broken = _trainer(tiny_sft, tmp_path / "broken")
    _oom_in_update_at(broken, broken.critic, step=3)  # the critic updates first: no optimizer stepped
    assert broken.run() == rundir.EXIT_OOM == 75
    assert _oom_checkpoints(tmp_path / "broken") == [2]
    info = ckpt.latest_complete(tmp_path / "broken" / rundir.CHECKPOINTS)
    assert info is not None and info.step == 2

    # The restart redoes step 3 from the saved state: same batch, same samples, same update.
    again = _trainer(tiny_sft, tmp_path / "broken")
    assert again.run() == 0
    want, got = _metrics(tmp_path / "whole"), _metrics(tmp_path / "broken")
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/reward_kl_penalty", "actor/pg_loss", "critic/vf_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_a_real_oom_after_an_optimizer_step_saves_nothing_and_the_last_periodic_checkpoint_stands(
    tiny_sft: Any, tmp_path: Path
) -> None:
    t = _trainer(tiny_sft, tmp_path, "trainer.save_freq=2")
    _oom_in_update_at(t, t.policy, step=3)  # the actor updates after the critic has stepped
    assert t.run() == rundir.EXIT_OOM
    assert _oom_checkpoints(tmp_path) == []
    info = ckpt.latest_complete(tmp_path / rundir.CHECKPOINTS)
    assert info is not None and info.step == 2
    [oom] = rundir.iter_events(tmp_path, ["oom"])
    assert oom["step"] == 3 and oom["what"] == "actor" and oom["action"] == "exit"


def test_a_budget_oom_in_the_actor_saves_the_state_before_the_critic_stepped(
    tiny_sft: Any, tmp_path: Path, tiny_trainer_args: Callable[..., list[str]]
) -> None:
    # 8 prompts of >= 12 tokens never fit in 96 tokens; 4 prompts of <= 16 + 8 tokens always do:
    # the critic (micro 4) updates, then the actor (micro 8) runs out of the budget.
    t = _trainer(tiny_sft, tmp_path, "trainer.memory_budget_tokens=96", "critic.ppo_micro_batch_size_per_gpu=4",
                 steps=2)
    assert t.run() == rundir.EXIT_OOM
    [oom] = rundir.iter_events(tmp_path, ["oom"])
    assert oom["what"] == "actor" and oom["step"] == 1
    assert optimizer_steps(t.critic_opt) == 2  # the critic's two mini batches did step
    assert _oom_checkpoints(tmp_path) == [0]
    components, extra = ckpt.load_checkpoint(ckpt.step_dir(tmp_path / rundir.CHECKPOINTS, 0))
    assert extra["global_step"] == 0
    # Saved: the state before the step (no optimizer state yet, the first batch not drawn).
    assert components["critic"]["optimizer"]["state"] == {}
    assert components["data"]["sampler"]["position"] == 0
