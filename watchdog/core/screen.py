"""Which rules are surely false or surely true, for many runs at once: the engine's columnar screen.

A daemon evaluates one rule pack over hundreds of runs at each new step, and nearly every rule of nearly
every run is at rest and false: its condition's first test (``kl > $kl_jump * clamp_min(median(kl, 5, 1),
...)``) already fails. :class:`Screen` evaluates the pack's conditions over a batch of runs at once, one
numpy operation per node of the expression over every run, and answers, per run and rule, whether the
condition is **surely false** or **surely true**: :func:`ppo_watchdog.core.expr.compile_expr`'s closure would
return false (or true) at this step, without raising. The engine does not call the closure of those
(:func:`ppo_watchdog.core.engine.evaluate`'s ``verdicts``): a rule at rest and surely false is skipped whole, and
a rule pending or firing steps on the condition the screen gives (a run in trouble has such rules at every
step). What the screen cannot be sure of, it leaves to the closures, which stay the one definition of what
an expression means. So a screened evaluation gives the very decisions and states of an unscreened one
(``tests/test_screen.py`` holds it to that on random expressions and windows, and the golden digests of
``tests/test_engine_equivalence.py`` still hold).

How it stays sure:

- Only *regular* runs are screened: evaluated at their newest step, steps consecutive over every window the
  pack reads and a cadence of one step (``Window.cadence``), no NaN or inf kept (``Window.nonfinite_steps`` empty). A metric whose series has a gap
  (``_Series.steps`` set) is unknown for that run; one that ended before the newest step is read as it is. Anything else (a gap, a NaN, a rewound window) is left whole to the
  closures.
- Each node's value per run is one of: known (within an error bound ``err``), surely raising
  ``MissingDataError`` (``miss``: ``holds`` makes it false, ``default`` its literal), or unknown. Conditions are
  surely true, surely false, ``miss``, or unknown; ``and``/``or`` follow Python's short circuit, so an
  operand after the deciding one can neither decide nor raise.
- ``count``, ``median``, ``min``, ``max``, comparisons and ``+ - *`` compute the same floats the closures do
  (the same IEEE operations on the same values), but for the sign of a zero, which no comparison, sum or
  product a condition sees tells apart (a division by zero is left to the closures). ``avg``, ``std``
  and ``slope`` sum in another order than ``math.fsum``: their values carry a bound on that difference, and a
  comparison within the bound is unknown, as are sums large enough that ``math.fsum`` would overflow.
  Division by zero, and a function the screen does not model
  (``delta``, ``zscore``, ``count_over`` ...), are unknown.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ppo_watchdog.core import expr as ex
from ppo_watchdog.core.engine import SURELY_TRUE, Verdict
from ppo_watchdog.core.series import Window

_U = 2.3e-16
"""A little more than twice the unit roundoff of a float64 (2**-53): the error bounds' unit."""
_TINY = 1e-300
_HUGE = 1e300
"""Sums of magnitudes below this cannot overflow ``math.fsum`` (which raises OverflowError where numpy gives inf)."""
_EXACT_STEPS = 2**50
"""The closures' slope uses exact centred steps below this (``expr._EXACT``); a run past it is not screened."""
_SPARSE = 16
"""An ``and``/``or`` chain stops when fewer than one run in this many is still undecided by its operands so far."""


@dataclass
class _Num:
    """A number per run: ``val`` where ``ok`` (the closure's value within ``err``), ``miss`` where the closure
    surely raises MissingDataError first; elsewhere unknown."""

    val: np.ndarray
    err: np.ndarray | None
    ok: np.ndarray
    miss: np.ndarray
    why: np.ndarray | None = None
    """Where ``miss``: the error's message (an index into ``Screen.messages``), -1 where not known; None: none known."""


@dataclass
class _Cond:
    """A condition per run: surely true, surely false, surely MissingDataError; elsewhere unknown."""

    t: np.ndarray
    f: np.ndarray
    miss: np.ndarray
    why: np.ndarray | None = None
    """As :attr:`_Num.why`."""


@dataclass
class _Column:
    """One metric's last ``width`` steps over the batch, right-aligned: column ``width - 1`` is each run's
    evaluated step. ``lo``/``hi``: the columns holding values (``hi < lo``: none); ``ok``: the series is
    regular (or absent) for that run."""

    vals: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ok: np.ndarray
    absent: np.ndarray
    """The run never logged the metric (a regular run: ``ok`` there too)."""


