"""Hostile inputs found by a red team of the rule packs, the daemon's config and the run directories: each is
refused, or read, with a message naming the file and the key or line, never a hang, a traceback or a value the
watchdog would then send to a trainer."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from ppo_watchdog.backends.local import read_tail
from ppo_watchdog.cli import app
from ppo_watchdog.control.daemon import DaemonConfigError, load_daemon_config, prepare_daemon
from ppo_watchdog.control.store import Phase, RunRecord, Store
from ppo_watchdog.core import actions as act
from ppo_watchdog.core.planner import snap_micro_batch
from ppo_watchdog.core.rulefile import MAX_ALIASES, RuleFileError, load_rules
from ppo_watchdog.core.ruletest import run_rule_tests
from ppo_watchdog.protocol import inputs, rundir
from ppo_watchdog.protocol.events import EventError
from ppo_watchdog.protocol.runinfo import RunInfo, RunInfoError
from ppo_watchdog.sources import ingest
from ppo_watchdog.sources.ingest import RunTailer, record_from_json


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, failing the test (instead of hanging the suite) when it has not returned in time."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (a read waiting on a FIFO?)"
    if "error" in out:
        raise out["error"]
    return out["value"]


# -- files that are not files ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_run_json_that_is_not_a_regular_file_is_refused_at_once_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / rundir.RUN_JSON
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(RunInfoError, match=rf"run\.json: cannot be read .*a {'FIFO' if kind == 'fifo' else kind}, not a regular"):
        _within(10, lambda: RunInfo.read(tmp_path))


def test_read_file_refuses_a_device_and_a_file_past_its_limit(tmp_path: Path) -> None:
    with pytest.raises(inputs.NotRegularFileError, match="a character device"):
        inputs.read_file("/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"x" * 2048)
    with pytest.raises(OSError, match="larger than 1,024 bytes"):
        inputs.read_file(big, max_bytes=1024)
    assert inputs.read_file(big, max_bytes=4096) == b"x" * 2048


def test_a_fifo_for_metrics_jsonl_fails_the_runs_read_naming_it_not_silently_blind(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / rundir.METRICS)
    tailer = RunTailer(tmp_path)
    with pytest.raises(OSError, match=r"a FIFO, not a regular file: '.*metrics\.jsonl'"):
        _within(10, tailer.poll)


def _daemon_config(tmp_path: Path, runs: list[Path], **extra: Any) -> Path:
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n  - name: nan\n    description: a NaN\n    expr: nonfinite()\n"
                     "    actions: [notify]\n")
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(rules)],
                                   "runs": [str(r) for r in runs], **extra}))
    return cfg


def test_a_daemon_watches_its_other_runs_beside_fifos_and_a_symlink_loop(tmp_path: Path) -> None:
    good, fifo, lock, metrics, loop = (tmp_path / n for n in ("good", "fifo", "lock", "metrics", "loop"))
    for d in (good, fifo, lock, metrics):
        d.mkdir()
    os.mkfifo(fifo / rundir.RUN_JSON)
    os.mkfifo(lock / ".trainer.lock")  # (a FIFO where the trainer's lock belongs: not held, never waited on)
    os.mkfifo(metrics / rundir.METRICS)
    loop.symlink_to(loop)
    for step, v in ((1, 0.01), (2, float("nan"))):
        for d in (good, lock):
            rundir.append_metrics(d, step, {"actor/reward_kl_penalty": v})
    cfg = _daemon_config(tmp_path, [good, fifo, lock, metrics, loop])
    wd = _within(30, lambda: prepare_daemon(load_daemon_config(cfg)))
    try:
        _within(30, wd.tick)
        _within(30, wd.tick)
        for run in ("good", "lock"):
            assert [d["step"] for d in wd.store.decisions(run)] == [2], run
        assert set(wd.unwatched) == {str(fifo), str(loop)}
        assert "a FIFO, not a regular file" in wd.unwatched[str(fifo)]
        assert "a FIFO, not a regular file" in wd._tick_errors["metrics"]
        assert wd.unwatched[str(loop)] == f"{loop}: cannot be resolved (a symlink loop): not a run directory"
    finally:
        wd.close()


def test_a_config_or_pack_piped_in_is_read_and_a_log_that_is_a_fifo_is_not_waited_on(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    # The writer is done before the reader opens, as a shell's `<(cat config)` often is. (A held read end lets
    # it open without waiting and keeps what it wrote; a writer still opening when the reader reads would be
    # read as an empty pipe.)
    held = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)

    def write() -> None:
        with open(pipe, "w") as f:
            f.write("runs: [x]\ntick_s: 5\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(10)
    try:
        assert _within(10, lambda: inputs.read_text(pipe, 1024, stream_ok=True)) == "runs: [x]\ntick_s: 5\n"
    finally:
        os.close(held)
    assert _within(10, lambda: read_tail(pipe)) == ""


# -- values too large to print or to hold ---------------------------------------------------------


def test_an_alias_bomb_in_the_daemon_config_is_refused_at_once_quoting_a_little_of_it(tmp_path: Path) -> None:
    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("runs: [x]\ntick_s: [" + ", ".join(levels) + "]\n")
    with pytest.raises(DaemonConfigError, match=r"daemon\.yaml: tick_s must be .*got \[\['lol'") as got:
        _within(10, lambda: load_daemon_config(cfg))
    assert len(str(got.value)) < 400
    assert len(inputs.short_repr(list(range(10**6)))) <= 80


@pytest.mark.parametrize("step", [2**70, 1e300, 2**53])
def test_a_step_past_2_to_the_53_is_a_skipped_line_not_an_overflow(step: float) -> None:
    rec, reason = record_from_json({"step": step, "data": {"actor/kl": 0.1}})
    assert rec is None and reason is not None and "at most 2**53 - 1" in reason
    if isinstance(step, int):
        with pytest.raises(EventError, match="step"):
            rundir.Event.parse({"kind": "oom", "step": step}, "events.jsonl:1")
    assert rundir.Event.parse({"kind": "oom", "step": 2**53 - 1}, "events.jsonl:1")["step"] == 2**53 - 1


def test_a_huge_step_in_metrics_jsonl_is_said_and_the_next_lines_are_read(tmp_path: Path) -> None:
    rundir.append_metrics(tmp_path, 1, {"actor/kl": 0.1})
    with open(tmp_path / rundir.METRICS, "a") as f:
        f.write('{"step": 1180591620717411303424, "data": {"actor/kl": 0.1}}\n')
    rundir.append_metrics(tmp_path, 2, {"actor/kl": 0.2})
    tailer = RunTailer(tmp_path)
    records, _ = tailer.poll()
    assert [r["step"] for r in records] == [1, 2]
    assert any(":2: skipped a record: 'step' must be at most 2**53 - 1" in i for i in tailer.issues)


def test_replay_reads_every_line_of_a_log_whose_key_holds_a_line_separator(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(f'{{"step": {s}, "data": {{"actor/kl\u2028x": 0.1, "actor/kl": 0.1}}}}\n' for s in (1, 2, 3)),
                   encoding="utf-8")
    assert [r["step"] for r in ingest.read_run(log).records] == [1, 2, 3]


# -- the CLI prints what files hold as it is --------------------------------------------------------


def test_a_run_id_or_path_with_console_markup_is_printed_as_it_is(tmp_path: Path) -> None:
    state = tmp_path / "[/red]state"
    r = CliRunner().invoke(app, ["status", "[/x]", "--state-dir", str(state)])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "[/red]state" in r.output
    store = Store(state)
    store.upsert_run(RunRecord("[/x]", str(tmp_path / "run"), ["python", "-m", "ppo_watchdog.trainer"], phase=Phase.PAUSED))
    store.close()
    r = CliRunner().invoke(app, ["status", "--state-dir", str(state)])
    assert r.exit_code == 0 and "[/x]" in r.output, r.output


def test_replay_prints_its_table_with_styles_not_markup_text(tmp_path: Path) -> None:
    for step, v in ((1, 0.01), (2, float("nan"))):
        rundir.append_metrics(tmp_path, step, {"actor/reward_kl_penalty": v})
    r = CliRunner().invoke(app, ["replay", str(tmp_path)])
    assert r.exit_code == 0 and "nan_or_inf" in r.output and "fire" in r.output, r.output
    assert "[yellow]" not in r.output and "[/]" not in r.output


def test_replay_of_a_run_dir_with_a_garbled_run_json_exits_2_naming_it(tmp_path: Path) -> None:
    rundir.append_metrics(tmp_path, 1, {"actor/kl": 0.1})
    (tmp_path / rundir.RUN_JSON).write_text("[1, 2]")
    r = CliRunner().invoke(app, ["replay", str(tmp_path)])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "run.json" in r.output and "Traceback" not in r.output


# -- rule packs ---------------------------------------------------------------------------------------


def _pack(tmp_path: Path, action: str, name: str = "pack.yaml", extra: str = "") -> Path:
    p = tmp_path / name
    p.write_text(f"version: 1\nrules:\n  - name: r1\n    description: \"d{extra}\"\n    expr: kl > 0.1\n"
                 f"    actions: [{action}]\n")
    return p


def _errors(*paths: Path) -> str:
    with pytest.raises(RuleFileError) as got:
        load_rules(list(paths))
    return str(got.value)


@pytest.mark.parametrize(("action", "said"), [
    ("{set: {key: actor_rollout_ref.actor.optim.lr, to: 1e308}}", "optim.lr must be in (0, 1]"),
    ("{set: {key: actor_rollout_ref.actor.ppo_epochs, to: 1e300}}", "a whole number from 1 to 2,147,483,647"),
    ("{set: {key: kl_coef, to: 1e300}}", "kl_coef must be at most 100"),
    ("{set: {key: kl_coef, scale: 1" + "0" * 400 + "}}", "must be a finite number"),
    ("{set: {key: kl_coef, scale: !!float abc}}", "bad scalar 'abc'"),
])
def test_a_pack_setting_an_absurd_value_is_refused_at_load_naming_the_line(tmp_path: Path, action: str,
                                                                            said: str) -> None:
    message = _errors(_pack(tmp_path, action))
    assert "pack.yaml:6:" in message and said in message, message


def test_a_value_no_setting_may_have_is_refused_when_planned_whatever_the_pack_says() -> None:
    assert act.value_problem("algorithm.kl_ctrl.kl_coef", 2.88e305) == \
        "algorithm.kl_ctrl.kl_coef must be at most 100, got 2.88e+305"
    assert act.value_problem("actor_rollout_ref.actor.entropy_coeff", 3.0) is not None
    assert act.value_problem("actor_rollout_ref.actor.optim.lr", 1e-6) is None
    grow = act.SetAction("kl_coef", "scale", 1e200, grow=True)
    assert grow.factor(3) == math.inf  # (1e600 overflows: no value may be infinite, so the set is refused)
    assert act.value_problem("kl_coef", grow.apply(0.001, 3)) is not None


def test_a_huge_micro_batch_snaps_to_the_mini_batch_at_once() -> None:
    assert _within(5, lambda: snap_micro_batch(10**15, 8)) == 8
    assert _within(5, lambda: snap_micro_batch(2**31 - 2, 2**31 - 1)) == 1  # (a prime share: no divisor but 1)
    assert [snap_micro_batch(v, 12) for v in (1, 5, 6, 7, 11, 12, 13)] == [1, 4, 6, 6, 6, 12, 12]


def test_a_description_with_a_terminal_escape_is_refused(tmp_path: Path) -> None:
    message = _errors(_pack(tmp_path, "notify", extra="\\x1b[2J"))
    assert "control character (U+001B)" in message


def test_a_string_alias_bomb_in_a_pack_is_refused_after_max_aliases(tmp_path: Path) -> None:
    rules = [f"  - name: r{i}\n    description: *s\n    expr: kl > 0.1\n    actions: [notify]\n"
             for i in range(MAX_ALIASES + 1)]
    p = tmp_path / "bomb.yaml"
    p.write_text("version: 1\nrules:\n  - name: r\n    description: &s " + "a " * 50_000 + "\n    expr: kl > 0.1\n"
                 "    actions: [notify]\n" + "".join(rules))
    message = _within(20, lambda: _errors(p))
    assert f"more than {MAX_ALIASES} aliases" in message


def test_a_rule_defined_twice_is_blamed_on_the_file_that_defines_it_again(tmp_path: Path) -> None:
    a, b = _pack(tmp_path, "notify", "a.yaml"), _pack(tmp_path, "notify", "b.yaml")
    c = tmp_path / "c.yaml"
    c.write_text("version: 1\nrules: []\n")
    message = _errors(a, b, c)
    assert f"{b}:3:1: rule 'r1' is already defined at {a}:3" in message


def test_an_overlay_may_move_a_parameter_only_within_its_packs_floor_and_ceiling(tmp_path: Path) -> None:
    pack = tmp_path / "pack.yaml"
    pack.write_text("version: 1\nparams:\n  kl_jump:\n    value: 2.0\n    description: how far KL jumps\n"
                    "    calibrate: {stat: kl, margin: 1.25, min: 1.5}\nrules:\n  - name: r1\n    description: d\n"
                    "    expr: kl > $kl_jump\n    actions: [notify]\n")
    ok, bad = tmp_path / "ok.yaml", tmp_path / "bad.yaml"
    ok.write_text("version: 1\nparams:\n  kl_jump: 3.0\n")
    bad.write_text("version: 1\nparams:\n  kl_jump: 0\n")
    assert load_rules([pack, ok]).params[0].value == 3.0
    assert f"{bad}:3:3: params.kl_jump: 0 is outside what its pack allows (1.5 to inf" in _errors(pack, bad)
    cal = tmp_path / "cal.yaml"
    cal.write_text(pack.read_text().replace("min: 1.5", "min: 5, max: 1"))
    assert "min 5 is above max 1" in _errors(cal)


def test_a_rule_test_with_a_list_for_a_step_is_an_error_naming_the_line(tmp_path: Path) -> None:
    pack = _pack(tmp_path, "notify")
    t = tmp_path / "t.yaml"
    t.write_text(f"rule_files: [{pack}]\ntests:\n  - name: t\n    input_series: {{kl: '0.2 0.2'}}\n"
                 "    expect_state: [{step: [1], rule: r1, status: firing}]\n")
    [result] = run_rule_tests([t])
    assert not result.passed and any("expect_state[].step must be a whole number" in f for f in result.failures), \
        result.failures


def test_a_pack_version_of_true_or_1_0_is_not_version_1(tmp_path: Path) -> None:
    for version in ("true", "1.0"):
        p = _pack(tmp_path, "notify")
        p.write_text(p.read_text().replace("version: 1", f"version: {version}"))
        assert "unsupported version" in _errors(p)


def test_a_daemon_config_number_yaml_reads_as_text_says_how_to_write_it(tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("runs: [x]\ntick_s: 1e-3\n")
    with pytest.raises(DaemonConfigError, match=r"tick_s must be a finite number \(YAML 1\.1 reads 1e-3 as text"):
        load_daemon_config(cfg)


def test_a_webhook_url_in_a_config_others_can_read_is_said_without_the_url(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _daemon_config(tmp_path, [tmp_path / "run"], webhook_url="https://hooks.example/T0/secret-part")
    for mode, said in ((0o644, True), (0o600, False)):
        cfg.chmod(mode)
        caplog.clear()
        with caplog.at_level("WARNING"):
            load_daemon_config(cfg)
        assert ("holds webhook_url and can be read by other users (mode 644)" in caplog.text) is said
        assert "secret-part" not in caplog.text


def test_a_count_over_that_would_read_billions_of_values_a_step_is_refused_at_load(tmp_path: Path) -> None:
    slow = _pack(tmp_path, "notify")
    slow.write_text(slow.read_text().replace("expr: kl > 0.1",
                                             "expr: count_over(reward > slope(reward, 100000), 100000) > 3"))
    assert "10,000,000,000 values a step, more than 100,000" in _errors(slow)
    fine = _pack(tmp_path, "notify", "fine.yaml")
    fine.write_text(fine.read_text().replace("expr: kl > 0.1", "expr: count_over(kl > median(kl, 100), 1000) > 3"))
    assert len(load_rules([fine]).rules) == 1


@pytest.mark.parametrize(("value", "said"), [
    ("1:30", "1:30 is a base-60 number in YAML 1.1 (90)"),
    ("010", "010 is an octal number in YAML 1.1 (8)"),
    ("!!int abc", "bad scalar 'abc'"),
])
def test_a_number_yaml_1_1_misreads_or_cannot_build_is_one_error_naming_the_line(tmp_path: Path, value: str,
                                                                                  said: str) -> None:
    p = _pack(tmp_path, "notify")
    p.write_text(p.read_text().replace("    actions:", f"    for: {value}\n    actions:"))
    message = _errors(p)
    assert f"pack.yaml:6:10: {said}" in message, message
    assert "must be a whole number" not in message  # (not a second error about the None it became)
    fine = _pack(tmp_path, "notify", "fine.yaml", extra=" 1:30 010")  # decimal, and the same text in a string
    fine.write_text(fine.read_text().replace("    actions:", "    for: 10\n    actions:"))
    (rule,) = load_rules([fine]).rules
    assert rule.for_ == 10 and rule.description == "d 1:30 010"


def test_a_digit_of_another_script_in_an_expression_is_an_unexpected_character(tmp_path: Path) -> None:
    p = _pack(tmp_path, "notify")
    p.write_text(p.read_text().replace("kl > 0.1", "kl > \u0661"))  # ARABIC-INDIC DIGIT ONE
    assert "unexpected character '\u0661'" in _errors(p)


@pytest.mark.parametrize(("item", "said"), [("lr=nan", "lr must be a finite number"),
                                            ("actor_rollout_ref.actor.optim.lr=5", "optim.lr must be in (0, 1]")])
def test_replay_refuses_a_set_no_run_could_hold(tmp_path: Path, item: str, said: str) -> None:
    rundir.append_metrics(tmp_path, 1, {"actor/kl": 0.1})
    r = CliRunner().invoke(app, ["replay", str(tmp_path), "--set", item])
    assert r.exit_code == 2 and said in r.output, r.output


def test_a_relative_run_dir_found_only_beside_the_config_or_under_a_tilde_is_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    conf, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    (conf / "run1").mkdir(parents=True)
    elsewhere.mkdir()
    cfg = conf / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "runs": ["run1", "~/runs/r2"]}))
    monkeypatch.chdir(elsewhere)
    with caplog.at_level("WARNING"):
        load_daemon_config(cfg)
    assert f"runs[0] run1 is relative to the daemon's working directory {elsewhere}, where it does not exist; " \
           f"{conf / 'run1'} does" in caplog.text
    assert "runs[1] ~/runs/r2: a ~ is not expanded" in caplog.text
    monkeypatch.chdir(conf)  # run from the config's folder, as meant: nothing to say of run1
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_daemon_config(cfg)
    assert "runs[0]" not in caplog.text and "runs[1] ~/runs/r2" in caplog.text
