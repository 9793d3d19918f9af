"""The Ray Job backend: pure mappings, a job server that is down, and a real local Ray head.

The head is started once for this file (``ray start --head --block`` on 127.0.0.1, one CPU,
its own temp dir and ports) and torn down by the process ids it started, so a Ray that
something else runs on this machine is never touched. The end-to-end test runs
``watchdog run --ray-address`` on the embedded trainer with an injected OOM: the trainer is
a Ray Job, dies of the OOM (exit 75, as Ray reports it), and is resubmitted with a smaller
micro batch, resuming from its checkpoint, until it finishes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
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

from ppo_watchdog.backends.dialect import classify_exit
from ppo_watchdog.backends.local import BackendUnavailable, SupervisorError
from ppo_watchdog.backends.ray_jobs import (
    LOG_HEADER,
    RayJobBackend,
    check_address_env,
    entrypoint,
    exit_code_for,
    next_attempt,
    submission_id,
)
from ppo_watchdog.control.store import Store
from ppo_watchdog.protocol import hydra, rundir
from ppo_watchdog.protocol.runinfo import RunInfo

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

    cmd = [sys.executable, "-m", "ppo_watchdog.trainer", "trainer.run_dir=/srv/runs/a b", "x=$HOME", "y='q'"]
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
    from ppo_watchdog import cli

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
    from ppo_watchdog.backends.ray_jobs import RayJobBackend as Backend
    from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon

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

    from ppo_watchdog.control import store as store_mod

    db = sqlite3.connect(tmp_path / "watchdog.db")
    v2 = (Path(__file__).parent / "data" / "store_schema_v2.sql").read_text()
    db.executescript(v2.replace("    job_id TEXT,\n", ""))
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
    token_file: Path | None
    """The file holding the cluster's auth token (None: token authentication off)."""
    log: Path
    """What ``ray start`` printed."""

    def token(self) -> str:
        assert self.token_file is not None
        return self.token_file.read_text().strip()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token()}"} if self.token_file else {}


#: Ray's token variables: removed from every environment a test hands on, so a token on this
#: machine (a ~/.ray/auth_token left by some local ray.init()) never decides a test.
RAY_TOKEN_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")


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


