"""Property-based fuzzing of every text the watchdog reads from outside (issue 14).

Rule files and expressions, control.json, run.json, events and metrics lines, daemon configs:
each is generated both from scratch and by mutating a valid document (the inputs that get
furthest into a parser are near-valid ones). The property is the same everywhere: the reader
returns a value or raises its own error type, whose message names the file and the position;
nothing else escapes (no traceback), and a value it accepts survives a write/read round trip.

Bounded for ``make test`` (``WATCHDOG_FUZZ_EXAMPLES``, default 150 per target); ``bench/fuzz.py``
runs the same properties with thousands of examples each and records the counts in
bench/results/fuzz.json. ``COUNTS`` tallies, per target, how many inputs were accepted and how
many were refused with a clean error.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppo_watchdog.control.daemon import DaemonConfigError, load_daemon_config
from ppo_watchdog.core.expr import BOOL, FUNCTIONS, NUM, ExprError, compile_expr
from ppo_watchdog.core.rulefile import RuleFileError, load_rules, parse_rules
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import ControlError, parse_control
from ppo_watchdog.protocol.events import Event, EventError
from ppo_watchdog.protocol.runinfo import RunInfo, RunInfoError
from ppo_watchdog.sources import ingest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("WATCHDOG_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: target -> Counter({"accepted": n, "refused": n})
COUNTS: dict[str, Counter[str]] = {}


def _tally(target: str, outcome: str) -> None:
    COUNTS.setdefault(target, Counter())[outcome] += 1


# -- mutation of valid documents -----------------------------------------------------------

#: Values a careless or hostile writer puts where a good one belongs.
HOSTILE = [
    ".nan", ".inf", "-.inf", "nan", "NaN", "inf", "-5", "0", "-1", "1e36", "1e26", "1e309", "10**30",
    "9" * 40, "abc", "", "null", "~", "true", "[", "]", "{", "}", ":", ": :", "- ", "-", "'", '"', "\t",
    "&a", "*a", "*missing", "<<: *a", "!!python/object/apply:os.system ['true']", "!!binary AAAA",
    "\x00", "\ufeff", "é", "\\u0000", "((((((", ")", ",", "$", "$nope", "step", "avg(", "kl >",
    " + ".join(["kl"] * 500), "max(" * 80 + "kl" + ")" * 80, "- " * 200, "[" * 300, "{a: " * 100,
    "? [a, b]\n: c", "%YAML 1.1", "---", "...", "#", "\n", "\r\n", "x" * 5000,
]


@st.composite
def mutated(draw: st.DrawFn, seed: str) -> str:
    """``seed`` with one to four edits: a token replaced, inserted or deleted, a line dropped or doubled."""
    text = seed
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        i = draw(st.integers(0, max(len(lines) - 1, 0)))
        op = draw(st.sampled_from(["replace", "insert", "delete", "drop_line", "dup_line", "swap_value"]))
        line = lines[i] if lines else ""
        token = draw(st.one_of(st.sampled_from(HOSTILE), st.text(max_size=12)))
        if op == "drop_line" and lines:
            del lines[i]
        elif op == "dup_line" and lines:
            lines.insert(i, line)
        elif op == "swap_value" and ":" in line:
            lines[i] = line.split(":", 1)[0] + ": " + token
        else:
            a = draw(st.integers(0, len(line)))
            b = draw(st.integers(a, min(len(line), a + 8)))
            lines[i] = line[:a] + ("" if op == "delete" else token) + line[b if op != "insert" else a:]
        text = "\n".join(lines)
    return text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _dumps(doc: Any) -> str:
    return json.dumps(doc, allow_nan=True)  # NaN and Infinity are what Python writers emit


# -- rule files and expressions ------------------------------------------------------------

DEFAULT_PACK = (ROOT / "rules" / "default.yaml").read_text()
SMALL_PACK = """\
version: 1
params:
  limit: {value: 0.1, description: the KL target}
rules:
  - name: kl_high
    severity: warning
    when: avg(kl, 3) > $limit
    for: 2
    cooldown: 10
    actions:
      - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.9, min: 1.0e-7}
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.2, max: 1.0}
      - rollback: {to: last_good}
    budget: {max_fires: 3, window: 100, escalate: [notify]}
