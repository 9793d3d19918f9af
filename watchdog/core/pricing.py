"""What an action costs in the run's mode, and when a tuning relaunch may go.

Pure: numbers in, numbers out; the live controller and ``watchdog eval`` share it.

- A live change (control.json read at the next step boundary) costs nothing but that
  boundary: no step is lost and the trainer keeps its memory, its rollout engine and its
  data position.
- A relaunch (an unmodified verl run changes nothing in process; the embedded trainer
  restarts for keys such as the mini batch) costs the run's start-up (model load,
  rollout engine, compile: about 4 minutes for Qwen2-7B on verl, verl issue 384; measured
  on the run itself after its first relaunch) plus the steps trained since the last
  checkpoint, which are trained again.

So a relaunch wanted only for tuning (a gentler kl_coef, a smaller lr) waits for the next
checkpoint, when the steps lost are none; the sets that wait are merged into one relaunch,
a set whose rule stopped firing meanwhile is dropped, and tuning relaunches are spaced at
least :attr:`RelaunchPolicy.min_steps` apart, counting from the launch: a run pays at most one
tuning relaunch per 100 steps it trains. A relaunch the run needs anyway (a rollback,
an OOM, a crash) goes at once and carries every set still waiting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_watchdog.core.vocabulary import ActionStatus

#: verl's start-up before a run has measured its own (Qwen2-7B on 8 GPUs: about 4 minutes, verl issue 384).
DEFAULT_STARTUP_S = 240.0


@dataclass(frozen=True)
class Cost:
    """The price of one action."""

    seconds: float
    """Wall time lost: start-up plus the steps trained again (0 for a live change)."""
    steps_lost: int
    """Steps trained since the checkpoint the relaunch resumes from (trained again)."""
    relaunch: bool
    """True when the trainer is stopped and started again."""
    in_process: bool = False
    """True for a checkpoint restored in the running trainer (no start-up, the steps since it trained again)."""

    def describe(self) -> str:
        """``live (no step lost)``, ``in process: 7 s (3 steps trained again)`` or
        ``relaunch: 312 s (start-up 240 s + 3 steps trained again)``."""
        if self.in_process:
            again = f" ({self.steps_lost} steps trained again)" if self.steps_lost else " (no step lost)"
            return f"in process: {self.seconds:.0f} s{again}"
        if not self.relaunch:
            return "live (no step lost)"
        again = f" + {self.steps_lost} steps trained again" if self.steps_lost else ", no step lost"
        return f"relaunch: {self.seconds:.0f} s (start-up{again})"

    def to_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "steps_lost": self.steps_lost, "relaunch": self.relaunch,
                **({"in_process": True} if self.in_process else {})}


@dataclass(frozen=True)
class CostModel:
    """A run's prices: its measured start-up and step time."""

    startup_s: float = DEFAULT_STARTUP_S
    """Stop to first new step of a relaunch (measured on the run, else the configured default)."""
    step_time_s: float = 0.0
    """Median wall time of one step."""

    LIVE = Cost(0.0, 0, False)

    def relaunch(self, steps_since_checkpoint: int) -> Cost:
        """A relaunch resuming from a checkpoint ``steps_since_checkpoint`` steps back."""
        lost = max(0, int(steps_since_checkpoint))
        return Cost(self.startup_s + lost * self.step_time_s, lost, True)

    def restore(self, steps_since_checkpoint: int) -> Cost:
        """A checkpoint restored in the running trainer (no start-up): the steps since it trained again."""
        lost = max(0, int(steps_since_checkpoint))
        return Cost(lost * self.step_time_s, lost, False, in_process=True)


@dataclass(frozen=True)
class RelaunchPolicy:
    """When a tuning relaunch may go."""

    min_steps: int = 100
    """Steps trained between two tuning relaunches, at least (a relaunch per 100 steps at most)."""

    def __post_init__(self) -> None:
        if self.min_steps < 0:
            raise ValueError(f"tuning relaunch spacing must be >= 0 steps, got {self.min_steps}")


@dataclass(frozen=True)
class Waiting:
    """One tuning set that waits for a relaunch."""

    id: int
    """Its journal entry (or, in eval, its sequence number)."""
    rule: str
    """The rule that asked for it."""
    step: int
    """Step of the decision."""
    sets: Mapping[str, Any] = field(default_factory=dict)
    """Key -> new value."""


