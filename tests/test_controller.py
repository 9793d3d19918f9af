"""The controller: pure planning and timing rules, then whole ticks against real small processes.

The tick tests use a minimal trainer that speaks the run-directory protocol through the
real ``ppo_watchdog.protocol.control.ControlApplier`` (metrics, events, control.json, exit codes) and
starts in a fraction of a second, so budgets, escalation, pause/resume and the live-apply
timeout are tested on real processes without PPO's start-up cost.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from ppo_watchdog.backends.dialect import classify_exit
from ppo_watchdog.backends.local import LocalBackend
from ppo_watchdog.control.actuator import (
    Actuator,
    ActuatorConfig,
    RunHandle,
    alert_payload,
    choose_known_good,
    launch_command,
    restart_command,
)
from ppo_watchdog.control.controller import (
    ControllerConfig,
    TickResult,
    heartbeat_timeout,
    span_start,
)
from ppo_watchdog.control.daemon import DaemonConfigError, build_watchdog, load_daemon_config
from ppo_watchdog.control.store import BadSpan, RunRecord, Store
from ppo_watchdog.core.actions import RollbackAction, SetAction
from ppo_watchdog.core.engine import Decision
from ppo_watchdog.core.pricing import DEFAULT_STARTUP_S
from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol.control import read_control
from ppo_watchdog.protocol.runinfo import RunInfo

KL = "algorithm.kl_ctrl.kl_coef"
LR = "actor_rollout_ref.actor.optim.lr"
LIVE = catalog.LIVE_KEYS


# -- pure core ----------------------------------------------------------------------------


def test_heartbeat_is_ten_median_step_times_with_a_floor():
    cfg = ControllerConfig(heartbeat_min_s=30, heartbeat_factor=10)
    assert heartbeat_timeout([], cfg) == 30
    assert heartbeat_timeout([0.1, 0.2, 100.0], cfg) == 30  # one slow step does not stretch it
    assert heartbeat_timeout([5.0, 6.0, 7.0, float("nan")], cfg) == 60


def test_exit_is_classified_from_the_code_or_for_an_adopted_process_from_its_events():
    assert classify_exit(75, False, False) == "oom"
    assert classify_exit(0, True, False) == "finished"
    assert classify_exit(-9, False, False) == "crash"
    assert classify_exit(None, False, True) == "oom"
    assert classify_exit(None, True, False) == "finished"
    assert classify_exit(None, False, False) == "crash"


def test_divergence_span_starts_at_the_checkpoint_that_produced_the_first_bad_step():
    assert span_start(fire_step=31, for_steps=1, margin=1) == 30
    assert span_start(fire_step=31, for_steps=3, margin=1) == 28
    assert span_start(fire_step=31, for_steps=0, margin=0) == 31


def test_known_good_skips_checkpoints_taken_while_diverging_but_not_their_retrained_copies():
    ck = [SimpleNamespace(step=s, complete=c, ts=t) for s, c, t in
          [(5, True, 50.0), (10, True, 100.0), (15, True, 150.0), (20, False, 200.0)]]
    span = BadSpan("nan", 10, 16, 140.0, 170.0)
    assert choose_known_good(ck, [span]).step == 5
    retrained = ck + [SimpleNamespace(step=15, complete=True, ts=300.0)]
    assert choose_known_good(retrained, [span]).ts == 300.0
    assert choose_known_good(ck, [BadSpan("nan", 0, None, 0.0, None)]) is None


def test_restart_command_replaces_overrides_and_adds_the_resume_arguments():
    base = ["python", "-m", "ppo_watchdog.trainer", "trainer.run_dir=/r", f"{KL}=0.001", "trainer.resume_mode=auto"]
    cmd = restart_command(base, {KL: 0.0012, LR: 1e-06}, "/r/checkpoints/global_step_10")
    assert cmd == ["python", "-m", "ppo_watchdog.trainer", "trainer.run_dir=/r", f"{LR}=1e-06", f"{KL}=0.0012",
                   "trainer.resume_mode=resume_path", "trainer.resume_from_path=/r/checkpoints/global_step_10"]


def test_a_script_whose_run_json_asks_for_env_is_relaunched_as_it_is_with_its_arguments_in_the_environment(
        tmp_path: Path) -> None:
    from ppo_watchdog.protocol import rundir
    from ppo_watchdog.protocol.runinfo import RunInfo

    resume = str(tmp_path / "checkpoints" / "global_step_6")
    cmd, env = launch_command(tmp_path, ["python", "my_grpo.py"], {LR: 5e-05}, resume, once=["trainer.resume_skip_batches=1"])
    assert cmd == ["python", "my_grpo.py", f"{LR}=5e-05", "trainer.resume_mode=resume_path",
                   f"trainer.resume_from_path={resume}", "trainer.resume_skip_batches=1"]  # argv: no run.json says otherwise
    assert env == {rundir.RUN_DIR_ENV: str(tmp_path.resolve())}
    RunInfo(command=["python", "my_grpo.py"], launch_args="env").write(tmp_path)
    cmd, env = launch_command(tmp_path, ["python", "my_grpo.py"], {LR: 5e-05}, resume, once=["trainer.resume_skip_batches=1"])
    assert cmd == ["python", "my_grpo.py"]
    assert rundir.launch_args(env) == [f"{LR}=5e-05", "trainer.resume_mode=resume_path",
                                       f"trainer.resume_from_path={resume}", "trainer.resume_skip_batches=1"]
    assert env[rundir.RUN_DIR_ENV] == str(tmp_path.resolve())
    with pytest.raises(ValueError, match=rundir.LAUNCH_ARGS_ENV):
        rundir.launch_args({rundir.LAUNCH_ARGS_ENV: '{"lr": 1}'})


def test_alert_payload_has_alertmanagers_webhook_shape():
    p = alert_payload("run1", "kl_far", "critical", "paused", "KL 0.9", now=0.0)
    assert p["version"] == "4" and p["status"] == "firing" and len(p["alerts"]) == 1
    a = p["alerts"][0]
    assert a["labels"] == {"alertname": "PPOWatchdogEscalation", "run": "run1", "rule": "kl_far",
                           "severity": "critical"}
    assert a["startsAt"] == "1970-01-01T00:00:00Z" and a["annotations"]["summary"] == "paused"


def test_daemon_config_rejects_unknown_keys_naming_the_file(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("runs: [/tmp/x]\ncontroller: {restart_budgett: 2}\n")
    with pytest.raises(DaemonConfigError, match=r"d.yaml: unknown key controller.restart_budgett"):
        load_daemon_config(f)
    f.write_text("runs: [{run_dir: /tmp/x, restart_command: [python, t.py]}]\ntick_s: 2\n")
    cfg = load_daemon_config(f)
    assert cfg.runs[0].restart_command == ["python", "t.py"] and cfg.tick_s == 2


# -- whole ticks against a real process ---------------------------------------------------

FAKE_TRAINER = textwrap.dedent('''
    """A protocol-speaking stand-in for the trainer: real metrics, events, control.json, exits."""
    import signal, sys, time
    from ppo_watchdog.protocol import catalog, rundir
    from ppo_watchdog.protocol.control import ControlApplier
    from ppo_watchdog.protocol.runinfo import RunInfo

    args = dict(a.split("=", 1) for a in sys.argv[1:])
    run_dir = args["trainer.run_dir"]
    steps, crash_at = int(args.get("steps", 10)), int(args.get("crash_at", 0))
    ignore = args.get("ignore_control") == "1"
    kl_coef = float(args.get("algorithm.kl_ctrl.kl_coef", 0.01))
    ctl = ControlApplier(run_dir)
    adaptive = {"algorithm": {"kl_ctrl": {"type": "adaptive"}}} if args.get("adaptive_kl") == "1" else {}
    RunInfo(live_keys=list(catalog.LIVE_KEYS), config=adaptive).write(run_dir)
    if ignore:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    else:
        ctl.install_signal_handler()
    start = int(args.get("trainer.resume_from_path", "x_0").rsplit("_", 1)[1] or 0)
    rundir.append_event(run_dir, "started", start, argv=sys.argv[1:])
    paused = False
    step = start
    while step < steps:
        changes = None if ignore else ctl.poll(step)
        if changes is not None:
            kl_coef = float(changes.overrides.get("algorithm.kl_ctrl.kl_coef", kl_coef))
            for c in changes.commands:
                if c.kind == "pause":
                    paused = True
                    rundir.append_event(run_dir, "paused", step)
                elif c.kind == "resume":
                    paused = False
                    rundir.append_event(run_dir, "resumed", step)
            ctl.mark_applied(changes, step, dict(changes.overrides))
        if paused:
            time.sleep(0.05)
            continue
        step += 1
        if step == crash_at:
            sys.exit(3)
        rundir.append_metrics(run_dir, step, {"actor/reward_kl_penalty": 0.5, "perf/time_per_step": 0.05,
                                              "actor/reward_kl_penalty_coeff": kl_coef})
        time.sleep(0.05)
    rundir.append_event(run_dir, "finished", step)
''')


def _setup(tmp_path: Path, rule_yaml: str, **kw):
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n" + textwrap.dedent(rule_yaml))
    wd = build_watchdog(tmp_path / "state", [rules], **kw)
    return wd


def _drive(wd, until, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wd.tick()
        if until():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


KL_DOUBLE_RULE = """
  - name: kl_high
    description: raise kl_coef
    expr: kl > 0.1
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 2.0, max: 1.0}
    cooldown: 1000
