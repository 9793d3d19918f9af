"""Issue 22: a daemon tick over many runs (one transaction a tick, a savepoint a run) and a run's
attach (run.json read once). Real SQLite, real run directories, a real trainer process to adopt;
the commit failure and the failing run are fault injection, named as such."""

from __future__ import annotations

import gc
import json
import math
import sqlite3
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_reliability import NAN_RULE

from ppo_watchdog.control import daemon
from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon
from ppo_watchdog.control.store import Store
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.runinfo import RunInfo


class _CountingDb:
    """The store's sqlite3 connection, counting its COMMITs and failing the next ``fail`` of them
    (fault injection: what a full disk or a lost lock does to a tick's commit)."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.commits = 0
        self.fail = 0

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.strip().upper() == "COMMIT":
            self.commits += 1
            if self.fail:
                self.fail -= 1
                self._db.execute("ROLLBACK")
                raise RuntimeError("injected: the tick's commit failed")
        return self._db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _daemon(tmp_path: Path, runs: list[Path], rules: str = NAN_RULE) -> Any:
    (tmp_path / "rules.yaml").write_text(rules)
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(tmp_path / "rules.yaml")],
                                   "runs": [str(d) for d in runs]}))
    return prepare_daemon(load_daemon_config(cfg))


def _runs(tmp_path: Path, n: int) -> list[Path]:
    dirs = [tmp_path / f"run{i}" for i in range(n)]
    for d in dirs:
        d.mkdir()
    return dirs


def _append(run: Path, step: int, kl: float) -> None:
    rundir.append_metrics(run, step, {"actor/reward_kl_penalty": kl, "critic/score/mean": 0.5})


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every RunInfo.read, by run directory (what the attach reads of run.json)."""
    calls: list[str] = []
    real = RunInfo.read.__func__  # type: ignore[attr-defined]

    def read(cls: type[RunInfo], run_dir: Path | str) -> RunInfo:
        calls.append(str(run_dir))
        return real(cls, run_dir)

    monkeypatch.setattr(RunInfo, "read", classmethod(read))
    yield calls


@pytest.fixture
def nan_daemon(tmp_path: Path) -> Iterator[Any]:
    """A daemon over three runs (run0, run1, run2), each with a NaN at step 1: the rule fires once in each."""
    runs = _runs(tmp_path, 3)
    wd = _daemon(tmp_path, runs)
    try:
        for d in runs:
            _append(d, 1, math.nan)
        yield wd
    finally:
        wd.close()


def test_a_tick_over_many_runs_with_new_steps_commits_once(tmp_path: Path) -> None:
    runs = _runs(tmp_path, 5)
    wd = _daemon(tmp_path, runs)
    try:
        db = wd.store._db = _CountingDb(wd.store._db)
        for d in runs:
            _append(d, 1, 0.01)
        wd.tick()
        assert db.commits == 1  # five runs read, evaluated and their positions stored: one transaction
        assert all(c.run.last_step == 1 for c in wd.controllers.values())
        stored = [json.loads(r["state"])["tailer"]["metrics"]["offset"] for r in
                  wd.store._db.execute("SELECT state FROM rule_states").fetchall()]
        assert len(stored) == 5 and all(o > 0 for o in stored)
        db.commits = 0
        wd.tick()  # nothing new anywhere: nothing written
        assert db.commits == 1 and wd.store._db.execute("SELECT count(*) FROM rule_states").fetchone()[0] == 5
    finally:
        wd.close()


def test_a_tick_whose_commit_fails_keeps_nothing_for_any_run_and_the_next_decides_each_step_once(
        tmp_path: Path) -> None:
    runs = _runs(tmp_path, 3)
    wd = _daemon(tmp_path, runs)
    try:
        db = wd.store._db = _CountingDb(wd.store._db)
        for d in runs:
            _append(d, 1, 0.01)
            _append(d, 2, math.nan)
        db.fail = 1
        wd.tick()
        assert wd.store.decisions() == []  # the decisions went with the commit
        assert all(c.run.last_step is None for c in wd.controllers.values())  # and the positions with them
        wd.tick()
        by_run = {c.run.run_id: [d["step"] for d in wd.store.decisions(c.run.run_id)]
                  for c in wd.controllers.values()}
        assert by_run == {c.run.run_id: [2] for c in wd.controllers.values()}  # each NaN once, not twice
        again = Store(tmp_path / "state", busy_timeout_s=1.0)  # what a restarted daemon would find
        assert sorted(d["run_id"] for d in again.decisions()) == sorted(by_run)
    finally:
        wd.close()


