"""Zero-patch mode: the watchdog supervising an unmodified verl run.

- exit classification from the log, on driver tracebacks built by raising the real Ray and
  torch exception classes (``RayTaskError(...).as_instanceof_cause()``, ``ActorDiedError``
  with an ``ActorDiedErrorContext``) with the messages the installed Ray and torch emit;
- verl's checkpoint layout (marker, per-rank files, world size) and known-good selection;
- verl's lr trap on resume, shown with a real AdamW + LambdaLR saved under verl's file names,
  and the patched copy that defuses it (or the refusal when weights_only cannot load a file);
- the launch command (logger, file-logger env, resume flags, KL coefficient carried over);
- the run's /metrics served by the watchdog, and `watchdog replay` / `watchdog run` on verl's
  older ``critic/kl`` / ``critic/kl_coeff`` keys written by verl's real FileLogger;
- end to end: `watchdog run --mode verl` over the embedded trainer behaving like verl
  (``trainer.run_dir_protocol=false``): an injected OOM and a KL rule, each by restart;
- the daemon: ``mode: verl`` per run in daemon.yaml (the deploy example parsed), the glue's launch,
  re-attaching to a live verl run after the daemon restarts, bad modes, and a KL restart end to end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import traceback
import urllib.request
from fractions import Fraction
from pathlib import Path

import pytest
from verl_logs import HEALTHY, needs_logs

from ppo_watchdog.backends import local, verl_exits
from ppo_watchdog.backends import zero_patch as verl_mode
from ppo_watchdog.backends.verl_lr_patch import LrPatchRefused, checkpoint_lrs, patch_lr_copy, wanted_changes
from ppo_watchdog.control.actuator import choose_known_good
from ppo_watchdog.control.store import BadSpan, Store
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import hydra, rundir
from ppo_watchdog.protocol.runinfo import RunInfo

ROOT = Path(__file__).resolve().parents[1]
ACTOR_LR = "actor_rollout_ref.actor.optim.lr"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
KL = "algorithm.kl_ctrl.kl_coef"

# -- fixtures: driver output as verl + Ray + Hydra print it --------------------------------

#: torch's caching-allocator message (c10/cuda/CUDACachingAllocator.cpp, TORCH_CHECK_WITH(OutOfMemoryError,
#: ...)): not in the CPU build installed here, so the format is copied from the source, numbers made up.
CUDA_OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
    "1.05 GiB is free. Process 381524 has 78.04 GiB memory in use. Of the allocated memory 75.12 GiB is "
    "allocated by PyTorch, and 1.37 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
    "See documentation for Memory Management  "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)
#: The raylet's OOM-kill texts (strings of ray/core/src/ray/raylet/raylet, Ray 2.60): "The actor is dead
#: because its worker process has died. Worker exit type: " + NODE_OUT_OF_MEMORY + " Worker exit detail: "
#: + "%d worker(s) were killed due to the node running low on memory. " + "Memory on the node (IP: %s, ID: %s)
#: was %sGB used / %sGB limit (%f)".
HOST_OOM_DETAIL = (
    "The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY "
    "Worker exit detail: 1 worker(s) were killed due to the node running low on memory. "
    "Memory on the node (IP: 10.0.0.7, ID: 5f1c2b) was 241.12GB used / 251.50GB limit (0.958725)"
)
#: A worker that died without the memory monitor (SIGKILL, segfault): the raylet lists the kernel OOM
#: killer only among possible causes.
SYSTEM_ERROR_DETAIL = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
    "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some potential "
    "root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage. "
    "(2) ray stop --force is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors."
)
HYDRA_TRAILER = "\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
#: One metric line of verl's console logger with NaN values (verl issue 498), before an unrelated crash.
NAN_METRIC_LINE = ("(TaskRunner pid=2217) step:1 - critic/kl:-0.000 - critic/kl_coeff:0.040 - critic/vf_loss:nan"
                   " - critic/grad_norm:nan - actor/pg_loss:-0.013")


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _driver_log(cause: BaseException) -> str:
    """verl's driver output when a worker raised ``cause``: RayTaskError wrapping it, printed by Hydra."""
    from ray.exceptions import RayTaskError

    worker_tb = _format(cause)
    err = RayTaskError("TaskRunner.run", worker_tb, cause, proctitle="ray::TaskRunner.run", pid=4242,
                       ip="10.0.0.7", actor_repr="<main_ppo.TaskRunner object at 0x7f2a>",
                       actor_id="5f1c2b").as_instanceof_cause()
    try:
        raise err
    except Exception as e:  # noqa: BLE001 - formatting what the driver would print
        driver = _format(e)
    return "Training from scratch\n" + driver + HYDRA_TRAILER


def _glue(run: Path, run_id: str = "run") -> verl_mode.VerlGlue:
    glue = verl_mode.dialect_for(run, run_id)
    assert isinstance(glue, verl_mode.VerlGlue), f"{run}: run.json does not say zero-patch mode"
    return glue


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return e


def _actor_died(detail: str) -> str:
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    ctx = ActorDiedErrorContext(error_message=detail, class_name="WorkerDict", actor_id=bytes(range(16)),
                                pid=31337, ray_namespace="verl", node_ip_address="10.0.0.7")
    return _format(_raised(ActorDiedError(ctx))) + HYDRA_TRAILER


@pytest.fixture(scope="module")
def cuda_oom_log() -> str:
    import torch

    return _driver_log(_raised(torch.OutOfMemoryError(CUDA_OOM_MESSAGE)))


@pytest.fixture(scope="module")
def host_oom_actor_log() -> str:
    return _actor_died(HOST_OOM_DETAIL)


@pytest.fixture(scope="module")
def ray_task_oom_log() -> str:
    from ray.exceptions import OutOfMemoryError as RayOOM

    return _driver_log(_raised(RayOOM(HOST_OOM_DETAIL)))


@pytest.fixture(scope="module")
def nan_sampling_log() -> str:
    import torch

    try:
        torch.multinomial(torch.tensor([float("nan"), 1.0]), 1)  # the real message of sampling NaN logits
    except RuntimeError as exc:
        return _driver_log(exc)
    raise AssertionError("torch.multinomial accepted NaN probabilities")


# -- exit classification ----------------------------------------------------------------------


def test_cuda_oom_wrapped_in_a_ray_task_error_with_exit_code_1_is_a_cuda_oom(cuda_oom_log: str) -> None:
    assert "RayTaskError(OutOfMemoryError)" in cuda_oom_log  # what verl's driver really prints
    ec = verl_exits.classify(cuda_oom_log, 1)
    assert (ec.kind, ec.memory, ec.action, ec.exit_code) == ("oom", "cuda", "oom", 1)
    assert "CUDA out of memory" in ec.evidence or "OutOfMemoryError" in ec.evidence