def _wait_for_job_server(head: RayHead, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(f"{head.address}/api/version", headers=head.headers())
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ray start exited with {proc.returncode}:\n{head.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                if resp.status == 200 and "ray_version" in json.loads(resp.read()):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"Ray job server at {head.address} not up within {timeout:.0f}s:\n"
                         f"{head.log.read_text()[-4000:]}")


@contextlib.contextmanager
def _ray_head(trainer_env: dict[str, str], auth: bool) -> Iterator[RayHead]:
    """``ray start --head --block`` on 127.0.0.1; stopped (and every process it started killed) afterwards.

    ``auth``: the way today's Ray starts by default: ``RAY_AUTH_MODE`` unset and a token where Ray
    looks (here ``$RAY_AUTH_TOKEN_PATH``, a file of the test's own), so the head turns token
    authentication on by itself. Without: ``RAY_AUTH_MODE=disabled``, the opt-out Ray names."""
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
    env = {k: v for k, v in trainer_env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", *RAY_TOKEN_ENV)}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    token_file = None
    if auth:
        token_file = temp_dir / "auth_token"
        token_file.write_text(secrets.token_hex(32))
        token_file.chmod(0o600)
        env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    head = RayHead(f"http://127.0.0.1:{dashboard}", temp_dir, token_file, temp_dir / "ray-start.log")
    with open(head.log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=temp_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_for_job_server(head, proc)
        yield head
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


@pytest.fixture(scope="module")
def ray_head(trainer_env: dict[str, str]) -> Iterator[RayHead]:
    """A head as today's Ray starts one by default: token authentication on."""
    with _ray_head(trainer_env, auth=True) as head:
        yield head


@pytest.fixture
def open_ray_head(trainer_env: dict[str, str]) -> Iterator[RayHead]:
    """A head with token authentication turned off (``RAY_AUTH_MODE=disabled``)."""
    with _ray_head(trainer_env, auth=False) as head:
        yield head


@pytest.fixture
def no_ray_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process with no Ray token anywhere Ray looks (an empty HOME); returns that HOME."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in (*RAY_TOKEN_ENV, "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return home


def _client(head: RayHead):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.address, headers=head.headers() or None)


def _backend(head: RayHead, run_id: str, **kwargs) -> RayJobBackend:
    """The backend for ``run_id`` on ``head``, its token read from the head's token file."""
    return RayJobBackend(head.address, run_id, token_file=head.token_file, **kwargs)


@pytest.mark.parametrize("head", ["ray_head", "open_ray_head"], ids=["token-auth", "auth-off"])
def test_a_job_is_attached_by_id_stopped_through_the_head_and_its_log_copied_once(head, request, tmp_path,
                                                                                  monkeypatch):
    ray_head = request.getfixturevalue(head)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    log_path = tmp_path / "trainer.log"
    backend = _backend(ray_head, "attach-me", stop_wait_s=2, log_interval_s=0)
    code = "import time; print('hello from', 'the job', flush=True); time.sleep(120)"
    proc = backend.start([sys.executable, "-c", code], env={"WD_X": "1"}, log_path=log_path)
    assert proc.job_id == "attach-me-1" and proc.pid is None
    deadline = time.monotonic() + 60
    while "hello from the job" not in (log_path.read_text() if log_path.exists() else ""):
        assert proc.alive() and time.monotonic() < deadline, log_path.read_text() if log_path.exists() else ""
        time.sleep(0.3)
    assert proc.signal(signal.SIGUSR1) is False  # Ray jobs take no signals: control.json is read at a step
    # A restarted watchdog (the first one's log stream gone with it): a new backend attaches by
    # submission id and carries on with the same log.
    proc.close()
    again = _backend(ray_head, "attach-me", stop_wait_s=2, log_interval_s=0)
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
    held = [j.submission_id for j in _backend(ray_head, "attach-me").run_jobs()]
    assert held == ["attach-me-1"] and next_attempt("attach-me", held) == 2


def test_the_test_head_has_token_authentication_on_as_todays_ray_starts_by_default(ray_head):
    import urllib.error

    assert "Token authentication is enabled for this Ray cluster" in ray_head.log.read_text()
    for headers, code in (({}, 401), ({"Authorization": "Bearer not-the-token"}, 403)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{ray_head.address}/api/version", headers=headers),
                                   timeout=10)
        assert refused.value.code == code


def test_the_token_comes_from_the_named_file_else_from_where_ray_looks_in_rays_order(tmp_path, caplog):
    from ppo_watchdog.backends.ray_jobs import RayAuthError, find_token

    named, by_path = tmp_path / "named", tmp_path / "by-path"
    named.write_text("tok-named\n")
    by_path.write_text("  tok-path  ")
    env = {"RAY_AUTH_TOKEN": "tok-env", "RAY_AUTH_TOKEN_PATH": str(by_path), "HOME": str(tmp_path)}
    assert find_token(named, env).value == "tok-named"  # a named file wins over anything Ray would find
    assert find_token(None, env).value == "tok-env"
    assert find_token(None, {**env, "RAY_AUTH_TOKEN": ""}).value == "tok-path"
    token = find_token(None, {"HOME": str(tmp_path)})
    assert token.value is None and token.headers() == {}
    assert token.looked == ("$RAY_AUTH_TOKEN: unset", "$RAY_AUTH_TOKEN_PATH: unset",
                            f"~/.ray/auth_token ({tmp_path}/.ray/auth_token): No such file or directory")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("tok-home")
    assert find_token(None, {"HOME": str(tmp_path)}).value == "tok-home"
    by_path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        found = find_token(None, {"RAY_AUTH_TOKEN_PATH": str(by_path)})
    assert found.headers() == {"Authorization": "Bearer tok-path"} and "tok-path" not in repr(found)
    assert f"Ray token file {by_path} can be read by other users (mode 644)" in caplog.text
    assert "tok-path" not in caplog.text
    caplog.clear()
    by_path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        find_token(None, {"RAY_AUTH_TOKEN_PATH": str(by_path)})
    assert caplog.text == ""
    for bad, why in ((tmp_path / "missing", "No such file"), (tmp_path, "a directory, not a regular file")):
        with pytest.raises(RayAuthError, match=f"Ray token file {bad}: cannot be used .*{why}"):
            find_token(bad, env)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RayAuthError, match="empty"):
        find_token(tmp_path / "empty", env)


def _run_against(head: RayHead, tmp_path: Path, *extra: str):
    from ppo_watchdog import cli

    return CliRunner().invoke(cli.app, [
        "run", "--ray-address", head.address, "--run-dir", str(tmp_path / "run"), "--state-dir",
        str(tmp_path / "state"), "--no-report", *extra, "--", sys.executable, "-c", "pass",
    ])


def test_watchdog_run_without_the_token_exits_2_naming_the_address_and_every_place_it_looked(
    ray_head, tmp_path, no_ray_token,
):
    result = _run_against(ray_head, tmp_path)
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"Ray job server at {ray_head.address} asks for a token" in said and "no token was found" in said
    for where in ("$RAY_AUTH_TOKEN: unset", "$RAY_AUTH_TOKEN_PATH: unset",
                  f"~/.ray/auth_token ({no_ray_token}/.ray/auth_token): No such file", "--ray-token-file"):
        assert where in said, said
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "state").exists()


