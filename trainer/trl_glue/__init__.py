"""TRL runs under the watchdog: GRPOTrainer and RLOOTrainer speaking the run-directory protocol.

``python -m ppo_watchdog.trainer.trl_glue --run-dir DIR KEY=VALUE ...`` trains with Hugging Face TRL
(``pip install 'ppo-watchdog[trl]'``, Python >= 3.11) and obeys the protocol as the embedded
trainer does: metrics.jsonl under the catalog's verl keys, events, run.json with live keys,
control.json at every step boundary, manifested checkpoints. Modules, from the pure core out:

- :mod:`.config`: the run's settings under verl's key names (``key=value``, Hydra's grammar),
  mapped onto GRPOConfig / RLOOConfig fields;
- :mod:`.task`: the built-in toy task (arithmetic prompts, a dense reward);
- :mod:`.assets`: a tiny local Qwen2 and byte-level tokenizer, built without the hub;
- :mod:`.callback`: the ``TrainerCallback`` (step boundary, metrics, checkpoints, faults) and the
  live settings on TRL's trainer;
- :mod:`.runner`: the entry point (run.json, resume, exit codes).

May import ``ppo_watchdog.protocol`` of the watchdog only (import-linter); nothing here imports TRL at
module level except :mod:`.callback` (transformers' ``TrainerCallback``), so ``import ppo_watchdog.trainer``
never needs TRL.
"""