@dataclass(frozen=True)
class Release:
    """What to do with the waiting sets now."""

    carry: tuple[Waiting, ...] = ()
    """Sets to carry out now, in one relaunch (later ones win for the same key)."""
    dropped: tuple[Waiting, ...] = ()
    """Sets whose rule no longer fires: their condition cleared while they waited."""
    keep: tuple[Waiting, ...] = ()
    """Sets that keep waiting."""

    def merged(self) -> dict[str, Any]:
        """The carried sets as one override dict."""
        out: dict[str, Any] = {}
        for w in sorted(self.carry, key=lambda w: (w.step, w.id)):
            out.update(w.sets)
        return out


def release(
    waiting: Sequence[Waiting], *, firing: Iterable[str], checkpoint_step: int | None, clock: int,
    last_tuning_relaunch: int | None, policy: RelaunchPolicy, relaunching: bool = False,
) -> Release:
    """Which waiting sets go now, which are dropped and which wait on.

    ``checkpoint_step``: the newest complete checkpoint's step (None: none yet); the sets go
    once one exists at or after every waiting decision's step, so the relaunch loses no step.
    ``clock``: steps trained so far (the engine's monotonic count); ``last_tuning_relaunch``: its
    value at the last tuning relaunch (None: none yet, the launch itself counts, at clock 0). ``relaunching``: the run relaunches now anyway (a
    rollback, an OOM), which carries every set whose rule still fires.
    """
    live = set(firing)
    dropped = tuple(w for w in waiting if w.rule not in live)
    valid = tuple(w for w in waiting if w.rule in live)
    if not valid:
        return Release((), dropped, ())
    if relaunching:
        return Release(valid, dropped, ())
    # The launch counts as the last relaunch: tuning spends at most one start-up per min_steps trained.
    spaced = clock - (last_tuning_relaunch or 0) >= policy.min_steps
    saved = checkpoint_step is not None and checkpoint_step >= max(w.step for w in valid)
    if spaced and saved:
        return Release(valid, dropped, ())
    return Release((), dropped, valid)


def duration_text(seconds: float) -> str:
    """``45 s``, ``30 min``, ``2.5 h``: a wait in the unit a person reads it in."""
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def cost_text(journal: Sequence[Mapping[str, Any]]) -> str:
    """What a decision's journal entries cost, in a few words (``watchdog history``, the report).

    A live change is ``live``; a restore in process its price (measured decision to first new step when
    known); a relaunch its price (measured start-up when known) and how it went: at once, after waiting
    for a checkpoint, merged into another, or dropped.
    """
    parts = []
    for j in journal:
        payload, result, status = j.get("payload") or {}, j.get("result") or {}, j.get("status", "")
        cost = payload.get("cost")
        if not isinstance(cost, Mapping):
            continue
        if cost.get("in_process"):
            if result.get("handed_to") is None:  # (else by the restart it handed over to, priced there)
                measured = result.get("first_step_s")
                secs = f"{measured:.0f} s measured" if isinstance(measured, (int, float)) else f"~{cost['seconds']:.0f} s"
                steps = cost.get("steps_lost")
                parts.append(f"in process {secs}" + (f", {steps} steps again" if steps else ""))
            continue
        if not cost.get("relaunch"):
            parts.append("live")
            continue
        if status == ActionStatus.WAITING:
            parts.append("deferred: waits for the next checkpoint")
            continue
        outcome = str(result.get("outcome", ""))
        if result.get("handed_to") is not None:
            continue  # carried out by the restart entry it handed over to, priced there
        if status == ActionStatus.DROPPED or outcome.startswith(("merged", "carried")):
            parts.append(outcome.split(":")[0] if status == ActionStatus.DROPPED else outcome)
            continue
        measured = result.get("relaunch_s")
        secs = f"{measured:.0f} s measured" if isinstance(measured, (int, float)) else f"~{cost['seconds']:.0f} s"
        steps = result.get("steps_lost", cost.get("steps_lost"))
        lost = f", {steps} steps again" if steps else ""
        when = " after waiting for a checkpoint" if "clock" in payload else ""
        parts.append(f"relaunch {secs}{lost}{when}")
    return "; ".join(parts) or "-"

