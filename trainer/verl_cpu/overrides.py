"""The one place that knows how to run verl 0.9.1's ``main_ppo`` on CPU: overrides and environment.

:func:`ppo_overrides` returns the Hydra overrides of a tiny PPO run (GAE, a critic, the KL to a
reference model in the reward with a fixed controller, the ``hf`` rollout), and :func:`verl_env`
the environment that loads :mod:`ppo_watchdog.trainer.verl_cpu.plugin` in every process verl starts. Why each
setting (measured on a 2-core machine, see ARCHITECTURE.md and ../shared/design/verl-on-cpu.md):

- ``ray_kwargs.ray_init.num_gpus``: one logical Ray GPU per rank, since verl's resource pool counts
  only GPUs (single_controller/ray/base.py:146-148); ``num_cpus=12`` logical, since every
  TransferQueue storage unit and its controller take a whole CPU (transfer_queue/storage/
  simple_storage.py:722, controller.py:943) and 2 real cores hang the job after its config print;
- ``num_data_storage_units=1``, ``agent.num_workers=1``, ``reward.num_workers=1``,
  ``data.dataloader_num_workers=0``: the defaults (8 each) start 16 extra processes and made the
  first step 49 s instead of 11 s;
- ``strategy=fsdp2``: FSDP1 wraps with ``sync_module_states=True``, which refuses CPU parameters
  (workers/engine/fsdp/transformer_impl.py:437-448); FSDP2's ``fully_shard`` runs on gloo;
- ``attn_implementation=sdpa``: the default is ``flash_attention_2`` (workers/config/model.py:185);
- ``use_remove_padding=False`` (the packed path is flash-attn varlen), ``use_torch_compile=False``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ppo_watchdog.trainer.verl_cpu.assets import Assets

PLUGIN = "ppo_watchdog.trainer.verl_cpu.plugin"
VERL_MAIN = ("-m", "verl.trainer.main_ppo")


def ppo_overrides(assets: Assets, *, steps: int = 8, save_freq: int = 2, batch: int = 4, mini_batch: int = 4,
                  micro_batch: int = 2, response_length: int = 16, lr: float = 1e-3, kl_coef: float = 0.001,
                  gpus: int = 1, test_freq: int = -1) -> list[str]:
    """Hydra overrides for a tiny PPO run with a critic and the KL in the reward, on CPU."""
    a = assets
    sdpa = "+{}.model.override_config.attn_implementation=sdpa"
    return [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.type=fixed",
        f"algorithm.kl_ctrl.kl_coef={kl_coef}",
        f"data.train_files={a.train}",
        f"data.val_files={a.val}",
        f"data.train_batch_size={batch}",
        f"data.val_batch_size={batch}",
        "data.max_prompt_length=48",
        f"data.max_response_length={response_length}",
        "data.dataloader_num_workers=0",
        "data.shuffle=False",
        f"actor_rollout_ref.model.path={a.model}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        sdpa.format("actor_rollout_ref"),
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.n=1",
        f"critic.model.path={a.model}",
        "critic.model.use_remove_padding=False",
        "critic.model.enable_gradient_checkpointing=False",
        sdpa.format("critic"),
        "critic.strategy=fsdp2",
        "critic.fsdp.use_torch_compile=False",
        "critic.optim.lr=1e-3",
        f"critic.ppo_micro_batch_size_per_gpu={micro_batch}",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={a.reward}",
        "reward.custom_reward_function.name=compute_score",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "+ray_kwargs.ray_init.num_gpus=" + str(gpus),
        "ray_kwargs.ray_init.num_cpus=12",
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={gpus}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        f"trainer.save_freq={save_freq}",
        f"trainer.test_freq={test_freq}",
        "trainer.val_before_train=False",
        "trainer.logger=[console]",
        "trainer.project_name=ppo_watchdog",
        "trainer.experiment_name=verl_cpu",
    ]


def verl_command(python: str, overrides: list[str]) -> list[str]:
    """``python -m verl.trainer.main_ppo OVERRIDES`` (unmodified verl)."""
    return [python, *VERL_MAIN, *overrides]


def verl_env(base: Mapping[str, str] | None = None, inject: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment verl must start with on CPU: the plugin in every process (``ppo_watchdog`` is
    installed, so every process verl starts imports it), one thread per process; ``inject`` adds fault-injection variables (``VERL_CPU_INJECT_*``)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "VERL_USE_EXTERNAL_MODULES": PLUGIN,
        "VERL_PLATFORM": "cpu",
        # verl registers its FSDP engines for cuda/npu only (transformer_impl.py:1143, :1594); this is
        # verl's own override of the device it looks the engine up by (workers/engine/base.py:405-406).
        "VERL_ENGINE_DEVICE": "cuda",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
        "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
        "HYDRA_FULL_ERROR": "1",
        "WANDB_MODE": "disabled",
    })
    env.update(dict(inject or {}))
    return env
