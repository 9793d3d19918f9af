"""verl at 7B scale (issue 13): what a real cluster run would hit, checked on CPU against verl 0.9.1.

Each test names the finding it covers. Where verl's own classes or files can say it, they do:
verl's Hydra config composes the relaunch arguments, verl's ActorConfig / CriticConfig /
OptimizerConfig read them, Ray's real exception classes print the tracebacks, verl's checkpoint
manager prunes, and a DTensor is saved on a one-process gloo group.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest

from ppo_watchdog.backends import verl_exits, zero_patch
from ppo_watchdog.backends import verl_lr_patch as lr_patch
from ppo_watchdog.control.actuator import Actuator, RunHandle, launch_clip_bounds, restart_command
from ppo_watchdog.control.store import RunRecord, Store
from ppo_watchdog.core.actions import TUNABLE_KEYS
from ppo_watchdog.core.planner import micro_batch_share, oom_remedy, snap_sets
from ppo_watchdog.protocol import catalog, hydra, rundir
from ppo_watchdog.protocol import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[1]
ACTOR_LR = "actor_rollout_ref.actor.optim.lr"
ACTOR_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
VERL_CMD = [
    "python3", "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=gae",
    "data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=96", "data.max_prompt_length=1024", "data.max_response_length=1024",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=48", f"{ACTOR_MICRO}=6",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=12",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=12",
    "actor_rollout_ref.actor.clip_ratio_high=0.28", "critic.model.path=Qwen/Qwen2-7B-Instruct",
    "critic.ppo_micro_batch_size_per_gpu=6", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
    "trainer.save_freq=5", "trainer.logger=[console]",
]


# -- helpers --------------------------------------------------------------------------------------


@functools.cache
def _verl_config_dir() -> str:
    import verl

    return str(Path(verl.__file__).resolve().parent / "trainer" / "config")


def _compose(command: list[str]) -> Any:
    """verl's own config (ppo_trainer.yaml) composed with a command's Hydra overrides, as main_ppo does."""
    from hydra import compose, initialize_config_dir

    args = [a for a in command if hydra.is_override(a)]
    with initialize_config_dir(version_base=None, config_dir=_verl_config_dir()):
        return compose(config_name="ppo_trainer", overrides=args)


class RecordingBackend:
    """A backend that records the command it was asked to start and starts nothing."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def start(self, command: Any, env: Any = None, cwd: Any = None, log_path: Any = None) -> Any:
        self.commands.append(list(command))
        return _NoProcess()

    def attach(self, pid: int) -> Any:
        return _NoProcess()


class _NoProcess:
    pid = None

    def poll(self) -> int | None:
        return 0

    def alive(self) -> bool:
        return False

    def signal(self, sig: int, group: bool = True) -> bool:
        return False

    def stop(self, grace: float = 10.0) -> int | None:
        return 0


def _launch(tmp_path: Path, command: list[str], overrides: dict[str, Any]) -> list[str]:
    """What the actuator launches for a zero-patch run with ``overrides`` in force."""
    run = tmp_path / "run"
    zero_patch.init_run(run, command)
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("run", str(run), command))
    backend = RecordingBackend()
    act = Actuator(store, backend)
    h = RunHandle(store.require_run("run"), dialect=zero_patch.dialect_for(run, "run"))
    h.run.overrides = dict(overrides)
    act.launch(h, None, 0.0)
    return backend.commands[-1]


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - a traceback to format
        return e


def _driver_log(cause: BaseException, worker_call: str) -> str:
    """verl's driver output when the worker method ``worker_call`` raised ``cause`` inside the TaskRunner:
    Ray's real RayTaskError twice (the worker's, then the TaskRunner's), as Hydra prints it."""
    from ray.exceptions import RayTaskError

    inner = _raised(RayTaskError(worker_call, _format(cause), cause, proctitle=f"ray::{worker_call}", pid=11,
                                 ip="10.0.0.7").as_instanceof_cause())
    outer = _raised(RayTaskError("TaskRunner.run", _format(inner), inner, proctitle="ray::TaskRunner.run", pid=12,
                                 ip="10.0.0.7").as_instanceof_cause())
    return "(TaskRunner pid=12) INFO vllm: KV cache 4.2 GiB\n" + _format(outer) + \
        "\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"


def _cuda_oom() -> BaseException:
    import torch

    return _raised(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                          "capacity of 79.10 GiB of which 1.05 GiB is free."))


# -- finding 1: clip_ratio by relaunch ----------------------------------------------------------------


def test_finding1_a_clip_ratio_relaunch_also_moves_the_bounds_verl_reads(tmp_path: Path) -> None:
    from verl.utils.config import omega_conf_to_dataclass

    cmd = _launch(tmp_path, VERL_CMD, {catalog.CLIP_RATIO_KEY: 0.1})
    args = hydra.values(cmd)
    assert args[catalog.CLIP_RATIO_KEY] == 0.1
    # verl's policy loss reads the bounds first: halving clip_ratio halves both, clip-higher's shape kept.
    assert args[catalog.CLIP_LOW_KEY] == pytest.approx(0.1) and args[catalog.CLIP_HIGH_KEY] == pytest.approx(0.14)
    actor = omega_conf_to_dataclass(_compose(cmd).actor_rollout_ref.actor)
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (pytest.approx(0.1), pytest.approx(0.14))


