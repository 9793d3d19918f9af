"""The columnar screen (ppo_watchdog.core.screen) only ever says "surely false" where the closure says false, "surely
true" where it says true, and "surely raises" where the closure raises that very MissingDataError.

The engine calls no closure for a condition the screen is sure of, so a wrong "surely false" would be a missed
fire, a wrong "surely true" a false one (and a wrong message a rule's health misreported). These tests hold the
screen to the closures on random expressions of the whole language over
windows in lockstep (gaps, zeros, equal values, a rewind, events, young and trimmed windows), and hold a
screened engine to an unscreened one, decision for decision and state for state, on every log of the corpus.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from test_engine_equivalence import load_bench

from ppo_watchdog.control import controller
from ppo_watchdog.control.controller import SCREEN_MIN_RUNS, EngineRules
from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon
from ppo_watchdog.core import engine
from ppo_watchdog.core.engine import SURELY_TRUE
from ppo_watchdog.core.expr import ExprError, compile_expr
from ppo_watchdog.core.rulefile import load_rules
from ppo_watchdog.core.screen import Screen, screen_for
from ppo_watchdog.core.series import MissingDataError, Window, window_steps
from ppo_watchdog.sources import ingest

ROOT = Path(__file__).resolve().parents[1]


def _rows(seed: int, n: int) -> list[tuple[int, dict[str, float], list[dict[str, Any]]]]:
    """(step, values, events) of a run: smooth metrics, with the shapes a screen must not misjudge."""
    rnd = random.Random(seed)
    names = ["kl", "reward", "entropy", "vf_loss", "response_length", "grad_norm", "reward_max", "reward_min",
             "aborted_ratio", "kl_coef"]
    level = {m: rnd.uniform(0.01, 2.0) for m in names}
    out = []
    step = 0
    for i in range(n):
        step += 1 if rnd.random() < 0.97 else 2  # a skipped step now and then: not regular for a while
        if i == n // 2:
            step -= 7  # a rewind
        row = {}
        for m in names:
            level[m] *= math.exp(rnd.gauss(0, 0.15))
            x = rnd.random()
            if x < 0.03:
                continue  # a gap in this metric
            row[m] = 0.0 if x < 0.06 else -0.0 if x < 0.07 else round(level[m], rnd.choice([1, 3, 12]))
        if rnd.random() < 0.2:
            row["reward_max"] = row["reward_min"] = 0.5
        if seed % 3 == 0:
            row.pop("aborted_ratio", None)  # a metric this run never logs
        if rnd.random() < 0.01:
            row["kl"] = math.nan  # a NaN: the run is left to the closures while it is kept
        evs = [{"kind": rnd.choice(["oom", "nan", "rollback", "checkpoint"]), "step": step}] if rnd.random() < 0.1 else []
        out.append((step, row, evs))
    return out


def _held_to_closures(compiled: list[Any], w: Window, step: int, seq: int,
                      verdicts: list[Any]) -> tuple[int, int, int]:
    """Each verdict of the screen against the closure: (surely false held, surely true held, surely raising held)."""
    false = true = raised = 0
    for c, verdict in zip(compiled, verdicts, strict=True):
        if verdict is False:
            continue
        try:
            got = c.fn(w, step, seq)
        except MissingDataError as exc:
            assert verdict == f"MissingDataError: {exc}", f"{c.source!r} at step {step}: {verdict!r}"
            raised += 1
            continue
        except Exception as exc:  # noqa: BLE001 - a raise where the screen said false is the failure
            raise AssertionError(f"{c.source!r} at step {step}: screened {verdict!r}, raised {exc!r}") from exc
        if verdict is SURELY_TRUE:
            assert got, f"{c.source!r} at step {step}: screened true, the closure says {got!r}"
            true += 1
            continue
        assert verdict is True, f"{c.source!r} at step {step}: screened {verdict!r}, the closure gives {got!r}"
        assert not got, f"{c.source!r} at step {step}: screened false, the closure says {got!r}"
        false += 1
    return false, true, raised


def test_what_the_closures_compute_otherwise_is_left_to_them() -> None:
    # Sums math.fsum overflows on (OverflowError, where numpy gives inf), squares past 1e154, and steps past
    # 2**50 (the closures' slope rounds its mean step there): never "surely false", never "surely missing".
    texts = ["holds(std(kl, 2) > reward)", "std(kl, 2) > reward", "holds(avg(kl, 3) > reward)",
             "holds(slope(kl, 2) > reward)", "slope(kl, 2) < 0.75", "avg(kl, 3) > 1"]
    compiled = [compile_expr(t, "condition") for t in texts]
    screen = Screen([SimpleNamespace(expr=c, enabled=True) for c in compiled], {})
    big, far = Window(), Window()
    for step, v in enumerate([1e308, 1e308, -1e308, 1e200, -1e200], start=1):
        big.append(step, {"kl": v})
    for step, v in [(2**52, 0.0), (2**52 + 1, 1.0)]:
        far.append(step, {"kl": v})
    verdicts = screen([(big, 5, 0), (far, 2**52 + 1, 0)])
    assert verdicts[1] is None  # past 2**50: left whole to the closures
    assert verdicts[0] is not None
    _held_to_closures(compiled, big, 5, 0, verdicts[0])
    assert verdicts[0][:3] == [False] * 3  # the closures raise OverflowError (std), or might (avg)


def test_surely_false_and_surely_true_hold_for_random_expressions_over_windows_in_lockstep() -> None:
    eq: Any = load_bench()
    rnd = random.Random(7)
    gen = eq.ExprGen(rnd)
    compiled = []
    while len(compiled) < 400:
        try:
            compiled.append(compile_expr(gen.cond(rnd.choice([1, 2, 3, 3, 4])), "condition", eq.PARAMS))
        except ExprError:
            continue
    rules = [SimpleNamespace(expr=c, enabled=True) for c in compiled]
    screen = Screen(rules, dict(eq.PARAMS))
    runs = [(_rows(seed, 90), Window(size, None if seed % 2 else frozenset(eq.METRICS[:6])))
            for seed, size in enumerate([None, 8, 25, 120, 25, None, 40, 60])]
    seqs = [0] * len(runs)
    said = said_true = raised = checked = irregular = 0
    for i in range(90):
        batch = []
        for k, (rows, w) in enumerate(runs):
            step, row, evs = rows[i]
            w.append(step, row)
            for e in evs:
                w.add_event(e)
            batch.append((w, step, seqs[k]))
        for (w, step, seq), skips in zip(batch, screen(batch), strict=True):
            if skips is None:
                irregular += 1
                continue
            false, true, missing = _held_to_closures(compiled, w, step, seq, skips)
            checked += len(skips)
            said += false
            said_true += true
            raised += missing
        seqs = [w.event_seq for w, _, _ in batch]
    # Not vacuous: the screen decided a good share, and the irregular shapes were met.
    assert said > checked // 5, (said, checked)
    assert said_true > checked // 20, (said_true, checked)
    assert raised > checked // 100, (raised, checked)
    assert irregular > 0


def _corpus() -> list[list[dict[str, Any]]]:
    logs = sorted(ROOT.glob("bench/corpus*/*/metrics.jsonl"))
    assert len(logs) >= 10
    return [ingest.read_records(p) for p in logs]


def _at_rest(rs: engine.RuleState) -> bool:
    return rs.status == engine.INACTIVE and rs.since is None


def test_a_screened_engine_decides_as_the_closures_do_on_every_corpus_log() -> None:
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    screen = screen_for(rules)
    assert screen_for(rules) is screen  # one per pack
    runs = _corpus()
    size = window_steps(rules.max_window)
    plain = [(Window(size, rules.metrics), engine.EngineState()) for _ in runs]
    screened = [(Window(size, rules.metrics), engine.EngineState()) for _ in runs]
    skipped = total = 0
    decisions = 0
    stepped_screened = 0  # rules pending or firing whose condition the screen told
    for i in range(max(len(r) for r in runs)):
        live = [k for k, recs in enumerate(runs) if i < len(recs)]
        batch = []
        for k in live:
            rec = runs[k][i]
            plain[k][0].append_record(rec)
            screened[k][0].append_record(rec)
            batch.append((screened[k][0], int(rec["step"]), screened[k][1].event_seq))
        for k, (w, step, _), skips in zip(live, batch, screen(batch), strict=True):
            states = screened[k][1].rules
            stepped_screened += sum((v is True or v is SURELY_TRUE) and r.name in states and not _at_rest(states[r.name])
                                    for r, v in zip(rules, skips or (), strict=False))
            d1, s1 = engine.evaluate(rules, plain[k][0], plain[k][1], step)
            d2, s2 = engine.evaluate(rules, w, screened[k][1], step, skips)
            assert [d.to_json() for d in d2] == [d.to_json() for d in d1], (k, step)
            assert s2.to_json() == s1.to_json(), (k, step)
            plain[k], screened[k] = (plain[k][0], s1), (w, s2)
            decisions += len(d1)
            total += len(rules)
            skipped += sum(v is True for v in skips or ())
    assert decisions > 0 and stepped_screened > 0
    assert skipped > total // 2, (skipped, total)


def _daemon_over_corpus(tmp_path: Path, name: str, logs: list[Path]) -> tuple[Any, list[tuple[Path, list[str]]]]:
    """A daemon (the default pack) over run directories that receive the corpus runs' lines as ticks go by."""
    runs = []
    for k, log in enumerate(logs):
        d = tmp_path / name / f"run{k}"
        d.mkdir(parents=True)
        runs.append((d, log.read_text().splitlines()))
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / name / "state"),
                                   "rules": [str(ROOT / "rules" / "default.yaml")],
                                   "runs": [str(d) for d, _ in runs]}))
    return prepare_daemon(load_daemon_config(cfg)), runs


