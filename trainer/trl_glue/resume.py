"""Where a TRL launch resumes, and the prompts a rollback skips after it.

Resume is always from an explicit, verified checkpoint (``global_step_N`` with its manifest), never
transformers' ``resume_from_checkpoint=True`` (the highest ``checkpoint-N``: possibly a branch the
watchdog abandoned).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.trainer.trl_glue.config import TRLRun


def resume_point(run: TRLRun, root: Path) -> Path | None:
    """The checkpoint to resume from, verified (CheckpointError when a named one is unusable).

    resume_path: that checkpoint; the abandoned timeline after it (under the same root) is
    discarded so nothing later resumes it. auto: the newest complete checkpoint under ``root``.
    """
    if run.resume_mode == "disable":
        return None
    if run.resume_mode == "resume_path":
        info = ckpt.verify_checkpoint(run.resume_from_path)
        if not (info.path / "trainer_state.json").is_file():
            raise ckpt.CheckpointError(info.path, "not a TRL checkpoint (no trainer_state.json)")
        if info.path.parent.resolve() == root.resolve():
            ckpt.discard_newer(root, info.step)
        return info.path
    for info in reversed([c for c in ckpt.list_checkpoints(root) if c.complete]):
        if (info.path / "trainer_state.json").is_file():
            return info.path
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