def test_finding1_a_second_clip_change_moves_from_the_commands_bounds_not_from_the_last_relaunch(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    bounds = launch_clip_bounds(_launch_dir(tmp_path / "a", VERL_CMD), {catalog.CLIP_RATIO_KEY: 0.05})
    assert bounds == {catalog.CLIP_LOW_KEY: pytest.approx(0.05), catalog.CLIP_HIGH_KEY: pytest.approx(0.07)}
    # A rule that set a bound itself keeps it; without clip_ratio in the overrides nothing is added.
    assert catalog.CLIP_LOW_KEY not in launch_clip_bounds(tmp_path / "a" / "run", {catalog.CLIP_RATIO_KEY: 0.1,
                                                                                  catalog.CLIP_LOW_KEY: 0.15})
    assert launch_clip_bounds(tmp_path / "a" / "run", {ACTOR_LR: 1e-7}) == {}
    assert restart_command(VERL_CMD, {catalog.CLIP_RATIO_KEY: 0.1}, None).count("actor_rollout_ref.actor.clip_ratio=0.1") == 1


def _launch_dir(tmp: Path, command: list[str]) -> Path:
    run = tmp / "run"
    zero_patch.init_run(run, command)
    return run


def test_finding12_in_process_clip_ratio_keeps_an_asymmetric_clip_higher() -> None:
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla  # noqa: F401  (the loss that reads them)
    from verl.workers.config import FSDPActorConfig

    from ppo_watchdog.trainer.verl_glue import apply

    cfg = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                          clip_ratio_low=0.2, clip_ratio_high=0.28)
    fn = apply.apply_loss_coefs(functools.partial(lambda **kw: None, config=cfg), {apply.CLIP_RATIO: 0.1})
    new = fn.keywords["config"]
    assert (new.clip_ratio, new.clip_ratio_low, new.clip_ratio_high) == (0.1, pytest.approx(0.1), pytest.approx(0.14))


# -- finding 2: the lr patch, one shard at a time ----------------------------------------------------


