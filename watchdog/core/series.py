"""Per-step series of one run, as the rules engine sees them.

A :class:`Window` holds, for each metric short name (``ppo_watchdog.protocol.catalog``), the values of
the last ``size`` steps, plus the run's events. It is built incrementally (one
:meth:`Window.append` per step, amortised O(1)) because the daemon keeps one per run and
evaluates thousands of runs per tick; window functions read contiguous tail slices found
by ``bisect``, so a rule evaluation costs microseconds.

Memory: a daemon holds one window per run for as long as it watches it, so a window stores
unboxed numbers. The steps of the run are one ``array('q')`` shared by every metric logged at
each of them (a verl record carries all its metrics at one step); a metric's values are one
``array('d')`` aligned with those steps. Only a metric with gaps (logged every few steps,
or absent for a while) keeps its own ``array('q')`` of steps, and goes back to the shared
one once its kept values are contiguous again. The running best (``best``, ``since_best``) is
two numbers per metric, recomputed from the kept values when asked at an earlier step. A window
built for rules (``Window(window_steps(rules.max_window), rules.metrics)``, as the daemon does) keeps
only the metrics they read, for the steps they read: about 25 KB a run for the default pack on a
verl record of ~100 keys, where lists of every catalog metric held 240 KB (``tests/test_series.py``
holds it under 50 KB; ``bench/bench_rules.py`` reports KB per run). Events are two small arrays
(kind index, step); the last :data:`MAX_EVENTS` are read. Two things serve the engine's hot path:
``now``, the newest step's values by name (rules read the step just appended), and ``slides``, the
sorted values of long ``median``/``min``/``max`` windows carried across steps (``ppo_watchdog.core.expr``).

Steps, not seconds: every window is "the last N training steps", the unit a training
engineer reasons in, at the run's logging cadence: a run that logs every ``c`` steps (TRL's
``logging_steps``) has one record, one look, per ``c`` steps, so its windows reach ``c`` times as far
(``cadence``, the median spacing of its last :data:`CADENCE_GAPS` records): "the 5 steps before" is
the 5 records before, the same number of looks whether a run logs every step or every 20. A count
("below every one of the 5 before"), a median or a standard deviation is as good as the number of
values it reads, not the steps they span. A step that arrives at or below the newest one (a resumed or rolled
back run rewrites steps) first drops everything recorded at that step and after, so the
newest line for a step wins and a rolled-back branch does not pollute the windows.

Events (``oom``, ``nan``, ``rollback`` ...) get a sequence number when added; the engine
remembers the last sequence number it saw, which is what makes ``event("oom")`` mean
"since the last evaluation" while :func:`ppo_watchdog.core.engine.evaluate` stays pure. A daemon
that rebuilds a window after a restart must add the run's events in file order (events.jsonl
is append-only), so sequence numbers match the ones its persisted engine state remembers.
The window keeps what rules read of an event, its kind and step; the rest stays in
events.jsonl.
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ppo_watchdog.protocol import catalog

#: Events kept per window; old ones only matter to ``event_count`` over long windows.
MAX_EVENTS = 512

#: The most steps a window sized from rules keeps (:func:`window_steps`): the longest reach of an
#: expression (a window of 100,000 steps lagged by 100,000, and the step itself). A window holds
#: at most twice its size per metric (it trims in halves), 16 bytes per kept metric and step.
MAX_WINDOW_STEPS = 200_001


def window_steps(max_window: int) -> int:
    """Window size for rules reading ``max_window`` steps back (``RuleSet.max_window``): that and
    the current step, at most :data:`MAX_WINDOW_STEPS` (a ``for:`` longer than that is counted by
    the engine's state, not read from the window)."""
    return max(1, min(int(max_window) + 1, MAX_WINDOW_STEPS))


#: Record spacings the cadence is the median of: enough that one missed or repeated line does not move it,
#: few enough that a run which changes its logging interval is read at the new one within a few records.
CADENCE_GAPS = 8


_NO_STEP = -(2**63)
"""An event's step in the window's step array when it has none."""
_ODD_STEP = _NO_STEP + 1
"""... when it is not an int (the value is kept aside, as given)."""

_NEG_INF = -math.inf  # one object for every series' initial best (``-math.inf`` boxes a new float)


class EvalError(ValueError):
    """A rule could not be evaluated on this window (the rule is marked unhealthy)."""


class MissingDataError(EvalError, LookupError):
    """A metric (or enough points of it) is absent at the evaluated step."""


class _Series:
    """Values of one metric, ascending by step, and what is remembered of values trimmed away.

    Aligned (``steps is None``): ``values[k]`` was logged at the window's row ``row0 + k`` (rows
    are numbered from the window's first, ``Window._lo``), so the metric shares the window's
    steps array. Otherwise ``steps`` holds its own steps, one per value.
    """

    __slots__ = ("values", "row0", "steps", "top", "top_at", "evicted_best", "evicted_best_at", "lowest",
                 "evicted_lowest", "base")

    def __init__(self, row0: int) -> None:
        self.values = array("d")
        self.row0 = row0
        self.base = 0
        """Values trimmed from the front so far: ``values[k]`` is the series' value number ``base + k``
        (numbers stay with their values until a rewind, which clears ``Window.slides``)."""
        self.steps: array[int] | None = None
        self.top = _NEG_INF
        """Best (max, NaN never) over every value of the branch, kept or trimmed: ``best`` now."""
        self.top_at = 0
        """Step at which ``top`` was first reached (for since_best)."""
        # The running max of values already trimmed away, so best-so-far covers the whole run.
        self.evicted_best = _NEG_INF
        self.evicted_best_at = 0
        self.lowest = math.inf
        """Lowest (min, NaN never) over every value of the branch, kept or trimmed: ``lowest`` now. A rolled-back
        branch's values leave it with them: the entropy of a policy the run no longer has is no baseline."""
        self.evicted_lowest = math.inf
        """The running min of values already trimmed away."""


def _running_lowest(values: Sequence[float], hi: int, low: float) -> float:
    """The min of ``low`` and ``values[:hi]`` (NaN never wins)."""
    for k in range(hi):
        v = values[k]
        if v < low:
            low = v
    return low


def _running_best(values: Sequence[float], hi: int, best: float) -> tuple[float, int]:
    """The max of ``best`` and ``values[:hi]`` (NaN never wins) and the index first reaching it
    (-1: ``best`` itself). Strictly greater replaces, so ties keep the first step."""
    at = -1
    for k in range(hi):
        v = values[k]
        if v > best:
            best, at = v, k
    return best, at


class Window:
    """The last ``size`` steps of one run's metrics (by short name) and its events."""

    def __init__(self, size: int | None = None, metrics: Iterable[str] | None = None) -> None:
        if size is not None and size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        """Steps kept per metric (None: all)."""
        self.metrics = frozenset(metrics) if metrics is not None else None
        """Short names whose values are kept (None: all). A daemon passes the ones its rules read
        (``RuleSet.metrics``); every value still counts for ``nonfinite()`` and ``sources``."""
        self.step: int | None = None
        """Newest step appended (None before the first)."""
        self.cadence = 1
        """Steps between the run's records: the median (the lower middle one) of the spacings of its last
        :data:`CADENCE_GAPS` + 1 rows (1 before it has two). Every window function's steps are this many steps
        each (``locate``, ``values``, ``points``, ``steps``)."""
        self._gaps: array[int] = array("q")
        self.now: dict[str, float] = {}
        """The values of the newest step (``step``) by short name, of the metrics kept: what
        ``value(name)`` gives at that step, read by rules without a bisection (``ppo_watchdog.core.expr``)."""
        self._series: dict[str, _Series] = {}
        self._rows: array[int] = array("q")
        """The window's steps, one row per appended record, ascending."""
        self._lo = 0
        """Number of rows trimmed away before ``_rows[0]`` (aligned series count rows from it)."""
        self._ev_kind = array("H")
        """Per event kept, oldest first: its kind, as an index into ``_kinds``. The sequence number
        of ``_ev_kind[i]`` is ``event_seq - len(_ev_kind) + 1 + i`` (events are never removed but
        from the front)."""
        self._ev_step = array("q")
        """Per event kept: its step (``_NO_STEP``: none; ``_ODD_STEP``: not an int, in ``_odd_steps``)."""
        self._kinds: list[Any] = []
        """The distinct event kinds of this run (a handful)."""
        self._odd_steps: dict[int, Any] = {}
        """Sequence number -> a step that is not an int (kept as given, as before)."""
        self.event_seq = 0
        """Sequence number of the newest event (0: none yet)."""
        self.nonfinite_steps: set[int] = set()
        """Steps at which some metric was NaN or inf (``nonfinite()`` without arguments)."""
        self.cache: dict[str, Any] = {}
        """Window-function results at the current data and step ``cache_at``, by the function's text
        (``ppo_watchdog.core.expr``); cleared on every append and event, and when ``cache_at`` moves."""
        self.cache_at: int | None = None
        """The evaluated step the entries of ``cache`` are for."""
        self.slides: dict[str, list[Any]] = {}
        """Sorted values of the windows ``median``, ``min`` and ``max`` read, carried from one evaluated step
        to the next and slid by the values that left and entered (``ppo_watchdog.core.expr``): by the text of
        the window, ``[series, first value number, end value number, sorted non-NaN values, NaN count]``.
        Value numbers (``_Series.base``) survive appends and trims; a rewind clears this."""
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
        ok = type(data) is dict or isinstance(data, Mapping)  # the ABC check only for what is not a dict
        self.append(int(record["step"]), catalog.to_short(data if ok else {}, self.sources))

    def append(self, step: int, values: Mapping[str, float]) -> None:
        """Record one step's values (short names). A step <= the newest first drops that step and later."""
        self.cache.clear()
        if self.step is not None and step <= self.step:
            self._truncate_from(step)
        rows = self._rows
        if rows:
            self._gap(step - rows[-1])
        row = self._lo + len(rows)
        rows.append(step)
        size = self.size
        limit = 2 * size if size is not None else None
        keep = self.metrics
        series = self._series
        now: dict[str, float] = {}
        for name, value in values.items():
            v = float(value)
            if v - v != 0.0:  # NaN or +-inf, without a function call per value
                self.nonfinite_steps.add(step)
            if keep is not None and name not in keep:
                continue
            now[name] = v
            s = series.get(name)
            if s is None:
                s = series[name] = _Series(row)
            vals = s.values
            if s.steps is not None:
                s.steps.append(step)
            elif not vals:
                s.row0 = row
            elif s.row0 + len(vals) != row:
                self._unalign(s)  # a gap: this metric was not logged at every step since
                s.steps.append(step)  # type: ignore[union-attr,attr-defined]
            vals.append(v)
            if v < s.lowest:
                s.lowest = v
            # NaN never becomes "best": a diverged step must not reset a stall detector.
            if v > s.top:
                s.top, s.top_at = v, step
            if limit is not None and len(vals) > limit:
                self._trim(s, size)  # type: ignore[arg-type]
        if limit is not None and len(rows) > limit:
            self._trim_rows(size)  # type: ignore[arg-type]
        self.now = now  # (with ``step``: a value that failed to convert leaves both as they were)
        self.step = step

    def _gap(self, gap: int) -> None:
        gaps = self._gaps
        gaps.append(gap)
        left = gaps.pop(0) if len(gaps) > CADENCE_GAPS else gap
        if gap != self.cadence or left != self.cadence:  # (a run at its cadence: nothing to sort)
            srt = sorted(gaps)
            self.cadence = max(1, srt[(len(srt) - 1) // 2])

    def _unalign(self, s: _Series) -> None:
        a = s.row0 - self._lo
        s.steps = self._rows[a:a + len(s.values)]

    def _trim(self, s: _Series, size: int) -> None:
        # Trimming in halves keeps append amortised O(1) and slices contiguous.
        cut = len(s.values) - size
        best, k = _running_best(s.values, cut, s.evicted_best)
        if k >= 0:
            s.evicted_best, s.evicted_best_at = best, self._step_of(s, k)
        s.evicted_lowest = _running_lowest(s.values, cut, s.evicted_lowest)
        del s.values[:cut]
        s.base += cut
        if s.steps is None:
            s.row0 += cut
            return
        del s.steps[:cut]
        # Contiguous with the window's newest rows again (a metric that started late, or
        # came back after a gap): share the window's steps from now on.
        rows = self._rows
        i = bisect_left(rows, s.steps[0])
        n = len(s.steps)
        if i + n <= len(rows) and rows[i] == s.steps[0] and rows[i + n - 1] == s.steps[-1]:
            s.row0, s.steps = self._lo + i, None

    def _trim_rows(self, size: int) -> None:
        cut = len(self._rows) - size
        lo = self._lo + cut
        for s in self._series.values():
            if s.steps is None and s.row0 < lo:
                if s.values:
                    self._unalign(s)  # keeps values older than the window's rows (by its own count)
                else:
                    s.row0 = lo
        del self._rows[:cut]
        self._lo = lo
        if len(self._rows) <= CADENCE_GAPS:  # (a window of fewer rows than the cadence reads: of those it keeps)
            self._recount()
        if self.nonfinite_steps:
            first = self._rows[0]
            self.nonfinite_steps = {st for st in self.nonfinite_steps if st >= first}

    def _truncate_from(self, step: int) -> None:
        # Value numbers past the cut are given again to the new branch's values: no slide survives.
        self.slides.clear()
        self.now = {}
        rows = self._rows
        end = self._lo + bisect_left(rows, step)
        for s in self._series.values():
            if s.steps is None:
                keep = max(0, min(len(s.values), end - s.row0))
            else:
                keep = bisect_left(s.steps, step)
                del s.steps[keep:]
            if keep < len(s.values):
                del s.values[keep:]
                best, k = _running_best(s.values, keep, s.evicted_best)
                s.top, s.top_at = best, (self._step_of(s, k) if k >= 0 else s.evicted_best_at)
                s.lowest = _running_lowest(s.values, keep, s.evicted_lowest)
            if not keep:
                s.row0, s.steps = end, None  # empty: aligned again, from the next row
        del rows[end - self._lo:]
        self.nonfinite_steps = {st for st in self.nonfinite_steps if st < step}
        self.step = rows[-1] if rows else None
        self._recount()

    def _recount(self) -> None:
        """The cadence again from the rows kept (after a rewind, or a trim to fewer rows than it reads)."""
        tail = self._rows[-CADENCE_GAPS - 1:]
        self._gaps = array("q", [b - a for a, b in zip(tail, tail[1:], strict=False)])
        gaps = sorted(self._gaps)
        self.cadence = max(1, gaps[(len(gaps) - 1) // 2]) if gaps else 1

    def _step_of(self, s: _Series, k: int) -> int:
        return s.steps[k] if s.steps is not None else self._rows[s.row0 - self._lo + k]

    def _span(self, s: _Series) -> tuple[Sequence[int], int, int]:
        """The steps of ``s`` as (sequence, first index, end index): its own, or a range of the rows."""
        if s.steps is not None:
            return s.steps, 0, len(s.steps)
        a = s.row0 - self._lo
        return self._rows, a, a + len(s.values)

    def add_event(self, event: Mapping[str, Any]) -> int:
        """Add one event (``{"kind": ..., "step": ...}``); returns its sequence number."""
        self.event_seq += 1
        kind = event.get("kind")
        kinds = self._kinds
        try:
            k = kinds.index(kind)
        except ValueError:
            k = len(kinds)
            if k > 0xFFFF:
                raise EvalError(f"more than {k} distinct event kinds in one run") from None
            kinds.append(sys.intern(kind) if type(kind) is str else kind)
        step = event.get("step")
        if step is None:
            code = _NO_STEP
        elif type(step) is int and _ODD_STEP < step < 2**63:
            code = step
        else:
            code = _ODD_STEP
            self._odd_steps[self.event_seq] = step
        self._ev_kind.append(k)
        self._ev_step.append(code)
        if len(self._ev_kind) > 2 * MAX_EVENTS:  # in halves: amortised O(1); queries read the last MAX_EVENTS
            cut = len(self._ev_kind) - MAX_EVENTS
            del self._ev_kind[:cut], self._ev_step[:cut]
            if self._odd_steps:
                first = self.event_seq - MAX_EVENTS + 1
                self._odd_steps = {q: v for q, v in self._odd_steps.items() if q >= first}
        self.cache.clear()
        return self.event_seq

    def _recent_events(self, since_seq: int) -> range:
        """Indices into the event arrays of the events after ``since_seq`` (of the last MAX_EVENTS)."""
        n = len(self._ev_kind)
        first_seq = self.event_seq - n + 1  # sequence number of index 0
        lo = max(n - MAX_EVENTS, since_seq + 1 - first_seq, 0)
        return range(lo, n)

    def _event_step(self, i: int) -> Any:
        code = self._ev_step[i]
        if code == _NO_STEP:
            return None
        if code == _ODD_STEP:
            return self._odd_steps.get(self.event_seq - len(self._ev_step) + 1 + i)
        return code

    def add_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Add events in order."""
        for e in events:
            self.add_event(e)

    # -- reading ----------------------------------------------------------------------

    def names(self) -> list[str]:
        """Short names with at least one value in the window."""
        return sorted(n for n, s in self._series.items() if s.values)

    def steps(self, n: int | None = None, at: int | None = None) -> list[int]:
        """Steps recorded in the last ``n`` steps (at the run's cadence) ending at ``at`` (default: newest)."""
        at = self.step if at is None else at
        if at is None:
            return []
        hi = bisect_right(self._rows, at)
        lo = 0 if n is None else bisect_right(self._rows, at - n * self.cadence)
        return self._rows[lo:hi].tolist()

    def value(self, name: str, at: int | None = None) -> float:
        """The value of ``name`` at step ``at`` (default: newest); MissingDataError when absent."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None:
            raise MissingDataError(f"no data for metric {name!r}")
        # _span inlined: every rule reads metrics at the evaluated step, the newest one.
        steps = s.steps
        if steps is None:
            steps = self._rows
            a = s.row0 - self._lo
            b = a + len(s.values)
        else:
            a, b = 0, len(steps)
        if b > a and steps[b - 1] == at:
            return s.values[-1]
        i = bisect_left(steps, at, a, b)
        if i < b and steps[i] == at:
            return s.values[i - a]
        raise MissingDataError(f"metric {name!r} has no value at step {at}")

    def has(self, name: str, at: int | None = None) -> bool:
        """True when ``name`` has a value at step ``at``."""
        try:
            self.value(name, at)
        except MissingDataError:
            return False
        return True

    def values(self, name: str, n: int, at: int | None = None) -> Sequence[float]:
        """Values of ``name`` in the last ``n`` steps ending at ``at``, at the run's cadence: steps in
        (at - n * cadence, at]."""
        at = self.step if at is None else at
        if at is None:
            return ()
        s, i, j = self.locate(name, at, n)
        return s.values[i:j] if s is not None else ()

    def locate(self, name: str, at: int, n: int, lag: int = 0) -> tuple[_Series | None, int, int]:
        """Where the ``n`` steps ending ``lag`` steps before ``at`` of ``name`` lie in its series, at the run's
        cadence ``c``: steps in (at - (lag + n) * c, at - lag * c]; (the series, first value index, end value
        index), or (None, 0, 0) when it was never logged. The hot path of every window function (``_span``
        inlined; ``ppo_watchdog.core.expr`` caches the answer for the step it evaluates)."""
        s = self._series.get(name)
        if s is None:
            return None, 0, 0
        c = self.cadence
        end = at - lag * c
        n *= c
        steps = s.steps
        if steps is None:
            steps = self._rows
            a = s.row0 - self._lo
            b = a + len(s.values)
        else:
            a, b = 0, len(steps)
        hi = b if b > a and steps[b - 1] <= end else bisect_right(steps, end, a, b)
        lo = bisect_right(steps, end - n, a, hi)
        return s, lo - a, hi - a

    def points(self, name: str, n: int, at: int | None = None) -> tuple[Sequence[int], Sequence[float]]:
        """Steps and values of ``name`` in the last ``n`` steps (at the run's cadence) ending at ``at``."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None:
            return (), ()
        steps, a, b = self._span(s)
        hi = bisect_right(steps, at, a, b)
        lo = bisect_right(steps, at - n * self.cadence, a, hi)
        return steps[lo:hi], s.values[lo - a:hi - a]

    def _best_upto(self, s: _Series, at: int) -> tuple[int, float, int]:
        """(values up to ``at``, the best over them and everything trimmed, the step first reaching it)."""
        steps, a, b = self._span(s)
        i = (b if b > a and steps[b - 1] <= at else bisect_right(steps, at, a, b)) - a
        if i == len(s.values):
            return i, s.top, s.top_at
        best, k = _running_best(s.values, i, s.evicted_best)
        return i, best, (self._step_of(s, k) if k >= 0 else s.evicted_best_at)

    def best(self, name: str, at: int | None = None) -> float:
        """Best-so-far (max over the whole run up to ``at``, NaN ignored); MissingDataError if none."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None:
            raise MissingDataError(f"no data for metric {name!r}")
        _, b, _ = self._best_upto(s, at)
        if b == -math.inf:
            raise MissingDataError(f"metric {name!r} has no finite value up to step {at}")
        return b

    def lowest(self, name: str) -> float:
        """The lowest value ``name`` had on the run's current branch (every kept or trimmed step; a rolled-back
        branch's steps left with it, as for :meth:`best`; NaN ignored); MissingDataError if none."""
        s = self._series.get(name)
        if s is None or s.lowest == math.inf:
            raise MissingDataError(f"no finite data for metric {name!r}")
        return s.lowest

    def since_best(self, name: str, at: int | None = None) -> int:
        """Steps since ``name`` last reached a new best (0: this step is the best so far)."""
        at = self.step if at is None else at
        s = self._series.get(name)
        if s is None or at is None or not s.values:
            raise MissingDataError(f"no data for metric {name!r}")
        i, b, b_at = self._best_upto(s, at)
        if i == 0:
            raise MissingDataError(f"metric {name!r} has no value up to step {at}")
        if b == -math.inf:
            raise MissingDataError(f"metric {name!r} has no finite value up to step {at}")
        return at - b_at

    def row(self, at: int | None = None) -> dict[str, float]:
        """All values recorded at step ``at`` (default: newest), by short name."""
        at = self.step if at is None else at
        out: dict[str, float] = {}
        if at is None:
            return out
        for name, s in self._series.items():
            steps, a, b = self._span(s)
            if b > a and steps[b - 1] == at:
                out[name] = s.values[-1]
            else:
                i = bisect_left(steps, at, a, b)
                if i < b and steps[i] == at:
                    out[name] = s.values[i - a]
        return out

    def events_since(self, seq: int) -> list[dict[str, Any]]:
        """Events added after sequence number ``seq``, oldest first, as their kind and step."""
        out: list[dict[str, Any]] = []
        kinds = self._kinds
        for i in self._recent_events(seq):
            step = self._event_step(i)
            kind = kinds[self._ev_kind[i]]
            out.append({"kind": kind} if step is None else {"kind": kind, "step": step})
        return out

    def count_events(self, kind: str, since_seq: int) -> int:
        """Events of ``kind`` added after sequence number ``since_seq``."""
        kinds = self._kinds
        if kind not in kinds:  # most runs have no events at all: no exception raised and caught
            return 0
        k = kinds.index(kind)
        ev = self._ev_kind
        return sum(1 for i in self._recent_events(since_seq) if ev[i] == k)

    def count_events_in(self, kind: str, n: int, at: int | None = None) -> int:
        """Events of ``kind`` whose step is after ``at - n`` (events without a step count too).

        Steps of events recorded before a rollback lie "in the future" of the rewound
        run; they still count, which is what makes repeated rollbacks visible.
        """
        at = self.step if at is None else at
        lo = -math.inf if at is None else at - n
        kinds = self._kinds
        if kind not in kinds:
            return 0
        k = kinds.index(kind)
        ev, steps = self._ev_kind, self._ev_step
        c = 0
        for i in self._recent_events(0):
            if ev[i] == k:
                code = steps[i]
                if code == _NO_STEP or (code > lo if code != _ODD_STEP else self._event_step(i) > lo):
                    c += 1
        return c
