"""The Window's compact storage: same answers as plain per-metric lists, a bounded size per run."""

from __future__ import annotations

import math
import random
import tracemalloc
from bisect import bisect_right
from pathlib import Path

import pytest

from ppo_watchdog.core import engine
from ppo_watchdog.core.rulefile import load_rules
from ppo_watchdog.core.series import MAX_EVENTS, MAX_WINDOW_STEPS, MissingDataError, Window, window_steps

ROOT = Path(__file__).resolve().parents[1]


class Ref:
    """The window as plain lists (what it was before the arrays): per metric its own steps and values,
    trimmed in halves by its own count, a running best and lowest covering what was trimmed; a rewind drops the
    steps after it, and with them their part in both."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.series: dict[str, list] = {}
        self.steps: list[int] = []
        self.step: int | None = None

    def append(self, step: int, values: dict[str, float]) -> None:
        if self.step is not None and step <= self.step:
            for s in self.series.values():
                i = bisect_right(s[0], step - 1)
                del s[0][i:], s[1][i:]
            del self.steps[bisect_right(self.steps, step - 1):]
        for name, v in values.items():
            s = self.series.setdefault(name, [[], [], -math.inf, 0, math.inf])
            s[0].append(step)
            s[1].append(v)
            if self.size is not None and len(s[0]) > 2 * self.size:
                cut = len(s[0]) - self.size
                for st, x in zip(s[0][:cut], s[1][:cut], strict=True):
                    if x > s[2]:
                        s[2], s[3] = x, st
                    if x < s[4]:
                        s[4] = x
                del s[0][:cut], s[1][:cut]
        self.steps.append(step)
        if self.size is not None and len(self.steps) > 2 * self.size:
            del self.steps[: len(self.steps) - self.size]
        # The cadence: the median spacing (the lower middle one) of the last 9 steps kept.
        tail = self.steps[-9:]
        gaps = sorted(b - a for a, b in zip(tail, tail[1:], strict=False))
        self.cadence = max(1, gaps[(len(gaps) - 1) // 2]) if gaps else 1
        self.step = step

    def values(self, name: str, n: int, at: int) -> list[float]:
        st, vs = self.series.get(name, [[], []])[:2]
        return [v for s, v in zip(st, vs, strict=True) if at - n * self.cadence < s <= at]

    def lowest(self, name: str) -> float:
        return min([self.series[name][4], *(v for v in self.series[name][1] if v == v)])

    def best(self, name: str, at: int) -> tuple[float, int]:
        st, vs, b, b_at, _ = self.series[name]
        for s, v in zip(st, vs, strict=True):
            if s <= at and v > b:
                b, b_at = v, s
        return b, b_at


def _random_run(rnd: random.Random, n: int) -> list[tuple[int, dict[str, float]]]:
    out, step = [], 0
    for _ in range(n):
        r = rnd.random()
        step = max(1, step - rnd.randrange(1, 40)) if r < 0.03 else step + (1 if r < 0.8 else rnd.randrange(2, 5))
        vals: dict[str, float] = {}
        for name, every in (("kl", 1), ("reward", 1), ("vf_loss", 3), ("entropy", 1), ("late", 1)):
            if name == "late" and step < 50:
                continue
            if name == "entropy" and 120 < step < 170:
                continue  # a gap: absent for a while
            if step % every == 0 or rnd.random() < 0.1:
                vals[name] = math.nan if rnd.random() < 0.02 else rnd.gauss(0, 1)
        out.append((step, vals))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size", [1, 7, 40, None])
def test_same_answers_as_plain_lists(seed: int, size: int | None) -> None:
    rnd = random.Random(seed)
    w, ref = Window(size, {"kl", "reward", "vf_loss", "entropy", "late"}), Ref(size)
    for step, vals in _random_run(rnd, 400):
        w.append(step, {**vals, "unread": 1.0})
        ref.append(step, vals)
        assert w.steps() == ref.steps
        assert "unread" not in w.names()
        for name in ("kl", "reward", "vf_loss", "entropy", "late"):
            for n, back in ((1, 0), (5, 0), (30, 3), (1000, 0)):
                at = step - back
                got, want = list(w.values(name, n, at)), ref.values(name, n, at)
                assert len(got) == len(want) and all(a == b or (a != a and b != b) for a, b in zip(got, want, strict=True))
                steps, _ = w.points(name, n, at)
                assert list(steps) == [s for s in ref.series.get(name, [[]])[0] if at - n * ref.cadence < s <= at]
                assert w.cadence == ref.cadence
            if name in ref.series and ref.series[name][0]:
                b, b_at = ref.best(name, step)
                if b == -math.inf:
                    with pytest.raises(MissingDataError):
                        w.best(name)
                else:
                    assert w.best(name) == b and w.since_best(name) == step - b_at
                    mid = ref.series[name][0][len(ref.series[name][0]) // 2]
                    b, b_at = ref.best(name, mid)
                    if b != -math.inf:
                        assert w.best(name, mid) == b and w.since_best(name, mid) == mid - b_at
                assert w.has(name, ref.series[name][0][-1])
                if ref.lowest(name) == math.inf:
                    with pytest.raises(MissingDataError):
                        w.lowest(name)
                else:
                    assert w.lowest(name) == ref.lowest(name)


def test_unkept_metrics_still_count_as_nonfinite_and_source() -> None:
    w = Window(10, {"kl"})
    w.append_record({"step": 1, "data": {"actor/grad_norm": math.nan, "actor/ppo_kl": 0.1}})
    assert w.nonfinite_steps == {1}
    assert w.names() == [] or "grad_norm" not in w.names()
    assert "grad_norm" in w.sources


def test_events_compact_and_bounded() -> None:
    w = Window(5)
    for i in range(3 * MAX_EVENTS):
        w.add_event({"kind": "checkpoint" if i % 2 else "oom", "step": i})
    assert w.event_seq == 3 * MAX_EVENTS
    assert len(w.events_since(0)) == MAX_EVENTS
    assert w.events_since(w.event_seq - 2) == [{"kind": "oom", "step": 3 * MAX_EVENTS - 2},
                                                {"kind": "checkpoint", "step": 3 * MAX_EVENTS - 1}]
    assert w.count_events("oom", w.event_seq - 4) == 2
    assert w.count_events_in("oom", 10, 3 * MAX_EVENTS) == 4  # steps 1528..1534
    w.add_event({"kind": "note"})
    w.add_event({"kind": "note", "step": 2.5})
    assert w.events_since(w.event_seq - 2) == [{"kind": "note"}, {"kind": "note", "step": 2.5}]
    assert w.count_events_in("note", 1, 10**9) == 1  # the one without a step always counts


def test_window_steps_capped() -> None:
    assert window_steps(100) == 101
    assert window_steps(10**36) == MAX_WINDOW_STEPS


def test_default_pack_window_under_50kb_a_run() -> None:
    """A daemon's window of the default pack on a verl record of ~100 keys, warmed past its size."""
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    keys = ["critic/kl", "actor/ppo_kl", "actor/entropy", "critic/score/mean", "critic/score/max", "critic/score/min",
            "critic/vf_loss", "critic/grad_norm", "actor/grad_norm", "response_length/mean", "actor/lr",
            "critic/kl_coeff", "actor/pg_loss", "actor/pg_clipfrac"] + [f"timing_s/x{i}" for i in range(86)]
    rnd = random.Random(0)
    n, size = 50, window_steps(rules.max_window)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ws = [Window(size, rules.metrics) for _ in range(n)]
        states = [engine.EngineState() for _ in range(n)]
        peak = 0
        for step in range(1, 3 * size + 1):
            rec = {"step": step, "data": {k: rnd.random() for k in keys}}
            for i, w in enumerate(ws):
                w.append_record(rec)
                if step % 10 == 0:
                    w.add_event({"kind": "checkpoint", "step": step})
                if step > 2 * size - 3:
                    _, states[i] = engine.evaluate(rules, w, states[i], step)
            if step > size:
                peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert peak / n < 50_000, f"{peak / n:.0f} bytes a run"
