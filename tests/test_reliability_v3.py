"""Issue 48 (reliability v3): each finding of its red team, reproduced, then held.

A person's control.json never hides the watchdog's change (1), a relaunch-only key never freezes live
control (2), Ctrl-C through a pipe whose reader is gone still stops the trainer (3), no file the watchdog
or a trainer creates in a run directory follows a symlink (4), a control.json at the protocol's largest
version disables nothing (5), a known-good checkpoint removed mid-relaunch falls back (6), a TRL resume
checkpoint that fails verification falls back (8).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_reliability_v2 import _alive, _run_cmd, _wait

from ppo_watchdog.backends.local import LocalBackend, SupervisorError
from ppo_watchdog.control.controller import RULE_FOREIGN_CONTROL
from ppo_watchdog.control.daemon import build_watchdog
from ppo_watchdog.control.store import Phase, Store
from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import lock as locks
from ppo_watchdog.protocol.control import MAX_VERSION, Control, ControlApplier, read_control, write_control
from ppo_watchdog.protocol.inputs import NotRegularFileError
from ppo_watchdog.protocol.runinfo import RunInfo

LR = "actor_rollout_ref.actor.optim.lr"
KL = "actor/reward_kl_penalty"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
LR_RULE = """\
version: 1
rules:
  - name: kl_high
    description: KL high halves the lr
    expr: kl > 0.5
    actions:
      - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.5}
    cooldown: 2
"""


def _steps(run: Path, values: list[float], start: int = 1) -> None:
    for i, v in enumerate(values, start=start):
        rundir.append_metrics(run, i, {KL: v, "critic/score/mean": 0.5})


def _watched(tmp_path: Path, live_keys: list[str] | None = None) -> tuple[object, object, Path]:
    """A watchdog over a run whose trainer (a :class:`ControlApplier` the test drives) runs at lr 1e-3."""
    run = tmp_path / "run"
    run.mkdir()
    RunInfo(id="run", live_keys=list(live_keys or catalog.LIVE_KEYS),
            config={"actor_rollout_ref": {"actor": {"optim": {"lr": 1e-3}}}}).write(run)
    rules = tmp_path / "rules.yaml"
    rules.write_text(LR_RULE)
    wd = build_watchdog(tmp_path / "state", [rules])
    ctl = wd.add_run(run, run_id="run", managed=False)
    return wd, ctl, run


def _lr_rules(tmp_path: Path) -> Path:
    rules = tmp_path / "rules.yaml"
    rules.write_text(LR_RULE)
    return rules


def _trainer_applies(run: Path, step: int, live_keys: list[str] | None = None) -> dict[str, object] | None:
    """The trainer's step boundary: the newest control.json version applied, as StepBoundary does."""
    applier = ControlApplier(run, live_keys=live_keys or catalog.LIVE_KEYS)
    changes = applier.poll(step)
    if changes is None:
        return None
    applier.mark_applied(changes, step, dict(changes.overrides))
    return dict(changes.overrides)


def drive_restart(wd: Any, ctl: Any, payload: dict[str, Any], rounds: int) -> Any:
    """A restart with ``payload`` journaled and driven by the actuator up to ``rounds`` times (as ticks would);
    its journal entry after."""
    aid = wd.store.add_action("run", "restart", payload)
    for _ in range(rounds):
        entry = wd.store.get_action(aid)
        if entry.status in ("intent", "sent"):
            wd.actuator.drive(ctl.h, entry, time.time())
    return wd.store.get_action(aid)


def to_checkpoint(root: Path, step: int) -> dict[str, Any]:
    """A rollback-by-restart's payload: to step ``step``'s checkpoint under ``root``."""
    return {"rule": "nan_rollback", "resume": "path", "resume_path": str(ckpt.step_dir(root, step)),
            "resume_step": step}


def _set_entries(wd: object, run_id: str = "run") -> list[object]:
    return [j for j in wd.store.journal(run_id) if j.kind == "live_set"]  # type: ignore[attr-defined]


# -- 1. a hand-written control.json while the watchdog's set waits ------------------------------------


