"""Fault injection (``ppo_watchdog.trainer.faults``) and the CPU memory budget that raises a real OOM.

Spec: comma-separated ``kind@step[:arg]`` items, e.g.::

    kl_collapse@20,lr_spike@30:x20,nan@45,oom@60,hang@80:30,crash@90

=============  =====================================================  ===============
kind           what the trainer does at that step                      arg (default)
=============  =====================================================  ===============
lr_spike       multiply the actor (and critic) lr by arg                ``x10``
kl_collapse    multiply the KL coefficient by arg                       ``x0`` (to zero)
nan            make the loss non-finite (the optimizer step is skipped)  none
nan_weights    write NaN into the actor's weights, as an update the      none
               non-finite guard missed would: every later forward is
               NaN until a checkpoint is restored (verl issues 498, 721)
oom            the next micro-batch raises torch.OutOfMemoryError       none
hang           sleep arg seconds without progress                       ``60``
crash          exit at once with exit code arg, no save                 ``1``
finish_early   in a launch resumed from a checkpoint only: report the   none
               run finished and exit 0 without training the step (a
               resume that loads and does nothing: verl issue 7401)
=============  =====================================================  ===============

Each fault fires once per run directory (remembered in ``run_dir/.faults_fired.json``),
so a run resumed from an earlier checkpoint does not re-inject the fault that made it
restart, forever.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import rundir

log = logging.getLogger(__name__)

FIRED_FILE = ".faults_fired.json"
KINDS = ("lr_spike", "kl_collapse", "nan", "nan_weights", "oom", "hang", "crash", "finish_early")
#: Kinds that fire only in a launch that resumed from a checkpoint (a fresh launch passes their step).
RESUMED_ONLY = frozenset({"finish_early"})
#: What ``arg`` means when the spec leaves it out.
DEFAULT_ARGS: dict[str, float | None] = {
    "lr_spike": 10.0, "kl_collapse": 0.0, "nan": None, "nan_weights": None, "oom": None, "hang": 60.0,
    "crash": 1.0, "finish_early": None,
}
_TAKES_ARG = frozenset(k for k, v in DEFAULT_ARGS.items() if v is not None)
_ITEM = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>-?\d+)(?::(?P<x>x)?(?P<arg>[^,]*))?$")


@dataclass(frozen=True)
class Fault:
    """One fault to inject at one step."""

    kind: str
    """One of :data:`KINDS`."""
    step: int
    """Global step at whose start the fault fires."""
    arg: float | None = None
    """The kind's argument (factor, seconds, exit code); None means the default."""

    @property
    def value(self) -> float | None:
        """``arg`` or the kind's default from :data:`DEFAULT_ARGS`."""
        return self.arg if self.arg is not None else DEFAULT_ARGS[self.kind]

    @property
    def id(self) -> str:
        """Stable identity within a schedule (``kind@step``)."""
        return f"{self.kind}@{self.step}"

    def __str__(self) -> str:
        if self.arg is None:
            return self.id
        mult = "x" if self.kind in ("lr_spike", "kl_collapse") else ""
        return f"{self.id}:{mult}{self.arg:g}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "arg": self.value, "spec": str(self)}


