"""The in-process verl glue on verl's real classes, on CPU, without the fit loop.

What runs for real: verl's KL controllers, its Hydra config (composed from verl's own
YAML, struct and read-only), ``ActorConfig`` and ``ppo_loss``, its warmup/cosine
``LambdaLR`` builders over a torch optimizer, its ``@register`` dispatch attributes and
worker-group binding (``create_colocated_worker_cls`` and ``WorkerGroup._bind_worker_method``
with verl's own dispatch/collect functions), its trainer registry, and our
``WatchdogPPOTrainer`` constructed from that config. What does not: Ray actors, GPUs and
the rollout engine. The worker group used for the step-boundary tests runs verl's dispatch
and collect functions on worker objects in this process (:class:`LocalWorkerGroup`); each
worker's engine is a namespace holding a real optimizer and LambdaLR, the two things the
glue touches.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from typer.testing import CliRunner
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, get_predefined_dispatch_fn
from verl.single_controller.base.worker_group import WorkerGroup
from verl.trainer.ppo.core_algos import AdaptiveKLController, FixedKLController
from verl.utils.torch_functional import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
)
from verl.workers.config import ActorConfig
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss

from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import Command, Control, write_control
from ppo_watchdog.protocol.exporter import MetricsExporter
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.trainer.verl_glue import apply
from ppo_watchdog.trainer.verl_glue.apply import LiveSettingError
from ppo_watchdog.trainer.verl_glue.boundary import (
    ControlBoundary,
    LiveSettings,
    RunRecorder,
    StopRequested,
    VerlTargets,
)
from ppo_watchdog.trainer.verl_glue.runner import app, build_config, glue_overrides
from ppo_watchdog.trainer.verl_glue.trainer import TRAINER_MODE, WatchdogPPOTrainer
from ppo_watchdog.trainer.verl_glue.workers import WatchdogActorRolloutRefWorker, WatchdogTrainingWorker

REPO = Path(__file__).resolve().parent.parent
BASE_OVERRIDES = [
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "data.train_files=unused.parquet",
    "actor_rollout_ref.model.path=unused-model",
]


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """verl's own ppo_trainer config, composed once as the launcher composes it."""
    return build_config(BASE_OVERRIDES, tmp_path_factory.mktemp("composed"))


@pytest.fixture()
def config(verl_config: Any) -> Any:
    """A fresh copy per test (tests change it)."""
    return copy.deepcopy(verl_config)


