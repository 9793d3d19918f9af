"""The embedded PPO trainer (``python -m trainer``) and the run-directory protocol.

Import-light on purpose: the watchdog imports ``trainer.catalog``, ``trainer.rundir``
and ``trainer.config`` without pulling in torch or verl.
"""