class Screen:
    """The surely-false screen of one rule pack (:func:`screen_for` keeps one per pack)."""

    def __init__(self, rules: Sequence[Any], params: dict[str, float]) -> None:
        self.params = params
        self.exprs = [r.expr.ast if r.enabled else None for r in rules]
        self.width: dict[str, int] = {}
        """Per metric the screen reads from windows: the columns its window functions reach."""
        self.keys: dict[int, str] = {}
        """Each node's exact text (``expr._key``) by its id: one value per text and pass, shared by the rules."""
        for node in self.exprs:
            if node is not None:
                self._reach(node)
        self.span = max(self.width.values(), default=1)
        self.messages: list[str] = []
        """The MissingDataError texts the screen can tell a closure raises (``engine.evaluate`` compares them with
        a rule's last error: a rule that fails the same way again is not evaluated again)."""
        self._message_codes: dict[str, int] = {}

    def code(self, message: str) -> int:
        """The index of a MissingDataError's message (its text as the engine records it)."""
        got = self._message_codes.get(message)
        if got is None:
            got = self._message_codes[message] = len(self.messages)
            self.messages.append(f"MissingDataError: {message}")
        return got

    def _reach(self, node: ex.Node) -> None:
        self.keys[id(node)] = ex._key(node, self.params)
        if isinstance(node, ex.Metric):
            self.width[node.name] = max(self.width.get(node.name, 1), 1)
        elif isinstance(node, ex.Call):
            if node.func in _WINDOWED:
                name = node.args[0].name  # type: ignore[union-attr]
                n = int(node.args[1].value)  # type: ignore[union-attr]
                lag = int(node.args[2].value) if len(node.args) > 2 else 0  # type: ignore[union-attr]
                self.width[name] = max(self.width.get(name, 1), n + lag)
            for a in node.args:
                self._reach(a)
        elif isinstance(node, (ex.Unary, ex.Not)):
            self._reach(node.operand)
        elif isinstance(node, (ex.Binary, ex.BoolOp)):
            self._reach(node.left)
            self._reach(node.right)
        elif isinstance(node, ex.Compare):
            for o in node.operands:
                self._reach(o)

    def __call__(self, batch: Sequence[tuple[Window, int, int]]) -> list[list[Verdict] | None]:
        """Per (window, step, event seq) of the batch, per rule: True where the condition is surely false at
        that step; :data:`~ppo_watchdog.core.engine.SURELY_TRUE` where it is surely true; the text the engine
        records of the MissingDataError it surely raises (``"MissingDataError: no data for metric
        'aborted_ratio'"``); False where the closure must tell. None for a run the screen leaves whole to the
        closures."""
        with np.errstate(all="ignore"):
            return _Pass(self, batch).run()


_WINDOWED = frozenset(("count", "median", "min", "max", "avg", "std", "slope"))