def _optimizer(lr: float, warmup: int = 0, cosine_steps: int | None = None) -> tuple[Any, Any, torch.nn.Parameter]:
    """A one-parameter SGD optimizer and verl's LambdaLR: the update of a unit gradient is the lr."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))  # float64: the update is exactly the lr
    opt = torch.optim.SGD([p], lr=lr)
    if cosine_steps is None:
        sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=warmup)
    else:
        sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=cosine_steps)
    return opt, sched, p


def _step(opt: Any, sched: Any, p: torch.nn.Parameter) -> float:
    """One optimizer step with gradient 1 then one scheduler step; returns the lr the step used."""
    before = float(p.detach())
    p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    return before - float(p.detach())


def _actor_config(**kw: Any) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kw)


def _actor_worker(lr: float, **cfg: Any) -> WatchdogActorRolloutRefWorker:
    """Our actor worker class without Ray/torch.distributed init: its inner TrainingWorker holds a
    real optimizer + LambdaLR (the engine's two attributes the glue uses) and verl's loss partial."""
    w = object.__new__(WatchdogActorRolloutRefWorker)
    w.role = "actor_rollout"
    w.actor = object.__new__(TrainingWorker)
    opt, sched, _ = _optimizer(lr)
    w.actor.engine = SimpleNamespace(optimizer=opt, lr_scheduler=sched)
    w.loss_fn = functools.partial(ppo_loss, config=_actor_config(**cfg))
    w.actor.set_loss_fn(w.loss_fn)  # verl's own registered method
    return w


def _critic_worker(lr: float) -> WatchdogTrainingWorker:
    w = object.__new__(WatchdogTrainingWorker)
    opt, sched, _ = _optimizer(lr)
    w.engine = SimpleNamespace(optimizer=opt, lr_scheduler=sched)
    return w


class LocalWorkerGroup(WorkerGroup):
    """verl's WorkerGroup with its methods bound by verl's ``_bind_worker_method`` (real dispatch and
    collect functions from the ``@register`` attributes); ``execute_all`` calls the workers in process."""

    def __init__(self, workers: list[Any]) -> None:
        super().__init__(resource_pool=None)
        self._workers = list(workers)
        self._bind_worker_method(type(workers[0]), self._generate)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(w, method_name)(*(a[i] for a in args), **{k: v[i] for k, v in kwargs.items()})
                for i, w in enumerate(self._workers)]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._workers[0], method_name)(*args, **kwargs)  # bound too, for verl's other methods

    @staticmethod
    def _generate(wg: Any, method_name: str, dispatch_fn: Any, collect_fn: Any, execute_fn: Any,
                  blocking: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            a, kw = dispatch_fn(wg, *args, **kwargs)
            return collect_fn(wg, execute_fn(method_name, *a, **kw))
        return call


@dataclasses.dataclass
class Rig:
    """A real WatchdogPPOTrainer with two actor ranks and a critic, and a step boundary over a run dir."""

    trainer: WatchdogPPOTrainer
    actors: list[WatchdogActorRolloutRefWorker]
    critic: WatchdogTrainingWorker
    boundary: ControlBoundary
    recorder: RunRecorder
    run_dir: Path
    saves: list[int]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return rundir.iter_events(self.run_dir, [kind] if kind else None)


@pytest.fixture()
def rig(config: Any, tmp_path: Path) -> Any:
    trainer = WatchdogPPOTrainer(config)
    actors = [_actor_worker(1e-6, use_kl_loss=True), _actor_worker(1e-6, use_kl_loss=True)]
    critic = _critic_worker(1e-5)
    trainer.actor_rollout_wg = LocalWorkerGroup(actors)
    trainer.critic_wg = LocalWorkerGroup([critic])
    trainer.global_steps = 4  # verl's counter at the boundary before step 4
    exporter = MetricsExporter("glue-test")
    recorder = RunRecorder(tmp_path, exporter)
    settings = LiveSettings(VerlTargets(trainer.config, trainer.kl_ctrl_in_reward,
                                        trainer._set_lr, trainer._set_loss_coefs))
    saves: list[int] = []
    trainer.recorder = recorder
    trainer.glue = ControlBoundary(tmp_path, settings, recorder, save=lambda: saves.append(trainer.global_steps - 1))
    yield Rig(trainer, actors, critic, trainer.glue, recorder, tmp_path, saves)
    exporter.close()


def _write(run_dir: Path, version: int, overrides: dict[str, Any] | None = None,
           commands: tuple[Command, ...] = ()) -> None:
    """control.json as the watchdog's actuator writes it."""
    write_control(run_dir, Control(version, dict(overrides or {}), commands))


# -- KL controllers -------------------------------------------------------------------------


def test_fixed_kl_controller_takes_the_new_coefficient_and_keeps_it() -> None:
    ctrl = FixedKLController(kl_coef=0.001)
    assert apply.apply_kl_coef(ctrl, 0.004) == 0.004
    ctrl.update(current_kl=0.5, n_steps=64)
    assert ctrl.value == 0.004


def test_adaptive_kl_controller_adapts_onward_from_the_new_coefficient() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.001, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.3, n_steps=10)
    apply.apply_kl_coef(ctrl, 0.01)
    fresh = AdaptiveKLController(init_kl_coef=0.01, target_kl=0.1, horizon=100)
    for kl in (0.2, 0.05, 0.12):
        ctrl.update(current_kl=kl, n_steps=10)
        fresh.update(current_kl=kl, n_steps=10)
    assert ctrl.value == pytest.approx(fresh.value, rel=1e-12)
    assert ctrl.target == 0.1 and ctrl.horizon == 100


