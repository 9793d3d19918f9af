"""W&B and TensorBoard across the watchdog's relaunches of a real verl run: verl 0.9.1's own ``main_ppo`` on CPU
(``make run-verl``'s zero-patch run, a NaN at step 5 rolled back by relaunch) with
``trainer.logger=['console','wandb','tensorboard']`` and ``WANDB_MODE=offline``. Every attempt logs to one W&B
run, each relaunch rewound to the step it resumed from, and TensorBoard shows the run's kept timeline. About 6
minutes on 2 cores; one verl run at a time on a machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("wandb")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import verl_e2e as e2e  # noqa: E402

from ppo_watchdog.protocol import rundir  # noqa: E402

LOGGER = "trainer.logger=['console','wandb','tensorboard']"
TAG = "actor/pg_loss"


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[e2e.VerlRun, Path]:
    """The supervised verl run (the demo's NaN only: one rollback by relaunch), W&B offline under ``wandb/``."""
    from ppo_watchdog.trainer.verl_cpu import assets, demo, overrides

    root = tmp_path_factory.mktemp("verl-wandb")
    a = assets.build(root / "assets")
    run_dir, state, wandb_dir = root / "run", root / "state", root / "wandb"
    wandb_dir.mkdir()
    inject = {k: v for k, v in demo.demo_inject(run_dir).items() if k != "VERL_CPU_INJECT_OOM"}
    env = overrides.verl_env(inject={**inject, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir),
                                     "WANDB_SILENT": "true", "RAY_memory_monitor_refresh_ms": "0"})
    for k in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_RESUME_FROM", "WANDB_FORK_FROM", "TENSORBOARD_DIR"):
        env.pop(k, None)
    env["WATCHDOG_WANDB_RESUME"] = "rewind"  # (offline, wandb 0.31 writes the rewind point: what these checks read)
    argv = [*demo.watchdog_argv(run_dir, a, ["--state-dir", str(state)]), LOGGER]
    return e2e.supervise(argv, env, run_dir, state, root), wandb_dir


def test_every_attempt_of_the_verl_run_logs_to_one_wandb_run(verl_run: tuple[e2e.VerlRun, Path]) -> None:
    from wandb_records import offline_runs

    run, wandb_dir = verl_run
    assert run.exit_code == 0, run.output[-4000:]
    run_id = json.loads((run.run_dir / "trackers.json").read_text())["wandb_run_id"]
    segments = offline_runs(wandb_dir)
    started = rundir.iter_events(run.run_dir, ["started"])
    assert len(started) >= 2, "no relaunch happened"
    assert len(segments) == len(started)
    assert {s.run_id for s in segments} == {run_id}


def test_each_relaunch_rewinds_the_wandb_run_to_the_step_it_resumed_from(verl_run: tuple[e2e.VerlRun, Path]) -> None:
    from wandb_records import offline_runs

    run, wandb_dir = verl_run
    first, *later = offline_runs(wandb_dir)
    assert "branch_point" not in first.wandb_config
    # The journal's restarts, in order: the step each resumed from (a started event's ``resumed_from`` reads the
    # resume path's name, which for an lr-patched copy is not ``global_step_N``).
    resumed = [int(e.payload["resume_step"]) for e in sorted(run.restarts(), key=lambda e: e.id)]
    assert [s.wandb_config["branch_point"]["step"] for s in later] == resumed
    for seg, step in zip(later, resumed, strict=True):
        assert seg.steps and min(seg.steps) == step + 1, (seg.path, sorted(seg.steps))


def test_tensorboard_shows_the_runs_kept_timeline(verl_run: tuple[e2e.VerlRun, Path]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = verl_run
    logdir = json.loads((run.run_dir / "trackers.json").read_text())["tensorboard_dir"]
    acc = EventAccumulator(logdir)
    acc.Reload()
    shown = {e.step: e.value for e in acc.Scalars(TAG)}
    kept = {int(r["step"]): float(r["data"][TAG]) for r in rundir.read_jsonl(run.run_dir / rundir.METRICS).records
            if TAG in r["data"]}
    assert sorted(shown) == sorted(kept)
    assert all(shown[s] == pytest.approx(kept[s], rel=1e-5, abs=1e-7) for s in kept)
