"""verl's own ``python -m verl.trainer.main_ppo`` on a GPU-less machine (the ``[verl]`` extra).

- :mod:`ppo_watchdog.trainer.verl_cpu.plugin`: the module verl imports in every process it starts
  (``VERL_USE_EXTERNAL_MODULES``): a CPU platform on gloo, the small fixes verl 0.9.1 needs on
  CPU (each naming the verl file and line it works around, failing loudly when verl no longer
  has it), and fault injection switched on by environment variables;
- :mod:`ppo_watchdog.trainer.verl_cpu.rollout`: an ``hf`` async rollout server (HF ``generate``) with weight sync;
- :mod:`ppo_watchdog.trainer.verl_cpu.assets`: tiny local assets (random Qwen2, byte-level tokenizer, gsm8k-layout
  parquet, a dense reward), no hub;
- :mod:`ppo_watchdog.trainer.verl_cpu.overrides`: the one place that knows the Hydra overrides and environment
  of a tiny PPO run (GAE, critic, KL in the reward) on CPU.

Imports torch, transformers and verl only inside the modules that need them; ``watchdog`` never
imports this package.
"""