@pytest.mark.parametrize("bad", [-0.1, float("nan"), "high", True])
def test_kl_coef_rejects_a_bad_value_naming_the_key(bad: Any) -> None:
    ctrl = FixedKLController(kl_coef=0.001)
    with pytest.raises(LiveSettingError, match="algorithm.kl_ctrl.kl_coef"):
        apply.apply_kl_coef(ctrl, bad)
    assert ctrl.value == 0.001


# -- ppo_epochs in the driver's OmegaConf config --------------------------------------------


def test_ppo_epochs_change_in_a_struct_read_only_config(config: Any) -> None:
    OmegaConf.set_readonly(config, True)
    with pytest.raises(Exception, match="read-only|ReadonlyConfigError"):
        config.actor_rollout_ref.actor.ppo_epochs = 2  # what a naive assignment meets
    assert apply.apply_ppo_epochs(config, 3.0) == 3
    assert apply.apply_ppo_epochs(config, 2, apply.CRITIC_EPOCHS) == 2
    assert config.actor_rollout_ref.actor.ppo_epochs == 3 and config.critic.ppo_epochs == 2
    assert OmegaConf.is_readonly(config) and OmegaConf.is_struct(config)  # flags restored


def test_ppo_epochs_refuses_fractions_and_unknown_keys(config: Any) -> None:
    with pytest.raises(LiveSettingError, match="ppo_epochs=2.5"):
        apply.apply_ppo_epochs(config, 2.5)
    with pytest.raises(LiveSettingError, match="no such key"):
        apply.set_config_key(config, "actor_rollout_ref.actor.ppo_epoch", 2)
    assert config.actor_rollout_ref.actor.ppo_epochs == 1
    assert "ppo_epoch" not in config.actor_rollout_ref.actor


# -- lr: torch optimizer + verl's LambdaLR --------------------------------------------------


def test_setting_param_groups_alone_is_undone_by_verls_scheduler() -> None:
    opt, sched, p = _optimizer(1e-3)
    for g in opt.param_groups:
        g["lr"] = 5e-4  # the naive live change
    assert _step(opt, sched, p) == pytest.approx(5e-4)  # the next step uses it...
    assert _step(opt, sched, p) == pytest.approx(1e-3)  # ...then LambdaLR multiplies the old base_lrs again


def test_apply_lr_holds_for_the_next_step_and_after_scheduler_steps() -> None:
    opt, sched, p = _optimizer(1e-3)
    _step(opt, sched, p)
    assert apply.apply_lr(opt, sched, 5e-4) == pytest.approx(5e-4)
    assert sched.get_last_lr() == [pytest.approx(5e-4)]  # what verl logs as actor/lr
    assert [_step(opt, sched, p) for _ in range(3)] == [pytest.approx(5e-4)] * 3
    restored = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    restored.load_state_dict(opt.state_dict())  # what a verl checkpoint carries
    assert restored.param_groups[0]["initial_lr"] == pytest.approx(5e-4)


def test_apply_lr_mid_cosine_schedule_continues_the_schedule_at_the_new_peak() -> None:
    opt, sched, p = _optimizer(1e-3, warmup=2, cosine_steps=10)
    for _ in range(4):
        _step(opt, sched, p)
    apply.apply_lr(opt, sched, 2e-3)
    ref_opt, ref_sched, ref_p = _optimizer(2e-3, warmup=2, cosine_steps=10)  # as if 2e-3 from the start
    for _ in range(4):
        _step(ref_opt, ref_sched, ref_p)
    for _ in range(4):
        assert _step(opt, sched, p) == pytest.approx(_step(ref_opt, ref_sched, ref_p), rel=1e-9)


def test_apply_lr_refuses_a_scheduler_that_is_not_verls_lambdalr() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(LiveSettingError, match="StepLR.*restart"):
        apply.apply_lr(opt, sched, 5e-4, apply.CRITIC_LR)
    with pytest.raises(LiveSettingError, match="must be > 0"):
        apply.apply_lr(*_optimizer(1e-3)[:2], 0.0)