def test_actor_killed_by_rays_memory_monitor_is_a_host_oom(host_oom_actor_log: str) -> None:
    assert "ray.exceptions.ActorDiedError" in host_oom_actor_log
    ec = verl_exits.classify(host_oom_actor_log, 1)
    assert (ec.kind, ec.memory) == ("oom", "host")


def test_ray_task_error_wrapping_rays_own_oom_is_host_not_cuda(ray_task_oom_log: str) -> None:
    # The wrapper's name is the same as for a CUDA OOM; the cause line says it was the node's memory.
    assert "RayTaskError(OutOfMemoryError)" in ray_task_oom_log
    assert verl_exits.classify(ray_task_oom_log, 1).memory == "host"


def test_sampling_from_nan_logits_is_a_nan_exit(nan_sampling_log: str) -> None:
    ec = verl_exits.classify(nan_sampling_log, 1)
    assert (ec.kind, ec.action) == ("nan", "crash")
    assert "probability tensor contains" in ec.evidence


def test_a_worker_death_that_only_lists_the_oom_killer_as_possible_is_a_crash() -> None:
    ec = verl_exits.classify(_actor_died(SYSTEM_ERROR_DETAIL), 1)
    assert ec.kind == "crash"
    assert ec.evidence.startswith("ray.exceptions.ActorDiedError")


def test_nan_in_console_metric_lines_is_not_an_exit_reason() -> None:
    text = NAN_METRIC_LINE + "\n" + _format(_raised(KeyError("critic/values/mean"))) + HYDRA_TRAILER
    ec = verl_exits.classify(text, 1)
    assert ec.kind == "crash" and "KeyError" in ec.evidence


def test_exit_code_zero_is_finished_whatever_the_log_says(cuda_oom_log: str) -> None:
    assert verl_exits.classify(cuda_oom_log, 0).kind == "finished"


def test_only_the_current_attempts_part_of_an_appended_log_is_read(tmp_path: Path, cuda_oom_log: str) -> None:
    log = tmp_path / "trainer.log"
    log.write_text(cuda_oom_log)
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write(_format(_raised(ValueError("bad data.train_files"))))
    assert verl_exits.classify(local.read_tail(str(log), start), 1).kind == "crash"
    assert verl_exits.classify(local.read_tail(str(log), 0), 1).kind == "oom"


# -- verl's checkpoint layout --------------------------------------------------------------------


