"""A sharded daemon (``shards: N``): N processes, each over its share of the runs, on one state database.

The config key is checked where the others are; the partition is total and the same in any interpreter;
a real ``python -m ppo_watchdog daemon`` with ``shards: 2`` decides every run once, each run held by the
process of its shard; a child killed with SIGKILL is started again and decides nothing twice; SIGTERM
stops every process (exit 0, no orphan), and a supervisor killed with SIGKILL takes its child with it.
The supervisor's backoff and its SIGKILL after the grace are checked with stand-in children (small
scripts that exit or ignore SIGTERM) and, for the backoff, a clock the test moves. Real processes, real
run directories with metrics already written (no trainer), SQLite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_reliability import NAN_RULE
from test_reliability_v2 import _alive, _wait
from typer.testing import CliRunner

from ppo_watchdog.cli import app
from ppo_watchdog.control.daemon import (
    DaemonConfig,
    DaemonConfigError,
    RunSpec,
    Watchdog,
    load_daemon_config,
    tick_trigger,
)
from ppo_watchdog.control.shards import SUPERVISOR_ENV, ShardSupervisor, shard_of, tick_phase
from ppo_watchdog.control.store import Store
from ppo_watchdog.protocol import lock as locks
from ppo_watchdog.protocol import rundir

RUNS = [f"run{i}" for i in range(6)]  # shard_of(., 2): run0-run3 in shard 1, run4 and run5 in shard 0


def _nan_at(run: Path, step: int) -> None:
    rundir.append_metrics(run, step, {"actor/reward_kl_penalty": float("nan"), "critic/score/mean": 0.5})


def _config(tmp_path: Path, **extra: object) -> Path:
    """Six run directories, each a healthy step then a NaN (the rule fires once in each), and a daemon config."""
    (tmp_path / "rules.yaml").write_text(NAN_RULE)
    for name in RUNS:
        run = tmp_path / name
        run.mkdir()
        rundir.append_metrics(run, 1, {"actor/reward_kl_penalty": 0.01, "critic/score/mean": 0.5})
        _nan_at(run, 2)
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(tmp_path / "rules.yaml")],
                                   "tick_s": 0.2, "runs": [str(tmp_path / r) for r in RUNS], **extra}))
    return cfg


def _decisions(tmp_path: Path) -> dict[str, list[int]]:
    """The steps decided for each run, from the shared state database (read-only, as `watchdog history`)."""
    try:
        store = Store(tmp_path / "state", read_only=True)
    except Exception:  # not created yet
        return {}
    try:
        out: dict[str, list[int]] = {}
        for d in store.decisions():
            out.setdefault(d["run_id"], []).append(d["step"])
        return {run: sorted(steps) for run, steps in out.items()}
    finally:
        store.close()


def _holder_pid(path: Path) -> int | None:
    holder = locks.holder_if_held(path)
    return holder.get("pid") if holder else None


class _Daemon:
    """A `python -m ppo_watchdog daemon` process, its console in a file (read while it runs)."""

    def __init__(self, tmp_path: Path, cfg: Path) -> None:
        self.tmp_path = tmp_path
        self.log = tmp_path / "daemon.out"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ppo_watchdog", "daemon", "--config", str(cfg)],
                                         stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, cond: object, what: str, timeout: float = 60.0) -> None:
        def check() -> bool:
            assert self.proc.poll() is None, f"{what}: the daemon exited {self.proc.returncode}: {self.output()}"
            return bool(cond())  # type: ignore[operator]
        try:
            _wait(check, what, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; decided: {_decisions(self.tmp_path)}; console: {self.output()}") from None

    def child_pid(self) -> int | None:
        return _holder_pid(self.tmp_path / "state" / locks.shard_lock(1))


@pytest.fixture
def sharded(tmp_path: Path) -> Iterator[_Daemon]:
    """A daemon of two processes over the six runs, each run decided once: the child's pid is in its lock."""
    assert {shard_of(r, 2) for r in RUNS} == {0, 1}  # a run that fires in each shard
    daemon = _Daemon(tmp_path, _config(tmp_path, shards=2, metrics_port=0))
    child: int | None = None
    try:
        daemon.wait_for(lambda: daemon.child_pid() is not None, "shard 1 to hold its lock")
        child = daemon.child_pid()
        daemon.wait_for(lambda: _decisions(tmp_path) == {r: [2] for r in RUNS}, "every run's NaN decided")
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(30)
        for pid in {child, daemon.child_pid()} - {None}:
            if _alive(pid):  # type: ignore[arg-type]
                os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]


# -- the key ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 257, 1000])
def test_a_shards_value_out_of_range_is_refused_naming_the_file_and_key(tmp_path: Path, value: int) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"shards": value, "runs": ["/r"]}))
    with pytest.raises(DaemonConfigError, match=rf"{cfg}: shards must be an integer from 1 to 256 .*got {value}"):
        load_daemon_config(cfg)
    r = CliRunner().invoke(app, ["daemon", "--config", str(cfg)])
    assert r.exit_code == 2 and "shards must be" in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("value", ["2", 2.0, True, None])