def test_a_tick_whose_commit_fails_leaves_each_run_as_its_store_says_and_says_a_pause_once_it_holds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The failed tick paused the run for its NaN and adopted a control version a human wrote. Neither was
    # committed, so neither may stay in memory: a pause kept there was never said once it held (the
    # console's "paused for a human" came only with the commit that failed), and the run's desired
    # overrides were not the store's.
    pause = NAN_RULE.replace("actions: [notify]", "actions: [{pause: {reason: a NaN}}]")
    runs = _runs(tmp_path, 1)
    wd = _daemon(tmp_path, runs, pause)
    try:
        ctl = wd.controllers["run0"]
        _append(runs[0], 1, 0.01)
        wd.tick()
        rundir.append_event(runs[0], "checkpoint", 1, path=str(runs[0] / "global_step_1"))
        wd.tick()  # an event alone: the step evaluated last is still step 1 (it was written back as None)
        assert wd.store.get_run("run0").last_evaluated_step == ctl.run.last_evaluated_step == 1
        _append(runs[0], 2, math.nan)
        rundir.append_event(runs[0], "applied", 2, version=7, commands=[],
                            applied={"algorithm.kl_ctrl.kl_coef": 0.5})  # written by hand, not by the watchdog
        rundir.append_event(runs[0], "error", 2, source="control", version=8, message="refused: lr < 0")
        db = wd.store._db = _CountingDb(wd.store._db)
        db.fail = 1
        wd.tick()
        stored = wd.store.get_run("run0")
        assert stored is not None and stored.phase != "paused" and stored.overrides == {}
        for name in ("phase", "overrides", "startup_s", "last_step", "last_evaluated_step", "control_version"):
            assert getattr(ctl.run, name) == getattr(stored, name), name
        assert ctl._control_errors == {} and ctl._paused_since is None
        caplog.clear()
        with caplog.at_level("WARNING"):
            wd.tick()
        assert wd.store.get_run("run0").phase == "paused"
        assert wd.store.get_run("run0").overrides == {"algorithm.kl_ctrl.kl_coef": 0.5}
        assert "paused for a human" in caplog.text
        assert "it changed algorithm.kl_ctrl.kl_coef" in caplog.text  # said with what it changed, not "no override"
        assert ctl._control_errors == {8: ["refused: lr < 0"]}  # the trainer's refusal, once
    finally:
        wd.close()


def test_a_confirmation_read_in_a_tick_whose_commit_fails_is_counted_once_when_read_again(tmp_path: Path) -> None:
    # The trainer's ``applied`` event closes a sent live set and counts it on /metrics; a tick whose commit
    # then fails reads it again next tick, and /metrics must count it once (it counted it twice).
    from ppo_watchdog.observe.telemetry import WatchdogMetrics

    runs = _runs(tmp_path, 1)
    wd = _daemon(tmp_path, runs)
    try:
        wd.telemetry = WatchdogMetrics()
        metrics = wd.telemetry
        wd.actuator._on_action = lambda run, rule, kind, outcome, step, said: metrics.action(run, rule, kind, outcome)
        ctl = next(iter(wd.controllers.values()))
        run_id = ctl.run.run_id
        aid = wd.store.add_action(run_id, "live_set", {"rule": "kl_high", "set": {"algorithm.kl_ctrl.kl_coef": 0.002}})
        wd.store.update_action(aid, status="sent", control_version=1, deadline=time.time() + 600)
        ctl.run.control_version = 1
        wd.store.update_run(run_id, control_version=1)
        _append(runs[0], 1, 0.01)
        rundir.append_event(runs[0], "applied", 1, version=1, commands=[])
        counted = {"run": run_id, "rule": "kl_high", "kind": "live_set", "outcome": "ok"}
        db = wd.store._db = _CountingDb(wd.store._db)
        db.fail = 1
        wd.tick()
        assert wd.store.get_action(aid).status == "sent"  # the confirmation went with the commit
        assert wd.telemetry.registry.get_sample_value("watchdog_actions_total", counted) is None
        wd.tick()
        assert wd.store.get_action(aid).status == "done"
        assert wd.telemetry.registry.get_sample_value("watchdog_actions_total", counted) == 1
    finally:
        wd.close()


def test_a_commit_failing_for_one_chunk_of_runs_keeps_the_other_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "DECIDE_CHUNK", 2)  # five runs: three transactions a tick
    runs = _runs(tmp_path, 5)
    wd = _daemon(tmp_path, runs)
    try:
        db = wd.store._db = _CountingDb(wd.store._db)
        for d in runs:
            _append(d, 1, math.nan)
        real = db.execute

        def execute(sql: str, *args: Any) -> Any:
            if sql.strip().upper() == "COMMIT" and db.commits == 1:  # the second chunk's commit
                db.fail = 1
            return real(sql, *args)

        db.execute = execute  # type: ignore[method-assign]
        wd.tick()
        assert sorted(d["run_id"] for d in wd.store.decisions()) == ["run0", "run1", "run4"]
        db.execute = real  # type: ignore[method-assign]
        wd.tick()  # the second chunk's runs read their line again, and decide on it once
        assert sorted(d["run_id"] for d in wd.store.decisions()) == [f"run{i}" for i in range(5)]
    finally:
        wd.close()


