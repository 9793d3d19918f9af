"""The embedded PPO trainer (``python -m ppo_watchdog.trainer``) and the in-process verl glue (``ppo_watchdog.trainer.verl_glue``).

Both speak the run-directory protocol through :mod:`ppo_watchdog.protocol`; nothing in
``watchdog`` imports this package, so the watchdog installs and runs without torch or verl.
"""