def test_a_shards_value_that_is_not_an_integer_is_refused_naming_the_key(tmp_path: Path, value: object) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"shards": value, "runs": ["/r"]}))
    with pytest.raises(DaemonConfigError, match=rf"{cfg}: shards must be an integer"):
        load_daemon_config(cfg)


def test_shards_whose_metrics_ports_run_past_65535_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DaemonConfigError, match=r"shards: 3 .* metrics_port 65534 .. 65536, past 65535"):
        DaemonConfig(shards=3, metrics_port=65534)
    assert DaemonConfig(shards=2, metrics_port=65534).for_shard(1).metrics_port == 65535
    assert DaemonConfig(shards=256).shards == 256 and DaemonConfig().shards == 1


@pytest.mark.parametrize("shards, shard", [(2, 2), (2, -1), (1, 1)])
def test_an_out_of_range_shard_option_exits_2(tmp_path: Path, shards: int, shard: int) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"shards": shards, "runs": ["/r"], "state_dir": str(tmp_path / "state")}))
    r = CliRunner().invoke(app, ["daemon", "--config", str(cfg), "--shard", str(shard)])
    out = " ".join(r.output.split())  # rich wraps long lines
    assert r.exit_code == 2 and f"{cfg}: --shard {shard}: the config has shards: {shards}," in out, r.output
    assert not (tmp_path / "state").exists()  # refused before anything is written


# -- the partition ------------------------------------------------------------------------------------


IDS = [f"run-{i}" for i in range(300)] + ["qwen2-7b-gsm8k", "exp", "ünïcode-run", ""]


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 256])
def test_every_run_is_in_exactly_one_shard(shards: int) -> None:
    cfg = DaemonConfig(runs=[RunSpec(f"/srv/runs/{i}", id=i) for i in IDS], shards=shards)
    parts = [[str(s.id) for s in cfg.for_shard(k).runs] for k in range(shards)]
    assert sorted(i for part in parts for i in part) == sorted(IDS)  # every run, none twice
    if shards in (2, 3):  # a hash that spreads the runs, not one that gives them all to one process
        assert min(len(p) for p in parts) > len(IDS) / shards * 0.7, [len(p) for p in parts]