def _optim_shard(numel: int, lr: float, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {i: {"step": torch.tensor(7.0), "exp_avg": torch.randn(numel, generator=g),
                 "exp_avg_sq": torch.rand(numel, generator=g)} for i in range(2)}
    return {"state": state, "param_groups": [{"lr": lr * 0.5, "initial_lr": lr, "params": [0, 1],
                                              "betas": (0.9, 0.999), "weight_decay": 0.01}]}


def _extra_state(lr: float) -> dict[str, Any]:
    import numpy as np
    import torch

    return {"lr_scheduler": {"base_lrs": [lr], "_last_lr": [lr * 0.5], "last_epoch": 7, "_step_count": 8},
            "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state()}}


def _multi_rank_checkpoint(root: Path, world: int, numel: int, lr: float = 1e-6) -> Path:
    """A verl ``global_step_40`` of ``world`` ranks for actor and critic, written with torch.save."""
    import torch

    d = ckpt.step_dir(root, 40)
    for c, comp in enumerate(("actor", "critic")):
        for rank in range(world):
            (d / comp).mkdir(parents=True, exist_ok=True)
            torch.save(_optim_shard(numel, lr, seed=100 * c + rank), ckpt.verl_file(d / comp, "optim", world, rank))
            torch.save(_extra_state(lr), ckpt.verl_file(d / comp, "extra_state", world, rank))
            torch.save({"w": torch.zeros(4)}, ckpt.verl_file(d / comp, "model", world, rank))
    torch.save({"dataloader": 40}, d / "data.pt")
    (root / rundir.LATEST_MARKER).write_text("40")
    return d


def _tensor_bytes_alive() -> int:
    """Bytes of every distinct tensor storage reachable in this process (what a load holds)."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                st = obj.untyped_storage()
            except RuntimeError:
                continue
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_finding2_the_lr_patch_holds_one_ranks_optimizer_state_at_a_time(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    world, numel = 4, 64 * 1024  # 8 optimizer shards of 1 MiB of tensors each
    src = _multi_rank_checkpoint(tmp_path / "ck", world, numel)
    shard = 2 * 2 * numel * 4  # two params x (exp_avg, exp_avg_sq) x float32
    baseline = _tensor_bytes_alive()
    peaks: list[int] = []
    real_load = ckpt.load_verl_file

    def counting_load(path: Path | str, mmap: bool = False) -> Any:
        obj = real_load(path, mmap=mmap)
        peaks.append(_tensor_bytes_alive() - baseline)  # everything held right after each load
        return obj

    monkeypatch.setattr(ckpt, "load_verl_file", counting_load)
    lrs = {ACTOR_LR: 5e-7, "critic.optim.lr": 5e-6}
    dst = lr_patch.patch_lr_copy(src, tmp_path / "resume", lrs)
    monkeypatch.undo()
    assert len(peaks) == 2 * 2 * world  # optim + extra_state, every rank of both components
    # The bound: one rank's optimizer shard (plus its small extra_state), never the 8 of the checkpoint.
    assert max(peaks) <= 1.25 * shard + 64 * 1024, f"peak {max(peaks)} B alive for shards of {shard} B"
    assert lr_patch.patch_memory_bound(src, lrs) < 2 * shard
    # ...and the copy is whole: every rank rescaled, tensors intact, the rest hard-linked.
    for c, comp in enumerate(("actor", "critic")):
        for rank in range(world):
            o = ckpt.load_verl_file(ckpt.verl_file(dst / comp, "optim", world, rank))
            want = _optim_shard(numel, 1e-6, seed=100 * c + rank)
            assert torch.equal(o["state"][1]["exp_avg_sq"], want["state"][1]["exp_avg_sq"])
            scale = (5e-7 if comp == "actor" else 5e-6) / 1e-6
            assert o["param_groups"][0]["initial_lr"] == pytest.approx(1e-6 * scale)
    assert os.path.samefile(ckpt.verl_file(dst / "actor", "model", world, 3), ckpt.verl_file(src / "actor", "model",
                                                                                             world, 3))


def test_finding2_a_refusal_on_the_last_rank_leaves_nothing_behind(tmp_path: Path) -> None:
    import torch

    src = _multi_rank_checkpoint(tmp_path / "ck", world=3, numel=16)
    torch.save({"state": {}, "param_groups": [{"lr": 1.0, "params": []}], "bad": _Pickled()},
               ckpt.verl_file(src / "critic", "optim", 3, 2))
    with pytest.raises(lr_patch.LrPatchRefused, match="critic/optim_world_size_3_rank_2.pt"):
        lr_patch.patch_lr_copy(src, tmp_path / "resume", {ACTOR_LR: 5e-7, "critic.optim.lr": 5e-6})
    assert not any((tmp_path / "resume").iterdir())


class _Pickled:
    """An arbitrary class: what weights_only=True must refuse."""


# -- finding 4: the grad clip keys verl reads --------------------------------------------------------


def test_finding4_grad_clip_keys_are_verls_optim_clip_grad() -> None:
    import inspect

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    for key in ("actor_rollout_ref.actor.optim.clip_grad", "critic.optim.clip_grad"):
        assert key in TUNABLE_KEYS and not TUNABLE_KEYS[key].live
    assert "actor_rollout_ref.actor.grad_clip" not in TUNABLE_KEYS and "critic.grad_clip" not in TUNABLE_KEYS
    cfg = _compose([*VERL_CMD, "actor_rollout_ref.actor.optim.clip_grad=0.5", "critic.optim.clip_grad=0.25"])
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim).clip_grad == 0.5
    assert omega_conf_to_dataclass(cfg.critic.optim).clip_grad == 0.25
    # The engine clips with the optimizer's clip_grad; actor.grad_clip is never read by it.
    step = inspect.getsource(FSDPEngine.optimizer_step)
    assert "optimizer_config.clip_grad" in step and "grad_clip" not in step.replace("clip_grad_norm", "")


def test_finding4_the_embedded_trainer_clips_with_optim_clip_grad_when_given() -> None:
    from ppo_watchdog.trainer.config import ActorConfig, CriticConfig, OptimConfig
    from ppo_watchdog.trainer.ppo import clip_norm

    assert clip_norm(ActorConfig(grad_clip=1.0)) == 1.0  # the older key still works alone
    assert clip_norm(ActorConfig(grad_clip=1.0, optim=OptimConfig(lr=1e-4, clip_grad=0.3))) == 0.3
    assert clip_norm(CriticConfig(optim=OptimConfig(lr=1e-3, clip_grad=0.7))) == 0.7


# -- finding 5: FSDP2 DTensors and numpy skew under weights_only=True ---------------------------------

DTENSOR_SAVE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[2]
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (1,))
    d = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    optim = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": d, "exp_avg_sq": d * d}},
             "param_groups": [{"lr": 1e-6, "initial_lr": 1e-6, "params": [0]}]}
    torch.save(optim, sys.argv[1])
    dist.destroy_process_group()
""")
PATCH_IN_FRESH_PROCESS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ppo_watchdog.backends import verl_lr_patch as lp
    from ppo_watchdog.protocol import checkpoint as ckpt
    assert "torch.distributed.tensor" not in sys.modules  # nothing of the watchdog imported it before
    src = Path(sys.argv[1])
    dst = lp.patch_lr_copy(src, Path(sys.argv[2]), {"actor_rollout_ref.actor.optim.lr": 5e-7})
    o = ckpt.load_verl_file(ckpt.verl_file(dst / "actor", "optim", 1, 0))
    print(type(o["state"][0]["exp_avg"]).__name__, o["param_groups"][0]["lr"], o["state"][0]["exp_avg"].to_local().sum().item())
""")


def test_finding5_an_fsdp2_dtensor_optimizer_state_gets_an_lr_patch_with_weights_only(tmp_path: Path) -> None:
    import torch

    from ppo_watchdog.protocol.exporter import free_port

    d = ckpt.step_dir(tmp_path / "ck", 10)
    (d / "actor").mkdir(parents=True)
    saved = subprocess.run([sys.executable, "-c", DTENSOR_SAVE, str(ckpt.verl_file(d / "actor", "optim", 1, 0)),
                            str(free_port())], capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-2000:]
    torch.save(_extra_state(1e-6), ckpt.verl_file(d / "actor", "extra_state", 1, 0))
    torch.save({"w": torch.zeros(2)}, ckpt.verl_file(d / "actor", "model", 1, 0))
    torch.save({}, d / "data.pt")
    out = subprocess.run([sys.executable, "-c", PATCH_IN_FRESH_PROCESS, str(d), str(tmp_path / "resume")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    kind, lr, total = out.stdout.split()
    assert (kind, float(lr), float(total)) == ("DTensor", pytest.approx(5e-7 * 0.5 / 0.5), 66.0)


def _rename_in_pickle(src: Path, dst: Path, old: bytes, new: bytes) -> None:
    """``src`` rewritten as the other numpy pickles it (torch.save's zip with data.pkl edited)."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("data.pkl"):
                assert old in data
                data = data.replace(old, new)
            zout.writestr(info, data)


@pytest.mark.parametrize("written_by", ["numpy 1 (numpy.core)", "numpy 2 (numpy._core)"])
def test_finding5_an_rng_state_pickled_by_the_other_numpy_loads_with_weights_only(tmp_path: Path,
                                                                                   written_by: str) -> None:
    import numpy as np
    import torch

    here = b"cnumpy._core.multiarray\n" if hasattr(np, "_core") else b"cnumpy.core.multiarray\n"
    other = b"cnumpy.core.multiarray\n" if "numpy 1" in written_by else b"cnumpy._core.multiarray\n"
    torch.save(_extra_state(1e-6), tmp_path / "mine.pt")
    _rename_in_pickle(tmp_path / "mine.pt", tmp_path / "theirs.pt", here, other)
    extra = ckpt.load_verl_file(tmp_path / "theirs.pt")
    assert extra["rng"]["numpy"][0] == "MT19937" and len(extra["rng"]["numpy"][1]) == 624
    assert lr_patch.base_lr({"param_groups": [{"lr": 1e-6}]}, extra, tmp_path / "theirs.pt") == 1e-6


# -- finding 6: OOM remedies verl accepts, each site its own knob ------------------------------------


def test_finding6_the_micro_batch_is_snapped_to_divide_each_ranks_share(tmp_path: Path) -> None:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    cfg = zero_patch.config_snapshot(VERL_CMD)
    # mini 48 x rollout.n 1 over 8 data-parallel ranks: each rank trains on 6 samples per mini batch.
    assert micro_batch_share(ACTOR_MICRO, cfg, 8) == 6
    sets = oom_remedy("actor_update", cfg, {}, world_size=8, failed_mb=6)
    assert sets == {ACTOR_MICRO: 3}  # 5 does not divide 6; 4 divides the global 48 but not 6
    assert snap_sets({ACTOR_MICRO: 4}, cfg, 8) == {ACTOR_MICRO: 3}

    def verl_accepts(micro: int) -> bool:
        data = TensorDict({"x": __import__("torch").zeros(6, 2)}, batch_size=[6])
        tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro)
        try:
            prepare_micro_batches(data)
        except AssertionError:
            return False
        return True

    assert verl_accepts(3) and not verl_accepts(4)  # verl's own check on one rank's share


def test_finding6_each_oom_site_lowers_its_own_knob() -> None:
    cfg = zero_patch.config_snapshot(VERL_CMD)
    assert oom_remedy("log_prob", cfg, {}, 8) == {"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 6}
    assert oom_remedy("ref_log_prob", cfg, {}, 8) == {"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 6}
    assert oom_remedy("rollout", cfg, {}, 8) == {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.4}
    assert oom_remedy("rollout", cfg, {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.4}, 8) == \
        {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.32}
    # Dynamic batch sizes: the token budget is the knob, never below one whole sequence (2048 here).
    dyn = {**cfg, "actor_rollout_ref.actor.use_dynamic_bsz": True}
    assert oom_remedy("actor_update", dyn, {}, 8) == {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 12288}
    assert oom_remedy("log_prob", dyn, {}, 8) == {"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 12288}
    assert oom_remedy("actor_update", dyn, {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 2048}, 8) == {}
    # The embedded trainer (one process): both PPO micro batches, as before.
    assert oom_remedy(None, {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 16,
                                                             "ppo_micro_batch_size_per_gpu": 8}},
                             "critic": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8}}, {}) == \
        {ACTOR_MICRO: 4, "critic.ppo_micro_batch_size_per_gpu": 4}


@pytest.mark.parametrize(("worker_call", "site"), [
    ("WorkerDict.actor_rollout_ref_update_actor", "actor_update"),
    ("WorkerDict.actor_rollout_ref_compute_log_prob", "log_prob"),
    ("WorkerDict.actor_rollout_ref_compute_ref_log_prob", "ref_log_prob"),
    ("WorkerDict.critic_train_mini_batch", "critic_update"),
    ("WorkerDict.critic_infer_batch", "critic_values"),
    ("vLLMHttpServer.wake_up", "rollout"),
])
def test_finding6_the_oom_site_is_read_from_rays_traceback(worker_call: str, site: str) -> None:
    ec = verl_exits.classify(_driver_log(_cuda_oom(), worker_call), 1)
    assert (ec.kind, ec.memory, ec.site) == ("oom", "cuda", site)


def test_finding3_a_v1_critic_oom_lowers_the_engines_token_budget_which_verl_accepts() -> None:
    import dataclasses

    from verl.workers.config import CriticConfig

    cfg = zero_patch.config_snapshot(VERL_CMD)
    sets = oom_remedy("critic_update", cfg, {}, 8)
    assert sets == {"critic.ppo_infer_max_token_len_per_gpu": 24576}  # 32768 x 0.75, verl's default budget
    cmd = restart_command(VERL_CMD, sets, None)
    assert "++critic.ppo_infer_max_token_len_per_gpu=24576" in cmd  # critic.yaml does not declare the key
    assert _compose(cmd).critic.ppo_infer_max_token_len_per_gpu == 24576  # Hydra takes it into verl's config
    assert "ppo_infer_max_token_len_per_gpu" in {f.name for f in dataclasses.fields(CriticConfig)}
    # ...which is what the v1 trainer copies into the critic engine (dynamic batching always on there).
    import inspect

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    src = inspect.getsource(PPOTrainer)
    assert "critic_cfg.engine.max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu" in src
    legacy = oom_remedy("critic_update", {**cfg, "trainer.use_v1": False}, {}, 8)
    assert legacy == {"critic.ppo_micro_batch_size_per_gpu": 3}


# -- finding 10: a run with a critic needs critic/ ---------------------------------------------------


def test_finding10_a_checkpoint_without_critic_files_is_incomplete_for_a_run_with_a_critic(tmp_path: Path) -> None:
    import torch

    run = tmp_path / "run"
    zero_patch.init_run(run, [*VERL_CMD, "trainer.n_gpus_per_node=1"])
    root = run / "checkpoints"
    d = ckpt.step_dir(root, 5)
    (d / "actor").mkdir(parents=True)
    for kind in ckpt.VERL_KINDS:
        torch.save({}, ckpt.verl_file(d / "actor", kind, 1, 0))
    torch.save({}, d / "data.pt")
    (root / rundir.LATEST_MARKER).write_text("5")
    (info,) = zero_patch.dialect_for(run, "run").checkpoints()
    assert not info.complete and "critic/" in info.reason
    # A GRPO run (no critic) needs none.
    grpo = tmp_path / "grpo"
    zero_patch.init_run(grpo, [*VERL_CMD, "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1",
                               f"trainer.default_local_dir={root}"])
    (info,) = zero_patch.dialect_for(grpo, "grpo").checkpoints()
    assert info.complete, info.reason


# -- finding 9: verl's own pruning must not take the last known-good checkpoint ---------------------


def _verl_save(root: Path, step: int, manager: Any, keep: int) -> None:
    """One verl save of a one-rank GRPO run, in verl's order: the checkpoint manager makes room
    (``ensure_checkpoint_capacity``), writes actor/, registers it (which prunes beyond ``keep``),
    then the trainer writes data.pt and the marker (trainer/ppo/v1/trainer_base.py, _save_checkpoint)."""
    import torch

    actor = ckpt.step_dir(root, step) / "actor"
    manager.ensure_checkpoint_capacity(keep)
    actor.mkdir(parents=True)
    for kind in ckpt.VERL_KINDS:
        torch.save({"step": step}, ckpt.verl_file(actor, kind, 1, 0))
    manager.register_checkpoint(str(actor), keep)
    torch.save({}, actor.parent / "data.pt")
    (root / rundir.LATEST_MARKER).write_text(str(step))


def test_finding9_verls_max_actor_ckpt_to_keep_cannot_prune_the_last_known_good_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    from ppo_watchdog.control.actuator import choose_known_good
    from ppo_watchdog.control.controller import EngineRules, RunController

    run, root = tmp_path / "run", tmp_path / "ckpts"
    command = [*VERL_CMD, "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1",
               f"trainer.default_local_dir={root}", "trainer.max_actor_ckpt_to_keep=1"]
    zero_patch.init_run(run, command)
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("run", str(run), command))
    with caplog.at_level("WARNING"):
        ctl = RunController(store, "run", EngineRules([REPO / "rules" / "default.yaml"]),
                            Actuator(store, RecordingBackend()))
    assert "trainer.max_actor_ckpt_to_keep=1" in caplog.text and ckpt.KEPT_DIR in caplog.text
    # verl's real pruning (its checkpoint manager's own methods; no process group is needed for them).
    manager = object.__new__(BaseCheckpointManager)
    manager.previous_saved_paths = []
    for step in (2, 4):
        _verl_save(root, step, manager, keep=1)
        ctl.tick()
    assert not (ckpt.step_dir(root, 2) / "actor").exists()  # verl pruned it
    store.open_bad_span("run", "kl_far", 5)  # the run diverges from step 5 on
    for step in (6, 8):
        _verl_save(root, step, manager, keep=1)
        ctl.tick()
    assert sorted(p.name for p in root.iterdir() if (p / "actor").is_dir()) == ["global_step_8"]
    good = choose_known_good([c for c in ctl.h.dialect.checkpoints() if c.complete], store.bad_spans("run"))
    assert good is not None and good.step == 4 and good.path.parent.name == ckpt.KEPT_DIR
    assert "global_step_" in str(good.path)  # verl's resume_path asserts it (trainer_base.py, _load_checkpoint)
    model = torch.load(ckpt.verl_file(good.path / "actor", "model", 1, 0), weights_only=True)
    assert model == {"step": 4}
    # After the rollback, newer known-good checkpoints release the older kept copies.
    store.close_bad_spans("run", 8)
    for step in (10, 12):
        _verl_save(root, step, manager, keep=1)
        ctl.tick()
    assert sorted(p.name for p in ckpt.kept_root(root).iterdir()) == ["global_step_10", "global_step_12"]