def test_watchdog_run_with_a_wrong_token_exits_2_and_never_shows_either_token(ray_head, tmp_path, no_ray_token):
    wrong = tmp_path / "wrong_token"
    wrong.write_text(secrets.token_hex(32))
    result = _run_against(ray_head, tmp_path, "--ray-token-file", str(wrong))
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"Ray job server at {ray_head.address} rejected the token" in said
    assert f"the token from --ray-token-file {wrong} was sent" in said
    assert wrong.read_text() not in result.output and ray_head.token() not in result.output
    missing = _run_against(ray_head, tmp_path, "--ray-token-file", str(tmp_path / "nope"))
    assert missing.exit_code == 2 and f"Ray token file {tmp_path / 'nope'}: cannot be used" in " ".join(
        missing.output.split())


def test_the_token_is_found_where_ray_itself_looks(ray_head, tmp_path, no_ray_token, monkeypatch):
    import ray

    from ppo_watchdog.backends.ray_jobs import check_job_server

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(ray_head.token_file))
    assert check_job_server(ray_head.address) == ray.__version__
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    (no_ray_token / ".ray").mkdir()
    shutil.copy(ray_head.token_file, no_ray_token / ".ray" / "auth_token")
    assert check_job_server(ray_head.address) == ray.__version__


def test_the_daemon_retries_a_refused_token_each_tick_and_launches_once_the_token_file_is_there(
    ray_head, tmp_path, no_ray_token, caplog,
):
    from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon

    rules = tmp_path / "rules.yaml"
    rules.write_text(QUIET_RULE)
    token_file = tmp_path / "secrets" / "ray_token"  # e.g. a Kubernetes secret not mounted yet
    config = tmp_path / "daemon.yaml"
    config.write_text(json.dumps({
        "state_dir": str(tmp_path / "state"), "rules": [str(rules)],
        # Its own run id: the head is the module's, and job ids number the launches of a run id.
        "runs": [{"run_dir": str(tmp_path / "token-run"), "ray_address": ray_head.address,
                  "ray_token_file": str(token_file),
                  "restart_command": [sys.executable, "-c", "import time; time.sleep(60)"]}],
    }))
    wd = prepare_daemon(load_daemon_config(config))
    try:
        with caplog.at_level(logging.WARNING):
            assert wd.tick() is False and wd.tick() is False  # neither raised
        assert f"Ray token file {token_file}: cannot be used" in caplog.text
        assert wd.store.require_run("token-run").phase == "new" and wd.store.require_run("token-run").job_id is None
        token_file.parent.mkdir()
        token_file.write_text("not-the-token")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            wd.tick()
        assert f"Ray job server at {ray_head.address} rejected the token" in caplog.text
        assert "not-the-token" not in caplog.text and wd.store.require_run("token-run").job_id is None
        shutil.copy(ray_head.token_file, token_file)
        wd.tick()
        run = wd.store.require_run("token-run")
        assert run.phase == "running" and run.job_id == "token-run-1"
        assert ray_head.token() not in caplog.text
    finally:
        proc = wd.controllers["token-run"].h.proc
        if proc is not None:
            proc.stop(grace=2)
        wd.close()
        wd.store.close()