def test_a_daemon_screening_its_runs_in_lockstep_decides_as_one_evaluating_every_rule(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs = sorted(ROOT.glob("bench/corpus*/*/metrics.jsonl"))[:SCREEN_MIN_RUNS + 4]
    screened, runs_a = _daemon_over_corpus(tmp_path, "screened", logs)
    plain, runs_b = _daemon_over_corpus(tmp_path, "plain", logs)
    verdicts: list[bool | str] = []
    real = EngineRules.screen

    def spy(self: EngineRules, batch: Any) -> Any:
        out = real(self, batch)
        verdicts.extend(v for row in out if row is not None for v in row)
        return out

    monkeypatch.setattr(EngineRules, "screen", spy)
    try:
        for start in range(0, max(len(lines) for _, lines in runs_a), 4):  # 4 new steps a run a tick
            for (da, lines), (db, _) in zip(runs_a, runs_b, strict=True):
                for d in (da, db):
                    with (d / "metrics.jsonl").open("a") as f:
                        f.writelines(line + "\n" for line in lines[start:start + 4])
            screened.tick(now=1000.0 + start)
            with monkeypatch.context() as m:
                m.setattr(controller, "SCREEN_MIN_RUNS", 10**9)  # the plain daemon: every rule's closure
                plain.tick(now=1000.0 + start)

        def decided(wd: Any) -> list[tuple[str, str, int, str]]:
            return [(d["run_id"], d["rule"], d["step"], d["kind"]) for d in wd.store.decisions()]

        assert decided(screened) == decided(plain)
        assert len(decided(screened)) > 0
        for run_id, ctl in screened.controllers.items():
            assert ctl.state.to_json() == plain.controllers[run_id].state.to_json(), run_id
        # The screen ran, and decided most rules of most runs (some failing as they did before).
        assert sum(v is True for v in verdicts) > len(verdicts) // 2
        assert any(isinstance(v, str) for v in verdicts)
    finally:
        screened.close()
        plain.close()


def test_a_tick_abandoned_half_way_through_the_lockstep_puts_every_run_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fault injection: something no run's tick catches (a BaseException) escapes the rounds. Every run left
    # half-read is put back, so the next tick reads the same lines again and decides as a plain daemon does.
    logs = sorted(ROOT.glob("bench/corpus*/*/metrics.jsonl"))[:SCREEN_MIN_RUNS]
    wd, runs = _daemon_over_corpus(tmp_path, "abandoned", logs)
    plain, runs_b = _daemon_over_corpus(tmp_path, "plain", logs)
    for (d, lines), (db, _) in zip(runs, runs_b, strict=True):
        for target in (d, db):
            (target / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))

    def interrupted(self: EngineRules, batch: Any) -> Any:
        raise KeyboardInterrupt

    try:
        with monkeypatch.context() as m:
            m.setattr(EngineRules, "screen", interrupted)
            with pytest.raises(KeyboardInterrupt):
                wd.tick(now=1000.0)
        assert wd.store.decisions() == []
        wd.tick(now=1001.0)
        with monkeypatch.context() as m:
            m.setattr(controller, "SCREEN_MIN_RUNS", 10**9)
            plain.tick(now=1001.0)
        got = [(d["run_id"], d["rule"], d["step"], d["kind"]) for d in wd.store.decisions()]
        assert got == [(d["run_id"], d["rule"], d["step"], d["kind"]) for d in plain.store.decisions()]
        assert got
    finally:
        wd.close()
        plain.close()