@pytest.mark.parametrize("same_version", [True, False], ids=["same-version", "next-version"])
def test_a_hand_written_control_json_landing_before_the_step_boundary_never_hides_the_watchdogs_set(
        tmp_path: Path, same_version: bool) -> None:
    wd, ctl, run = _watched(tmp_path)
    _steps(run, [0.01, 0.9])
    wd.tick()  # kl_high fires: lr 1e-3 -> 5e-4 sent as a new control.json version, waiting for the trainer
    sent = read_control(run)
    assert sent is not None and sent.overrides[LR] == pytest.approx(5e-4)
    # Before the trainer's next step boundary a person writes their own control.json over it.
    write_control(run, Control(sent.version if same_version else sent.version + 1, {LR: 2e-3}))
    assert _trainer_applies(run, 2) == {LR: 2e-3}
    wd.tick()
    (entry,) = _set_entries(wd)
    assert entry.status != "done", f"the set was recorded as applied while the trainer runs at 2e-3: {entry}"
    (foreign,) = [d for d in wd.store.decisions("run") if d["rule"] == RULE_FOREIGN_CONTROL]
    assert "not written by the watchdog" in foreign["message"] and "2e-3" in foreign["message"].replace("0.002", "2e-3")
    # The watchdog's set is sent again on top, and the trainer ends at the watchdog's lr.
    again = read_control(run)
    assert again is not None and again.version > (sent.version + (0 if same_version else 1))
    assert again.overrides[LR] == pytest.approx(5e-4)
    assert _trainer_applies(run, 3) is not None
    wd.tick()
    (entry,) = _set_entries(wd)
    assert entry.status == "done" and f"v{again.version}" in entry.result["outcome"], entry
    assert wd.store.require_run("run").overrides[LR] == pytest.approx(5e-4)
    wd.close()


# -- 2. a relaunch-only key in the desired state ---------------------------------------------------


def test_a_relaunch_only_key_in_the_desired_state_never_reaches_control_json_so_live_sets_still_apply(
        tmp_path: Path) -> None:
    live = [LR, "algorithm.kl_ctrl.kl_coef"]
    wd, ctl, run = _watched(tmp_path, live_keys=live)
    # An OOM remedy earlier in the run halved the micro batch by relaunch: it is in the desired state.
    wd.store.update_run("run", overrides={MICRO: 2})
    ctl.run.overrides = {MICRO: 2}
    _steps(run, [0.01, 0.9])
    wd.tick()
    sent = read_control(run)
    assert sent is not None and MICRO not in sent.overrides, sent
    assert _trainer_applies(run, 2, live_keys=live) == {LR: pytest.approx(5e-4)}
    wd.tick()
    (entry,) = _set_entries(wd)
    assert entry.status == "done", entry
    # The desired state keeps it for the next relaunch.
    assert wd.store.require_run("run").overrides[MICRO] == 2
    wd.close()


# -- 5. the protocol's largest version by hand -------------------------------------------------------


def test_a_hand_written_control_json_at_the_largest_version_is_refused_and_later_actions_still_apply(
        tmp_path: Path) -> None:
    wd, ctl, run = _watched(tmp_path)
    write_control(run, Control(MAX_VERSION, {LR: 2e-3}))
    assert _trainer_applies(run, 1) is None  # refused by the trainer, said in an event
    (err,) = [e for e in rundir.read_jsonl(run / rundir.EVENTS).records if e["kind"] == "error"]
    assert str(MAX_VERSION) in err["message"] and "refused" in err["message"]
    _steps(run, [0.01, 0.9])
    wd.tick()
    sent = read_control(run)
    assert sent is not None and sent.version < MAX_VERSION and sent.overrides[LR] == pytest.approx(5e-4)
    alerts = [p["alerts"][0]["annotations"]["description"] for p in wd.actuator.notifier.sent]
    assert any(str(MAX_VERSION) in a for a in alerts), alerts
    assert _trainer_applies(run, 2) is not None
    wd.tick()
    (entry,) = _set_entries(wd)
    assert entry.status == "done", entry
    wd.close()