class _Pass:
    """One screening of one batch: its columns, gathered once, and the values of the nodes met so far."""

    def __init__(self, screen: Screen, batch: Sequence[tuple[Window, int, int]]) -> None:
        self.s = screen
        self.batch = batch
        n = len(batch)
        self.n = n
        span = screen.span
        regular = np.zeros(n, dtype=bool)
        for r, (w, at, _) in enumerate(batch):
            rows = w._rows
            k = min(len(rows), span)
            regular[r] = (k > 0 and at == w.step == rows[-1] and not w.nonfinite_steps and at - rows[-k] == k - 1
                          and w.cadence == 1
                          and -_EXACT_STEPS < at - span < at < _EXACT_STEPS)
        self.regular = regular
        self.at = np.array([float(at) for _, at, _ in batch])
        self.regular_list = regular.tolist()
        self.series = [w._series for w, _, _ in batch]
        self.newest = [len(w._rows) + w._lo for w, _, _ in batch]
        """Per run: the row number past its newest (an aligned series ending at the newest step ends there)."""
        self.columns: dict[str, _Column] = {}
        self.memo: dict[str, Any] = {}

    def column(self, name: str) -> _Column:
        """A metric's columns, gathered when a node first reads them. A run whose series ends at its newest
        step (nearly every run) has its last ``width`` values concatenated into the matrix's buffer (one C copy,
        after a NaN padding while the series is shorter); any other run gets a row of NaN, then its own values."""
        col = self.columns.get(name)
        if col is not None:
            return col
        n, width = self.n, self.s.width[name]
        buf = array("d")
        blank = array("d", [math.nan]) * width
        # What most runs have (their last ``width`` values), set otherwise run by run.
        lo, hi, ok, absent = [0] * n, [width - 1] * n, [True] * n, [False] * n
        others = []
        for r, (series, newest, reg) in enumerate(zip(self.series, self.newest, self.regular_list, strict=True)):
            s = series.get(name) if reg else None
            if s is not None and s.steps is None:
                kept = s.values
                k = len(kept)
                if s.row0 + k == newest and k:
                    if k >= width:
                        buf += kept[-width:]
                    else:
                        buf += blank[k:]
                        buf += kept
                        lo[r] = width - k
                    continue
                if k:
                    others.append(r)  # logged, but not at the newest step
            buf += blank
            hi[r] = -1
            # Never logged (or not since a rewind): no values, and regular. A gap: left to the closures.
            ok[r] = reg and (s is None or s.steps is None)
            absent[r] = reg and s is None
        vals = np.frombuffer(buf, dtype=np.float64).reshape(n, width)
        los, his = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)
        for r in others:
            w = self.batch[r][0]
            s = w._series[name]
            newest = len(w._rows) - 1
            first = s.row0 - w._lo  # the rows of values[0] and values[-1]
            last = first + len(s.values) - 1
            h = width - 1 - (newest - last)
            if h < 0:
                continue  # nothing within reach
            lo_col = width - 1 - (newest - first)
            skip = max(0, -lo_col)
            vals[r, lo_col + skip:h + 1] = s.values[skip:]
            los[r], his[r] = lo_col + skip, h
        col = self.columns[name] = _Column(vals, los, his, np.array(ok, dtype=bool), np.array(absent, dtype=bool))
        return col

    # -- the pass -----------------------------------------------------------------------

    def run(self) -> list[list[Verdict] | None]:
        # Per rule and run: 0 evaluate, 1 surely false, 2 surely true, 3 + k surely the MissingDataError messages[k].
        verdicts = []
        for node in self.s.exprs:
            if node is None:
                verdicts.append(np.zeros(self.n, dtype=np.int64))
                continue
            c = self.cond(node)
            known = c.miss & (c.why >= 0) if c.why is not None else c.miss & False
            verdict = np.where(c.f, 1, np.where(c.t, 2, np.where(known, (c.why if c.why is not None else 0) + 3, 0)))
            verdicts.append(np.where(self.regular, verdict, 0))
        lookup = np.array([False, True, SURELY_TRUE, *self.s.messages], dtype=object)
        table = lookup[np.stack(verdicts, axis=1)].tolist() if verdicts else [[] for _ in range(self.n)]
        return [row if reg else None for row, reg in zip(table, self.regular_list, strict=True)]

    def _none(self) -> np.ndarray:
        return np.zeros(self.n, dtype=bool)

    def unknown_num(self) -> _Num:
        z = self._none()
        return _Num(np.full(self.n, math.nan), None, z, z)

    def unknown_cond(self) -> _Cond:
        z = self._none()
        return _Cond(z, z, z)

    def const(self, v: float) -> _Num:
        return _Num(np.full(self.n, v), None, self.regular, self._none())

    def num(self, node: ex.Node) -> _Num:
        return self._once(node, self._num)  # type: ignore[no-any-return]

    def cond(self, node: ex.Node) -> _Cond:
        return self._once(node, self._cond)  # type: ignore[no-any-return]

    def _once(self, node: ex.Node, build: Any) -> Any:
        """A node's value in this pass, computed once per text (``median(kl, 5, 1)`` in many rules)."""
        key = self.s.keys[id(node)]
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = build(node)
        return hit

    def _num(self, node: ex.Node) -> _Num:
        if isinstance(node, ex.Num):
            return self.const(node.value)
        if isinstance(node, ex.Param):
            return self.const(float(self.s.params[node.name]))
        if isinstance(node, ex.Step):
            return _Num(self.at, None, self.regular, self._none())
        if isinstance(node, ex.Metric):
            col = self.column(node.name)
            width = col.vals.shape[1]
            here = col.ok & (col.hi == width - 1)
            why = np.where(col.absent, self.s.code(f"no data for metric {node.name!r}"), -1)
            return _Num(col.vals[:, width - 1], None, here, col.ok & ~here, why)
        if isinstance(node, ex.Unary):
            a = self.num(node.operand)
            return _Num(-a.val, a.err, a.ok, a.miss, a.why)
        if isinstance(node, ex.Binary):
            return self.binary(node)
        if isinstance(node, ex.Call):
            return self.call(node)
        return self.unknown_num()

    def binary(self, node: ex.Binary) -> _Num:
        a, b = self.num(node.left), self.num(node.right)
        # Python reads the left operand first: its MissingDataError is the one raised.
        miss = a.miss | (a.ok & b.miss)
        why = _first(a, b)
        ok = a.ok & b.ok
        x, y = a.val, b.val
        if node.op == "/":
            exact = a.err is None and b.err is None
            ok = ok & (y != 0) & exact  # x / 0 is the closure's own IEEE rule; with an error bound, no division
            return _Num(x / y, None, ok, miss, why)
        val = x + y if node.op == "+" else x - y if node.op == "-" else x * y
        if a.err is None and b.err is None:
            return _Num(val, None, ok, miss, why)
        ea = a.err if a.err is not None else 0.0
        eb = b.err if b.err is not None else 0.0
        if node.op == "*":
            grown = np.abs(x) * eb + np.abs(y) * ea + ea * eb
        else:
            grown = ea + eb
        err = grown * (1 + 1e-12) + 1e-15 * np.abs(val) + _TINY
        return _Num(val, err, ok & np.isfinite(val) & np.isfinite(err), miss, why)

    def call(self, node: ex.Call) -> _Num:
        f = node.func
        args = node.args
        if f in _WINDOWED:
            if f == "slope":
                return self.slope(node)
            name = args[0].name  # type: ignore[union-attr]
            n = int(args[1].value)  # type: ignore[union-attr]
            lag = int(args[2].value) if len(args) > 2 else 0  # type: ignore[union-attr]
            return self.window(f, name, n, lag)
        if f in ("best", "lowest") and len(args) == 1:
            return self.running(f, args[0].name)  # type: ignore[union-attr]
        if f == "abs":
            a = self.num(args[0])
            return _Num(np.abs(a.val), a.err, a.ok, a.miss, a.why)
        if f in ("clamp_min", "clamp_max"):
            a, b = self.num(args[0]), self.num(args[1])
            # max(x, bound) (min) moves no value further than its error bound; NaN stays NaN, as the closure's.
            pick = np.fmax if f == "clamp_min" else np.fmin
            val = np.where(np.isnan(a.val) | np.isnan(b.val), math.nan, pick(a.val, b.val))
            err = None if a.err is None and b.err is None else np.maximum(
                a.err if a.err is not None else 0.0, b.err if b.err is not None else 0.0)
            return _Num(val, err, a.ok & b.ok, a.miss | (a.ok & b.miss), _first(a, b))
        if f == "default":
            a = self.num(args[0])
            lit = args[1]
            fallback = lit.value if isinstance(lit, ex.Num) else -float(lit.operand.value)  # type: ignore[union-attr]
            val = np.where(a.miss, fallback, a.val)
            err = None if a.err is None else np.where(a.miss, 0.0, a.err)
            return _Num(val, err, a.ok | a.miss, self._none())
        if f == "event":
            kind = args[0].value  # type: ignore[union-attr]
            none = np.array([w.event_seq == seq or kind not in w._kinds for w, _, seq in self.batch])
            return _Num(np.zeros(self.n), None, self.regular & none, self._none())
        if f == "event_count":
            kind = args[0].value  # type: ignore[union-attr]
            none = np.array([kind not in w._kinds for w, _, _ in self.batch])
            return _Num(np.zeros(self.n), None, self.regular & none, self._none())
        return self.unknown_num()

    def window(self, f: str, name: str, n: int, lag: int) -> _Num:
        col = self.column(name)
        width = col.vals.shape[1]
        a, b = width - lag - n, width - lag  # the window's columns [a, b)
        lo, hi = np.maximum(col.lo, a), np.minimum(col.hi, b - 1)
        count = np.maximum(hi - lo + 1, 0)
        if f == "count":
            return _Num(count.astype(float), None, col.ok, self._none())
        have = col.ok & (count > 0)
        miss = col.ok & (count == 0)
        where = f"in the last {n} steps" if not lag else f"in the {n} steps ending {lag} back"
        why = np.full(self.n, self.s.code(f"{f}({name}, {n}{f', {lag}' if lag else ''}): no values {where}"))
        block = col.vals[:, a:b]  # NaN where no value
        if f in ("min", "max"):
            val = (np.fmin if f == "min" else np.fmax).reduce(block, axis=1)
            return _Num(val, None, have, miss, why)
        if f == "median":
            # NaN (no value) sorts last. Equal values may come in another order than ``sorted`` gives them: only
            # 0.0 and -0.0 are equal and unlike, and the sign of a zero changes no comparison, sum or product
            # a condition sees (a division by zero is left to the closures).
            srt = np.sort(block, axis=1)
            c = np.maximum(count, 1)
            mid = c // 2
            rows = np.arange(self.n)
            upper = srt[rows, np.minimum(mid, n - 1)]
            lower = srt[rows, np.maximum(mid - 1, 0)]
            val = np.where(c % 2 == 1, upper, (lower + upper) / 2)
            return _Num(val, None, have, miss, why)
        present = ~np.isnan(block)
        c = np.maximum(count, 1).astype(float)
        x = np.where(present, block, 0.0)
        mag = np.abs(x).sum(axis=1)
        mean = x.sum(axis=1) / c
        if f == "avg":
            err = _U * ((c + 1) * mag / c + 2 * np.abs(mean)) + _TINY
            # math.fsum raises OverflowError past the largest float; below 1e300 in all it cannot.
            return _Num(mean, err, have & (mag < _HUGE), miss, why)
        # std, the population's: two passes in both (the closure's with math.fsum).
        big = np.max(np.abs(x), axis=1)
        var = np.where(present, (block - mean[:, None]) ** 2, 0.0).sum(axis=1) / c
        val = np.sqrt(var)
        err = np.sqrt(4e-15 * (c + 10) * (big + np.abs(mean)) ** 2) + _U * val + _TINY
        # (v - m) ** 2 raises OverflowError past 1.3e154: values below 1e150 keep every square and sum finite.
        return _Num(val, err, have & (big < 1e150) & (mag < _HUGE), miss, why)

    def slope(self, node: ex.Call) -> _Num:
        name = node.args[0].name  # type: ignore[union-attr]
        n = int(node.args[1].value)  # type: ignore[union-attr]
        col = self.column(name)
        width = col.vals.shape[1]
        lo, hi = np.maximum(col.lo, width - n), col.hi
        count = np.maximum(hi - lo + 1, 0)
        full = col.ok & (count == n) & (hi == width - 1)
        miss = col.ok & (count < 2)
        why = np.where(count == 0, self.s.code(f"slope({name}, {n}): no values in the last {n} steps"),
                       self.s.code(f"slope({name}, {n}): needs 2 values, has 1"))
        if n < 2:
            return _Num(np.full(self.n, math.nan), None, self._none(), miss, why)
        ys = col.vals[:, width - n:]
        dx = np.arange(n) - (n - 1) / 2  # the closure's centred steps (exact: halves of small integers)
        sxx = float(np.sum(dx ** 2))
        ys0 = np.where(full[:, None], ys, 0.0)
        my = ys0.sum(axis=1) / n
        val = (dx * (ys0 - my[:, None])).sum(axis=1) / sxx
        big = np.max(np.abs(ys0), axis=1)
        spread = float(np.abs(dx).sum())
        err = 2 * _U * (n + 4) * spread * (big + np.abs(my)) / sxx + _TINY
        # The closure's math.fsum over the values and over dx * (y - mean) stays finite below 1e300.
        return _Num(val, err, full & (big * max(n, spread) < _HUGE / 2), miss, why)

    def running(self, f: str, name: str) -> _Num:
        # At the newest step, Window.best is the series' running top and lowest its running lowest (both
        # remember values trimmed or rolled back, an inf of long ago too); -inf (inf): never a finite value.
        best = f == "best"
        none = -math.inf if best else math.inf
        got = [none if s is None else (s.top if best else s.lowest)
               for s in (w._series.get(name) for w, _, _ in self.batch)]
        val = np.array(got)
        miss = val == none
        # lowest(): one message for both ways of having none; best(): the step is in one of its two.
        why = None if best else np.full(self.n, self.s.code(f"no finite data for metric {name!r}"))
        return _Num(val, None, self.regular & ~miss, self.regular & miss, why)

    # -- conditions ---------------------------------------------------------------------

    def _cond(self, node: ex.Node) -> _Cond:
        if isinstance(node, ex.Compare):
            return self.compare(node)
        if isinstance(node, ex.BoolOp):
            return self.chain(node)
        if isinstance(node, ex.Not):
            a = self.cond(node.operand)
            return _Cond(a.f, a.t, a.miss, a.why)
        if isinstance(node, ex.Call):
            if node.func == "holds":
                a = self.cond(node.args[0])
                return _Cond(a.t, a.f | a.miss, self._none())
            if node.func == "nonfinite":
                return _Cond(self._none(), self.regular, self._none())  # a regular run keeps no NaN or inf
        return self.unknown_cond()

    def compare(self, node: ex.Compare) -> _Cond:
        if len(node.ops) != 1:
            return self.unknown_cond()
        a, b = self.num(node.operands[0]), self.num(node.operands[1])
        op = node.ops[0]
        ok = a.ok & b.ok
        miss = a.miss | (a.ok & b.miss)
        why = _first(a, b)
        x, y = a.val, b.val
        exact = _CMP[op](x, y)
        if a.err is None and b.err is None:
            return _Cond(ok & exact, ok & ~exact, miss, why)
        e = (a.err if a.err is not None else 0.0) + (b.err if b.err is not None else 0.0)
        d = x - y
        margin = e * (1 + 1e-12) + 1e-15 * (np.abs(x) + np.abs(y)) + _TINY
        sure = ok & np.isfinite(x) & np.isfinite(y) & np.isfinite(margin)
        above, below, apart = d > margin, d < -margin, np.abs(d) > margin
        t, f = {
            ">": (above, below), ">=": (above, below), "<": (below, above), "<=": (below, above),
            "==": (np.zeros_like(apart), apart), "!=": (apart, np.zeros_like(apart)),
        }[op]
        return _Cond(sure & t, sure & f, miss, why)

    def chain(self, node: ex.BoolOp) -> _Cond:
        operands = _flatten(node, node.op)
        going = self.regular.copy()  # runs whose operands so far all went on (true for and, false for or)
        t, f, miss = self._none(), self._none(), self._none()
        why = np.full(self.n, -1)
        for o in operands:
            if np.count_nonzero(going) * _SPARSE < self.n:
                # Nearly every run decided: the rest are left to their closures (unknown) rather than have
                # every run's matrices worked through the remaining operands for them.
                return _Cond(t, f, miss, why)
            c = self.cond(o)
            stop, on = (c.f, c.t) if node.op == "and" else (c.t, c.f)
            if node.op == "and":
                f = f | (going & stop)
            else:
                t = t | (going & stop)
            missed = going & c.miss
            if c.why is not None:
                why = np.where(missed, c.why, why)
            miss = miss | missed
            going = going & on
        if node.op == "and":
            t = t | going
        else:
            f = f | going
        return _Cond(t, f, miss, why)


def _first(a: _Num, b: _Num) -> np.ndarray | None:
    """The message of whichever operand raises first: ``a`` where it does, else ``b``'s."""
    if a.why is None and b.why is None:
        return None
    return np.where(a.miss, -1 if a.why is None else a.why, -1 if b.why is None else b.why)


def _flatten(node: ex.Node, op: str) -> list[ex.Node]:
    if isinstance(node, ex.BoolOp) and node.op == op:
        return [*_flatten(node.left, op), *_flatten(node.right, op)]
    return [node]


_CMP = {
    "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal, "!=": np.not_equal,
}

_SCREENS: dict[int, tuple[object, Screen]] = {}


def screen_for(rules: Any) -> Screen:
    """The screen of a rule pack (a RuleSet, by identity: a daemon's one pack is compiled once)."""
    hit = _SCREENS.get(id(rules))
    if hit is not None and hit[0] is rules:
        return hit[1]
    params = {p.name: float(p.value) for p in getattr(rules, "params", ())}
    screen = Screen(tuple(rules), params)
    if len(_SCREENS) >= 16:
        _SCREENS.clear()
    _SCREENS[id(rules)] = (rules, screen)
    return screen
