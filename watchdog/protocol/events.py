"""events.jsonl lines as validated :class:`Event` objects.

A trainer (or the watchdog's zero-patch glue, speaking for verl) appends one line per event:
``{"ts": 1733050000.1, "step": 12, "kind": "checkpoint", ...fields}``. An :class:`Event` is that
line as a dict, checked once where it is read: ``kind`` a string, ``step`` a non-negative
integer or null, ``ts`` a finite number. What a line may carry beyond those three is the
event's own (``path`` of a checkpoint, ``micro_batch_size`` of an OOM). A line that fails the
check is an :class:`EventError` naming the file, line and field; readers skip it and say so.

Pure: no I/O here (:mod:`~ppo_watchdog.protocol.rundir` reads and appends the file), so the rules
core imports the event vocabulary without touching a file.
"""

from __future__ import annotations

import math
from typing import Any

from ppo_watchdog.protocol.inputs import short_repr

#: The largest step a metrics line or an event may carry: the largest integer every JSON reader reads exactly
#: (2**53 - 1), far past any training run, and what a window's 64-bit step arrays hold with room to spare.
MAX_STEP = 2**53 - 1

#: Event kinds a trainer records in events.jsonl (a newer trainer's other kinds are read, not written).
EVENT_KINDS = frozenset(
    {
        "started", "finished", "checkpoint", "oom", "nan", "applied", "error",
        "paused", "resumed", "rollback", "stopped", "fault", "validation",
    }
)


#: The ``what`` of an ``error`` event a trainer writes when the checkpoint it was told to resume from cannot be
#: loaded (its ``path`` in the event): the watchdog relaunches from the one before it, never that one again.
RESUME_FAILED = "resume"


def resume_failure(e: Any) -> str | None:
    """The checkpoint path an event says could not be resumed from (None: no such event)."""
    if e.get("kind") == "error" and e.get("what") == RESUME_FAILED and isinstance(e.get("path"), str):
        return str(e["path"])
    return None


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


#: Fields the watchdog acts on, by event kind: each must be a non-negative integer (or null where
#: the field is optional). A line that breaks one is refused as a whole (it would be misread).
_COUNTS: dict[str, tuple[tuple[str, bool], ...]] = {
    "applied": (("version", False),),
    "rollback": (("to_step", True), ("from_step", True)),
    "started": (("resumed_from", True), ("attempt", True)),
    "oom": (("micro_batch_size", True),),
}


class EventError(ValueError):
    """An events.jsonl line that is not a valid event; the message is ``where: field: reason``."""

    def __init__(self, where: str, field: str | None, reason: str) -> None:
        super().__init__(f"{where}: {field!r}: {reason}" if field else f"{where}: {reason}")
        self.where = where
        self.field = field


#: Steps past a run's last logged step an event may carry: an OOM or NaN in the middle of the step
#: being trained is recorded at that step, one past the last metric line.
STEP_SLACK = 1


class Event(dict[str, Any]):
    """One event, as written (a JSON object), with its three common fields checked and typed."""

    where: str = ""
    """Where it was read (``file:line``), for messages; not part of the event."""

    @property
    def kind(self) -> str:
        return str(self["kind"])

    @property
    def step(self) -> int | None:
        step = self.get("step")
        return step if isinstance(step, int) else None

    @property
    def ts(self) -> float | None:
        ts = self.get("ts")
        return float(ts) if isinstance(ts, (int, float)) else None

    @classmethod
    def parse(cls, obj: Any, where: str = "events.jsonl") -> Event:
        """Validate one decoded line; raise :class:`EventError` naming the field at fault."""
        if not isinstance(obj, dict):
            raise EventError(where, None, f"not a JSON object ({type(obj).__name__})")
        kind = obj.get("kind")
        if not isinstance(kind, str) or not kind:
            raise EventError(where, "kind", f"must be a non-empty string, got {short_repr(kind, 60)}")
        step = obj.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP):
            raise EventError(where, "step", f"must be a non-negative integer (at most 2**53 - 1) or null, got "
                                            f"{short_repr(step, 60)}")
        ts = obj.get("ts")
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts)):
            raise EventError(where, "ts", f"must be a finite number (unix time), got {short_repr(ts, 60)}")
        for name, optional in _COUNTS.get(kind, ()):
            value = obj.get(name)
            if (value is None and not optional) or (value is not None and not _count(value)):
                raise EventError(where, name, f"a {kind} event's {name} must be a non-negative integer"
                                 f"{' or null' if optional else ''}, got {short_repr(value, 60)}")
        if kind == "applied" and not isinstance(obj.get("commands", []), list):
            raise EventError(where, "commands", f"must be a list, got {short_repr(obj.get('commands'), 60)}")
        event = cls(obj)
        event.where = where
        return event

    @classmethod
    def new(cls, kind: str, step: int | None, ts: float, **fields: Any) -> Event:
        """An event about to be written (the kind must be one of :data:`EVENT_KINDS`)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        return cls.parse({"ts": ts, "step": step, "kind": kind, **fields}, f"event {kind!r}")


def past_the_end(events: list[Event], last_step: int | None) -> tuple[list[Event], list[Event]]:
    """(events within the run's steps, events whose step lies past its last step + :data:`STEP_SLACK`).

    An event past the end of the run (a hand-edited line, a step from another run) is never acted on:
    a rule evaluated at the last step would otherwise take it for something that happened there.
    """
    if last_step is None:
        return list(events), []
    inside = [e for e in events if e.step is None or e.step <= last_step + STEP_SLACK]
    return inside, [e for e in events if e.step is not None and e.step > last_step + STEP_SLACK]


def outside_message(event: Event, last_step: int) -> str:
    """What a reader says about an event :func:`past_the_end` left out (file:line first)."""
    return (f"{event.where or 'events'}: a {event.kind!r} event at step {event.step}, past the run's last step "
            f"{last_step}: ignored, never acted on")
