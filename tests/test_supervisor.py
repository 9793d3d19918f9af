"""The local process backend, with real small Python processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from ppo_watchdog.backends.local import LocalBackend, SupervisorError


def _wait_for(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def test_started_process_sees_env_and_cwd_and_reports_its_exit_code(tmp_path):
    code = "import os, sys; open('out.txt', 'w').write(os.environ['WD_X'] + ' ' + os.getcwd()); sys.exit(75)"
    proc = LocalBackend().start([sys.executable, "-c", code], env={"WD_X": "hello"}, cwd=tmp_path,
                                log_path=tmp_path / "log.txt")
    assert proc.wait(20) == 75
    assert (tmp_path / "out.txt").read_text() == f"hello {tmp_path}"
    assert not proc.alive() and proc.poll() == 75


def test_process_runs_in_its_own_process_group(tmp_path):
    proc = LocalBackend().start([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    finally:
        proc.stop(grace=1)


def test_sigusr1_reaches_the_process(tmp_path):
    code = (
        "import signal, time, pathlib\n"
        "p = pathlib.Path('got.txt')\n"
        "signal.signal(signal.SIGUSR1, lambda *a: p.write_text('usr1'))\n"
        "pathlib.Path('ready').write_text('1')\n"
        "for _ in range(300):\n    time.sleep(0.05)\n    if p.exists(): break\n"
    )
    proc = LocalBackend().start([sys.executable, "-c", code], cwd=tmp_path)
    _wait_for(tmp_path / "ready")
    assert proc.signal(signal.SIGUSR1)
    assert _wait_for(tmp_path / "got.txt") == "usr1"
    assert proc.wait(10) == 0


def test_stop_ends_a_cooperative_process_with_sigterm_within_the_grace(tmp_path):
    code = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path('saved').write_text('1'), sys.exit(0)))\n"
        "pathlib.Path('ready').write_text('1')\n"
        "time.sleep(60)\n"
    )
    proc = LocalBackend().start([sys.executable, "-c", code], cwd=tmp_path)
    _wait_for(tmp_path / "ready")
    assert proc.stop(grace=10) == 0
    assert (tmp_path / "saved").exists()


def test_stop_kills_a_process_that_ignores_sigterm_after_the_grace(tmp_path):
    code = (
        "import signal, time, pathlib\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path('ready').write_text('1')\n"
        "time.sleep(60)\n"
    )
    proc = LocalBackend().start([sys.executable, "-c", code], cwd=tmp_path)
    _wait_for(tmp_path / "ready")
    t0 = time.monotonic()
    assert proc.stop(grace=0.5) == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - t0 < 8


def test_attached_handle_sees_a_foreign_process_end_but_not_its_exit_code(tmp_path):
    child = LocalBackend().start([sys.executable, "-c", "import time; time.sleep(30)"])
    adopted = LocalBackend().attach(child.pid)
    assert adopted.alive() and adopted.poll() is None
    adopted.stop(grace=2)
    child.wait(5)  # reap it, as its real parent would
    assert not adopted.alive() and adopted.poll() is None


def test_starting_a_missing_program_names_the_command():
    with pytest.raises(SupervisorError, match="no-such-program-xyz"):
        LocalBackend().start(["no-such-program-xyz"])
