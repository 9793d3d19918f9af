"""The v1 trainer subclass that makes a verl run obey the run-directory protocol.

Registered with verl's ``register_trainer`` as ``watchdog_sync`` and chosen with
``trainer.v1.trainer_mode=watchdog_sync``; it *is* verl's synchronous trainer
(``PPOTrainerSync``) with four hooks, each a few lines:

- ``on_init_end`` (after workers, rollout replicas and ``_load_checkpoint``): run.json,
  the exporter, ``started``; a resumed run takes its lr from the config, not the
  checkpoint (verl's resume would bring the old lr back); the newest control.json
  overrides are applied before the first step.
- ``on_step_begin``: the step boundary, :class:`ppo_watchdog.trainer.verl_glue.boundary.ControlBoundary`.
- ``_compute_metrics``: after verl computed the step's metrics (validation included),
  one line in metrics.jsonl and the gauges on /metrics.
- ``_save_checkpoint``: after verl's own save (marker written), a manifest (so the watchdog
  can restart or roll back from it, :mod:`ppo_watchdog.trainer.verl_glue.manifest`) and a
  ``checkpoint`` event.
- A ``rollback`` command restores a checkpoint in the running trainer, at the step boundary
  (:meth:`WatchdogPPOTrainer._rollback_at_boundary`): what verl's own resume does at start-up (the
  actor and critic worker groups load the checkpoint: weights, optimizer, lr scheduler, RNG; the
  dataloader its ``data.pt``), then the step counter, the KL controller (from the config, as a
  relaunch has it: verl does not save it), the live overrides and the rollback's sets, and the
  weights pushed to the rollout replicas before the step generates. A run this cannot serve
  (:meth:`WatchdogPPOTrainer._restore_unsupported`) rolls back by restart.

Worker classes are swapped for :mod:`ppo_watchdog.trainer.verl_glue.workers` so the driver can reach
the optimizer, LambdaLR and loss function. Everything else (replay buffer, checkpoint
layout, resume) behaves as ``trainer_mode=sync``: the base class keys those on the mode
name, so the subclass reports ``sync`` once its class has been chosen.

SIGUSR1: the trainer runs in a Ray actor, not in the process the watchdog started. The
launcher (:mod:`ppo_watchdog.trainer.verl_glue.runner`) only makes SIGUSR1 harmless there; the actor
reads control.json at every step boundary anyway and a verl step cannot be interrupted,
so the signal changes nothing but the latency of a paused run (the pause loop polls
every second).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import create_rl_sampler
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.skip import SkipManager
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import COMMAND_KINDS
from ppo_watchdog.protocol.exporter import MetricsExporter
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.trainer.verl_glue import apply, workers
from ppo_watchdog.trainer.verl_glue.boundary import ControlBoundary, LiveSettings, RunRecorder, VerlTargets
from ppo_watchdog.trainer.verl_glue.manifest import ManifestWriter

log = logging.getLogger(__name__)

#: ``trainer.v1.trainer_mode`` that selects this trainer.
TRAINER_MODE = "watchdog_sync"
#: Config node the launcher adds: ``watchdog.run_dir``, ``watchdog.metrics_port``, ``watchdog.run_id``.
GLUE_NODE = "watchdog"
#: The engines whose checkpoints an in-process rollback loads through verl's own worker calls.
RESTORABLE_STRATEGIES = ("fsdp", "fsdp2")


class GlueConfigError(ValueError):
    """The run's config lacks what the glue needs (names the key)."""


def glue_settings(config: Any) -> tuple[Path, int, str]:
    """``(run_dir, metrics_port, run_id)`` from the config's ``watchdog`` node."""
    node = config.get(GLUE_NODE) if hasattr(config, "get") else None
    if node is None or not node.get("run_dir"):
        raise GlueConfigError(
            f"trainer.v1.trainer_mode={TRAINER_MODE} needs {GLUE_NODE}.run_dir: launch with "
            "`python -m ppo_watchdog.trainer.verl_glue --run-dir DIR ...` (or pass +watchdog.run_dir=DIR)")
    run_dir = Path(str(node.run_dir))
    return run_dir, int(node.get("metrics_port", 0) or 0), str(node.get("run_id") or run_dir.name)