# -- loss coefficients: frozen ActorConfig through set_loss_fn -------------------------------


def test_actor_config_is_frozen_so_loss_coefs_go_through_a_new_loss_fn() -> None:
    cfg = _actor_config(use_kl_loss=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kl_loss_coef = 0.5  # type: ignore[misc]
    old = functools.partial(ppo_loss, config=cfg)
    new = apply.apply_loss_coefs(old, {apply.KL_LOSS_COEF: 0.05, apply.CLIP_RATIO: 0.1, apply.ENTROPY_COEFF: 0.01})
    c = new.keywords["config"]
    assert new.func is ppo_loss and isinstance(c, ActorConfig)
    assert (c.kl_loss_coef, c.entropy_coeff) == (0.05, 0.01)
    assert (c.clip_ratio, c.clip_ratio_low, c.clip_ratio_high) == (0.1, 0.1, 0.1)  # verl reads low/high first
    assert cfg.kl_loss_coef == 0.001 and cfg.clip_ratio_low == 0.2  # the old partial is untouched


def test_kl_loss_coef_is_refused_while_the_kl_loss_is_off() -> None:
    loss = functools.partial(ppo_loss, config=_actor_config(use_kl_loss=False))
    with pytest.raises(LiveSettingError, match="use_kl_loss is false"):
        apply.apply_loss_coefs(loss, {apply.KL_LOSS_COEF: 0.05})
    with pytest.raises(LiveSettingError, match="not an actor loss key"):
        apply.apply_loss_coefs(loss, {apply.ACTOR_LR: 0.05})


# -- the workers' registered methods ----------------------------------------------------------


@pytest.mark.parametrize("cls, method", [
    (WatchdogActorRolloutRefWorker, "watchdog_set_lr"),
    (WatchdogActorRolloutRefWorker, "watchdog_set_loss_coefs"),
    (WatchdogTrainingWorker, "watchdog_set_lr"),
    (WatchdogActorRolloutRefWorker, "watchdog_forget_saves_after"),
    (WatchdogTrainingWorker, "watchdog_forget_saves_after"),
])
def test_worker_methods_are_registered_with_verls_dispatch(cls: type, method: str) -> None:
    attrs = getattr(getattr(cls, method), MAGIC_ATTR)
    assert attrs["dispatch_mode"] is Dispatch.ONE_TO_ALL and attrs["blocking"] is True
    assert get_predefined_dispatch_fn(attrs["dispatch_mode"])["dispatch_fn"].__name__ == "dispatch_one_to_all"


def test_colocated_worker_class_exposes_the_methods_under_each_role() -> None:
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, create_colocated_worker_cls

    remote = create_colocated_worker_cls({
        "actor_rollout": RayClassWithInitArgs(cls=ray.remote(WatchdogActorRolloutRefWorker), config=None,
                                              role="actor_rollout"),
        "critic": RayClassWithInitArgs(cls=ray.remote(WatchdogTrainingWorker), config=None),
    })
    bound = remote.cls.__ray_actor_class__
    for name in ("actor_rollout_watchdog_set_lr", "actor_rollout_watchdog_set_loss_coefs", "critic_watchdog_set_lr"):
        assert getattr(getattr(bound, name), MAGIC_ATTR)["dispatch_mode"] is Dispatch.ONE_TO_ALL


def test_worker_group_call_changes_every_ranks_optimizer_and_loss_fn() -> None:
    actors = [_actor_worker(1e-6, use_kl_loss=True) for _ in range(2)]
    wg = LocalWorkerGroup(actors)
    assert wg.watchdog_set_lr(3e-6) == [pytest.approx(3e-6)] * 2
    assert wg.watchdog_set_loss_coefs({apply.KL_LOSS_COEF: 0.02}) == [{apply.KL_LOSS_COEF: 0.02}] * 2
    for w in actors:
        assert w.actor.engine.lr_scheduler.base_lrs == [pytest.approx(3e-6)]
        assert w.actor.loss_fn.keywords["config"].kl_loss_coef == 0.02  # what train_batch will use
        assert w.loss_fn is w.actor.loss_fn


def test_an_in_process_rollback_makes_every_rank_forget_the_abandoned_saves() -> None:
    actors = [_actor_worker(1e-6) for _ in range(2)]
    for w in actors:
        w.actor.engine.checkpoint_manager = SimpleNamespace(
            previous_saved_paths=[f"/c/global_step_{s}/actor" for s in (2, 4, 6)])
    assert LocalWorkerGroup(actors).watchdog_forget_saves_after(2) == [2, 2]
    assert all(w.actor.engine.checkpoint_manager.previous_saved_paths == ["/c/global_step_2/actor"] for w in actors)


# -- the trainer subclass -------------------------------------------------------------------


def test_trainer_is_registered_and_behaves_as_verls_sync_trainer(config: Any) -> None:
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from ppo_watchdog.trainer.verl_glue.taskrunner import TaskRunnerV1Class, WatchdogTaskRunner

    assert config.trainer.v1.trainer_mode == TRAINER_MODE
    cls = get_trainer_cls(TRAINER_MODE)
    assert cls is WatchdogPPOTrainer and issubclass(cls, PPOTrainerSync)
    assert issubclass(WatchdogTaskRunner.__ray_actor_class__, TaskRunnerV1Class)
    t = WatchdogPPOTrainer(config)
    assert t.trainer_mode == "sync" and type(t.replay_buffer) is ReplayBuffer
    t._init_resource_pool_mgr()
    classes = {getattr(c, "__ray_actor_class__", c) for c in t.role_worker_mapping.values()}
    assert classes == {WatchdogActorRolloutRefWorker, WatchdogTrainingWorker}


def test_live_keys_follow_the_runs_config(config: Any) -> None:
    assert set(apply.live_keys_for(config)) == set(apply.VERL_LIVE_KEYS)
    OmegaConf.update(config, "algorithm.use_kl_in_reward", False)
    OmegaConf.update(config, "actor_rollout_ref.actor.use_kl_loss", False)
    keys = apply.live_keys_for(config)
    assert apply.KL_COEF not in keys and apply.KL_LOSS_COEF not in keys and apply.ACTOR_LR in keys


# -- the step boundary: control.json ----------------------------------------------------------


def test_boundary_applies_a_control_version_once_to_verls_objects(rig: Rig) -> None:
    t = rig.trainer
    _write(rig.run_dir, 1, {apply.KL_COEF: 0.004, apply.ACTOR_LR: 5e-7, apply.CRITIC_LR: 2e-6,
                            apply.ACTOR_EPOCHS: 2, apply.KL_LOSS_COEF: 0.03})
    t.on_step_begin()
    t.on_step_begin()  # same version again: a no-op
    applied = rig.events("applied")
    assert len(applied) == 1 and applied[0]["version"] == 1 and applied[0]["step"] == 3
    assert applied[0]["applied"][apply.KL_COEF] == 0.004
    assert t.kl_ctrl_in_reward.value == 0.004
    assert all(w.actor.engine.lr_scheduler.base_lrs == [pytest.approx(5e-7)] for w in rig.actors)
    assert rig.critic.engine.lr_scheduler.base_lrs == [pytest.approx(2e-6)]
    assert all(w.actor.loss_fn.keywords["config"].kl_loss_coef == 0.03 for w in rig.actors)
    # the driver's config follows: verl reads epochs from it, a restart and run.json too
    assert t.config.actor_rollout_ref.actor.ppo_epochs == 2
    assert t.config.actor_rollout_ref.actor.optim.lr == 5e-7
    assert t.config.algorithm.kl_ctrl.kl_coef == 0.004
    _write(rig.run_dir, 2, {apply.KL_COEF: 0.004, apply.ACTOR_LR: 5e-7, apply.CRITIC_LR: 2e-6,
                            apply.ACTOR_EPOCHS: 2, apply.KL_LOSS_COEF: 0.03, apply.CLIP_RATIO: 0.1})
    t.global_steps = 6
    t.on_step_begin()
    assert [e["version"] for e in rig.events("applied")] == [1, 2]
    assert all(w.actor.loss_fn.keywords["config"].clip_ratio_high == 0.1 for w in rig.actors)
    events = rig.recorder.exporter.registry.get_sample_value("ppo_events_total", {"run": "glue-test", "kind": "applied"})
    assert events == 2


def test_boundary_records_one_error_for_a_garbled_control_file(rig: Rig) -> None:
    (rig.run_dir / rundir.CONTROL).write_text('{"version": 3, "overrides": {')
    rig.trainer.on_step_begin()
    rig.trainer.on_step_begin()
    errors = rig.events("error")
    assert len(errors) == 1 and "control.json" in errors[0]["message"] and "not JSON" in errors[0]["message"]
    assert rig.events("applied") == [] and rig.trainer.kl_ctrl_in_reward.value == 0.001


def test_boundary_refuses_a_version_with_a_key_verl_cannot_change_live(rig: Rig) -> None:
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    _write(rig.run_dir, 1, {key: 2, apply.KL_COEF: 0.004})
    rig.trainer.on_step_begin()
    (error,) = rig.events("error")
    assert key in error["message"] and error["keys"] == [key]
    assert rig.events("applied") == [] and rig.trainer.kl_ctrl_in_reward.value == 0.001


def test_boundary_reports_a_bad_value_and_applies_the_rest(rig: Rig) -> None:
    _write(rig.run_dir, 1, {apply.ACTOR_EPOCHS: 1.5, apply.KL_COEF: 0.002})
    rig.trainer.on_step_begin()
    (error,) = rig.events("error")
    assert apply.ACTOR_EPOCHS in error["message"] and error["version"] == 1
    (applied,) = rig.events("applied")
    assert applied["applied"] == {apply.KL_COEF: 0.002}


def test_boundary_commands_checkpoint_then_stop_and_leaves_rollback_to_a_restart(rig: Rig) -> None:
    _write(rig.run_dir, 1, commands=(Command("c1", "checkpoint"), Command("r1", "rollback")))
    rig.trainer.on_step_begin()
    assert rig.saves == [3]
    (applied,) = rig.events("applied")
    assert applied["commands"] == ["c1"]  # rollback unconfirmed: the watchdog restarts instead
    assert "rollback" in rig.events("error")[0]["message"]
    _write(rig.run_dir, 2, commands=(Command("c1", "checkpoint"), Command("s1", "stop")))
    with pytest.raises(StopRequested):
        rig.trainer.on_step_begin()
    assert rig.saves == [3, 3]  # c1 not run twice; stop saved
    assert [e["kind"] for e in rig.events()][-2:] == ["applied", "stopped"]


def test_a_rollback_the_trainer_cannot_restore_at_this_boundary_is_refused_with_why(rig: Rig) -> None:
    t = rig.trainer  # at the boundary before step 4
    t.total_training_steps = 20
    root = Path(t.config.trainer.default_local_dir).resolve()
    for args, why in (({"to_step": 0, "path": str(root)}, "the initial weights are a restart's"),
                      ({"to_step": 4, "path": str(root / "global_step_4")}, "is not before the step about to run"),
                      ({"to_step": 2, "path": "/elsewhere/global_step_2"}, "is not a checkpoint of step 2"),
                      ({"to_step": 2, "path": str(root / "global_step_2")}, "not a directory")):
        assert why in (t._check_rollback(args) or ""), args
    t.total_training_steps = 4
    assert "last step" in (t._check_rollback({"to_step": 2, "path": str(root / "global_step_2")}) or "")
    t.config.watchdog.rollback = "restart"
    assert t._restore_unsupported() == "launched with --rollback restart"


def test_pause_waits_between_steps_until_resume(rig: Rig) -> None:
    waits: list[float] = []

    def wait(seconds: float) -> bool:  # the watchdog's writes, one per poll of the paused trainer
        waits.append(seconds)
        if len(waits) == 1:
            _write(rig.run_dir, 2, {apply.KL_COEF: 0.003}, (Command("p1", "pause"),))
        elif len(waits) == 3:
            _write(rig.run_dir, 3, {apply.KL_COEF: 0.003},
                   (Command("p1", "pause"), Command("u1", "resume")))
        return False

    rig.boundary.steps.wait = wait
    _write(rig.run_dir, 1, commands=(Command("p1", "pause", {"reason": "test"}),))
    rig.trainer.on_step_begin()
    kinds = [e["kind"] for e in rig.events()]
    assert kinds == ["applied", "paused", "applied", "resumed", "applied"]
    assert rig.trainer.kl_ctrl_in_reward.value == 0.003  # overrides apply while paused
    assert len(waits) == 3


def test_restart_reapplies_the_newest_overrides_before_the_first_step(rig: Rig, config: Any) -> None:
    _write(rig.run_dir, 1, {apply.KL_COEF: 0.006, apply.ACTOR_LR: 4e-7})
    rig.trainer.on_step_begin()
    again = WatchdogPPOTrainer(copy.deepcopy(config))  # a relaunched trainer, fresh workers
    actors = [_actor_worker(1e-6, use_kl_loss=True)]
    again.actor_rollout_wg, again.critic_wg = LocalWorkerGroup(actors), LocalWorkerGroup([_critic_worker(1e-5)])
    settings = LiveSettings(VerlTargets(again.config, again.kl_ctrl_in_reward, again._set_lr, again._set_loss_coefs))
    boundary = ControlBoundary(rig.run_dir, settings, rig.recorder, save=lambda: None)
    assert boundary.start(4) == {apply.KL_COEF: 0.006, apply.ACTOR_LR: 4e-7}
    assert again.kl_ctrl_in_reward.value == 0.006 and actors[0].actor.engine.lr_scheduler.base_lrs == [4e-7]
    assert boundary.at_boundary(4) is None  # version 1 was applied before: nothing new


# -- metrics and the launcher ---------------------------------------------------------------


def test_recorder_writes_numeric_metrics_and_feeds_the_exporter(tmp_path: Path) -> None:
    with MetricsExporter("rec") as exporter:
        rec = RunRecorder(tmp_path, exporter)
        data = {"actor/reward_kl_penalty": np.float32(0.25), "actor/lr": torch.tensor(1e-6),
                "critic/score/mean": 1, "val-core/gsm8k/reward/mean@1": 0.5, "table": [1, 2], "name": "x"}
        written = rec.metrics(7, data)
        assert set(written) == {"actor/reward_kl_penalty", "actor/lr", "critic/score/mean",
                                "val-core/gsm8k/reward/mean@1"}
        (line,) = (tmp_path / rundir.METRICS).read_text().splitlines()
        assert json.loads(line)["step"] == 7 and json.loads(line)["data"]["actor/reward_kl_penalty"] == 0.25
        assert 'ppo_kl_mean{run="rec"} 0.25' in exporter.exposition()
        (val,) = rundir.iter_events(tmp_path, ["validation"])
        assert val["score"] == 0.5


def test_launcher_overrides_refuse_another_trainer_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=sync"):
        glue_overrides(["trainer.v1.trainer_mode=sync"], tmp_path)
    out = glue_overrides(["trainer.default_local_dir=/ckpt"], tmp_path)
    assert out[-1] == f"trainer.v1.trainer_mode={TRAINER_MODE}"
    assert not any(a.startswith("trainer.default_local_dir=" + str(tmp_path)) for a in out)


def test_composed_config_carries_the_run_dir_and_checkpoints_inside_it(verl_config: Any) -> None:
    run_dir = Path(verl_config.watchdog.run_dir)
    assert verl_config.trainer.default_local_dir == str(run_dir / rundir.CHECKPOINTS)
    assert OmegaConf.is_struct(verl_config)


def test_cli_prints_the_config_and_rejects_a_bad_override(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["--run-dir", str(tmp_path), "--print-config", "trainer.total_training_steps=3"])
    assert ok.exit_code == 0, ok.output
    assert f"trainer_mode: {TRAINER_MODE}" in ok.output and "total_training_steps: 3" in ok.output
    bad = runner.invoke(app, ["--run-dir", str(tmp_path), "trainer.no_such_key=1"])
    assert bad.exit_code == rundir.EXIT_USAGE and "no_such_key" in bad.output


def test_importing_trainer_never_loads_verl() -> None:
    code = ("import sys, trainer, ppo_watchdog.trainer.verl_glue, ppo_watchdog.trainer.verl_glue.apply, ppo_watchdog.trainer.verl_glue.runner; "
            "bad = [m for m in ('verl', 'ray', 'vllm') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gpu_smoke_checker_passes_a_conforming_run_and_catches_an_lr_that_snapped_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_gpu_smoke", REPO / "bench" / "verl_gpu_smoke.py")
    assert spec is not None and spec.loader is not None
    smoke = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "verl_gpu_smoke", smoke)  # its dataclasses look their module up
    spec.loader.exec_module(smoke)
    RunInfo(live_keys=list(apply.VERL_LIVE_KEYS)).write(tmp_path)
    rundir.append_event(tmp_path, "started", 0)
    rundir.append_event(tmp_path, "applied", 2, version=1, applied={apply.KL_COEF: 0.002}, commands=[])
    rundir.append_event(tmp_path, "applied", 3, version=2, applied={apply.KL_COEF: 0.002, apply.ACTOR_LR: 5e-7},
                        commands=[])
    rundir.append_event(tmp_path, "checkpoint", 3, path="x")
    rundir.append_event(tmp_path, "finished", 6)

    def write_metrics(lr_at_5: float) -> None:
        (tmp_path / rundir.METRICS).unlink(missing_ok=True)
        for step in range(1, 7):
            rundir.append_metrics(tmp_path, step, {
                "actor/reward_kl_penalty_coeff": 0.001 if step <= 2 else 0.002,
                "actor/lr": 1e-6 if step <= 3 else (lr_at_5 if step == 5 else 5e-7)})

    write_metrics(5e-7)
    assert all(c.ok for c in smoke.check_run(tmp_path)), smoke.check_run(tmp_path)
    write_metrics(1e-6)  # verl's trap: the scheduler put the old lr back
    failed = [c.name for c in smoke.check_run(tmp_path) if not c.ok]
    assert failed == ["actor/lr follows the change at step 3"]


