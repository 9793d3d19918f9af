"""Where a TRL launch resumes, and the prompts a rollback skips after it.

Resume is always from an explicit, verified checkpoint (``global_step_N`` with its manifest), never
transformers' ``resume_from_checkpoint=True`` (the highest ``checkpoint-N``: possibly a branch the
watchdog abandoned).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir
from ppo_watchdog.trainer.trl_glue.config import TRLRun

log = logging.getLogger(__name__)


def resume_point(run: TRLRun, root: Path) -> Path | None:
    """The checkpoint to resume from, verified.

    resume_path: that checkpoint; the abandoned timeline after it (under the same root) is
    discarded so nothing later resumes it. One of the run's own (what a watchdog relaunch names)
    that fails verification falls back to the newest usable one before it, else the initial
    weights, said in an ``error`` event: a torn checkpoint is no configuration error, and exit 2
    would give the whole run up. One a person named elsewhere stays their error (CheckpointError).
    auto: the newest complete checkpoint under ``root``.
    """
    if run.resume_mode == "disable":
        return None
    if run.resume_mode == "resume_path":
        named = Path(run.resume_from_path)
        try:
            info = ckpt.verify_checkpoint(named)
            if not (info.path / "trainer_state.json").is_file():
                raise ckpt.CheckpointError(info.path, "not a TRL checkpoint (no trainer_state.json)")
        except ckpt.CheckpointError as exc:
            if named.parent.resolve() != root.resolve():
                raise
            step = next((c.step for c in ckpt.list_checkpoints(root, verify=False)
                         if c.path.resolve() == named.resolve()), None)
            back = _newest_usable(root, below=step)
            where = f"step {back.step} ({back.path})" if back is not None else "the initial weights"
            message = (f"trainer.resume_from_path: {exc}; resuming from {where}, the newest usable checkpoint "
                       "before it, instead")
            log.error("%s", message)
            rundir.append_event(root.parent, "error", step, message=message, source="resume")
            ckpt.discard_newer(root, back.step if back is not None else -1)
            return back.path if back is not None else None
        if info.path.parent.resolve() == root.resolve():
            ckpt.discard_newer(root, info.step)
        return info.path
    back = _newest_usable(root)
    return back.path if back is not None else None


def _newest_usable(root: Path, below: int | None = None) -> ckpt.CheckpointInfo | None:
    """The newest complete TRL checkpoint under ``root`` (before step ``below``, when given)."""
    for info in reversed([c for c in ckpt.list_checkpoints(root) if c.complete]):
        if (below is None or info.step < below) and (info.path / "trainer_state.json").is_file():
            return info
    return None


def skip_items(args: Any, steps: int) -> tuple[int, int]:
    """(sampler indices, steps) a skip of ``steps`` steps drops: whole generation blocks
    (``num_iterations`` steps reuse one generation), each step ``per_device x steps_per_generation x
    gradient_accumulation`` indices (TRL's RepeatSampler feeding transformers' loop)."""
    if steps <= 0:
        return 0, 0
    block = max(1, int(args.num_iterations))
    steps = math.ceil(steps / block) * block
    per_step = int(args.per_device_train_batch_size) * int(args.steps_per_generation or 1) * \
        int(args.gradient_accumulation_steps)
    return steps * per_step, steps


class SkipFirst:
    """A sampler that drops its first ``n`` indices once (a rollback's batch skip), then is the sampler."""

    def __init__(self, sampler: Any, n: int) -> None:
        self.sampler = sampler
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.sampler)
        n, self.n = self.n, 0  # only the epoch the run resumes in
        for _ in range(n):
            if next(it, None) is None:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.sampler)
