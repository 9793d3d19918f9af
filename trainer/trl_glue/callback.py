"""The run-directory protocol inside a TRL run: a ``TrainerCallback`` and its live settings.

:class:`WatchdogCallback` is what ``python -m ppo_watchdog.trainer.trl_glue`` hands GRPOTrainer / RLOOTrainer:

- ``on_train_begin`` (after transformers restored a checkpoint's optimizer and scheduler):
  the launch lr and the newest control.json overrides are applied again, because a resume
  puts the checkpoint's lr back (transformers' ``_load_optimizer_and_scheduler``); then the
  ``started`` event (``resumed_from``, ``skipped_batches``);
- ``on_step_begin`` (before the step's generation and loss): the step boundary, through the
  protocol's one dispatcher (:class:`ppo_watchdog.protocol.control.StepBoundary`): overrides, then
  ``checkpoint`` / ``pause`` / ``resume`` / ``stop``; a ``rollback`` is left unconfirmed (the
  watchdog relaunches from the known-good checkpoint); then injected faults;
- ``on_optimizer_step``: the lr the step really used (the scheduler's logged lr lags by one);
- ``on_log``: TRL's logged values under the catalog's verl keys (:func:`~ppo_watchdog.protocol.catalog.trl_metrics`), TRL's
  own values kept beside them as ``trl/<name>``;
- ``on_save``: transformers' ``checkpoint-N`` becomes ``checkpoints/global_step_N`` with a
  manifest (the watchdog counts it), verl's marker, a ``checkpoint`` event; old ones are pruned
  here, never the one this launch resumed from (transformers' own ``save_total_limit`` rotates by
  mtime and would delete the rollback target, so it is never passed on).

Live keys (:func:`live_keys`) and what TRL cannot do, refused with an ``error`` event naming
the key: the KL coefficient from 0 to non-zero (TRL built no reference model), a clip ratio when
``num_iterations`` is 1 (the ratio is 1: clipping never bites), an entropy bonus while TRL's
adaptive entropy rewrites the coefficient each step.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from transformers import TrainerCallback

from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol.control import ControlApplier, StepBoundary
from ppo_watchdog.trainer.faults import Fault, FaultSchedule
from ppo_watchdog.trainer.trl_glue.config import (
    ACTOR_LR,
    CLIP_RATIO,
    ENTROPY_COEFF,
    GRPO,
    KL_COEF,
    TRLRun,
)
from ppo_watchdog.trainer.verl_glue import apply as verl_apply
from ppo_watchdog.trainer.verl_glue.boundary import RunRecorder
from ppo_watchdog.trainer.verl_glue.manifest import write_manifest

log = logging.getLogger(__name__)

#: Seconds between control.json reads while paused.
PAUSE_POLL_S = 0.5
#: transformers' checkpoint folder prefix (trainer_utils.PREFIX_CHECKPOINT_DIR).
HF_PREFIX = "checkpoint-"


class StopRequested(Exception):
    """A ``stop`` command or SIGTERM was carried out (state saved): the run ends with exit code 0."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def live_keys(run: TRLRun) -> tuple[str, ...]:
    """The keys this run changes at a step boundary (run.json's ``live_keys``); the rest go by relaunch.

    The KL key and clip are listed even where TRL cannot honour them, so a change is refused with a
    reason in ``watchdog history`` instead of costing a relaunch that changes nothing (clip) or
    being done silently by one.
    """
    keys = [ACTOR_LR, run.kl_key, CLIP_RATIO]
    if run.algorithm == GRPO:
        keys.append(ENTROPY_COEFF)
    return tuple(keys)


