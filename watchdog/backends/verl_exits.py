"""How an unmodified verl run ended, read from the tail of its log and its exit code.

verl writes no events: a CUDA OOM in a worker reaches the driver as
``ray.exceptions.RayTaskError(OutOfMemoryError)`` wrapping ``torch.OutOfMemoryError:
CUDA out of memory. Tried to allocate ...`` and Hydra ends the process with exit code 1,
exactly like any other error. The watchdog tells them apart from the text:

=========  =====================================================================
kind       evidence (the exception and message formats of the installed Ray and torch)
=========  =====================================================================
finished   exit code 0
oom/host   Ray's memory monitor killed a worker: an ``ActorDiedError`` whose worker
           exit type is ``NODE_OUT_OF_MEMORY``, the raylet's "worker(s) were killed due
           to the node running low on memory" / "Memory on the node (IP: ...)", or
           ``ray.exceptions.OutOfMemoryError`` (a task it killed)
oom/cuda   ``torch.OutOfMemoryError`` / ``torch.cuda.OutOfMemoryError``, the caching
           allocator's "CUDA out of memory. Tried to allocate", "CUDA error: out of
           memory", or ``RayTaskError(OutOfMemoryError)`` without a host marker
resume     the attempt died loading the checkpoint it resumed from: its traceback runs through
           verl's ``_load_checkpoint`` / ``load_checkpoint`` (a truncated ``data.pt``, a corrupt
           optimizer shard); the watchdog relaunches from the checkpoint before it
nan        torch's "probability tensor contains either `inf`, `nan` or element < 0"
           (sampling from NaN logits), autograd's "returned nan values in its ... output",
           or a final exception line naming nan/inf
crash      anything else (also a SYSTEM_ERROR worker death, whose Ray message only lists
           the kernel OOM killer among *possible* causes: not evidence enough to shrink
           a micro batch)
=========  =====================================================================

Host markers are checked first because ``RayTaskError(OutOfMemoryError)`` also wraps
Ray's own ``OutOfMemoryError``; the cause line decides. An OOM's ``site`` (which of verl's
passes ran out: the actor or critic update, a log-prob pass, the rollout) comes from the same
traceback (:mod:`ppo_watchdog.protocol.oom`), so the remedy lowers that pass's own knob. A NaN in a *metric* line of
verl's console logger (``critic/vf_loss:nan``) is not an exit reason: those lines are
skipped. Pure: text and exit code in, a classification out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ppo_watchdog.backends.local import TAIL_BYTES
from ppo_watchdog.protocol import oom

_NAN = re.compile(
    r"probability tensor contains either `inf`, `nan` or element < 0"
    r"|returned nan values in its \d+\w* output"
)
# The final line of a Python traceback: ``module.Name: message`` (Ray's dual class adds ``(Cause)``).
_EXC_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w.]*(?:\([\w.]+\))?(?:Error|Exception|Interrupt)): ?(?P<msg>.*)$")
_NAN_WORD = re.compile(r"\b(?:nan|inf)\b", re.I)
# A traceback frame of verl's checkpoint loading (trainer/ppo/v1/trainer_base.py ``_load_checkpoint``, the FSDP
# checkpoint manager's ``load_checkpoint``), after whatever prefix Ray puts on a worker's line.
_LOAD_FRAME = re.compile(r'File "[^"]*", line \d+, in _?load_checkpoint$')


@dataclass(frozen=True)
class ExitClass:
    """How a run ended and the line that says so."""

    kind: str
    """finished | oom | resume | nan | crash."""
    exit_code: int | None
    """The process's exit code (None when unknown)."""
    memory: str | None = None
    """For an OOM: ``cuda`` or ``host``."""
    evidence: str = ""
    """The log line the classification rests on (empty when there is none)."""
    site: str | None = None
    """For an OOM: the pass that ran out (:data:`ppo_watchdog.protocol.oom.SITES`), when the traceback says."""

    @property
    def action(self) -> str:
        """What the controller does with it: finished | oom | crash (a NaN exit restarts like a crash; so does a
        failed resume, whose ``error`` event sends the restart to the checkpoint before)."""
        return "crash" if self.kind in ("nan", "resume") else self.kind


def _find(pattern: re.Pattern[str], lines: list[str]) -> str | None:
    at = oom.find_last(pattern, lines)
    return lines[at].strip() if at is not None else None


def last_exception(lines: list[str]) -> str | None:
    """The last ``Name: message`` exception line of the text, or None."""
    for line in reversed(lines):
        if _EXC_LINE.match(line.strip()):
            return line.strip()
    return None


def classify(text: str, exit_code: int | None) -> ExitClass:
    """Classify one attempt's end from its log text (the tail is enough) and exit code."""
    if exit_code == 0:
        return ExitClass("finished", exit_code)
    lines = oom.clean_lines(text[-TAIL_BYTES:])
    found = oom.memory_of(lines)
    if found is not None:
        memory, at = found
        return ExitClass("oom", exit_code, memory, lines[at].strip(), oom.site_of(lines, at))
    if any(_LOAD_FRAME.search(line) for line in lines):
        return ExitClass("resume", exit_code, None, last_exception(lines) or "")
    nan = _find(_NAN, lines)
    if nan is None:
        exc = last_exception(lines)
        if exc is not None and _NAN_WORD.search(_EXC_LINE.match(exc).group("msg")):  # type: ignore[union-attr]
            nan = exc
    if nan is not None:
        return ExitClass("nan", exit_code, None, nan)
    return ExitClass("crash", exit_code, None, last_exception(lines) or "")
