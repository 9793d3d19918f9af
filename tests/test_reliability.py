"""Reliability findings (issue 14): each failed on the main of its day; see RELIABILITY.md.

No silent loss of supervision, every bad input a clean error naming where, nothing that
loops forever, no secret passed on.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ppo_watchdog.backends.local import SECRET_ENV, LocalBackend, child_env
from ppo_watchdog.cli import app
from ppo_watchdog.control.actuator import Notifier, alert_payload, resolve_webhook_url
from ppo_watchdog.control.daemon import DaemonConfigError, build_watchdog, load_daemon_config, prepare_daemon
from ppo_watchdog.control.store import Phase, RunRecord, Store, StoreError
from ppo_watchdog.core import replay
from ppo_watchdog.core.rulefile import RuleFileError, load_rules
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import Command, Control, ControlApplier, write_control
from ppo_watchdog.sources import ingest

NAN_RULE = textwrap.dedent("""\
    version: 1
    rules:
      - name: nan
        description: a NaN anywhere
        expr: nonfinite()
        actions: [notify]
""")


def _rules(tmp_path: Path, text: str = NAN_RULE) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return path


def _steps(run: Path, values: list[float], start: int = 1) -> None:
    for i, v in enumerate(values, start=start):
        rundir.append_metrics(run, i, {"actor/reward_kl_penalty": v, "critic/score/mean": 0.5})


# -- 1. run identity ---------------------------------------------------------------------------


def test_two_run_directories_of_one_name_are_two_runs(tmp_path: Path) -> None:
    x, z = tmp_path / "x" / "exp", tmp_path / "z" / "exp"
    for d in (x, z):
        d.mkdir(parents=True)
    _steps(x, [0.01, 0.01])
    _steps(z, [0.01, float("nan")])
    rules = _rules(tmp_path)
    first = build_watchdog(tmp_path / "state", [rules])
    a = first.add_run(x, managed=False)
    first.tick()
    second = build_watchdog(tmp_path / "state", [rules])  # `watchdog run --run-dir z/exp`, same state
    b = second.add_run(z, managed=False)
    second.tick()
    assert a.run.run_id == "exp" and b.run.run_id.startswith("exp-") and b.run.run_dir == str(z.resolve())
    assert [d["rule"] for d in second.store.decisions(b.run.run_id)] == ["nan"]  # z's NaN is seen
    assert second.store.decisions("exp") == []  # and x stays x's
    # The same directory again is the same run, whatever the process.
    third = build_watchdog(tmp_path / "state", [rules])
    assert third.add_run(z, managed=False).run.run_id == b.run.run_id


def test_a_daemon_config_with_two_directories_of_one_name_watches_both(tmp_path: Path) -> None:
    for d in ("a/exp", "b/exp"):
        (tmp_path / d).mkdir(parents=True)
    cfg_file = tmp_path / "daemon.yaml"
    cfg_file.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(_rules(tmp_path))],
                                        "runs": [str(tmp_path / "a/exp"), str(tmp_path / "b/exp")]}))
    wd = prepare_daemon(load_daemon_config(cfg_file))
    assert sorted(c.run.run_dir for c in wd.controllers.values()) == [str(tmp_path / "a/exp"), str(tmp_path / "b/exp")]


def test_a_v3_state_is_migrated_to_one_run_per_directory(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.upsert_run(RunRecord("exp", "/runs/exp"))
    store._db.execute("DROP INDEX runs_dir")
    store._db.execute("INSERT INTO runs (run_id, run_dir, created, updated) VALUES ('exp2', '/runs/exp', 1, 1)")
    store._db.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    store.close()
    with pytest.raises(StoreError, match="/runs/exp: exp, exp2|/runs/exp: exp2, exp"):
        Store(tmp_path)
    db = sqlite3.connect(tmp_path / "watchdog.db")
    db.execute("DELETE FROM runs WHERE run_id='exp2'")
    db.commit()
    db.close()
    assert Store(tmp_path).run_for_dir("/runs/exp").run_id == "exp"


# -- 2. a tick is all or nothing ----------------------------------------------------------------


def test_a_tick_that_cannot_commit_keeps_nothing_and_the_next_one_decides(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    wd.store.busy_timeout_s = 0.2
    wd.store._db.execute("PRAGMA busy_timeout=200")
    ctl = wd.add_run(run, managed=False)
    _steps(run, [0.01, float("nan"), float("nan")])
    locker = sqlite3.connect(wd.store.path, timeout=0)
    locker.execute("BEGIN IMMEDIATE")  # another process holds the write lock past the timeout
    wd.tick()
    assert wd.store.decisions(ctl.run.run_id) == []
    locker.rollback()
    locker.close()
    wd.tick()
    decisions = wd.store.decisions(ctl.run.run_id)
    assert [d["step"] for d in decisions] == [2], decisions  # read again, decided once


def test_a_bad_event_line_is_skipped_and_the_nan_beside_it_still_decided(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    ctl = wd.add_run(run, managed=False)
    with open(run / rundir.EVENTS, "a") as f:
        f.write(json.dumps({"ts": 1.0, "step": 1, "kind": "applied", "version": "abc"}) + "\n")
    _steps(run, [0.01, float("nan")])
    wd.tick()
    assert [d["step"] for d in wd.store.decisions(ctl.run.run_id)] == [2]
    assert any("'version'" in i and "events.jsonl:1" in i for i in ctl.tailer.issues), ctl.tailer.issues


# -- 3. values checked at every boundary -------------------------------------------------------


@pytest.mark.parametrize(("action", "message"), [
    ("{set: {key: algorithm.kl_ctrl.kl_coef, to: .nan}}", "must be a finite number"),
    ("{set: {key: algorithm.kl_ctrl.kl_coef, scale: .inf}}", "must be a finite number"),
    ("{set: {key: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, to: -5}}", "whole number from 1 to"),
    ("{set: {key: actor_rollout_ref.actor.clip_ratio, to: -1}}", "must be in (0, 1]"),
    ("{set: {key: actor_rollout_ref.actor.entropy_coeff, add: 0.1, max: .inf}}", "must be a finite number"),
    ("{rollback: {skip_batches: 100000000000}}", "<= 10,000,000"),
])
def test_a_rule_file_value_no_trainer_can_take_is_refused_at_check(tmp_path: Path, action: str, message: str) -> None:
    path = _rules(tmp_path, NAN_RULE.replace("actions: [notify]", f"actions: [{action}]"))
    with pytest.raises(RuleFileError) as err:
        load_rules(path)
    (first,) = err.value.errors
    assert message in first.message and first.line == 6, str(first)


def test_for_past_any_run_is_refused(tmp_path: Path) -> None:
    path = _rules(tmp_path, NAN_RULE.replace("actions: [notify]", "for: 1000000000000\n    actions: [notify]"))
    with pytest.raises(RuleFileError, match="for must be a whole number <= 10,000,000"):
        load_rules(path)


def test_the_trainer_refuses_a_nan_or_negative_override_and_keeps_the_previous_value(tmp_path: Path) -> None:
    from ppo_watchdog.trainer.config import ConfigError, load_config

    cfg = load_config([f"trainer.run_dir={tmp_path}"])
    for key, bad in (("algorithm.kl_ctrl.kl_coef", float("nan")), ("actor_rollout_ref.actor.clip_ratio", -1.0),
                     ("actor_rollout_ref.actor.entropy_coeff", float("inf"))):
        before = cfg.get(key)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            cfg.set(key, bad)
        assert cfg.get(key) == before
    # On the wire, a NaN never parses as a control version: the whole version is an error event.
    (tmp_path / rundir.CONTROL).write_text('{"version": 3, "overrides": {"algorithm.kl_ctrl.kl_coef": NaN}}')
    applier = ControlApplier(tmp_path)
    assert applier.poll(1) is None
    (err,) = rundir.iter_events(tmp_path, ["error"])
    assert "must be a finite number" in err["message"]


# -- 4. a control version above the watchdog's ------------------------------------------------


def test_a_control_version_the_watchdog_never_wrote_does_not_wedge_live_control(tmp_path: Path) -> None:
    from ppo_watchdog.control.actuator import Actuator, RunHandle

    run = tmp_path / "run"
    run.mkdir()
    # (One within MAX_VERSION_STEP of the last applied: the trainer refuses one further up, and the watchdog
    # writes over it: tests/test_reliability_v3.py.)
    write_control(run, Control(10**6, {"algorithm.kl_ctrl.kl_coef": 0.5}))
    applier = ControlApplier(run)  # the trainer applied it
    changes = applier.poll(1)
    applier.mark_applied(changes, 1, dict(changes.overrides))
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("run", str(run)))
    act = Actuator(store, LocalBackend())
    h = RunHandle(store.require_run("run"))
    version = act.reserve_version(h, None, {"algorithm.kl_ctrl.kl_coef": 0.2})
    assert version == 10**6 + 1 and act.write_control(h, version)
    assert applier.poll(2).overrides == {"algorithm.kl_ctrl.kl_coef": 0.2}  # the trainer takes it
    # Past what JSON and SQLite hold: refused on read, not stored.
    (run / rundir.CONTROL).write_text(json.dumps({"version": 10**30}))
    assert applier.poll(3) is None
    assert "'version' must be an integer from 0 to" in rundir.iter_events(run, ["error"])[-1]["message"]


# -- 5. clean errors, no endless loops --------------------------------------------------------


def test_a_deeply_chained_expression_is_an_error_naming_the_rule(tmp_path: Path) -> None:
    chain = " + ".join(["kl"] * 500)
    path = _rules(tmp_path, NAN_RULE.replace("expr: nonfinite()", f'expr: "{chain} > 1"'))
    with pytest.raises(RuleFileError) as err:
        load_rules(path)
    (first,) = err.value.errors
    assert "nested 501 levels deep" in first.message and first.line == 5


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--rules", "typo.yaml", "--", "true"], "typo.yaml"),
    (["run", "--run-dir", "/proc/1/nope", "--", "true"], "--run-dir /proc/1/nope: cannot be written"),
    (["run", "--tick", "nan", "--", "true"], "--tick must be a positive number"),
    (["run", "--tick", "-1", "--", "true"], "--tick must be a positive number"),
    (["run", "--heartbeat-min", "nan", "--", "true"], "heartbeat_min_s must be a finite number"),
])
def test_bad_run_options_exit_2_naming_the_option(tmp_path: Path, args: list[str], message: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, [*args[:1], "--state-dir", str(tmp_path / "state"), *args[1:]])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_a_state_dir_that_is_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("not a directory")
    r = CliRunner().invoke(app, ["run", "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "r"),
                                 "--", "true"])
    assert r.exit_code == 2 and "not a directory" in r.output, r.output


def test_a_corrupt_or_locked_state_is_said_not_a_traceback(tmp_path: Path) -> None:
    store = Store(tmp_path / "locked")
    store.upsert_run(RunRecord("r", str(tmp_path / "r")))
    store.close()
    locker = sqlite3.connect(tmp_path / "locked" / "watchdog.db", timeout=0)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        # Looking reads what was last committed (read-only, WAL): a writer at work does not block it.
        r = CliRunner().invoke(app, ["status", "--json", "--state-dir", str(tmp_path / "locked")])
        assert r.exit_code == 0 and json.loads(r.output)[0]["run"] == "r", r.output
        r = CliRunner().invoke(app, ["resume", "r", "--state-dir", str(tmp_path / "locked")])
    finally:
        locker.rollback()
    assert r.exit_code == 2 and "locked by another process" in r.output, r.output
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "watchdog.db").write_bytes(b"this is not sqlite" * 100)
    r = CliRunner().invoke(app, ["history", "--state-dir", str(tmp_path / "corrupt")])
    assert r.exit_code == 2 and "not a usable watchdog state database" in r.output, r.output


@pytest.mark.parametrize(("doc", "message"), [
    ({"tick_s": float("nan")}, "tick_s must be a finite number"),
    ({"metrics_port": 99999}, "metrics_port must be 0 (any free port) .. 65535"),
    ({"runs": 5}, "runs must be a list"),
    ({"runs": [{"run_dir": "/r", "restart_command": "python -m ppo_watchdog.trainer"}]}, "runs[0].restart_command must be a list"),
    ({"controller": {"restart_budget": "3"}}, "controller.restart_budget must be an integer"),
    ({"actuator": {"stop_grace_s": -1}}, "stop_grace_s must be > 0"),
])
def test_a_bad_daemon_config_names_the_key(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(DaemonConfigError) as err:
        load_daemon_config(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_a_trainer_command_that_cannot_run_is_given_up_at_once(tmp_path: Path) -> None:
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    ctl = wd.add_run(tmp_path / "run", command=["/nonexistent/trainer", "a=1"])
    assert ctl.tick().done
    assert ctl.run.phase == Phase.FAILED
    (d,) = wd.store.decisions(ctl.run.run_id)
    assert d["rule"] == "watchdog:budget" and "No such file" in d["message"]


def test_a_checkpoint_missing_a_part_is_skipped_for_the_one_before(tmp_path: Path, tiny_trainer_args,
                                                                    trainer_env) -> None:
    run = tmp_path / "run"
    out = subprocess.run(tiny_trainer_args(run, "trainer.save_freq=1", steps=2), env=trainer_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    newest = run / rundir.CHECKPOINTS / "global_step_2" / "manifest.json"
    doc = json.loads(newest.read_text())
    doc["files"] = {k: v for k, v in doc["files"].items() if not k.startswith("actor/")}
    newest.write_text(json.dumps(doc))
    out = subprocess.run(tiny_trainer_args(run, "trainer.save_freq=1", steps=3), env=trainer_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    started = rundir.iter_events(run, ["started"])[-1]
    assert started["resumed_from"] == 1  # global_step_2 lacks actor/: the one before it
    assert any("lacks actor/model" in e["message"] for e in rundir.iter_events(run, ["error"]))


def test_a_rollback_to_a_missing_step_is_not_confirmed(tmp_path: Path, tiny_trainer_args, trainer_env) -> None:
    run = tmp_path / "run"
    write_control(run, Control(1, {}, (Command("c1", "rollback", {"to_step": 77}),)))
    out = subprocess.run(tiny_trainer_args(run, steps=2), env=trainer_env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (applied,) = rundir.iter_events(run, ["applied"])
    assert applied["commands"] == []  # the rollback it could not do is not reported as done
    (err,) = [e for e in rundir.iter_events(run, ["error"]) if e.get("command") == "c1"]
    assert "global_step_77" in err["message"] and not rundir.iter_events(run, ["rollback"])


def test_a_corrupt_resume_path_and_a_read_only_run_dir_exit_2_saying_why(tmp_path: Path, trainer_env) -> None:
    bad = tmp_path / "ckpt" / "global_step_3"
    bad.mkdir(parents=True)
    (bad / "manifest.json").write_text("{not json")
    args = [sys.executable, "-m", "ppo_watchdog.trainer", f"trainer.run_dir={tmp_path / 'run'}", "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={bad}"]
    out = subprocess.run(args, env=trainer_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "trainer.resume_from_path" in out.stderr and "not JSON" in out.stderr
    assert "Traceback" not in out.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        out = subprocess.run([sys.executable, "-m", "ppo_watchdog.trainer", f"trainer.run_dir={ro}"], env=trainer_env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "cannot be written" in out.stderr
    finally:
        ro.chmod(0o700)


# -- 6. replay loses nothing silently ----------------------------------------------------------


def test_a_negative_step_is_refused_not_read_as_a_rewind(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    lines = [{"step": s, "data": {"actor/reward_kl_penalty": v}} for s, v in
             ((4, 0.01), (5, float("nan")), (6, 0.01), (7, float("nan")))]
    lines.insert(2, {"step": -5, "data": {"actor/reward_kl_penalty": 0.0}})
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    res = ingest.read_run(log)
    assert [r["step"] for r in res.records] == [4, 5, 6, 7]
    assert any("'step' must be >= 0" in i.message and i.line == 3 for i in res.issues), res.issues
    out = replay.replay(res.records, load_rules(_rules(tmp_path)))
    assert [d.step for d in out.decisions if d.kind == "fire"] == [5, 7]


def test_console_values_printed_as_torch_tensors_are_read(tmp_path: Path) -> None:
    step, data, problems = ingest.parse_console_line(
        "step:3 - actor/reward_kl_penalty:tensor(0.5, device='cuda:0') - critic/vf_loss:np.float64(0.25)")
    assert (step, data, problems) == (3, {"actor/reward_kl_penalty": 0.5, "critic/vf_loss": 0.25}, [])


# -- 7. secrets ----------------------------------------------------------------------------------


def test_a_failing_webhook_never_logs_its_url(caplog: pytest.LogCaptureFixture) -> None:
    url = "http://127.0.0.1:9/hooks/T000/SECRET-TOKEN"
    outcome = Notifier(url, timeout_s=1).notify(alert_payload("r", "rule", "critical", "s", "d"))
    assert outcome.startswith("webhook failed") and "SECRET-TOKEN" not in caplog.text + outcome


def test_the_webhook_url_comes_from_a_file_or_the_environment_never_argv(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hook = tmp_path / "hook"
    hook.write_text("\nhttps://hooks.example/abc\n")
    assert resolve_webhook_url(hook) == "https://hooks.example/abc"
    monkeypatch.setenv("WATCHDOG_WEBHOOK_URL", "https://env.example/x")
    assert resolve_webhook_url() == "https://env.example/x"
    helptext = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert "--webhook-url-file" in helptext and "--webhook-url " not in helptext


def test_a_trainer_does_not_inherit_the_watchdogs_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECRET_ENV:
        monkeypatch.setenv(name, "s3cret")
    monkeypatch.setenv("HF_TOKEN", "the-trainers-own")
    assert not SECRET_ENV & set(child_env())
    out = tmp_path / "env.json"
    code = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    proc = LocalBackend().start([sys.executable, "-c", code])
    assert proc._popen is not None and proc._popen.wait(timeout=60) == 0  # its exit: the file is written
    env = json.loads(out.read_text())
    assert not SECRET_ENV & set(env) and env["HF_TOKEN"] == "the-trainers-own"


# -- 8. Ctrl-C and looking ---------------------------------------------------------------------


def test_status_on_a_new_state_dir_creates_nothing(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path / "new")])
    assert r.exit_code == 2 and "no watchdog state there" in r.output  # bad input, as `history` says it
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_ctrl_c_stops_the_trainer_and_records_the_run_as_stopped(tmp_path: Path, trainer_env) -> None:
    import signal
    import threading
    import time

    run, state = tmp_path / "run", tmp_path / "state"
    trainer = textwrap.dedent("""\
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a trainer that ignores SIGTERM
        print("ready", flush=True)
        time.sleep(600)
    """)
    (tmp_path / "stubborn.py").write_text(trainer)
    proc = subprocess.Popen([sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run), "--state-dir", str(state),
                             "--stop-grace", "60", "--no-report", "--", sys.executable, str(tmp_path / "stubborn.py")],
                            env=trainer_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = run / "trainer.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and "ready" in log.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the trainer did not start"
        time.sleep(0.1)
    pid = Store(state).require_run("run").pid
    lines: list[str] = []
    stopping = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "interrupted: stopping the trainer" in line:
                stopping.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.send_signal(signal.SIGINT)
    assert stopping.wait(60), "".join(lines)  # stopping: SIGTERM sent, ignored, 60 s of grace begun
    proc.send_signal(signal.SIGINT)  # a second Ctrl-C kills it at once
    proc.wait(timeout=30)
    reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 130, out
    assert "interrupted again: killing the trainer" in out
    assert Store(state).require_run("run").phase == Phase.STOPPED
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