def _processes_showing(secret: str) -> list[str]:
    """Every process on this machine whose command line holds ``secret`` (pid: argv)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            data = cmdline.read_bytes()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if secret.encode() in data:
            argv = data.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{cmdline.parent.name}: {argv}")
    return found


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
    trainer = tiny_trainer_args(run_dir, "trainer.save_freq=2", hydra.format_override("trainer.faults", faults), steps=8)
    # The token only from the file named on the command line: nothing of Ray's in the environment,
    # and a HOME without ~/.ray/auth_token.
    env = {k: v for k, v in trainer_env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", *RAY_TOKEN_ENV)}
    env["HOME"] = str(tmp_path)
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--ray-address", ray_head.address, "--run-dir", str(run_dir),
           "--state-dir", str(state), "--rules", str(rules), "--tick", "0.3", "--stop-grace", "5", "--no-report",
           "--ray-token-file", str(ray_head.token_file), "--verbose", "--", *trainer]
    out, err = tmp_path / "watchdog.out", tmp_path / "watchdog.err"
    with open(out, "w") as o, open(err, "w") as e:
        watchdog = subprocess.Popen(cmd, stdout=o, stderr=e, text=True, env=env)
        try:
            # While the watchdog and its first job run, no process on the machine shows the token.
            deadline = time.monotonic() + 120
            while not rundir.iter_events(run_dir, ["started"]):
                assert watchdog.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.2)
            assert _processes_showing(ray_head.token()) == []
            watchdog.wait(timeout=300)
        finally:
            if watchdog.poll() is None:
                watchdog.kill()
    assert watchdog.returncode == 0, out.read_text() + err.read_text()

    # Two jobs on the cluster: the first died of the OOM with the trainer's own exit code, the
    # second ran the smaller micro batch (8 - 1 = 7 does not divide the mini batch of 8: 4).
    jobs = _backend(ray_head, "run").run_jobs()
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

    # The token is a secret: not in the watchdog's console or log, its state, the run directory,
    # `watchdog history`, or what the jobs were given.
    token = ray_head.token().encode()
    history = subprocess.run([sys.executable, "-m", "ppo_watchdog", "history", "--state-dir", str(state), "--json"],
                             capture_output=True, env=env, timeout=60)
    assert history.returncode == 0 and b"watchdog:oom" in history.stdout
    assert token not in history.stdout + history.stderr
    files = [out, err, *(p for d in (run_dir, state) for p in d.rglob("*") if p.is_file())]
    assert state / "watchdog.db" in files and run_dir / "trainer.log" in files
    assert [str(p) for p in files if token in p.read_bytes()] == []
    for job in jobs:
        assert ray_head.token() not in json.dumps(job.runtime_env) + json.dumps(job.metadata) + job.entrypoint


# -- the log copy, the job id in run.json, adoption by the daemon --------------------------------


def test_the_log_copy_skips_what_the_file_holds_wherever_the_bytes_come_from(tmp_path):
    from ppo_watchdog.backends.ray_jobs import _copied_so_far, _LogSink

    path = tmp_path / "trainer.log"
    path.write_bytes(b"local run output\n")
    first = _LogSink(path, "r-1", fresh=True)
    first.write_at(0, b"a\nb\n")
    first.write_at(0, b"a\nb\nc\n")  # a stream read again from the log's start: only c is new
    first.write_at(6, b"d\n")
    first.close()
    header = ("\n" + LOG_HEADER.format(job_id="r-1") + "\n").encode()
    assert path.read_bytes() == b"local run output\n" + header + b"a\nb\nc\nd\n"
    # A restarted watchdog finds where the job's part ends, even with the header across a block edge.
    for block in (3, 7, len(header), 1 << 20):
        assert _copied_so_far(path, header, block=block) == len(b"a\nb\nc\nd\n")
    assert _copied_so_far(path, ("\n" + LOG_HEADER.format(job_id="r-2") + "\n").encode(), block=5) == -1
    again = _LogSink(path, "r-1", fresh=False)
    again.write_at(0, b"a\nb\nc\nd\ne\n")
    again.close()
    assert path.read_bytes().count(b"c\n") == 1 and path.read_bytes().endswith(header + b"a\nb\nc\nd\ne\n")


def _wait_for(what: str, cond, proc, timeout: float = 60.0) -> None:
    """Poll the job (as the controller's tick does) until ``cond()``; fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.alive(), f"job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.2)


def test_a_running_jobs_log_is_copied_as_it_grows_once_each_line_across_a_watchdog_restart(
    ray_head, tmp_path, monkeypatch,
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    log_path, gate = tmp_path / "trainer.log", tmp_path / "gate"
    # Three batches of lines; the job waits for gate-1 and gate-2 (files) before the 2nd and 3rd.
    code = ("import os, sys, time\n"
            "for batch in range(3):\n"
            "    while batch and not os.path.exists(sys.argv[1] + '-' + str(batch)): time.sleep(0.05)\n"
            "    for i in range(10): print(f'line {batch * 10 + i:02d}', flush=True)\n")
    backend = _backend(ray_head, "tail-me", stop_wait_s=2, log_interval_s=0)
    whole_log_fetches: list[str] = []
    real_job_logs = backend.job_logs
    backend.job_logs = lambda job_id: whole_log_fetches.append(job_id) or real_job_logs(job_id)  # type: ignore[method-assign]
    proc = backend.start([sys.executable, "-c", code, str(gate)], log_path=log_path)

    def text() -> str:
        return log_path.read_text() if log_path.exists() else ""

    _wait_for("the first batch in trainer.log", lambda: "line 09" in text(), proc)
    assert "line 10" not in text()  # the job is still waiting: the copy follows it while it runs
    proc.close()  # the watchdog goes away; the job carries on and prints its 2nd batch meanwhile
    gate.with_name("gate-1").touch()
    again = _backend(ray_head, "tail-me", stop_wait_s=2, log_interval_s=0)
    again.job_logs = lambda job_id: whole_log_fetches.append(job_id) or real_job_logs(job_id)  # type: ignore[method-assign]
    adopted = again.attach_job(proc.job_id, log_path)
    _wait_for("the second batch in trainer.log", lambda: "line 19" in text(), adopted)
    assert whole_log_fetches == []  # no poll of a running job downloaded its whole log
    gate.with_name("gate-2").touch()
    deadline = time.monotonic() + 60
    while adopted.alive():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert adopted.poll() == 0
    lines = [ln for ln in text().splitlines() if ln.startswith("line ")]
    assert lines == [f"line {i:02d}" for i in range(30)]  # complete at the end, none twice
    assert text().count(LOG_HEADER.format(job_id=proc.job_id)) == 1
    assert again.adopt_job(proc.job_id) is None  # an ended job is not adopted


@pytest.fixture(scope="module")
def embedded_job(ray_head, tmp_path_factory, tiny_trainer_args):
    """The embedded trainer submitted as a Ray job (hanging at step 2 until stopped), once run.json is written."""
    run_dir = tmp_path_factory.mktemp("adopt") / "adopted"
    command = tiny_trainer_args(run_dir, "trainer.faults=hang@2:300", steps=4)
    backend = _backend(ray_head, run_dir.name, stop_wait_s=2)
    proc = backend.start(command, log_path=run_dir / "trainer.log")
    try:
        _wait_for("run.json", lambda: RunInfo.read(run_dir).pid is not None, proc, timeout=120)
        yield run_dir, command, proc
    finally:
        proc.stop(grace=5)
        proc.close()


def test_the_embedded_trainer_run_as_a_ray_job_records_its_submission_id_in_run_json(embedded_job):
    run_dir, _, proc = embedded_job
    assert RunInfo.read(run_dir).ray_job_id == proc.job_id == f"{run_dir.name}-1"


def test_the_daemon_adopts_the_running_ray_job_run_json_names_instead_of_submitting_another(
    embedded_job, ray_head, tmp_path, monkeypatch,
):
    from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run_dir, command, proc = embedded_job
    jobs_before = {j.submission_id for j in _client(ray_head).list_jobs()}
    rules = tmp_path / "rules.yaml"
    rules.write_text(QUIET_RULE)
    config = tmp_path / "daemon.yaml"
    config.write_text(json.dumps({
        "state_dir": str(tmp_path / "state"), "rules": [str(rules)],
        "runs": [{"run_dir": str(run_dir), "restart_command": command, "ray_address": ray_head.address,
                  "ray_token_file": str(ray_head.token_file)}],
    }))
    wd = prepare_daemon(load_daemon_config(config))
    try:
        ctl = wd.controllers[run_dir.name]
        assert ctl.run.phase == "running" and ctl.run.job_id == proc.job_id
        for _ in range(3):
            assert wd.tick() is False
        record = wd.store.require_run(run_dir.name)
        assert record.phase == "running" and record.job_id == proc.job_id and record.restarts == 0
        assert ctl.h.proc is not None and ctl.h.proc.alive()
    finally:
        wd.close()
        wd.store.close()
    assert {j.submission_id for j in _client(ray_head).list_jobs()} == jobs_before  # no second job
    assert [j.submission_id for j in _backend(ray_head, run_dir.name).run_jobs()] == [proc.job_id]


def test_the_submission_id_is_read_from_the_job_config_ray_gives_the_entrypoint():
    from ppo_watchdog.trainer.loop import RAY_JOB_CONFIG_ENV, ray_job_id

    config = {"runtime_env": {}, "metadata": {"job_submission_id": "exp-3", "app": "ppo-watchdog"}}
    assert ray_job_id({RAY_JOB_CONFIG_ENV: json.dumps(config)}) == "exp-3"
    assert ray_job_id({}) is None  # not a Ray job
    assert ray_job_id({RAY_JOB_CONFIG_ENV: "{not json"}) is None
    assert ray_job_id({RAY_JOB_CONFIG_ENV: json.dumps({"metadata": None})}) is None