@pytest.mark.parametrize("stage", ["_evaluate", "_commit"])
def test_one_run_failing_its_read_or_its_write_undoes_only_its_own_part_of_the_tick(
        nan_daemon: Any, stage: str) -> None:
    # _evaluate: the rules, run before the chunk's transaction (nothing of the run's is written yet);
    # _commit: after the run wrote its decision into the transaction (its savepoint must take that back).
    wd = nan_daemon
    bad = wd.controllers["run1"]
    real = getattr(bad, stage)
    failures = iter([RuntimeError(f"injected: this run's {stage} failed")])

    def fail_once(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return out

    setattr(bad, stage, fail_once)
    wd.tick()
    assert sorted(d["run_id"] for d in wd.store.decisions()) == ["run0", "run2"]
    assert wd._tick_errors["run1"].startswith("RuntimeError: injected")
    assert bad.run.last_step is None  # its read went back with it
    wd.tick()  # run1 reads the same line again and decides on it, once
    assert sorted(d["run_id"] for d in wd.store.decisions()) == ["run0", "run1", "run2"]


def test_a_chunk_reads_and_runs_its_rules_without_holding_the_state_databases_write_lock(nan_daemon: Any) -> None:
    # Another writer of the state (a `watchdog resume`, a second daemon process) waits for a chunk's
    # writes only, not for its reads and rules: while run1's rules run, a write elsewhere goes through.
    wd = nan_daemon
    ctl = wd.controllers["run1"]
    real = ctl._run_engine
    other = sqlite3.connect(str(wd.store.path), timeout=0.0, isolation_level=None)
    wrote: list[str] = []

    def run_engine(*a: Any, **k: Any) -> Any:
        other.execute("BEGIN IMMEDIATE")  # "database is locked" at once if the daemon held the lock
        other.execute("ROLLBACK")
        wrote.append("ok")
        return real(*a, **k)

    ctl._run_engine = run_engine  # type: ignore[method-assign]
    wd.tick()
    other.close()
    assert wrote == ["ok"]
    assert sorted(d["run_id"] for d in wd.store.decisions()) == ["run0", "run1", "run2"]


def test_attaching_a_run_with_a_running_trainer_reads_its_run_json_once(
        tmp_path: Path, counted: list[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    trainer = [sys.executable, "-c", "import time; time.sleep(600)"]
    started = time.time()
    proc = subprocess.Popen(trainer)
    RunInfo(pid=proc.pid, command=trainer, started=started).write(run)
    (tmp_path / "rules.yaml").write_text(NAN_RULE)
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(tmp_path / "rules.yaml")],
                                   "runs": [{"run_dir": str(run), "restart_command": trainer}]}))
    try:
        wd = prepare_daemon(load_daemon_config(cfg))
        try:
            ctl = wd.controllers["run"]
            assert ctl.h.proc is not None and ctl.h.proc.pid == proc.pid  # adopted, from that one read
            assert [c for c in counted if Path(c) == run] == [str(run)]
            assert ctl.setup.mode == "embedded" and ctl.setup.checkpoint_dir == run / rundir.CHECKPOINTS
        finally:
            wd.close()
    finally:
        proc.kill()
        proc.wait()


def test_attaching_a_zero_patch_run_writes_run_json_once_and_reads_it_no_more(
        tmp_path: Path, counted: list[str]) -> None:
    run = tmp_path / "run"
    (tmp_path / "rules.yaml").write_text(NAN_RULE)
    command = ["python3", "-m", "verl.trainer.main_ppo", "trainer.default_local_dir=ckpts"]
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(tmp_path / "rules.yaml")],
                                   "runs": [{"run_dir": str(run), "restart_command": command, "mode": "verl"}]}))
    wd = prepare_daemon(load_daemon_config(cfg))
    try:
        ctl = wd.controllers["run"]
        # init_run reads the run.json an earlier attach may have left, then writes the new one: that one read.
        assert [c for c in counted if Path(c) == run] == [str(run)]
        assert ctl.setup.mode == "verl" and ctl.h.dialect.ckpt_dir == ctl.setup.checkpoint_dir
        assert ctl.setup.checkpoint_dir.name == "ckpts" and ctl.setup.checkpoint_dir.is_absolute()
        assert RunInfo.read(run).zero_patch
    finally:
        wd.close()


