"""Pure apply functions: one live control.json key onto verl's own objects.

Each function takes the real object verl trains with and changes it so that the
*next* use sees the new value, and nothing later puts the old one back:

- ``algorithm.kl_ctrl.kl_coef``: the driver's KL controller (``kl_ctrl_in_reward``, a
  ``FixedKLController`` or ``AdaptiveKLController``); ``apply_kl_penalty`` reads
  ``.value`` at every step and an adaptive controller goes on updating from the new one.
- ``*.ppo_epochs``: the driver's OmegaConf config (struct, possibly read-only):
  ``_update_actor`` / ``_update_critic`` read it into the batch's ``epochs`` at every step.
- ``*.optim.lr``: a worker's torch optimizer and its LambdaLR. verl's warmup/cosine
  schedules multiply ``base_lrs`` at every ``scheduler.step()``, so setting
  ``param_groups[i]["lr"]`` alone is undone at the end of the very next update: the
  trap this module exists to avoid. :func:`apply_lr` moves ``base_lrs``,
  ``initial_lr``, ``lr`` and ``_last_lr`` together.
- ``actor.kl_loss_coef`` / ``entropy_coeff`` / ``clip_ratio``: ``ActorConfig`` is a
  frozen dataclass, held by the worker's loss function ``partial(ppo_loss, config=...)``;
  the supported path is a new config (``dataclasses.replace``) in a new partial handed to
  the worker's ``set_loss_fn``, which is what :func:`apply_loss_coefs` builds.

Nothing here imports verl at module level, so ``import ppo_watchdog.trainer`` never needs it; errors
are :class:`LiveSettingError` naming the key and the value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ppo_watchdog.protocol.catalog import moved_clip_bounds

KL_COEF = "algorithm.kl_ctrl.kl_coef"
ACTOR_LR = "actor_rollout_ref.actor.optim.lr"
CRITIC_LR = "critic.optim.lr"
ACTOR_EPOCHS = "actor_rollout_ref.actor.ppo_epochs"
CRITIC_EPOCHS = "critic.ppo_epochs"
KL_LOSS_COEF = "actor_rollout_ref.actor.kl_loss_coef"
ENTROPY_COEFF = "actor_rollout_ref.actor.entropy_coeff"
CLIP_RATIO = "actor_rollout_ref.actor.clip_ratio"

#: Keys the in-process verl glue can change at a step boundary (a run's own set may be smaller:
#: see :func:`live_keys_for`). Micro-batch sizes are not here: verl bakes them into each
#: worker's engine config at init, so they change by restart.
VERL_LIVE_KEYS = (
    KL_COEF, ACTOR_LR, CRITIC_LR, ACTOR_EPOCHS, CRITIC_EPOCHS, KL_LOSS_COEF, ENTROPY_COEFF, CLIP_RATIO,
)

#: Actor loss keys and the ActorConfig field(s) each one sets. ``clip_ratio`` moves the low and
#: high bounds too: ActorConfig defaults them to 0.2 (not None), and verl's policy loss reads
#: ``clip_ratio_low``/``clip_ratio_high`` first, so ``clip_ratio`` alone would change nothing.
#: The bounds move by the factor clip_ratio moves (``catalog.moved_clip_bounds``): an asymmetric
#: clip-higher setting keeps its shape.
LOSS_FIELDS: dict[str, tuple[str, ...]] = {
    KL_LOSS_COEF: ("kl_loss_coef",),
    ENTROPY_COEFF: ("entropy_coeff",),
    CLIP_RATIO: ("clip_ratio", "clip_ratio_low", "clip_ratio_high"),
}


class LiveSettingError(ValueError):
    """A live key or value that cannot be applied; the message names the key and the value."""

    def __init__(self, key: str, value: Any, reason: str) -> None:
        super().__init__(f"{key}={value!r}: {reason}")
        self.key = key
        """The control.json key at fault."""
        self.value = value
        """The offending value."""
        self.reason = reason
        """What is wrong, in words."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised inside Ray workers: unpickling at the driver must rebuild it from its three parts.
        return (type(self), (self.key, self.value, self.reason))


# -- value checks ------------------------------------------------------------------------


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LiveSettingError(key, value, "must be a number")
    x = float(value)
    if not math.isfinite(x):
        raise LiveSettingError(key, value, "must be finite")
    return x


def _positive(key: str, value: Any) -> float:
    x = _number(key, value)
    if x <= 0:
        raise LiveSettingError(key, value, "must be > 0")
    return x


def _non_negative(key: str, value: Any) -> float:
    x = _number(key, value)
    if x < 0:
        raise LiveSettingError(key, value, "must be >= 0")
    return x


