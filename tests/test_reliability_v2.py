"""Reliability v2 (issue 20): each finding failed on the main of its day; see RELIABILITY.md.

One watchdog per run, SIGTERM is not desertion, a pid is checked before it is trusted, one bad
run never blinds the daemon, steps only go forward, and bad inputs exit 2 naming what is wrong.
Real processes, real files and SQLite throughout; the trainers are small stub scripts (started
as the watchdog starts any trainer) where the embedded one would only add minutes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from test_reliability import NAN_RULE  # noqa: E402 - one notify-on-NaN rule for both files
from typer.testing import CliRunner

from ppo_watchdog.backends.local import LocalProcess, not_the_trainer, start_ticks
from ppo_watchdog.cli import app
from ppo_watchdog.control.daemon import build_watchdog, load_daemon_config, prepare_daemon
from ppo_watchdog.control.store import Phase, Store
from ppo_watchdog.protocol import lock as locks
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.runinfo import RunInfo

#: A trainer that says it is up, then trains (sleeps) until stopped; SIGTERM ends it at once.
SLEEPER = textwrap.dedent("""\
    import sys, time
    print("ready", flush=True)
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 600)
""")


def _rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(NAN_RULE)
    return path


def _sleeper(tmp_path: Path) -> Path:
    path = tmp_path / "sleeper.py"
    path.write_text(SLEEPER)
    return path


def _wait(cond: Callable[[], bool], what: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{what}: the watchdog exited {proc.returncode}: {out}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _run_cmd(tmp_path: Path, run: Path, state: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run), "--state-dir", str(state), "--no-report",
            "--tick", "0.2", *extra, "--", sys.executable, str(_sleeper(tmp_path))]


@pytest.fixture
def first_watchdog(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, Path]]:
    """A `watchdog run` supervising a sleeping trainer, up and running; stopped at the end of the test."""
    run, state = tmp_path / "run", tmp_path / "state"
    proc = subprocess.Popen(_run_cmd(tmp_path, run, state), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: (run / "trainer.log").exists() and "ready" in (run / "trainer.log").read_text(),
              "the trainer to start", proc=proc)
        yield proc, run, state
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        holder = locks.read_holder(run / locks.TRAINER_LOCK)
        if isinstance(holder.get("pid"), int) and _alive(holder["pid"]):
            os.killpg(holder["pid"], signal.SIGKILL)


# -- 1. one watchdog per run and per state ---------------------------------------------------------


@pytest.mark.slow
def test_a_second_watchdog_on_a_watched_run_dir_or_state_is_refused_naming_the_holder(
        tmp_path: Path, first_watchdog: tuple[subprocess.Popen[str], Path, Path]) -> None:
    proc, run, state = first_watchdog
    # The same run dir and state; the same run dir with another state; another run dir on the same state.
    for run_dir, state_dir, held in ((run, state, "the state"), (run, tmp_path / "state2", "the run"),
                                     (tmp_path / "other", state, "the state")):
        second = subprocess.run(_run_cmd(tmp_path, run_dir, state_dir), capture_output=True, text=True, timeout=120)
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert f"{held} is held by a watchdog (pid {proc.pid} on host" in " ".join(out.split()), out
        assert "Traceback" not in out
    started = [ln for ln in (run / "trainer.log").read_text().splitlines() if ln == "ready"]
    assert len(started) == 1  # one trainer, never a second in the same run dir
    assert not (tmp_path / "other" / "trainer.log").exists()


@pytest.mark.slow
def test_a_run_whose_watchdog_died_is_never_given_a_second_trainer(
        tmp_path: Path, first_watchdog: tuple[subprocess.Popen[str], Path, Path]) -> None:
    proc, run, state = first_watchdog
    trainer_pid = Store(state).require_run("run").pid
    proc.send_signal(signal.SIGKILL)  # the watchdog dies; its trainer trains on, holding its trainer lock
    proc.wait(30)
    r = subprocess.run(_run_cmd(tmp_path, run, tmp_path / "elsewhere"), capture_output=True, text=True, timeout=120)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and f"a trainer is running there: a trainer (pid {trainer_pid} on host" in out, out
    assert _alive(trainer_pid)
    # The watchdog's own state knows that trainer: `watchdog run` adopts it instead (and stops it on SIGTERM).
    again = subprocess.Popen(_run_cmd(tmp_path, run, state), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    _wait(lambda: locks.holder_if_held(run / locks.RUN_LOCK) is not None, "the run dir to be taken", proc=again)
    again.send_signal(signal.SIGTERM)
    out = again.communicate(timeout=60)[0]
    assert again.returncode == 143, out
    assert not _alive(trainer_pid), out
    assert sum(ln == "ready" for ln in (run / "trainer.log").read_text().splitlines()) == 1


@pytest.mark.slow
def test_two_watchdogs_racing_on_one_run_dir_give_it_one_watchdog_and_one_trainer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    procs = [subprocess.Popen(_run_cmd(tmp_path, run, tmp_path / f"state{i}"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        _wait(lambda: any(p.poll() is not None for p in procs), "one of the two to be refused", timeout=120)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        out = loser.communicate()[0]
        assert loser.returncode == 2, out
        assert f"the run is held by a watchdog (pid {winner.pid} on host" in " ".join(out.split()), out
        _wait(lambda: (run / "trainer.log").exists() and "ready" in (run / "trainer.log").read_text(),
              "the winner's trainer to start", proc=winner)
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(60) == 143
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sum(ln == "ready" for ln in (run / "trainer.log").read_text().splitlines()) == 1
    states = [tmp_path / f"state{i}" for i in range(2) if (tmp_path / f"state{i}" / "watchdog.db").exists()]
    assert sum(Store(s, read_only=True).run_for_dir(run) is not None for s in states) == 1  # the loser recorded nothing


def test_a_daemon_refuses_a_state_another_watchdog_holds(tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(_rules(tmp_path))]}))
    holder = prepare_daemon(load_daemon_config(cfg))
    try:
        r = CliRunner().invoke(app, ["daemon", "--config", str(cfg)])
        assert r.exit_code == 2, r.output
        assert f"the state is held by a watchdog (pid {os.getpid()} on host" in " ".join(r.output.split())
    finally:
        holder.close()
    assert locks.holder_if_held(tmp_path / "state" / locks.STATE_LOCK) is None  # dies with its holder


# -- 2. SIGTERM and SIGHUP are a clean stop ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_stops_the_trainer_and_records_the_run_as_stopped(
        tmp_path: Path, first_watchdog: tuple[subprocess.Popen[str], Path, Path], sig: int) -> None:
    proc, run, state = first_watchdog
    pid = Store(state).require_run("run").pid
    proc.send_signal(sig)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + sig, out
    assert "interrupted: stopping the trainer" in out and "Traceback" not in out
    assert not _alive(pid)
    store = Store(state)
    assert store.require_run("run").phase == Phase.STOPPED
    (d,) = [d for d in store.decisions("run") if d["rule"] == "watchdog:shutdown"]
    assert signal.Signals(sig).name in d["outcome"] and "trainer stopped" in d["outcome"]


@pytest.mark.slow
def test_a_daemon_stopped_by_sigterm_says_which_trainers_it_leaves_and_status_shows_them_unsupervised(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({
        "state_dir": str(tmp_path / "state"), "rules": [str(_rules(tmp_path))], "tick_s": 0.2,
        "runs": [{"run_dir": str(run), "restart_command": [sys.executable, str(_sleeper(tmp_path))]}]}))
    proc = subprocess.Popen([sys.executable, "-m", "ppo_watchdog", "daemon", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid = None
    try:
        _wait(lambda: (run / "trainer.log").exists() and "ready" in (run / "trainer.log").read_text(),
              "the trainer to start", proc=proc)
        pid = Store(tmp_path / "state").require_run("run").pid
        r = CliRunner().invoke(app, ["status", "--json", "--state-dir", str(tmp_path / "state")])
        assert json.loads(r.output)[0]["watchdog"]["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, out
        assert "1 trainer(s) left running UNSUPERVISED" in out and f"pid {pid}" in out, out
        assert _alive(pid)  # left for the next daemon to adopt
        r = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path / "state")], env={"COLUMNS": "300"})
        assert r.exit_code == 0 and f"UNSUPERVISED: a trainer (pid {pid} on host" in " ".join(r.output.split())
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and _alive(pid):
            os.killpg(pid, signal.SIGKILL)


# -- 3. a pid is an identity -------------------------------------------------------------------------


def test_an_unrelated_pid_in_run_json_is_never_adopted_signalled_or_killed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    bystander = subprocess.Popen(["sleep", "600"])
    trainer = [sys.executable, str(_sleeper(tmp_path))]
    RunInfo(pid=bystander.pid, command=trainer, started=time.time()).write(run)  # stale, or hand-written
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(_rules(tmp_path))],
                                   "controller": {"heartbeat_min_s": 0.1, "startup_timeout_s": 0.1},
                                   "runs": [{"run_dir": str(run), "restart_command": trainer}]}))
    wd = prepare_daemon(load_daemon_config(cfg))
    try:
        ctl = wd.controllers["run"]
        assert ctl.h.proc is None  # not adopted: it runs `sleep 600`, not the trainer's command
        wd.tick()
        assert ctl.h.proc is not None and ctl.h.proc.pid != bystander.pid  # the run's own trainer
        time.sleep(0.5)
        for _ in range(3):  # past the (tiny) hang timeout: the watchdog restarts its trainer, never the bystander
            wd.tick()
        assert bystander.poll() is None
    finally:
        for c in wd.controllers.values():
            wd.actuator.stop(c.h)
        wd.close()
        bystander.kill()
        bystander.wait()


def test_a_pid_reused_by_another_process_is_not_the_trainer(tmp_path: Path) -> None:
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        ticks = start_ticks(bystander.pid)
        assert ticks is not None
        # The trainer lock's note: a trainer of that pid that started earlier (the pid was reused since).
        (tmp_path / locks.TRAINER_LOCK).write_text(json.dumps({"pid": bystander.pid, "start_ticks": ticks - 100}))
        assert "the pid was reused" in (not_the_trainer(bystander.pid, tmp_path) or "")
        (tmp_path / locks.TRAINER_LOCK).unlink()
        RunInfo(pid=bystander.pid, started=time.time() - 3600).write(tmp_path)  # run.json older than the process
        assert "started at" in (not_the_trainer(bystander.pid, tmp_path) or "")
        # A handle attached to the trainer whose pid is then given to another process: gone, never signalled.
        handle = LocalProcess(bystander.pid)
        handle.start_ticks = ticks - 100
        assert not handle.alive() and not handle.signal(signal.SIGTERM)
        handle.stop(grace=0.2)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_an_oom_event_from_before_the_attempt_is_not_counted_against_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with open(run / rundir.EVENTS, "a") as f:  # an earlier trainer's OOM, long before this watchdog
        f.write(json.dumps({"ts": time.time() - 3600, "step": 7, "kind": "oom", "micro_batch_size": 8}) + "\n")
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    ctl = wd.add_run(run, command=[sys.executable, str(_sleeper(tmp_path)), "1"])
    deadline = time.monotonic() + 60
    while not ctl.tick().done:
        assert time.monotonic() < deadline, ctl.run.phase
        time.sleep(0.1)
    assert ctl.run.phase == Phase.FINISHED
    assert not [d for d in wd.store.decisions(ctl.run.run_id) if d["rule"] == "watchdog:oom"]
    wd.close()


# -- 4. bad run, not bad daemon ----------------------------------------------------------------------


def _healthy_then_nan(run: Path) -> None:
    for step, v in ((1, 0.01), (2, float("nan"))):
        rundir.append_metrics(run, step, {"actor/reward_kl_penalty": v, "critic/score/mean": 0.5})


def test_a_daemon_with_ten_healthy_runs_and_one_garbled_watches_all_ten(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dirs = [tmp_path / f"run{i:02d}" for i in range(11)]
    for d in dirs:
        d.mkdir()
        _healthy_then_nan(d)
    (dirs[5] / rundir.RUN_JSON).write_text("[1, 2, 3]")  # a run.json that is a JSON list
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "rules": [str(_rules(tmp_path))],
                                   "runs": [str(d) for d in dirs]}))
    wd = prepare_daemon(load_daemon_config(cfg))
    try:
        wd.tick()
        wd.tick()
        watched = {c.run.run_dir for c in wd.controllers.values()}
        assert watched == {str(d) for d in dirs if d != dirs[5]}
        for c in wd.controllers.values():  # each of the ten is really watched: its NaN decided
            assert [d["step"] for d in wd.store.decisions(c.run.run_id)] == [2], c.run.run_id
        assert list(wd.unwatched) == [str(dirs[5])] and "top level must be an object" in wd.unwatched[str(dirs[5])]
        alerts = [p for p in wd.actuator.notifier.sent if p["alerts"][0]["labels"]["rule"] == "watchdog:unwatched"]
        assert len(alerts) == 1  # alerted once
        (dirs[5] / rundir.RUN_JSON).write_text("{}")  # fixed: watched from the next retry on
        wd.retry_unwatched(time.time() + 60)
        assert str(dirs[5]) in {c.run.run_dir for c in wd.controllers.values()} and not wd.unwatched
    finally:
        wd.close()


def test_a_foreground_run_with_a_garbled_run_json_exits_2_naming_file_and_field(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.RUN_JSON).write_text(json.dumps({"pid": "twelve"}))
    r = CliRunner().invoke(app, ["run", "--run-dir", str(run), "--state-dir", str(tmp_path / "state"), "--",
                                 sys.executable, str(_sleeper(tmp_path))])
    assert r.exit_code == 2, r.output
    assert f"{run / rundir.RUN_JSON}: 'pid': must be an integer" in " ".join(r.output.split())
    assert not (run / "trainer.log").exists()


def test_a_trainer_that_finishes_while_its_run_json_is_garbled_is_seen_to_finish_and_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    ctl = wd.add_run(run, command=[sys.executable, str(_sleeper(tmp_path)), "1.5"])
    wd.tick()  # launched
    (run / rundir.RUN_JSON).write_text("[]")
    _healthy_then_nan(run)
    deadline = time.monotonic() + 60
    with caplog.at_level(logging.ERROR):
        while not wd.tick():
            assert time.monotonic() < deadline, ctl.run.phase
            time.sleep(0.1)
    assert ctl.run.phase == Phase.FINISHED
    said = [r for r in caplog.records if "tick failed" in r.getMessage()]
    assert len(said) == 1 and "top level must be an object" in said[0].getMessage(), [r.getMessage() for r in said]
    assert said[0].exc_info is None  # a known error: its message, not a traceback
    wd.close()


# -- 5. steps only go forward within an attempt -------------------------------------------------------


def test_a_metrics_line_for_a_step_already_passed_is_reported_and_ignored(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in range(1, 46):
        rundir.append_metrics(run, step, {"actor/reward_kl_penalty": 0.01, "critic/score/mean": 0.5})
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    ctl = wd.add_run(run, managed=False)
    wd.tick()
    rundir.append_metrics(run, 25, {"actor/reward_kl_penalty": float("nan"), "critic/score/mean": 0.5})
    wd.tick()
    assert wd.store.decisions(ctl.run.run_id) == []  # not acted on
    assert any("metrics.jsonl:46: step 25 is below the last step 45" in i for i in ctl.tailer.issues), ctl.tailer.issues
    rundir.append_metrics(run, 46, {"actor/reward_kl_penalty": 0.01, "critic/score/mean": 0.5})
    wd.tick()
    assert ctl.run.last_step == 46
    # A real rewind (the trainer says so first) is taken: the NaN on the new timeline is decided.
    rundir.append_event(run, "rollback", 20, from_step=46, to_step=20)
    rundir.append_metrics(run, 21, {"actor/reward_kl_penalty": float("nan"), "critic/score/mean": 0.5})
    wd.tick()
    assert [d["step"] for d in wd.store.decisions(ctl.run.run_id)] == [21]
    # A restarted watchdog rebuilds the same window: the stray line stays ignored.
    wd.close()
    again = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    assert again.add_run(run, managed=False).window.steps()[-1] == 21
    again.close()


# -- 6. no command writes into a state it was only asked to read ---------------------------------------


def test_status_on_a_zero_byte_state_writes_nothing_into_it(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    db = tmp_path / "state" / "watchdog.db"
    db.write_bytes(b"")
    for args in (["status"], ["history"], ["report", "r", "--out", str(tmp_path / "r.html")]):
        r = CliRunner().invoke(app, [*args, "--state-dir", str(tmp_path / "state")])
        assert "Traceback" not in r.output and "empty file" in r.output, r.output
        assert db.stat().st_size == 0, args


# -- 6. every bad input a clean error, exit 2 ---------------------------------------------------------

DEEP = "[" * 500 + "]" * 500


def _daemon_cfg(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "daemon.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(("make", "message"), [
    (lambda t: ["daemon", "--config", str(_daemon_cfg(t, "runs: " + DEEP))], "nested too deeply"),
    (lambda t: ["daemon", "--config", str(_daemon_cfg(t, bytes(range(256)) * 4))], "not a text file"),
    (lambda t: ["daemon", "--config", str(_daemon_cfg(t, yaml.safe_dump({"state_dir": str(_file(t))})))],
     "not a directory"),
    (lambda t: ["daemon", "--config", str(_daemon_cfg(t, yaml.safe_dump({"state_dir": str(t / "s"),
                                                                       "metrics_port": _busy_port()})))],
     "cannot serve /metrics"),
    (lambda t: ["run", "--run-dir", str(t / "ünï"), "--state-dir", str(t / "s")],
     "not a path the trainer can be given as trainer.run_dir"),
    (lambda t: ["run", "--metrics-port", "99999", "--run-dir", str(t / "r"), "--state-dir", str(t / "s"), "--",
                "true"], "metrics port 99999: cannot serve /metrics"),
    (lambda t: ["run", "--metrics-port", str(_busy_port()), "--run-dir", str(t / "r"), "--state-dir", str(t / "s"),
                "--", "true"], "cannot serve /metrics"),
    (lambda t: ["dashboards", "export", str(_file(t) / "sub")], "cannot write the dashboards there"),
    (lambda t: ["report", "r", "--out", str(_file(t) / "r.html"), "--state-dir", str(_state_with_a_run(t))],
     "cannot be written"),
], ids=["daemon-yaml-500-deep", "daemon-binary-config", "daemon-state-dir-a-file", "daemon-metrics-port-in-use",
        "run-non-ascii-run-dir", "run-metrics-port-99999", "run-metrics-port-in-use", "dashboards-export-uncreatable",
        "report-out-uncreatable"])
def test_a_bad_input_is_a_clean_error_naming_it_and_exit_2(tmp_path: Path, make: Callable[[Path], list[str]],
                                                           message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = make(tmp_path)
    r = CliRunner().invoke(app, args)
    out = " ".join(r.output.split())
    assert r.exit_code == 2, (r.output, r.exc_info)
    assert message in out and "Traceback" not in out, out
    assert not (tmp_path / "ünï").exists()  # nothing was started for a run dir no launch could take


_held: list[object] = []


def _busy_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    _held.append(s)  # held until the test session ends
    return int(s.getsockname()[1])


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


def _state_with_a_run(tmp_path: Path) -> Path:
    from ppo_watchdog.control.store import RunRecord

    run = tmp_path / "r"
    run.mkdir()
    _healthy_then_nan(run)
    store = Store(tmp_path / "s")
    store.upsert_run(RunRecord("r", str(run)))
    store.close()
    return tmp_path / "s"


def test_yaml_nested_500_deep_is_a_rule_file_error_not_a_recursion_error(tmp_path: Path) -> None:
    from ppo_watchdog.core.rulefile import RuleFileError, load_rules
    from ppo_watchdog.core.ruletest import run_rule_tests

    path = tmp_path / "deep.yaml"
    path.write_text("version: 1\nrules: " + DEEP + "\n")
    with pytest.raises(RuleFileError, match="nested too deeply"):
        load_rules(path)
    results = run_rule_tests([path])
    assert results and not any(r.passed for r in results)
    assert "nested too deeply" in " ".join(f for r in results for f in r.failures)


def test_rules_test_bounds_an_input_series(tmp_path: Path) -> None:
    from ppo_watchdog.core.ruletest import SeriesError, parse_series

    with pytest.raises(SeriesError, match="'0x999999999999' makes the series longer than 100,000 steps"):
        parse_series("1 2 0x999999999999")
    assert len(parse_series("0x99999")) == 100_000
    rules = _rules(tmp_path)
    test = tmp_path / "t.yaml"
    test.write_text(yaml.safe_dump({"rule_files": [str(rules)], "tests": [
        {"name": "huge", "input_series": {"kl": "0x999999999999"}},
        {"name": "far event", "input_series": {"kl": "0"}, "events": [{"step": 10**12, "kind": "oom"}]}]}))
    r = CliRunner().invoke(app, ["rules", "test", str(test)])
    assert r.exit_code != 0 and "longer than 100,000 steps" in r.output and "event step must be" in r.output, r.output
    assert "Traceback" not in r.output


def test_deeply_nested_json_in_run_json_control_json_and_jsonl_is_an_error_naming_the_file(tmp_path: Path) -> None:
    from ppo_watchdog.protocol.control import ControlError, read_control
    from ppo_watchdog.protocol.runinfo import RunInfoError

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / rundir.RUN_JSON).write_text(deep)
    with pytest.raises(RunInfoError, match="nested too deeply"):
        RunInfo.read(tmp_path)
    (tmp_path / rundir.CONTROL).write_text(deep)
    with pytest.raises(ControlError, match="nested too deeply"):
        read_control(tmp_path)
    (tmp_path / rundir.METRICS).write_text(deep + "\n" + json.dumps({"step": 1, "data": {}}) + "\n")
    chunk = rundir.read_jsonl(tmp_path / rundir.METRICS)
    assert [r["step"] for r in chunk.records] == [1] and "metrics.jsonl:1: JSON nested too deeply" in chunk.errors[0]
