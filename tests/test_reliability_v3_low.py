"""Issue 48's Low findings, each reproduced, then held.

A tick error that repeats forever ends `watchdog run` with exit 2 and the cause; `status` still names the
watchdog when the run lock was replaced by a FIFO; a stopped verl attempt's steps written while the watchdog
was killed mid-stop stay off the timeline; TRL's learning rate and run length are checked as a configuration;
a daemon leaves a run `watchdog run` finished alone; the foreign-control report names the trainer's refusal;
checkpoint listing reads no file of an unchanged checkpoint again; SIGHUP with the terminal gone exits 129.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability_v2 import _wait
from test_verl_mode import SEED_COMMAND, _glue

from ppo_watchdog.backends import zero_patch as verl_mode
from ppo_watchdog.control.actuator import restart_command
from ppo_watchdog.control.controller import RULE_TICK
from ppo_watchdog.protocol import lock as locks
from ppo_watchdog.protocol import rundir

WATCHDOG = [sys.executable, "-m", "ppo_watchdog"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _history(state: Path, run_id: str = "run") -> list[dict[str, object]]:
    out = subprocess.run([*WATCHDOG, "history", run_id, "--state-dir", str(state), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


# -- a tick error that repeats forever ------------------------------------------------------------------------


@pytest.mark.parametrize("broken", ["trainer-lock-directory", "hydra-sweep"])
def test_a_tick_that_fails_the_same_way_every_time_ends_watchdog_run_with_exit_2_and_the_cause(
        tmp_path: Path, broken: str) -> None:
    run, state = tmp_path / "run", tmp_path / "state"
    extra: list[str] = []
    if broken == "trainer-lock-directory":
        (run / locks.TRAINER_LOCK).mkdir(parents=True)
        cause = "cannot take the run's trainer lock"
    else:
        extra = ["lr=1e-3,2e-3"]  # unquoted: Hydra reads a sweep of two values
        cause = "a sweep"
    out = subprocess.run([*WATCHDOG, "run", "--run-dir", str(run), "--state-dir", str(state), "--no-report",
                          "--tick", "0.1", "--", *SLEEPER, *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    said = " ".join((out.stdout + out.stderr).split())
    assert cause in said and "every tick failed the same way" in said, said
    (decision,) = _history(state)
    assert decision["rule"] == RULE_TICK and cause in str(decision["message"])


# -- status with the run lock replaced by a FIFO ----------------------------------------------------------------


def test_status_names_the_watchdog_when_its_run_lock_was_replaced_by_a_fifo(tmp_path: Path) -> None:
    run, state = tmp_path / "run", tmp_path / "state"
    proc = subprocess.Popen([*WATCHDOG, "run", "--run-dir", str(run), "--state-dir", str(state), "--no-report",
                             "--tick", "0.2", "--", *SLEEPER], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: locks.holder_if_held(run / locks.TRAINER_LOCK) is not None, "the trainer to start", proc=proc)
        (run / locks.RUN_LOCK).unlink()
        os.mkfifo(run / locks.RUN_LOCK)  # the watchdog holds the old file; the path says nothing now
        out = subprocess.run([*WATCHDOG, "status", "--state-dir", str(state), "--json"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        (row,) = json.loads(out.stdout)
        assert row["watchdog"] is not None and row["watchdog"]["pid"] == proc.pid, row
        assert "UNSUPERVISED" not in row["supervised"] and "not a regular file" in row["supervised"], row
    finally:
        proc.terminate()
        proc.wait(60)


# -- a stopped verl attempt's steps after a kill -9 mid-stop -------------------------------------------------------


def test_steps_a_stopped_verl_attempt_writes_while_the_watchdog_is_killed_mid_stop_stay_off_the_timeline(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    verl_mode.init_run(run, SEED_COMMAND)
    glue = _glue(run)
    cmd, env = glue.prepare_launch(restart_command(SEED_COMMAND, {}, None), {}, None)
    glue.launched(101, cmd, None)
    log1 = Path(env["VERL_FILE_LOGGER_PATH"])
    log1.write_text("".join(json.dumps({"step": s, "data": {"actor/pg_loss": 0.1}}) + "\n" for s in (1, 2, 3, 4)))
    glue.poll(None)
    glue.stopping(4)  # the relaunch from step 4 stops verl ...
    del glue          # ... and the watchdog is killed (-9) while verl shuts down, training on
    with log1.open("a") as f:
        for s in (5, 6):
            f.write(json.dumps({"step": s, "data": {"actor/pg_loss": float("nan")}}) + "\n")
    glue = _glue(run)  # the watchdog started again: its first tick relays before it re-drives the relaunch
    glue.poll(None)
    assert [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS).records] == [1, 2, 3, 4]
    kept = rundir.read_jsonl(run / "verl" / verl_mode.ABANDONED_FILE).records
    assert [(r["attempt"], r["step"]) for r in kept] == [(1, 5), (1, 6)]


# -- TRL: the learning rate and the run's length are configuration -------------------------------------------------


@pytest.mark.parametrize(("arg", "said"), [
    ("trl.learning_rate=abc", "must be a number"),
    ("trl.max_steps=-5", "trainer.total_training_steps=-5: must be >= 1"),
    ("actor_rollout_ref.actor.optim.lr=1e308", "must be a number > 0 and < 1"),
    ("learning_rate=1.5", "must be a number > 0 and < 1"),
    ("trl.learning_rate=nan", "must be a number > 0 and < 1"),
])
def test_a_trl_learning_rate_or_run_length_that_cannot_train_is_a_configuration_error(
        tmp_path: Path, arg: str, said: str) -> None:
    pytest.importorskip("trl")
    from ppo_watchdog.trainer.trl_glue.config import TRLConfigError, parse_args

    model = f"actor_rollout_ref.model.path={tmp_path}"
    with pytest.raises(TRLConfigError, match=said.replace("(", r"\(")):
        parse_args([model, arg])
    # What trl.<name> names, for a knob the glue maps, is that knob: the run's length stays checked and in force.
    assert parse_args([model, "trl.max_steps=7"]).total_training_steps == 7
    assert parse_args([model, "trl.learning_rate=3e-6"]).lr == 3e-6


def test_trl_learning_rate_abc_exits_2_as_a_configuration_error_before_training(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    out = subprocess.run([sys.executable, "-m", "ppo_watchdog.trainer.trl_glue", "--run-dir", str(tmp_path / "run"),
                          f"actor_rollout_ref.model.path={tmp_path}", "trl.learning_rate=abc"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "actor_rollout_ref.actor.optim.lr='abc': must be a number" in out.stderr, out.stderr


# -- a daemon and a run `watchdog run` finished ------------------------------------------------------------------

FINISHING = ("import os; from ppo_watchdog.protocol import rundir; d = os.environ['WATCHDOG_RUN_DIR']; "
             "rundir.append_event(d, 'started', 0, resumed_from=0); print('trained', flush=True); "
             "rundir.append_event(d, 'finished', 3)")


def test_a_daemon_does_not_relaunch_a_run_that_watchdog_run_finished(tmp_path: Path) -> None:
    import yaml

    from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon
    from ppo_watchdog.control.store import Phase

    run = tmp_path / "run"
    trainer = [sys.executable, "-c", FINISHING]
    out = subprocess.run([*WATCHDOG, "run", "--run-dir", str(run), "--state-dir", str(tmp_path / "ran"), "--no-report",
                          "--tick", "0.1", "--", *trainer], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    log_before = (run / "trainer.log").read_text()
    assert log_before.count("trained") == 1
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "daemon"), "rules": [],
                                   "runs": [{"run_dir": str(run), "restart_command": trainer}]}))
    wd = prepare_daemon(load_daemon_config(cfg))
    try:
        (ctl,) = wd.controllers.values()
        for _ in range(3):
            wd.tick()
        assert ctl.run.phase == Phase.FINISHED and ctl.h.proc is None
        assert (run / "trainer.log").read_text() == log_before  # nothing launched
    finally:
        wd.close()


# -- the foreign-control report and the trainer's refusal ------------------------------------------------------


def test_the_report_of_a_hand_written_control_json_names_what_the_trainer_refused_of_it(tmp_path: Path) -> None:
    from test_reliability_v3 import LR, _steps, _watched

    from ppo_watchdog.control.controller import RULE_FOREIGN_CONTROL
    from ppo_watchdog.protocol import catalog
    from ppo_watchdog.protocol.control import Control, ControlApplier, write_control

    wd, _, run = _watched(tmp_path)
    try:
        write_control(run, Control(3, {LR: 2e-3, "algorithm.kl_ctrl.kl_coef": 0.05}))
        applier = ControlApplier(run, live_keys=catalog.LIVE_KEYS)
        changes = applier.poll(1)
        assert changes is not None
        # The trainer applies the KL coefficient and refuses the lr (its error, then its ``applied``: the protocol's order).
        rundir.append_event(run, "error", 1, source="control", version=3,
                            message=f"{LR}: refused: this optimizer's lr is fixed for the run")
        applier.mark_applied(changes, 1, {"algorithm.kl_ctrl.kl_coef": 0.05})
        _steps(run, [0.01])
        wd.tick()
        (decision,) = [d for d in wd.store.decisions("run") if d["rule"] == RULE_FOREIGN_CONTROL]
        assert "not written by the watchdog" in decision["message"]
        assert "refused part of it" in decision["message"] and "lr is fixed for the run" in decision["message"]
        alerts = [p["alerts"][0]["annotations"]["description"] for p in wd.actuator.notifier.sent]
        assert any("lr is fixed for the run" in a for a in alerts), alerts
    finally:
        wd.close()


# -- SIGHUP with the terminal gone -------------------------------------------------------------------------------


def test_sighup_with_the_terminal_gone_stops_the_trainer_and_exits_129(tmp_path: Path) -> None:
    run = tmp_path / "run"
    master, slave = os.openpty()  # the terminal `watchdog run` prints to
    proc = subprocess.Popen([*WATCHDOG, "run", "--run-dir", str(run), "--state-dir", str(tmp_path / "state"),
                             "--no-report", "--tick", "0.2", "--", *SLEEPER],
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    try:
        os.set_blocking(master, False)

        def started() -> bool:
            try:
                os.read(master, 65536)  # (the terminal reads what it prints, so no write blocks)
            except OSError:
                pass
            return locks.holder_if_held(run / locks.TRAINER_LOCK) is not None

        _wait(started, "the trainer to start", proc=proc)
        os.close(master)  # the window closed: every write to the terminal fails with EIO from now on
        master = -1
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 128 + signal.SIGHUP
        assert locks.holder_if_held(run / locks.TRAINER_LOCK) is None  # the trainer stopped with it
    finally:
        if master >= 0:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# -- checkpoint listing every tick --------------------------------------------------------------------------------


def test_a_verl_runs_checkpoints_are_walked_again_only_when_they_change(tmp_path: Path) -> None:
    from test_checkpoint_fallback import _verl_checkpoint, _verl_run

    from ppo_watchdog.protocol import checkpoint as ckpt

    run, root = _verl_run(tmp_path, (2, 4))
    glue = _glue(run)
    first = glue.checkpoints()
    assert [(c.step, c.complete) for c in first] == [(2, True), (4, True)]
    walks = glue._listing.walks
    for _ in range(5):  # the ticks in between: nothing changed, nothing walked
        assert glue.checkpoints() == first
    assert glue._listing.walks == walks
    # A rank's file gone from step 4: walked again, and judged incomplete.
    (ckpt.step_dir(root, 4) / "actor" / "optim_world_size_1_rank_0.pt").unlink()
    assert [(c.step, c.complete) for c in glue.checkpoints()] == [(2, True), (4, False)]
    assert glue._listing.walks == walks + 1
    # A new save: the marker moved, so each is judged against it again; then quiet once more.
    _verl_checkpoint(root, 6)
    assert [(c.step, c.complete) for c in glue.checkpoints()] == [(2, True), (4, False), (6, True)]
    walks = glue._listing.walks
    glue.checkpoints()
    assert glue._listing.walks == walks