def _one_value(results: Any, what: str) -> float:
    """The common result of a ONE_TO_ALL call (one per rank); ranks that disagree are an error."""
    values = [float(r) for r in (results if isinstance(results, list) else [results])]
    if not values or any(abs(v - values[0]) > 1e-12 * max(1.0, abs(values[0])) for v in values):
        raise RuntimeError(f"{what}: ranks disagree ({values})")
    return values[0]


def _refusal(exc: Exception, key: str, value: Any) -> apply.LiveSettingError:
    """A worker's exception as a LiveSettingError (Ray wraps it: ``RayTaskError.cause`` is the original)."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, apply.LiveSettingError):
        return apply.LiveSettingError(cause.key, cause.value, cause.reason)
    return apply.LiveSettingError(key, value, f"workers refused: {type(cause).__name__}: {cause}")


def _json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


@register_trainer(TRAINER_MODE)
class WatchdogPPOTrainer(PPOTrainerSync):
    """verl's sync trainer plus the run-directory protocol (metrics, events, control.json)."""

    glue: ControlBoundary | None = None
    recorder: RunRecorder | None = None
    manifests: ManifestWriter | None = None
    _training = False

    # -- behave as "sync" -------------------------------------------------------------------
    def _build_replay_buffer(self) -> Any:
        # Called from PPOTrainer.__init__ right after it stored the mode name, which picks the
        # replay buffer, the TransferQueue checkpointing and parameter_sync_step: all "sync".
        self.trainer_mode = "sync"
        self.parameter_sync_step = self.config.trainer.v1.get("sync", {}).get("parameter_sync_step", 1)
        return super()._build_replay_buffer()

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        swap = {ActorRolloutRefWorker: workers.WatchdogActorRolloutRefWorker,
                TrainingWorker: workers.WatchdogTrainingWorker}
        for role, remote_cls in list(self.role_worker_mapping.items()):
            base = getattr(remote_cls, "__ray_actor_class__", remote_cls)
            if base in swap:
                self.role_worker_mapping[role] = ray.remote(swap[base])

    # -- the driver's handles on the workers -------------------------------------------------
    def _set_lr(self, role: str, lr: float) -> float:
        key = apply.ACTOR_LR if role == "actor" else apply.CRITIC_LR
        wg = self.actor_rollout_wg if role == "actor" else getattr(self, "critic_wg", None)
        if wg is None:
            raise apply.LiveSettingError(key, lr, "this run has no critic")
        try:
            return _one_value(getattr(wg, workers.SET_LR)(lr, key), key)
        except Exception as exc:  # a worker-side failure must not end training: report it
            raise _refusal(exc, key, lr) from exc

    def _set_loss_coefs(self, changes: dict[str, float]) -> dict[str, float]:
        try:
            results = getattr(self.actor_rollout_wg, workers.SET_LOSS_COEFS)(changes)
        except Exception as exc:
            raise _refusal(exc, ", ".join(changes), changes) from exc
        return dict(results[0] if isinstance(results, list) else results)

    # -- hooks ---------------------------------------------------------------------------------
    def on_init_end(self) -> None:
        super().on_init_end()
        run_dir, port, run_id = glue_settings(self.config)
        run_dir.mkdir(parents=True, exist_ok=True)
        exporter = MetricsExporter(run_id, port=port)
        self.recorder = RunRecorder(run_dir, exporter)
        settings = LiveSettings(VerlTargets(self.config, getattr(self, "kl_ctrl_in_reward", None),
                                            self._set_lr, self._set_loss_coefs))
        restore = self._restore_unsupported() is None
        self.glue = ControlBoundary(run_dir, settings, self.recorder, self._save_at_boundary,
                                    self._rollback_at_boundary if restore else None, self._check_rollback)
        resumed_from = int(self.global_steps)
        restored = self._config_lr_wins(settings) if resumed_from > 0 else {}
        skipped = self._skip_batches(int(self.config.get(GLUE_NODE, {}).get("resume_skip_batches", 0) or 0)) \
            if resumed_from > 0 else 0
        applied = self.glue.start(resumed_from)
        self._write_run_json(run_dir, run_id, exporter.port, settings.live_keys)
        if threading.current_thread() is threading.main_thread():
            self.glue.applier.install_signal_handler()  # wakes a paused run at once
        self.recorder.event("started", resumed_from, resumed_from=resumed_from, applied=applied,
                            lr_from_config=restored, total_steps=int(self.total_training_steps),
                            trainer_mode=TRAINER_MODE, **({"skipped_batches": skipped} if skipped else {}))

    def _skip_batches(self, steps: int) -> int:
        """Draw and drop the batches of ``steps`` steps through verl's own fetch (a rollback's ``skip_batches``:
        the data that led to the divergence is not trained on again); returns the steps skipped."""
        data = self.config.data
        per_step = math.ceil(int(data.train_batch_size) / int(data.get("gen_batch_size", None) or data.train_batch_size))
        for _ in range(max(0, steps) * per_step):
            self._fetch_one_gen_batch()
        return max(0, steps)

    def _config_lr_wins(self, settings: LiveSettings) -> dict[str, float]:
        """After a resume: the configured lr, not the checkpoint's (verl reloads the old one)."""
        wanted = {k: float(OmegaConf.select(self.config, k)) for k in (apply.ACTOR_LR, apply.CRITIC_LR)
                  if k in settings.live_keys}
        applied, errors = settings.apply(wanted)
        for message in errors:
            assert self.recorder is not None
            self.recorder.event("error", int(self.global_steps), message=message, source="resume")
        return applied

    def on_train_begin(self) -> None:
        super().on_train_begin()
        self._training = True

    def _validate(self) -> dict[str, float]:
        val = super()._validate()
        if self.recorder is not None and not self._training and val:
            # Validation before training is logged by verl outside _compute_metrics: record it here.
            self.recorder.metrics(int(self.global_steps), val)
        return val

    def on_step_begin(self) -> None:
        super().on_step_begin()
        if self.glue is not None:
            t0 = time.monotonic()
            self.glue.at_boundary(int(self.global_steps) - 1)
            # verl calls this inside marked_timer("step") (trainer_base.py, fit), which adds the step's
            # time to timing_raw["step"]: seed it with minus the boundary's (a pause for a human, a
            # boundary save), so perf/time_per_step and the throughput are the step's own.
            spent = time.monotonic() - t0
            timing = getattr(self, "timing_raw", None)
            if isinstance(timing, dict):
                timing["step"] = timing.get("step", 0.0) - spent
                timing["watchdog_boundary"] = timing.get("watchdog_boundary", 0.0) + spent

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        if self.recorder is not None:
            self.recorder.metrics(int(global_steps), metrics)

    def _save_checkpoint(self) -> None:
        super()._save_checkpoint()
        if self.recorder is None:
            return
        step = int(self.global_steps)
        path = Path(self.config.trainer.default_local_dir, f"global_step_{step}").resolve()
        epoch = (step - 1) // max(1, int(self.steps_per_epoch))
        if self.config.actor_rollout_ref.actor.get("checkpoint", {}).get("async_save", False):
            # Still being written when verl returns: no manifest, so the watchdog never trusts it.
            self.recorder.event("checkpoint", step, path=str(path), epoch=epoch, layout="verl", manifest=False)
            return
        recorder = self.recorder

        def vouched(where: Path, exc: Exception | None) -> None:
            if exc is not None:
                recorder.event("error", step, message=f"checkpoint manifest not written: {exc}", source="checkpoint")
            else:
                recorder.event("checkpoint", step, path=str(where), epoch=epoch, layout="verl", manifest=True)

        if self.manifests is None:
            self.manifests = ManifestWriter()
        trainer_cfg = self.config.trainer
        world = int(trainer_cfg.n_gpus_per_node) * int(trainer_cfg.nnodes)
        # Hashed in the background: the step (and verl's step timer) goes on at once.
        self.manifests.submit(path, step, epoch, vouched, world_size=world,
                              components=("actor", "critic") if getattr(self, "use_critic", False) else ("actor",))

    def _save_at_boundary(self) -> None:
        """Save the state after the last completed step (a ``checkpoint`` or ``stop`` command).

        At the boundary verl's counter already names the next step, so the save is labelled
        with the step it holds; a step verl already saved on schedule is not saved twice.
        """
        done = int(self.global_steps) - 1
        marker = Path(self.config.trainer.default_local_dir) / rundir.LATEST_MARKER
        try:
            if int(marker.read_text().strip()) == done:
                log.info("step %d is already saved (%s)", done, marker)
                return
        except (OSError, ValueError):
            pass
        self.global_steps = done
        try:
            self._save_checkpoint()
        finally:
            self.global_steps = done + 1

    # -- rollback in process ----------------------------------------------------------------
    def _restore_unsupported(self) -> str | None:
        """Why this run cannot restore a checkpoint in process (None: it can)."""
        if str(self.config.get(GLUE_NODE, {}).get("rollback", "in-process")) != "in-process":
            return "launched with --rollback restart"
        actor = self.config.actor_rollout_ref.actor
        strategy = str(actor.get("strategy", "fsdp"))
        if strategy not in RESTORABLE_STRATEGIES:
            return f"actor strategy {strategy} (in process: {', '.join(RESTORABLE_STRATEGIES)})"
        if actor.get("checkpoint", {}).get("async_save", False):
            return "checkpoints are saved asynchronously"
        if int(self.config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0:
            return "a LoRA run (its rollout holds merged weights)"
        return None

    def _check_rollback(self, args: Mapping[str, Any]) -> str | None:
        """Why the checkpoint a ``rollback`` command names cannot be restored at this boundary (None: it can).
        Asked only where the run restores in process at all (:meth:`_restore_unsupported`, once, at start-up)."""
        step = args.get("to_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            return f"no checkpoint step to restore ({step!r}; the initial weights are a restart's)"
        if step >= int(self.global_steps):
            return f"step {step} is not before the step about to run ({int(self.global_steps)})"
        if int(self.global_steps) >= int(self.total_training_steps):
            return "the run is at its last step (verl's loop ends after it whatever the step counter says)"
        root = Path(self.config.trainer.default_local_dir).resolve()
        path = Path(str(args.get("path", ""))).resolve()
        if path.name != f"global_step_{step}" or root not in path.parents:
            return f"{path} is not a checkpoint of step {step} under {root}"
        if self.manifests is not None:
            self.manifests.wait()
        try:
            ckpt.verify_checkpoint(path)
        except ckpt.CheckpointError as exc:
            return str(exc)
        roles = ["actor", "critic"] if getattr(self, "use_critic", False) else ["actor"]
        missing = [p for p in (*roles, "data.pt") if not (path / p).exists()]
        return f"{path} lacks {', '.join(missing)}" if missing else None

    def _rollback_at_boundary(self, args: Mapping[str, Any]) -> None:
        """Restore the checkpoint ``args`` name in this running trainer, before the step about to run.

        What verl's resume does at start-up (``_setup``: sleep the replicas, ``_load_checkpoint``), from
        its own worker calls: the actor and critic worker groups load the checkpoint (weights, optimizer,
        lr scheduler, RNG); the dataloader is built anew and loads ``data.pt``, then draws ``skip_batches``
        steps' batches through verl's own fetch; the step counter names the step after the checkpoint. Then what a
        relaunch gets: the KL controller at its configured value, the configured lr over the
        checkpoint's, the live overrides and the rollback's sets. Last, verl's own weight sync pushes the
        restored actor to the rollout replicas (``on_init_end``'s), so the next step generates with it.
        The newer checkpoints go aside first: a crash from here on resumes from the restored one.
        """
        assert self.glue is not None and self.recorder is not None
        t0 = time.monotonic()
        step, skip = int(args["to_step"]), int(args.get("skip_batches") or 0)
        path = Path(str(args["path"])).resolve()  # (verl's own folder, or the watchdog's kept link of it)
        from_step = int(self.global_steps) - 1
        ckpt.set_aside_newer(Path(self.config.trainer.default_local_dir), step, f"rollback-{args.get('id') or from_step}")
        self.checkpoint_manager.sleep_replicas()
        self.actor_rollout_wg.load_checkpoint(local_path=str(path / "actor"), del_local_after_load=False)
        getattr(self.actor_rollout_wg, workers.FORGET_SAVES)(step)
        if getattr(self, "use_critic", False):
            self.critic_wg.load_checkpoint(local_path=str(path / "critic"), del_local_after_load=False)
            getattr(self.critic_wg, workers.FORGET_SAVES)(step)
        # As verl builds it at start-up (a fresh sampler, seeded from the config: the state in data.pt does not
        # carry the shuffle of the epochs after it), then its state; a dataloader state is plain data.
        old = self.train_dataloader
        self.train_dataloader = type(old)(dataset=old.dataset, batch_size=old.batch_size, num_workers=old.num_workers,
                                          drop_last=old.drop_last, collate_fn=old.collate_fn,
                                          sampler=create_rl_sampler(self.config.data, old.dataset))
        self.train_dataloader.load_state_dict(torch.load(path / "data.pt", weights_only=True))
        self.train_dataloader_it = None
        self._skip_batches(skip)
        self.global_steps = step + 1
        SkipManager.set_step(self.global_steps)
        kl_ctrl = getattr(self, "kl_ctrl_in_reward", None)
        if kl_ctrl is not None:
            # As a relaunch starts it: verl does not save the controller, so from the configured value (which
            # follows every live set); an adaptive controller adapts from there.
            kl_ctrl.value = float(self.config.algorithm.kl_ctrl.kl_coef)
        settings = self.glue.settings
        settings.forget()  # the checkpoint brought its own values back: every override is sent again
        lr = self._config_lr_wins(settings)
        applied, errors = settings.apply({**self.glue.applier.current_overrides(), **dict(args.get("set") or {})})
        for message in errors:
            self.recorder.event("error", step, message=message, source="rollback")
        self.checkpoint_manager.update_weights(step)
        self.recorder.event("rollback", step, from_step=from_step, to_step=step, path=str(path),
                            skip_batches=skip, in_process=True, seconds=round(time.monotonic() - t0, 3),
                            lr_from_config=lr, applied=applied)

    # -- run.json and the end ---------------------------------------------------------------
    def _write_run_json(self, run_dir: Path, run_id: str, port: int, live_keys: tuple[str, ...]) -> None:
        info = RunInfo.read(run_dir)  # the launcher's: id, command, pid (the process to signal)
        info.replace(
            id=info.id or run_id, live_keys=list(live_keys), metrics_port=port,
            config=_json_safe(OmegaConf.to_container(self.config, resolve=True)),
            trainer_pid=os.getpid(), trainer_host=socket.gethostname(), trainer_mode=TRAINER_MODE,
            total_steps=int(self.total_training_steps), steps_per_epoch=int(self.steps_per_epoch),
            checkpoint_dir=str(Path(self.config.trainer.default_local_dir).resolve()),
            exit_codes={"oom": rundir.EXIT_OOM, "stopped": rundir.EXIT_STOPPED},
            commands=sorted(COMMAND_KINDS if self.glue is not None and self.glue.can_rollback
                            else COMMAND_KINDS - {"rollback"}),
            started=info.started if info.started is not None else time.time(),
        ).write(run_dir)

    def watchdog_finish(self, kind: str = "finished", **fields: Any) -> None:
        """The last event of the run and the exporter closed (the runner calls it)."""
        if self.recorder is None:
            return
        if self.manifests is not None:
            self.manifests.close()  # the last save (a stop's) is vouched for before the run's last event
        if kind:
            self.recorder.event(kind, int(self.global_steps) - 1, **fields)
        self.recorder.exporter.close()
