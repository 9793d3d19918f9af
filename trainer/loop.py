"""The training loop and its run directory: ``python -m ppo_watchdog.trainer [key=value ...]``.

One step reads top to bottom: control boundary (control.json, pause, stop, rollback),
faults, rollout, score, log-probs and values, KL penalty and GAE, actor and critic
updates, metrics, validation, checkpoint. Everything the watchdog needs goes through
the run directory (trainer/rundir.py): run.json, metrics.jsonl, events.jsonl,
control.json and checkpoints/ in verl's layout.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol.control import ControlApplier, StepBoundary
from ppo_watchdog.protocol.events import RESUME_FAILED
from ppo_watchdog.protocol.exporter import MetricsExporter
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.trainer import data as data_mod
from ppo_watchdog.trainer import ppo, verl_like
from ppo_watchdog.trainer.config import Config, ConfigError
from ppo_watchdog.trainer.faults import Fault, FaultSchedule, MemoryBudget
from ppo_watchdog.trainer.model import Critic
from ppo_watchdog.trainer.sft import SFTSettings, cache_root, ensure_sft, load_sft

log = logging.getLogger(__name__)

ACTOR_LR = "actor_rollout_ref.actor.optim.lr"
CRITIC_LR = "critic.optim.lr"
KL_COEF = "algorithm.kl_ctrl.kl_coef"
ACTOR_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"
#: Steps in the KL std window (actor/reward_kl_penalty_std; the rules' std(kl, 10)).
KL_STD_STEPS = 10


#: What a checkpoint of the embedded trainer holds, by component: all of it is needed to restore.
_STATE_PARTS = {"actor": ("model", "optimizer", "lr_scheduler"), "critic": ("model", "optimizer", "lr_scheduler"),
                "data": ("sampler",)}

class StopTraining(Exception):
    """Raised inside the loop to end the run with an exit code after state is saved."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class Summary:
    """What a run did, for the end-of-run table and the caller."""

    exit_code: int = 0
    """Process exit code."""
    steps: int = 0
    """Last completed global step."""
    first_val: float | None = None
    """Validation score before training (or the first one measured)."""
    last_val: float | None = None
    """Last validation score."""
    kl_over_threshold: int = 0
    """Steps with KL mean above 0.1."""
    events: dict[str, int] = field(default_factory=dict)
    """Event counts by kind."""
    seconds: float = 0.0
    """Wall time of the loop."""
    last_metrics: dict[str, float] = field(default_factory=dict)
    """The last step's metrics."""


@dataclass
class StepStart:
    """What a step changes besides the weights, as it was before the step (cheap to keep each step)."""

    sampler: dict[str, int]
    """Data sampler state before the step's batch was drawn."""
    rng: torch.Tensor
    """Sampling generator state."""
    torch_rng: torch.Tensor
    """torch's global RNG state."""
    kl_coef: float
    """KL controller value (an adaptive one moves during the step)."""
    kl_std_window: list[float]
    """Last steps' KL means (the step pushes its own)."""
    optimizer_steps: tuple[int, int]
    """Optimizer steps taken so far by the actor and the critic."""


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer has taken (Adam's per-parameter ``step``; 0 before the first)."""
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def _lambda_warmup(warmup: int) -> Any:
    def f(step: int) -> float:
        return 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)
    return f