def _whole(key: str, value: Any) -> int:
    # The watchdog's `add` action on an integer key may arrive as 3.0; 2.5 epochs is an error.
    x = _number(key, value)
    if x != int(x) or x < 1:
        raise LiveSettingError(key, value, "must be a whole number >= 1")
    return int(x)


def check_value(key: str, value: Any) -> float | int:
    """The value as it will be applied (int for epochs), or :class:`LiveSettingError`."""
    if key in (ACTOR_EPOCHS, CRITIC_EPOCHS):
        return _whole(key, value)
    if key in (ACTOR_LR, CRITIC_LR):
        return _positive(key, value)
    if key in (KL_COEF, KL_LOSS_COEF):
        return _non_negative(key, value)
    if key == CLIP_RATIO:
        x = _positive(key, value)
        if x >= 1:
            raise LiveSettingError(key, value, "must be in (0, 1)")
        return x
    if key == ENTROPY_COEFF:
        return _number(key, value)
    raise LiveSettingError(key, value, f"not settable live by the verl glue (live keys: {', '.join(VERL_LIVE_KEYS)})")


# -- the apply functions ---------------------------------------------------------------


def apply_kl_coef(kl_ctrl: Any, value: Any) -> float:
    """Set the KL-in-reward coefficient of verl's Fixed/AdaptiveKLController; returns it.

    An adaptive controller keeps its target and horizon and goes on adapting from the new
    value, which is what a watchdog raising kl_coef wants: a new starting point, not a
    different controller.
    """
    x = check_value(KL_COEF, value)
    if not hasattr(kl_ctrl, "value") or not callable(getattr(kl_ctrl, "update", None)):
        raise LiveSettingError(KL_COEF, value, f"{type(kl_ctrl).__name__} is not a verl KL controller")
    kl_ctrl.value = float(x)
    return float(kl_ctrl.value)


def set_config_key(config: Any, key: str, value: Any) -> Any:
    """Set an existing dotted key of an OmegaConf config, struct and read-only flags notwithstanding.

    Hydra hands verl a struct config (no new keys) that may also be read-only. The flags
    are lifted on the parent node only, for this one assignment, and the key must already
    exist: a typo must fail, not grow the config.
    """
    from omegaconf import OmegaConf, open_dict, read_write

    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(config, parent_key) if parent_key else config
    if parent is None or not OmegaConf.is_dict(parent) or leaf not in parent:
        raise LiveSettingError(key, value, "no such key in the run's config")
    with read_write(parent), open_dict(parent):
        parent[leaf] = value
    return OmegaConf.select(config, key)


def apply_ppo_epochs(config: Any, value: Any, key: str = ACTOR_EPOCHS) -> int:
    """Set ``actor_rollout_ref.actor.ppo_epochs`` (or ``critic.ppo_epochs``) in the driver's config.

    The v1 trainer copies it into each update's ``epochs`` at every step, so the next
    update runs that many passes; the workers keep no copy of their own.
    """
    if key not in (ACTOR_EPOCHS, CRITIC_EPOCHS):
        raise LiveSettingError(key, value, f"apply_ppo_epochs sets {ACTOR_EPOCHS} or {CRITIC_EPOCHS}")
    n = check_value(key, value)
    return int(set_config_key(config, key, int(n)))


