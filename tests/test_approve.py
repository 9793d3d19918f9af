"""Approval (``--approve KINDS``): an action of those kinds waits for a person, then is carried out or not.

Real processes on the tiny embedded trainer, as tests/test_advise.py drives them: its actor lr is multiplied by
30 at step 6, and the rule rolls the run back to its step-4 checkpoint. Under ``--approve rollback`` the
rollback waits: ``watchdog approve`` carries it out (the trainer's ``rollback`` event), ``watchdog deny`` and an
unanswered deadline leave the run training to its end in its one process, alerted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from test_advise import LR_RULE, STEPS, TINY
from typer.testing import CliRunner

from ppo_watchdog import cli
from ppo_watchdog.backends.dialect import protect_known_good
from ppo_watchdog.control.controller import ControllerConfig
from ppo_watchdog.control.daemon import DaemonConfigError, load_daemon_config, prepare_daemon
from ppo_watchdog.control.store import NoState, Store, StoreError
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir

# The spike at step 6; the steps after it slowed to 0.7 s each, so the trainer is still training while a
# person answers (the tiny trainer steps faster than a watchdog tick).
FAULTS = "lr_spike@6:x30," + ",".join(f"hang@{s}:0.7" for s in range(7, STEPS + 1))


def _rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(LR_RULE)
    return path


def _wait(cond: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen | None = None) -> object:
    """Until ``cond()`` is true (checked every 50 ms), else fail saying ``what`` (and the watchdog's output)."""
    deadline, tick = time.monotonic() + timeout, threading.Event()
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        tick.wait(0.05)
    out = proc.communicate(timeout=30)[1][-3000:] if proc is not None else ""
    raise AssertionError(f"{what} did not happen in {timeout} s {out}")


def _decision(state: Path, status: str) -> dict | None:
    """The lr_spiked decision once it has ``status`` (None before the state or the decision exists)."""
    try:
        store = Store(state, create=False, read_only=True)
    except (NoState, StoreError):
        return None
    try:
        return next((d for d in store.decisions("run") if d["rule"] == "lr_spiked" and d["status"] == status), None)
    finally:
        store.close()


def _events(run: Path) -> list[str]:
    return [e["kind"] for e in rundir.read_jsonl(run / rundir.EVENTS).records]


def _watchdog_run(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--approve", "rollback", "--rules", str(_rules(tmp_path)),
           "--run-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"), "--tick", "0.3",
           "--no-report", "--faults", FAULTS, *extra]
    for s in TINY:  # (the same STEPS as test_advise's)
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _answer(verb: str, state: Path, *args: str) -> tuple[int, str]:
    out = CliRunner().invoke(cli.app, [verb, "run", *args, "--state-dir", str(state)])
    return out.exit_code, out.output


def _assert_trained_on_alone(run: Path, state: Path) -> dict:
    """One trainer trained every step once and finished; no rollback reached it; the decision is denied."""
    kinds = _events(run)
    assert kinds.count("started") == 1 and kinds.count("finished") == 1
    assert "rollback" not in kinds and "applied" not in kinds
    steps = [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS).records]
    assert steps == list(range(1, STEPS + 1))
    decision = _decision(state, "denied")
    assert decision is not None, "the lr_spiked decision is not denied"
    (entry,) = decision["journal"]
    assert (entry["kind"], entry["status"]) == ("rollback", "denied")
    return decision


@pytest.mark.slow
def test_an_approved_rollback_waits_for_a_person_then_goes_to_the_checkpoint_it_chose(tmp_path: Path) -> None:
    run, state = tmp_path / "run", tmp_path / "state"
    proc = _watchdog_run(tmp_path)
    try:
        waiting = _wait(lambda: _decision(state, "waiting"), 120, "a waiting rollback", proc)
        # Held: nothing of it reached the trainer, and it says what, why, what it costs and how to answer.
        assert "rollback" not in _events(run) and not (run / "control.json").exists()
        assert waiting["outcome"].startswith("waits for approval: roll back to step 4")
        (entry,) = waiting["journal"]
        assert entry["status"] == "awaiting" and entry["payload"]["chosen_step"] == 4
        # The embedded trainer restores in process: priced as that, not as a relaunch (issue 50).
        assert "lr=" in entry["result"]["why"] and entry["result"]["priced"].startswith("in process")
        code, out = _answer("approve", state)
        assert code == 0 and "approved by" in out and "roll back to step 4" in out, out
        _wait(lambda: "rollback" in _events(run), 60, "the rollback event", proc)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "waits for approval: roll back to step 4" in stderr and "watchdog approve run" in stderr
    rollback = next(e for e in rundir.read_jsonl(run / rundir.EVENTS).records if e["kind"] == "rollback")
    assert rollback["to_step"] == 4  # the checkpoint chosen when the rollback was decided
    done = _decision(state, "applied")
    assert done is not None and done["journal"][0]["result"]["approved_by"]
    code, out = _answer("approve", state)  # nothing waits any more: said, exit 2
    assert code == 2 and "nothing to approve" in out


@pytest.mark.slow
def test_a_denied_rollback_leaves_the_run_training_and_alerted(tmp_path: Path, webhook) -> None:
    url, received = webhook
    run, state = tmp_path / "run", tmp_path / "state"
    proc = _watchdog_run(tmp_path, env={"WATCHDOG_WEBHOOK_URL": url})
    try:
        _wait(lambda: _decision(state, "waiting"), 120, "a waiting rollback", proc)
        code, out = _answer("deny", state, "--reason", "a spike I expected")
        assert code == 0 and "denied by" in out, out
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    decision = _assert_trained_on_alone(run, state)
    assert decision["outcome"].startswith("denied by") and "a spike I expected" in decision["outcome"]
    modes = [(p["body"]["status"], p["body"]["alerts"][0]["labels"].get("mode")) for p in received]
    assert ("firing", "approve") in modes and ("resolved", "approve") in modes and ("firing", "denied") in modes
    asked = next(p["body"]["alerts"][0] for p in received if p["body"]["alerts"][0]["labels"].get("mode") == "approve")
    assert "watchdog approve run" in asked["annotations"]["description"]
    assert "Cost: in process" in asked["annotations"]["description"]


