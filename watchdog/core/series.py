"""Per-step series of one run, as the rules engine sees them.

A :class:`Window` holds, for each metric short name (``watchdog.protocol.catalog``), the values of
the last ``size`` steps, plus the run's events. It is built incrementally (one
:meth:`Window.append` per step, amortised O(1)) because the daemon keeps one per run and
evaluates thousands of runs per tick; window functions read contiguous tail slices of
plain lists found by ``bisect``, so a rule evaluation costs microseconds.

Steps, not seconds: every window is "the last N training steps", the unit a training
engineer reasons in. A step that arrives at or below the newest one (a resumed or rolled
back run rewrites steps) first drops everything recorded at that step and after, so the
newest line for a step wins and a rolled-back branch does not pollute the windows.

Events (``oom``, ``nan``, ``rollback`` ...) get a sequence number when added; the engine
remembers the last sequence number it saw, which is what makes ``event("oom")`` mean
"since the last evaluation" while :func:`watchdog.core.engine.evaluate` stays pure. A daemon
that rebuilds a window after a restart must add the run's events in file order (events.jsonl
is append-only), so sequence numbers match the ones its persisted engine state remembers.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from watchdog.protocol import catalog

#: Events kept per window; old ones only matter to ``event_count`` over long windows.
MAX_EVENTS = 512


class EvalError(ValueError):
    """A rule could not be evaluated on this window (the rule is marked unhealthy)."""


class MissingDataError(EvalError, LookupError):
    """A metric (or enough points of it) is absent at the evaluated step."""


class _Series:
    """Steps and values of one metric, ascending by step; ``best`` is the running max."""

    __slots__ = ("steps", "values", "best", "best_at", "evicted_best", "evicted_best_at", "lowest")

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[float] = []
        self.best: list[float] = []
        self.best_at: list[int] = []
        """Step at which ``best`` was first reached (for since_best)."""
        # The running max of values already trimmed away, so best-so-far covers the whole run.
        self.evicted_best = -math.inf
        self.evicted_best_at = 0
        self.lowest = math.inf
        """Lowest value ever appended (also from a rolled-back branch; NaN never)."""


class Window:
    """The last ``size`` steps of one run's metrics (by short name) and its events."""

    def __init__(self, size: int | None = None) -> None:
        if size is not None and size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        """Steps kept per metric (None: all)."""
        self.step: int | None = None
        """Newest step appended (None before the first)."""
        self._series: dict[str, _Series] = {}
        self._steps: list[int] = []
        self._events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=MAX_EVENTS)
        self.event_seq = 0
        """Sequence number of the newest event (0: none yet)."""
        self.nonfinite_steps: set[int] = set()
        """Steps at which some metric was NaN or inf (``nonfinite()`` without arguments)."""
        self.cache: dict[tuple[Any, ...], float] = {}
        """Window-function results at the current data; cleared on every append."""
        self.sources: dict[str, str] = {}
        """The verl key each short name was last read from (``kl``: ``actor/kl_loss`` in a GRPO run)."""

    # -- building ---------------------------------------------------------------------

    @classmethod
    def from_records(
        cls,
        records: Sequence[Mapping[str, Any]],
        events: Sequence[Mapping[str, Any]] = (),
        size: int | None = None,
    ) -> Window:
        """A window from verl FileLogger records ``{"step": N, "data": {verl keys}}`` and events.

        Records are taken in the order written: a resumed or rolled-back run rewrites steps,
        and appending in file order is what drops the abandoned branch.
        """
        w = cls(size)
        for rec in records:
            w.append_record(rec)
        w.add_events(events)
        return w

    def append_record(self, record: Mapping[str, Any]) -> None:
        """Append one FileLogger record; verl keys (and their aliases) map through the catalog."""
        data = record.get("data", {})
        self.append(int(record["step"]), catalog.to_short(data if isinstance(data, Mapping) else {}, self.sources))

    def append(self, step: int, values: Mapping[str, float]) -> None:
        """Record one step's values (short names). A step <= the newest first drops that step and later."""
        self.cache.clear()
        if self.step is not None and step <= self.step:
            self._truncate_from(step)
        for name, value in values.items():
            s = self._series.get(name)
            if s is None:
                s = self._series[name] = _Series()
            v = float(value)
            if v - v != 0.0:  # NaN or +-inf, without a function call per value
                self.nonfinite_steps.add(step)
            if s.best:
                prev, prev_at = s.best[-1], s.best_at[-1]
            else:
                prev, prev_at = s.evicted_best, s.evicted_best_at
            s.steps.append(step)
            s.values.append(v)
            if v < s.lowest:
                s.lowest = v
            # NaN never becomes "best": a diverged step must not reset a stall detector.
            if v > prev:
                s.best.append(v)
                s.best_at.append(step)
            else:
                s.best.append(prev)
                s.best_at.append(prev_at)
            if self.size is not None and len(s.steps) > 2 * self.size:
                self._trim(s)
        self._steps.append(step)
        if self.size is not None and len(self._steps) > 2 * self.size:
            del self._steps[: len(self._steps) - self.size]
            if self.nonfinite_steps:
                self.nonfinite_steps = {s for s in self.nonfinite_steps if s >= self._steps[0]}
        self.step = step

    def _trim(self, s: _Series) -> None:
        # Trimming in halves keeps append amortised O(1) and slices contiguous.
        cut = len(s.steps) - self.size  # type: ignore[operator]
        s.evicted_best, s.evicted_best_at = s.best[cut - 1], s.best_at[cut - 1]
        del s.steps[:cut], s.values[:cut], s.best[:cut], s.best_at[:cut]

    def _truncate_from(self, step: int) -> None:
        for s in self._series.values():
            i = bisect_left(s.steps, step)
            del s.steps[i:], s.values[i:], s.best[i:], s.best_at[i:]
        del self._steps[bisect_left(self._steps, step):]
        self.nonfinite_steps = {s for s in self.nonfinite_steps if s < step}
        self.step = self._steps[-1] if self._steps else None

    def add_event(self, event: Mapping[str, Any]) -> int:
        """Add one event (``{"kind": ..., "step": ...}``); returns its sequence number."""
        self.event_seq += 1
        self._events.append((self.event_seq, dict(event)))
        self.cache.clear()
        return self.event_seq

    def add_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Add events in order."""
        for e in events:
            self.add_event(e)

    # -- reading ----------------------------------------------------------------------

    def names(self) -> list[str]:
        """Short names with at least one value in the window."""
        return sorted(n for n, s in self._series.items() if s.steps)

    def steps(self, n: int | None = None, at: int | None = None) -> list[int]:
        """Steps recorded in the last ``n`` steps ending at ``at`` (default: newest)."""
        at = self.step if at is None else at
        if at is None:
            return []
        hi = bisect_right(self._steps, at)
        lo = 0 if n is None else bisect_right(self._steps, at - n)
        return self._steps[lo:hi]

    def value(self, name: str, at: int | None = None) -> float:
        """The value of ``name`` at step ``at`` (default: newest); MissingDataError when absent."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None:
            raise MissingDataError(f"no data for metric {name!r}")
        if s.steps and s.steps[-1] == at:
            return s.values[-1]
        i = bisect_left(s.steps, at)
        if i < len(s.steps) and s.steps[i] == at:
            return s.values[i]
        raise MissingDataError(f"metric {name!r} has no value at step {at}")

    def has(self, name: str, at: int | None = None) -> bool:
        """True when ``name`` has a value at step ``at``."""
        try:
            self.value(name, at)
        except MissingDataError:
            return False
        return True

    def values(self, name: str, n: int, at: int | None = None) -> list[float]:
        """Values of ``name`` in the last ``n`` steps ending at ``at``: steps in (at-n, at]."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None:
            return []
        steps = s.steps
        hi = len(steps) if steps and steps[-1] <= at else bisect_right(steps, at)
        lo = bisect_right(steps, at - n, 0, hi)
        return s.values[lo:hi]

    def points(self, name: str, n: int, at: int | None = None) -> tuple[list[int], list[float]]:
        """Steps and values of ``name`` in the last ``n`` steps ending at ``at``."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None:
            return [], []
        hi = bisect_right(s.steps, at)
        lo = bisect_right(s.steps, at - n, 0, hi)
        return s.steps[lo:hi], s.values[lo:hi]

    def best(self, name: str, at: int | None = None) -> float:
        """Best-so-far (max over the whole run up to ``at``, NaN ignored); MissingDataError if none."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None:
            raise MissingDataError(f"no data for metric {name!r}")
        i = bisect_right(s.steps, at)
        b = s.best[i - 1] if i else s.evicted_best
        if b == -math.inf:
            raise MissingDataError(f"metric {name!r} has no finite value up to step {at}")
        return b

    def lowest(self, name: str) -> float:
        """The lowest value ``name`` ever had in this run (NaN ignored); MissingDataError if none."""
        s = self._series.get(name)
        if s is None or s.lowest == math.inf:
            raise MissingDataError(f"no finite data for metric {name!r}")
        return s.lowest

    def since_best(self, name: str, at: int | None = None) -> int:
        """Steps since ``name`` last reached a new best (0: this step is the best so far)."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None or not s.steps:
            raise MissingDataError(f"no data for metric {name!r}")
        i = bisect_right(s.steps, at) - 1
        if i < 0:
            raise MissingDataError(f"metric {name!r} has no value up to step {at}")
        if s.best[i] == -math.inf:
            raise MissingDataError(f"metric {name!r} has no finite value up to step {at}")
        return at - s.best_at[i]

    def row(self, at: int | None = None) -> dict[str, float]:
        """All values recorded at step ``at`` (default: newest), by short name."""
        at = self.step if at is None else at
        out: dict[str, float] = {}
        if at is None:
            return out
        for name, s in self._series.items():
            if s.steps and s.steps[-1] == at:
                out[name] = s.values[-1]
            else:
                i = bisect_left(s.steps, at)
                if i < len(s.steps) and s.steps[i] == at:
                    out[name] = s.values[i]
        return out

    def events_since(self, seq: int) -> list[dict[str, Any]]:
        """Events added after sequence number ``seq``, oldest first."""
        out = []
        for s, e in reversed(self._events):
            if s <= seq:
                break
            out.append(e)
        out.reverse()
        return out

    def count_events(self, kind: str, since_seq: int) -> int:
        """Events of ``kind`` added after sequence number ``since_seq``."""
        n = 0
        for s, e in reversed(self._events):
            if s <= since_seq:
                break
            if e.get("kind") == kind:
                n += 1
        return n

    def count_events_in(self, kind: str, n: int, at: int | None = None) -> int:
        """Events of ``kind`` whose step is after ``at - n`` (events without a step count too).

        Steps of events recorded before a rollback lie "in the future" of the rewound
        run; they still count, which is what makes repeated rollbacks visible.
        """
        at = self.step if at is None else at
        lo = -math.inf if at is None else at - n
        c = 0
        for _, e in self._events:
            st = e.get("step")
            if e.get("kind") == kind and (st is None or st > lo):
                c += 1
        return c