def set_lr(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """Change the lr for good: param_groups AND the scheduler's base_lrs (else LambdaLR puts it back)."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr * factor


class Trainer:
    """One PPO run in one run directory."""

    def __init__(self, cfg: Config, argv: Sequence[str] | None = None) -> None:
        self.cfg = cfg
        self.argv = list(argv) if argv is not None else [sys.executable, "-m", "ppo_watchdog.trainer", *sys.argv[1:]]
        t = cfg.trainer
        torch.set_num_threads(max(1, t.num_threads))
        self.run_dir = Path(t.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_root = Path(t.default_local_dir) if t.default_local_dir else self.run_dir / rundir.CHECKPOINTS
        # false: an unmodified verl run's behaviour (trainer/verl_like.py), for the zero-patch watchdog.
        self.protocol = t.run_dir_protocol
        self.tracking: Any = None
        self._term = False
        self._summary = Summary()
        self._t0 = time.time()

        # -- data ------------------------------------------------------------------------
        train_files, val_files = cfg.data.train_files, cfg.data.val_files
        if not train_files:
            d = cfg.data
            key = cfg.settings_hash(["data.train_size", "data.val_size", "data.max_operand", "data.data_seed",
                                      "data.val_heldout"])
            tr, va = data_mod.write_synthetic(cache_root() / f"data-{key}", d.train_size, d.val_size,
                                              d.max_operand, d.data_seed, d.val_heldout)
            train_files, val_files = str(tr), val_files or str(va)
        self.train = data_mod.load_examples(
            train_files, cfg.data.prompt_key,
            response_key=cfg.data.response_key if cfg.data.offline else None, reward_key=cfg.data.reward_key)
        self.val = data_mod.load_examples(val_files, cfg.data.prompt_key) if val_files else []

        # -- models: SFT warm start is the reference and the init of actor and critic -----
        m = cfg.actor_rollout_ref.model
        if m.path:
            sft_dir, self.sft_info = Path(m.path), dict[str, float]()
        else:
            settings = SFTSettings(
                train_files=train_files if not cfg.data.offline else train_files, n_layer=m.n_layer,
                n_embd=m.n_embd, n_head=m.n_head,
                n_positions=cfg.data.max_prompt_length + cfg.data.max_response_length,
                max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
                seed=t.seed)
            sft_dir, self.sft_info = ensure_sft(settings, val_files or None, progress=t.progress)
        self.sft_dir = sft_dir
        self.policy, self.tokenizer = load_sft(sft_dir)
        self.ref, _ = load_sft(sft_dir)
        self.ref.eval().requires_grad_(False)
        self.critic = Critic(self.policy)
        a, c = cfg.actor_rollout_ref.actor, cfg.critic
        self.actor_opt = torch.optim.AdamW(self.policy.parameters(), lr=a.optim.lr, weight_decay=a.optim.weight_decay)
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=c.optim.lr, weight_decay=c.optim.weight_decay)
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_opt, _lambda_warmup(a.optim.lr_warmup_steps))
        self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, _lambda_warmup(c.optim.lr_warmup_steps))
        self.kl_ctrl = ppo.kl_controller(cfg.algorithm)
        self.kl_std = ppo.StepStd(KL_STD_STEPS)
        self.sampler = data_mod.BatchSampler(len(self.train), cfg.data.train_batch_size, t.seed)
        self.gen = torch.Generator().manual_seed(t.seed)
        self.global_step = 0
        self.skipped_batches = 0
        """Batches skipped after a resume_path checkpoint (trainer.resume_skip_batches)."""
        self.total_steps = t.total_training_steps or t.total_epochs * self.sampler.steps_per_epoch

        # -- run directory plumbing ----------------------------------------------------------
        self.faults = FaultSchedule.parse(t.faults, self.run_dir)
        self.budget = MemoryBudget(t.memory_budget_tokens)
        # The run is its directory's name, the name the watchdog knows it by, so the `run` label of
        # its series is the same everywhere (Prometheus source, dashboards); a resume keeps the id.
        self.run_id = RunInfo.read(self.run_dir).id or self.run_dir.name
        self.exporter = MetricsExporter(self.run_id, port=t.metrics_port, addr=t.metrics_addr)
        # Control events (applied, error) are recorded by the applier itself; count them on /metrics too.
        self.control = ControlApplier(self.run_dir, on_event=lambda e: self.exporter.count_event(e["kind"]))
        self.steps = StepBoundary(self.control, self)
        self._poison = False
        self._oom_fault = False  # an injected OOM is pending this step
        self.resumed_from: int | None = None
        """The step of the checkpoint this launch resumed from (None: a fresh start)."""

    # -- run.json / events -------------------------------------------------------------------
    def _write_run_json(self) -> None:
        RunInfo(
            id=self.run_id, command=self.argv, config=self.cfg.to_dict(), pid=os.getpid(),
            live_keys=list(catalog.LIVE_KEYS), metrics_port=self.exporter.port, cwd=os.getcwd(),
            started=time.time(), total_steps=self.total_steps, steps_per_epoch=self.sampler.steps_per_epoch,
            sft_dir=str(self.sft_dir), exit_codes={"oom": rundir.EXIT_OOM, "stopped": rundir.EXIT_STOPPED},
            skip_batches_key="trainer.resume_skip_batches", ray_job_id=ray_job_id(os.environ),
        ).write(self.run_dir)

    def event(self, kind: str, **fields: Any) -> None:
        """Record an event (events.jsonl + the exporter's counter); verl-like: the counter only."""
        if self.protocol:
            rundir.append_event(self.run_dir, kind, self.global_step, **fields)
        self.exporter.count_event(kind)
        self._summary.events[kind] = self._summary.events.get(kind, 0) + 1

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """Checkpoint components (verl's actor/critic/data) and extra (RNG, KL controller)."""
        components = {
            "actor": {"model": self.policy.state_dict(), "optimizer": self.actor_opt.state_dict(),
                      "lr_scheduler": self.actor_sched.state_dict()},
            "critic": {"model": self.critic.state_dict(), "optimizer": self.critic_opt.state_dict(),
                       "lr_scheduler": self.critic_sched.state_dict()},
            "data": {"sampler": self.sampler.state_dict()},
        }
        extra = {"global_step": self.global_step, "rng": self.gen.get_state(),
                 "torch_rng": torch.get_rng_state(), "kl_coef": float(self.kl_ctrl.value),
                 # The configured starting value when this was saved: a resume with another one (a
                 # watchdog's remedy) restarts an adaptive controller from it (load_state).
                 "kl_coef_config": float(self.cfg.get(KL_COEF)),
                 "kl_std_window": self.kl_std.state(),
                 "micro_batch": {ACTOR_MICRO: self.cfg.get(ACTOR_MICRO), CRITIC_MICRO: self.cfg.get(CRITIC_MICRO)}}
        return components, extra

    def load_state(self, components: dict[str, dict[str, Any]], extra: dict[str, Any], path: Path) -> None:
        """Restore a checkpoint; lr and a fixed kl_coef then follow the current config (live changes win).

        CheckpointError naming ``path`` and what is missing when the checkpoint lacks a part (a manifest
        that lists only some files verifies, yet cannot be restored)."""
        missing = [f"{c}/{k}" for c, keys in _STATE_PARTS.items() for k in keys
                   if not isinstance(components.get(c), dict) or k not in components[c]]
        missing += [k for k in ("rng", "torch_rng", "global_step") if k not in extra]
        if missing:
            raise ckpt.CheckpointError(path, f"lacks {', '.join(missing)}: cannot be restored")
        self.policy.load_state_dict(components["actor"]["model"])
        self.actor_opt.load_state_dict(components["actor"]["optimizer"])
        self.actor_sched.load_state_dict(components["actor"]["lr_scheduler"])
        self.critic.load_state_dict(components["critic"]["model"])
        self.critic_opt.load_state_dict(components["critic"]["optimizer"])
        self.critic_sched.load_state_dict(components["critic"]["lr_scheduler"])
        self.sampler.load_state_dict(components["data"]["sampler"])
        self.gen.set_state(extra["rng"])
        torch.set_rng_state(extra["torch_rng"])
        self.global_step = int(extra["global_step"])
        # Checkpoints from before the KL std window was saved restart it empty.
        self.kl_std.load(extra.get("kl_std_window", []))
        # verl's trap: a checkpoint's lr would silently override a new optim.lr; here the config wins.
        set_lr(self.actor_opt, self.actor_sched, self.cfg.get(ACTOR_LR))
        set_lr(self.critic_opt, self.critic_sched, self.cfg.get(CRITIC_LR))
        # An adaptive controller's value is learned state; a fixed one is the config's. A configured
        # value other than the one the checkpoint was saved with (a remedy that raised kl_coef, set
        # before the rollback or passed to the relaunch) is the adaptive controller's new starting
        # point: it adapts onward from there toward its own target_kl.
        configured = float(self.cfg.get(KL_COEF))
        saved = extra.get("kl_coef_config")
        adaptive = self.cfg.algorithm.kl_ctrl.type == "adaptive"
        moved = saved is not None and float(saved) != configured
        self.kl_ctrl.value = float(extra["kl_coef"]) if adaptive and not moved else configured

    def save(self, reason: str = "schedule") -> Path:
        """Save a checkpoint of the current step and record a ``checkpoint`` event."""
        if not self.protocol:
            return verl_like.save(self)
        components, extra = self.state()
        epoch = self.sampler.epoch if self.sampler.position < self.sampler.steps_per_epoch else self.sampler.epoch + 1
        path = ckpt.save_checkpoint(self.ckpt_root, self.global_step, epoch, components, extra,
                                    keep=self.cfg.trainer.max_actor_ckpt_to_keep)
        self.event("checkpoint", path=str(path), epoch=epoch, reason=reason)
        return path

    def _save_snapshot(self, snap: tuple[dict[str, dict[str, Any]], dict[str, Any]], reason: str) -> Path:
        components, extra = snap
        step = int(extra["global_step"])
        sampler = components["data"]["sampler"]
        # Completed epochs, as save() counts them: a sampler at the end of its epoch has finished it.
        epoch = int(sampler["epoch"]) + (1 if int(sampler["position"]) >= self.sampler.steps_per_epoch else 0)
        path = ckpt.save_checkpoint(self.ckpt_root, step, epoch, components, extra,
                                    keep=self.cfg.trainer.max_actor_ckpt_to_keep)
        rundir.append_event(self.run_dir, "checkpoint", step, path=str(path), epoch=epoch, reason=reason)
        self.exporter.count_event("checkpoint")
        return path

    def step_start(self) -> StepStart:
        """The non-weight state before a step (for :meth:`save_after_oom`)."""
        return StepStart(dict(self.sampler.state_dict()), self.gen.get_state(), torch.get_rng_state(),
                         float(self.kl_ctrl.value), self.kl_std.state(),
                         (optimizer_steps(self.actor_opt), optimizer_steps(self.critic_opt)))

    def save_after_oom(self, snap: tuple[dict[str, dict[str, Any]], dict[str, Any]] | None,
                       start: StepStart) -> Path | None:
        """Checkpoint the last completed step before exiting 75, so a restart redoes the failed one.

        A deep snapshot (taken when an OOM is foreseeable: a memory budget is set or an oom
        fault is pending) is saved as it is. Without one, the live weights are still the last
        step's as long as no optimizer stepped in the failed step (an OOM in the rollout, the
        log-probs or the first mini batch, where a real one strikes first): they are saved
        with the sampler, RNGs and KL coefficient of ``start``. After an optimizer step they
        are half-updated, a state no step produced; guarding against that means copying every
        weight and optimizer state each step (~20 ms, ~5% of a default step), so instead the
        restart resumes from the last periodic checkpoint (returns None).
        """
        if snap is not None:
            snap[1]["global_step"] = self.global_step - 1
            return self._save_snapshot(snap, "oom")
        if (optimizer_steps(self.actor_opt), optimizer_steps(self.critic_opt)) != start.optimizer_steps:
            log.warning("out of memory after an optimizer step of step %d: weights are half-updated, not saved; "
                        "a restart resumes from the last periodic checkpoint", self.global_step)
            return None
        components, extra = self.state()
        components["data"]["sampler"] = start.sampler
        extra.update(global_step=self.global_step - 1, rng=start.rng, torch_rng=start.torch_rng,
                     kl_coef=start.kl_coef, kl_std_window=start.kl_std_window)
        return self._save_snapshot((components, extra), "oom")

    def resume(self) -> None:
        """resume_mode auto | disable | resume_path."""
        t = self.cfg.trainer
        if not self.protocol:
            verl_like.resume(self)
            return
        info: ckpt.CheckpointInfo | None = None
        if t.resume_mode == "auto":
            info = self._resume_newest_usable()
        elif t.resume_mode == "resume_path":
            try:
                info = ckpt.verify_checkpoint(t.resume_from_path)
                components, extra = ckpt.load_checkpoint(info.path)
                self.load_state(components, extra, info.path)
            except ckpt.CheckpointError as exc:
                # Said as the protocol says it: a watchdog that chose this checkpoint relaunches from the one
                # before it; a person who named it gets exit 2, their configuration error (run_cli).
                self.event("error", what=RESUME_FAILED, path=str(t.resume_from_path), message=str(exc),
                           source="resume")
                raise
        if info is None:
            return
        self.resumed_from = info.step
        log.info("resumed from %s (step %d)", info.path, self.global_step)
        if t.resume_mode == "resume_path" and info.path.parent.resolve() == self.ckpt_root.resolve():
            # A rollback by restart: as in process, checkpoints of the abandoned timeline (the one
            # SIGTERM saved while stopping us included) must not be what a later resume picks up.
            ckpt.discard_newer(self.ckpt_root, info.step)
        if t.resume_mode == "resume_path" and t.resume_skip_batches:
            self.sampler.skip(t.resume_skip_batches)
            self.skipped_batches = t.resume_skip_batches
            log.info("skipped %d batches after the checkpoint", t.resume_skip_batches)

    def _resume_newest_usable(self) -> ckpt.CheckpointInfo | None:
        """resume_mode auto: the newest complete checkpoint that restores; an unusable one is skipped, said."""
        for info in sorted((c for c in ckpt.list_checkpoints(self.ckpt_root) if c.complete),
                           key=lambda c: c.step, reverse=True):
            try:
                components, extra = ckpt.load_checkpoint(info.path)
                self.load_state(components, extra, info.path)
                return info
            except ckpt.CheckpointError as exc:
                log.warning("not resuming from %s: %s; trying the one before", info.path, exc)
                self.event("error", what="checkpoint", message=str(exc))
        return None

    # -- live settings --------------------------------------------------------------------------
    def apply_live(self, key: str, value: Any) -> Any:
        """Apply one live override at a step boundary; returns the value in force."""
        before = self.cfg.get(key) if key in (catalog.CLIP_RATIO_KEY, KL_COEF) else None
        stored = self.cfg.set(key, value)
        if key == KL_COEF:
            # control.json is desired state, applied whole at each new version: the same kl_coef again
            # must not reset what an adaptive controller has learned since (never fight it).
            if self.cfg.algorithm.kl_ctrl.type != "adaptive" or before is None or float(before) != float(stored):
                self.kl_ctrl.value = float(stored)
        elif key == ACTOR_LR:
            set_lr(self.actor_opt, self.actor_sched, float(stored))
        elif key == CRITIC_LR:
            set_lr(self.critic_opt, self.critic_sched, float(stored))
        elif key == catalog.CLIP_RATIO_KEY:
            # verl's clip_ratio_low/high win over clip_ratio: bounds that are set move by the same
            # factor (an asymmetric clip-higher keeps its shape); unset ones follow clip_ratio anyway.
            low, high = catalog.moved_clip_bounds(before, float(stored), self.cfg.get(catalog.CLIP_LOW_KEY),
                                                  self.cfg.get(catalog.CLIP_HIGH_KEY))
            for bound_key, bound in ((catalog.CLIP_LOW_KEY, low), (catalog.CLIP_HIGH_KEY, high)):
                if bound is not None:
                    self.cfg.set(bound_key, bound)
        return stored

    def apply_overrides(self, overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Apply overrides; (applied, errors). A bad value is reported and skipped, the rest applied."""
        applied, errors = {}, []
        for key, value in overrides.items():
            try:
                applied[key] = self.apply_live(key, value)
            except ConfigError as exc:
                errors.append(str(exc))
        return applied, errors

    # -- the step boundary: control.json (ppo_watchdog.protocol.control.StepBoundary) ----------------
    can_rollback = True
    """This trainer restores checkpoints in process (a ``rollback`` command)."""

    def boundary(self) -> None:
        """Apply control.json (overrides, then one-shot commands); honour SIGTERM."""
        if not self.protocol:  # verl reads no control.json
            if self._term:
                self.stop("SIGTERM")
            return
        self.steps.at_boundary(self.global_step)

    def apply(self, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The dispatcher's hook: :meth:`apply_overrides`."""
        return self.apply_overrides(dict(overrides))

    def checkpoint(self, reason: str) -> None:
        """The dispatcher's hook: save now."""
        self.save(reason=reason)

    def should_stop(self) -> str | None:
        """The dispatcher's hook: SIGTERM arrived."""
        return "SIGTERM" if self._term else None

    def stop(self, reason: str) -> NoReturn:
        """Save and end the run with exit code 0."""
        self.save(reason=f"stop ({reason})")
        self.event("stopped", reason=reason)
        raise StopTraining(rundir.EXIT_STOPPED, reason)

    def _rollback_source(self, args: Mapping[str, Any]) -> ckpt.CheckpointInfo:
        """The checkpoint a rollback names (path, or to_step, else the newest complete); CheckpointError if unusable."""
        if args.get("path"):
            return ckpt.verify_checkpoint(args["path"])
        if args.get("to_step") is not None:
            return ckpt.verify_checkpoint(ckpt.step_dir(self.ckpt_root, int(args["to_step"])))
        found = ckpt.latest_complete(self.ckpt_root)
        if found is None:
            raise ckpt.CheckpointError(self.ckpt_root, "no complete checkpoint to roll back to")
        return found

    def check_rollback(self, args: Mapping[str, Any]) -> str | None:
        """The dispatcher's hook, before a rollback is confirmed: why it cannot be done (None when it can)."""
        try:
            self._rollback_source(args)
        except (ckpt.CheckpointError, ValueError) as exc:
            return f"rollback: {exc}"
        return None

    def rollback(self, args: Mapping[str, Any]) -> None:
        """Restore a checkpoint (path, or to_step, else the newest complete) and skip batches."""
        from_step = self.global_step
        info = self._rollback_source(args)
        components, extra = ckpt.load_checkpoint(info.path)
        self.load_state(components, extra, info.path)
        if info.path.parent.resolve() == self.ckpt_root.resolve():
            # Checkpoints of the abandoned timeline must not be what a later resume picks up.
            ckpt.discard_newer(self.ckpt_root, info.step)
        skip = int(args.get("skip_batches") or 0)
        self.sampler.skip(skip)
        self.event("rollback", from_step=from_step, to_step=self.global_step, path=str(info.path),
                   skip_batches=skip)

    def _signals(self) -> None:
        def on_term(signum: int, frame: Any) -> None:
            self._term = True
        if threading.current_thread() is not threading.main_thread():
            return  # embedded in another thread (tests): Python only lets the main thread set handlers
        signal.signal(signal.SIGTERM, on_term)
        self.control.install_signal_handler()

    def _ignore_wakeups(self) -> None:
        """Exiting: a late SIGUSR1 (a watchdog acting on the last step) must not kill the trainer."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    # -- faults -----------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> None:
        """Apply one scheduled fault at this step."""
        self.event("fault", fault=fault.kind, arg=fault.arg)
        arg = fault.value
        if fault.kind == "lr_spike":
            # The optimizer only, not the config: a rollback (which re-applies the config) undoes it.
            for opt, sched in ((self.actor_opt, self.actor_sched), (self.critic_opt, self.critic_sched)):
                set_lr(opt, sched, float(sched.base_lrs[0]) * float(arg if arg is not None else 10.0))
        elif fault.kind == "kl_collapse":
            self.kl_ctrl.value = float(self.kl_ctrl.value) * float(arg if arg is not None else 0.0)
        elif fault.kind == "nan":
            self._poison = True
        elif fault.kind == "nan_weights":
            with torch.no_grad():
                next(self.policy.parameters()).fill_(float("nan"))
        elif fault.kind == "oom":
            self.budget.force_next()
            self._oom_fault = True
        elif fault.kind == "hang":
            end = time.time() + float(arg if arg is not None else 60.0)
            while time.time() < end and not self._term:
                time.sleep(0.1)
        elif fault.kind == "crash":
            logging.shutdown()
            os._exit(int(arg if arg is not None else 1))
        elif fault.kind == "finish_early":
            self.event("finished", steps=self.global_step - 1)
            logging.shutdown()
            os._exit(0)

    # -- one PPO step ---------------------------------------------------------------------------
    def rollout(self, idx: list[int]) -> ppo.Rollout:
        """Sample (or read, offline) responses for a batch and score them."""
        cfg = self.cfg
        examples = [self.train[i] for i in idx]
        n = cfg.actor_rollout_ref.rollout.n
        examples = [e for e in examples for _ in range(n)]
        p_ids, p_mask = ppo.encode_prompts(self.tokenizer, [e.prompt for e in examples], cfg.data.max_prompt_length)
        sampled: list[torch.Tensor] = []
        if cfg.data.offline:
            responses = ppo.encode_responses(self.tokenizer, [e.response or "" for e in examples],
                                             cfg.data.max_response_length)
        else:
            self.policy.eval()
            responses = ppo.generate(self.policy, p_ids, p_mask, cfg.data.max_response_length,
                                     self.tokenizer.eos_id, self.tokenizer.pad_id,
                                     temperature=cfg.actor_rollout_ref.rollout.temperature, generator=self.gen,
                                     log_probs_out=sampled)
        texts = [self.tokenizer.decode(r) for r in responses.tolist()]
        low, high = cfg.algorithm.reward_clip
        scores = []
        for e, text in zip(examples, texts, strict=True):
            s = e.reward if (cfg.data.offline and e.reward is not None) else data_mod.score(text, e.ground_truth)
            scores.append(min(max(s, low), high))
        ro = ppo.assemble(self.tokenizer, p_ids, p_mask, responses, torch.tensor(scores), texts)
        if sampled:
            ro.rollout_log_prob = sampled[0][:, : responses.shape[1]]
        return ro

    def train_step(self, idx: list[int]) -> dict[str, float]:
        """Rollout, advantages, actor and critic updates for one batch; returns step metrics."""
        cfg = self.cfg
        a = cfg.actor_rollout_ref.actor
        t0 = time.time()
        # -- rollout and score
        ro = self.rollout(idx)
        # -- old/ref log-probs and values
        temp = cfg.actor_rollout_ref.rollout.temperature
        ro.old_log_prob = ppo.log_probs(self.policy, ro, a.ppo_mini_batch_size, temp)
        ro.ref_log_prob = ppo.log_probs(self.ref, ro, a.ppo_mini_batch_size, temp)
        ro.values = ppo.values_of(self.critic, ro, cfg.critic.ppo_mini_batch_size)
        # -- KL penalty in the reward, then GAE
        metrics = ppo.apply_kl_penalty(ro, self.kl_ctrl, cfg.algorithm.kl_penalty, cfg.algorithm.use_kl_in_reward)
        metrics.update(ppo.rollout_mismatch(ro))
        metrics["actor/reward_kl_penalty_std"] = self.kl_std.push(metrics["actor/reward_kl_penalty"])
        ppo.compute_advantages(ro, cfg.algorithm.gamma, cfg.algorithm.lam)
        # -- updates (critic first, as verl does); OOM may come from any micro batch
        retry_possible = self.cfg.trainer.oom_retry_live and (
            self.cfg.trainer.memory_budget_tokens is not None or self._oom_fault)
        snap = (copy.deepcopy((self.critic.state_dict(), self.critic_opt.state_dict(),
                               self.policy.state_dict(), self.actor_opt.state_dict()))
                if retry_possible else None)
        while True:
            try:
                crit = ppo.update_critic(self.critic, self.critic_opt, ro, cfg.critic, self.budget.check)
                act = ppo.update_actor(self.policy, self.actor_opt, ro, a, temp, self.budget.check, self._poison)
                break
            except torch.OutOfMemoryError as exc:
                what = "critic" if str(exc).startswith("critic") else "actor"
                key = CRITIC_MICRO if what == "critic" else ACTOR_MICRO
                micro = int(self.cfg.get(key))
                smaller = _smaller_micro(micro, int(self.cfg.get(key.replace("micro_batch_size_per_gpu",
                                                                             "mini_batch_size"))))
                retry = self.cfg.trainer.oom_retry_live and smaller is not None
                self.event("oom", micro_batch_size=micro, what=what, message=str(exc),
                           action="retry" if retry else "exit", new_micro_batch_size=smaller if retry else None)
                if not retry or snap is None:
                    raise
                # Undo the partial update and redo it with the smaller micro batch.
                self.critic.load_state_dict(snap[0])
                self.critic_opt.load_state_dict(snap[1])
                self.policy.load_state_dict(snap[2])
                self.actor_opt.load_state_dict(snap[3])
                self.cfg.set(key, smaller)
        self._poison = False
        self._oom_fault = False
        for what in act.skipped + crit.skipped:
            self.event("nan", what=what)
        self.actor_sched.step()
        self.critic_sched.step()
        # -- metrics (verl keys, trainer/catalog.py)
        metrics.update(act.metrics)
        metrics.update(crit.metrics)
        metrics.update(ppo.data_metrics(ro))
        elapsed = time.time() - t0
        n_tokens = float(ro.attention_mask.sum())
        metrics.update({
            "actor/lr": float(self.actor_opt.param_groups[0]["lr"]),
            "critic/lr": float(self.critic_opt.param_groups[0]["lr"]),
            "perf/time_per_step": elapsed,
            "perf/throughput": n_tokens / max(elapsed, 1e-9),
        })
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy accuracy per data source: ``val-core/<data_source>/reward/mean@1``."""
        if not self.val:
            return {}
        from ppo_watchdog.trainer.sft import accuracy

        out: dict[str, float] = {}
        sources = sorted({e.data_source for e in self.val})
        for src in sources:
            ex = [e for e in self.val if e.data_source == src]
            out[f"val-core/{src}/reward/mean@1"] = accuracy(
                self.policy, self.tokenizer, ex, self.cfg.data.max_prompt_length,
                self.cfg.data.max_response_length, self.cfg.data.val_batch_size)
        return out

    def _record_val(self, val: dict[str, float]) -> None:
        if not val:
            return
        score = sum(val.values()) / len(val)
        if self._summary.first_val is None:
            self._summary.first_val = score
        self._summary.last_val = score
        self.event("validation", score=score, metrics=val)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Train to total_steps; returns the exit code (0, or EXIT_OOM after saving)."""
        from tqdm import tqdm

        t = self.cfg.trainer
        self.resume()
        resumed_from = self.global_step
        # A restarted trainer re-applies the newest overrides before its first step.
        applied, errors = self.steps.start() if self.protocol else ({}, [])
        if self.protocol:
            self._write_run_json()
            self._signals()
        else:
            self.tracking = verl_like.tracking(self.cfg)
        self.event("started", resumed_from=resumed_from, total_steps=self.total_steps, applied=applied,
                   sft=self.sft_info, skipped_batches=self.skipped_batches)
        for message in errors:
            self.event("error", message=message, source="control")
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="PPO",
                   disable=None if t.progress else True,  # None: off when stderr is not a terminal
                   dynamic_ncols=True, file=sys.stderr)
        try:
            if t.val_before_train and self.global_step == 0 and t.test_freq > 0:
                val = self.validate()
                if val:
                    self._log_metrics(0, dict(val))
                    self.exporter.update(0, val)
                    self._record_val(val)
            while True:
                self.boundary()
                if self.global_step >= self.total_steps:
                    break
                self.global_step += 1
                for fault in self.faults.due(self.global_step, resumed=self.resumed_from is not None):
                    self.inject(fault)
                # A deep copy: state_dict() shares storage with the live weights the update changes.
                snap = copy.deepcopy(self.state()) if self._may_oom() else None
                start = self.step_start()
                epoch, idx = self.sampler.next()
                try:
                    metrics = self.train_step(idx)
                except torch.OutOfMemoryError:
                    if not self.protocol:
                        raise  # as verl: a traceback and exit code 1, nothing saved
                    self.save_after_oom(snap, start)
                    raise StopTraining(rundir.EXIT_OOM, "out of memory") from None
                metrics["training/global_step"] = float(self.global_step)
                metrics["training/epoch"] = float(epoch)
                if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or self.global_step == self.total_steps):
                    val = self.validate()
                    metrics.update(val)
                    self._record_val(val)
                self._log_metrics(self.global_step, metrics)
                self.exporter.update(self.global_step, metrics)
                self._summary.last_metrics = metrics
                if metrics.get("actor/reward_kl_penalty", 0.0) > 0.1:
                    self._summary.kl_over_threshold += 1
                bar.n = self.global_step
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.2f}",
                                kl=f"{metrics['actor/reward_kl_penalty']:.3f}",
                                val=f"{self._summary.last_val or 0:.2f}", refresh=False)
                bar.refresh()
                if self._due_checkpoint(epoch):
                    self.save()
            self._ignore_wakeups()
            self.event("finished", steps=self.global_step)
            self._summary.exit_code = 0
        except StopTraining as stop:
            self._ignore_wakeups()
            self._summary.exit_code = stop.code
            log.warning("stopping at step %d: %s (exit %d)", self.global_step, stop.reason, stop.code)
        finally:
            bar.close()
            self.exporter.close()
            if self.tracking is not None:
                self.tracking.finish()
        self._summary.steps = self.global_step
        self._summary.seconds = time.time() - self._t0
        return self._summary.exit_code

    def _may_oom(self) -> bool:
        # The snapshot costs a copy of all weights and optimizer state; only take it when an
        # OOM without live retry is possible (a budget is set or an oom fault is pending).
        return (self.cfg.trainer.memory_budget_tokens is not None or self._oom_fault) \
            and not self.cfg.trainer.oom_retry_live and self.protocol

    def _log_metrics(self, step: int, data: dict[str, float]) -> None:
        """One step's metrics: run_dir/metrics.jsonl, or (verl-like) verl's Tracking backends."""
        if self.tracking is not None:
            self.tracking.log(data=data, step=step)
        else:
            rundir.append_metrics(self.run_dir, step, data)

    def _due_checkpoint(self, epoch: int) -> bool:
        t = self.cfg.trainer
        if t.save_freq > 0 and self.global_step % t.save_freq == 0:
            return True
        end_of_epoch = self.sampler.position >= self.sampler.steps_per_epoch
        return bool(t.save_epoch_freq > 0 and end_of_epoch and (epoch + 1) % t.save_epoch_freq == 0)

    @property
    def summary(self) -> Summary:
        """The run's summary (complete after :meth:`run`)."""
        return self._summary


#: What Ray's job supervisor gives a job's entrypoint: the job's config as JSON, with the
#: submission id at ``metadata.job_submission_id``.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def ray_job_id(environ: Any) -> str | None:
    """The Ray Job submission id this trainer runs as (None outside a Ray Job), for run.json.

    Read from the environment Ray's job supervisor sets, not ``ray.get_runtime_context()``: that
    gives the driver's job id (``02000000``), not the submission id the job server knows, and
    would import ray into a trainer that does not use it. A daemon with no record of the run
    adopts the job by this id instead of submitting a second one."""
    raw = environ.get(RAY_JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        job = json.loads(raw).get("metadata", {}).get("job_submission_id")
    except (ValueError, AttributeError):
        log.warning("$%s is not the JSON Ray writes; no ray_job_id in run.json", RAY_JOB_CONFIG_ENV)
        return None
    return job if isinstance(job, str) and job else None


def _smaller_micro(micro: int, mini: int) -> int | None:
    """The largest divisor of ``mini`` at most half of ``micro`` (None when micro is already 1)."""
    if micro <= 1:
        return None
    for m in range(micro // 2, 0, -1):
        if mini % m == 0:
            return m
    return 1


def print_summary(trainer: Trainer) -> None:
    """One screen: what the run did (rich table on stdout)."""
    from rich.console import Console
    from rich.table import Table

    s = trainer.summary
    table = Table(title=f"PPO run {trainer.run_id}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    m = s.last_metrics

    def fmt(x: float | None) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    table.add_row("run dir", str(trainer.run_dir))
    table.add_row("steps", f"{s.steps} / {trainer.total_steps}")
    table.add_row("exit code", str(s.exit_code))
    table.add_row("SFT val accuracy", fmt(trainer.sft_info.get("val_acc")))
    table.add_row("val accuracy first -> last", f"{fmt(s.first_val)} -> {fmt(s.last_val)}")
    for key in ("critic/score/mean", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "critic/vf_loss",
                "actor/entropy", "perf/time_per_step"):
        table.add_row(key + " (last)", fmt(m.get(key)))
    table.add_row("steps with KL > 0.1", str(s.kl_over_threshold))
    table.add_row("events", ", ".join(f"{k}={v}" for k, v in sorted(s.events.items())) or "-")
    table.add_row("wall time", f"{s.seconds:.1f} s")
    Console().print(table)


def run_cli(cfg: Config, args: Sequence[str]) -> int:
    """Run a parsed config as ``python -m ppo_watchdog.trainer`` does: train, print the summary, return the exit code."""
    logging.basicConfig(level=os.environ.get("TRAINER_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    run_dir = Path(cfg.trainer.run_dir)
    try:  # the run directory is where everything goes: a read-only one is a config error, said at once
        rundir.check_writable(run_dir)
    except OSError as exc:
        sys.stderr.write(f"config error: trainer.run_dir {run_dir}: cannot be written ({exc.strerror or exc})\n")
        return rundir.EXIT_USAGE
    trainer = Trainer(cfg, [sys.executable, "-m", "ppo_watchdog.trainer", *args])
    try:
        code = trainer.run()
    except ckpt.CheckpointError as exc:  # trainer.resume_from_path names a checkpoint that cannot be restored
        sys.stderr.write(f"config error: trainer.resume_from_path: {exc}\n")
        return rundir.EXIT_USAGE
    print_summary(trainer)
    return code
