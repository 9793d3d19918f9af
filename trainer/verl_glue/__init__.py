"""In-process mode: a real verl v1 run that obeys the run-directory protocol.

``python -m ppo_watchdog.trainer.verl_glue --run-dir DIR KEY=VALUE ...`` runs verl's PPO with
``trainer.v1.trainer_mode=watchdog_sync``: verl's own synchronous trainer plus metrics
(metrics.jsonl, /metrics), events (started, applied, error, checkpoint, finished, ...)
and control.json applied at step boundaries. Modules, from the pure core out:

- :mod:`.apply`: one function per live key, on verl's real objects (KL controller,
  OmegaConf config, torch optimizer + LambdaLR, the actor's loss partial). No verl import.
- :mod:`.boundary`: the step-boundary handler (control.json, commands, pause) and the
  metrics/events recorder, over :class:`~.boundary.VerlTargets`.
- :mod:`.workers`: worker subclasses with ``@register``-ed ``watchdog_set_lr`` /
  ``watchdog_set_loss_coefs``.
- :mod:`.trainer`: the registered v1 trainer subclass (``watchdog_sync``).
- :mod:`.taskrunner`: our ``TaskRunnerV1`` for ``run_ppo``.
- :mod:`.runner`: config composition and the launcher (``__main__``).

Nothing is imported here: ``import ppo_watchdog.trainer`` and ``import ppo_watchdog.trainer.verl_glue`` never load
verl, Ray or CUDA.
"""