"""
QUIET_RULE = """
  - name: kl_absurd
    description: never fires
    expr: kl > 1000
    actions: [checkpoint]
"""


def test_crashing_trainer_is_restarted_within_the_budget_then_handed_to_a_human(tmp_path, webhook):
    url, received = webhook
    wd = _setup(tmp_path, QUIET_RULE, webhook_url=url, controller={"restart_budget": 2})
    run_dir = tmp_path / "run"
    ctl = wd.add_run(run_dir, command=[sys.executable, str(tmp_path / "fake_trainer.py"),
                                       f"trainer.run_dir={run_dir}", "crash_at=3", "steps=10"])
    _drive(wd, lambda: ctl.run.phase == "failed")
    assert len(rundir.iter_events(run_dir, ["started"])) == 3  # first launch + 2 restarts
    rules = [d["rule"] for d in wd.store.decisions("run")]
    assert rules == ["watchdog:crash", "watchdog:crash", "watchdog:budget"]
    # Each restart said in words as it is done (mode "done"), then the escalation.
    done = [p for p in received if p["body"]["alerts"][0]["labels"].get("mode") == "done"]
    assert len(done) == 2 and all("relaunched from" in p["body"]["alerts"][0]["annotations"]["summary"] for p in done)
    (post,) = [p for p in received if p not in done]
    alert = post["body"]["alerts"][0]
    assert post["ctype"] == "application/json" and alert["labels"]["rule"] == "watchdog:crash"
    assert "restart budget (2) exhausted" in alert["annotations"]["description"]


def test_the_planned_relaunch_gauge_holds_from_the_restart_to_the_new_trainers_first_step(tmp_path):
    wd = _setup(tmp_path, QUIET_RULE, controller={"restart_budget": 1})
    run_dir = tmp_path / "run"
    ctl = wd.add_run(run_dir, command=[sys.executable, str(tmp_path / "fake_trainer.py"),
                                       f"trainer.run_dir={run_dir}", "crash_at=3", "steps=10"])
    seen = []  # (the gauge, the restarts carried out, the newest step) after each tick

    def tick_and_look():
        seen.append((wd.telemetry.registry.get_sample_value("watchdog_planned_relaunch", {"run": "run"}),
                     sum(j.kind == "restart" and j.status == "done" for j in wd.store.journal("run")),
                     ctl.run.last_step))
        return ctl.run.phase == "failed"

    _drive(wd, tick_and_look)
    assert seen[0][0] is None  # the first launch is no relaunch: nothing said
    relaunching = [i for i, s in enumerate(seen) if s[0] == 1.0]
    assert relaunching and all(seen[i][1] == 1 for i in relaunching), seen
    assert relaunching == list(range(relaunching[0], relaunching[-1] + 1)), seen  # one stretch
    after = seen[relaunching[-1] + 1:]
    assert after and all(g == 0.0 for g, _, _ in after), seen  # the new trainer's first step, then the run ended


def test_unconfirmed_live_change_falls_back_to_a_restart_with_the_override(tmp_path):
    wd = _setup(tmp_path, KL_DOUBLE_RULE, actuator={"live_timeout_s": 0.5, "stop_grace_s": 2})
    run_dir = tmp_path / "run"
    ctl = wd.add_run(run_dir, command=[sys.executable, str(tmp_path / "fake_trainer.py"),
                                       f"trainer.run_dir={run_dir}", "ignore_control=1", "steps=60"])
    _drive(wd, lambda: len(rundir.iter_events(run_dir, ["started"])) == 2)
    second = rundir.iter_events(run_dir, ["started"])[1]
    assert f"{KL}=0.02" in second["argv"]  # 0.01 x 2, now a Hydra override of the relaunch
    decisions = wd.store.decisions("run")
    (d,) = [d for d in decisions if d["rule"] != "watchdog:live_timeout"]
    assert d["status"] == "applied" and "timed out: applied by restart" in d["outcome"]
    # The fallback restart is the watchdog's own decision, counted against the restart budget.
    (timeout,) = [d for d in decisions if d["rule"] == "watchdog:live_timeout"]
    assert "not applied within 0.5 s" in timeout["message"] and wd.store.require_run("run").restarts >= 1
    wd.actuator.stop(ctl.h)


def test_a_tuning_set_of_kl_coef_under_an_adaptive_controller_is_skipped_with_the_reason_in_its_outcome(tmp_path):
    # Found on real verl (bench/verl_e2e.py's adaptive-KL run): the decision read "skipped, no action".
    wd = _setup(tmp_path, KL_DOUBLE_RULE)
    run_dir = tmp_path / "run"
    ctl = wd.add_run(run_dir, command=[sys.executable, str(tmp_path / "fake_trainer.py"),
                                       f"trainer.run_dir={run_dir}", "adaptive_kl=1", "steps=5"])
    _drive(wd, lambda: any(d["rule"] == "kl_high" for d in wd.store.decisions("run")))
    (d,) = [d for d in wd.store.decisions("run") if d["rule"] == "kl_high"]
    assert d["status"] == "skipped" and "adaptive KL controller" in d["outcome"], d
    wd.actuator.stop(ctl.h)


def test_pause_rule_pauses_alerts_and_waits_for_watchdog_resume(tmp_path, webhook):
    url, received = webhook
    wd = _setup(tmp_path, """
      - name: kl_stuck
        description: a human must look
        expr: kl > 0.1
        actions:
          - pause: {reason: KL stuck high}
        cooldown: 1000
    """, webhook_url=url)
    run_dir = tmp_path / "run"
    ctl = wd.add_run(run_dir, command=[sys.executable, str(tmp_path / "fake_trainer.py"),
                                       f"trainer.run_dir={run_dir}", "steps=8"])
    _drive(wd, lambda: rundir.iter_events(run_dir, ["paused"]) and not wd.store.open_actions("run"))
    assert ctl.run.phase == "paused" and received[0]["body"]["alerts"][0]["labels"]["rule"] == "kl_stuck"
    time.sleep(0.5)
    wd.tick()
    assert not rundir.iter_events(run_dir, ["finished"]) and ctl.run.phase == "paused"  # no hang restart
    from ppo_watchdog.cli.run import run_app

    out = CliRunner().invoke(run_app, ["resume", "run", "--state-dir", str(tmp_path / "state")])
    assert out.exit_code == 0, out.output
    _drive(wd, lambda: ctl.run.phase == "finished")
    assert rundir.iter_events(run_dir, ["resumed"])
    assert [j.status for j in wd.store.journal("run")] == ["done", "done", "done"]


def test_daemon_watches_a_run_it_did_not_start_and_serves_its_own_metrics(tmp_path):
    import urllib.request

    from ppo_watchdog.control.daemon import prepare_daemon

    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    (tmp_path / "rules.yaml").write_text("version: 1\nrules:\n" + textwrap.dedent(KL_DOUBLE_RULE))
    run_dir = tmp_path / "ext"
    run_dir.mkdir()
    import subprocess

    trainer = subprocess.Popen([sys.executable, str(tmp_path / "fake_trainer.py"), f"trainer.run_dir={run_dir}",
                                "steps=40"])
    cfg_file = tmp_path / "daemon.yaml"
    cfg_file.write_text(f"runs: [{run_dir}]\nrules: [{tmp_path / 'rules.yaml'}]\n"
                        f"state_dir: {tmp_path / 'state'}\nmetrics_port: 0\ntick_s: 0.2\n")
    wd = prepare_daemon(load_daemon_config(cfg_file))
    try:
        _drive(wd, lambda: any(e.get("version") == 1 for e in rundir.iter_events(run_dir, ["applied"])))
        wd.tick()
        (d,) = wd.store.decisions("ext")
        assert d["status"] == "applied" and wd.store.require_run("ext").phase == "detached"
        port = wd.telemetry.port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "watchdog_runs_watched 1.0" in text
        assert 'watchdog_actions_total{kind="live_set",outcome="ok",rule="kl_high",run="ext"} 1.0' in text
    finally:
        trainer.wait(30)
        wd.telemetry.close()


def test_the_daemon_takes_its_rules_from_WATCHDOG_RULES_when_none_are_given(tmp_path, monkeypatch):
    pack = tmp_path / "mine.yaml"
    pack.write_text(textwrap.dedent("""\
        version: 1
        rules:
          - name: only_mine
            description: KL far out
            expr: kl > 0.5
            actions: [notify]
    """))
    monkeypatch.setenv("WATCHDOG_RULES", str(pack))
    wd = build_watchdog(tmp_path / "state")
    assert [r.name for r in wd.rules.ruleset.rules] == ["only_mine"]


def _actuator_rig(tmp_path: Path, run: Path, command: list[str], **config) -> tuple[Store, Actuator, RunHandle]:
    """A store with one run ("run") of ``command``, a real local actuator and the run's handle."""
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("run", str(run), command))
    return store, Actuator(store, LocalBackend(), config=ActuatorConfig(**config)), RunHandle(store.require_run("run"))