def test_a_runs_shard_is_the_same_in_a_fresh_interpreter_whatever_its_hash_seed() -> None:
    here = [shard_of(i, 7) for i in IDS]
    code = ("import json, sys; from ppo_watchdog.control.shards import shard_of; "
            "print(json.dumps([shard_of(i, 7) for i in json.loads(sys.argv[1])]))")
    for seed in ("1", "2"):  # str hashes differ between these two: a partition by hash() would too
        out = subprocess.run([sys.executable, "-c", code, json.dumps(IDS)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, timeout=60, check=True)
        assert json.loads(out.stdout) == here


def test_a_runs_shard_is_decided_on_its_id_else_its_directorys_name(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert RunSpec(str(tmp_path / "real"), id="mine").shard_key() == "mine"
    assert RunSpec(str(tmp_path / "link")).shard_key() == "real"  # the name the daemon gives the run


# -- the supervisor, with stand-in children ----------------------------------------------------------


def _stand_in(tmp_path: Path, body: str) -> str:
    """An executable run as the children's "python" (it gets `-m ppo_watchdog daemon ...` and ignores them)."""
    exe = tmp_path / "stand_in"
    exe.write_text(f"#!{sys.executable}\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


def test_a_child_that_exits_is_said_and_started_again_after_a_backoff_doubling_to_a_minute(tmp_path: Path) -> None:
    now = [1000.0]
    said: list[str] = []
    alerted: list[tuple[int, str]] = []
    sup = ShardSupervisor(tmp_path / "daemon.yaml", 2, said.append,
                          python=_stand_in(tmp_path, "raise SystemExit(3)"), clock=lambda: now[0],
                          alert=lambda shard, why: alerted.append((shard, why)))
    child = sup.children[0]
    sup.start()
    waits = []
    try:
        for ran in (0, 0, 0, 0, 0, 0, 0, 0, 61, 0):
            pid = sup.pids()[1]
            _wait(lambda: child.proc is not None and child.proc.poll() is not None, "the stand-in to exit")
            now[0] += ran
            sup.poll()
            assert f"shard 1 (pid {pid}) exited with exit code 3 after {ran} s" in said[-1], said
            assert sup.pids() == {}  # not before its backoff
            waits.append(child.start_at - now[0])
            now[0] = child.start_at
            sup.poll()
            assert sup.pids()[1] != pid
    finally:
        sup.stop(grace_s=10)
    # 1 s doubling to 60 s; a child that ran a minute (the 9th) starts from 1 s again.
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 1, 2]
    # Alerted once, at its third exit in a row within a minute of its start (not again until it runs a minute).
    assert [shard for shard, _ in alerted] == [1] and "3 exits in a row" in alerted[0][1], alerted


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_and_said(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    body = (f"import signal, time, pathlib\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(120)")
    said: list[str] = []
    now = [1000.0]
    sup = ShardSupervisor(tmp_path / "daemon.yaml", 2, said.append, python=_stand_in(tmp_path, body),
                          clock=lambda: now[0])
    sup.start()
    pid = sup.pids()[1]
    try:
        _wait(ready.exists, "the stand-in to ignore SIGTERM")
        sup.terminate()  # as when the stop signal came: the supervisor's own last tick takes the grace ...
        now[0] += 30.0
        started = time.monotonic()
        sup.stop(grace_s=30.0)  # ... so the wait after it is what is left of the grace: nothing
        assert time.monotonic() - started < 10.0
        assert not _alive(pid)
        assert said == [f"shard 1 (pid {pid}) still running 30 s after SIGTERM: SIGKILL",
                        f"shard 1 (pid {pid}) stopped with signal SIGKILL"]
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# -- the processes ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_shards_decide_every_run_once_each_run_held_by_the_process_of_its_shard(
        tmp_path: Path, sharded: _Daemon) -> None:
    pids = {0: sharded.proc.pid, 1: sharded.child_pid()}
    assert pids[1] != pids[0]
    for name in RUNS:
        assert _holder_pid(tmp_path / name / locks.RUN_LOCK) == pids[shard_of(name, 2)], name
    assert _holder_pid(tmp_path / "state" / locks.STATE_LOCK) == pids[0]
    # A second daemon on the state is refused as today; a second shard 1 is refused naming the holder.
    cfg = str(tmp_path / "daemon.yaml")
    second = subprocess.run([sys.executable, "-m", "ppo_watchdog", "daemon", "--config", cfg], capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 2 and f"pid {pids[0]}" in second.stdout + second.stderr, second
    # A shard 1 started by hand is refused before it takes anything; one started as a supervisor starts it
    # (its parent named in its environment), by the shard's lock, naming the holder.
    by_hand = subprocess.run([sys.executable, "-m", "ppo_watchdog", "daemon", "--config", cfg, "--shard", "1"],
                             capture_output=True, text=True, timeout=60)
    out = " ".join((by_hand.stdout + by_hand.stderr).split())
    assert by_hand.returncode == 2 and "--shard 1: a sharded daemon's processes 1 .. shards-1 are started by its " \
        "shard 0" in out and "Traceback" not in out, out
    again = subprocess.run([sys.executable, "-m", "ppo_watchdog", "daemon", "--config", cfg, "--shard", "1"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, SUPERVISOR_ENV: str(os.getpid())})
    out = again.stdout + again.stderr
    assert again.returncode == 2 and "shard 1 of the state is held by watchdog daemon shard 1" in out, out
    assert f"pid {pids[1]}" in out, out
    # Each process said its share and its own /metrics port (0: a free one each).
    said = sharded.output()
    ports = {line.rsplit(":", 1)[1] for line in said.splitlines() if "/metrics on http://127.0.0.1:" in line}
    assert "shard 0 (pid" in said and "shard 1 (pid" in said and len(ports) == 2, said
    # Each took its turn of the 0.2 s interval: shard 0 at its start, shard 1 half-way.
    assert "ticks 0 s into each 0.2 s" in said and "ticks 0.1 s into each 0.2 s" in said, said
    assert _decisions(tmp_path) == {r: [2] for r in RUNS}


@pytest.mark.parametrize("tick_s", [60.0, 7.5, 0.2])
@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_each_shard_ticks_at_its_own_turn_of_the_interval_whenever_it_was_started(shards: int, tick_s: float) -> None:
    from datetime import datetime, timezone

    phases = [tick_phase(k, shards, tick_s) for k in range(shards)]
    assert phases == [pytest.approx(k * tick_s / shards) for k in range(shards)]  # evenly spread, shard 0 at 0
    for k, phase in enumerate(phases):
        # A shard started (or started again) at any moment ticks at the same instants: its turn, every tick_s.
        for started in (1_700_000_000.0, 1_700_000_000.0 + 0.29 * tick_s, 1_700_000_000.0 + 0.9999 * tick_s,
                        1_700_003_600.0 + k * 0.37 * tick_s):
            trigger = tick_trigger(tick_s, phase, now=started)
            at = datetime.fromtimestamp(started, timezone.utc)
            fires = [trigger.get_next_fire_time(None, at)]
            while len(fires) < 3:
                fires.append(trigger.get_next_fire_time(fires[-1], fires[-1]))
            times = [f.timestamp() for f in fires]
            assert started - 1e-5 <= times[0] < started + tick_s, (k, started, times)
            first = round((times[0] - phase) / tick_s)  # whole intervals since the epoch, one apart
            assert times == [pytest.approx(phase + (first + i) * tick_s, abs=1e-5) for i in range(3)], (k, started)


def test_a_shard_ticks_once_at_start_then_at_its_turns() -> None:
    """``serve_forever`` with a turn, over a stand-in for the Watchdog that records when it is ticked: the turn is
    put half an interval from the start, where ticks counted from the start would be as far from it as can be."""
    tick_s = 1.0
    phase = (time.time() + tick_s / 2) % tick_s
    ticks: list[float] = []
    enough = threading.Event()

    class Ticked:
        freeze_survivors = False
        done = threading.Event()

        def tick(self, now: float | None = None) -> bool:
            ticks.append(time.time())
            if len(ticks) >= 4:
                enough.set()
            return False

    stop = threading.Event()
    start = time.time()
    serving = threading.Thread(target=Watchdog.serve_forever, args=(Ticked(), tick_s),
                               kwargs={"until_done": False, "stop": stop, "phase_s": phase}, daemon=True)
    serving.start()
    try:
        assert enough.wait(30), ticks
    finally:
        stop.set()
        serving.join(30)

    def off_turn(t: float) -> float:
        return abs((t - phase + tick_s / 2) % tick_s - tick_s / 2)

    assert ticks[0] - start < tick_s / 4 and off_turn(ticks[0]) > tick_s / 4, (start, phase, ticks)  # at start
    assert sorted(off_turn(t) for t in ticks[1:])[1] < tick_s / 4, (start, phase, ticks)  # then at its turns


@pytest.mark.slow
def test_a_killed_child_is_started_again_decides_nothing_twice_and_sigterm_stops_every_process(
        tmp_path: Path, sharded: _Daemon) -> None:
    old = sharded.child_pid()
    assert old is not None
    os.kill(old, signal.SIGKILL)
    sharded.wait_for(lambda: sharded.child_pid() not in (None, old), "shard 1 started again")
    new = sharded.child_pid()
    assert new is not None
    sharded.wait_for(lambda: all(_holder_pid(tmp_path / r / locks.RUN_LOCK) == new
                                 for r in RUNS if shard_of(r, 2) == 1), "the new shard 1 holding its runs")
    assert f"shard 1 (pid {old}) exited with signal SIGKILL" in sharded.output()
    # A run of each shard recovers at step 3 and fails again at 4: decided there (the rule resolved, then fired
    # again), once each; the firings at step 2, read again by the new shard 1, are not decided again.
    for run in ("run0", "run4"):
        rundir.append_metrics(tmp_path / run, 3, {"actor/reward_kl_penalty": 0.01, "critic/score/mean": 0.5})
        _nan_at(tmp_path / run, 4)
    expected = {r: [2, 3, 4] if r in ("run0", "run4") else [2] for r in RUNS}
    sharded.wait_for(lambda: _decisions(tmp_path) == expected, "the new NaNs decided")
    sharded.proc.send_signal(signal.SIGTERM)
    assert sharded.proc.wait(timeout=60) == 0, sharded.output()
    assert not _alive(new)  # the supervisor waited for its child: no orphan
    said = sharded.output()
    assert "watchdog daemon shard 1 stopped by SIGTERM" in said and "watchdog daemon shard 0 stopped by SIGTERM" in said
    assert _decisions(tmp_path) == expected


@pytest.mark.slow
def test_a_supervisor_killed_with_sigkill_takes_its_child_with_it(tmp_path: Path, sharded: _Daemon) -> None:
    child = sharded.child_pid()
    assert child is not None
    sharded.proc.kill()
    sharded.proc.wait(30)
    _wait(lambda: not _alive(child), "the orphaned shard 1 to stop", timeout=30)
    # Its locks died with it: the next daemon takes the state and every run again.
    assert sharded.child_pid() is None
    assert all(_holder_pid(tmp_path / r / locks.RUN_LOCK) is None for r in RUNS)


@pytest.mark.slow
def test_one_shard_is_todays_daemon_no_child_and_no_shard_lock(tmp_path: Path) -> None:
    daemon = _Daemon(tmp_path, _config(tmp_path))
    try:
        daemon.wait_for(lambda: _decisions(tmp_path) == {r: [2] for r in RUNS}, "every run's NaN decided")
        assert {_holder_pid(tmp_path / r / locks.RUN_LOCK) for r in RUNS} == {daemon.proc.pid}
        assert not list((tmp_path / "state").glob("watchdog.shard-*"))
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=60) == 0
        assert "shards (processes)" not in daemon.output() and "shard 0" not in daemon.output(), daemon.output()
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(30)
