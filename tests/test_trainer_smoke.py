"""Short real training runs on the tiny SFT model: metrics, events, checkpoints, resume, control."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol.control import Command, Control, write_control
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.trainer import data as data_mod
from ppo_watchdog.trainer.config import load_config
from ppo_watchdog.trainer.loop import Trainer

torch.set_num_threads(1)


def _train(overrides: list[str]) -> Trainer:
    t = Trainer(load_config(overrides), argv=["test"])
    t.run()
    return t


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    # newest line per step wins, as the watchdog's ingest reads it
    return {r["step"]: r["data"] for r in rundir.read_jsonl(run_dir / rundir.METRICS).records}


def test_a_few_steps_write_catalog_keys_events_checkpoints_and_run_json(tiny_sft, tmp_path: Path) -> None:
    run = tmp_path / "run"
    t = _train(tiny_sft.overrides(run, steps=3) + ["trainer.test_freq=2", "trainer.save_freq=2",
                                                    "actor_rollout_ref.actor.use_kl_loss=true"])
    assert t.summary.exit_code == 0
    m = _metrics(run)
    assert sorted(m) == [0, 1, 2, 3]
    assert list(m[0]) == ["val-core/tiny_arith/reward/mean@1"]
    written = {catalog.canonical_key(k) for step in (1, 2, 3) for k in m[step]}
    missing = {x.key for x in catalog.METRICS} - catalog.VERL_ONLY_KEYS - written
    assert not missing, f"catalog metrics never written: {missing}"
    for step in (1, 2, 3):
        assert m[step]["training/global_step"] == step
        assert all(isinstance(v, float) for v in m[step].values())
    assert "val-core/tiny_arith/reward/mean@1" in m[2] and "val-core/tiny_arith/reward/mean@1" not in m[1]
    info = RunInfo.read(run)
    assert info.pid is not None and info.pid > 0 and info.live_keys == list(catalog.LIVE_KEYS)
    assert info.config["trainer"]["run_dir"] == str(run)
    kinds = [e["kind"] for e in rundir.iter_events(run)]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert kinds.count("checkpoint") == 1 and kinds.count("validation") == 3
    c = ckpt.latest_complete(run / rundir.CHECKPOINTS)
    assert c is not None and c.step == 2
    components, extra = ckpt.load_checkpoint(c.path)
    assert {"actor", "critic", "data"} <= set(components) and extra["global_step"] == 2


def test_resuming_from_a_checkpoint_gives_the_same_metrics_as_a_straight_run(tiny_sft, tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(tiny_sft.overrides(straight, steps=4) + ["trainer.save_freq=2"])
    _train(tiny_sft.overrides(split, steps=2) + ["trainer.save_freq=2"])
    resumed = _train(tiny_sft.overrides(split, steps=4) + ["trainer.save_freq=2"])
    assert [e["resumed_from"] for e in rundir.iter_events(split, ["started"])] == [0, 2]
    assert resumed.summary.steps == 4
    a, b = _metrics(straight), _metrics(split)
    for step in (3, 4):
        same = {k: v for k, v in a[step].items() if not k.startswith("perf/")}
        assert {k: b[step][k] for k in same} == pytest.approx(same, rel=1e-6, abs=1e-9), step


def test_offline_mode_trains_on_stored_responses_without_sampling(tiny_sft, tmp_path: Path) -> None:
    rows = data_mod.offline_rows(32, p_correct=0.25, max_operand=5, seed=1)
    path = data_mod.write_parquet(rows, tmp_path / "offline.parquet")
    run = tmp_path / "run"
    _train(tiny_sft.overrides(run, steps=2) + [f"data.train_files={path}", "data.offline=true"])
    m = _metrics(run)
    stored = [r["reward"] for r in rows]
    assert 0 < m[1]["critic/score/mean"] < 1
    # the stored rewards are what gets scored: batch means are means of 16 stored values
    assert any(abs(m[1]["critic/score/mean"] * 16 - round(m[1]["critic/score/mean"] * 16)) < 1e-6 for _ in stored)
    # responses are the stored "#### N" (7 or 8 tokens with EOS), not sampled text
    assert 6 <= m[1]["response_length/mean"] <= 8


def test_control_overrides_are_applied_before_the_first_step_and_recorded(tiny_sft, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_control(run, Control(3, {
        "algorithm.kl_ctrl.kl_coef": 0.0123,
        "actor_rollout_ref.actor.optim.lr": 3e-5,
        "actor_rollout_ref.actor.clip_ratio": 0.1,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
    }))
    t = _train(tiny_sft.overrides(run, steps=2))
    m = _metrics(run)
    assert m[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.0123)
    assert m[1]["actor/lr"] == pytest.approx(3e-5)
    # Unset clip bounds stay unset and follow clip_ratio, as in verl (set ones move by the same factor).
    actor = t.cfg.actor_rollout_ref.actor
    assert actor.clip_ratio == 0.1 and actor.clip_ratio_low is None and actor.clip_ratio_high is None
    applied = rundir.iter_events(run, ["applied"])
    assert len(applied) == 1 and applied[0]["version"] == 3 and applied[0]["step"] == 0
    assert applied[0]["applied"]["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 4
    # a restarted trainer re-applies the overrides (no second `applied` event for the same version)
    t2 = _train(tiny_sft.overrides(run, steps=3))
    assert t2.kl_ctrl.value == pytest.approx(0.0123)
    assert len(rundir.iter_events(run, ["applied"])) == 1


def test_rollback_command_restores_the_named_step_and_skips_batches(tiny_sft, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(tiny_sft.overrides(run, steps=4) + ["trainer.save_freq=2"])
    before = _metrics(run)
    write_control(run, Control(1, {}, (Command("c1", "rollback", {"to_step": 2,
                                                                                     "skip_batches": 1}),)))
    t = _train(tiny_sft.overrides(run, steps=4) + ["trainer.save_freq=2"])
    (rb,) = rundir.iter_events(run, ["rollback"])
    assert (rb["from_step"], rb["to_step"], rb["skip_batches"]) == (4, 2, 1)
    assert t.summary.steps == 4
    after = _metrics(run)
    # step 3 was redone on a different batch (one skipped), so its score series differs from before
    assert after[3]["training/global_step"] == 3
    assert after[3] != before[3]


def test_pause_blocks_steps_until_a_resume_command_arrives(tiny_sft, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_control(run, Control(1, {}, (Command("p1", "pause", {"reason": "test"}),)))
    t = Trainer(load_config(tiny_sft.overrides(run, steps=2)), argv=["test"])
    done = threading.Thread(target=t.run)
    done.start()
    deadline = time.time() + 60
    while not rundir.iter_events(run, ["paused"]) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert not _metrics(run).get(1), "no step may run while paused"
    write_control(run, Control(2, {}, (Command("p1", "pause", {"reason": "test"}),
                                                     Command("r1", "resume"))))
    done.join(60)
    assert not done.is_alive()
    assert t.summary.exit_code == 0 and t.summary.steps == 2
    kinds = [e["kind"] for e in rundir.iter_events(run)]
    assert kinds.index("paused") < kinds.index("resumed") < kinds.index("finished")


@pytest.mark.slow
def test_cli_exits_75_after_an_oom_with_state_saved_and_a_rerun_finishes(tiny_trainer_args, trainer_env,
                                                                         tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = tiny_trainer_args(run, "trainer.faults='nan@1,oom@3'", steps=4)
    first = subprocess.run(argv, env=trainer_env, capture_output=True, text=True, timeout=120)
    assert first.returncode == rundir.EXIT_OOM, first.stderr[-2000:]
    events = rundir.iter_events(run)
    (oom,) = [e for e in events if e["kind"] == "oom"]
    assert oom["micro_batch_size"] == 8 and oom["step"] == 3
    assert [e["what"] for e in events if e["kind"] == "nan"] and all(e["step"] == 1 for e in events if e["kind"] == "nan")
    c = ckpt.latest_complete(run / rundir.CHECKPOINTS)
    assert c is not None and c.step == 2
    second = subprocess.run(argv + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
                            env=trainer_env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert sorted(_metrics(run)) == [1, 2, 3, 4]
    started = rundir.iter_events(run, ["started"])
    assert started[-1]["resumed_from"] == 2
    info = json.loads((run / rundir.RUN_JSON).read_text())
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4" in info["command"]


def test_cli_rejects_an_unknown_key_with_exit_2_naming_the_closest(trainer_env, tmp_path: Path) -> None:
    import sys

    proc = subprocess.run([sys.executable, "-m", "ppo_watchdog.trainer", "algorithm.kl_ctrl.klcoef=0.1"], env=trainer_env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "algorithm.kl_ctrl.klcoef" in proc.stderr and "algorithm.kl_ctrl.kl_coef" in proc.stderr


def test_oom_with_live_retry_halves_the_micro_batch_and_carries_on(tiny_sft, tmp_path: Path) -> None:
    run = tmp_path / "run"
    t = _train(tiny_sft.overrides(run, steps=3) + ["trainer.faults=oom@2", "trainer.oom_retry_live=true"])
    assert t.summary.exit_code == 0 and t.summary.steps == 3
    (oom,) = rundir.iter_events(run, ["oom"])
    assert (oom["step"], oom["micro_batch_size"], oom["new_micro_batch_size"], oom["action"]) == (2, 8, 4, "retry")
    assert t.cfg.critic.ppo_micro_batch_size_per_gpu == 4  # the critic updates first, so its micro batch hit it
    assert sorted(_metrics(run)) == [1, 2, 3]


def test_lr_spike_and_kl_collapse_faults_show_in_the_metrics_of_their_step(tiny_sft, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(tiny_sft.overrides(run, steps=3) + ["trainer.faults='lr_spike@2:x10,kl_collapse@3'"])
    m = _metrics(run)
    assert m[2]["actor/lr"] == pytest.approx(10 * m[1]["actor/lr"])
    assert m[2]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert m[3]["actor/reward_kl_penalty_coeff"] == 0.0
    assert [e["fault"] for e in rundir.iter_events(run, ["fault"])] == ["lr_spike", "kl_collapse"]


@pytest.mark.slow
def test_sigterm_during_a_hang_saves_and_exits_0(tiny_trainer_args, trainer_env, tmp_path: Path) -> None:
    import signal

    run = tmp_path / "run"
    proc = subprocess.Popen(tiny_trainer_args(run, "trainer.faults=hang@2:60", steps=4), env=trainer_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not (run / rundir.EVENTS).exists() or \
                not rundir.iter_events(run, ["fault"]):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.time() < deadline, "the hang fault never fired"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == rundir.EXIT_STOPPED
    finally:
        if proc.poll() is None:
            proc.kill()
    (stopped,) = rundir.iter_events(run, ["stopped"])
    assert "SIGTERM" in stopped["reason"]
    c = ckpt.latest_complete(run / rundir.CHECKPOINTS)
    assert c is not None and c.step == 2  # the hung step finished, then the boundary saved it
