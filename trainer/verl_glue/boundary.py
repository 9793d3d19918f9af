"""The step boundary of an in-process verl run: control.json in, events and metrics out.

The v1 trainer subclass (:mod:`ppo_watchdog.trainer.verl_glue.trainer`) calls :class:`ControlBoundary`
before each step and :class:`RunRecorder` after it; everything verl-specific comes in as
:class:`VerlTargets` (the driver's config, its KL controller, and two callables that
reach the workers through their worker groups). So the handler runs, and is tested, on
verl's real objects without a fit loop, Ray or a GPU.

control.json semantics are the embedded trainer's, through the same dispatcher
(:class:`ppo_watchdog.protocol.control.StepBoundary`): a version not newer than the last applied one is
a no-op, a garbled file is one ``error`` event per bad content, a version that names a key
this run cannot change live is refused whole (the watchdog then restarts with it), and
one ``applied`` event confirms each version. One-shot commands: ``checkpoint`` (verl's
own save), ``pause`` / ``resume`` (the driver waits between steps, polling control.json),
``stop`` (save, then end the run with exit code 0). ``rollback`` restores the checkpoint in the
running trainer when the trainer lends a ``restore`` (the v1 trainer's
``WatchdogPPOTrainer._rollback_at_boundary``: worker groups reloaded, dataloader, step counter and KL
controller reset, weights pushed to the rollout replicas before the next step); one it cannot restore
(``check``) is reported as an ``error`` and left unconfirmed, so the watchdog rolls back by restart.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol.control import Changes, ControlApplier, StepBoundary
from ppo_watchdog.protocol.exporter import MetricsExporter
from ppo_watchdog.trainer.verl_glue import apply

log = logging.getLogger(__name__)

#: Seconds between control.json reads while paused.
PAUSE_POLL_S = 1.0


class StopRequested(Exception):
    """A ``stop`` command was executed (state saved): the run ends with exit code 0."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class VerlTargets:
    """What the live keys act on in one verl run, seen from the driver."""

    config: Any
    """The driver's OmegaConf config (``self.config`` of the trainer): epochs are read from it per step."""
    kl_ctrl: Any | None
    """``kl_ctrl_in_reward`` (None when ``algorithm.use_kl_in_reward`` is off)."""
    set_lr: Callable[[str, float], float]
    """``(role, lr) -> lr in force``, role ``actor`` or ``critic``: the workers' ``watchdog_set_lr``."""
    set_loss_coefs: Callable[[dict[str, float]], dict[str, float]]
    """``{control key: value} -> values in force``: the actor workers' ``watchdog_set_loss_coefs``."""


class LiveSettings:
    """Applies live overrides to :class:`VerlTargets`; remembers what is in force."""

    def __init__(self, targets: VerlTargets, live_keys: tuple[str, ...] | None = None) -> None:
        """``live_keys`` defaults to :func:`apply.live_keys_for` the run's config."""
        self.targets = targets
        self.live_keys = tuple(live_keys) if live_keys is not None else apply.live_keys_for(targets.config)
        self._in_force: dict[str, Any] = {}

    def apply(self, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Apply overrides; returns (values in force by key, error messages). A bad key is skipped, the rest applied.

        A key already in force with the same value is not sent again (control.json is
        desired state: every version repeats every override).
        """
        applied: dict[str, Any] = {}
        errors: list[str] = []
        loss: dict[str, Any] = {}
        for key, value in overrides.items():
            if key in self._in_force and self._in_force[key] == value:
                applied[key] = self._in_force[key]
                continue
            try:
                if key not in self.live_keys:
                    raise apply.LiveSettingError(key, value, f"not settable live in this run (live keys: "
                                                             f"{', '.join(self.live_keys)})")
                if key in apply.LOSS_FIELDS:
                    apply.check_value(key, value)
                    loss[key] = value  # one call to the workers for all loss keys
                    continue
                applied[key] = self._apply_one(key, value)
                self._in_force[key] = value
            except (apply.LiveSettingError, TypeError) as exc:
                errors.append(str(exc))
        if loss:
            try:
                in_force = self.targets.set_loss_coefs(dict(loss))
                for key in loss:
                    self._mirror(key, in_force[key])
                    applied[key] = in_force[key]
                    self._in_force[key] = loss[key]
            except (apply.LiveSettingError, TypeError) as exc:
                errors.append(str(exc))
        return applied, errors

    def forget(self) -> None:
        """Forget what is in force (a checkpoint restored in process brought its own values back)."""
        self._in_force.clear()

    def _apply_one(self, key: str, value: Any) -> Any:
        t = self.targets
        if key == apply.KL_COEF:
            if t.kl_ctrl is None:
                raise apply.LiveSettingError(key, value, "algorithm.use_kl_in_reward is false: no KL controller")
            out = apply.apply_kl_coef(t.kl_ctrl, value)
            self._mirror(key, out)
            return out
        if key in (apply.ACTOR_EPOCHS, apply.CRITIC_EPOCHS):
            return apply.apply_ppo_epochs(t.config, value, key)
        if key in (apply.ACTOR_LR, apply.CRITIC_LR):
            lr = float(apply.check_value(key, value))
            t.set_lr("actor" if key == apply.ACTOR_LR else "critic", lr)
            # The configured lr, not the scheduler's current factor of it: what a restart passes on.
            self._mirror(key, lr)
            return lr
        raise apply.LiveSettingError(key, value, "no apply function for this key")

    def _mirror(self, key: str, value: Any) -> None:
        # The driver's config follows every live change: run.json's snapshot, verl's own use of
        # entropy_coeff (calculate_entropy) and a later restart all read it from there.
        for name in apply.LOSS_FIELDS.get(key, (key.rpartition(".")[2],)):
            dotted = f"{key.rpartition('.')[0]}.{name}"
            try:
                apply.set_config_key(self.targets.config, dotted, value)
            except apply.LiveSettingError:
                log.debug("config has no %s to mirror", dotted)


def numeric_metrics(data: Mapping[str, Any]) -> dict[str, float]:
    """The scalar numbers of one step's metrics (numpy and 0-d tensors included), as floats."""
    out: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, bool):
            continue
        try:
            if getattr(value, "ndim", 0) != 0:
                continue
            x = float(value)
        except (TypeError, ValueError):
            continue
        out[str(key)] = x
    return out