@pytest.mark.parametrize("value", [{"a": 1.5, "b": None, "c": [1, 2, {"d": "x"}]}, {"n": 2**70}, {}, [0.1, -3]])
def test_state_json_is_what_the_standard_decoder_reads_back(value: Any) -> None:
    assert json.loads(rundir.dumps(value)) == value


def test_state_json_keeps_nan_and_infinity_which_orjson_would_write_as_null() -> None:
    text = rundir.dumps({"last": {"step": 3, "data": {"kl": math.nan, "x": 1.0}}, "y": [math.inf, None]})
    back = json.loads(text)
    assert math.isnan(back["last"]["data"]["kl"]) and back["y"] == [math.inf, None]


def test_a_tick_freezes_what_it_leaves_alive_and_the_hourly_full_pass_finds_cycles_that_died_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a tick leaves alive (windows, states) is moved out of the collector's reach, so the next tick's
    # collections do not walk it; a cycle among those objects that dies later is found by the full pass.
    runs = _runs(tmp_path, 2)
    wd = _daemon(tmp_path, runs)
    wd.freeze_survivors = True  # as a daemon's serve_forever sets it
    before = gc.get_threshold()
    try:
        class Cycle:
            me: Any

        dead = Cycle()
        dead.me = dead
        freed: list[bool] = []
        weakref.finalize(dead, freed.append, True)
        del dead  # garbage already at the tick's end: collected, not frozen
        cycle = Cycle()
        cycle.me = cycle
        found: list[bool] = []
        weakref.finalize(cycle, found.append, True)
        gc.disable()  # (so that only the tick's own pass can find the dead one)
        try:
            _append(runs[0], 1, 0.01)
            wd.tick()
        finally:
            gc.enable()
        assert freed == [True]
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[2] > 10**9  # the oldest generation's passes are the daemon's own
        assert gc.get_threshold()[0] >= daemon.GC_YOUNG_EVERY  # the youngest's come after that many allocations
        del cycle
        gc.collect()
        assert found == []  # frozen: no ordinary collection looks at it
        monkeypatch.setattr(daemon, "FULL_GC_EVERY_S", 0.0)  # the hour has passed
        wd.tick()
        assert found == [True]
        assert gc.get_freeze_count() > 0  # and what is alive is frozen again
    finally:
        wd.close()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before  # a closed daemon leaves the collector as it was


def test_a_run_that_cannot_even_be_put_back_fails_its_own_tick_and_the_others_decide(nan_daemon: Any) -> None:
    # Fault injection: run1's read fails, and so does reading its history back to put it where it was
    # (a file that became unreadable). That is run1's failed tick; the other runs are read, decided, acted on.
    wd = nan_daemon
    bad = wd.controllers["run1"]

    def fail(*a: Any, **k: Any) -> Any:
        raise OSError(5, "injected: Input/output error")

    bad.tailer.poll = fail  # type: ignore[method-assign]
    bad._rebuild_window = fail  # type: ignore[method-assign]
    wd.tick()
    assert sorted(d["run_id"] for d in wd.store.decisions()) == ["run0", "run2"]
    assert "injected" in wd._tick_errors["run1"]


def test_a_chunk_whose_transaction_cannot_begin_reads_no_idle_runs_history_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _runs(tmp_path, 3)
    wd = _daemon(tmp_path, runs)
    try:
        _append(runs[0], 1, 0.01)
        wd.tick()
        _append(runs[0], 2, 0.01)  # run0 has a new line; run1 and run2 have nothing new
        rebuilt: list[str] = []
        for run_id, ctl in wd.controllers.items():
            real = ctl._rebuild_window

            def rebuild(*a: Any, run_id: str = run_id, real: Any = real) -> Any:
                rebuilt.append(run_id)
                return real(*a)

            ctl._rebuild_window = rebuild  # type: ignore[method-assign]
        db = wd.store._db
        wd.store._db = _Refusing(db)  # fault injection: the state stays locked past the busy timeout
        wd.tick()
        assert rebuilt == ["run0"]  # the run whose read moved goes back; the idle ones had nothing to undo
        assert all("locked" in why for why in wd._tick_errors.values()) and len(wd._tick_errors) == 3
        wd.store._db = db
        wd.tick()
        assert wd.controllers["run0"].run.last_step == 2
    finally:
        wd.close()


class _Refusing(_CountingDb):
    """The store's connection refusing to begin a write transaction, as SQLite does past its busy timeout."""

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.strip().upper().startswith("BEGIN"):
            raise sqlite3.OperationalError("database is locked")
        return self._db.execute(sql, *args)
