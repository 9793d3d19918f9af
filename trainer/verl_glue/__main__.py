"""``python -m trainer.verl_glue [--run-dir DIR] KEY=VALUE ...``: verl in process, with the protocol."""

from trainer.verl_glue.runner import app

if __name__ == "__main__":
    app(prog_name="python -m trainer.verl_glue")
