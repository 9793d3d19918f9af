"""Rule unit tests in the manner of ``promtool test rules``.

A test file::

    rule_files: [../default.yaml]          # relative to this file
    tests:
      - name: KL above 0.1 raises kl_coef
        rules: [kl_high]                   # optional: evaluate only these rules
        start_step: 1                      # step of the first value (default 1, like verl)
        input_series:                      # per short name (or verl key), one value per step
          kl: "0.02x9 0.15x4"              # promtool expanding notation, see parse_series
          reward: "0.5+0.01x12"
        events:                            # optional, delivered before evaluating that step
          - {step: 12, kind: oom}
        expect:                            # decisions: step, rule, kind, optionally action kinds
          - {step: 11, rule: kl_high, kind: fire, actions: [set]}
        complete: true                     # default: any decision not listed fails the test
        expect_state:                      # optional: rule status after evaluating a step
          - {step: 13, rule: kl_high, status: firing}

The rules are evaluated after every step, exactly as live and in ``watchdog replay``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppo_watchdog.core.engine import STATUSES, Decision, EngineState, evaluate
from ppo_watchdog.core.rulefile import (
    MAX_FILE_BYTES,
    RuleError,
    RuleFileError,
    RuleSet,
    YamlReader,
    _show,
    load_rules,
)
from ppo_watchdog.core.series import Window
from ppo_watchdog.protocol import catalog, inputs
from ppo_watchdog.protocol.events import EVENT_KINDS

_ITEM = re.compile(
    r"^(?P<a>_|nan|[-+]?inf|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
    r"(?:(?P<sign>[-+])(?P<b>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))?"
    r"(?:x(?P<n>\d+))?$"
)


class SeriesError(ValueError):
    """A series string is not valid expanding notation; names the item."""


MAX_SERIES_STEPS = 100_000
"""Steps a rule unit test may span (a series' length, an event's distance from ``start_step``): a unit
test is a few hundred steps; ``0x999999999999`` would otherwise expand until memory runs out."""


def parse_series(text: str, max_len: int = MAX_SERIES_STEPS) -> list[float | None]:
    """Expand promtool notation: ``a+bxn`` is n+1 values a, a+b, ..., a+n*b; ``axn`` is a, n+1 times.

    ``_`` is a missing value (``_xn``: n missing values, as in promtool); ``nan`` and
    ``inf`` are literal values. Example: ``"1 2+1x2 _x2 nan"`` -> 1 2 3 4 _ _ nan.
    A series longer than ``max_len`` values is a SeriesError naming the item that passes it.
    """
    out: list[float | None] = []
    for item in str(text).split():
        m = _ITEM.match(item)
        if m is None:
            raise SeriesError(f"bad series item {item!r} (expected a, a+bxn, a-bxn, axn, _ or _xn)")
        n = int(m["n"]) if m["n"] is not None else None
        if len(out) + (n if n is not None else 0) + 1 > max_len:
            raise SeriesError(f"series item {item!r} makes the series longer than {max_len:,} steps "
                              "(a rule unit test spans a few hundred)")
        if m["a"] == "_":
            if m["b"] is not None:
                raise SeriesError(f"bad series item {item!r}: a missing value cannot increment")
            out.extend([None] * (n if n is not None else 1))
            continue
        a = float(m["a"])
        b = float(m["b"]) if m["b"] is not None else 0.0
        if m["sign"] == "-":
            b = -b
        if n is None:
            if m["b"] is not None:
                raise SeriesError(f"bad series item {item!r}: a+b needs a count, e.g. {item}x5")
            out.append(a)
            continue
        out.extend(a + i * b if b else a for i in range(n + 1))
    return out


@dataclass
class RuleTestResult:
    """Outcome of one rule unit test (or of a test file that could not be read)."""

    file: str
    """Test file."""
    name: str
    """Test name (the file name when the file itself is broken)."""
    passed: bool
    """True when every expectation held."""
    failures: list[str] = field(default_factory=list)
    """One line per missing/unexpected decision or broken expectation."""
    decisions: list[Decision] = field(default_factory=list)
    """Every decision the rules made (for debugging a failure)."""


@dataclass
class _Expect:
    step: int
    rule: str
    kind: str
    actions: tuple[str, ...] | None
    line: int

    def __str__(self) -> str:
        acts = f" [{', '.join(self.actions)}]" if self.actions is not None else ""
        return f"step {self.step}: {self.rule} {self.kind}{acts}"


def _fmt(d: Decision) -> str:
    return f"step {d.step}: {d.rule} {d.kind} [{', '.join(a.kind for a in d.actions)}]"


def _read_test_file(path: Path) -> tuple[RuleSet | None, list[dict[str, Any]], list[RuleError]]:
    r = YamlReader(str(path))
    try:
        text = inputs.read_text(path, MAX_FILE_BYTES, stream_ok=True)
    except (OSError, UnicodeDecodeError) as exc:
        return None, [], [RuleError(str(path), 1, 1, f"cannot read test file: {inputs.reason(exc)}")]
    root = r.compose(text)
    if root is None:
        return None, [], r.errors or [RuleError(str(path), 1, 1, "empty test file")]
    top = r.mapping(root, "test file", ("rule_files", "tests"), required=("rule_files", "tests"))
    if top is None or "rule_files" not in top or "tests" not in top:
        return None, [], r.errors
    files = r.sequence(top["rule_files"][1], "rule_files") or []
    rule_paths = []
    for node in files:
        s = r.string(node, "rule_files[]")
        if s is not None:
            rule_paths.append(path.parent / s)
    rules: RuleSet | None = None
    if rule_paths:
        try:
            rules = load_rules(rule_paths)
        except RuleFileError as exc:
            r.errors += exc.errors
    tests: list[dict[str, Any]] = []
    for i, tnode in enumerate(r.sequence(top["tests"][1], "tests") or []):
        t = _read_test(r, tnode, i, rules)
        if t is not None:
            tests.append(t)
    return rules, tests, r.errors


def _read_test(r: YamlReader, node: yaml.Node, i: int, rules: RuleSet | None) -> dict[str, Any] | None:
    where = f"tests[{i}]"
    m = r.mapping(
        node, where,
        ("name", "rules", "start_step", "input_series", "events", "expect", "complete", "expect_state"),
        required=("name", "input_series"),
    )
    if m is None or "name" not in m or "input_series" not in m:
        return None
    n_err = len(r.errors)
    name = r.string(m["name"][1], f"{where}.name") or where
    only: list[str] | None = None
    if "rules" in m:
        only = []
        for rn in r.sequence(m["rules"][1], f"{where}.rules") or []:
            s = r.string(rn, f"{where}.rules[]")
            if s is not None and rules is not None and rules.get(s) is None:
                r.error(rn, f"{where}: unknown rule {s!r}")
            elif s is not None:
                only.append(s)
    start = r.integer(m["start_step"][1], f"{where}.start_step") if "start_step" in m else 1
    series: dict[str, list[float | None]] = {}
    sm = r.mapping(m["input_series"][1], f"{where}.input_series", _Any())
    for key, (knode, vnode) in (sm or {}).items():
        metric = catalog.lookup(key)
        if metric is None:
            r.error(knode, f"{where}: unknown metric {key!r}")
            continue
        v = r.scalar(vnode)
        if isinstance(v, yaml.Node):
            r.error(vnode, f"{where}.input_series.{key}: must be a series of values in a string, got {_show(v)}")
            continue
        try:
            series[metric.short] = parse_series(v if isinstance(v, str) else str(v))
        except SeriesError as exc:
            r.error(vnode, f"{where}.input_series.{key}: {exc}")
    events: list[dict[str, Any]] = []
    for en in (r.sequence(m["events"][1], f"{where}.events") or []) if "events" in m else []:
        em = r.mapping(en, f"{where}.events[]", _Any(), required=("step", "kind"))
        if em is None or "step" not in em or "kind" not in em:
            continue
        ev = {k: r.scalar(v) for k, (_, v) in em.items()}
        if ev["kind"] not in EVENT_KINDS:
            r.error(em["kind"][1], f"{where}: unknown event kind {_show(ev['kind'])}")
        if not isinstance(ev["step"], int) or isinstance(ev["step"], bool):
            r.error(em["step"][1], f"{where}: event step must be a whole number")
        elif start is not None and not 0 <= ev["step"] - start < MAX_SERIES_STEPS:
            r.error(em["step"][1], f"{where}: event step must be from start_step ({start}) to "
                                   f"{start + MAX_SERIES_STEPS - 1:,}, got {ev['step']}")
        events.append(ev)
    expects: list[_Expect] = []
    for en in (r.sequence(m["expect"][1], f"{where}.expect") or []) if "expect" in m else []:
        em = r.mapping(en, f"{where}.expect[]", ("step", "rule", "kind", "actions"), required=("step", "rule", "kind"))
        if em is None or not {"step", "rule", "kind"} <= set(em):
            continue
        step = r.integer(em["step"][1], f"{where}.expect[].step")
        rule = r.string(em["rule"][1], f"{where}.expect[].rule")
        kind = r.scalar(em["kind"][1])
        if kind not in ("fire", "escalate", "resolve"):
            r.error(em["kind"][1], f"{where}: expected kind must be fire, escalate or resolve, got {_show(kind)}")
        if rule is not None and rules is not None and rules.get(rule) is None:
            r.error(em["rule"][1], f"{where}: unknown rule {rule!r}")
        acts = None
        if "actions" in em:
            acts = tuple(str(r.scalar(a)) for a in (r.sequence(em["actions"][1], f"{where}.expect[].actions") or []))
        if step is not None and rule is not None:
            expects.append(_Expect(step, rule, str(kind), acts, en.start_mark.line + 1))
    states = []
    for en in (r.sequence(m["expect_state"][1], f"{where}.expect_state") or []) if "expect_state" in m else []:
        em = r.mapping(en, f"{where}.expect_state[]", ("step", "rule", "status"), required=("step", "rule", "status"))
        if em is None or not {"step", "rule", "status"} <= set(em):
            continue
        st = {"step": r.integer(em["step"][1], f"{where}.expect_state[].step"),
              "rule": r.string(em["rule"][1], f"{where}.expect_state[].rule"), "status": r.scalar(em["status"][1])}
        if st["status"] not in STATUSES:
            r.error(em["status"][1], f"{where}: status must be one of {', '.join(STATUSES)}")
        if st["rule"] is not None and rules is not None and rules.get(st["rule"]) is None:
            r.error(em["rule"][1], f"{where}: unknown rule {st['rule']!r}")
        states.append(st)
    complete = r.boolean(m["complete"][1], f"{where}.complete") if "complete" in m else True
    if len(r.errors) > n_err:
        return None
    return {
        "name": name, "only": only, "start": start, "series": series, "events": events,
        "expect": expects, "complete": complete, "states": states,
    }


class _Any(tuple):  # type: ignore[type-arg]
    def __contains__(self, item: object) -> bool:
        return True


def run_test(rules: RuleSet, test: dict[str, Any], file: str = "") -> RuleTestResult:
    """Run one parsed test against ``rules``."""
    rs = rules.only(test["only"]) if test["only"] else rules
    length = max((len(v) for v in test["series"].values()), default=0)
    last_event = max((int(e["step"]) for e in test["events"]), default=test["start"] - 1)
    last = max(test["start"] + length - 1, last_event)
    w = Window(rs.max_window + 1)
    st = EngineState()
    decisions: list[Decision] = []
    state_at: dict[int, EngineState] = {}
    for i, step in enumerate(range(test["start"], last + 1)):
        row = {k: v[i] for k, v in test["series"].items() if i < len(v) and v[i] is not None}
        w.append(step, row)
        w.add_events(e for e in test["events"] if int(e["step"]) == step)
        got, st = evaluate(rs, w, st, step)
        decisions += got
        state_at[step] = st
    failures: list[str] = []
    unmatched = list(decisions)
    for e in test["expect"]:
        hit = next(
            (
                d for d in unmatched
                if d.step == e.step and d.rule == e.rule and d.kind == e.kind
                and (e.actions is None or tuple(a.kind for a in d.actions) == e.actions)
            ),
            None,
        )
        if hit is None:
            near = [_fmt(d) for d in decisions if d.rule == e.rule]
            failures.append(f"missing:    {e}  (line {e.line}; {e.rule} made: {', '.join(near) or 'no decisions'})")
        else:
            unmatched.remove(hit)
    if test["complete"]:
        failures += [f"unexpected: {_fmt(d)}  ({d.message})" for d in unmatched]
    for s in test["states"]:
        at = state_at.get(int(s["step"]))
        got_status = at.rule(str(s["rule"])).status if at else "(step not evaluated)"
        if got_status != s["status"]:
            failures.append(f"state:      step {s['step']}: {s['rule']} is {got_status}, expected {s['status']}")
    return RuleTestResult(file, test["name"], not failures, failures, decisions)


def is_rule_pack(path: Path) -> bool:
    """True when ``path`` is a rule pack (a top-level ``rules:`` or ``params:`` and no ``tests:``), not a file
    of rule unit tests; a file that cannot be read or parsed is not called a pack (read as a test, it fails
    with its error)."""
    try:
        text = inputs.read_text(path, MAX_FILE_BYTES, stream_ok=True)
    except (OSError, UnicodeDecodeError):
        return False
    root = YamlReader(str(path)).compose(text)
    if not isinstance(root, yaml.MappingNode):
        return False
    keys = {k.value for k, _ in root.value if isinstance(k, yaml.ScalarNode)}
    return bool(keys & {"rules", "params"}) and not keys & {"tests", "rule_files"}


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    """The test files of ``paths``: a directory gives its *.yaml / *.yml (recursively) that are not rule packs (a
    repository's rules/ holds both); a rule pack named on its own is a ValueError saying so."""
    out: list[Path] = []
    for p in [Path(x) for x in paths]:
        if p.is_dir():
            out += sorted(x for x in p.rglob("*") if x.suffix in (".yaml", ".yml") and x.is_file()
                          and not is_rule_pack(x))
        elif is_rule_pack(p):
            raise ValueError(f"{p}: a rule pack, not a file of rule tests (those have rule_files: and tests:); "
                             f"check a pack with `watchdog rules check {p}`")
        else:
            out.append(p)
    return out


def run_rule_tests(paths: Sequence[str | Path]) -> list[RuleTestResult]:
    """Run every test in the given files (directories: their test files, rule packs left out); a broken file is one
    failed result."""
    results: list[RuleTestResult] = []
    for path in _expand(paths):
        rules, tests, errors = _read_test_file(path)
        if errors or rules is None:
            msgs = [str(e) for e in errors] or [f"{path}: no rule files"]
            results.append(RuleTestResult(str(path), path.name, False, msgs))
            continue
        results += [run_test(rules, t, str(path)) for t in tests]
    return results


def format_results(results: Sequence[RuleTestResult]) -> str:
    """A promtool-like report: one line per test, failure diffs indented below."""
    lines = []
    for r in results:
        lines.append(f"{'PASS' if r.passed else 'FAIL'}  {r.file}: {r.name}")
        lines += [f"      {f}" for f in r.failures]
    n_fail = sum(not r.passed for r in results)
    lines.append(f"{len(results) - n_fail} passed, {n_fail} failed")
    return "\n".join(lines)