class RunRecorder:
    """Writes metrics.jsonl and events.jsonl of the run and feeds the exporter."""

    def __init__(self, run_dir: Path | str, exporter: MetricsExporter) -> None:
        self.run_dir = Path(run_dir)
        self.exporter = exporter
        self.counts: dict[str, int] = {}

    def count(self, record: Mapping[str, Any]) -> None:
        """Count an event recorded elsewhere (the control applier's ``applied`` / ``error``)."""
        kind = str(record["kind"])
        self.exporter.count_event(kind)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def event(self, kind: str, step: int | None, **fields: Any) -> dict[str, Any]:
        """Append one event and count it."""
        record = rundir.append_event(self.run_dir, kind, step, **fields)
        self.count(record)
        return record

    def metrics(self, step: int, data: Mapping[str, Any]) -> dict[str, float]:
        """One step's metrics in verl's FileLogger format, and on /metrics; returns what was written."""
        numbers = numeric_metrics(data)
        rundir.append_metrics(self.run_dir, step, numbers)
        self.exporter.update(step, numbers)
        val = [v for k, v in numbers.items() if catalog.canonical_key(k) == "val-core/reward/mean@1"]
        if val and all(math.isfinite(v) for v in val):
            self.event("validation", step, score=sum(val) / len(val),
                       metrics={k: v for k, v in numbers.items() if k.startswith(("val-core/", "val/"))})
        return numbers


class ControlBoundary:
    """control.json at verl's step boundaries: this run's hooks for the protocol's
    :class:`~ppo_watchdog.protocol.control.StepBoundary` (the embedded trainer's dispatcher too)."""

    def __init__(
        self,
        run_dir: Path | str,
        settings: LiveSettings,
        recorder: RunRecorder,
        save: Callable[[], None],
        restore: Callable[[Mapping[str, Any]], None] | None = None,
        check: Callable[[Mapping[str, Any]], str | None] | None = None,
    ) -> None:
        """``save`` runs verl's own checkpoint save (it records the ``checkpoint`` event); ``restore``
        rolls the running trainer back to the checkpoint a ``rollback`` command names, after ``check``
        found nothing against it (None: rollback goes by restart)."""
        self.settings = settings
        self.recorder = recorder
        self.save = save
        self.restore = restore
        self.check = check
        self.can_rollback = restore is not None
        self.applier = ControlApplier(run_dir, live_keys=settings.live_keys, on_event=recorder.count)
        self.steps = StepBoundary(self.applier, self, poll_s=PAUSE_POLL_S)
        self._step = 0

    def start(self, step: int) -> dict[str, Any]:
        """Before the first step: re-apply the newest overrides (a restarted run keeps what was set live)."""
        self._step = step
        applied, errors = self.steps.start()
        for message in errors:
            self.recorder.event("error", step, message=message, source="control")
        return applied

    def at_boundary(self, step: int) -> Changes | None:
        """Apply a newer control.json version, if any; ``step`` is the last completed step.

        Raises :class:`StopRequested` after a ``stop`` command saved the run.
        """
        self._step = step
        return self.steps.at_boundary(step)

    # -- the dispatcher's hooks ---------------------------------------------------------------
    def apply(self, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        return self.settings.apply(overrides)

    def checkpoint(self, reason: str) -> None:
        self.save()

    def stop(self, reason: str) -> NoReturn:
        self.save()
        self.recorder.event("stopped", self._step, reason=reason)
        raise StopRequested(reason)

    def rollback(self, args: Mapping[str, Any]) -> None:
        if self.restore is None:
            raise NotImplementedError("this run rolls back by restart")
        self.restore(args)

    def check_rollback(self, args: Mapping[str, Any]) -> str | None:
        if self.restore is None:
            return "this run rolls back by restart"
        return self.check(args) if self.check is not None else None

    def event(self, kind: str, **fields: Any) -> None:
        self.recorder.event(kind, self._step, **fields)

    def should_stop(self) -> str | None:
        return None  # verl's own signal handling ends the driver
