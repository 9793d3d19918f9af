"""The embedded trainer behaving like an unmodified verl run (``trainer.run_dir_protocol=false``).

The watchdog's zero-patch mode supervises ``python -m verl.trainer.main_ppo`` without
changing it; verl's full PPO does not run on a CPU, so this is how its tests get a real
process that behaves the way verl does in every respect the watchdog relies on:

- metrics only through verl's own :class:`verl.utils.tracking.Tracking` with the
  configured ``trainer.logger`` (``console`` prints ``step:N - key:value`` lines, ``file``
  writes FileLogger JSONL to ``VERL_FILE_LOGGER_PATH``, truncating it at start as verl does);
- checkpoints in verl's layout (``global_step_N/{actor,critic}/{model,optim,extra_state}_
  world_size_1_rank_0.pt``, ``data.pt``, then ``latest_checkpointed_iteration.txt``) under
  ``trainer.default_local_dir``, with no manifest;
- resume as verl's FSDP checkpoint manager does: optimizer state, then the LambdaLR state
  from ``extra_state`` (so the checkpoint's lr wins over a new ``optim.lr``: verl's trap),
  and the KL controller from the config (verl does not checkpoint it).

Files are loaded with ``torch.load(weights_only=True)`` (numpy RNG types allowed).
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir
from ppo_watchdog.trainer.config import ConfigError

log = logging.getLogger(__name__)

WORLD_SIZE, RANK = 1, 0


def rng_state() -> dict[str, Any]:
    """The RNG state verl's checkpoint manager saves (``BaseCheckpointManager.get_rng_state`` on CPU)."""
    return {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (``load_rng_state``)."""
    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(_tuples(state["random"]))


def _tuples(x: Any) -> Any:
    # weights_only loading gives random.getstate()'s nested tuples back as they were; be lenient with lists.
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def tracking(cfg: Any) -> Any:
    """verl's own Tracking with the configured backends (``file`` honours VERL_FILE_LOGGER_PATH)."""
    from verl.utils.tracking import Tracking

    t = cfg.trainer
    return Tracking(project_name=t.project_name, experiment_name=t.experiment_name,
                    default_backend=list(t.logger), config=cfg.to_dict())


def _parts(trainer: Any) -> tuple[tuple[str, Any, Any, Any], ...]:
    return (("actor", trainer.policy, trainer.actor_opt, trainer.actor_sched),
            ("critic", trainer.critic, trainer.critic_opt, trainer.critic_sched))


def save(trainer: Any) -> Path:
    """Write ``global_step_N`` the way verl does (per-rank files, data.pt, then the marker)."""
    root = Path(trainer.ckpt_root)
    step_dir = ckpt.step_dir(root, trainer.global_step)
    for name, model, opt, sched in _parts(trainer):
        d = step_dir / name
        ckpt.save_verl_file(ckpt.verl_file(d, "model", WORLD_SIZE, RANK), model.state_dict())
        ckpt.save_verl_file(ckpt.verl_file(d, "optim", WORLD_SIZE, RANK), opt.state_dict())
        ckpt.save_verl_file(ckpt.verl_file(d, "extra_state", WORLD_SIZE, RANK),
                            {"lr_scheduler": sched.state_dict(), "rng": rng_state()})
    ckpt.save_verl_file(step_dir / ckpt.VERL_DATA_FILE,
                        {"sampler": trainer.sampler.state_dict(), "generator": trainer.gen.get_state()})
    rundir.atomic_write_bytes(root / rundir.LATEST_MARKER, str(int(trainer.global_step)).encode())
    keep = trainer.cfg.trainer.max_actor_ckpt_to_keep
    if keep:
        steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in root.glob("global_step_*") if p.is_dir()
                       and p.name.rsplit("_", 1)[1].isdigit())
        for old in steps[:-keep]:
            shutil.rmtree(ckpt.step_dir(root, old), ignore_errors=True)
    log.info("saved checkpoint %s (verl layout)", step_dir)
    return step_dir


def resume(trainer: Any) -> None:
    """verl's ``_load_checkpoint``: auto (the marker's step), resume_path, or disable."""
    t = trainer.cfg.trainer
    if t.resume_mode == "disable":
        return
    if t.resume_mode == "auto":
        marker = ckpt.read_marker(trainer.ckpt_root)
        if marker is None or not ckpt.step_dir(trainer.ckpt_root, marker).is_dir():
            log.info("training from scratch (no checkpoint under %s)", trainer.ckpt_root)
            return
        path = ckpt.step_dir(trainer.ckpt_root, marker)
    else:
        path = Path(t.resume_from_path)
        if "global_step_" not in path.name or not path.name.rsplit("_", 1)[1].isdigit():
            raise ConfigError(f"trainer.resume_from_path must name a global_step_N directory, got {path}",
                              "trainer.resume_from_path", str(path))
    for name, model, opt, sched in _parts(trainer):
        d = path / name
        model.load_state_dict(ckpt.load_verl_file(ckpt.verl_file(d, "model", WORLD_SIZE, RANK)))
        opt.load_state_dict(ckpt.load_verl_file(ckpt.verl_file(d, "optim", WORLD_SIZE, RANK)))
        extra = ckpt.load_verl_file(ckpt.verl_file(d, "extra_state", WORLD_SIZE, RANK))
        set_rng_state(extra["rng"])
        if extra["lr_scheduler"] is not None:
            # As verl: the scheduler's base_lrs come back from the checkpoint, whatever optim.lr says now.
            sched.load_state_dict(extra["lr_scheduler"])
    data = ckpt.load_verl_file(path / ckpt.VERL_DATA_FILE)
    trainer.sampler.load_state_dict(data["sampler"])
    trainer.gen.set_state(data["generator"])
    trainer.global_step = int(path.name.rsplit("_", 1)[1])
    log.info("resumed from %s (step %d, verl layout)", path, trainer.global_step)
