"""``python -m ppo_watchdog.trainer.trl_glue``: see :mod:`ppo_watchdog.trainer.trl_glue.runner`."""

from ppo_watchdog.trainer.trl_glue.runner import app

app(prog_name="python -m ppo_watchdog.trainer.trl_glue")