# -- 3. Ctrl-C with the console's reader gone -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_stop_signal_after_the_consoles_reader_is_gone_still_stops_the_trainer_and_records_the_run(
        tmp_path: Path, sig: int) -> None:
    # `watchdog run ... 2>&1 | tee run.log`, then Ctrl-C: the terminal's SIGINT reaches tee too, which goes first.
    run, state = tmp_path / "run", tmp_path / "state"
    wd = subprocess.Popen(_run_cmd(tmp_path, run, state), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
    pid = None
    try:
        reader = subprocess.Popen(["head", "-n", "1"], stdin=wd.stdout, stdout=subprocess.DEVNULL)
        assert wd.stdout is not None
        wd.stdout.close()  # the reader holds the pipe's only read end
        assert reader.wait(60) == 0  # it read the watchdog's first line and is gone
        _wait(lambda: (run / "trainer.log").exists() and "ready" in (run / "trainer.log").read_text(),
              "the trainer to start")
        pid = Store(state).require_run("run").pid
        assert pid is not None and _alive(pid)
        os.killpg(wd.pid, sig)  # the whole foreground group, as the terminal sends it
        code = wd.wait(60)
        assert code == 128 + sig
        assert not _alive(pid), "the trainer trains on unsupervised"
        store = Store(state)
        assert store.require_run("run").phase == Phase.STOPPED
        (d,) = [d for d in store.decisions("run") if d["rule"] == "watchdog:shutdown"]
        assert "trainer stopped" in d["outcome"]
    finally:
        if wd.poll() is None:
            wd.kill()
            wd.wait(30)
        if pid is not None and _alive(pid):
            os.killpg(pid, signal.SIGKILL)


# -- 4. no file of a run directory is written through a symlink ----------------------------------------


def test_no_lock_log_or_event_file_of_a_run_dir_is_written_through_a_symlink(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "precious"
    run.mkdir()
    elsewhere.mkdir()
    targets = {}
    for name in (locks.RUN_LOCK, locks.TRAINER_LOCK, "trainer.log", rundir.EVENTS, rundir.METRICS):
        target = elsewhere / name.lstrip(".")
        target.write_text("not yours\n")
        (run / name).symlink_to(target)
        targets[name] = target
    with pytest.raises(NotRegularFileError, match="symbolic link"):
        locks.HolderLock(run / locks.RUN_LOCK, "the run").acquire()
    with pytest.raises(SupervisorError, match="symbolic link"):  # the trainer lock, before anything starts
        LocalBackend().start([sys.executable, "-c", "print('hi')"], log_path=run / "trainer.log",
                             lock_path=run / locks.TRAINER_LOCK)
    (run / locks.TRAINER_LOCK).unlink()
    with pytest.raises(SupervisorError, match="symbolic link"):  # trainer.log
        LocalBackend().start([sys.executable, "-c", "print('hi')"], log_path=run / "trainer.log",
                             lock_path=run / locks.TRAINER_LOCK)
    with pytest.raises(NotRegularFileError, match="symbolic link"):
        rundir.append_event(run, "started", 0)
    with pytest.raises(NotRegularFileError, match="symbolic link"):
        rundir.append_metrics(run, 1, {KL: 0.1})
    for target in targets.values():
        assert target.read_text() == "not yours\n", target
    # The watchdog started on it: exit 2 naming the file, the target untouched.
    (run / locks.TRAINER_LOCK).write_text("")
    out = subprocess.run([sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run), "--state-dir",
                          str(tmp_path / "state"), "--no-report", "--", sys.executable, "-c", "pass"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and locks.RUN_LOCK in out.stdout and "Traceback" not in out.stdout + out.stderr, out
    assert targets[locks.RUN_LOCK].read_text() == "not yours\n"


def test_a_write_probe_of_a_run_dir_never_follows_a_symlink(tmp_path: Path) -> None:
    run, target = tmp_path / "run", tmp_path / "precious"
    run.mkdir()
    target.write_text("not yours\n")
    for name in (".watchdog-write-test", ".trainer-write-test"):
        (run / name).symlink_to(target)
    rundir.check_writable(run)
    assert target.read_text() == "not yours\n"


# -- 6. the known-good checkpoint removed while the relaunch is prepared ---------------------------------


def test_a_known_good_checkpoint_removed_before_its_relaunch_falls_back_to_the_one_before_with_an_alert(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    root = run / rundir.CHECKPOINTS
    for step in (4, 8):
        ckpt.save_checkpoint(root, step, 0, {"actor": {"w": step}})
    wd = build_watchdog(tmp_path / "state", [_lr_rules(tmp_path)])
    ctl = wd.add_run(run, run_id="run", command=[sys.executable, "-c", "import time; time.sleep(120)"])
    shutil.rmtree(ckpt.step_dir(root, 8))  # removed (by hand, a pruning) after it was chosen
    try:
        entry = drive_restart(wd, ctl, to_checkpoint(root, 8), rounds=2)
        assert entry.status == "done", entry
        assert entry.payload["resume_path"] == str(ckpt.step_dir(root, 4))
        assert "restarted from step 4" in entry.result["outcome"] and "vanished" in entry.result["outcome"]
        assert ckpt.step_dir(root, 4).name in Path(f"/proc/{ctl.h.proc.pid}/cmdline").read_text()
        alerts = [p["alerts"][0]["annotations"]["description"] for p in wd.actuator.notifier.sent]
        assert any("step 8" in a and "vanished" in a for a in alerts), alerts
    finally:
        if ctl.h.proc is not None:
            ctl.h.proc.stop(5)
        wd.close()


# -- 8. TRL: a resume checkpoint that fails verification ---------------------------------------------


def _trl_checkpoints(run: Path, steps: tuple[int, ...]) -> Path:
    root = run / rundir.CHECKPOINTS
    for step in steps:
        path = ckpt.save_checkpoint(root, step, 0, {"actor": {"w": step}})
        (path / "trainer_state.json").write_text("{}")
    return root


def test_a_trl_resume_checkpoint_that_fails_verification_falls_back_to_the_one_before_not_a_config_error(
        tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from ppo_watchdog.trainer.trl_glue.config import TRLRun
    from ppo_watchdog.trainer.trl_glue.resume import resume_point

    run = tmp_path / "run"
    root = _trl_checkpoints(run, (4, 8))
    (ckpt.step_dir(root, 8) / "manifest.json").write_text("{torn")  # the watchdog's relaunch names step 8
    trl = TRLRun(model_path=str(tmp_path), resume_mode="resume_path", resume_from_path=str(ckpt.step_dir(root, 8)))
    assert resume_point(trl, root) == ckpt.step_dir(root, 4)
    (err,) = [e for e in rundir.read_jsonl(run / rundir.EVENTS).records if e["kind"] == "error"]
    assert "global_step_8" in err["message"] and "step 4" in err["message"], err
    # Nothing usable before it: the initial weights, said the same way.
    shutil.rmtree(ckpt.step_dir(root, 4))
    (ckpt.step_dir(root, 8)).mkdir(exist_ok=True)
    (ckpt.step_dir(root, 8) / "manifest.json").write_text("{torn")
    assert resume_point(trl, root) is None
    assert "initial weights" in rundir.read_jsonl(run / rundir.EVENTS).records[-1]["message"]


def test_a_trl_resume_checkpoint_a_person_names_outside_the_run_is_still_a_config_error(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from ppo_watchdog.trainer.trl_glue.config import TRLRun
    from ppo_watchdog.trainer.trl_glue.resume import resume_point

    mine = _trl_checkpoints(tmp_path / "elsewhere", (3,))
    (ckpt.step_dir(mine, 3) / "manifest.json").write_text("{torn")
    trl = TRLRun(model_path=str(tmp_path), resume_mode="resume_path", resume_from_path=str(ckpt.step_dir(mine, 3)))
    with pytest.raises(ckpt.CheckpointError):
        resume_point(trl, tmp_path / "run" / rundir.CHECKPOINTS)
