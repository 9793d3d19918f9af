"""The Ray Job backend: pure mappings, a job server that is down, and a real local Ray head.

The head is started once for this file (``ray start --head --block`` on 127.0.0.1, one CPU,
its own temp dir and ports) and torn down by the process ids it started, so a Ray that
something else runs on this machine is never touched. The end-to-end test runs
``watchdog run --ray-address`` on the embedded trainer with an injected OOM: the trainer is
a Ray Job, dies of the OOM (exit 75, as Ray reports it), and is resubmitted with a smaller
micro batch, resuming from its checkpoint, until it finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainer import rundir
from watchdog.controller import classify_exit
from watchdog.store import Store
from watchdog.supervisor import BackendUnavailable, SupervisorError
from watchdog.supervisor_ray import (
    LOG_HEADER,
    RayJobBackend,
    check_address_env,
    entrypoint,
    exit_code_for,
    next_attempt,
    submission_id,
)

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
QUIET_RULE = """version: 1
rules:
  - name: kl_never
    description: never fires, so only the watchdog's own OOM handling acts
    expr: kl > 100
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 2.0}
"""
LIVE_RULE = """version: 1
rules:
  - name: kl_high
    description: raises kl_coef, live, once at the first step
    expr: step >= 1
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 2.0, max: 1.0}
    cooldown: 1000
    severity: warning
"""


def _missing_ray_default_extras() -> list[str]:
    """Distributions of ``ray[default]`` (what the dashboard and its job server need) not installed."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    try:
        reqs = [Requirement(r) for r in requires("ray") or []]
    except PackageNotFoundError:
        return ["ray"]
    missing = []
    for req in reqs:
        if req.marker is None or not req.marker.evaluate({"extra": "default"}) or req.marker.evaluate({"extra": ""}):
            continue  # a base dependency, or one of another extra / another Python
        try:
            version(req.name)
        except PackageNotFoundError:
            missing.append(req.name)
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _no_ray_address_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}


# -- pure -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "driver_code", "message", "code", "how"), [
    ("SUCCEEDED", 0, "", 0, "finished"),
    ("FAILED", rundir.EXIT_OOM, "Job entrypoint command failed with exit code 75", rundir.EXIT_OOM, "oom"),
    ("FAILED", 1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", rundir.EXIT_OOM, "oom"),
    ("FAILED", 3, "ValueError: bad batch", 3, "crash"),
    ("FAILED", None, "runtime_env setup failed", 1, "crash"),
    ("STOPPED", None, "", rundir.EXIT_STOPPED, "finished"),
    ("RUNNING", None, "", None, None),
    ("PENDING", None, "", None, None),
])
def test_job_status_maps_to_the_exit_code_the_controller_classifies(status, driver_code, message, code, how):
    assert exit_code_for(status, driver_code, message) == code
    if how is not None:
        assert classify_exit(code, saw_finished=False, saw_oom=False) == how


def test_submission_ids_number_the_launches_of_a_run():
    assert submission_id("exp 1/a", 1) == "exp_1_a-1"
    existing = ["exp-1", "exp-3", "exp-x", "expo-9", "other-7", "exp-2"]
    assert next_attempt("exp", existing) == 4
    assert next_attempt("fresh", existing) == 1


def test_entrypoint_is_one_shell_line_that_gives_back_every_argument():
    import shlex

    cmd = [sys.executable, "-m", "trainer", "trainer.run_dir=/srv/runs/a b", "x=$HOME", "y='q'"]
    assert shlex.split(entrypoint(cmd)) == cmd
    line = entrypoint(cmd, cwd="/srv/my runs")
    assert line.startswith("cd '/srv/my runs' && ") and shlex.split(line.split(" && ", 1)[1]) == cmd
    with pytest.raises(SupervisorError, match="empty command"):
        entrypoint([])


def test_a_ray_address_env_that_would_override_the_given_address_is_refused():
    check_address_env("http://127.0.0.1:8265", {})
    check_address_env("http://127.0.0.1:8265", {"RAY_ADDRESS": "http://127.0.0.1:8265/"})
    with pytest.raises(SupervisorError, match=r"RAY_ADDRESS='http://10.0.0.9:8265'.*override"):
        check_address_env("http://127.0.0.1:8265", {"RAY_ADDRESS": "http://10.0.0.9:8265"})


# -- a job server that is down -----------------------------------------------------------------


def test_submitting_to_a_down_job_server_raises_an_error_naming_its_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    address = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(BackendUnavailable, match=f"Ray job server at {address} is not reachable"):
        RayJobBackend(address, "r").start([sys.executable, "-c", "pass"])


