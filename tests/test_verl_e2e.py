"""The watchdog over real verl, end to end: verl 0.9.1's own ``python -m verl.trainer.main_ppo`` on CPU.

One supervised zero-patch run (``watchdog run --mode verl``: ``make run-verl``'s run with the test
overlay tests/data/verl_e2e_rules.yaml) is shared by every assertion: verl's v1 sync trainer, FSDP2
workers on gloo, TransferQueue, its checkpoint manager and resume, PPO with GAE, a critic and the KL
in the reward, through :mod:`ppo_watchdog.trainer.verl_cpu` (no file of verl edited). Injected: a NaN actor loss
at step 5 and a memory budget from step 8; one tuning relaunch carries lr x0.5, kl_coef x2 and
clip_ratio x0.5; verl prunes its checkpoints to one; the rollback skips one batch (the dataloader
state in the resume copy's data.pt). About 7 minutes on 2 cores. The checks are bench/verl_e2e.py's rows (the bench
runs them too, with figures, plus the in-process glue). A second run, under the in-process glue, has its NaN
rolled back inside the running trainer (about 2 minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import verl_e2e as e2e  # noqa: E402


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory) -> e2e.VerlRun:
    """The supervised verl run, once for the module. Ray's memory monitor is off: on a machine shared with
    other jobs their memory spikes made it kill this run's workers once (a real host OOM, which the watchdog
    answered with a smaller micro batch, so the injected OOM these checks describe never came)."""
    return e2e.run_zero_patch(tmp_path_factory.mktemp("verl-e2e"), ray_memory_monitor=False)


def _passes(row: e2e.Row) -> None:
    assert row.ok, f"{row.name}: {row.detail}"


def test_the_supervised_verl_run_ends_on_its_own_with_every_step_trained(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_finished(verl_run))


def test_a_nan_loss_in_verls_actor_is_rolled_back_and_the_steps_after_are_the_reruns(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_rollback(verl_run))


def test_an_lr_change_by_relaunch_is_the_lr_verl_logs_after_the_resume(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_lr(verl_run))


def test_a_kl_coef_relaunch_is_the_coefficient_verl_logs_after_the_resume(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_kl(verl_run))


def test_a_clip_ratio_relaunch_moves_the_bounds_verl_reads(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_clip(verl_run))


def test_an_oom_in_verls_actor_update_gets_a_micro_batch_verl_accepts(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_oom(verl_run))


def test_stopping_and_finishing_leave_no_ray_or_verl_process_behind(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_processes(verl_run))


def test_a_stopped_attempts_steps_past_its_relaunch_checkpoint_stay_out_of_the_timeline(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_timeline(verl_run))


def test_replay_reads_the_console_log_and_the_file_logger_output_to_the_same_decisions(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_replay(verl_run))


def test_verls_own_pruning_cannot_remove_the_known_good_checkpoint_the_rollback_needs(verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_pruning(verl_run))


def test_a_rollback_with_skip_batches_resumes_verl_on_the_batch_after_the_one_it_would_have_rerun(
        verl_run: e2e.VerlRun) -> None:
    _passes(e2e.check_skip(verl_run))


# -- a rollback restored inside the running trainer (the in-process glue) ---------------------------


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory: pytest.TempPathFactory) -> e2e.VerlRun:
    """``watchdog run -- python -m ppo_watchdog.trainer.verl_glue`` with the default pack: a NaN actor loss once at
    step 5 of 8, a checkpoint every 2; nan_or_inf rolls back to step 2 with lr x0.5 and one batch skipped, in the
    running trainer. About 2 minutes (bench/verl_e2e.py --rollback-in-process runs it beside the relaunch)."""
    return e2e.run_rollback(tmp_path_factory.mktemp("verl-rollback"), "in-process")


def test_a_nan_in_verls_actor_is_rolled_back_inside_the_running_trainer(rolled_back: e2e.VerlRun) -> None:
    _passes(e2e.check_in_process_rollback(rolled_back))


def test_the_in_process_rollback_is_priced_as_a_restore_and_carries_its_sets(rolled_back: e2e.VerlRun) -> None:
    entry, seconds, lost, _ = e2e._rollback_timing(rolled_back)
    assert entry.payload["cost"]["relaunch"] is False and entry.payload["cost"]["steps_lost"] >= 1
    assert entry.payload["command"]["set"] == entry.payload["set"]  # applied with the restore, not a step later
    assert 0 < seconds and lost >= 2


def test_one_launch_of_verl_did_the_whole_rolled_back_run(rolled_back: e2e.VerlRun) -> None:
    assert len([e for e in rolled_back.events() if e["kind"] == "started"]) == 1  # no relaunch
    (moved,) = [e for e in rolled_back.events() if e["kind"] == "rollback"]
    assert moved["in_process"] is True and moved["skip_batches"] == 1
    assert rolled_back.last_step() == 8
