"""Shared fixtures: a tiny SFT model and data, trained once per test session in a temp cache.

Tests that run the trainer (in process or as ``python -m ppo_watchdog.trainer``) use
``tiny_trainer_args(run_dir, *overrides)`` for an argv that finishes a step in a
fraction of a second, and ``trainer_env`` for a subprocess environment whose cache is
the session's temp directory (nothing under ~/.cache is touched).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class TinySFT:
    """A tiny SFT warm start and the synthetic data it was trained on."""

    cache: Path
    """PPO_WATCHDOG_CACHE of the session."""
    model_dir: Path
    """Saved model + tokenizer.json (actor_rollout_ref.model.path)."""
    train_files: Path
    """verl-format training parquet."""
    val_files: Path
    """verl-format validation parquet."""

    def overrides(self, run_dir: Path | str, steps: int = 4) -> list[str]:
        """``key=value`` overrides for a run of a few fast steps (batch 16, mini 8, micro 8)."""
        return [
            f"actor_rollout_ref.model.path={self.model_dir}",
            f"data.train_files={self.train_files}",
            f"data.val_files={self.val_files}",
            "data.train_batch_size=16",
            "data.val_batch_size=64",
            "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size_per_gpu=8",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=0",
            "trainer.save_epoch_freq=0",
            "trainer.progress=false",
            f"trainer.run_dir={run_dir}",
        ]


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """No $COLUMNS from the runner: pytest-xdist's workers inherit COLUMNS=80, and the CLI honours it, as it should
    for a person's pipe. A test sees the CLI as a file or a CI log does (``ppo_watchdog.cli.console.WIDE``), or sets
    the width it is about."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(scope="session")
def tiny_sft(tmp_path_factory: pytest.TempPathFactory) -> TinySFT:
    """Train (a few seconds) a 1-layer d=32 SFT model on 64 synthetic problems, once per session."""
    import torch

    from ppo_watchdog.trainer import data as data_mod
    from ppo_watchdog.trainer.sft import SFTSettings, train_sft

    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("ppo-cache")
    train, val = data_mod.write_synthetic(cache / "data", n_train=64, n_val=32, max_operand=5, seed=0)
    settings = SFTSettings(str(train), n_layer=1, n_embd=32, n_head=2, n_positions=32, max_prompt_length=16,
                           max_response_length=8, steps=30, batch_size=32, lr=3e-3, seed=0)
    model_dir = cache / "tiny-sft"
    train_sft(settings, model_dir, None, progress=False)
    return TinySFT(cache, model_dir, train, val)


@pytest.fixture(scope="session")
def tiny_trainer_args(tiny_sft: TinySFT) -> Callable[..., list[str]]:
    """``f(run_dir, *extra, steps=4)`` -> argv for ``python -m ppo_watchdog.trainer`` on the tiny model."""

    def make(run_dir: Path | str, *extra: str, steps: int = 4) -> list[str]:
        return [sys.executable, "-m", "ppo_watchdog.trainer", *tiny_sft.overrides(run_dir, steps), *extra]

    return make


@pytest.fixture(scope="session")
def trainer_env(tiny_sft: TinySFT) -> dict[str, str]:
    """Environment for trainer subprocesses: session cache, one thread, quiet logs."""
    env = dict(os.environ)
    env.update({
        "PPO_WATCHDOG_CACHE": str(tiny_sft.cache),
        "OMP_NUM_THREADS": "1",
        "TRAINER_LOG_LEVEL": "WARNING",
    })
    return env


#: Test files that start Ray (a head of their own, or verl's local ``ray.init``): under ``pytest -n`` they run
#: one after another in one worker (two Ray clusters on one machine can find each other's).
RAY_FILES = ("test_ray_", "test_verl_")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: none without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``make test`` runs the suite in 2 workers (``pytest -n 2``): each test file goes whole to one worker
    (its module fixtures, a Ray head or a verl run, are made once), and the files that start Ray go to the
    same one, as one unit of work (the largest, so it starts first)."""
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "ray" if Path(path).name.startswith(RAY_FILES) else path

    return RayFilesTogether(config, log)


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append({"path": self.path, "ctype": self.headers["Content-Type"],
                                    "body": json.loads(body)})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict]]]:
    """A real Alertmanager-style receiver on 127.0.0.1: (its URL, the payloads it received, oldest first)."""
    _Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/alert", _Hook.received
    server.shutdown()