def test_finding9_without_verls_pruning_nothing_is_kept(tmp_path: Path) -> None:
    run, root = tmp_path / "run", tmp_path / "ckpts"
    zero_patch.init_run(run, [*VERL_CMD, "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1",
                              f"trainer.default_local_dir={root}"])
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    manager = object.__new__(BaseCheckpointManager)
    manager.previous_saved_paths = []
    _verl_save(root, 2, manager, keep=0)
    glue = zero_patch.dialect_for(run, "run")
    assert glue.protect(lambda step, ts: False) == [] and not ckpt.kept_root(root).exists()


def test_finding9_starting_over_sets_the_kept_copies_aside_too(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    (ckpt.step_dir(root, 2) / "actor").mkdir(parents=True)
    (ckpt.kept_root(root) / "global_step_2").mkdir(parents=True)
    moved = ckpt.set_aside(root, "7")
    assert moved is not None and (moved / ckpt.KEPT_DIR / "global_step_2").is_dir()
    assert not ckpt.kept_root(root).exists()


# -- finding 7: a relaunch waits for the whole process group, not only the leader ---------------------

# A leader that exits at once on SIGTERM, and a worker in its process group (as Ray's raylet, its
# workers and vLLM are under a local ray.init) that takes a while to let go.
LEADER_WITH_SLOW_WORKER = textwrap.dedent("""
    import pathlib, signal, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", '''
    import pathlib, signal, sys, time
    def bye(*a):
        time.sleep(1.0)  # releasing the GPU takes time
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    pathlib.Path("worker.pid").write_text(str(__import__("os").getpid()))
    time.sleep(60)
    '''])
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    if sys.argv[1] == "crash":
        while not pathlib.Path("worker.pid").exists():
            time.sleep(0.02)
        sys.exit(1)
    time.sleep(60)
""")


def _pid_gone(pid: int) -> bool:
    from ppo_watchdog.backends.local import _pid_alive

    return not _pid_alive(pid)


@pytest.mark.parametrize("how", ["running", "crash"])
def test_finding7_stop_returns_only_once_the_leaders_whole_process_group_has_ended(tmp_path: Path, how: str) -> None:
    import time

    from ppo_watchdog.backends.local import LocalBackend

    (tmp_path / "leader.py").write_text(LEADER_WITH_SLOW_WORKER)
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("run", str(tmp_path), ["python"]))
    act = Actuator(store, LocalBackend())
    h = RunHandle(store.require_run("run"))
    h.proc = LocalBackend().start([sys.executable, str(tmp_path / "leader.py"), how], cwd=tmp_path)
    deadline = time.monotonic() + 20
    while not (tmp_path / "worker.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    worker = int((tmp_path / "worker.pid").read_text())
    if how == "crash":
        while h.proc.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not h.proc.alive() and not _pid_gone(worker)  # the leader died; its worker lives on
    act.stop(h)
    assert _pid_gone(worker), "stop returned while a process of the old attempt still ran"
    assert h.proc.group_members() == []


# -- finding 12: one OOM, one event; a host OOM is an ActorDiedError -----------------------------------

#: The raylet's OOM-kill detail (the format of tests/test_verl_mode.py's HOST_OOM_DETAIL).
HOST_OOM_DETAIL = (
    "The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY "
    "Worker exit detail: 1 worker(s) were killed due to the node running low on memory. "
    "Memory on the node (IP: 10.0.0.7, ID: 5f1c2b) was 241.12GB used / 251.50GB limit (0.958725)"
)


def _host_oom() -> BaseException:
    """Ray's real ActorDiedError for a worker its memory monitor killed (no 'OutOfMemoryError' in it)."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    ctx = ActorDiedErrorContext(class_name="WorkerDict", actor_id=b"\x01" * 16, pid=4242,
                                node_ip_address="10.0.0.7", error_message=HOST_OOM_DETAIL)
    return _raised(ActorDiedError(ctx))


def test_finding12_is_oom_knows_a_host_oom_that_reaches_the_driver_as_an_actor_died_error() -> None:
    from ray.exceptions import RayTaskError

    from ppo_watchdog.trainer.verl_glue import runner

    host = _host_oom()
    assert "OutOfMemoryError" not in f"{type(host).__name__}: {host}"  # what the old check looked for
    assert runner.oom_fields(host) is not None and runner.oom_fields(host)["memory"] == "host"  # type: ignore[index]
    cuda = _raised(RayTaskError("WorkerDict.actor_rollout_ref_update_actor", _format(_cuda_oom()), _cuda_oom(),
                                proctitle="ray::WorkerDict.actor_rollout_ref_update_actor").as_instanceof_cause())
    fields = runner.oom_fields(cuda)
    assert fields is not None and (fields["memory"], fields["site"]) == ("cuda", "actor_update")
    assert "CUDA out of memory" in fields["message"]
    assert not runner.is_oom(_raised(ValueError("shapes do not match")))


def test_finding12_an_in_process_oom_writes_one_oom_event_and_no_error(tmp_path: Path, monkeypatch) -> None:
    import verl.trainer.main_ppo as main_ppo
    from omegaconf import OmegaConf

    from ppo_watchdog.trainer.verl_glue import runner
    from ppo_watchdog.trainer.verl_glue.taskrunner import TaskRunnerV1Class, WatchdogTaskRunner

    run = tmp_path / "run"
    cfg = OmegaConf.create({"watchdog": {"run_dir": str(run), "run_id": "r", "metrics_port": 0},
                            "trainer": {"default_local_dir": str(run / "checkpoints")},
                            "actor_rollout_ref": {"actor": {}}, "critic": {}, "algorithm": {}})
    monkeypatch.setattr(runner, "_write_launch_json", lambda *a: None)
    task_runner = object.__new__(WatchdogTaskRunner.__ray_actor_class__)  # the actor's class, run in this process
    task_runner._finish = lambda kind, **f: rundir.append_event(run, kind, 3, **f)  # as watchdog_finish writes it
    oom = _cuda_oom()

    def verl_fails(self: Any, config: Any) -> None:
        raise oom

    monkeypatch.setattr(TaskRunnerV1Class, "run", verl_fails)

    def run_ppo(config: Any, task_runner_class: Any = None) -> None:
        try:
            task_runner.run(config)  # the TaskRunner sees the worker's OOM first...
        except BaseException as exc:  # ...and the driver gets it wrapped by Ray
            from ray.exceptions import RayTaskError

            raise RayTaskError("TaskRunner.run", _format(exc), exc).as_instanceof_cause() from exc

    monkeypatch.setattr(main_ppo, "run_ppo", run_ppo)
    assert runner.launch(cfg, ["python"]) == rundir.EXIT_OOM
    kinds = [e.kind for e in rundir.iter_events(run)]
    assert kinds == ["oom"] and rundir.iter_events(run)[0]["memory"] == "cuda"
    # A host OOM that took the TaskRunner down: the driver alone says it, once.
    host = _host_oom()

    def killed(config: Any, task_runner_class: Any = None) -> None:
        raise host

    monkeypatch.setattr(main_ppo, "run_ppo", killed)
    assert runner.launch(cfg, ["python"]) == rundir.EXIT_OOM
    assert [(e.kind, e.get("memory")) for e in rundir.iter_events(run)] == [("oom", "cuda"), ("oom", "host")]


# -- finding 11: the adaptive KL coefficient on relaunch ----------------------------------------------


def test_finding11_a_relaunch_passes_the_coefficient_verls_adaptive_controller_holds_after_the_checkpoint(
        tmp_path: Path) -> None:
    import json

    from verl.trainer.ppo.core_algos import AdaptiveKLController

    run = tmp_path / "run"
    command = [*VERL_CMD, "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
               "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.02", "algorithm.kl_ctrl.horizon=500",
               "actor_rollout_ref.rollout.n=2"]
    zero_patch.init_run(run, command)
    glue = zero_patch.dialect_for(run, "run")
    cmd, env = glue.prepare_launch(command, {}, None)
    glue.launched(1, cmd, None)
    # verl's own controller over 6 steps, logged as apply_kl_penalty logs it: the coefficient *before*
    # the step's update (trainer/ppo/ray_trainer.py), with n_steps the batch size (96 prompts x n=2).
    ctrl = AdaptiveKLController(init_kl_coef=0.05, target_kl=0.02, horizon=500)
    kls = [0.031, 0.027, 0.012, 0.05, 0.019, 0.04]
    after: dict[int, float] = {}
    lines = []
    for step, kl in enumerate(kls, start=1):
        lines.append(json.dumps({"step": step, "data": {"actor/reward_kl_penalty": kl,
                                                        "actor/reward_kl_penalty_coeff": ctrl.value}}))
        ctrl.update(current_kl=kl, n_steps=96 * 2)
        after[step] = ctrl.value
    Path(env[zero_patch.FILE_LOGGER_ENV]).write_text("\n".join(lines) + "\n")
    glue.poll(None)
    # A rollback to step 2's checkpoint: step 3 must run with the controller's value after step 2.
    resume = str(ckpt.step_dir(glue.ckpt_dir, 2))
    cmd2, _ = glue.prepare_launch(restart_command(command, {}, resume), {}, resume)
    assert float(hydra.values(cmd2)[zero_patch.KL_COEF_KEY]) == pytest.approx(after[2], rel=1e-12)
    assert after[2] != after[6] and after[2] != kls[1]  # neither the newest nor the logged (pre-update) value
    # A resume from the newest checkpoint passes the value after the newest step, not the one before it.
    resume6 = str(ckpt.step_dir(glue.ckpt_dir, 6))
    cmd3, _ = glue.prepare_launch(restart_command(command, {}, resume6), {}, resume6)
    assert float(hydra.values(cmd3)[zero_patch.KL_COEF_KEY]) == pytest.approx(after[6], rel=1e-12)


def test_finding11_a_fixed_controller_passes_the_logged_coefficient_unchanged() -> None:
    cfg = {**zero_patch.KL_CTRL_DEFAULTS}
    assert zero_patch.kl_coef_after(0.001, 0.5, cfg) == 0.001


# -- finding 8: boundaries and manifests off verl's step timer; manifests hashed in parallel ----------


def test_finding8_the_boundarys_time_is_not_counted_in_verls_step_timer() -> None:
    import time

    from verl.utils.debug import marked_timer  # what trainer_base.fit times the step with

    from ppo_watchdog.trainer.verl_glue.trainer import WatchdogPPOTrainer

    class SlowBoundary:  # a pause for a human, or a boundary save: 0.3 s
        def at_boundary(self, step: int) -> None:
            time.sleep(0.3)

    t = object.__new__(WatchdogPPOTrainer)
    t.glue, t.global_steps, t.timing_raw = SlowBoundary(), 4, {}  # type: ignore[assignment]
    with marked_timer("step", t.timing_raw):  # fit's own order: the timer, then on_step_begin inside it
        t.on_step_begin()
        time.sleep(0.05)  # the step's own work
    assert 0.04 <= t.timing_raw["step"] < 0.2, t.timing_raw
    assert t.timing_raw["watchdog_boundary"] >= 0.3


def _verl_step_dir(root: Path, step: int, world: int) -> Path:
    import torch

    d = ckpt.step_dir(root, step)
    (d / "actor").mkdir(parents=True)
    for rank in range(world):
        for kind in ckpt.VERL_KINDS:
            torch.save({"rank": rank, "kind": kind}, ckpt.verl_file(d / "actor", kind, world, rank))
    torch.save({}, d / "data.pt")
    return d


def test_finding8_manifests_are_hashed_in_the_background_several_files_at_once(tmp_path: Path, monkeypatch) -> None:
    import threading

    from ppo_watchdog.trainer.verl_glue import manifest

    d = _verl_step_dir(tmp_path, 4, world=4)
    release, threads = threading.Event(), set()
    real = manifest._sha256_file

    def gated(path: Path) -> str:
        threads.add(threading.current_thread().name)
        release.wait(10)
        return real(path)

    monkeypatch.setattr(manifest, "_sha256_file", gated)
    done: list[tuple[Path, Exception | None]] = []
    writer = manifest.ManifestWriter(hash_workers=4)
    writer.submit(d, 4, 0, lambda p, e: done.append((p, e)), world_size=4, components=("actor",))
    # The caller (verl's training step) goes on while the files are hashed.
    assert not (d / ckpt.MANIFEST).exists() and done == []
    release.set()
    writer.close()
    assert done == [(d, None)] and ckpt.verify_checkpoint(d).complete
    assert len(threads) > 1, threads  # several files at once


def test_finding8_a_multi_node_save_with_node_local_disks_gets_no_manifest_and_says_why(tmp_path: Path) -> None:
    from ppo_watchdog.trainer.verl_glue import manifest

    d = _verl_step_dir(tmp_path, 4, world=16)
    for rank in range(8, 16):  # the second node's shards are on its own disk
        for kind in ckpt.VERL_KINDS:
            ckpt.verl_file(d / "actor", kind, 16, rank).unlink()
    with pytest.raises(ckpt.CheckpointError, match="shares"):
        manifest.write_manifest(d, 4, 0, world_size=16, components=("actor",))
    assert not (d / ckpt.MANIFEST).exists()


# -- RL-Insight: verl's own Prometheus series read without a second exporter --------------------------


def test_rl_insight_series_verl_sends_map_onto_the_catalog_and_the_source_reads_them(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    from verl.utils.tracking import RLInsightLogger

    from ppo_watchdog.protocol.runinfo import RunInfo
    from ppo_watchdog.sources.prometheus import PrometheusSource, make_source, source_config

    sent: dict[str, float] = {}

    class Hub:  # rl_insight's module API as verl calls it (metric_gauge(name, value))
        @staticmethod
        def metric_gauge(name: str, value: float) -> None:
            sent[catalog.RL_INSIGHT_PREFIX + name] = value  # the hub's namespace prefix

    monkeypatch.setenv(RLInsightLogger.ENABLE_ENV, "1")
    monkeypatch.setattr(RLInsightLogger, "_rl_insight_module", Hub)
    monkeypatch.setattr(RLInsightLogger, "_init_done", True)
    logged = {"training/global_step": 7, "actor/reward_kl_penalty": 0.031, "actor/pg_clipfrac": 0.12,
              "actor/ppo_kl": 0.004, "critic/vf_loss": 0.8, "perf/time_per_step": 41.5, "critic/kl": 0.03,
              "response_length/mean": 412.0, "val-core/gsm8k/reward/mean@1": 0.61}
    RLInsightLogger.log(logged, step=7)  # verl's own logger backend
    mapped = {catalog.BY_RL_INSIGHT[n].key: v for n, v in sent.items() if n in catalog.BY_RL_INSIGHT}
    assert mapped["actor/pg_clipfrac"] == 0.12 and mapped["training/global_step"] == 7
    assert mapped["actor/reward_kl_penalty"] in (0.031, 0.03)  # critic/kl: an older verl's name for the same
    assert "rl_insight_monitor_perf_time_per_step" in catalog.BY_RL_INSIGHT
    assert catalog.rl_insight_name("val-core/gsm8k/reward/mean@1") is None  # "-" and "@": no Prometheus name

    class RLInsightPrometheus:  # Prometheus's query API over two scrapes of the hub
        safe_url = "http://prometheus"

        def __init__(self) -> None:
            self.asked: list[str] = []

        def query(self, promql: str, at: float) -> dict[str, Any]:
            self.asked.append(promql)
            series = [{"metric": {"__name__": n, "experiment_name": "qwen7b-ppo", "project": "p"},
                       "values": [[started + 1, str(v)], [started + 2, str(v)]]}
                      for n, v in sent.items() if n in catalog.BY_RL_INSIGHT]
            return {"resultType": "matrix", "result": series}

    run = tmp_path / "run"
    zero_patch.init_run(run, [*VERL_CMD, "trainer.experiment_name=qwen7b-ppo"])
    RunInfo.read(run).replace(id="run").write(run)
    rundir.append_event(run, "started", 0)
    started = rundir.iter_events(run)[0]["ts"]
    client = RLInsightPrometheus()
    source = PrometheusSource(client, run, names="rl_insight", clock=lambda: started + 10)
    records, _ = source.poll()
    assert [r["step"] for r in records] == [7]
    assert records[0]["data"]["actor/pg_clipfrac"] == 0.12
    assert 'experiment_name="qwen7b-ppo"' in client.asked[0] and "rl_insight_monitor_actor_pg_clipfrac" in client.asked[0]
    cfg = source_config("rl_insight", "http://prometheus:9090")
    assert make_source(cfg, run, "run").names == "rl_insight"
