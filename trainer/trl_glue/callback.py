"""The run-directory protocol inside a TRL run: the public ``TrainerCallback`` and its live settings.

A user's own script (``from ppo_watchdog.trl import WatchdogCallback``, :mod:`ppo_watchdog.trl`)::

    watchdog = WatchdogCallback()          # the run dir: $WATCHDOG_RUN_DIR (``watchdog run`` sets it), or a path
    trainer = GRPOTrainer(model=..., reward_funcs=[...], train_dataset=..., args=GRPOConfig(...),
                          callbacks=[watchdog])
    watchdog.train(trainer)                # in place of trainer.train()

:meth:`WatchdogCallback.train` reads the trainer's settings under verl's keys (:func:`.config.from_trl`)
and a relaunch's arguments from ``$WATCHDOG_LAUNCH_ARGS`` (run.json says ``"launch_args": "env"``, so
the watchdog relaunches the script's own command as it is), writes run.json, resumes where the
watchdog says (or from the newest complete checkpoint of the run), trains, and turns what ends the run
into events and the protocol's exit codes. The demo entry point (:mod:`.runner`) uses the same class,
given its settings and argv. The hooks:

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
  here (``save_total_limit``, or ``trainer.max_actor_ckpt_to_keep``), never the one this launch resumed
  from (transformers' own rotation goes by mtime and would delete the rollback target; it never sees
  ours, moved out of ``output_dir`` at once).

Live keys (:func:`live_keys`; TRL's names for them, ``learning_rate``, ``beta``, ``epsilon``,
``entropy_coef``, are taken too) and what TRL cannot do, refused with an ``error`` event naming
the key: the KL coefficient from 0 to non-zero (TRL built no reference model), a clip ratio when
``num_iterations`` is 1 (the ratio is 1: clipping never bites), an entropy bonus while TRL's
adaptive entropy rewrites the coefficient each step.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from transformers import TrainerCallback

from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol.control import COMMAND_KINDS, ControlApplier, StepBoundary
from ppo_watchdog.protocol.exporter import MetricsExporter
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.trainer.faults import Fault, FaultSchedule
from ppo_watchdog.trainer.trl_glue.config import (
    ACTOR_LR,
    BETA,
    CLIP_RATIO,
    ENTROPY_COEFF,
    GRPO,
    IGNORED,
    KL_COEF,
    SKIP_KEY,
    TRL_NAMES,
    TRLConfigError,
    TRLRun,
    from_trl,
    verl_key,
)
from ppo_watchdog.trainer.trl_glue.failures import nan_like, oom_fields
from ppo_watchdog.trainer.trl_glue.resume import SkipFirst, resume_point, skip_items
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

    @property
    def accepted(self) -> tuple[str, ...]:
        """The live keys and TRL's names for them (what control.json may carry)."""
        names = [n for n in (*TRL_NAMES, BETA) if verl_key(n, self.run.algorithm) in self.keys]
        return (*self.keys, *names)

    def apply(self, overrides: Mapping[str, Any], force: bool = False) -> tuple[dict[str, Any], list[str]]:
        """Apply overrides; (values in force by key, one error message per refused key). ``force``:
        apply even what is already in force (after a resume restored the checkpoint's values)."""
        applied: dict[str, Any] = {}
        errors: list[str] = []
        for name, value in overrides.items():
            key = verl_key(name, self.run.algorithm)  # TRL's name for a key (learning_rate, beta ...) is that key
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