def test_watchdog_run_against_a_down_head_exits_non_zero_naming_it_and_writes_nothing(tmp_path, monkeypatch):
    from watchdog import cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    address = f"http://127.0.0.1:{_free_port()}"
    result = CliRunner().invoke(cli.app, [
        "run", "--ray-address", address, "--run-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
        "--no-report", "--", sys.executable, "-c", "pass",
    ])
    assert result.exit_code == 2, result.output
    assert address in result.output and "not reachable" in result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "state").exists()


def test_daemon_run_with_a_ray_address_survives_a_down_job_server_and_keeps_the_launch(tmp_path, monkeypatch):
    from watchdog.daemon import load_daemon_config, prepare_daemon
    from watchdog.supervisor_ray import RayJobBackend as Backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    rules = tmp_path / "rules.yaml"
    rules.write_text(QUIET_RULE)
    address = f"http://127.0.0.1:{_free_port()}"
    config = tmp_path / "daemon.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "state_dir": str(tmp_path / "state"), "rules": [str(rules)],
        "runs": [{"run_dir": str(tmp_path / "run"), "restart_command": [sys.executable, "-c", "pass"],
                  "ray_address": address}],
    }))
    wd = prepare_daemon(load_daemon_config(config))
    backend = wd.controllers["run"].h.backend
    assert isinstance(backend, Backend) and backend.address == address and backend.run_id == "run"
    assert wd.tick() is False and wd.tick() is False  # neither raised
    run = wd.store.require_run("run")
    assert run.phase == "new" and run.job_id is None and run.restarts == 0  # still to be launched
    assert wd.store.journal("run") == [] and wd.store.decisions("run") == []


def test_a_version_1_state_database_is_migrated_and_keeps_its_runs(tmp_path):
    import sqlite3

    from watchdog import store as store_mod

    db = sqlite3.connect(tmp_path / "watchdog.db")
    db.executescript(store_mod._SCHEMA.replace("    job_id TEXT,\n", ""))
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute("INSERT INTO runs (run_id, run_dir, pid, created, updated) VALUES ('old', '/r', 42, 1, 1)")
    db.commit()
    db.close()
    store = Store(tmp_path)
    old = store.require_run("old")
    assert old.pid == 42 and old.job_id is None
    store.update_run("old", pid=None, job_id="old-1")
    assert store.require_run("old").job_id == "old-1"
    store.close()
    db = sqlite3.connect(tmp_path / "watchdog.db")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(
        store_mod.SCHEMA_VERSION)
    db.close()


# -- a real Ray head ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RayHead:
    """A running local Ray head."""

    address: str
    """Job server (dashboard) URL."""
    temp_dir: Path
    """Ray's --temp-dir (and the cwd of the head)."""


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_job_server(address: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2) as resp:
                if resp.status == 200 and "ray_version" in json.loads(resp.read()):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"Ray job server at {address} not up within {timeout:.0f}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def ray_head(trainer_env: dict[str, str]) -> Iterator[RayHead]:
    """``ray start --head --block`` on 127.0.0.1; stopped (and every process it started killed) afterwards."""
    missing = _missing_ray_default_extras()
    if missing:
        pytest.skip(f"Ray's job server needs ray[default]; missing {', '.join(missing)} "
                    "(make test installs it from pyproject.toml)")
    # Short: Ray's unix sockets live under it, and a socket path may not exceed 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="wdray-"))
    dashboard = _free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_bin) if ray_bin.exists() else shutil.which("ray") or "ray", "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1", "--port", str(_free_port()),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--ray-client-server-port", str(_free_port()), "--dashboard-agent-listen-port", str(_free_port()),
        "--num-cpus", "1", "--include-dashboard", "true", "--disable-usage-stats", "--temp-dir", str(temp_dir),
    ]
    # The jobs inherit the head's environment: the session's SFT cache, one thread, quiet logs.
    env = {k: v for k, v in trainer_env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    log = temp_dir / "ray-start.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=temp_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_job_server(address, proc, log)
        yield RayHead(address, temp_dir)
    finally:
        # Jobs run in sessions of their own: collect every descendant before the parents go.
        started = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        _kill_pids(started + _descendants(proc.pid))
        shutil.rmtree(temp_dir, ignore_errors=True)


def _client(head: RayHead):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.address)