def apply_lr(optimizer: Any, scheduler: Any, lr: Any, key: str = ACTOR_LR) -> float:
    """Change a worker's learning rate for good; returns the lr the next ``optimizer.step()`` uses.

    verl builds a ``LambdaLR`` (``get_constant_schedule_with_warmup`` /
    ``get_cosine_schedule_with_warmup``) whose ``step()`` sets every group's lr to
    ``base_lr * lambda(step)``. So the new lr goes into ``base_lrs`` (what the schedule
    multiplies), ``initial_lr`` (what a reloaded scheduler rebuilds ``base_lrs`` from), the
    groups' ``lr`` at the schedule's current factor (the very next step) and ``_last_lr``
    (what verl logs as ``actor/lr``). Groups with different base lrs keep their ratios to
    the first group.
    """
    from torch.optim.lr_scheduler import LambdaLR

    x = float(check_value(key, lr))
    if optimizer is None or scheduler is None:
        raise LiveSettingError(key, lr, "this worker has no optimizer / lr scheduler (forward-only engine?)")
    if not isinstance(scheduler, LambdaLR):
        raise LiveSettingError(
            key, lr, f"the lr scheduler is a {type(scheduler).__name__}, not verl's LambdaLR (FSDP engine); "
                     "change it by restart")
    groups = optimizer.param_groups
    if len(scheduler.base_lrs) != len(groups):
        raise LiveSettingError(key, lr, f"scheduler has {len(scheduler.base_lrs)} base lrs for {len(groups)} groups")
    first = float(scheduler.base_lrs[0])
    ratios = [float(b) / first if first > 0 else 1.0 for b in scheduler.base_lrs]
    new_base = [x * r for r in ratios]
    scheduler.base_lrs = list(new_base)
    for group, base, lmbda in zip(groups, new_base, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = base
        group["lr"] = base * float(lmbda(scheduler.last_epoch))
    scheduler._last_lr = [float(g["lr"]) for g in groups]
    return float(groups[0]["lr"])


def loss_config(loss_fn: Any) -> Any:
    """The ActorConfig bound in a worker's loss function ``partial(ppo_loss, config=...)``."""
    if not isinstance(loss_fn, functools.partial) or "config" not in loss_fn.keywords:
        raise TypeError(f"expected functools.partial(<loss>, config=ActorConfig), got {loss_fn!r}")
    return loss_fn.keywords["config"]


def apply_loss_coefs(loss_fn: Any, changes: Mapping[str, Any]) -> functools.partial:
    """A new actor loss function with ``kl_loss_coef`` / ``entropy_coeff`` / ``clip_ratio`` changed.

    ``ActorConfig`` is frozen (assigning a field raises ``FrozenInstanceError``), and the
    worker holds it only through its loss ``partial``; so the new values go into a copy
    made with ``dataclasses.replace`` (``__post_init__`` re-validates it) bound in a new
    partial of the same function, for the worker's ``set_loss_fn``. ``kl_loss_coef``
    with ``use_kl_loss=False`` is refused: it would be accepted and change nothing.
    """
    cfg = loss_config(loss_fn)
    updates: dict[str, Any] = {}
    for key, value in changes.items():
        if key not in LOSS_FIELDS:
            raise LiveSettingError(key, value, f"not an actor loss key ({', '.join(LOSS_FIELDS)})")
        x = check_value(key, value)
        if key == KL_LOSS_COEF and not getattr(cfg, "use_kl_loss", False):
            raise LiveSettingError(key, value, "actor_rollout_ref.actor.use_kl_loss is false: the KL loss is off "
                                               "(the KL in the reward is algorithm.kl_ctrl.kl_coef)")
        updates[LOSS_FIELDS[key][0]] = float(x)
        if key == CLIP_RATIO:
            low, high = moved_clip_bounds(float(cfg.clip_ratio), float(x), cfg.clip_ratio_low, cfg.clip_ratio_high)
            updates.update({n: v for n, v in (("clip_ratio_low", low), ("clip_ratio_high", high)) if v is not None})
    fresh = dataclasses.replace(cfg, **updates, global_batch_info={})
    return functools.partial(loss_fn.func, *loss_fn.args, **{**loss_fn.keywords, "config": fresh})


def loss_values(loss_fn: Any, keys: Iterable[str]) -> dict[str, float]:
    """The values in force in a loss function's config, by control key (first field of each)."""
    cfg = loss_config(loss_fn)
    return {k: float(getattr(cfg, LOSS_FIELDS[k][0])) for k in keys}


def live_keys_for(config: Any) -> tuple[str, ...]:
    """The live keys of one verl run: those whose target exists in this config.

    ``algorithm.kl_ctrl.kl_coef`` only with ``algorithm.use_kl_in_reward`` (else there is no
    controller: the watchdog must restart instead), critic keys only with a critic,
    ``kl_loss_coef`` only with ``use_kl_loss``. run.json lists this set, so the watchdog
    knows which changes to make by restart.
    """
    from verl.trainer.ppo.utils import need_critic

    keys = []
    for key in VERL_LIVE_KEYS:
        if key == KL_COEF and not config.algorithm.get("use_kl_in_reward", False):
            continue
        if key in (CRITIC_LR, CRITIC_EPOCHS) and not need_critic(config):
            continue
        if key == KL_LOSS_COEF and not config.actor_rollout_ref.actor.get("use_kl_loss", False):
            continue
        keys.append(key)
    return tuple(keys)


_SAVED_STEP = re.compile(r"global_step_(\d+)")


def forget_saves_after(manager: Any, step: int) -> int:
    """Drop from a verl checkpoint manager's ``previous_saved_paths`` the saves of steps after ``step``
    (a timeline an in-process rollback abandoned); returns how many. verl prunes by that list when
    ``max_*_ckpt_to_keep`` is set: a stale entry named like a step the run saves again would have the
    new save removed as the old one's excess."""
    paths = getattr(manager, "previous_saved_paths", None)
    if not isinstance(paths, list):
        return 0
    keep = [p for p in paths if (m := _SAVED_STEP.search(str(p))) is None or int(m.group(1)) <= step]
    manager.previous_saved_paths = keep
    return len(paths) - len(keep)
