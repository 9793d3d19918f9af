"""``python -m trainer.trl_glue``: see :mod:`trainer.trl_glue.runner`."""

from trainer.trl_glue.runner import app

app(prog_name="python -m trainer.trl_glue")