"""


def _check_rule_errors(text: str, file: str) -> None:
    rules, errors = parse_rules(text, file)
    for e in errors:
        assert e.file == file and e.line >= 1 and e.col >= 1 and e.message, e
    _tally("rule file", "refused" if errors else "accepted")
    if not errors:
        assert rules is not None


@FUZZ
@given(st.one_of(mutated(SMALL_PACK), mutated(DEFAULT_PACK)))
def test_a_mutated_rule_file_is_read_or_refused_with_file_line_and_column(text: str) -> None:
    _check_rule_errors(text, "pack.yaml")


@FUZZ
@given(st.text(max_size=300))
def test_any_text_as_a_rule_file_is_read_or_refused_with_file_line_and_column(text: str) -> None:
    _check_rule_errors(text, "random.yaml")


def test_a_rule_file_on_disk_names_itself_in_every_error(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(SMALL_PACK.replace("scale: 0.9", "scale: .nan"))
    try:
        load_rules([path])
    except RuleFileError as exc:
        assert all(e.file == str(path) for e in exc.errors) and "scale" in str(exc)
    else:
        raise AssertionError("a NaN scale was accepted")


_EXPR_TOKENS = st.sampled_from(
    [*FUNCTIONS, "kl", "reward", "entropy", "step", "$p", "$nope", "'oom'", "1", "0.5", "-3", "1e309", "nan",
     "(", ")", ",", "+", "-", "*", "/", "<", ">", "<=", ">=", "==", "!=", "and", "or", "not", " ", "@", "\"",
     "actor/kl_loss", "critic/score/mean"])


_metrics = st.sampled_from(["kl", "reward", "entropy", "grad_norm", 'm("actor/kl_loss")', 'm("critic/score/mean")',
                            "actor/kl_loss", "nope"])
_windowed = st.builds(lambda f, m, n: f"{f}({m}, {n})", st.sampled_from(["avg", "min", "max", "std", "median", "delta"]),
                     _metrics, st.integers(-1, 60))
_atoms = st.one_of(_metrics, _windowed, st.sampled_from(["step", "$p", "$nope", "1", "0.5", "-3", "1e309", "nan"]))


def _call(name: str, args: list[str]) -> str:
    return f"{name}({', '.join(args)})"


_exprs = st.recursive(_atoms, lambda inner: st.one_of(
    st.builds(_call, st.sampled_from(sorted(FUNCTIONS)), st.lists(st.one_of(inner, st.sampled_from(["3", "'oom'"])),
                                                               max_size=3)),
    st.builds(lambda a, op, b: f"{a} {op} {b}", inner,
              st.sampled_from(["+", "-", "*", "/", "<", ">", "<=", ">=", "==", "!=", "and", "or"]), inner),
    inner.map(lambda a: f"not ({a})"), inner.map(lambda a: f"({a})"),
), max_leaves=10)


_conds = st.recursive(
    st.builds(lambda a, op, b: f"{a} {op} {b}", _exprs, st.sampled_from(["<", ">", "<=", ">=", "==", "!="]), _exprs),
    lambda inner: st.one_of(st.builds(lambda a, op, b: f"({a}) {op} ({b})", inner, st.sampled_from(["and", "or"]), inner),
                            inner.map(lambda a: f"not ({a})")),
    max_leaves=4)


@FUZZ
@given(st.one_of(_exprs, _conds, _conds.flatmap(mutated), st.lists(_EXPR_TOKENS, max_size=40).map(" ".join)),
       st.sampled_from([BOOL, NUM]))
def test_an_expression_compiles_or_fails_with_a_column_inside_it(text: str, want: str) -> None:
    try:
        compile_expr(text, want, params={"p": 1.0})
    except ExprError as exc:
        assert 1 <= exc.col <= len(text) + 1 and str(exc), (text, exc)
        _tally("expression", "refused")
    else:
        _tally("expression", "accepted")


# -- control.json ---------------------------------------------------------------------------

VALID_CONTROL = json.dumps({
    "version": 7,
    "overrides": {"algorithm.kl_ctrl.kl_coef": 0.0012, "actor_rollout_ref.actor.optim.lr": 1e-6},
    "commands": [{"id": "c1", "kind": "rollback", "to_step": 10}, {"id": "c2", "kind": "pause"}],
}, indent=1)


@FUZZ
@given(st.one_of(mutated(VALID_CONTROL), json_values.map(_dumps),
                 st.fixed_dictionaries({}, optional={"version": json_values, "overrides": json_values,
                                                     "commands": json_values}).map(_dumps)))
def test_control_json_is_read_or_refused_naming_the_file(text: str) -> None:
    path = "/runs/exp/control.json"
    try:
        control = parse_control(text, path)
    except ControlError as exc:
        assert str(exc).startswith(f"{path}: ") and exc.reason, exc
        _tally("control.json", "refused")
        return
    _tally("control.json", "accepted")
    assert parse_control(json.dumps(control.to_json()), path) == control


# -- run.json ---------------------------------------------------------------------------------

VALID_RUN = json.dumps(RunInfo(id="exp", command=["python", "-m", "ppo_watchdog.trainer"], pid=123, started=1.7e9,
                               config={"trainer": {"total_training_steps": 80}}, world_size=1,
                               total_steps=80, exit_codes={"oom": 3}).to_json(), indent=1)


@FUZZ
@given(st.one_of(mutated(VALID_RUN), json_values.map(_dumps),
                 st.dictionaries(st.sampled_from(["id", "pid", "command", "started", "config", "mode",
                                                  "exit_codes", "launches", "live_keys", "world_size"]),
                                 json_values, max_size=5).map(_dumps)))
def test_run_json_is_read_or_refused_naming_the_file_and_field(text: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / rundir.RUN_JSON
        path.write_text(text, encoding="utf-8")
        try:
            info = RunInfo.read(d)
        except RunInfoError as exc:
            assert str(exc).startswith(f"{path}: ") and exc.reason, exc
            _tally("run.json", "refused")
            return
        _tally("run.json", "accepted")
        info.write(d)
        assert RunInfo.read(d) == info


# -- events and metrics lines ---------------------------------------------------------------

_GOOD_EVENTS = [
    {"ts": 1.0, "step": 3, "kind": "applied", "version": 2, "commands": []},
    {"ts": 1.0, "step": 4, "kind": "rollback", "to_step": 0, "from_step": 4},
    {"ts": 1.0, "step": None, "kind": "started", "resumed_from": None, "attempt": 1},
    {"ts": 1.0, "step": 5, "kind": "oom", "micro_batch_size": 4},
    {"ts": 1.0, "step": 6, "kind": "error", "message": "x"},
]
_lines = st.one_of(
    st.sampled_from(_GOOD_EVENTS).map(json.dumps),
    st.builds(lambda e, k, v: json.dumps({**e, k: v}), st.sampled_from(_GOOD_EVENTS),
              st.sampled_from(["step", "ts", "kind", "version", "to_step", "attempt", "micro_batch_size",
                               "commands"]), json_values),
    json_values.map(_dumps), st.text(max_size=40), st.sampled_from(["", "{", "[1,", "\x00\x01"]),
)


@FUZZ
@given(st.lists(_lines, max_size=12))
def test_events_lines_are_kept_or_skipped_naming_file_and_line(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / rundir.EVENTS
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        chunk = rundir.read_jsonl(path)
        events = rundir.events_of(chunk)
        for err in chunk.errors:
            assert err.startswith(f"{path}:"), err
        for e in events:
            assert Event.parse(dict(e), "again") == e
        _tally("events line", "refused" if chunk.errors else "accepted")


@FUZZ
@given(st.one_of(json_values, st.builds(lambda e, k, v: {**e, k: v}, st.sampled_from(_GOOD_EVENTS),
                                        st.sampled_from(["step", "ts", "kind", "version", "to_step", "from_step",
                                                         "resumed_from", "micro_batch_size", "commands"]),
                                        st.one_of(json_values, st.integers(0, 100)))))
def test_an_event_object_is_valid_or_refused_naming_the_field(obj: Any) -> None:
    try:
        Event.parse(obj, "events.jsonl:9")
    except EventError as exc:
        assert str(exc).startswith("events.jsonl:9"), exc
        _tally("event object", "refused")
    else:
        _tally("event object", "accepted")


_steps = st.one_of(st.integers(-10, 50), st.sampled_from([10**30, "abc", "3", 1.5, True, None, float("nan")]))
_metric_lines = st.one_of(
    st.builds(lambda s, d: json.dumps({"step": s, "data": d}, allow_nan=True), _steps,
              st.dictionaries(st.sampled_from(["actor/reward_kl_penalty", "critic/score/mean", "actor/entropy",
                                               "critic/vf_loss", "x"]),
                              st.one_of(st.floats(), st.sampled_from(["nan", "np.float64(1.5)", "1e400", "abc"]),
                                        json_values), max_size=4)),
    st.builds(lambda s, v: f"step:{s} - actor/reward_kl_penalty:{v} - critic/vf_loss:np.float64({v})",
              _steps, st.sampled_from(["0.1", "nan", "tensor(0.5, device='cuda:0')", "abc", "", "1e999"])),
    json_values.map(_dumps), st.text(max_size=60),
)


@FUZZ
@given(st.lists(_metric_lines, min_size=1, max_size=15))
def test_metrics_lines_are_read_or_skipped_naming_file_and_line(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "metrics.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        try:
            res = ingest.read_run(path)
        except ingest.IngestError as exc:
            assert str(exc).startswith(str(path)), exc
            _tally("metrics line", "refused")
            return
        n = len("\n".join(lines).splitlines())
        for issue in res.issues:
            assert issue.file == str(path) and 1 <= issue.line <= max(n, 1) and issue.message, issue
        steps = [r["step"] for r in res.records]
        assert all(isinstance(s, int) and s >= 0 for s in steps) and steps == sorted(set(steps)), steps
        _tally("metrics line", "refused" if res.issues else "accepted")


# -- daemon configs ---------------------------------------------------------------------------

VALID_DAEMON = yaml.safe_dump({
    "runs": [{"run_dir": "/runs/a", "restart_command": ["python", "-m", "ppo_watchdog.trainer"], "on_escalate": "stop"},
             "/runs/b"],
    "tick_s": 5.0, "metrics_port": 0, "source": "files", "state_dir": "/tmp/state",
    "controller": {"restart_budget": 3}, "actuator": {"live_timeout_s": 60.0},
}, sort_keys=False)


@FUZZ
@given(st.one_of(mutated(VALID_DAEMON), st.text(max_size=200),
                 st.dictionaries(st.sampled_from(["runs", "tick_s", "metrics_port", "source", "rules", "controller",
                                                  "actuator", "webhook_url_file", "bogus"]),
                                 json_values, max_size=4).map(lambda d: yaml.safe_dump(d))))
def test_a_daemon_config_is_loaded_or_refused_naming_the_file(text: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "daemon.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            load_daemon_config(path)
        except DaemonConfigError as exc:
            assert str(exc).startswith(f"{path}: "), exc
            _tally("daemon config", "refused")
        else:
            _tally("daemon config", "accepted")


# -- a live run's timeline and a daemon's runs (issue 20) -------------------------------------------


@FUZZ
@given(st.lists(st.one_of(st.tuples(st.just("line"), st.integers(0, 60)),
                          st.tuples(st.sampled_from(["started", "rollback"]), st.integers(0, 60))),
                min_size=1, max_size=40))
def test_a_tailed_run_steps_only_go_forward_unless_an_event_explains_the_rewind(
        items: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        tailer = ingest.RunTailer(d)
        kept: list[int] = []
        explained: list[int] = []  # targets of the started/rollback events written so far
        written = 0
        for what, step in items:
            if what == "line":
                rundir.append_metrics(d, step, {"actor/reward_kl_penalty": 0.1})
                written += 1
            elif what == "rollback":
                rundir.append_event(d, "rollback", step, to_step=step, from_step=step + 1)
                explained.append(step)
            else:
                rundir.append_event(d, "started", step, resumed_from=step, attempt=1)
                explained.append(step)
            before = len(tailer.issues)
            records, _ = tailer.poll()
            for rec in records:
                step_now = rec["step"]
                if kept and step_now < kept[-1]:
                    # a rewind: explained by an event whose target is this step or the one before
                    assert any(t <= step_now <= t + 1 for t in explained), (kept, step_now, explained)
                kept.append(step_now)
            for issue in tailer.issues[before:]:
                line = int(issue.split("metrics.jsonl:", 1)[1].split(":", 1)[0])
                assert 1 <= line <= written and "no started or rollback event explains it" in issue, issue
        _tally("live timeline", "refused" if tailer.issues else "accepted")


@settings(max_examples=max(10, EXAMPLES // 10), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.one_of(mutated(VALID_RUN), json_values.map(_dumps), st.binary(max_size=40).map(
    lambda b: b.decode("latin-1"))), min_size=1, max_size=3))
def test_a_daemon_watches_its_healthy_run_whatever_the_other_runs_files_hold(texts: list[str]) -> None:
    from ppo_watchdog.control.daemon import prepare_daemon

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        healthy = root / "healthy"
        healthy.mkdir()
        for step, v in ((1, 0.01), (2, float("nan"))):
            rundir.append_metrics(healthy, step, {"actor/reward_kl_penalty": v})
        dirs = [str(healthy)]
        for i, text in enumerate(texts):
            run = root / f"r{i}"
            run.mkdir()
            (run / rundir.RUN_JSON).write_text(text, encoding="utf-8")
            rundir.append_metrics(run, 1, {"actor/reward_kl_penalty": 0.01})
            dirs.append(str(run))
        rules = root / "rules.yaml"
        rules.write_text("version: 1\nrules:\n  - name: nan\n    description: a NaN\n    expr: nonfinite()\n"
                         "    actions: [notify]\n")
        cfg = root / "daemon.yaml"
        cfg.write_text(yaml.safe_dump({"state_dir": str(root / "state"), "rules": [str(rules)], "runs": dirs}))
        wd = prepare_daemon(load_daemon_config(cfg))
        try:
            wd.tick()
            wd.tick()
            assert "healthy" in wd.controllers and not wd.unwatched.get(str(healthy))
            assert [x["step"] for x in wd.store.decisions("healthy")] == [2]
            assert len(wd.controllers) + len(wd.unwatched) == len(dirs)
        finally:
            wd.close()
        _tally("daemon beside bad runs", "refused" if wd.unwatched else "accepted")
