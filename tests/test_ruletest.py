"""Rule unit tests (promtool style): the series notation, pass/fail reporting with diffs,
and broken test files reported with file:line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_watchdog.core.ruletest import SeriesError, format_results, parse_series, run_rule_tests

RULES = """version: 1
rules:
  - name: kl_high
    description: KL above 0.1 for two steps.
    expr: kl > 0.1
    for: 2
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.2, max: 0.02}
"""


@pytest.mark.parametrize(
    "text,values",
    [
        ("-2+4x3", [-2, 2, 6, 10]),  # promtool's own documented examples
        ("1-2x4", [1, -1, -3, -5, -7]),
        ("1x4", [1, 1, 1, 1, 1]),
        ("1 _x3 2", [1, None, None, None, 2]),
        ("0.02x2 0.15", [0.02, 0.02, 0.02, 0.15]),
        ("1e-3+1e-3x2", [0.001, 0.002, 0.003]),
        ("_", [None]),
    ],
)
def test_expanding_notation_matches_promtool(text: str, values: list) -> None:
    got = parse_series(text)
    assert len(got) == len(values)
    for g, v in zip(got, values, strict=True):
        assert (g is None and v is None) or g == pytest.approx(v)


def test_nan_and_inf_are_values() -> None:
    got = parse_series("nan inf -inf nanx1")
    assert math.isnan(got[0]) and got[1] == math.inf and got[2] == -math.inf and len(got) == 5


@pytest.mark.parametrize("text", ["1+", "abc", "1+2", "_+1x3", "1x", "0.1.2"])
def test_bad_series_items_are_named(text: str) -> None:
    with pytest.raises(SeriesError, match="bad series item"):
        parse_series(text)


def write(tmp_path: Path, tests: str) -> Path:
    (tmp_path / "rules.yaml").write_text(RULES)
    f = tmp_path / "t.yaml"
    f.write_text("rule_files: [rules.yaml]\ntests:\n" + tests)
    return f


def test_a_correct_expectation_passes(tmp_path: Path) -> None:
    f = write(tmp_path, """
  - name: fires on the second high step
    input_series: {kl: "0.05x2 0.15x2"}
    expect:
      - {step: 5, rule: kl_high, kind: fire, actions: [set]}
    expect_state:
      - {step: 4, rule: kl_high, status: pending}
""")
    [r] = run_rule_tests([f])
    assert r.passed, r.failures


def test_a_wrong_expectation_fails_with_a_diff_of_missing_and_unexpected_decisions(tmp_path: Path) -> None:
    f = write(tmp_path, """
  - name: wrong step
    input_series: {kl: "0.05x2 0.15x2"}
    expect:
      - {step: 4, rule: kl_high, kind: fire}
    expect_state:
      - {step: 5, rule: kl_high, status: inactive}
""")
    [r] = run_rule_tests([f])
    assert not r.passed
    assert r.failures[0].startswith("missing:    step 4: kl_high fire  (line 7; kl_high made: step 5: kl_high fire [set])")
    assert r.failures[1].startswith("unexpected: step 5: kl_high fire [set]")
    assert r.failures[2] == "state:      step 5: kl_high is firing, expected inactive"
    report = format_results([r])
    assert "FAIL" in report and report.endswith("0 passed, 1 failed")


def test_complete_false_ignores_decisions_not_listed(tmp_path: Path) -> None:
    f = write(tmp_path, """
  - name: partial
    complete: false
    input_series: {kl: "0.15x3 0.01"}
    expect:
      - {step: 2, rule: kl_high, kind: fire}
""")
    [r] = run_rule_tests([f])
    assert r.passed and [d.kind for d in r.decisions] == ["fire", "resolve"]


def test_a_broken_test_file_is_one_failed_result_with_file_and_line(tmp_path: Path) -> None:
    f = write(tmp_path, """
  - name: broken
    input_series: {klx: "1 2", kl: "1+"}
    events:
      - {step: 2, kind: explosion}
    expect:
      - {step: 2, rule: no_such_rule, kind: fired}
""")
    [r] = run_rule_tests([f])
    assert not r.passed and r.name == "t.yaml"
    text = "\n".join(r.failures)
    assert f"{f}:5:20: tests[0]: unknown metric 'klx'" in text
    assert f"{f}:5:36: tests[0].input_series.kl: bad series item '1+'" in text
    assert "unknown event kind 'explosion'" in text
    assert "unknown rule 'no_such_rule'" in text
    assert "expected kind must be fire, escalate or resolve, got 'fired'" in text


def test_a_broken_rule_file_fails_the_tests_that_use_it(tmp_path: Path) -> None:
    f = write(tmp_path, "  - {name: x, input_series: {kl: '1'}}\n")
    (tmp_path / "rules.yaml").write_text(RULES.replace("kl > 0.1", "kll > 0.1"))
    [r] = run_rule_tests([f])
    assert not r.passed and "unknown metric 'kll'" in r.failures[0]


@settings(max_examples=100, deadline=None)
@given(st.integers(-50, 50), st.integers(-20, 20), st.integers(0, 30))
def test_expanding_notation_property(a: int, b: int, n: int) -> None:
    text = f"{a}{'+' if b >= 0 else '-'}{abs(b)}x{n}"
    assert parse_series(text) == [a + i * b for i in range(n + 1)]
    assert parse_series(f"_x{n}") == [None] * n