class LiveSettings:
    """Applies live overrides to a GRPOTrainer / RLOOTrainer; remembers what is in force."""

    def __init__(self, run: TRLRun) -> None:
        self.run = run
        self.keys = live_keys(run)
        self.trainer: Any = None
        """The TRL trainer (bound once built: a callback is handed no trainer)."""
        self.in_force: dict[str, Any] = {}

    def apply(self, overrides: Mapping[str, Any], force: bool = False) -> tuple[dict[str, Any], list[str]]:
        """Apply overrides; (values in force by key, one error message per refused key). ``force``:
        apply even what is already in force (after a resume restored the checkpoint's values)."""
        applied: dict[str, Any] = {}
        errors: list[str] = []
        for key, value in overrides.items():
            if not force and key in self.in_force and self.in_force[key] == value:
                applied[key] = value
                continue
            try:
                if key not in self.keys:
                    raise verl_apply.LiveSettingError(key, value, f"not settable live in this TRL run (live keys: "
                                                                  f"{', '.join(self.keys)}); it changes by relaunch")
                applied[key] = self._apply_one(key, value)
                self.in_force[key] = value
            except verl_apply.LiveSettingError as exc:
                errors.append(str(exc))
        return applied, errors

    def _apply_one(self, key: str, value: Any) -> Any:
        t = self.trainer
        if key == ACTOR_LR:
            return verl_apply.apply_lr(t.optimizer, t.lr_scheduler, value, key)
        if key == self.run.kl_key:
            beta = float(verl_apply.check_value(KL_COEF, value))
            if beta != 0 and getattr(t, "ref_model", None) is None and self.run.beta == 0:
                raise verl_apply.LiveSettingError(key, value, "TRL built no reference model (the KL coefficient was 0 "
                                                              "at launch): turning the KL on takes a relaunch with "
                                                              f"{key}={value}")
            t.beta = beta
            return beta
        if key == ENTROPY_COEFF:
            coef = float(verl_apply.check_value(ENTROPY_COEFF, value))
            if getattr(t, "use_adaptive_entropy", False):
                raise verl_apply.LiveSettingError(key, value, "TRL's adaptive entropy (use_adaptive_entropy) rewrites "
                                                              "the coefficient every step")
            t.entropy_coef = coef
            # Cached at init (grpo_trainer: _entropy_bonus_enabled gates the bonus): set with it.
            t._entropy_bonus_enabled = coef != 0.0
            return coef
        if key == CLIP_RATIO:
            new = float(verl_apply.check_value(CLIP_RATIO, value))
            iters, spg = int(getattr(t, "num_iterations", 1)), int(getattr(t.args, "steps_per_generation", 1) or 1)
            if iters == 1 and spg == 1:
                raise verl_apply.LiveSettingError(key, value, "no effect in TRL with num_iterations=1 and one step per "
                                                              "generation (the policy ratio is 1, clipping never "
                                                              "bites); set actor_rollout_ref.actor.ppo_epochs > 1 at "
                                                              "launch to use it")
            old = self.in_force.get(CLIP_RATIO, self.run.clip_ratio)
            low, high = catalog.moved_clip_bounds(float(old), new, float(t.epsilon_low), float(t.epsilon_high))
            t.epsilon_low, t.epsilon_high = float(low if low is not None else new), float(high if high is not None else new)
            return new
        raise verl_apply.LiveSettingError(key, value, "no apply function for this key")


def _hf_checkpoint(output_dir: Path, step: int) -> Path:
    return output_dir / f"{HF_PREFIX}{step}"