def test_manifest_makes_a_verl_save_a_verified_checkpoint_and_catches_tampering(tmp_path: Path) -> None:
    from ppo_watchdog.protocol import checkpoint as ckpt
    from ppo_watchdog.trainer.verl_glue.manifest import write_manifest

    step_dir = tmp_path / "global_step_3"
    (step_dir / "actor").mkdir(parents=True)
    torch.save({"w": torch.arange(4)}, step_dir / "actor" / "model_world_size_1_rank_0.pt")
    torch.save({"sampler": 3}, step_dir / "data.pt")
    with pytest.raises(ckpt.CheckpointError, match="no manifest.json"):
        ckpt.verify_checkpoint(step_dir)
    write_manifest(step_dir, 3, 0)
    info = ckpt.verify_checkpoint(step_dir)
    assert (info.step, info.complete) == (3, True)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path) if c.complete] == [3]
    torch.save({"sampler": 4}, step_dir / "data.pt")
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        ckpt.verify_checkpoint(step_dir)


def test_a_worker_side_refusal_is_an_error_event_and_the_rest_applies(rig: Rig) -> None:
    for w in rig.actors:  # the workers' ActorConfig has the KL loss off, whatever the driver's config says
        w.loss_fn = functools.partial(ppo_loss, config=_actor_config(use_kl_loss=False))
    _write(rig.run_dir, 1, {apply.KL_LOSS_COEF: 0.05, apply.KL_COEF: 0.002})
    rig.trainer.on_step_begin()
    (error,) = rig.events("error")
    assert error["message"].startswith(f"{apply.KL_LOSS_COEF}=0.05: ") and "use_kl_loss is false" in error["message"]
    (applied,) = rig.events("applied")
    assert applied["applied"] == {apply.KL_COEF: 0.002}
