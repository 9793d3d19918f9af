"""W&B and TensorBoard across relaunches (ppo_watchdog.backends.trackers): the variables each launch gets, and
the real wandb (offline) and TensorBoard reading them as one run rewound to the step a relaunch resumes from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_watchdog.backends import trackers
from ppo_watchdog.backends.trackers import TrackerConfigError, launch_env, wandb_env

VERL_WANDB = ["python", "-m", "verl.trainer.main_ppo", "trainer.logger=['console','wandb','file']",
              "trainer.project_name=p", "trainer.experiment_name=e"]
VERL_TB = ["python", "-m", "verl.trainer.main_ppo", "trainer.logger=[console,tensorboard]",
           "trainer.project_name=p", "trainer.experiment_name=e"]

# verl's Tracking, as verl/utils/tracking.py (0.9.1) makes and feeds its W&B logger: wandb.init with project,
# name, entity from $WANDB_ENTITY, the config and no settings; then wandb.log(data=..., step=...) per step.
VERL_LIKE = """
import os, sys, wandb
first, last, scale = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
wandb.init(project="p", name="e", entity=os.environ.get("WANDB_ENTITY", None), config={"trainer": {}}, settings=None)
for step in range(first, last + 1):
    wandb.log(data={"actor/pg_loss": step * scale}, step=step)
