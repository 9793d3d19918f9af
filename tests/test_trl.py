"""TRL runs under the watchdog: a real GRPOTrainer / RLOOTrainer on a tiny local Qwen2, on CPU.

Most tests run the glue in this process (``runner.launch``: one TRL import for the file, about a
second a run); a test that needs a change at a chosen step adds a TrainerCallback that writes
control.json at the end of that step, so nothing waits on a clock. The ``slow`` tests run
``watchdog run -- python -m ppo_watchdog.trainer.trl_glue`` as processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the [trl] extra (TRL needs Python >= 3.11)")

from transformers import TrainerCallback  # noqa: E402

from ppo_watchdog.core.replay import replay  # noqa: E402
from ppo_watchdog.core.rulefile import load_rules  # noqa: E402
from ppo_watchdog.protocol import catalog, rundir  # noqa: E402
from ppo_watchdog.protocol import checkpoint as ckpt  # noqa: E402
from ppo_watchdog.protocol.control import Command, Control, read_control, write_control  # noqa: E402
from ppo_watchdog.protocol.runinfo import RunInfo  # noqa: E402
from ppo_watchdog.trainer.trl_glue import assets  # noqa: E402
from ppo_watchdog.trainer.trl_glue.config import KL_COEF, KL_LOSS_COEF, TRLConfigError, parse_args  # noqa: E402
from ppo_watchdog.trainer.trl_glue.runner import launch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PACK = REPO / "rules" / "default.yaml"
LR = "actor_rollout_ref.actor.optim.lr"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2 warm-started on the arithmetic task, and its byte-level tokenizer, built once per
    session (no hub; ~10-25 s on 2 cores)."""
    return assets.build(tmp_path_factory.mktemp("trl-model") / "model")


def _args(model: Path, *extra: str, steps: int = 4) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"trainer.total_training_steps={steps}",
            "trainer.save_freq=2", "actor_rollout_ref.actor.optim.lr=0.0001", *extra]


