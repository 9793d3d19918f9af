"""`pip install ppo-watchdog` alone: the watchdog without torch, verl, ray, transformers or pandas.

A fresh venv (no system site-packages) gets the project's core dependencies only, then runs the
commands a monitoring host runs: checking the rules, replaying and judging recorded runs, and
the daemon's help. Run from outside the repository, so only what was installed is importable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import tomllib

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
    assert "roll back to the last known-good checkpoint" in replay.stdout
    ev = _run(core_venv, "eval", str(CORPUS / "labels.yaml"))
    assert ev.returncode == 0, ev.stdout + ev.stderr
    assert re.search(r"^PASS: (\d+)/\1 logs passed", ev.stdout, re.M), ev.stdout[-2000:]
    daemon = _run(core_venv, "daemon", "--help")
    assert daemon.returncode == 0 and "--config" in daemon.stdout, daemon.stdout + daemon.stderr


def test_a_missing_extra_is_named_not_a_traceback(core_venv: Path, tmp_path: Path) -> None:
    # The embedded trainer is the [trainer] extra: without torch its command fails saying so.
    out = subprocess.run([str(core_venv / "bin" / "python"), "-m", "ppo_watchdog.trainer", f"trainer.run_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=core_venv, timeout=120)
    assert out.returncode != 0
    assert "ppo-watchdog[trainer]" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def _imports(python: Path, cwd: Path, *names: str) -> dict[str, str]:
    """Each name imported in a fresh interpreter started in ``cwd``: 'ok' or the error's class name."""
    code = ("import importlib, json, sys\nout = {}\nfor n in sys.argv[1:]:\n"
            "    try:\n        importlib.import_module(n); out[n] = 'ok'\n"
            "    except Exception as e:\n        out[n] = type(e).__name__\nprint(json.dumps(out))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, cwd=cwd, env=env,
                         check=True, timeout=300)
    return json.loads(out.stdout)


def test_one_import_root_outside_the_checkout_in_the_test_venv(tmp_path: Path) -> None:
    # The folders watchdog/ and trainer/ are the package ppo_watchdog and ppo_watchdog.trainer, not
    # top-level modules of their own that would shadow PyPI's `watchdog` or a repository's `trainer`.
    got = _imports(Path(sys.executable), tmp_path, "ppo_watchdog.cli", "ppo_watchdog.trainer.config",
                   "trainer", "watchdog.core")
    assert got == {"ppo_watchdog.cli": "ok", "ppo_watchdog.trainer.config": "ok",
                   "trainer": "ModuleNotFoundError", "watchdog.core": "ModuleNotFoundError"}
    out = subprocess.run([sys.executable, "-m", "ppo_watchdog", "--help"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and "rules" in out.stdout, out.stdout + out.stderr


def test_the_core_install_sits_beside_pypis_watchdog(core_venv: Path) -> None:
    python = core_venv / "bin" / "python"
    assert _imports(python, core_venv, "watchdog", "trainer") == {
        "watchdog": "ModuleNotFoundError", "trainer": "ModuleNotFoundError"}
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "watchdog"], capture_output=True, text=True,
                         timeout=600, cwd=core_venv)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Both import, and neither file was overwritten by the other: PyPI's watchdog is the filesystem-events one.
    assert _imports(python, core_venv, "watchdog.observers", "ppo_watchdog.cli", "ppo_watchdog.core.engine") == {
        "watchdog.observers": "ok", "ppo_watchdog.cli": "ok", "ppo_watchdog.core.engine": "ok"}
    assert _run(core_venv, "rules", "check", str(core_venv / "share" / "ppo-watchdog" / "rules" / "default.yaml")
                ).returncode == 0


def test_pyproject_lists_every_package_folder() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    # The mapped folders (watchdog/, trainer/) are siblings: each package folder lies under exactly one.
    found = {".".join([name, *init.parent.relative_to(REPO / folder).parts])
             for name, folder in setuptools["package-dir"].items() for init in (REPO / folder).rglob("__init__.py")}
    assert sorted(setuptools["packages"]) == sorted(found)