def _train_state(lr: float, steps: int, warmup: int = 10, seed: int = 0):
    """A real tiny model, AdamW and LambdaLR (linear warm-up, as verl's) after ``steps`` updates."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    for _ in range(steps):
        model(torch.ones(3, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _save_verl_step(root: Path, step: int, world_size: int, lr: float = 1e-3, components=("actor", "critic"),
                    optim_extra: object | None = None) -> Path:
    """A verl ``global_step_N`` with every rank's files written by torch.save under verl's names."""
    import random

    import numpy as np
    import torch

    model, opt, sched = _train_state(lr, steps=3)
    d = ckpt.step_dir(root, step)
    for comp in components:
        for rank in range(world_size):
            optim = opt.state_dict()
            if optim_extra is not None:
                optim = {**optim, "sharded": optim_extra}
            files = {"model": model.state_dict(), "optim": optim,
                     "extra_state": {"lr_scheduler": sched.state_dict(),
                                     "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
                                             "random": random.getstate()}}}
            for kind, obj in files.items():
                path = ckpt.verl_file(d / comp, kind, world_size, rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(obj, path)
    torch.save({"dataloader": {"step": step}}, d / "data.pt")
    return d


def test_a_verl_checkpoint_counts_at_or_below_the_marker_with_every_ranks_files(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step in (2, 3, 4, 6):
        _save_verl_step(root, step, world_size=2)
    (root / rundir.LATEST_MARKER).write_text("4")
    ckpt.verl_file(root / "global_step_3" / "critic", "optim", 2, 1).unlink()  # a torn save
    infos = {c.step: c for c in ckpt.list_verl_checkpoints(root, world_size=2)}
    assert {s for s, c in infos.items() if c.complete} == {2, 4}
    assert "optim_world_size_2_rank_1.pt" in infos[3].reason
    assert "newer than" in infos[6].reason
    # The run now has 4 GPUs: a 2-GPU checkpoint is not a resume point for it.
    other = ckpt.list_verl_checkpoints(root, world_size=4)
    assert not any(c.complete for c in other) and "world size 2" in other[0].reason
    # Known-good selection is the one the embedded trainer's checkpoints get.
    complete = [c for c in infos.values() if c.complete]
    assert choose_known_good(complete, []).step == 4
    span = BadSpan("kl_far_above", start_step=3, end_step=None, opened_ts=0.0, closed_ts=None)
    assert choose_known_good(complete, [span]).step == 2


def test_a_verl_checkpoint_without_the_dataloader_state_or_marker_does_not_count(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    d = _save_verl_step(root, 5, world_size=1)
    assert not ckpt.list_verl_checkpoints(root)[0].complete  # no marker yet
    (root / rundir.LATEST_MARKER).write_text("5")
    assert ckpt.list_verl_checkpoints(root)[0].complete
    (d / "data.pt").unlink()
    assert "data.pt" in ckpt.list_verl_checkpoints(root)[0].reason


# -- verl's lr trap and the patched copy ----------------------------------------------------------


def _verl_resume(path: Path, lr: float, world_size: int = 2, rank: int = 0):
    """What verl's FSDP checkpoint manager does on resume: a fresh optimizer and scheduler built with the
    NEW config lr, then the optimizer state and the LambdaLR state loaded from the checkpoint files."""
    model, opt, sched = _train_state(lr, steps=0)
    d = path / "actor"
    model.load_state_dict(ckpt.load_verl_file(ckpt.verl_file(d, "model", world_size, rank)))
    opt.load_state_dict(ckpt.load_verl_file(ckpt.verl_file(d, "optim", world_size, rank)))
    sched.load_state_dict(ckpt.load_verl_file(ckpt.verl_file(d, "extra_state", world_size, rank))["lr_scheduler"])
    return model, opt, sched


def _one_step(model, opt, sched) -> tuple[float, float]:
    """(parameter change of one optimizer.step(), lr the scheduler sets for the next step)."""
    import torch

    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).pow(2).sum().backward()
    opt.step()
    sched.step()
    return float((model.weight.detach() - before).abs().sum()), float(opt.param_groups[0]["lr"])


def test_verl_resume_keeps_the_checkpoint_lr_and_the_patched_copy_carries_the_new_one(tmp_path: Path) -> None:
    old, new = 1e-3, 2.5e-4
    src = _save_verl_step(tmp_path / "ck", 3, world_size=2, lr=old)
    warm = min(1.0, 4 / 10)  # LambdaLR after 3 steps of a 10-step warm-up
    # The trap: built with the new lr, verl's load puts the old one back, now and for every later step.
    trap = _verl_resume(src, new)
    assert trap[1].param_groups[0]["lr"] == pytest.approx(old * warm)
    assert trap[2].base_lrs == [pytest.approx(old)]
    trap_delta, trap_next = _one_step(*trap)
    assert trap_next == pytest.approx(old * min(1.0, 5 / 10))

    assert wanted_changes(src, {ACTOR_LR: new}) == {ACTOR_LR: (pytest.approx(old), new)}
    dst = patch_lr_copy(src, tmp_path / "resume", {ACTOR_LR: new})
    assert dst.name == src.name  # verl takes the step from the directory name
    for rank in (0, 1):
        fixed = _verl_resume(dst, new, rank=rank)
        assert fixed[1].param_groups[0]["lr"] == pytest.approx(new * warm)
        assert fixed[1].param_groups[0]["initial_lr"] == pytest.approx(new)
        assert fixed[2].base_lrs == [pytest.approx(new)]
        delta, nxt = _one_step(*fixed)
        assert nxt == pytest.approx(new * min(1.0, 5 / 10))
        # Same state, same gradient: AdamW's step (and its decoupled weight decay) scale with the lr used.
        assert delta / trap_delta == pytest.approx(new / old, rel=1e-4)
    assert checkpoint_lrs(dst) == {ACTOR_LR: pytest.approx(new), "critic.optim.lr": pytest.approx(old)}
    # The model shards are shared, the source is untouched, the copy is reused when asked again.
    m_src, m_dst = (ckpt.verl_file(p / "actor", "model", 2, 0) for p in (src, dst))
    assert os.stat(m_src).st_ino == os.stat(m_dst).st_ino
    assert checkpoint_lrs(src)[ACTOR_LR] == pytest.approx(old)
    stamp = (dst / ".watchdog_lr_patch.json").stat().st_mtime_ns
    assert patch_lr_copy(src, tmp_path / "resume", {ACTOR_LR: new}) == dst
    assert (dst / ".watchdog_lr_patch.json").stat().st_mtime_ns == stamp


def test_an_lr_change_is_refused_when_a_file_cannot_be_loaded_weights_only(tmp_path: Path) -> None:
    # An object outside the weights_only allowlist stands for what verl cannot guarantee (sharded tensor
    # classes of other torch versions): the patch refuses, naming the file, and writes nothing.
    src = _save_verl_step(tmp_path / "ck", 3, world_size=1, optim_extra=Fraction(1, 3))
    with pytest.raises(LrPatchRefused) as caught:
        patch_lr_copy(src, tmp_path / "resume", {ACTOR_LR: 5e-4})
    assert "optim_world_size_1_rank_0.pt" in str(caught.value) and "weights_only" in str(caught.value)
    assert not (tmp_path / "resume").exists() or not any((tmp_path / "resume").iterdir())


def test_a_refused_lr_change_is_audited_and_dropped_from_the_restart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = ["python3", "-m", "verl.trainer.main_ppo", f"{ACTOR_LR}=1e-3", "trainer.n_gpus_per_node=1"]
    verl_mode.init_run(run, cmd)
    glue = _glue(run)
    bad = _save_verl_step(run / "checkpoints", 3, world_size=1, optim_extra=Fraction(1, 3))
    p = glue.plan_resume({"resume_path": str(bad), "set": {ACTOR_LR: 5e-4, KL: 0.002}, "resume": "latest"},
                         {ACTOR_LR: 5e-4, KL: 0.002})
    assert p["set"] == {KL: 0.002} and p["refused_keys"] == [ACTOR_LR]
    assert "lr change refused" in p["refused"] and "optim_world_size_1_rank_0.pt" in p["refused"]
    assert p["resume_path"] == str(bad)
    good = _save_verl_step(tmp_path / "ck2", 4, world_size=1, lr=1e-3)
    p = glue.plan_resume({"resume_path": str(good), "resume": "latest"}, {ACTOR_LR: 5e-4})
    assert p["checkpoint_path"] == str(good) and Path(p["resume_path"]).name == "global_step_4"
    assert "0.001 -> 0.0005" in p["lr_patch"]
    assert checkpoint_lrs(Path(p["resume_path"]))[ACTOR_LR] == pytest.approx(5e-4)


# -- the launch command ---------------------------------------------------------------------------

#: The seed's example, run_qwen2-7b style (verl's examples/ppo_trainer/run_qwen2-7b_*.sh).
SEED_COMMAND = [
    "python3", "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=gae",
    "data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=256", "data.max_prompt_length=1024", "data.max_response_length=512",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.clip_ratio=0.2", "algorithm.kl_ctrl.kl_coef=0.001", "critic.optim.lr=1e-5",
    "critic.model.path=Qwen/Qwen2-7B-Instruct", "critic.ppo_micro_batch_size_per_gpu=32",
    "trainer.logger=['console','wandb']", "trainer.project_name=verl_example",
    "trainer.experiment_name=qwen2-7b_gsm8k", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
    "trainer.save_freq=5", "trainer.test_freq=10", "trainer.total_epochs=15",
]


def _args(cmd: list[str]) -> dict[str, str]:
    """Each override's value as written on the command line (Hydra's parser finds them)."""
    return {k: ov.text.partition("=")[2] for k, ov in hydra.overrides(cmd).items()}


def test_the_relaunch_of_a_verl_command_adds_logger_env_resume_and_carries_kl(tmp_path: Path) -> None:
    from ppo_watchdog.control.actuator import restart_command

    run = tmp_path / "run"
    info = verl_mode.init_run(run, SEED_COMMAND)
    assert info.live_keys == [] and info.world_size == 8 and info.config[KL] == 0.001
    glue = _glue(run)
    assert verl_mode.resolve_mode("auto", SEED_COMMAND) == "verl"
    # First launch: the user's own values stand; the logger gets `file`, verl saves into the run dir.
    cmd, env = glue.prepare_launch(restart_command(SEED_COMMAND, {}, None), {}, None)
    a = _args(cmd)
    assert a["trainer.logger"] == "[console,wandb,file]"
    assert a["trainer.default_local_dir"] == str(run / "checkpoints")
    assert a[KL] == "0.001" and "trainer.resume_mode" not in a
    assert env == {"VERL_FILE_LOGGER_PATH": str(run / "verl" / "metrics.1.jsonl")}
    glue.launched(123, cmd, None)
    # verl logs an adaptive coefficient under the OLD key: it is what the restart must carry.
    Path(env["VERL_FILE_LOGGER_PATH"]).write_text(json.dumps({"step": 7, "data": {"critic/kl_coeff": 0.0013}}) + "\n")
    glue.poll(None)
    resume = str(run / "checkpoints" / "global_step_5")
    overrides = {MICRO: 8}
    cmd2, env2 = glue.prepare_launch(restart_command(SEED_COMMAND, overrides, resume), overrides, resume)
    a2 = _args(cmd2)
    assert a2[MICRO] == "8" and a2[KL] == "0.0013"
    assert cmd2[-2:] == ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={resume}"]
    assert env2["VERL_FILE_LOGGER_PATH"].endswith("metrics.2.jsonl")
    assert sum(1 for x in cmd2 if x.startswith(f"{KL}=")) == 1
    # A rule's new coefficient wins over the logged one, and is carried by the restarts after it.
    overrides = {MICRO: 8, KL: 0.0024}
    cmd3, _ = glue.prepare_launch(restart_command(SEED_COMMAND, overrides, resume), overrides, resume)
    assert _args(cmd3)[KL] == "0.0024"
    cmd4, _ = glue.prepare_launch(restart_command(SEED_COMMAND, overrides, resume), overrides, resume)
    assert _args(cmd4)[KL] == "0.0024"  # nothing logged since the change: the override, not 0.0013
    # metrics.jsonl kept what verl's file logger wrote, for the tailer, replay and the report.
    assert rundir.read_jsonl(run / rundir.METRICS).records == [{"step": 7, "data": {"critic/kl_coeff": 0.0013}}]


def test_a_stopped_attempts_steps_and_saves_past_the_relaunch_checkpoint_are_set_aside(tmp_path: Path) -> None:
    # Found on real verl on CPU: verl's driver trains on while Ray shuts down, so an attempt stopped for a
    # relaunch from global_step_4 logged steps 5-6 and saved global_step_6 after the decision; relayed as
    # the run's own, its NaN at step 5 rolled the healthy relaunch back to step 2.
    from ppo_watchdog.control.actuator import restart_command

    run = tmp_path / "run"
    verl_mode.init_run(run, SEED_COMMAND)
    glue = _glue(run)
    cmd, env = glue.prepare_launch(restart_command(SEED_COMMAND, {}, None), {}, None)
    glue.launched(101, cmd, None)
    ckpts = run / "checkpoints"
    for step in (2, 4, 6):
        (ckpts / f"global_step_{step}").mkdir(parents=True)
    log1 = Path(env["VERL_FILE_LOGGER_PATH"])
    log1.write_text("".join(json.dumps({"step": s, "data": {"actor/lr": 1e-3}}) + "\n" for s in (1, 2, 3, 4)))
    glue.poll(None)
    # Between the relaunch decision (resume from step 4) and its death, attempt 1 writes steps 5 and 6
    # (step 5 with a NaN loss) and saves global_step_6.
    with log1.open("a") as f:
        for s, loss in ((5, float("nan")), (6, 0.1)):
            f.write(json.dumps({"step": s, "data": {"actor/pg_loss": loss}}) + "\n")
    (ckpts / rundir.LATEST_MARKER).write_text("6")
    resume = str(ckpts / "global_step_4")
    cmd2, env2 = glue.prepare_launch(restart_command(SEED_COMMAND, {}, resume), {}, resume)
    glue.launched(102, cmd2, resume)
    Path(env2["VERL_FILE_LOGGER_PATH"]).write_text(json.dumps({"step": 5, "data": {"actor/pg_loss": 0.2}}) + "\n")
    glue.poll(None)
    steps = [(r["step"], r["data"].get("actor/pg_loss")) for r in rundir.read_jsonl(run / rundir.METRICS).records]
    assert steps == [(1, None), (2, None), (3, None), (4, None), (5, 0.2)]  # one timeline: the relaunch's step 5
    kept = rundir.read_jsonl(run / "verl" / verl_mode.ABANDONED_FILE).records
    assert [(r["attempt"], r["step"]) for r in kept] == [(1, 5), (1, 6)]
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("global_step_")) == ["global_step_2",
                                                                                          "global_step_4"]
    assert (ckpts / "abandoned-attempt-1" / "global_step_6").is_dir()
    assert (ckpts / rundir.LATEST_MARKER).read_text() == "4"


def test_under_verls_async_save_a_checkpoint_counts_by_its_files_so_a_rollback_has_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # verl 0.9.1's v1 trainer writes no latest_checkpointed_iteration.txt under async_save
    # (trainer/ppo/v1/trainer_base.py:1011-1019): its checkpoints count once all their files are there.
    run = tmp_path / "run"
    verl_mode.init_run(run, [*SEED_COMMAND, "actor_rollout_ref.actor.checkpoint.async_save=true",
                             "trainer.n_gpus_per_node=2"])
    with caplog.at_level("INFO"):
        glue = _glue(run)
    assert "async_save=true" in caplog.text and "no rollback" not in caplog.text
    for step in (2, 4, 6):
        _save_verl_step(run / "checkpoints", step, world_size=2)
    (run / "checkpoints" / "global_step_6" / "data.pt").unlink()  # a save in progress: data.pt comes last
    ckpt.verl_file(run / "checkpoints" / "global_step_4" / "critic", "optim", 2, 1).unlink()  # a torn one
    assert not (run / "checkpoints" / rundir.LATEST_MARKER).exists()
    judged = {c.step: c for c in glue.checkpoints()}
    assert [s for s, c in judged.items() if c.complete] == [2]
    assert "data.pt" in judged[6].reason and "optim_world_size_2_rank_1.pt" in judged[4].reason
    # A marker there is not verl's (it writes none under async save): later saves still count by their files.
    (run / "checkpoints" / rundir.LATEST_MARKER).write_text("2")
    _save_verl_step(run / "checkpoints", 8, world_size=2)
    assert [c.step for c in glue.checkpoints() if c.complete] == [2, 8]
    # Without async save the marker still rules.
    verl_mode.init_run(tmp_path / "plain", [*SEED_COMMAND, "trainer.n_gpus_per_node=2"])
    _save_verl_step(tmp_path / "plain" / "checkpoints", 2, world_size=2)
    assert not any(c.complete for c in _glue(tmp_path / "plain").checkpoints())


def test_a_user_checkpoint_dir_is_kept_and_searched(tmp_path: Path) -> None:
    cmd = [*SEED_COMMAND, "trainer.default_local_dir=ckpts/qwen"]
    info = verl_mode.init_run(tmp_path / "run", cmd, cwd=tmp_path)
    assert info.checkpoint_dir == str(tmp_path / "ckpts" / "qwen")
    # verl's own default world size when the command does not say (8 GPUs on 1 node); a stand-in: its files.
    assert verl_mode.run_world_size([c for c in SEED_COMMAND if "n_gpus" not in c and "nnodes" not in c]) == 8
    assert verl_mode.run_world_size(["python", "stand_in.py", "trainer.nnodes=2"]) == 16
    assert verl_mode.run_world_size(["python", "stand_in.py"]) is None
    assert verl_mode.merge_logger(None) == ["console", "file"]
    assert verl_mode.merge_logger("wandb") == ["wandb", "console", "file"]
    assert verl_mode.resolve_mode("auto", ["python", "-m", "ppo_watchdog.trainer"]) == "embedded"
    with pytest.raises(verl_mode.VerlModeError):
        verl_mode.resolve_mode("megatron", cmd)


def test_live_actions_become_restarts_and_pause_stops_verl(tmp_path: Path) -> None:
    import time

    from ppo_watchdog.backends.local import LocalBackend
    from ppo_watchdog.control.actuator import Actuator, RunHandle
    from ppo_watchdog.control.store import RunRecord, Store

    run = tmp_path / "run"
    cmd = [sys.executable, "-c", "import time; time.sleep(120)", "trainer.n_gpus_per_node=1"]
    verl_mode.init_run(run, cmd)
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("run", str(run), cmd))
    act = Actuator(store, LocalBackend())
    h = RunHandle(store.require_run("run"), dialect=_glue(run))
    try:
        act.launch(h, None, time.time())
        first = h.proc
        # A live set (what a run with live keys would get) is carried out by a restart instead.
        live = store.add_action("run", "live_set", {"rule": "kl_high", "set": {KL: 0.002}})
        act.drive(h, store.get_action(live), time.time())
        entry = store.get_action(live)
        assert entry.status == "done" and "by restart" in entry.result["outcome"]
        (restart,) = [e for e in store.open_actions("run") if e.kind == "restart"]
        assert restart.payload["set"] == {KL: 0.002}
        act.drive(h, restart, time.time())
        assert not first.alive() and h.proc is not first and h.proc.alive()
        assert _args(RunInfo.read(run).launches[-1]["command"])[KL] == "0.002"
        # Pause: verl cannot wait in place, so it is stopped; a checkpoint command cannot be honoured.
        pause = store.add_action("run", "command", {"rule": "r", "command": {"id": "c1", "kind": "pause"}})
        act.drive(h, store.get_action(pause), time.time())
        assert not h.proc.alive() and "verl cannot pause" in store.get_action(pause).result["outcome"]
        snap = store.add_action("run", "command", {"rule": "r", "command": {"id": "c2", "kind": "checkpoint"}})
        act.drive(h, store.get_action(snap), time.time())
        assert store.get_action(snap).status == "failed"
        assert "reads no control.json" in store.get_action(snap).result["error"]
    finally:
        act.stop(h)


# -- verl's metric keys: /metrics, replay, run -----------------------------------------------------


def _file_logger(path: Path, records: list[dict]) -> None:
    """Write records through verl's real FileLogger (VERL_FILE_LOGGER_PATH)."""
    from verl.utils.tracking import FileLogger

    old = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        fl = FileLogger("p", "e")
        for r in records:
            fl.log(r["data"], r["step"])
        fl.finish()
    finally:
        if old is None:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = old