def test_a_job_is_attached_by_id_stopped_through_the_head_and_its_log_copied_once(ray_head, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    log_path = tmp_path / "trainer.log"
    backend = RayJobBackend(ray_head.address, "attach-me", stop_wait_s=2, log_interval_s=0)
    code = "import time; print('hello from', 'the job', flush=True); time.sleep(120)"
    proc = backend.start([sys.executable, "-c", code], env={"WD_X": "1"}, log_path=log_path)
    assert proc.job_id == "attach-me-1" and proc.pid is None
    deadline = time.monotonic() + 60
    while "hello from the job" not in (log_path.read_text() if log_path.exists() else ""):
        assert proc.alive() and time.monotonic() < deadline, log_path.read_text() if log_path.exists() else ""
        time.sleep(0.3)
    assert proc.signal(signal.SIGUSR1) is False  # Ray jobs take no signals: control.json is read at a step
    # A restarted watchdog: a new backend attaches by submission id and carries on with the same log.
    again = RayJobBackend(ray_head.address, "attach-me", stop_wait_s=2, log_interval_s=0)
    adopted = again.attach_job(proc.job_id, log_path)
    assert adopted.alive()
    assert adopted.stop(grace=5) == rundir.EXIT_STOPPED
    assert not adopted.alive()
    info = _client(ray_head).get_job_info(proc.job_id)
    assert str(info.status.value) == "STOPPED" and info.runtime_env["env_vars"]["WD_X"] == "1"
    text = log_path.read_text()
    assert text.count(LOG_HEADER.format(job_id=proc.job_id)) == 1
    assert text.count("hello from the job") == 1  # the re-attached copy did not repeat it
    # The next launch of the run continues the numbering from what the cluster holds.
    held = [j.submission_id for j in RayJobBackend(ray_head.address, "attach-me").run_jobs()]
    assert held == ["attach-me-1"] and next_attempt("attach-me", held) == 2


@pytest.mark.slow
def test_oom_in_a_ray_job_is_resubmitted_with_a_smaller_micro_batch_and_finishes(
    ray_head, tmp_path, tiny_trainer_args, trainer_env,
):
    run_dir, state = tmp_path / "run", tmp_path / "state"
    rules = tmp_path / "rules.yaml"
    rules.write_text(LIVE_RULE)
    # Steps slower than a tick (0.8 s hangs) until the OOM at step 6, so the live kl_coef change is
    # applied by the first job through control.json alone (a Ray job takes no SIGUSR1).
    faults = ",".join([*(f"hang@{s}:0.8" for s in range(1, 6)), "oom@6"])
    trainer = tiny_trainer_args(run_dir, "trainer.save_freq=2", f"trainer.faults={faults}", steps=8)
    env = {k: v for k, v in trainer_env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    cmd = [sys.executable, "-m", "watchdog", "run", "--ray-address", ray_head.address, "--run-dir", str(run_dir),
           "--state-dir", str(state), "--rules", str(rules), "--tick", "0.3", "--stop-grace", "5", "--no-report",
           "--", *trainer]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # Two jobs on the cluster: the first died of the OOM with the trainer's own exit code, the
    # second ran the smaller micro batch (8 - 1 = 7 does not divide the mini batch of 8: 4).
    jobs = RayJobBackend(ray_head.address, "run").run_jobs()
    assert [j.submission_id for j in jobs] == ["run-1", "run-2"]
    first, second = jobs
    assert str(first.status.value) == "FAILED" and first.driver_exit_code == rundir.EXIT_OOM
    assert f"{MICRO}=8" in first.entrypoint
    assert str(second.status.value) == "SUCCEEDED"
    assert f"{MICRO}=4" in second.entrypoint and "trainer.resume_mode=resume_path" in second.entrypoint

    (oom,) = rundir.iter_events(run_dir, ["oom"])
    starts = rundir.iter_events(run_dir, ["started"])
    assert len(starts) == 2 and starts[1]["resumed_from"] == oom["step"] - 1
    assert rundir.iter_events(run_dir, ["finished"])
    steps = [r["step"] for r in rundir.read_jsonl(run_dir / rundir.METRICS).records]
    assert steps == sorted(set(steps)) and steps[-1] == 8  # no step lost, none repeated

    store = Store(state)
    run = store.require_run("run")
    assert run.phase == "finished" and run.oom_retries == 1 and run.job_id == "run-2" and run.pid is None
    history = store.decisions("run")
    store.close()
    live, decision = history
    (applied,) = [e for e in rundir.iter_events(run_dir, ["applied"]) if e.get("version") == 1]
    assert live["rule"] == "kl_high" and live["status"] == "applied"
    assert live["outcome"] == f"applied v1 at step {applied['step']}" and applied["step"] < oom["step"]
    assert decision["rule"] == "watchdog:oom" and decision["status"] == "applied"
    assert decision["inputs"]["exit_code"] == rundir.EXIT_OOM  # Ray's report of the entrypoint's exit
    (restart,) = decision["journal"]
    assert restart["kind"] == "restart" and restart["result"]["resume_step"] == oom["step"] - 1
    assert restart["result"]["job_id"] == "run-2" and "(ray job run-2, prior exit 75)" in decision["outcome"]
    log = (run_dir / "trainer.log").read_text()
    for job in ("run-1", "run-2"):
        assert LOG_HEADER.format(job_id=job) in log and f"Running entrypoint for job {job}" in log
