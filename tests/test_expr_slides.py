"""Sorted windows carried across steps (``Window.slides``) and the newest step's values (``Window.now``).

A window of ``median``, ``min`` or ``max`` over 20 steps or more keeps its sorted values from one
evaluated step to the next and slides them by the values that left and entered. Each test below
evaluates one long-lived window step by step and compares every result, as ``repr`` (so -0.0 and
0.0 differ, and NaN is NaN), with the plain computation over the same values: ``sorted()``,
``min()`` and ``max()`` of the window's values in step order. Each names the invalidation it holds:
a rewind (value numbers given again), a trim (value numbers shifted), a gap, a NaN entering and
leaving, equal values of either sign.
"""

from __future__ import annotations

import math
import random
from typing import Any

from ppo_watchdog.core.expr import compile_expr
from ppo_watchdog.core.series import Window

FNS = ("median(kl, {n}, {lag})", "min(kl, {n}, {lag})", "max(kl, {n}, {lag})")


def plain(kind: str, vals: list[float]) -> Any:
    """The reduction as the engine did it before slides: over the values in step order."""
    if not vals:
        return "MissingDataError"
    if any(math.isnan(v) for v in vals):
        return repr(math.nan)
    if kind == "min":
        return repr(min(vals))
    if kind == "max":
        return repr(max(vals))
    srt = sorted(vals)
    mid = len(srt) // 2
    return repr(srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2)


def check_every_step(feed: list[tuple[int, float | None]], size: int | None, windows: tuple[tuple[int, int], ...],
                     skip: range = range(0)) -> int:
    """Append ``feed`` ((step, value or None for a gap) in order, rewinds included) to one window and, at
    every step (but the appends numbered in ``skip``: a daemon that judged nothing then), compare each
    function with the plain one over the window's values; returns how many slid (not sorted again)
    evaluations there were, so a test knows it exercised the carried path."""
    w = Window(size)
    fns = [(f.split("(")[0], n, lag, compile_expr(f.format(n=n, lag=lag), "number"))
           for n, lag in windows for f in FNS]
    slid = 0
    for i, (step, v) in enumerate(feed):
        w.append(step, {"other": 1.0} if v is None else {"kl": v, "other": 1.0})
        if i in skip:
            continue
        before = {k: (sl[1], sl[2]) for k, sl in w.slides.items()}
        for kind, n, lag, c in fns:
            want = plain(kind, list(w.values("kl", n, step - lag * w.cadence)))  # (steps at the run's cadence)
            try:
                got = repr(c(w, step))
            except Exception as exc:  # noqa: BLE001 - the error is what is compared
                got = type(exc).__name__
            assert got == want, f"{kind}(kl, {n}, {lag}) at step {step}: {got} != {want}"
        slid += sum(1 for k, sl in w.slides.items() if k in before and before[k] != (sl[1], sl[2]))
    return slid


def test_a_slid_window_equals_a_fresh_sort_at_every_step_of_a_long_run() -> None:
    rnd = random.Random(5)
    feed = [(s, rnd.random()) for s in range(1, 300)]
    assert check_every_step(feed, None, ((20, 0), (20, 5), (50, 3))) > 500


def test_a_rewind_drops_the_carried_sorted_values() -> None:
    # Steps 25..30 are trained again with other values (appends 30..35, not judged): the same value
    # numbers now hold other values, and the window judged at step 31 is one step on from the one judged
    # at step 30. Carried across the rewind, the sorted values would still hold the abandoned branch's.
    rnd = random.Random(6)
    feed = [(s, float(s)) for s in range(1, 31)] + [(s, 100.0 + rnd.random()) for s in range(25, 40)]
    assert check_every_step(feed, None, ((20, 0), (20, 1)), skip=range(30, 36)) > 10


def test_a_trim_keeps_the_carried_values_aligned_with_the_window() -> None:
    # A window of 21 steps trims to 21 values whenever it holds 43: value numbers move with the cut. Judged
    # at step 30, then not until step 53 (a trim of 22 values at step 43 between), the window's index range
    # is one step on from step 30's, its values 23 steps on.
    rnd = random.Random(7)
    feed = [(s, rnd.choice([rnd.random(), float(s % 7)])) for s in range(1, 200)]
    assert check_every_step(feed, 21, ((20, 0), (20, 1))) > 200
    assert check_every_step(feed, 21, ((20, 0), (20, 1)), skip=range(30, 52)) > 200


def test_gaps_and_skipped_steps_slide_by_the_values_that_left_and_entered() -> None:
    rnd = random.Random(8)
    feed: list[tuple[int, float | None]] = []
    step = 0
    for i in range(250):
        step += rnd.choice([1, 1, 1, 2, 3])
        feed.append((step, None if rnd.random() < 0.2 or 100 <= i < 130 else rnd.random()))
    check_every_step(feed, 60, ((20, 0), (25, 4)))


def test_a_nan_entering_and_leaving_the_window_gives_nan_then_numbers_again() -> None:
    feed: list[tuple[int, float | None]] = [(s, float(s % 5)) for s in range(1, 90)]
    feed[30] = (31, math.nan)
    feed[31] = (32, math.inf)
    feed[32] = (33, -math.inf)
    check_every_step(feed, None, ((20, 0), (20, 2)))


def test_equal_values_of_either_sign_come_out_as_min_and_max_give_them() -> None:
    # min() and max() return the first of equal extremes in step order: 0.0 or -0.0 by which came first.
    rnd = random.Random(9)
    feed = [(s, rnd.choice([0.0, -0.0, 1.0, -1.0, 0.0])) for s in range(1, 200)]
    check_every_step(feed, 40, ((20, 0), (21, 1)))


def test_the_newest_values_by_name_are_the_rows_of_the_newest_step() -> None:
    rnd = random.Random(10)
    w = Window(8, {"kl", "reward"})
    step = 0
    for i in range(120):
        step = step - 4 if i % 37 == 36 else step + rnd.choice([1, 2])
        row = {m: rnd.random() for m in ("kl", "reward", "entropy") if rnd.random() < 0.8}
        w.append(step, row)
        assert w.now == w.row() == {m: v for m, v in row.items() if m != "entropy"}
        for m in ("kl", "reward"):
            got = compile_expr(f"{m} > 0.5")
            if m in w.now:
                assert got(w, step) == (w.value(m, step) > 0.5)