def test_the_watchdog_serves_a_verl_runs_metrics_under_catalog_names(tmp_path: Path) -> None:
    run = tmp_path / "run"
    verl_mode.init_run(run, SEED_COMMAND, metrics_port=-1)
    glue = _glue(run, "qwen")
    try:
        _, env = glue.prepare_launch(SEED_COMMAND, {}, None)
        _file_logger(Path(env["VERL_FILE_LOGGER_PATH"]), [
            {"step": 1, "data": {"critic/kl": 0.004, "critic/kl_coeff": 0.001, "critic/vf_loss": float("nan")}},
            {"step": 2, "data": {"critic/kl": 0.125, "critic/kl_coeff": 0.001, "critic/vf_loss": 0.31}},
        ])
        glue.poll(None)
        port = RunInfo.read(run).metrics_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        glue.close()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s for f in text_string_to_metric_families(body) for s in f.samples
               if s.labels.get("run") == "qwen"}
    assert samples["ppo_kl_mean"].value == 0.125
    assert samples["ppo_kl_coef"].value == 0.001
    assert samples["ppo_value_loss"].value == pytest.approx(0.31)
    assert samples["ppo_global_step"].value == 2


@needs_logs
def test_replay_of_verls_file_logger_output_matches_its_console_log(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ppo_watchdog import cli
    from ppo_watchdog.sources import ingest

    records = ingest.read_records(HEALTHY)
    assert "critic/kl" in records[-1]["data"] and "critic/kl_coeff" in records[-1]["data"]
    jsonl = tmp_path / "healthy.jsonl"
    _file_logger(jsonl, records)
    rules = ROOT / "rules" / "default.yaml"
    runner = CliRunner()
    from_file = runner.invoke(cli.app, ["replay", str(jsonl), "--json", "--rules", str(rules)])
    from_console = runner.invoke(cli.app, ["replay", str(HEALTHY), "--json", "--rules", str(rules)])
    assert from_file.exit_code == 0 and from_console.exit_code == 0, from_file.output + from_console.output
    decisions = json.loads(from_file.stdout)
    assert decisions == json.loads(from_console.stdout)
    first = next(r for r in records if r["data"]["critic/kl"] > 0.1)
    fires = [d for d in decisions if d["rule"] == "kl_high" and d["kind"] == "fire"]
    assert fires and fires[0]["step"] >= first["step"]
    assert fires[0]["inputs"]["kl"] == pytest.approx(
        next(r for r in records if r["step"] == fires[0]["step"])["data"]["critic/kl"])


#: A stand-in for ``verl.trainer.main_ppo`` that replays a recorded verl run through verl's own
#: Tracking (the logger list and resume path from its Hydra arguments, as verl reads them).
RECORDED_VERL = textwrap.dedent('''
    import sys
    import yaml
    from verl.utils.tracking import Tracking
    from ppo_watchdog.sources.ingest import read_records

    args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
    start = 0
    if args.get("trainer.resume_mode") == "resume_path":
        start = int(args["trainer.resume_from_path"].rsplit("_", 1)[1])
    tracking = Tracking("recorded", "verl", default_backend=yaml.safe_load(args["trainer.logger"]))
    for rec in read_records(sys.argv[1]):
        if rec["step"] > start:
            tracking.log(data=rec["data"], step=rec["step"])
    tracking.finish()
''')


@needs_logs
@pytest.mark.slow
def test_watchdog_run_reads_the_older_critic_kl_keys_and_restarts_with_the_new_kl_coef(tmp_path: Path) -> None:
    from ppo_watchdog.sources import ingest

    script = tmp_path / "recorded_verl.py"
    script.write_text(RECORDED_VERL)
    rules = tmp_path / "rules.yaml"
    rules.write_text(textwrap.dedent("""\
        version: 1
        rules:
          - name: kl_high
            description: KL above the seed's threshold raises kl_coef (by restart for verl)
            expr: kl > 0.1
            actions:
              - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.2, max: 0.01}
            cooldown: 1000
            severity: warning
            urgent: true  # the recorded run saves no checkpoint a tuning relaunch would wait for
    """))
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--rules", str(rules), "--run-dir", str(run),
         "--state-dir", str(tmp_path / "state"), "--tick", "0.3", "--no-report", "--",
         sys.executable, str(script), str(HEALTHY), "trainer.n_gpus_per_node=1"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = ingest.read_records(HEALTHY)
    first = next(r for r in records if r["data"]["critic/kl"] > 0.1)
    history = json.loads(subprocess.run(
        [sys.executable, "-m", "ppo_watchdog", "history", "run", "--json", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, check=True).stdout)
    (fire,) = [d for d in history if d["rule"] == "kl_high"]
    assert fire["step"] == first["step"] and fire["inputs"]["kl"] == pytest.approx(first["data"]["critic/kl"])
    launches = RunInfo.read(run).launches
    assert len(launches) == 2
    coef = float(_args(launches[1]["command"])[KL])
    assert coef == pytest.approx(1.2 * first["data"]["critic/kl_coeff"])
    assert _args(launches[0]["command"])["trainer.logger"] == "[console,file]"
    started = rundir.iter_events(run, ["started"])
    assert [e["attempt"] for e in started] == [1, 2]
    # Both attempts' lines were relayed from verl's per-attempt files into metrics.jsonl.
    steps = [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS).records]
    assert steps.count(records[-1]["step"]) >= 1 and steps.count(1) == 2


#: A KL rule that fires on the first steps (any KL at all), so a restart comes quickly.
KL_ANY_RULE = textwrap.indent(textwrap.dedent("""\
    - name: kl_high
      description: any KL at all raises kl_coef (fires on the first steps)
      expr: kl > 0.0
      actions:
        - set: {key: algorithm.kl_ctrl.kl_coef, scale: 2.0, max: 1.0}
      cooldown: 1000
      severity: warning
"""), "  ")


# -- end to end: the embedded trainer standing in for verl -----------------------------------------


@pytest.mark.slow
def test_zero_patch_run_restarts_an_oom_smaller_and_a_kl_fire_with_the_new_coef(
    tmp_path: Path, tiny_trainer_args, trainer_env
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n" + KL_ANY_RULE + textwrap.indent(textwrap.dedent("""\
          - name: oom
            description: out of memory -> one micro batch smaller, resume (as in the default pack)
            expr: event("oom") > 0
            actions:
              - set: {key: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, add: -1, min: 1}
              - set: {key: critic.ppo_micro_batch_size_per_gpu, add: -1, min: 1}
            severity: critical
            urgent: true
    """), "  "))
    run = tmp_path / "run"
    # KL is above 0 from step 2 on; the 5 s hang at step 3 keeps the first attempt there until the
    # watchdog has acted on it, so the OOM at step 6 comes in the attempt after the KL restart. (An OOM
    # racing a restart is not lost in real life: the relaunch runs out of memory again at the same spot;
    # an injected fault fires only once.)
    trainer = tiny_trainer_args(run, "trainer.run_dir_protocol=false", "trainer.save_freq=2",
                                "trainer.faults='hang@3:5,oom@6'", "actor_rollout_ref.actor.entropy_coeff=1.0",
                                "actor_rollout_ref.actor.optim.lr=0.003", "algorithm.kl_ctrl.kl_coef=0.1", steps=9)
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--rules", str(rules), "--run-dir", str(run),
         "--state-dir", str(tmp_path / "state"), "--tick", "0.3", "--stop-grace", "5", "--no-report",
         "--tuning-relaunch-every", "0", "--",  # the tuning set waits for a checkpoint only (save_freq=2)
         *trainer],
        capture_output=True, text=True, timeout=300, env=trainer_env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    launches = [_args(x["command"]) for x in RunInfo.read(run).launches]
    (oom,) = rundir.iter_events(run, ["oom"])
    assert oom["memory"] == "cuda" and oom["exit_code"] == 1 and oom["micro_batch_size"] == 8
    assert "torch.OutOfMemoryError" in oom["message"]
    # The restart after the OOM: one micro batch smaller (8 - 1 = 7 snaps to 4, a divisor of the mini
    # batch of 8), resumed from verl's newest checkpoint before the OOM.
    after = [a for a in launches if a.get(MICRO) == "4"]
    assert after and after[0]["trainer.resume_mode"] == "resume_path"
    resumed = int(after[0]["trainer.resume_from_path"].rsplit("_", 1)[1])
    assert resumed <= oom["step"] and resumed % 2 == 0
    # The KL rule: restart with the doubled coefficient, carried by every launch after it.
    kl_at = next(i for i, a in enumerate(launches) if a.get(KL) == "0.2")
    assert kl_at >= 1 and all(a.get(KL) == "0.2" for a in launches[kl_at:])
    assert rundir.iter_events(run, ["finished"])
    steps = [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS).records]
    assert max(steps) == 9
    logged = {r["step"]: r["data"] for r in rundir.read_jsonl(run / rundir.METRICS).records}
    assert logged[9]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.2)
    # The trainer spoke no protocol: run.json is still the glue's (no live keys), events are the glue's.
    info = RunInfo.read(run)
    assert info.mode == "verl" and info.live_keys == []
    assert {e.get("source") for e in rundir.iter_events(run)} == {"watchdog:verl"}
    assert all(math.isfinite(v) for v in logged[9].values() if isinstance(v, float))
    # Every relaunch's cost, stop to its first new step, measured and kept for the cost model.
    from ppo_watchdog.control.store import Store

    store = Store(tmp_path / "state")
    (run_id,) = store.run_ids()
    restarts = [e for e in store.journal(run_id) if e.kind == "restart" and e.status == "done"]
    assert len(restarts) == len(launches) - 1 >= 2
    assert all(isinstance(e.result.get("relaunch_s"), float) and e.result["relaunch_s"] > 0 for e in restarts)
    assert store.require_run(run_id).startup_s == pytest.approx(restarts[-1].result["relaunch_s"], abs=1e-3)


@pytest.mark.slow
def test_zero_patch_tuning_waits_for_the_next_checkpoint_and_a_divergence_does_not(
    tmp_path: Path, tiny_trainer_args, trainer_env
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n" + textwrap.indent(textwrap.dedent("""\
          - name: kl_high
            description: stands in for a tuning rule that keeps firing from step 2 (its set needs a relaunch)
            expr: step >= 2
            clear: step < 0
            actions:
              - set: {key: algorithm.kl_ctrl.kl_coef, scale: 2.0, max: 1.0}
            cooldown: 1000
          - name: diverged
            description: stands in for a divergence rule (fires once at step 7), which must not wait
            expr: step >= 7
            actions: [rollback]
            cooldown: 1000
            divergence: true
            severity: critical
    """), "  "))
    run, state = tmp_path / "run", tmp_path / "state"
    # The tuning set is decided at step 2 and waits for the step-4 checkpoint; the hangs keep each
    # attempt at a step long enough for the watchdog's ticks to see it.
    trainer = tiny_trainer_args(run, "trainer.run_dir_protocol=false", "trainer.save_freq=4",
                                "trainer.faults='hang@3:2,hang@7:3'", "algorithm.kl_ctrl.kl_coef=0.1", steps=10)
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--rules", str(rules), "--run-dir", str(run),
         "--state-dir", str(state), "--tick", "0.3", "--stop-grace", "5", "--no-report",
         "--tuning-relaunch-every", "0", "--", *trainer],
        capture_output=True, text=True, timeout=300, env=trainer_env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    decisions = Store(state).decisions("run")
    tune = next(d for d in decisions if d.get("rule") == "kl_high")
    div = next(d for d in decisions if d.get("rule") == "diverged")
    (tune_entry,) = [j for j in tune["journal"] if j["kind"] == "restart"]
    assert tune["step"] == 2 and "deferred" not in tune["outcome"]  # settled: carried out
    # The tuning relaunch went at the checkpoint after its decision, resuming from it: no step lost.
    assert tune_entry["payload"]["resume_step"] >= 4 > tune["step"]
    assert "tuning relaunch at the step-4 checkpoint" in tune_entry["payload"]["reason"]
    assert tune_entry["payload"]["cost"]["relaunch"] is True
    assert "clock" in tune_entry["payload"]  # it was journalled as waiting, at that engine clock
    # The divergence went at once: its rollback was journalled as an intent with the decision, in the
    # same transaction (never waiting), and restarted from the known-good step-4 checkpoint.
    journal = Store(state).journal("run")
    rollback = next(j for j in journal if j.kind == "rollback" and j.decision_id == div["id"])
    assert "clock" not in rollback.payload and abs(rollback.created - div["created"]) < 0.1
    restart = next(j for j in journal if j.kind == "restart" and j.decision_id == div["id"])
    assert restart.payload["resume_step"] == 4 and restart.status == "done"
    started = [e for e in rundir.iter_events(run, ["started"]) if e.get("resumed_from") == 4]
    assert len(started) == 2  # the tuning relaunch and the rollback, each resumed from step 4
    launches = [_args(x["command"]) for x in RunInfo.read(run).launches]
    assert len(launches) == 3 and launches[0][KL] == "0.1" and launches[1][KL] == "0.2" == launches[2][KL]


# -- the daemon: `mode:` per run in daemon.yaml ----------------------------------------------------

DAEMON_YAML = ROOT / "deploy" / "watchdog" / "daemon.yaml"
QUIET_RULES = textwrap.dedent("""\
    version: 1
    rules:
      - name: kl_absurd
        description: never fires on these runs
        expr: kl > 10.0
        actions: [notify]
""")
#: A stand-in for verl that behaves like it towards the glue: it logs through $VERL_FILE_LOGGER_PATH
#: (step 1 at once, step 2 once the file GO exists), records what it was launched with, then runs on.
STAND_IN = textwrap.dedent("""\
    import json, os, sys, time
    from pathlib import Path
    here = Path(sys.argv[1])
    (here / "launched.json").write_text(json.dumps({"argv": sys.argv[2:], "env": os.environ.get("VERL_FILE_LOGGER_PATH")}))
    out = open(os.environ["VERL_FILE_LOGGER_PATH"], "w")
    def log(step):
        out.write(json.dumps({"step": step, "data": {"critic/kl": 0.001, "critic/kl_coeff": 0.001}}) + "\\n")
        out.flush()
    log(1)
    while not (here / "GO").exists():
        time.sleep(0.05)
    log(2)
    time.sleep(120)
""")


def _example_verl_run() -> dict:
    """The commented `mode: verl` entry of deploy/watchdog/daemon.yaml, uncommented and parsed."""
    lines = DAEMON_YAML.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  # - run_dir:") and "mode: verl" in
                 "\n".join(lines[i:i + 4]))
    block = []
    for line in lines[start:]:
        if not line.startswith("  # "):
            break
        block.append("  " + line[4:])
    import yaml

    (run,) = yaml.safe_load("runs:\n" + "\n".join(block))["runs"]
    return run


def _daemon_yaml(path: Path, state: Path, runs: list[dict], rules: Path | None = None) -> Path:
    import yaml

    # Tuning relaunches wait for the next checkpoint only: these runs are a few steps long.
    doc: dict = {"state_dir": str(state), "tick_s": 0.2, "runs": runs, "controller": {"tuning_relaunch_every": 0}}
    if rules is not None:
        doc["rules"] = [str(rules)]
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_daemon_examples_verl_run_gets_the_glue_with_verls_own_world_size(tmp_path: Path) -> None:
    from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon

    example = _example_verl_run()
    assert example["mode"] == "verl" and verl_mode.is_verl_command(example["restart_command"])
    run = tmp_path / "qwen"
    cfg = load_daemon_config(_daemon_yaml(tmp_path / "daemon.yaml", tmp_path / "state",
                                          [{**example, "run_dir": str(run), "run_metrics_port": None}]))
    assert cfg.runs[0].mode == "verl"
    wd = prepare_daemon(cfg)  # no tick: nothing is launched (verl itself would start here)
    try:
        ctl = wd.controllers["qwen2-7b-gsm8k"]
        assert isinstance(ctl.h.dialect, verl_mode.VerlGlue) and ctl.run.phase == "new"
        info = RunInfo.read(run)
        assert info.mode == "verl" and info.live_keys == [] and info.world_size == 8
        assert info.checkpoint_dir == str(run / "checkpoints") and info.config[KL] == 0.001
    finally:
        wd.close()


def test_the_daemon_launches_a_verl_run_with_the_glue_and_re_attaches_after_its_own_restart(tmp_path: Path) -> None:
    import time

    from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon

    (tmp_path / "stand_in.py").write_text(STAND_IN)
    (tmp_path / "rules.yaml").write_text(QUIET_RULES)
    run = tmp_path / "run"
    command = [sys.executable, str(tmp_path / "stand_in.py"), str(tmp_path), "trainer.logger=[console]",
               f"{MICRO}=4", f"{KL}=0.001"]
    cfg_file = _daemon_yaml(tmp_path / "daemon.yaml", tmp_path / "state", [
        {"run_dir": str(run), "mode": "verl", "run_metrics_port": -1, "restart_command": command}],
        tmp_path / "rules.yaml")

    def drive(wd, until) -> None:
        deadline = time.monotonic() + 30
        while not until():
            assert time.monotonic() < deadline, "condition not reached in 30 s"
            wd.tick()
            time.sleep(0.1)

    def steps() -> list[int]:
        return [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS).records]

    wd = prepare_daemon(load_daemon_config(cfg_file))
    wd2 = None
    pid = None
    try:
        drive(wd, lambda: steps() == [1])
        ctl = wd.controllers["run"]
        pid = ctl.h.proc.pid
        # What the process was really started with: the glue's logger, checkpoint dir and file-logger env.
        launched = json.loads((tmp_path / "launched.json").read_text())
        a = _args(launched["argv"])
        assert a["trainer.logger"] == "[console,file]" and a["trainer.default_local_dir"] == str(run / "checkpoints")
        assert a[MICRO] == "4" and launched["env"] == str(run / "verl" / "metrics.1.jsonl")
        launched_cmd = RunInfo.read(run).command
        assert _args(launched_cmd)["trainer.logger"] == "[console,file]"
        wd.close()  # the daemon goes away; the trainer runs on

        wd2 = prepare_daemon(load_daemon_config(cfg_file))
        ctl2 = wd2.controllers["run"]
        assert ctl2.h.proc is not None and ctl2.h.proc.pid == pid and ctl2.h.proc.alive()
        assert ctl2.h.dialect.state.attempt == 1 and ctl2.h.dialect.state.relay_offset > 0  # re-attached, not re-initialised
        assert RunInfo.read(run).command == launched_cmd
        (tmp_path / "GO").touch()
        drive(wd2, lambda: steps() == [1, 2])
        wd2.tick()
        assert steps() == [1, 2]  # step 1 not relayed twice
        assert [e["attempt"] for e in rundir.iter_events(run, ["started"])] == [1]
        assert ctl2.h.proc.pid == pid and wd2.store.require_run("run").restarts == 0
        port = RunInfo.read(run).metrics_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'ppo_global_step{run="run"} 2.0' in body
    finally:
        for w in (wd2, wd):
            if w is not None and "run" in w.controllers and w.controllers["run"].h.proc is not None:
                w.actuator.stop(w.controllers["run"].h)
                break
        if wd2 is not None:
            wd2.close()


@pytest.mark.parametrize(("entry", "message"), [
    ({"mode": "megatron", "restart_command": ["python3", "-m", "verl.trainer.main_ppo"]},
     "runs[0].mode must be one of auto, embedded, verl, got 'megatron'"),
    ({"mode": "verl"}, "runs[0].mode: verl needs a restart_command"),
    ({"run_metrics_port": 9500, "restart_command": ["python3", "-m", "ppo_watchdog.trainer"]},
     "runs[0].run_metrics_port is for mode verl"),
])
def test_a_bad_mode_in_the_daemon_config_is_an_error_naming_the_file_and_key(
    tmp_path: Path, entry: dict, message: str
) -> None:
    from typer.testing import CliRunner

    from ppo_watchdog.cli.run import run_app
    from ppo_watchdog.control.daemon import DaemonConfigError, load_daemon_config

    cfg_file = _daemon_yaml(tmp_path / "daemon.yaml", tmp_path / "state", [{"run_dir": str(tmp_path / "r"), **entry}])
    with pytest.raises(DaemonConfigError) as err:
        load_daemon_config(cfg_file)
    assert str(err.value).startswith(f"{cfg_file}: ") and message in str(err.value)
    out = CliRunner().invoke(run_app, ["daemon", "--config", str(cfg_file)])
    assert out.exit_code == 2 and "runs[0]." in out.output
    assert not (tmp_path / "r").exists()  # stopped before touching any run directory


@pytest.mark.slow
def test_the_daemon_restarts_a_zero_patch_run_with_the_kl_rules_new_coef(
    tmp_path: Path, tiny_trainer_args, trainer_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from ppo_watchdog.control.daemon import load_daemon_config, prepare_daemon

    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n" + KL_ANY_RULE)
    run = tmp_path / "run"
    # As in the `watchdog run` test above: the hang at step 3 holds the first attempt until the restart.
    # A checkpoint every step: the rule fires on step 2's line, which verl-like training writes before
    # it saves step 2 but after step 1's save is complete, so the restart always has one to resume.
    trainer = tiny_trainer_args(run, "trainer.run_dir_protocol=false", "trainer.save_freq=1",
                                "trainer.faults=hang@3:5", "actor_rollout_ref.actor.entropy_coeff=1.0",
                                "actor_rollout_ref.actor.optim.lr=0.003", f"{KL}=0.1", steps=5)
    for key in ("PPO_WATCHDOG_CACHE", "OMP_NUM_THREADS", "TRAINER_LOG_LEVEL"):
        monkeypatch.setenv(key, trainer_env[key])  # the daemon's children inherit its environment
    cfg_file = _daemon_yaml(tmp_path / "daemon.yaml", tmp_path / "state",
                            [{"run_dir": str(run), "mode": "verl", "restart_command": trainer}], rules)
    cfg = load_daemon_config(cfg_file)
    cfg.actuator = {"stop_grace_s": 5.0}
    wd = prepare_daemon(cfg)
    ctl = wd.controllers["run"]
    try:
        deadline = time.monotonic() + 240
        while ctl.run.phase not in ("finished", "failed"):
            assert time.monotonic() < deadline, rundir.read_jsonl(run / rundir.EVENTS).records
            wd.tick()
            time.sleep(0.3)
    finally:
        if ctl.h.proc is not None:
            wd.actuator.stop(ctl.h)
        wd.close()
    assert ctl.run.phase == "finished"
    launches = [_args(x["command"]) for x in RunInfo.read(run).launches]
    assert len(launches) >= 2 and launches[0][KL] == "0.1"
    assert launches[1][KL] == "0.2" and launches[1]["trainer.resume_mode"] == "resume_path"
    assert all(a["trainer.logger"] == "[console,file]" for a in launches)
    (d,) = [d for d in wd.store.decisions("run") if d["rule"] == "kl_high"]
    assert d["outcome"] and d["status"] != "skipped"
    logged = {r["step"]: r["data"] for r in rundir.read_jsonl(run / rundir.METRICS).records}
    assert max(logged) == 5 and logged[5]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.2)
    assert {e.get("source") for e in rundir.iter_events(run)} == {"watchdog:verl"}


# -- verl as a Ray Job ------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["ray_kwargs.ray_init.num_cpus=12", "+ray_kwargs.ray_init.num_gpus=1"])
def test_a_verl_command_for_a_ray_job_that_passes_ray_init_resources_is_refused_naming_the_key(tmp_path, given):
    # Found running verl's main_ppo as a Ray Job: its ray.init() connects to the head, and Ray raises
    # "When connecting to an existing cluster, num_cpus and num_gpus must not be provided" at once.
    cmd = ["python3", "-m", "verl.trainer.main_ppo", "trainer.n_gpus_per_node=1", given]
    with pytest.raises(verl_mode.VerlModeError) as err:
        verl_mode.prepare_run(tmp_path, cmd, "auto", ray_job=True)
    assert given.lstrip("+").split("=")[0] in str(err.value) and "ray start --num-cpus" in str(err.value)
    assert not (tmp_path / rundir.RUN_JSON).exists()  # refused before anything is written
    # The same command runs locally (its own ray.init() starts a cluster with those resources) ...
    assert verl_mode.prepare_run(tmp_path / "local", cmd, "auto") == verl_mode.MODE_VERL
    # ... and as a Ray Job once the key is gone or null.
    ok = [*cmd[:-1], "ray_kwargs.ray_init.num_cpus=null"]
    assert verl_mode.prepare_run(tmp_path / "job", ok, "auto", ray_job=True) == verl_mode.MODE_VERL