@pytest.mark.slow
def test_an_unanswered_rollback_is_denied_at_its_deadline_and_says_so(tmp_path: Path) -> None:
    run, state = tmp_path / "run", tmp_path / "state"
    proc = _watchdog_run(tmp_path, "--approve-timeout", "1")
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    decision = _assert_trained_on_alone(run, state)
    assert "nobody approved it within" in decision["outcome"] and "the run carries on" in decision["outcome"]
    assert "nobody approved it within" in stderr
    out = CliRunner().invoke(cli.app, ["history", "run", "--advised", "--json", "--state-dir", str(state)])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    (row,) = summary["decisions"]
    assert (row["step"], row["rule"], row["status"]) == (6, "lr_spiked", "denied")
    assert row["actions"][0].startswith("roll back to step 4")
    assert summary["totals"]["actions"] == {"rollback": 1} and summary["totals"]["relaunches"] == 0


@pytest.mark.slow
def test_a_daemon_with_approve_rollback_carries_it_out_on_watchdog_approve(
        tmp_path: Path, tiny_trainer_args, trainer_env, monkeypatch: pytest.MonkeyPatch) -> None:
    run, state = tmp_path / "run", tmp_path / "state"
    for key, value in trainer_env.items():
        monkeypatch.setenv(key, value)
    command = tiny_trainer_args(run, "trainer.save_freq=2", f"trainer.faults='{FAULTS}'", steps=STEPS)
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(state), "rules": [str(_rules(tmp_path))], "metrics_port": 0,
                                   "approve": ["rollback"], "runs": [{"run_dir": str(run), "restart_command": command}]}))
    wd = prepare_daemon(load_daemon_config(cfg))
    try:
        ctl = wd.controllers["run"]
        assert ctl.h.approve == ("rollback",)
        gauge = 'watchdog_approvals_waiting{run="run"}'

        def tick_until(cond: Callable[[], object], what: str) -> None:
            deadline = time.monotonic() + 120
            while not cond():
                assert time.monotonic() < deadline and ctl.run.phase != "finished", f"{what}: phase {ctl.run.phase}"
                wd.tick()
                wd.done.wait(0.2)  # (the daemon's own tick interval, shortened)

        tick_until(lambda: _decision(state, "waiting"), "a waiting rollback")
        assert _metric(wd, gauge) == 1.0  # the daemon's /metrics: an approval waits
        code, out = _answer("approve", state)
        assert code == 0, out
        tick_until(lambda: "rollback" in _events(run), "the rollback event")
        assert _metric(wd, gauge) == 0.0
        assert _metric(wd, 'watchdog_actions_total{kind="rollback",outcome="awaiting",rule="lr_spiked",run="run"}') == 1
    finally:
        wd.close()


def _metric(wd, sample: str) -> float | None:
    from prometheus_client import generate_latest

    for line in generate_latest(wd.telemetry.registry).decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample or (name.startswith(sample.split("{")[0] + "{") and _labels(name) == _labels(sample)):
            return float(value)
    return None


def _labels(sample: str) -> set[str]:
    return set(sample.partition("{")[2].rstrip("}").split(","))


def test_approve_with_nothing_waiting_says_so_and_exits_2(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    from ppo_watchdog.control.store import RunRecord

    store.upsert_run(RunRecord("run", str(tmp_path / "run")))
    store.close()
    for verb in ("approve", "deny"):
        code, out = _answer(verb, tmp_path / "state")
        assert code == 2 and f"nothing to {verb}: no action of run run waits for approval" in out
    code, out = _answer("approve", tmp_path / "state", "7")
    assert code == 2 and "decision 7 of run run" in out


def test_approve_names_only_actions_that_can_wait() -> None:
    assert ControllerConfig(approve="rollback, stop").approve == ("rollback", "stop")
    with pytest.raises(ValueError, match="'restart' is not an action that can wait for approval"):
        ControllerConfig(approve=("restart",))
    with pytest.raises(ValueError, match="approve_timeout_s must be > 0"):
        ControllerConfig(approve_timeout_s=0)


def test_a_daemon_config_with_an_unknown_approve_kind_is_refused_naming_the_run(tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"runs": [{"run_dir": str(tmp_path / "r"), "approve": ["rollback", "nap"]}]}))
    with pytest.raises(DaemonConfigError, match=r"runs\[0\]\.approve: 'nap' is not an action"):
        load_daemon_config(cfg)
    cfg.write_text(yaml.safe_dump({"approve": "rollback", "runs": [str(tmp_path / "r")]}))
    with pytest.raises(DaemonConfigError, match="approve must be a list"):
        load_daemon_config(cfg)


def test_the_checkpoint_a_waiting_rollback_chose_is_kept_from_pruning(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        ckpt.save_checkpoint(root, step, 0, {"actor": {"w": step}}, {"global_step": step})
    infos = ckpt.list_checkpoints(root)
    # Only the newest two known-good are kept; the step-2 checkpoint a rollback waits for is kept too.
    assert protect_known_good(root, infos, lambda step, ts: False) == [8, 6]
    assert protect_known_good(root, infos, lambda step, ts: False, hold={2}) == [8, 6, 2]
    assert sorted(p.name for p in ckpt.kept_root(root).iterdir()) == ["global_step_2", "global_step_6",
                                                                      "global_step_8"]