class WatchdogCallback(TrainerCallback):
    """The run-directory protocol for one TRL run (see the module docstring)."""

    can_rollback = False
    """A TRL step loop cannot restore a checkpoint mid-run: rollback goes by relaunch."""

    def __init__(self, run_dir: Path | str, run: TRLRun, recorder: RunRecorder, faults: FaultSchedule,
                 resumed_from: Path | None = None, skip_steps: int = 0) -> None:
        """``resumed_from``: the checkpoint this launch resumes (never pruned); ``skip_steps``: steps'
        worth of prompts the sampler skips after it (for the ``started`` event)."""
        self.run_dir = Path(run_dir)
        self.run = run
        self.recorder = recorder
        self.faults = faults
        self.root = self.run_dir / rundir.CHECKPOINTS
        self.resumed_from = resumed_from
        self.skip_steps = skip_steps
        self.settings = LiveSettings(run)
        self.applier = ControlApplier(self.run_dir, live_keys=self.settings.keys, on_event=recorder.count)
        self.steps = StepBoundary(self.applier, self, poll_s=PAUSE_POLL_S)
        self.trainer: Any = None
        self._step = 0
        self._t0: float | None = None
        self._lr_used: float | None = None
        self._term = False

    def bind(self, trainer: Any) -> None:
        """The TRL trainer whose knobs the live keys turn (a callback is handed only model and optimizer)."""
        self.trainer = trainer
        self.settings.trainer = trainer

    def install_signals(self) -> None:
        """SIGTERM: save and stop at the next step boundary; SIGUSR1: read control.json (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum: int, frame: Any) -> None:
            self._term = True
            self.applier.wake()  # a paused run notices at once

        signal.signal(signal.SIGTERM, on_term)
        self.applier.install_signal_handler()

    # -- transformers' hooks -------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step = int(state.global_step)
        # A resume restored the checkpoint's optimizer and scheduler, lr included: the launch's lr
        # (a relaunch passes the watchdog's) and then the newest live overrides win.
        applied, errors = self.settings.apply({ACTOR_LR: self.run.lr}, force=True)
        over, more = self.settings.apply(self.applier.current_overrides(), force=True)
        applied.update(over)
        self.recorder.event("started", self._step, resumed_from=self._step, total_steps=self.run.total_training_steps,
                            applied=applied, skipped_batches=self.skip_steps, algorithm=self.run.algorithm,
                            resume_path=str(self.resumed_from) if self.resumed_from else None)
        for message in errors + more:
            self.recorder.event("error", self._step, message=message, source="control")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step = int(state.global_step)
        self.steps.at_boundary(self._step)
        for fault in self.faults.due(self._step + 1):
            self.inject(fault)
        self._t0 = time.monotonic()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self.trainer.optimizer if self.trainer is not None else kwargs.get("optimizer")
        if opt is not None:
            self._lr_used = float(opt.param_groups[0]["lr"])

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not logs or "train_runtime" in logs or "loss" not in logs:
            return  # the end-of-training summary, or an evaluation
        step = int(state.global_step)
        beta = float(getattr(self.trainer, "beta", self.run.beta)) if self.trainer is not None else self.run.beta
        data = catalog.trl_metrics(logs, kl_in_reward=self.run.algorithm != GRPO, beta=beta)
        if self._lr_used is not None:
            data["actor/lr"] = self._lr_used
        if self._t0 is not None:
            data["perf/time_per_step"] = time.monotonic() - self._t0
        data["training/global_step"] = float(step)
        data["training/epoch"] = float(state.epoch or 0.0)
        self.recorder.metrics(step, data)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.publish(int(state.global_step), float(state.epoch or 0.0), "schedule")

    # -- checkpoints ---------------------------------------------------------------------------
    def publish(self, step: int, epoch: float, reason: str) -> Path | None:
        """transformers' ``checkpoint-<step>`` -> ``checkpoints/global_step_<step>`` + manifest + marker + event."""
        src = _hf_checkpoint(Path(self.trainer.args.output_dir), step)
        if not src.is_dir():
            return None
        dst = ckpt.step_dir(self.root, step)
        if dst.exists():
            # A save of a step already published (HF saves the last step again): the newer one wins.
            shutil.rmtree(dst)
        self.root.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)  # one rename: the folder appears whole; the manifest written last makes it count
        write_manifest(dst, step, int(epoch), layout="trl")
        rundir.atomic_write_bytes(self.root / rundir.LATEST_MARKER, str(step).encode())
        self.recorder.event("checkpoint", step, path=str(dst), epoch=int(epoch), reason=reason)
        if self.run.max_ckpt_to_keep:
            protect = [self._resumed_step()] if self.resumed_from is not None else []
            ckpt.prune(self.root, self.run.max_ckpt_to_keep, protect=[s for s in protect if s is not None])
        return dst

    def _resumed_step(self) -> int | None:
        try:
            return ckpt.verify_checkpoint(self.resumed_from).step if self.resumed_from else None
        except ckpt.CheckpointError:
            return None

    # -- the dispatcher's hooks (ppo_watchdog.protocol.control.BoundaryTarget) ----------------------
    def apply(self, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        return self.settings.apply(overrides)

    def checkpoint(self, reason: str) -> None:
        t = self.trainer
        t._save_checkpoint(t.model, None)  # transformers' own save of the last completed step
        self.publish(int(t.state.global_step), float(t.state.epoch or 0.0), reason)

    def stop(self, reason: str) -> NoReturn:
        self.checkpoint(f"stop ({reason})")
        self.recorder.event("stopped", self._step, reason=reason)
        raise StopRequested(reason)

    def rollback(self, args: Mapping[str, Any]) -> None:  # never called: can_rollback is False
        raise NotImplementedError("a TRL run rolls back by relaunch")

    def check_rollback(self, args: Mapping[str, Any]) -> str | None:  # never asked: can_rollback is False
        return "a TRL run rolls back by relaunch"

    def event(self, kind: str, **fields: Any) -> None:
        self.recorder.event(kind, self._step, **fields)

    def should_stop(self) -> str | None:
        return "SIGTERM" if self._term else None

    # -- faults (injected, named as such in the events) ----------------------------------------
    def inject(self, fault: Fault) -> None:
        """Apply one scheduled fault at the start of its step."""
        import torch

        step = self._step + 1
        self.recorder.event("fault", step, fault=fault.kind, arg=fault.arg)
        t = self.trainer
        if fault.kind == "lr_spike":
            # The optimizer only: a relaunch (which re-applies the launch lr) undoes it.
            lr = float(t.lr_scheduler.base_lrs[0]) * float(fault.value or 10.0)
            verl_apply.apply_lr(t.optimizer, t.lr_scheduler, lr)
        elif fault.kind == "kl_collapse":
            t.beta = float(t.beta) * float(fault.value or 0.0)
        elif fault.kind == "nan_weights":
            with torch.no_grad():
                next(t.model.parameters()).fill_(math.nan)
        elif fault.kind == "oom":
            raise torch.OutOfMemoryError(f"injected fault {fault}: CPU out of memory (a test of the OOM path)")
        elif fault.kind == "hang":
            end = time.monotonic() + float(fault.value or 60.0)
            while time.monotonic() < end and not self._term:
                time.sleep(0.1)
        elif fault.kind == "crash":
            logging.shutdown()
            os._exit(int(fault.value if fault.value is not None else 1))
        else:
            raise ValueError(f"fault {fault}: not supported by the TRL glue")


#: Faults the TRL glue injects (trainer/faults.py's ``nan`` needs the embedded loss).
FAULT_KINDS = ("lr_spike", "kl_collapse", "nan_weights", "oom", "hang", "crash")
