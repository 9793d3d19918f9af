"""`pip install ppo-watchdog` alone: the watchdog without torch, verl, ray, transformers or pandas.

A fresh venv (no system site-packages) gets the project's core dependencies only, then runs the
commands a monitoring host runs: checking the rules, replaying and judging recorded runs, and
the daemon's help. Run from outside the repository, so only what was installed is importable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "bench" / "corpus"
HEAVY = ("torch", "verl", "ray", "transformers", "pandas")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("core-venv")
    # A copy of what a source distribution holds: the build writes into it, never into the checkout.
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("watchdog", "trainer", "rules"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    root = root / "venv"
    py = root / "bin" / "python"
    # At the tested versions, as make test installs its own: a new release cannot fail this by surprise.
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), str(src)],
                         capture_output=True, text=True, timeout=900, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root


def _run(env_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(env_root / "bin" / "watchdog"), *args], capture_output=True, text=True,
                          timeout=300, cwd=env_root, env=env)


def test_the_core_install_has_none_of_the_trainer_side(core_venv: Path) -> None:
    code = ("import importlib.util, sys; "
            f"print([m for m in {HEAVY!r} if importlib.util.find_spec(m) is not None])")
    out = subprocess.run([str(core_venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         cwd=core_venv, check=True)
    assert out.stdout.strip() == "[]"


def test_the_core_install_checks_replays_and_judges_rules(core_venv: Path, tmp_path: Path) -> None:
    pack = core_venv / "share" / "ppo-watchdog" / "rules" / "default.yaml"
    check = _run(core_venv, "rules", "check", str(pack))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ok" in check.stdout.lower()
    replay = _run(core_venv, "replay", str(CORPUS / "lr_spike_x30_at_40"))
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "rollback" in replay.stdout
    ev = _run(core_venv, "eval", str(CORPUS / "labels.yaml"))
    assert ev.returncode == 0, ev.stdout + ev.stderr
    assert re.search(r"^PASS: (\d+)/\1 logs passed", ev.stdout, re.M), ev.stdout[-2000:]
    daemon = _run(core_venv, "daemon", "--help")
    assert daemon.returncode == 0 and "--config" in daemon.stdout, daemon.stdout + daemon.stderr


def test_a_missing_extra_is_named_not_a_traceback(core_venv: Path, tmp_path: Path) -> None:
    # The embedded trainer is the [trainer] extra: without torch its command fails saying so.
    out = subprocess.run([str(core_venv / "bin" / "python"), "-m", "trainer", f"trainer.run_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=core_venv, timeout=120)
    assert out.returncode != 0
    assert "ppo-watchdog[trainer]" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