wandb.finish()
"""


# -- the variables ---------------------------------------------------------------------------------


def test_the_first_launch_gets_a_new_run_id_kept_in_trackers_json_for_every_relaunch(tmp_path: Path) -> None:
    first = launch_env(tmp_path, VERL_WANDB, None, environ={})
    run_id = first.env["WANDB_RUN_ID"]
    assert first.env == {"WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow"}
    assert len(run_id) == 8 and run_id.isalnum()
    assert json.loads((tmp_path / "trackers.json").read_text())["wandb_run_id"] == run_id
    again = launch_env(tmp_path, VERL_WANDB, 6, environ={})
    assert again.env == {"WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow"}  # plain resume unless rewind is asked for
    assert f"run {run_id}" in again.sentence


def test_a_relaunch_from_step_n_rewinds_the_run_to_n_where_the_installed_wandb_can() -> None:
    env, said = wandb_env("abc12345", first=False, resume_step=6, mode="auto", wandb_version="0.31.0")
    assert env == {"WANDB_RUN_ID": "abc12345", "WANDB_RESUME_FROM": "abc12345?_step=6"}
    assert "rewound to step 6" in said and "from step 7" in said


def test_a_wandb_older_than_rewind_resumes_the_run_and_says_which_steps_keep_the_old_values() -> None:
    env, said = wandb_env("abc12345", first=False, resume_step=6, mode="auto", wandb_version="0.16.6")
    assert env == {"WANDB_RUN_ID": "abc12345", "WANDB_RESUME": "allow"}
    assert "wandb 0.16.6 cannot rewind" in said and "after step 6" in said


def test_allow_by_choice_or_an_unknown_resume_step_resumes_without_rewinding() -> None:
    env, said = wandb_env("abc12345", first=False, resume_step=6, mode="allow", wandb_version="0.31.0")
    assert env == {"WANDB_RUN_ID": "abc12345", "WANDB_RESUME": "allow"} and "WATCHDOG_WANDB_RESUME=allow" in said
    env, said = wandb_env("abc12345", first=False, resume_step=None, mode="rewind", wandb_version="0.31.0")
    assert "WANDB_RESUME_FROM" not in env and "unknown" in said


def test_the_users_own_run_id_is_kept_and_their_own_resume_choice_left_alone(tmp_path: Path) -> None:
    got = launch_env(tmp_path / "a", VERL_WANDB, None, environ={"WANDB_RUN_ID": "mine0001"})
    assert got.env["WANDB_RUN_ID"] == "mine0001"
    left = launch_env(tmp_path / "b", VERL_WANDB, 4, environ={"WANDB_RESUME": "must"})
    assert left.env == {} and "WANDB_RESUME" in left.sentence


def test_a_run_without_wandb_or_tensorboard_gets_no_tracker_variable(tmp_path: Path) -> None:
    cmd = ["python", "-m", "verl.trainer.main_ppo", "trainer.logger=[console,file]"]
    assert launch_env(tmp_path, cmd, 3, environ={}).env == {}
    assert not (tmp_path / "trackers.json").exists()


def test_a_bad_resume_choice_is_refused_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(TrackerConfigError, match="WATCHDOG_WANDB_RESUME='sometimes'"):
        launch_env(tmp_path, VERL_WANDB, None, environ={"WATCHDOG_WANDB_RESUME": "sometimes"})


def test_an_api_key_is_never_written_to_trackers_json(tmp_path: Path) -> None:
    secret = "k" * 40
    launch_env(tmp_path, VERL_WANDB, None, environ={"WANDB_API_KEY": secret})
    launch_env(tmp_path, VERL_WANDB, 2, environ={"WANDB_API_KEY": secret})
    assert secret not in (tmp_path / "trackers.json").read_text()


# -- the real wandb, offline -------------------------------------------------------------------------


def _attempt(tmp_path: Path, env: dict[str, str], first: int, last: int, scale: float) -> None:
    full = {**os.environ, **env, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true"}
    for k in ("WANDB_RESUME", "WANDB_RESUME_FROM", "WANDB_FORK_FROM", "WANDB_RUN_ID"):
        if k not in env:
            full.pop(k, None)
    out = subprocess.run([sys.executable, "-c", VERL_LIKE, str(first), str(last), str(scale)], env=full,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]


def test_two_attempts_are_one_wandb_run_whose_history_is_rewound_to_the_resume_step(tmp_path: Path) -> None:
    # (rewind asked for: the default is plain resume, which any W&B server takes)
    from wandb_records import offline_runs

    (tmp_path / "wb").mkdir()
    run_dir = tmp_path / "run"
    _attempt(tmp_path, launch_env(run_dir, VERL_WANDB, None, environ={}).env, 1, 10, 1.0)
    # a rollback to step 6's checkpoint: the relaunch logs steps 7.. again, with other values
    _attempt(tmp_path, launch_env(run_dir, VERL_WANDB, 6, environ={"WATCHDOG_WANDB_RESUME": "rewind"}).env, 6, 9,
             100.0)
    first, second = offline_runs(tmp_path / "wb")
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb_run_id"]
    assert first.run_id == second.run_id == run_id
    assert "branch_point" not in first.wandb_config
    assert second.wandb_config["branch_point"] == {"run_id": run_id, "step": 6}
    assert sorted(first.steps) == list(range(1, 11))
    # W&B keeps step 6 of the first attempt; the relaunch's own step 6 (verl's validation at the resumed
    # step) is dropped, and its history goes on from step 7 with its own values.
    assert sorted(second.steps) == [7, 8, 9]
    assert [second.steps[s]["actor/pg_loss"] for s in (7, 8, 9)] == [700.0, 800.0, 900.0]


# -- TensorBoard ---------------------------------------------------------------------------------------


def test_a_relaunch_hides_the_tensorboard_points_after_its_resume_step(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    run_dir, cwd = tmp_path / "run", tmp_path / "cwd"
    first = launch_env(run_dir, VERL_TB, None, environ={}, cwd=cwd)
    logdir = Path(first.env["TENSORBOARD_DIR"])
    assert logdir == cwd / "tensorboard_log" / "p" / "e"  # verl's own default, pinned
    logdir.mkdir(parents=True)
    w = SummaryWriter(str(logdir))  # as verl's _TensorboardAdapter makes it: no purge_step
    for step in range(1, 11):
        w.add_scalar("actor/pg_loss", float(step), step)
        if step % 5 == 0:
            w.add_scalar("val/score", float(step), step)
    w.close()
    again = launch_env(run_dir, VERL_TB, 6, environ={}, cwd=tmp_path / "elsewhere")
    assert again.env["TENSORBOARD_DIR"] == str(logdir)  # the same log, whatever the watchdog's directory
    assert "after step 6" in again.sentence
    w = SummaryWriter(str(logdir))
    for step in range(7, 10):
        w.add_scalar("actor/pg_loss", step * 100.0, step)
    w.close()
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("actor/pg_loss")]
    assert points == [(s, float(s)) for s in range(1, 7)] + [(7, 700.0), (8, 800.0), (9, 900.0)]
    # A tag the relaunch has not logged again yet: TensorBoard's own out-of-order purge (by the tags of a point
    # that goes back) never reaches it; the purge at step 7 does.
    assert [e.step for e in acc.Scalars("val/score")] == [5]


def test_without_tensorboard_installed_the_purge_is_said_not_done(tmp_path: Path, monkeypatch) -> None:
    run_dir, cwd = tmp_path / "run", tmp_path / "cwd"
    logdir = Path(launch_env(run_dir, VERL_TB, None, environ={}, cwd=cwd).env["TENSORBOARD_DIR"])
    logdir.mkdir(parents=True)
    (logdir / "events.out.tfevents.1.host.1.0").write_bytes(b"")

    def missing(logdir: object, step: int) -> Path:
        raise ModuleNotFoundError("No module named 'tensorboard'")

    monkeypatch.setattr(trackers, "write_purge", missing)
    said = launch_env(run_dir, VERL_TB, 4, environ={}, cwd=cwd).sentence
    assert "points after step 4 not hidden" in said and "tensorboard is not installed" in said
