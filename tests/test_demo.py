"""`make run`, the README's main job, ends on its own: finished, or stopped with a verdict; never waiting."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ppo_watchdog.control.store import Store

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_the_make_run_demo_scenario_ends_on_its_own(tmp_path: Path) -> None:
    run, state = tmp_path / "run", tmp_path / "state"
    proc = subprocess.run(["make", "-s", "run", f"RUN_ARGS=--run-dir {run} --state-dir {state} --no-report"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 2), out[-4000:]  # make's own 2 wraps the watchdog's 1 (stopped with a verdict)
    record = Store(state).require_run("run")
    assert record.phase in ("finished", "stopped"), (record.phase, out[-3000:])
    if record.phase == "finished":
        assert proc.returncode == 0 and record.last_step == 80
    else:
        assert "verdict:" in out
    assert "waiting for `watchdog resume" not in out
    decisions = Store(state).decisions("run")
    # The scenario's faults are remedied: the OOM by a smaller micro batch, the 30x spike by a rollback.
    assert any(d["rule"] == "watchdog:oom" or d["rule"] == "oom" for d in decisions)
    assert any(j["kind"] == "rollback" for d in decisions for j in d["journal"])
