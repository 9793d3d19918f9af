"""Your own TRL script under the watchdog: ``from ppo_watchdog.trl import WatchdogCallback``.

::

    from ppo_watchdog.trl import WatchdogCallback

    watchdog = WatchdogCallback()  # the run directory `watchdog run --run-dir` names (or a path)
    trainer = GRPOTrainer(model=..., reward_funcs=[my_reward], train_dataset=my_ds, args=GRPOConfig(...),
                          callbacks=[watchdog])
    watchdog.train(trainer)  # in place of trainer.train()

and ``watchdog run --run-dir runs/x -- python my_grpo.py``. The same for RLOOTrainer. Needs the
``[trl]`` extra (TRL >= 1.16, Python >= 3.11); the class is
:class:`ppo_watchdog.trainer.trl_glue.callback.WatchdogCallback`, re-exported here.
"""

from __future__ import annotations

from ppo_watchdog.trainer.trl_glue.callback import StopRequested, WatchdogCallback

__all__ = ["StopRequested", "WatchdogCallback"]