def test_a_screen_that_fails_costs_its_time_never_a_decision(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Fault injection: the screen raises. Every rule of every run is evaluated by its closure instead.
    logs = sorted(ROOT.glob("bench/corpus*/*/metrics.jsonl"))[:SCREEN_MIN_RUNS]
    wd, runs = _daemon_over_corpus(tmp_path, "failing", logs)

    def broken(self: EngineRules, batch: Any) -> Any:
        raise RuntimeError("injected: the screen failed")

    monkeypatch.setattr(EngineRules, "screen", broken)
    try:
        for d, lines in runs:
            (d / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
        wd.tick(now=1000.0)
        want = []
        for (d, _), log in zip(runs, logs, strict=True):
            recs = ingest.read_records(log)
            want += [(d.name, r.rule, r.step) for r in _replayed(recs)]
        got = [(d["run_id"], d["rule"], d["step"]) for d in wd.store.decisions() if d["kind"] != "resolve"]
        assert sorted(got) == sorted(want)
        assert "the rules' screen failed" in caplog.text
    finally:
        wd.close()


def _replayed(records: list[dict[str, Any]]) -> list[Any]:
    """The fires and escalations of ``ppo_watchdog.core.engine.run_series`` over a run's records."""
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    return [d for r in engine.run_series(rules, records) for d in r.decisions if d.kind != "resolve"]
