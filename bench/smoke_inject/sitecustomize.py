"""Fault injection for the zero-patch GPU smoke test (bench/verl_gpu_smoke.py), loaded by every
Python process started with this directory on PYTHONPATH (verl's driver and its Ray workers).

With ``SMOKE_OOM_RUN_DIR`` set, verl's actor update raises a CUDA out-of-memory error once: at
its first call in launch number ``SMOKE_OOM_ATTEMPT`` (read from the per-attempt file-logger
path the watchdog passes, ``.../metrics.N.jsonl``). verl itself is not modified on disk; the
watchdog sees what it would see after a real OOM (Ray's RayTaskError over torch's message).
Never on PYTHONPATH outside the smoke test.
"""

from __future__ import annotations

import os
import re

_RUN_DIR = os.environ.get("SMOKE_OOM_RUN_DIR")


def _attempt() -> int | None:
    m = re.search(r"metrics\.(\d+)\.jsonl$", os.environ.get("VERL_FILE_LOGGER_PATH", ""))
    return int(m.group(1)) if m else None


def _install() -> None:
    import functools

    try:
        from verl.workers import engine_workers
    except Exception:  # noqa: BLE001 - not a verl process (or verl absent): nothing to inject
        return
    cls = engine_workers.ActorRolloutRefWorker
    original = cls.update_actor

    @functools.wraps(original)
    def update_actor(self, *args, **kwargs):
        marker = os.path.join(str(_RUN_DIR), f"oom_injected.rank{os.environ.get('RANK', '0')}")
        if _attempt() == int(os.environ.get("SMOKE_OOM_ATTEMPT", "3")) and not os.path.exists(marker):
            open(marker, "w").close()
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by "
                                         "bench/verl_gpu_smoke.py)")
        return original(self, *args, **kwargs)

    cls.update_actor = update_actor


if _RUN_DIR:
    _install()