def _run(run_dir: Path, model: Path, *extra: str, steps: int = 4, callbacks: tuple[Any, ...] = ()) -> int:
    return launch(parse_args(_args(model, *extra, steps=steps)), run_dir, ["test"], callbacks=callbacks)


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Step -> data; a step logged twice (a resumed run) keeps its last line."""
    return {r["step"]: r["data"] for r in rundir.read_jsonl(run_dir / rundir.METRICS).records}


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [dict(e) for e in rundir.iter_events(run_dir, [kind])]


class WriteControlAfter(TrainerCallback):
    """Writes one control.json version at the end of a chosen step (before the next step's boundary)."""

    def __init__(self, run_dir: Path, step: int, control: Control) -> None:
        self.run_dir, self.step, self.control = run_dir, step, control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            write_control(self.run_dir, self.control)


class OnDiskAtTrainBegin(TrainerCallback):
    """Records which checkpoints exist when training starts (after the glue's resume handling)."""

    def __init__(self, root: Path) -> None:
        self.root, self.steps = root, None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps = [c.step for c in ckpt.list_checkpoints(self.root)]


# -- settings ---------------------------------------------------------------------------------


def test_verl_keys_map_onto_trl_and_the_kl_key_follows_the_trainer(tiny_model: Path) -> None:
    grpo = parse_args(_args(tiny_model, f"{KL_LOSS_COEF}=0.02", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"))
    assert (grpo.beta, grpo.micro, grpo.completions_per_step, grpo.kl_key) == (0.02, 4, 8, KL_LOSS_COEF)
    rloo = parse_args(_args(tiny_model, "trainer.algorithm=rloo", f"{KL_COEF}=0.03"))
    assert (rloo.beta, rloo.kl_key) == (0.03, KL_COEF)
    # A relaunch after an OOM may carry the critic's micro batch (the pack lowers both): ignored.
    parse_args(_args(tiny_model, "critic.ppo_micro_batch_size_per_gpu=3"))


@pytest.mark.parametrize(("arg", "named"), [
    ("actor_rollout_ref.actor.optim.lrr=0.1", "actor_rollout_ref.actor.optim.lrr"),
    ("actor_rollout_ref.actor.optim.lr=-1", LR),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "ppo_micro_batch_size_per_gpu"),
    (f"{KL_COEF}=0.1", KL_COEF),  # GRPO's KL is a loss term: the reward penalty's key means another KL
    ("actor_rollout_ref.model.lora_rank=-8", "actor_rollout_ref.model.lora_rank"),
])
def test_a_bad_key_or_value_is_refused_naming_it(tiny_model: Path, arg: str, named: str) -> None:
    with pytest.raises(TRLConfigError, match=named.replace(".", r"\.")):
        parse_args(_args(tiny_model, arg))


def test_rloo_refuses_an_entropy_bonus_it_does_not_have(tiny_model: Path) -> None:
    with pytest.raises(TRLConfigError, match="entropy_coeff"):
        parse_args(_args(tiny_model, "trainer.algorithm=rloo", "actor_rollout_ref.actor.entropy_coeff=0.01"))


def test_an_unknown_trl_field_or_a_missing_model_exits_2_before_training(tiny_model: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(tmp_path / "run", tiny_model, "trl.no_such_field=1") == rundir.EXIT_USAGE
    assert _run(tmp_path / "run", tiny_model, f"actor_rollout_ref.model.path={tmp_path / 'nowhere'}") == rundir.EXIT_USAGE
    err = capsys.readouterr().err
    assert "trl.no_such_field" in err and "actor_rollout_ref.model.path" in err and "not a directory" in err
    assert not (tmp_path / "run" / rundir.METRICS).exists()


# -- the protocol -----------------------------------------------------------------------------


def test_grpo_run_writes_catalog_metrics_with_kl_as_a_loss_and_counted_checkpoints(tiny_model: Path,
                                                                                   tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _run(run_dir, tiny_model) == 0
    metrics = _metrics(run_dir)
    assert sorted(metrics) == [1, 2, 3, 4]
    short = catalog.to_short(metrics[4])
    for name in ("kl", "kl_coef", "entropy", "reward", "grad_norm", "lr", "pg_loss", "response_length", "step_time"):
        assert name in short, name
    assert metrics[4]["actor/kl_loss"] == metrics[4]["trl/kl"]  # GRPO's k3 KL is in the loss
    assert "actor/reward_kl_penalty" not in metrics[4]
    info = RunInfo.read(run_dir)
    assert info.pid == os.getpid() and info.skip_batches_key == "trainer.resume_skip_batches"
    assert set(info.live_keys or []) == {LR, KL_LOSS_COEF, "actor_rollout_ref.actor.clip_ratio",
                                         "actor_rollout_ref.actor.entropy_coeff"}
    assert "rollback" not in (info.commands or [])
    saved = [c for c in ckpt.list_checkpoints(run_dir / rundir.CHECKPOINTS) if c.complete]
    assert [c.step for c in saved] == [2, 4]  # manifests verify: the watchdog counts them
    assert [e["kind"] for e in rundir.iter_events(run_dir)] == ["started", "checkpoint", "checkpoint", "finished"]


def test_live_lr_and_beta_changes_take_effect_at_the_next_step_as_trl_itself_logs(tiny_model: Path,
                                                                                  tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    change = Control(1, {LR: 0.0002, KL_LOSS_COEF: 0.0})
    assert _run(run_dir, tiny_model, steps=4, callbacks=(WriteControlAfter(run_dir, 2, change),)) == 0
    (applied,) = _events(run_dir, "applied")
    assert (applied["step"], applied["version"]) == (2, 1)
    m = _metrics(run_dir)
    # TRL's own logged values: its learning_rate, and its KL, which it logs only while beta != 0.
    assert [m[s]["trl/learning_rate"] for s in (1, 2)] == [0.0001, 0.0001]
    assert [m[s]["trl/learning_rate"] for s in (3, 4)] == [pytest.approx(0.0002)] * 2
    assert [m[s]["actor/lr"] for s in (3, 4)] == [pytest.approx(0.0002)] * 2
    assert all("trl/kl" in m[s] for s in (1, 2)) and not any("trl/kl" in m[s] for s in (3, 4))


def test_what_trl_cannot_do_live_is_refused_with_an_error_naming_the_key(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    change = Control(1, {KL_LOSS_COEF: 0.05, "actor_rollout_ref.actor.clip_ratio": 0.1, LR: 0.0005})
    code = _run(run_dir, tiny_model, f"{KL_LOSS_COEF}=0.0", steps=3,
                callbacks=(WriteControlAfter(run_dir, 1, change),))
    assert code == 0
    errors = " | ".join(e["message"] for e in _events(run_dir, "error"))
    assert f"{KL_LOSS_COEF}=0.05" in errors and "reference model" in errors
    assert "actor_rollout_ref.actor.clip_ratio=0.1" in errors and "num_iterations=1" in errors
    m = _metrics(run_dir)
    assert not any("trl/kl" in d for d in m.values())  # the KL stayed off
    assert m[3]["trl/learning_rate"] == pytest.approx(0.0005)  # the key TRL can change still changed


def test_stop_command_saves_the_step_and_exits_0(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stop = Control(1, {}, (Command("s1", "stop"),))
    assert _run(run_dir, tiny_model, steps=6, callbacks=(WriteControlAfter(run_dir, 3, stop),)) == 0
    (saved,) = [e for e in _events(run_dir, "checkpoint") if e["reason"].startswith("stop")]
    assert saved["step"] == 3 and ckpt.verify_checkpoint(saved["path"]).step == 3
    assert _events(run_dir, "stopped") and not _events(run_dir, "finished")


def test_pause_holds_the_run_between_steps_until_resume_and_applies_what_arrives_meanwhile(
        tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    pause = Control(1, {}, (Command("p1", "pause"),))

    def answer() -> None:  # the watchdog's part: once the trainer says it is paused, resume with a new lr
        deadline = time.monotonic() + 120
        while not _events(run_dir, "paused") and time.monotonic() < deadline:
            time.sleep(0.05)
        write_control(run_dir, Control(2, {LR: 0.0003}, (Command("r1", "resume"),)))

    helper = threading.Thread(target=answer, daemon=True)
    helper.start()
    assert _run(run_dir, tiny_model, steps=4, callbacks=(WriteControlAfter(run_dir, 2, pause),)) == 0
    helper.join(5)
    kinds = [(e["kind"], e["step"]) for e in rundir.iter_events(run_dir) if e["kind"] in ("paused", "resumed", "applied")]
    assert kinds == [("applied", 2), ("paused", 2), ("resumed", 2), ("applied", 2)]
    m = _metrics(run_dir)
    assert sorted(m) == [1, 2, 3, 4] and m[3]["trl/learning_rate"] == pytest.approx(0.0003)


def test_nan_weights_become_a_nan_event_and_exit_1_before_any_metric_of_that_step(tiny_model: Path,
                                                                                  tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _run(run_dir, tiny_model, "trainer.faults=nan_weights@3", steps=5) == 1
    (nan,) = _events(run_dir, "nan")
    assert nan["step"] == 3 and "probability tensor" in nan["message"]
    assert sorted(_metrics(run_dir)) == [1, 2]


def test_an_oom_becomes_an_oom_event_and_exit_75(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = _run(run_dir, tiny_model, "trainer.faults=oom@2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    assert code == rundir.EXIT_OOM
    (oom,) = _events(run_dir, "oom")
    assert (oom["step"], oom["micro_batch_size"], oom["memory"]) == (2, 4, "host")


def test_resume_applies_the_launch_lr_not_the_checkpoints_and_discards_the_abandoned_branch(
        tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _run(run_dir, tiny_model, steps=4) == 0  # lr 1e-4, checkpoints at 2 and 4
    first = _metrics(run_dir)
    root = run_dir / rundir.CHECKPOINTS
    back = str(ckpt.step_dir(root, 2))
    seen = OnDiskAtTrainBegin(root)
    code = _run(run_dir, tiny_model, "actor_rollout_ref.actor.optim.lr=0.0002", "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={back}", "trainer.max_actor_ckpt_to_keep=1", steps=6, callbacks=(seen,))
    assert code == 0
    assert seen.steps == [2]  # the abandoned branch's checkpoint 4 was gone before the resumed run trained
    resumed = _metrics(run_dir)
    assert [resumed[s]["trl/learning_rate"] for s in (3, 4, 5, 6)] == [pytest.approx(0.0002)] * 4
    started = _events(run_dir, "started")[-1]
    assert (started["resumed_from"], started["resume_path"]) == (2, back)
    # Checkpoint 4 of the abandoned branch went at the resume; keeping 1 never prunes the one resumed from.
    steps = [c.step for c in ckpt.list_checkpoints(root) if c.complete]
    assert steps == [2, 6]
    assert first[3]["trl/learning_rate"] == pytest.approx(0.0001)


def test_a_resumed_step_replays_the_original_unless_a_rollback_skips_its_batch(tiny_model: Path,
                                                                               tmp_path: Path) -> None:
    # Prompts of 64 different lengths: the tokens a step reads (TRL's num_tokens) say which prompts it drew.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "7" * (i + 1) + "="}) + "\n" for i in range(64)))
    data = f"data.train_files={prompts}"
    runs = {}
    for name, skip in (("orig", None), ("same", 0), ("skip", 1)):
        run_dir = tmp_path / name
        if name == "orig":
            assert _run(run_dir, tiny_model, data, steps=3) == 0
        else:
            assert _run(tmp_path / f"{name}-base", tiny_model, data, steps=2) == 0
            back = ckpt.step_dir(tmp_path / f"{name}-base" / rundir.CHECKPOINTS, 2)
            assert _run(run_dir, tiny_model, data, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={back}",
                        f"trainer.resume_skip_batches={skip}", steps=3) == 0
        runs[name] = _metrics(run_dir)[3]
    assert runs["same"]["trl/num_tokens"] == runs["orig"]["trl/num_tokens"]
    assert runs["same"]["trl/kl"] == runs["orig"]["trl/kl"]  # a resume reproduces the step exactly on CPU
    assert runs["skip"]["trl/num_tokens"] != runs["orig"]["trl/num_tokens"]
    (started,) = _events(tmp_path / "skip", "started")
    assert started["skipped_batches"] == 1


def test_a_lora_run_checkpoints_its_adapter_and_a_resume_replays_the_step_it_would_have_trained(
        tiny_model: Path, tmp_path: Path) -> None:
    lora = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
    assert _run(tmp_path / "orig", tiny_model, *lora, steps=3) == 0
    assert _run(tmp_path / "base", tiny_model, *lora, steps=2) == 0
    back = ckpt.step_dir(tmp_path / "base" / rundir.CHECKPOINTS, 2)
    assert (back / "adapter_model.safetensors").is_file() and not (back / "model.safetensors").exists()
    assert _run(tmp_path / "resumed", tiny_model, *lora, "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={back}", steps=3) == 0
    # Step 3 from the restored adapter and optimizer is step 3 of the run that never stopped (exact on CPU); an
    # adapter not restored would start from the base model again, whose KL to itself is 0.
    orig, resumed = _metrics(tmp_path / "orig")[3], _metrics(tmp_path / "resumed")[3]
    assert resumed["trl/kl"] == orig["trl/kl"] and orig["trl/kl"] > 0
    model = json.loads((tmp_path / "resumed" / "run.json").read_text())["config"]["actor_rollout_ref"]["model"]
    assert (model["lora_rank"], model["lora_alpha"], model["target_modules"]) == (4, 8, "all-linear")


def test_rloo_smoke_logs_its_kl_as_a_reward_penalty(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _run(run_dir, tiny_model, "trainer.algorithm=rloo", f"{KL_COEF}=0.05", steps=3) == 0
    m = _metrics(run_dir)
    assert sorted(m) == [1, 2, 3]
    assert m[3]["actor/reward_kl_penalty"] == m[3]["trl/kl"] and m[3]["actor/reward_kl_penalty_coeff"] == 0.05
    assert set(RunInfo.read(run_dir).live_keys or []) == {LR, KL_COEF, "actor_rollout_ref.actor.clip_ratio"}


def test_the_default_pack_judges_a_healthy_trl_run_without_a_rollback(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _run(run_dir, tiny_model, "trainer.save_freq=10", steps=40) == 0
    records = rundir.read_jsonl(run_dir / rundir.METRICS).records
    out = replay(records, load_rules([DEFAULT_PACK]), events=_events(run_dir, "checkpoint"),
                 config=RunInfo.read(run_dir).config, live_keys=RunInfo.read(run_dir).live_keys or ())
    drastic = [(d.step, d.rule) for d in out.decisions for a in d.actions if a["kind"] in ("rollback", "pause")]
    assert drastic == []


# -- under the watchdog (processes) -----------------------------------------------------------


def _watchdog(tmp_path: Path, model: Path, *extra: str, steps: int, rules: Path | None = None
              ) -> subprocess.CompletedProcess[str]:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--state-dir", str(tmp_path / "state"),
           "--tick", "0.3", "--no-report", *(["--rules", str(rules)] if rules else []), "--", sys.executable, "-m",
           "ppo_watchdog.trainer.trl_glue", "--run-dir", str(run_dir), *_args(model, *extra, steps=steps)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=170, env={**os.environ, "TRAINER_LOG_LEVEL": "WARNING"})


def _history(tmp_path: Path) -> list[dict[str, Any]]:
    return json.loads(subprocess.run(
        [sys.executable, "-m", "ppo_watchdog", "history", "run", "--json", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, check=True).stdout)


TIGHTEN = """version: 1
rules:
  - name: tighten
    description: at step 2, halve the lr and the clip ratio (TRL takes the lr; clip has no effect at num_iterations 1)
    expr: step >= 2
    actions:
      - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.5}
      - set: {key: actor_rollout_ref.actor.clip_ratio, scale: 0.5}
    cooldown: 1000
    severity: warning
"""


@pytest.mark.slow
def test_a_live_set_trl_refuses_in_part_says_which_key_and_why_in_history(tiny_model: Path, tmp_path: Path) -> None:
    rules = tmp_path / "tighten.yaml"
    rules.write_text(TIGHTEN)
    # TRL's steps take a few hundredths of a second: a pause at step 4 keeps the run alive until the set
    # decided at step 2 is applied, however slow the machine (else the run can end before it).
    proc = _watchdog(tmp_path, tiny_model, "trainer.faults=hang@4:5", steps=8, rules=rules)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (decision,) = [h for h in _history(tmp_path) if h["rule"] == "tighten"]
    assert decision["status"] == "applied"
    assert "refused by the trainer: actor_rollout_ref.actor.clip_ratio=0.1" in decision["outcome"]
    assert "num_iterations=1" in decision["outcome"] and LR not in decision["outcome"].split("refused")[1]
    (applied,) = _events(tmp_path / "run", "applied")
    assert _metrics(tmp_path / "run")[applied["step"] + 1]["trl/learning_rate"] == pytest.approx(0.00005)  # free: live


@pytest.mark.slow
def test_watchdog_rolls_a_trl_run_back_after_a_nan_and_never_resumes_the_abandoned_branch(
        tiny_model: Path, tmp_path: Path) -> None:
    proc = _watchdog(tmp_path, tiny_model, "trainer.faults=nan_weights@8", "trainer.save_freq=3", steps=12)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = _history(tmp_path)
    fired = [h for h in history if h["kind"] != "resolve"]
    assert [(h["rule"], h["status"]) for h in fired if h["rule"] == "nan_or_inf"] == [("nan_or_inf", "applied")]
    # The tiny model's KL can pass the seed's 0.1 before the NaN (kl_high: kl_coef x1.2, live, no restart);
    # no other rule rolls back or restarts (one restart below: the NaN's).
    assert {h["rule"] for h in fired} <= {"nan_or_inf", "kl_high", "kl_above_target"}, fired
    run_dir = tmp_path / "run"
    starts = _events(run_dir, "started")
    assert len(starts) == 2
    target = Path(starts[1]["resume_path"])
    assert target.parent == run_dir / rundir.CHECKPOINTS and starts[1]["resumed_from"] < 8
    assert starts[1]["skipped_batches"] >= 1
    # The rollback's lr, not the checkpoint's: the pack halves it.
    assert _metrics(run_dir)[starts[1]["resumed_from"] + 1]["trl/learning_rate"] == pytest.approx(0.00005)
    # Every checkpoint now on disk was saved on the new timeline (or before the target): none of the
    # abandoned branch is left for a later resume to pick up.
    restart_ts = starts[1]["ts"]
    for c in ckpt.list_checkpoints(run_dir / rundir.CHECKPOINTS):
        assert c.step <= starts[1]["resumed_from"] or c.ts > restart_ts, c
    assert _events(run_dir, "finished")


# -- a user's own script: from ppo_watchdog.trl import WatchdogCallback -----------------------------

USER_SCRIPT = '''\
"""A user's own GRPO script: its reward, its data, its GRPOConfig; the watchdog's callback and train()."""
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from ppo_watchdog.trl import WatchdogCallback

model, run_dir, out, faults = sys.argv[1:5]


def digit_share(completions, **kwargs):
    return [sum(c.isdigit() for c in str(t)) / max(len(str(t)), 1) for t in completions]


rows = [{"prompt": f"{a}+{b}="} for a in range(8) for b in range(8)]
args = GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  learning_rate=1e-4, lr_scheduler_type="constant", beta=0.04, max_steps=12, save_steps=3,
                  logging_steps=1, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, seed=0)
watchdog = WatchdogCallback(run_dir, faults=faults)
trainer = GRPOTrainer(model=model, reward_funcs=[digit_share], train_dataset=Dataset.from_list(rows), args=args,
                      callbacks=[watchdog])
watchdog.train(trainer)
'''

HALVE_LR_AT_2 = """version: 1
rules:
  - name: halve_lr_at_2
    description: at step 2, halve the lr (live in a TRL run)
    expr: step == 2
    actions:
      - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.5}
    cooldown: 1000
    severity: warning
"""


@pytest.mark.slow
def test_a_users_own_grpo_script_under_watchdog_run_gets_a_live_lr_change_and_a_rollback_by_relaunch(
        tiny_model: Path, tmp_path: Path) -> None:
    script, run_dir, rules = tmp_path / "my_grpo.py", tmp_path / "run", tmp_path / "halve.yaml"
    script.write_text(USER_SCRIPT)
    rules.write_text(HALVE_LR_AT_2)
    # hang@4:5 keeps the run alive at step 4 until the set decided at step 2 is applied, however slow the machine.
    own = [sys.executable, str(script), str(tiny_model), str(run_dir), str(tmp_path / "out"), "hang@4:5,nan_weights@8"]
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--state-dir", str(tmp_path / "state"),
           "--tick", "0.3", "--no-report", "--rules", str(DEFAULT_PACK), "--rules", str(rules), "--", *own]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRAINER_LOG_LEVEL": "WARNING"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fired = {h["rule"]: h for h in _history(tmp_path) if h["kind"] != "resolve"}
    assert fired["halve_lr_at_2"]["status"] == "applied" and fired["nan_or_inf"]["status"] == "applied"
    # Live: applied at a step boundary of the first launch, the next step trained at half the lr.
    live = next(e for e in _events(run_dir, "applied") if LR in e["applied"])
    first: dict[int, dict[str, float]] = {}  # the first launch's lines (the relaunch trains some steps again)
    for r in rundir.read_jsonl(run_dir / rundir.METRICS).records:
        first.setdefault(r["step"], r["data"])
    assert first[live["step"]]["trl/learning_rate"] == pytest.approx(0.0001)
    assert first[live["step"] + 1]["trl/learning_rate"] == pytest.approx(0.00005)
    m = _metrics(run_dir)
    # The rollback: the script relaunched as it was (its own argv, nothing appended), resumed from a
    # checkpoint before the NaN with the rollback's batch skip, at the lr the watchdog wants now.
    info = RunInfo.read(run_dir)
    assert info.launch_args == "env" and info.command[1:] == own[1:]
    starts = _events(run_dir, "started")
    assert len(starts) == 2 and Path(starts[1]["resume_path"]).parent == run_dir / rundir.CHECKPOINTS
    assert starts[1]["resumed_from"] < 8 and starts[1]["skipped_batches"] >= 1
    (nan,) = _events(run_dir, "nan")
    assert nan["step"] == 8
    wanted = read_control(run_dir).overrides[LR]
    assert wanted < 0.00005  # the rollback's own remedy halved the live-set lr again
    assert m[starts[1]["resumed_from"] + 1]["trl/learning_rate"] == pytest.approx(wanted)
    assert sorted(m)[-1] == 12 and _events(run_dir, "finished")
    assert all(c.complete for c in ckpt.list_checkpoints(run_dir / rundir.CHECKPOINTS))


def _rloo(model: Path, out: Path, steps: int, *callbacks: Any) -> Any:
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    from ppo_watchdog.trainer.trl_glue.task import digits_reward, prompts

    args = RLOOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
                      learning_rate=1e-4, lr_scheduler_type="constant", beta=0.05, max_steps=steps, save_steps=2,
                      logging_steps=1, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)
    return RLOOTrainer(model=str(model), reward_funcs=[digits_reward], train_dataset=Dataset.from_list(prompts(32)),
                       args=args, callbacks=list(callbacks))


def test_an_rloo_script_resumes_where_the_launch_args_say_and_takes_trls_own_setting_names(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_watchdog.trl import WatchdogCallback

    run_dir = tmp_path / "run"
    monkeypatch.setenv(rundir.RUN_DIR_ENV, str(run_dir))
    monkeypatch.delenv(rundir.LAUNCH_ARGS_ENV, raising=False)
    first = WatchdogCallback()
    first.train(_rloo(tiny_model, tmp_path / "out", 2, first))
    info = RunInfo.read(run_dir)
    assert info.launch_args == "env" and set(info.live_keys or []) == {LR, KL_COEF, "actor_rollout_ref.actor.clip_ratio"}
    assert info.config["algorithm"]["kl_ctrl"]["kl_coef"] == 0.05 and _metrics(run_dir)[2]["actor/reward_kl_penalty"] > -1
    back = ckpt.step_dir(run_dir / rundir.CHECKPOINTS, 2)
    # A relaunch: TRL's own names beside verl's; a micro batch the script's built trainer cannot take is said.
    monkeypatch.setenv(rundir.LAUNCH_ARGS_ENV, json.dumps([
        "learning_rate=0.0002", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={back}",
        "per_device_train_batch_size=2"]))
    second = WatchdogCallback(run_dir)
    # control.json in TRL's names (written by hand, say) is read as the same keys.
    by_hand = WriteControlAfter(run_dir, 3, Control(1, {"learning_rate": 0.0003}))
    second.train(_rloo(tiny_model, tmp_path / "out", 4, second, by_hand))
    started = _events(run_dir, "started")[-1]
    assert (started["resumed_from"], started["resume_path"]) == (2, str(back))
    m = _metrics(run_dir)
    assert m[3]["trl/learning_rate"] == pytest.approx(0.0002)
    assert m[4]["trl/learning_rate"] == pytest.approx(0.0003)
    (error,) = _events(run_dir, "error")
    assert error["message"].startswith("per_device_train_batch_size=2: not applied")


def test_the_callback_needs_a_run_directory_and_its_own_train(tiny_model: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_watchdog.trl import WatchdogCallback

    monkeypatch.delenv(rundir.RUN_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=rundir.RUN_DIR_ENV):
        WatchdogCallback()
    monkeypatch.setenv(rundir.RUN_DIR_ENV, str(tmp_path / "watched"))
    with pytest.raises(ValueError, match="not the one the watchdog watches"):
        WatchdogCallback(tmp_path / "elsewhere")
    callback = WatchdogCallback()
    with pytest.raises(RuntimeError, match=r"watchdog\.train\(trainer\)"):
        _rloo(tiny_model, tmp_path / "out", 1, callback).train()
