"""The embedded PPO trainer (``python -m trainer``) and the in-process verl glue (``trainer.verl_glue``).

Both speak the run-directory protocol through :mod:`watchdog.protocol`; nothing in
``watchdog`` imports this package, so the watchdog installs and runs without torch or verl.
"""