def _move(src: Path, dst: Path) -> None:
    """``src`` to ``dst`` whole: one rename, or across filesystems a copy beside ``dst`` renamed into place."""
    try:
        os.replace(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        part = dst.with_name(f".{dst.name}.part")
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(src, part)
        os.replace(part, dst)
        shutil.rmtree(src, ignore_errors=True)


def _own_command() -> list[str]:
    """This process's argv as the kernel has it (what the watchdog compares to tell its trainer), else
    the interpreter and ``sys.argv``."""
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return [sys.executable, *sys.argv]
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


#: Keys of a relaunch's arguments that say where to resume (read by :meth:`WatchdogCallback.fit` itself).
_RESUME_KEYS = frozenset({catalog.RESUME_MODE_KEY, catalog.RESUME_PATH_KEY, SKIP_KEY})


class WatchdogCallback(TrainerCallback):
    """The run-directory protocol for one TRL run: in the trainer's ``callbacks``, then :meth:`train` in place
    of ``trainer.train()`` (see the module docstring)."""

    can_rollback = False
    """A TRL step loop cannot restore a checkpoint mid-run: rollback goes by relaunch."""
    run: TRLRun
    """The run's settings under verl's keys (given, or read from the trainer by :meth:`fit`)."""
    settings: LiveSettings
    recorder: RunRecorder
    applier: ControlApplier
    steps: StepBoundary
    faults: FaultSchedule

    def __init__(self, run_dir: Path | str | None = None, *, faults: str = "", metrics_port: int = 0,
                 run: TRLRun | None = None, command: Sequence[str] | None = None) -> None:
        """``run_dir``: where the run's files go; by default ``$WATCHDOG_RUN_DIR``, which ``watchdog run`` sets
        for its trainer (given both, they must be the same directory). ``faults``: injected faults
        (``kind@step[:arg]``, :data:`FAULT_KINDS`; a test's). ``metrics_port``: serve ``/metrics`` on 127.0.0.1
        (0 off, -1 any free port). ``run`` and ``command``: the demo entry point's settings and argv (a
        relaunch appends its arguments to the command); without them the settings are the trainer's and a
        relaunch's arguments come in ``$WATCHDOG_LAUNCH_ARGS``. ValueError when there is no run directory."""
        env = os.environ.get(rundir.RUN_DIR_ENV)
        if run_dir is None and not env:
            raise ValueError(f"WatchdogCallback: no run directory: give one (WatchdogCallback('runs/x')) or run the "
                             f"script under `watchdog run --run-dir DIR -- python ...`, which sets ${rundir.RUN_DIR_ENV}")
        if run_dir is not None and env and Path(run_dir).resolve() != Path(env).resolve():
            raise ValueError(f"WatchdogCallback: run directory {run_dir} is not the one the watchdog watches "
                             f"(${rundir.RUN_DIR_ENV}={env}): leave it out, or give that one")
        self.run_dir = Path(run_dir if run_dir is not None else str(env)).resolve()
        self.root = self.run_dir / rundir.CHECKPOINTS
        self._given = run
        self._faults = faults or (run.faults if run is not None else "")
        self._metrics_port = metrics_port or (run.metrics_port if run is not None else 0)
        self._command = list(command) if command is not None else None
        if run is not None:
            self.run = run
        self.trainer: Any = None
        self.resumed_from: Path | None = None
        self.skip_steps = 0
        self._unapplied: list[str] = []
        self._step = 0
        self._t0: float | None = None
        self._lr_used: float | None = None
        self._term = False

    # -- training -----------------------------------------------------------------------------
    def train(self, trainer: Any) -> Any:
        """``trainer.train()`` under the protocol: returns TRL's TrainOutput when training finishes; ends the
        process (SystemExit) with the protocol's exit code when it does not (:meth:`fit`)."""
        code, out = self.fit(trainer)
        if out is None:
            raise SystemExit(code)
        return out

    def fit(self, trainer: Any) -> tuple[int, Any]:
        """Bind ``trainer``, write run.json, resume, train; (exit code, TrainOutput or None when it did not finish).

        Exit codes, those the watchdog reads (:mod:`ppo_watchdog.protocol.rundir`): 0 finished, or stopped by a
        ``stop`` command or SIGTERM after saving; 2 a setting it cannot run; 75 out of memory (an ``oom`` event
        first); 1 anything else, after a ``nan`` event (non-finite weights: TRL's sampler raises "probability
        tensor contains either inf, nan or element < 0" before any metric of the step is logged) or an
        ``error`` event naming the exception."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            args = [] if self._given is not None else rundir.launch_args()
            run = self._given or from_trl(trainer, args)
            faults = FaultSchedule.parse(self._faults or None, self.run_dir)
            bad = [str(f) for f in faults.faults if f.kind not in FAULT_KINDS]
            if bad:
                raise TRLConfigError(f"faults: {', '.join(bad)} not injectable in a TRL run (kinds: {', '.join(FAULT_KINDS)})")
            resume = resume_point(run, self.root)
        except (ValueError, OSError) as exc:  # TRLConfigError, CheckpointError (an OSError), a bad $WATCHDOG_LAUNCH_ARGS
            log.error("config error: %s", exc)
            rundir.append_event(self.run_dir, "error", 0, message=f"config error: {exc}", source="trl")
            return rundir.EXIT_USAGE, None
        self.run, self.faults, self.resumed_from = run, faults, resume
        self.trainer = trainer
        self.settings = LiveSettings(run)
        self.settings.trainer = trainer
        # What a relaunch asked for that a script's own trainer, built already, cannot take (said at the start).
        self._unapplied = [a for a in args if verl_key(a.split("=", 1)[0].lstrip("+"), run.algorithm)
                           not in {*self.settings.keys, *_RESUME_KEYS, *IGNORED}]
        exporter = MetricsExporter(RunInfo.read(self.run_dir).id or self.run_dir.name, port=self._metrics_port)
        self.recorder = RunRecorder(self.run_dir, exporter)
        self.applier = ControlApplier(self.run_dir, live_keys=self.settings.accepted, on_event=self.recorder.count)
        self.steps = StepBoundary(self.applier, self, poll_s=PAUSE_POLL_S)
        items, self.skip_steps = skip_items(trainer.args, run.resume_skip_batches if resume is not None and
                                            run.resume_mode == "resume_path" else 0)
        if items:
            sampler = trainer._get_train_sampler

            def skipping(*a: Any, **k: Any) -> Any:  # the rollback's batches, once, in the epoch resumed
                return SkipFirst(sampler(*a, **k), items)

            trainer._get_train_sampler = skipping
        # Before run.json lists live keys: from then on the watchdog may send SIGUSR1.
        self.install_signals()
        self._write_run_json(run, exporter.port)
        try:
            try:
                out = trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
            except StopRequested as stop:
                log.warning("stopped at step %d: %s", self._step, stop.reason)
                return rundir.EXIT_STOPPED, None
            except Exception as exc:
                return self._failed(exc), None
            self.recorder.event("finished", int(trainer.state.global_step), steps=int(trainer.state.global_step))
            return 0, out
        finally:
            exporter.close()
            if hasattr(signal, "SIGUSR1"):  # a late nudge from the watchdog must not kill an exiting trainer
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    def _failed(self, exc: Exception) -> int:
        """The event and exit code of an exception that ended training."""
        step = int(self.trainer.state.global_step) + 1  # the step that failed
        fields = oom_fields(exc, self.run.micro)
        if fields is not None:
            self.recorder.event("oom", step, **fields)
            log.error("out of memory at step %d: %s", step, fields["message"])
            return rundir.EXIT_OOM
        if nan_like(exc):
            self.recorder.event("nan", step, what="generate", message=f"{type(exc).__name__}: {exc}"[:2000])
            log.error("non-finite values at step %d: %s", step, exc)
            return 1
        self.recorder.event("error", step, message=f"{type(exc).__name__}: {exc}"[:2000], source="trl")
        log.error("TRL run failed at step %d: %s", step, "".join(traceback.format_exception(exc))[-4000:])
        return 1

    def _write_run_json(self, run: TRLRun, metrics_port: int) -> None:
        """run.json: what the watchdog reads about this launch."""
        info = RunInfo.read(self.run_dir)
        info.replace(
            id=info.id or self.run_dir.name, command=self._command or _own_command(), pid=os.getpid(),
            cwd=os.getcwd(), mode="trl", trainer_mode=run.algorithm, started=time.time(), config=run.verl_config(),
            live_keys=list(self.settings.keys), commands=sorted(COMMAND_KINDS - {"rollback"}),
            metrics_port=metrics_port or None, checkpoint_dir=str(self.root), total_steps=run.total_training_steps,
            exit_codes={"oom": rundir.EXIT_OOM, "stopped": rundir.EXIT_STOPPED}, skip_batches_key=SKIP_KEY,
            launch_args="argv" if self._command is not None else "env",
        ).write(self.run_dir)

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
        if self.trainer is None:
            raise RuntimeError("WatchdogCallback: train with watchdog.train(trainer), not trainer.train(): it "
                               "writes run.json, resumes where the watchdog says and reports how the run ended")
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
        for arg in self._unapplied:
            self.recorder.event("error", self._step, source="launch",
                                message=f"{arg}: not applied: the script builds its own trainer before the watchdog's "
                                        "arguments are read; set it in the script")

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
        _move(src, dst)  # the folder appears whole; the manifest written last makes it count
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
