"""``python -m ppo_watchdog.trainer.verl_glue [--run-dir DIR] KEY=VALUE ...``: verl in process, with the protocol."""

from ppo_watchdog.trainer.verl_glue.runner import app

if __name__ == "__main__":
    app(prog_name="python -m ppo_watchdog.trainer.verl_glue")
