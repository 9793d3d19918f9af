"""Advise mode: every decision made, priced, journaled and announced as what the watchdog would do, nothing done.

Real processes on the tiny embedded trainer (as tests/test_watchdog_run.py): `watchdog run --advise` and a
daemon with ``advise: true`` watch a run whose actor lr is multiplied by 30 at step 6 (the fault injection
the Makefile's demo uses). Live, the rule below rolls the run back to its step-4 checkpoint; advised, the
run trains on in its one process to the end, and the rollback is in the journal as advice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ppo_watchdog import cli
from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon
from ppo_watchdog.control.store import Store
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import read_control
from ppo_watchdog.protocol.runinfo import RunInfo

pytestmark = pytest.mark.slow

LR_RULE = """version: 1
rules:
  - name: lr_spiked
    description: the actor lr far above the tiny trainer's 2e-4 -> last known-good, then a tenth of the lr
    expr: lr > 0.001
    divergence: true
    actions:
      - rollback: {skip_batches: 1}
      - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.1, min: 1.0e-8}
    cooldown: 1000
    severity: critical
"""
STEPS = 12
TINY = [
    "data.train_batch_size=16", "data.train_size=64", "data.val_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
    "trainer.test_freq=0", "trainer.save_freq=2", "trainer.progress=false", f"trainer.total_training_steps={STEPS}",
]
# The spike at step 6; the steps after it slowed to 0.4 s each, so the advice is given while the trainer that
# would have been rolled back is still training (the tiny trainer steps faster than a watchdog tick).
FAULTS = "lr_spike@6:x30," + ",".join(f"hang@{s}:0.4" for s in range(7, STEPS + 1))


def _rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(LR_RULE)
    return path


def _history(state: Path, *extra: str) -> list[dict]:
    out = CliRunner().invoke(cli.app, ["history", "run", "--json", "--state-dir", str(state), *extra])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def _replayed(run: Path, rules: Path) -> list[tuple[str, int, str]]:
    out = CliRunner().invoke(cli.app, ["replay", str(run), "--json", "--rules", str(rules)])
    assert out.exit_code == 0, out.output
    return [(d["rule"], d["step"], d["kind"]) for d in json.loads(out.stdout)]


def _assert_untouched_and_advised(run: Path, state: Path, rules: Path) -> None:
    """One trainer trained every step once and finished; nothing of the watchdog reached it; the rollback it
    would have made is journaled as advice, and the advised decisions are replay's."""
    events = rundir.read_jsonl(run / rundir.EVENTS).records
    kinds = [e["kind"] for e in events]
    assert kinds.count("started") == 1 and kinds.count("finished") == 1  # one launch, never relaunched
    assert "applied" not in kinds and "rollback" not in kinds and "paused" not in kinds
    assert read_control(run) is None and not (run / "control.json").exists()
    steps = [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS).records]
    assert steps == list(range(1, STEPS + 1))  # trained on past the spike, no step re-run
    store = Store(state, create=False, read_only=True)
    record = store.require_run("run")
    assert record.pid == RunInfo.read(run).pid and record.restarts == 0 and record.control_version == 0
    assert record.phase == "finished" and store.control_versions("run") == []
    (decision,) = [d for d in _history(state) if d["rule"] == "lr_spiked"]
    assert decision["status"] == "advised" and decision["step"] == 6
    assert decision["outcome"].startswith("would roll back to step 4 (the last known-good checkpoint)")
    assert decision["outcome"].endswith("then set lr 2e-4 -> 2e-5")  # (the lr in words, from -> to)
    assert decision["cost"]  # priced as it would be
    (entry,) = decision["journal"]
    assert (entry["kind"], entry["status"]) == ("rollback", "advised")
    assert [j.status for j in store.journal("run")] == ["advised"]
    advised = [(d["rule"], d["step"], d["kind"]) for d in _history(state, "--all")]
    assert advised == _replayed(run, rules) and advised


def test_watchdog_run_advise_keeps_one_trainer_and_journals_the_rollback_it_would_make(tmp_path: Path) -> None:
    run, state, rules = tmp_path / "run", tmp_path / "state", _rules(tmp_path)
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--advise", "--rules", str(rules), "--run-dir", str(run),
           "--state-dir", str(state), "--tick", "0.3", "--no-report", "--faults", FAULTS]
    for s in TINY:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "advise mode" in proc.stdout and "advise mode: what the watchdog would have done" in proc.stdout
    assert "advise: would roll back to step 4" in proc.stderr  # said on the console as it happened
    _assert_untouched_and_advised(run, state, rules)


def test_a_daemon_with_advise_true_never_touches_its_run(tmp_path: Path, tiny_trainer_args, trainer_env,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run, state, rules = tmp_path / "run", tmp_path / "state", _rules(tmp_path)
    for key, value in trainer_env.items():
        monkeypatch.setenv(key, value)
    command = tiny_trainer_args(run, "trainer.save_freq=2", f"trainer.faults='{FAULTS}'", steps=STEPS)
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(state), "rules": [str(rules)], "advise": True,
                                   "runs": [{"run_dir": str(run), "restart_command": command}]}))
    wd = prepare_daemon(load_daemon_config(cfg))
    try:
        ctl = wd.controllers["run"]
        assert ctl.h.advise
        pids = set()
        deadline = time.monotonic() + 240
        while ctl.run.phase != "finished":
            assert time.monotonic() < deadline, f"the run did not finish: phase {ctl.run.phase}"
            wd.tick()
            pids.add(ctl.run.pid)
            if ctl.run.phase != "finished":
                wd.done.wait(0.2)  # (the daemon's own tick interval, shortened)
        assert len(pids) == 1  # the one trainer the daemon launched, throughout
    finally:
        wd.close()
    _assert_untouched_and_advised(run, state, rules)


def test_a_run_of_its_own_advise_false_is_acted_on_under_a_daemon_advising(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(_rules(tmp_path))],
                                   "advise": True, "runs": [{"run_dir": str(run), "advise": False},
                                                            str(tmp_path / "other")]}))
    (tmp_path / "other").mkdir()
    wd = prepare_daemon(load_daemon_config(cfg))
    try:
        assert not wd.controllers["run"].h.advise and wd.controllers["other"].h.advise
    finally:
        wd.close()