@dataclass
class FaultSchedule:
    """The faults of one run and which of them already fired in its run directory."""

    faults: tuple[Fault, ...] = ()
    """All faults, sorted by step."""
    run_dir: Path | None = None
    """Where fired faults are remembered; None keeps it in memory only."""
    fired: set[str] = field(default_factory=set)
    """Ids of faults that already fired."""

    @classmethod
    def parse(cls, spec: str | None, run_dir: Path | str | None = None) -> FaultSchedule:
        """Parse a ``ppo_watchdog.trainer.faults`` spec; ValueError names the bad item and why."""
        faults: list[Fault] = []
        seen: set[str] = set()
        items = [] if spec is None else [s.strip() for s in str(spec).split(",")]
        if items == [""]:
            items = []
        for n, item in enumerate(items, start=1):
            where = f"trainer.faults item {n} {item!r}"
            m = _ITEM.match(item)
            if not m:
                raise ValueError(f"{where}: expected kind@step[:arg], e.g. lr_spike@30:x20")
            kind, step = m["kind"], int(m["step"])
            if kind not in KINDS:
                raise ValueError(f"{where}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
            if step < 1:
                raise ValueError(f"{where}: step must be >= 1, got {step}")
            arg: float | None = None
            if m["arg"] is not None:
                if kind not in _TAKES_ARG:
                    raise ValueError(f"{where}: {kind} takes no argument")
                try:
                    arg = float(m["arg"])
                except ValueError:
                    raise ValueError(f"{where}: argument {m['arg']!r} is not a number") from None
                if arg != arg or arg in (float("inf"), float("-inf")) or arg < 0:
                    raise ValueError(f"{where}: argument must be a finite number >= 0, got {m['arg']!r}")
                if kind == "crash" and arg != int(arg):
                    raise ValueError(f"{where}: exit code must be an integer, got {m['arg']!r}")
            fault = Fault(kind, step, arg)
            if fault.id in seen:
                raise ValueError(f"{where}: {fault.id} given twice")
            seen.add(fault.id)
            faults.append(fault)
        sched = cls(tuple(sorted(faults, key=lambda f: (f.step, KINDS.index(f.kind)))), None)
        if run_dir is not None:
            sched.bind(run_dir)
        return sched

    def bind(self, run_dir: Path | str) -> FaultSchedule:
        """Remember fired faults in ``run_dir`` (loading what fired there before)."""
        self.run_dir = Path(run_dir)
        path = self.run_dir / FIRED_FILE
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            doc = {"fired": []}
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable ({exc})") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("fired"), list):
            raise ValueError(f"{path}: expected {{'fired': [...]}}")
        self.fired |= {str(x) for x in doc["fired"]}
        return self

    def due(self, step: int, resumed: bool = False) -> list[Fault]:
        """Faults to inject at ``step`` that have not fired yet (those of :data:`RESUMED_ONLY` only in a launch that
        ``resumed`` from a checkpoint); marks them fired (persisted first)."""
        due = [f for f in self.faults if f.step == step and f.id not in self.fired
               and (resumed or f.kind not in RESUMED_ONLY)]
        if due:
            self.fired |= {f.id for f in due}
            if self.run_dir is not None:
                # Persist before the caller injects: a crash fault must not fire again after restart.
                rundir.atomic_write_json(self.run_dir / FIRED_FILE, {"fired": sorted(self.fired)})
            for f in due:
                log.warning("injecting fault %s", f)
        return due

    def __bool__(self) -> bool:
        return bool(self.faults)

    def __str__(self) -> str:
        return ",".join(str(f) for f in self.faults)


class MemoryBudget:
    """A per-micro-batch token budget that raises a real ``torch.OutOfMemoryError`` when exceeded.

    On CPU nothing runs out of memory at these sizes; the budget reproduces the failure a
    GPU would have at the same spot, with the same exception type, so the OOM path (and
    the watchdog's micro-batch remedy) is exercised for real.
    """

    def __init__(self, tokens_per_micro_batch: int | None) -> None:
        if tokens_per_micro_batch is not None and tokens_per_micro_batch < 1:
            raise ValueError(f"tokens_per_micro_batch must be >= 1 or None, got {tokens_per_micro_batch!r}")
        self.tokens_per_micro_batch = tokens_per_micro_batch
        """Largest micro-batch in tokens that fits; None means unlimited."""
        self._forced = 0

    def force_next(self, times: int = 1) -> None:
        """Make the next ``times`` checks raise regardless of size (the ``oom`` fault)."""
        self._forced += times

    def check(self, n_tokens: int, what: str) -> None:
        """Raise ``torch.OutOfMemoryError`` if a micro-batch of ``n_tokens`` does not fit."""
        import torch  # here, so parsing fault specs does not import torch

        if self._forced > 0:
            self._forced -= 1
            raise torch.OutOfMemoryError(
                f"{what}: injected out-of-memory error (fault) at a micro-batch of {n_tokens} tokens"
            )
        budget = self.tokens_per_micro_batch
        if budget is not None and n_tokens > budget:
            raise torch.OutOfMemoryError(
                f"{what}: micro-batch of {n_tokens} tokens exceeds the memory budget of {budget} tokens"
            )
