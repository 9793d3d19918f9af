"""`watchdog status` as an operator reads it: short columns, age, start, the last action in words, why a run
ended, and pids only while their processes hold their locks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from ppo_watchdog.cli import app
from ppo_watchdog.control.store import RunRecord, Store
from ppo_watchdog.protocol import lock as locks

# A trainer stand-in that holds its run directory's trainer lock, as a real trainer does, until its stdin closes.
HOLDER = """
import sys
from ppo_watchdog.protocol import lock
lk = lock.HolderLock(sys.argv[1], "the run", role="a trainer").acquire()
print("held", flush=True)
sys.stdin.read()
"""


def _firing_state(rule: str) -> str:
    return json.dumps({"version": 1, "engine": {"rules": {rule: {"status": "firing"}}}})


def test_status_shows_short_columns_the_last_action_in_words_and_only_live_pids(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = Store(state)
    done, live = tmp_path / "done", tmp_path / "live"
    done.mkdir()
    live.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited: its pid is no trainer's any more
    store.upsert_run(RunRecord("done", str(done), ["python", "train.py"], phase="finished", pid=dead_pid,
                               last_step=80, last_progress_ts=time.time() - 600))
    store.save_engine_state("done", 1, _firing_state("kl_runaway"))  # its rules' last states, left as they were
    d = store.add_decision("done", 62, "kl_explosion", "fire", [{"kind": "rollback"}], {"kl": 5.87},
                           message="kl > 5 * median(kl, 5)")
    store.set_decision(d, "applied", "rolled back in process to step 56")
    store.add_decision("done", 70, "kl_explosion", "resolve", [], {}, status="skipped", outcome="resolved")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live / locks.TRAINER_LOCK)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        store.upsert_run(RunRecord("live", str(live), ["python", "train.py"], phase="running", pid=holder.pid,
                                   last_step=12, last_progress_ts=time.time() - 5))
        store.save_engine_state("live", 1, _firing_state("kl_high"))
        store.close()
        args = ["status", "--state-dir", str(state)]
        r = CliRunner().invoke(app, args, env={"COLUMNS": "240"})
        assert r.exit_code == 0, r.output
        header = next(line for line in r.output.splitlines() if " phase " in line)
        assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
            "run", "phase", "step", "age", "started", "last action", "why", "pids"]
        assert "control_version" not in r.output and "open_actions" not in r.output and "None" not in r.output
        rows = {line.split("│")[1].strip(): line for line in r.output.splitlines() if line.startswith("│ ")
                and line.split("│")[1].strip()}
        assert "firing" not in rows["done"] and "finished" in rows["done"]  # a finished run fires nothing
        # The last action as its sentence: what the rule saw (this rule has no summary: its condition), then what was done.
        assert "step 62, kl_explosion: kl > 5 * median(kl, 5): rolled back in process to step 56" in rows["done"]
        assert f"{dead_pid}" not in r.output  # a dead pid is no pid
        assert " 10m " in rows["done"] and " 80 " in rows["done"]
        assert "running (firing: kl_high)" in rows["live"] and f"trainer {holder.pid}" in rows["live"]
        rows_json = {row["run"]: row for row in json.loads(CliRunner().invoke(app, [*args, "--json"]).output)}
        assert rows_json["done"]["firing"] == [] and rows_json["live"]["firing"] == ["kl_high"]
        assert rows_json["done"]["pid"] == dead_pid and rows_json["done"]["pids"] == ""  # --json keeps every field
        assert rows_json["live"]["trainer_alive"] is True and rows_json["live"]["started"] > 0
    finally:
        holder.communicate(timeout=30)
    after = CliRunner().invoke(app, ["status", "live", "--state-dir", str(state)], env={"COLUMNS": "240"})
    assert after.exit_code == 0 and f"trainer {holder.pid}" not in after.output  # its process has gone


def test_status_says_why_a_stopped_run_ended(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = Store(state)
    store.upsert_run(RunRecord("r", str(tmp_path / "r"), ["python", "train.py"], phase="stopped", last_step=30))
    d = store.add_decision("r", 30, "repeated_rollbacks", "escalate", [{"kind": "stop"}], {})
    store.set_decision(d, "applied", "stopped: rolled back 6 times in 100 steps")
    store.close()
    r = CliRunner().invoke(app, ["status", "--state-dir", str(state)], env={"COLUMNS": "240"})
    assert r.exit_code == 0 and "stopped: rolled back 6 times in 100 steps" in r.output, r.output