def _wait_for_log(path: Path, done, timeout: float = 10.0) -> str:
    """The log's text once ``done(text)`` holds (or at the timeout, for the assertions to report)."""
    deadline = time.time() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if done(text) or time.time() > deadline:
            return text
        time.sleep(0.05)


@pytest.mark.parametrize("commands, in_process", [(None, True), (["checkpoint", "pause", "resume", "stop"], False)])
def test_rollback_goes_in_process_only_to_a_trainer_whose_run_json_offers_it(tmp_path, commands, in_process):
    import torch

    from ppo_watchdog.protocol import checkpoint as ckpt

    run = tmp_path / "run"
    ckpt.save_checkpoint(run / rundir.CHECKPOINTS, 4, 0, {"actor": {"w": torch.zeros(2)}})
    info = {"id": "run", "live_keys": list(catalog.LIVE_KEYS)}
    if commands is not None:
        info["commands"] = commands
    RunInfo.from_json(info).write(run)
    store, act, h = _actuator_rig(tmp_path, run, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        act.launch(h, None, time.time())
        rb = store.add_action("run", "rollback", {"rule": "kl_far_above", "set": {LR: 5e-4}})
        t0 = time.time()
        act.drive(h, store.get_action(rb), t0)
        control = read_control(run)
        sent = [c.kind for c in control.commands] if control else []
        restarts = [e for e in store.open_actions("run") if e.kind == "restart"]
        if in_process:
            assert sent == ["rollback"] and not restarts and store.get_action(rb).status == "sent"
            # The sets go with the restore (a restored optimizer brings its old lr back for the first step
            # otherwise), and a restore may take as long as the relaunch it replaces.
            assert control.commands[0].args["set"] == {LR: 5e-4}
            assert store.get_action(rb).deadline >= t0 + act.config.live_timeout_s + DEFAULT_STARTUP_S
        else:
            # No 60 s wait for a confirmation that cannot come: the restart is planned at once.
            assert sent == [] and store.get_action(rb).status == "done"
            assert restarts and restarts[0].payload["resume_step"] == 4
    finally:
        act.stop(h)


def test_a_rollback_the_trainer_refuses_in_process_goes_by_restart_at_once_saying_why(tmp_path):
    """The verl glue applies the version and leaves a rollback it cannot restore (LoRA, the last step, ...)
    unconfirmed, with an ``error`` naming the command: the relaunch goes at the next drive, not after the
    in-process deadline (a relaunch's start-up on top of the live timeout)."""
    import torch

    run = tmp_path / "run"
    ckpt.save_checkpoint(run / rundir.CHECKPOINTS, 4, 0, {"actor": {"w": torch.zeros(2)}})
    RunInfo.from_json({"id": "run", "live_keys": list(catalog.LIVE_KEYS)}).write(run)
    store, act, h = _actuator_rig(tmp_path, run, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        act.launch(h, None, time.time())
        rb = store.add_action("run", "rollback", {"rule": "nan_or_inf", "set": {}})
        act.drive(h, store.get_action(rb), time.time())
        entry = store.get_action(rb)
        cmd = entry.payload["command"]["id"]
        act.confirm(h, entry.control_version, 6, [], [f"command {cmd}: a LoRA run; left unconfirmed so the watchdog "
                                                      "rolls back by restart"])
        act.drive(h, store.get_action(rb), time.time())
        done = store.get_action(rb)
        assert done.status == "done" and "could not roll back in process (command" in done.result["outcome"]
        assert "a LoRA run" in done.result["outcome"]
        assert [e.payload["resume_step"] for e in store.open_actions("run") if e.kind == "restart"] == [4]
    finally:
        act.stop(h)


def test_a_rollback_by_restart_skips_batches_for_that_launch_only(tmp_path):
    import torch

    from ppo_watchdog.protocol import checkpoint as ckpt

    run = tmp_path / "run"
    ckpt.save_checkpoint(run / rundir.CHECKPOINTS, 4, 0, {"actor": {"w": torch.zeros(2)}})
    RunInfo(id="run", commands=["pause"], skip_batches_key="trainer.resume_skip_batches").write(run)
    # The "trainer" prints its argv, so the log shows what each launch was given.
    store, act, h = _actuator_rig(tmp_path, run, [
        sys.executable, "-c", "import sys, time; print(sys.argv[1:], flush=True); time.sleep(60)", "a=1"])

    def launch_lines(text):
        return [ln for ln in text.splitlines() if ln.startswith("[")]

    def launches():
        return launch_lines(_wait_for_log(run / act.config.log_name, lambda text: True))

    def wait_for_launch(n):
        _wait_for_log(run / act.config.log_name, lambda text: len(launch_lines(text)) >= n)

    def drive_restarts(n):
        for e in [e for e in store.open_actions("run") if e.kind == "restart"]:
            act.drive(h, e, time.time())
        wait_for_launch(n)

    try:
        act.launch(h, None, time.time())
        wait_for_launch(1)
        rb = store.add_action("run", "rollback", {"rule": "kl_far_above", "set": {}, "skip_batches": 2})
        act.drive(h, store.get_action(rb), time.time())
        drive_restarts(2)
        (restart,) = [e for e in store.journal("run") if e.kind == "restart"]
        assert "skipped 2 batches" in store.get_action(restart.id).result["outcome"]
        store.add_action("run", "restart", {"rule": "watchdog:crash", "resume": "latest"})
        drive_restarts(3)
        first, rolled_back, later = launches()
        assert "'trainer.resume_skip_batches=2'" in rolled_back
        assert "skip_batches" not in first and "skip_batches" not in later
    finally:
        act.stop(h)


def test_a_restarted_daemon_does_not_relaunch_a_run_that_already_finished(tmp_path):
    from ppo_watchdog.control.daemon import prepare_daemon

    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    (tmp_path / "rules.yaml").write_text("version: 1\nrules:\n" + textwrap.dedent(QUIET_RULE))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(tmp_path / "fake_trainer.py"), f"trainer.run_dir={run_dir}", "steps=3"]
    cfg_file = tmp_path / "daemon.yaml"
    cfg_file.write_text(json.dumps({"runs": [{"run_dir": str(run_dir), "restart_command": cmd}],
                                    "rules": [str(tmp_path / "rules.yaml")], "state_dir": str(tmp_path / "state")}))
    wd = prepare_daemon(load_daemon_config(cfg_file))
    _drive(wd, lambda: wd.store.require_run("run").phase == "finished")
    wd.close()
    again = prepare_daemon(load_daemon_config(cfg_file))  # the daemon restarted (a deploy, a reboot)
    for _ in range(5):
        again.tick()
    again.close()
    assert again.store.require_run("run").phase == "finished"
    assert len(rundir.iter_events(run_dir, ["started"])) == 1
    # `watchdog run` on the same directory is a request for a new attempt, and still gets one.
    wd3 = _setup(tmp_path, QUIET_RULE)
    ctl = wd3.add_run(run_dir, "run", cmd)
    assert ctl.run.phase == "new"


def test_status_lists_runs_as_json_and_says_where_it_looked_when_there_are_none(tmp_path):
    from ppo_watchdog.cli import app

    state = tmp_path / "state"
    r = CliRunner().invoke(app, ["status", "--state-dir", str(state)])
    assert r.exit_code == 2 and "no runs in" in r.output and "watchdog.db" in r.output  # as `history`
    assert not state.exists()  # looking creates nothing
    Store(state).upsert_run(RunRecord("a", str(tmp_path / "a"), ["python", "-m", "ppo_watchdog.trainer"], phase="running"))
    r = CliRunner().invoke(app, ["status", "--state-dir", str(state), "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.output)
    assert row["run"] == "a" and row["phase"] == "running" and row["firing"] == []
    r = CliRunner().invoke(app, ["status", "nope", "--state-dir", str(state)])
    assert r.exit_code == 2 and "nope" in r.output


def test_a_divergence_before_the_first_checkpoint_rolls_back_to_the_start(tmp_path):

    run = tmp_path / "run"
    RunInfo(id="run").write(run)
    # Like the embedded trainer, this one saves a checkpoint when SIGTERM stops it (at step 9 here).
    trainer = textwrap.dedent(f"""\
        import signal, sys, time
        import torch
        from ppo_watchdog.protocol import checkpoint as ckpt
        print(sys.argv[1:], flush=True)
        def save(*_):
            ckpt.save_checkpoint({str(run / rundir.CHECKPOINTS)!r}, 9, 0, {{"actor": {{"w": torch.zeros(2)}}}})
            sys.exit(0)
        signal.signal(signal.SIGTERM, save)
        print("ready", flush=True)
        time.sleep(60)
    """)
    store, act, h = _actuator_rig(tmp_path, run, [sys.executable, "-c", trainer, "a=1"], stop_grace_s=20)
    try:
        act.launch(h, None, time.time())
        log = run / act.config.log_name
        _wait_for_log(log, lambda text: "ready" in text, timeout=30)
        rb = store.add_action("run", "rollback", {"rule": "kl_far_above", "set": {KL: 0.0002}, "skip_batches": 2})
        act.drive(h, store.get_action(rb), time.time())
        assert store.get_action(rb).status == "done" and "from the start" in store.get_action(rb).result["outcome"]
        (restart,) = [e for e in store.open_actions("run") if e.kind == "restart"]
        act.drive(h, restart, time.time())
        outcome = store.get_action(restart.id).result["outcome"]
        assert "restarted from the start" in outcome
        # Relaunched with the rule's set and no resume arguments (nothing to resume from).
        text = _wait_for_log(log, lambda text: f"{KL}=0.0002" in text)
        relaunch = [ln for ln in text.splitlines() if KL in ln]
        assert len(relaunch) == 1 and "'trainer.resume_mode=disable'" in relaunch[0]
        assert "resume_from_path" not in relaunch[0] and "skip_batches" not in relaunch[0]
        assert store.require_run("run").overrides == {KL: 0.0002}
        # What the stopped trainer saved on the abandoned timeline is kept, but out of reach of a resume.
        assert not list((run / rundir.CHECKPOINTS).glob("global_step_*"))
        assert list((run / rundir.CHECKPOINTS).glob("abandoned-*/global_step_9"))
    finally:
        act.stop(h)


def test_a_divergence_one_step_after_the_first_checkpoint_rolls_back_to_the_initial_weights(tmp_path):
    # The first checkpoint is at step 2 and a divergence rule fires at step 3: its margin makes step 2
    # suspect, so no checkpoint is known-good. README: the run goes back to its initial weights.
    import torch

    run = tmp_path / "run"
    RunInfo(id="run").write(run)
    ckpt.save_checkpoint(run / rundir.CHECKPOINTS, 2, 0, {"actor": {"w": torch.zeros(2)}})
    trainer = "import sys, time; print(sys.argv[1:], flush=True); print('ready', flush=True); time.sleep(60)"
    store, act, h = _actuator_rig(tmp_path, run, [sys.executable, "-c", trainer, "a=1"])
    try:
        act.launch(h, None, time.time())
        log = run / act.config.log_name
        _wait_for_log(log, lambda text: "ready" in text, timeout=30)
        store.open_bad_span("run", "kl_far_above", 2)
        rb = store.add_action("run", "rollback", {"rule": "kl_far_above", "set": {KL: 0.0002}, "skip_batches": 1})
        act.drive(h, store.get_action(rb), time.time())
        done = store.get_action(rb)
        assert done.status == "done", done.result
        assert "from the start" in done.result["outcome"] and "step 2" in done.result["outcome"]
        (restart,) = [e for e in store.open_actions("run") if e.kind == "restart"]
        act.drive(h, restart, time.time())
        assert "restarted from the start" in store.get_action(restart.id).result["outcome"]
        text = _wait_for_log(log, lambda text: f"{KL}=0.0002" in text)
        relaunch = [ln for ln in text.splitlines() if KL in ln]
        assert len(relaunch) == 1 and "'trainer.resume_mode=disable'" in relaunch[0]
        # The suspect checkpoint is kept for a human, out of reach of any later resume.
        assert not list((run / rundir.CHECKPOINTS).glob("global_step_*"))
        assert list((run / rundir.CHECKPOINTS).glob("abandoned-*/global_step_2"))
    finally:
        act.stop(h)


def test_sigusr1_waits_until_the_relaunched_trainer_has_written_its_own_pid(tmp_path):

    run = tmp_path / "run"
    RunInfo(id="run", live_keys=[KL], pid=1).write(run)  # the previous launch's run.json
    # A process with SIGUSR1's default action (death), like a trainer still importing torch.
    store, act, h = _actuator_rig(tmp_path, run, [sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        act.launch(h, None, time.time())
        act.drive(h, store.get_action(store.add_action("run", "live_set", {"rule": "r", "set": {KL: 0.2}})), time.time())
        time.sleep(0.3)
        assert h.proc.alive() and read_control(run).overrides == {KL: 0.2}  # written, not signalled
        RunInfo(id="run", live_keys=[KL], pid=h.proc.pid).write(run)  # the trainer is up
        act.drive(h, store.get_action(store.add_action("run", "live_set", {"rule": "r", "set": {KL: 0.4}})), time.time())
        assert h.proc.wait(5) == -signal.SIGUSR1  # now it is signalled (and this stand-in has no handler)
    finally:
        act.stop(h)


def test_a_live_changes_sigusr1_wakes_the_trainer_and_not_the_ray_processes_of_its_group(tmp_path):
    # Found with verl's in-process glue on CPU: the trainer handles SIGUSR1, but its local ray.init()
    # put Ray's raylet and workers in its process group, and a group-wide SIGUSR1 (default action:
    # death) killed the run at the first live change.
    import psutil

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    code = ("import signal, subprocess, sys, time, pathlib\n"
            f"out = pathlib.Path({str(out)!r})\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "signal.signal(signal.SIGUSR1, lambda *a: (out / 'woken').write_text('1'))\n"
            "(out / 'child.pid').write_text(str(child.pid))\n"
            "time.sleep(60)\n")
    store, act, h = _actuator_rig(tmp_path, run, [sys.executable, "-c", code])
    try:
        act.launch(h, None, time.time())
        pidfile = out / "child.pid"
        _wait_for_log(pidfile, lambda text: bool(text))
        child_pid = int(pidfile.read_text())
        RunInfo(id="run", live_keys=[KL], pid=h.proc.pid).write(run)
        act.drive(h, store.get_action(store.add_action("run", "live_set", {"rule": "r", "set": {KL: 0.2}})), time.time())
        assert _wait_for_log(out / "woken", lambda text: bool(text)) == "1" and h.proc.alive()
        time.sleep(0.3)
        # The group's other process (Ray's, in a verl run) is alive: not gone, not a zombie of the signal.
        assert psutil.Process(child_pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    finally:
        act.stop(h)


def test_a_divergence_that_recurs_after_its_rollback_suspects_the_checkpoint_it_went_back_to(tmp_path: Path) -> None:
    """lr x30 at step 75, detected at 77: the checkpoint of step 75 already holds the spiked update.
    The first rollback goes there (nothing says otherwise yet); when the same rule fires again
    before the run got past step 78, the next rollback must go further back than 75."""
    run = tmp_path / "run"
    run.mkdir()
    wd = build_watchdog(tmp_path / "state", [])
    ctl = wd.add_run(run, managed=False)
    rid = ctl.run.run_id
    assert ctl._recurring_start("kl_explosion", 77, 76) == 76  # a first divergence: as the rule says
    wd.store.open_bad_span(rid, "kl_explosion", 76)
    entry = wd.store.add_action(rid, "rollback", {"rule": "kl_explosion", "resume_step": 75})
    wd.store.update_action(entry, status="done")
    wd.store.close_bad_spans(rid, 78)
    assert ctl._recurring_start("kl_explosion", 77, 76) == 75  # again, on the same steps: 75 is suspect
    assert ctl._recurring_start("kl_explosion", 90, 89) == 89  # past them: a new divergence
    assert ctl._recurring_start("nan", 77, 76) == 76  # another cause
    spans = [BadSpan("kl_explosion", 75, None, 0.0, None)]
    assert choose_known_good([SimpleNamespace(step=s, complete=True) for s in (70, 75)], spans).step == 70


def _rewound_run(tmp_path: Path, target: int, decided: int | None = None) -> tuple[Any, Any, str]:
    """A watched run whose kl_leap rewind (lr 1e-3 -> 1e-4), decided at step ``decided`` (None: not
    recorded), resumed from ``target`` (0: the start)."""
    run = tmp_path / "run"
    RunInfo(id="run", live_keys=[LR], config={"actor_rollout_ref": {"actor": {"optim": {"lr": 1e-3}}}}).write(run)
    wd = build_watchdog(tmp_path / "state", [])
    ctl = wd.add_run(run, managed=False)
    rid = ctl.run.run_id
    wd.store.open_bad_span(rid, "kl_leap", target + 4 if target else 1)  # fired a few steps past its target
    resume = "scratch" if target == 0 else "path"
    entry = wd.store.add_action(rid, "restart", {"rule": "kl_leap", "resume": resume, "resume_step": target,
                                                 "set": {LR: 1e-4}, **({} if decided is None else {"step": decided})})
    wd.store.update_action(entry, status="done")
    wd.store.close_bad_spans(rid, target + 5)
    ctl.run.overrides = {LR: 1e-4}
    return wd, ctl, rid


def _drift(step: int) -> Decision:
    return Decision("kl_drift", step, "fire", [RollbackAction(2), SetAction(LR, "scale", 0.5, min=1e-8, grow=True)],
                    {}, "critical", "m", divergence=True, urgent=True)


def test_a_divergence_soon_after_a_rewind_to_the_start_goes_to_the_start_again_and_cuts_harder(tmp_path: Path) -> None:
    """Issue 45 item 3, found on TRL: an lr 100x too high caught by kl_leap at step 2 went back to the start
    with lr x0.1; at 10x it drifted, and kl_drift at step 20 went back to a checkpoint trained at 10x. The
    cause was there from the first step: the start again, with the lr cut as a second rewind (x0.25)."""
    wd, ctl, rid = _rewound_run(tmp_path, 0)
    try:
        ctl._commit([_drift(20)], TickResult())
        (span,) = [s for s in wd.store.bad_spans(rid) if s.rule == "kl_drift"]
        assert span.start_step == 0  # every checkpoint since the start was trained under the cause
        checkpoints = [SimpleNamespace(step=s, complete=True, ts=None) for s in range(2, 20, 2)]
        assert choose_known_good(checkpoints, wd.store.bad_spans(rid)) is None  # so: the initial weights
        (rollback,) = [j for j in wd.store.journal(rid) if j.kind == "rollback"]
        assert rollback.payload["rewind"] == 2
        assert rollback.payload["set"][LR] == pytest.approx(1e-4 * 0.25)
    finally:
        wd.close()


def test_each_rewind_that_proves_too_short_goes_back_twice_as_far(tmp_path: Path) -> None:
    """Issue 45 item 3, found on TRL (beta 1e-4, lr 10x): kl_drift went back 6 steps (16 -> 10) and the drift
    came back at once; going back one checkpoint more (to 5) was still under the cause. The second rewind
    goes back at least twice as far from its own detection as the first went: 48 - 2 x 10 = 28."""
    wd, ctl, rid = _rewound_run(tmp_path, 40, decided=50)
    try:
        ctl._commit([_drift(48)], TickResult())
        (span,) = [s for s in wd.store.bad_spans(rid) if s.rule == "kl_drift"]
        assert span.start_step == 28
        checkpoints = [SimpleNamespace(step=s, complete=True, ts=None) for s in (20, 25, 30, 35, 40, 45)]
        assert choose_known_good(checkpoints, wd.store.bad_spans(rid)).step == 25
    finally:
        wd.close()


def test_a_divergence_soon_after_a_rewind_goes_back_before_that_rewinds_checkpoint(tmp_path: Path) -> None:
    wd, ctl, rid = _rewound_run(tmp_path, 40)
    try:
        ctl._commit([_drift(55)], TickResult())
        (span,) = [s for s in wd.store.bad_spans(rid) if s.rule == "kl_drift"]
        assert span.start_step == 40
        checkpoints = [SimpleNamespace(step=s, complete=True, ts=None) for s in (30, 40, 45, 50)]
        assert choose_known_good(checkpoints, wd.store.bad_spans(rid)).step == 30
    finally:
        wd.close()


def test_a_divergence_after_the_run_recovered_past_its_rewind_is_a_new_one(tmp_path: Path) -> None:
    wd, ctl, rid = _rewound_run(tmp_path, 0)
    try:
        ctl._commit([_drift(45)], TickResult())  # 45 steps trained past the start: the budget's progress is 30
        (span,) = [s for s in wd.store.bad_spans(rid) if s.rule == "kl_drift"]
        assert span.start_step > 40
        (rollback,) = [j for j in wd.store.journal(rid) if j.kind == "rollback"]
        assert "rewind" not in rollback.payload and rollback.payload["set"][LR] == pytest.approx(1e-4 * 0.5)
    finally:
        wd.close()


def test_a_live_set_decided_on_the_timeline_a_rollback_abandons_is_never_sent(tmp_path: Path) -> None:
    """Found on TRL (bench/trl_stability.py): a rollback set lr 1e-3 -> 1e-4; while it was relaunching,
    the abandoned steps fired a tuning rule whose live lr x0.8 (of 1e-3) was written to control.json,
    and the relaunched trainer applied it over the rollback's 1e-4."""
    run = tmp_path / "run"
    RunInfo(id="run", live_keys=[LR]).write(run)
    wd = build_watchdog(tmp_path / "state", [])
    ctl = wd.add_run(run, managed=False)
    rid = ctl.run.run_id
    wd.store.add_action(rid, "rollback", {"rule": "kl_leap", "set": {LR: 1e-4}, "skip_batches": 2})
    tuning = Decision("kl_above_target", 19, "fire", [SetAction(LR, "scale", 0.8, min=1e-7)], {}, "warning", "m")
    ctl._commit([tuning], TickResult())
    assert [j.kind for j in wd.store.journal(rid)] == ["rollback"]
    (d,) = [d for d in wd.store.decisions(rid) if d["rule"] == "kl_above_target"]
    assert d["outcome"] == "covered by the rollback in progress"
    assert read_control(run) is None  # nothing written for the trainer the rollback relaunches
def test_a_checkpoint_saved_before_the_watchdog_first_saw_the_run_is_never_known_good(tmp_path: Path) -> None:
    """Issue 21 item 3: the run resumed from step 20 of an unwatched run (or was already under way), so
    the first step the watchdog sees is 21. Checkpoint 20 was saved in a state it never saw healthy; a
    checkpoint it watched being written (step 22) is known-good."""
    import torch

    from ppo_watchdog.protocol import checkpoint as ckpt

    run = tmp_path / "run"
    ckpt.save_checkpoint(run / rundir.CHECKPOINTS, 20, 0, {"actor": {"w": torch.zeros(2)}})
    for step in (21, 22):
        rundir.append_metrics(run, step, {"critic/score/mean": 0.0, "actor/reward_kl_penalty": 4.0})
    wd = build_watchdog(tmp_path / "state", [])
    try:
        ctl = wd.add_run(run, managed=False)
        wd.tick()
        spans = wd.store.bad_spans(ctl.run.run_id)
        assert choose_known_good(ckpt.list_checkpoints(run / rundir.CHECKPOINTS), spans) is None
        time.sleep(0.01)  # a later wall time than the span's: written while the watchdog watched
        ckpt.save_checkpoint(run / rundir.CHECKPOINTS, 22, 0, {"actor": {"w": torch.zeros(2)}})
        chosen = choose_known_good(ckpt.list_checkpoints(run / rundir.CHECKPOINTS), wd.store.bad_spans(ctl.run.run_id))
        assert chosen is not None and chosen.step == 22
    finally:
        wd.close()


def test_a_run_watched_from_its_first_step_keeps_every_checkpoint_known_good(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2):
        rundir.append_metrics(run, step, {"critic/score/mean": 0.5})
    wd = build_watchdog(tmp_path / "state", [])
    try:
        ctl = wd.add_run(run, managed=False)
        wd.tick()
        assert wd.store.bad_spans(ctl.run.run_id) == []
    finally:
        wd.close()


def test_a_rollback_with_only_checkpoints_from_before_the_watchdog_fails_naming_why_and_restarts_nothing(
        tmp_path: Path) -> None:
    import torch

    from ppo_watchdog.protocol import checkpoint as ckpt

    run = tmp_path / "run"
    ckpt.save_checkpoint(run / rundir.CHECKPOINTS, 20, 0, {"actor": {"w": torch.zeros(2)}})
    RunInfo(id="run", commands=["pause"]).write(run)
    store, act, h = _actuator_rig(tmp_path, run, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        act.launch(h, None, time.time())
        store.mark_unwatched("run", 30)  # what the controller records when the first step it sees is 30
        rb = store.add_action("run", "rollback", {"rule": "kl_far_above", "set": {}})
        act.drive(h, store.get_action(rb), time.time())
        done = store.get_action(rb)
        assert done.status == "failed" and "first saw this run at step 30" in (done.result or {}).get("error", "")
        assert [e.kind for e in store.journal("run") if e.kind == "restart"] == []
        assert h.proc is not None and h.proc.alive()  # nothing stopped for a rollback that cannot happen
    finally:
        act.stop(h)


KL_CAPPED_RULE = """
  - name: kl_high
    description: raise kl_coef x1.2, capped at 0.02
    expr: kl > 0.1
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.2, max: 0.02}
    cooldown: 1000
    budget: {max: 5, window: 200, escalate: [notify]}
"""


def test_a_live_set_that_would_change_nothing_is_never_sent_and_the_rules_escalation_alerts(tmp_path, webhook):
    # Issue 21, item 6: the trainer runs at kl_coef 0.1; a raise capped at 0.02 cannot move it.
    url, received = webhook
    wd = _setup(tmp_path, KL_CAPPED_RULE, webhook_url=url)
    run_dir = tmp_path / "run"
    ctl = wd.add_run(run_dir, command=[sys.executable, str(tmp_path / "fake_trainer.py"),
                                       f"trainer.run_dir={run_dir}", f"{KL}=0.1", "steps=6"])
    _drive(wd, lambda: ctl.run.phase == "finished" and not wd.store.open_actions("run"))
    journal = wd.store.journal("run")
    assert [j.kind for j in journal] == ["notify"] and journal[0].payload.get("exhausted") is True
    assert not rundir.iter_events(run_dir, ["applied"])  # no control.json change 0.1 -> 0.1 was written
    (post,) = received
    assert "remedy exhausted" in post["body"]["alerts"][0]["annotations"]["summary"]


ROLLOUTS_FAIL_RULE = """
  - name: rollouts_fail
    description: the rollout machinery failed (here, steered by the KL)
    expr: kl > 0.1
    actions:
      - restart: {reason: "rollouts fail: a fresh rollout engine"}
    cooldown: 3
    repeat: true
    urgent: true
    budget: {max: 1, window: 200, escalate: [{stop: {reason: "rollouts keep failing after a restart"}}]}
"""


def test_a_restart_action_relaunches_the_trainer_from_its_latest_checkpoint_then_stops_naming_the_cause(tmp_path):
    # Issue 21, item 1: a failed rollout machinery is restarted, never rolled back, within a budget.
    wd = _setup(tmp_path, ROLLOUTS_FAIL_RULE, actuator={"stop_grace_s": 2})
    run_dir = tmp_path / "run"
    ctl = wd.add_run(run_dir, command=[sys.executable, str(tmp_path / "fake_trainer.py"),
                                       f"trainer.run_dir={run_dir}", "steps=200"])
    _drive(wd, lambda: ctl.run.phase == "stopped" and not wd.store.open_actions("run"), timeout=60)
    kinds = [j.kind for j in wd.store.journal("run")]
    assert "rollback" not in kinds and kinds.count("restart") == 1 and "stop" in kinds
    (restart,) = [j for j in wd.store.journal("run") if j.kind == "restart"]
    assert restart.payload["resume"] == "latest" and restart.payload["fresh_engine"] is True
    assert len(rundir.iter_events(run_dir, ["started"])) == 2
    (stop,) = [j for j in wd.store.journal("run") if j.kind == "stop"]
    assert "rollouts keep failing after a restart" in stop.payload["verdict"]


def test_a_run_with_nothing_new_writes_nothing_to_the_store_and_its_next_step_is_committed(tmp_path):
    run_dir = tmp_path / "run-idle"
    run_dir.mkdir()
    for step in (1, 2, 3):
        rundir.append_metrics(run_dir, step, {"actor/reward_kl_penalty": 0.01, "critic/vf_loss": 0.1})
    wd = build_watchdog(tmp_path / "state")
    wd.add_run(run_dir, None, None, managed=False)
    wd.tick(1_800_000_000.0)
    db = wd.store._db
    before = db.total_changes
    saved = wd.store.load_engine_state("run-idle")
    wd.tick(1_800_000_060.0)
    assert db.total_changes == before  # a stat per file, no write
    assert wd.store.load_engine_state("run-idle") == saved
    rundir.append_metrics(run_dir, 4, {"actor/reward_kl_penalty": 0.01, "critic/vf_loss": 0.1})
    wd.tick(1_800_000_120.0)
    assert db.total_changes > before
    assert wd.store.require_run("run-idle").last_step == 4
    assert wd.store.load_engine_state("run-idle")["tailer"]["last"]["step"] == 4
    wd.close()
