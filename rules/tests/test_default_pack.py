"""The default rule pack: its rule unit tests pass, every rule is covered, and it behaves on
real verl logs (the healthy Gemma-2B GSM8K run triggers no rollback or pause; each NaN
excerpt from verl issues triggers the NaN rule). The whole labelled corpus is judged by
``watchdog eval`` in tests/test_eval.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from verl_logs import HEALTHY
from verl_logs import NAN as NAN_EXCERPTS

from ppo_watchdog.core.engine import blind_rules, run_series
from ppo_watchdog.core.rulefile import load_rules
from ppo_watchdog.core.ruletest import RuleTestResult, _read_test_file, run_rule_tests, run_test
from ppo_watchdog.protocol import catalog

HERE = Path(__file__).resolve().parent
PACK = HERE.parent / "default.yaml"

TEST_FILES = sorted(HERE.glob("*.yaml"))


def _cases() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for f in TEST_FILES:
        _, tests, errors = _read_test_file(f)
        assert not errors, "\n".join(map(str, errors))
        out += [(f, t) for t in tests]
    return out


CASES = _cases()


@pytest.mark.parametrize("path,case", CASES, ids=[f"{p.stem}: {c['name']}" for p, c in CASES])
def test_rule_unit_test(path: Path, case: dict[str, Any]) -> None:
    rules, _, _ = _read_test_file(path)
    assert rules is not None
    result = run_test(rules, case, str(path))
    assert result.passed, "\n".join(result.failures)


def test_every_rule_of_the_default_pack_has_a_test_that_makes_it_act() -> None:
    results: list[RuleTestResult] = run_rule_tests(TEST_FILES)
    assert results and all(r.passed for r in results)
    acted = {d.rule for r in results for d in r.decisions if d.kind in ("fire", "escalate")}
    resolved = {d.rule for r in results for d in r.decisions if d.kind == "resolve"}
    escalated = {d.rule for r in results for d in r.decisions if d.kind == "escalate"}
    names = set(load_rules([PACK]).names)
    assert names - acted == set(), "rules never fired by any test"
    assert {"nan_or_inf", "kl_explosion", "reward_collapse", "kl_high", "oom"} <= resolved
    assert {"nan_or_inf", "oom", "kl_high"} <= escalated


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        from ppo_watchdog.sources.ingest import read_records
    except ImportError:  # pragma: no cover - the ingest module is another engineer's; keep a fallback
        return _parse_console(path)
    return read_records(path)


def _parse_console(path: Path) -> list[dict[str, Any]]:
    """Minimal verl console-log parser: ``step:N - key:value - ...`` lines, ANSI codes stripped."""
    recs: dict[int, dict[str, float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        m = re.search(r"step:(\d+) - (.*)", line)
        if not m:
            continue
        data = recs.setdefault(int(m.group(1)), {})
        for kv in m.group(2).split(" - "):
            k, _, v = kv.strip().rpartition(":")
            try:
                data[k] = float(v)
            except ValueError:
                continue
    return [{"step": s, "data": d} for s, d in sorted(recs.items())]


@pytest.mark.skipif(not HEALTHY.exists(), reason="verl reference log not available")
def test_healthy_verl_run_triggers_no_rollback_and_no_pause() -> None:
    rules = load_rules([PACK])
    records = _records(HEALTHY)
    assert len(records) > 100
    results = list(run_series(rules, records))
    decisions = [d for r in results for d in r.decisions]
    drastic = [d.message for d in decisions if any(a.kind in ("rollback", "pause") for a in d.actions)]
    assert drastic == []
    # Its KL does pass 0.1 (0.10-0.13 from step 66 at kl_coef 0.001): the gentle rule nudges kl_coef.
    assert any(d.rule == "kl_high" and d.kind == "fire" and d.step >= 60 for d in decisions)
    # Every rule could be evaluated on verl's older key names (critic/kl, actor/entropy_loss ...), but
    # the ones reading a metric this verl version did not log yet (the rollout/trainer mismatch, and
    # verl 0.9's aborted rollouts).
    unhealthy = {n: s.last_error for n, s in results[-1].state.rules.items() if s.health != "ok"}
    assert set(unhealthy) == {"rollout_mismatch", "rollout_failure"}, unhealthy
    seen = {k for r in records for k in catalog.to_short(r["data"])}
    # (batch_shrink reads the aborted share through default(..., 0), but the static reading counts it.)
    assert blind_rules(rules, seen) == {"rollout_probs_diff": ["rollout_mismatch", "mismatch_rising"],
                                        "aborted_ratio": ["rollout_failure", "batch_shrink"],
                                        "sequences": ["batch_shrink"], "response_clip_ratio": ["truncation"]}


@pytest.mark.skipif(not NAN_EXCERPTS.exists(), reason="verl NaN excerpts not available")
def test_every_nan_excerpt_from_verl_issues_triggers_the_nan_rule(tmp_path: Path) -> None:
    rules = load_rules([PACK])
    blocks = [b for b in NAN_EXCERPTS.read_text().split("\n### ")[1:] if "step:" in b]
    assert len(blocks) == 3
    for i, block in enumerate(blocks):
        f = tmp_path / f"excerpt{i}.log"
        f.write_text(block)  # each excerpt is a different run: replay it alone
        records = _records(f)
        assert len(records) == 1, block[:200]
        fired = [d for r in run_series(rules, records) for d in r.decisions if d.rule == "nan_or_inf"]
        assert [d.kind for d in fired] == ["fire"], block[:120]
        assert fired[0].actions[0].kind == "rollback"
