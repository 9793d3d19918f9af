"""verl worker subclasses with the registered methods the driver calls to change settings live.

The optimizer, the LambdaLR and the actor's loss function live in the worker processes
(``ActorRolloutRefWorker.actor.engine`` and the critic ``TrainingWorker.engine``), not
in the driver. verl reaches them through its single-controller machinery: a method
decorated with ``@register(dispatch_mode=...)`` is bound onto the worker group, and a call
``worker_group.watchdog_set_lr(lr)`` runs it on every rank (``ONE_TO_ALL``, like verl's
own ``set_loss_fn``) and returns one result per rank. The trainer swaps these classes in
for verl's (``role_worker_mapping``), the way verl's separate-async trainer swaps its own.

The methods only call the pure functions of :mod:`ppo_watchdog.trainer.verl_glue.apply`; they hold no
state of their own. Imports verl (not torch.cuda): importing this module needs no GPU.
"""

from __future__ import annotations

from typing import Any

from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from ppo_watchdog.trainer.verl_glue import apply

#: Names of the registered methods (the driver calls them on the worker groups).
SET_LR = "watchdog_set_lr"
SET_LOSS_COEFS = "watchdog_set_loss_coefs"
FORGET_SAVES = "watchdog_forget_saves_after"


class LiveLrMixin:
    """``watchdog_set_lr``: :func:`apply.apply_lr` on this worker's optimizer and LambdaLR; and
    ``watchdog_forget_saves_after`` for an in-process rollback."""

    def _watchdog_engine(self) -> Any:
        raise NotImplementedError

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # a DynamicEnum
    def watchdog_set_lr(self, lr: float, key: str = apply.ACTOR_LR) -> float:
        """Set the lr on this rank; returns the lr the next optimizer step uses."""
        engine = self._watchdog_engine()
        return apply.apply_lr(getattr(engine, "optimizer", None), getattr(engine, "lr_scheduler", None), lr, key)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # a DynamicEnum
    def watchdog_forget_saves_after(self, step: int) -> int:
        """After an in-process rollback to ``step``: :func:`apply.forget_saves_after` on this rank's
        checkpoint manager; returns how many saves it forgot."""
        return apply.forget_saves_after(getattr(self._watchdog_engine(), "checkpoint_manager", None), step)


class WatchdogActorRolloutRefWorker(LiveLrMixin, ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker plus live lr and loss coefficients."""

    def _watchdog_engine(self) -> Any:
        if self.actor is None:
            raise apply.LiveSettingError(apply.ACTOR_LR, None, f"worker role {self.role!r} has no actor")
        return self.actor.engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # a DynamicEnum
    def watchdog_set_loss_coefs(self, changes: dict[str, float]) -> dict[str, float]:
        """New actor loss coefficients through verl's own ``set_loss_fn`` path; returns the values in force."""
        if self.actor is None:
            raise apply.LiveSettingError(next(iter(changes), "actor"), None, f"worker role {self.role!r} has no actor")
        loss_fn = apply.apply_loss_coefs(self.loss_fn, changes)
        self.loss_fn = loss_fn
        self.actor.set_loss_fn(loss_fn)
        return apply.loss_values(self.actor.loss_fn, changes)


class WatchdogTrainingWorker(LiveLrMixin, TrainingWorker):
    """verl's TrainingWorker (the critic in the v1 trainer) plus a live lr."""

    def _watchdog_engine(self) -> Any:
        return self.engine
