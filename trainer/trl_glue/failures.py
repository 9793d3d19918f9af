"""What an exception that ends a TRL run was: non-finite numbers (a ``nan`` event) or out of memory (an ``oom`` event).

TRL raises no error of its own for either: NaN weights surface as torch's sampler refusing "probability
tensor contains either inf, nan or element < 0" before any metric of the step is logged, and a host OOM
on CPU is a plain RuntimeError of torch's allocator. Read from the exception and its chain.
"""

from __future__ import annotations

import traceback
from typing import Any

from ppo_watchdog.protocol import oom

#: Words of an exception (or its chain) that mean non-finite numbers reached the trainer.
_NAN_MARKERS = ("probability tensor contains either", "returned nan values", "nan or inf", "non-finite")


def nan_like(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) says NaN/inf reached the computation."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).lower()
    return any(m in text for m in _NAN_MARKERS)


#: What a host out-of-memory error says on CPU (torch's allocator raises a plain RuntimeError).
_HOST_OOM = ("DefaultCPUAllocator: can't allocate memory", "CPU out of memory")


def oom_fields(exc: BaseException, micro: int) -> dict[str, Any] | None:
    """The ``oom`` event's fields for an out-of-memory ``exc`` (torch's OutOfMemoryError, Python's
    MemoryError, the CPU allocator's error, or the protocol's OOM text rules over its chain), else None."""
    import torch

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    found = oom.read_oom(f"{type(exc).__name__}: {exc}\n{text}")
    host = isinstance(exc, MemoryError) or any(m in text for m in _HOST_OOM)
    if found is None and not host and not isinstance(exc, torch.OutOfMemoryError):
        return None
    memory, site, evidence = found if found is not None else ("host", None, str(exc))
    if host or not torch.cuda.is_available():
        memory = "host"  # torch names its CPU OOMs OutOfMemoryError too; the CUDA pattern would say cuda
    return {"memory": memory, **({"site": site} if site else {}), "message": str(evidence)[:2000],
            "micro_batch_size": micro, "source": "trl"}
