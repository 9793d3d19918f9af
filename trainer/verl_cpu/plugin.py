"""The module verl imports in every process it starts, to run on CPU (``VERL_USE_EXTERNAL_MODULES``).

verl 0.9.1's ``verl/__init__.py`` imports the modules named in ``VERL_USE_EXTERNAL_MODULES``
and picks its platform from ``VERL_PLATFORM``; with ``VERL_PLATFORM=cpu`` this module is all an
unmodified ``python -m verl.trainer.main_ppo`` needs on a GPU-less machine (with the overrides of
:mod:`ppo_watchdog.trainer.verl_cpu.overrides`). No file of verl is edited. What it does, each against the
verl 0.9.1 file and line it works around:

1. a ``cpu`` platform on gloo (platform_manager.py:114-117 falls back to ``nvidia``);
2. ``init_process_group`` given ``cpu:gloo,cpu:gloo`` (utils/distributed.py:63, :89 build
   ``cpu:gloo,{device}:{backend}``; torch rejects the duplicate pair): the duplicate is dropped;
3. the critic's ``load_valuehead_model`` hard-codes ``flash_attention_2`` (utils/model.py:649,
   :674): the same ``AutoModelForTokenClassification`` load with ``sdpa``;
4. the ref model's ``CPUOffloadPolicy(pin_memory=True)`` (workers/engine/fsdp/transformer_impl.py:462)
   cannot pin without an accelerator: ``pin_memory=False``;
5. verl's monkey patch imports trl's value-head class whenever trl is installed
   (models/transformers/monkey_patch.py:352-360); trl 1.16 has none: the guard asks for the class;
6. an ``hf`` async rollout (workers/rollout/base.py:89-92 and replica.py:388-390 register only
   vLLM/SGLang/TRT-LLM): :mod:`ppo_watchdog.trainer.verl_cpu.rollout`;
7. an aborted response (no tokens) fails its whole prompt group in the v1 trainer
   (experimental/agent_loop/agent_loop.py:147 indexes its last token for the reward) and never
   reaches ``response/aborted_ratio``: it is kept, with no reward token.

A patch whose target is gone (verl moved on) raises :class:`VerlPatchError` naming the file, what
it expected and the verl version, at import: a silent no-op would let the run fail later, far from
the cause.

**Fault injection** (named as such; every fault goes through verl's own code path), switched on by
environment variables, with ``VERL_CPU_INJECT_DIR`` holding one-shot markers:

- ``VERL_CPU_INJECT_OOM=STEP:MAX_MICRO``: a memory budget. From global step STEP on, verl's actor
  update (``ActorRolloutRefWorker.update_actor``, where a real CUDA OOM is raised) raises
  ``torch.OutOfMemoryError`` while ``actor.ppo_micro_batch_size_per_gpu`` is above MAX_MICRO;
- ``VERL_CPU_INJECT_NAN=STEP``: once, the actor's PPO loss at step STEP is NaN (the loss function
  verl's worker set, multiplied by NaN): verl's engine sees a non-finite grad norm, skips the
  optimizer step and logs it, as with a real NaN;
- ``VERL_CPU_INJECT_LR_SPIKE=STEP:FACTOR``: once, from global step STEP on, the actor's learning rate is
  FACTOR times what it was (every optimizer group's ``lr`` and the lr scheduler's ``base_lrs``, so the
  schedule keeps it and verl logs it as ``actor/lr``), for the rest of the process that reached STEP
  first: a mid-run lr blunder. A checkpoint saved after it carries it; a relaunch does not redo it;
- ``VERL_CPU_INJECT_ROLLOUT_FAIL=STEP``: once, the rollout server's ``generate`` raises at step STEP;
- ``VERL_CPU_INJECT_ROLLOUT_ABORT=STEP:SHARE``: from step STEP on, a share SHARE (0-1) of the rollout
  server's requests come back aborted: no tokens, ``stop_reason="aborted"``, what vLLM's server
  answers for a request it aborted (engine restart, timeout). verl scores them like any response
  and logs them itself (trainer/ppo/metric_utils.py:468, :511: ``response/aborted_ratio`` is the
  share of responses of length 0; ``critic/score/*`` and ``response_length_non_aborted/*`` leave
  them out). Every k-th request by a per-server counter, so the share is exact and repeatable.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TESTED_VERL = "0.9.1"
PLATFORM = "cpu"
INJECT_DIR_ENV = "VERL_CPU_INJECT_DIR"
INJECT_OOM_ENV = "VERL_CPU_INJECT_OOM"
INJECT_NAN_ENV = "VERL_CPU_INJECT_NAN"
INJECT_LR_ENV = "VERL_CPU_INJECT_LR_SPIKE"
INJECT_ROLLOUT_ENV = "VERL_CPU_INJECT_ROLLOUT_FAIL"
INJECT_ABORT_ENV = "VERL_CPU_INJECT_ROLLOUT_ABORT"
#: Set by the hf rollout on an aborted response's extra fields: whether the caller asked for log-probs.
ABORTED_LOGPROBS_FIELD = "_verl_cpu_aborted_logprobs"

#: The global step the worker is training (set by the rollout adapter at each weight sync: verl's
#: sync trainer syncs step N's weights after step N, so the next update is step N + 1).
CURRENT_STEP: list[int] = [0]


class VerlPatchError(RuntimeError):
    """What a fix of this plugin patches is not in the installed verl; names the file and version."""


def verl_version() -> str:
    """The installed verl's version (read from its file: verl may be half-imported here)."""
    try:
        import verl

        return str(getattr(verl, "__version__", None) or
                   (Path(verl.__file__).parent / "version" / "version").read_text().strip())
    except Exception:  # noqa: BLE001 - only used in messages
        return "unknown"


def require(cond: bool, where: str, what: str) -> None:
    """Fail loudly when verl no longer has what a fix works around."""
    if not cond:
        raise VerlPatchError(f"ppo_watchdog.trainer.verl_cpu (tested with verl {TESTED_VERL}) cannot patch verl "
                             f"{verl_version()}: {where}: {what}. Update trainer/verl_cpu for this verl.")


# -- post-import hooks: patch a verl module right after it is executed ------------------------

_AFTER: dict[str, list[Callable[[types.ModuleType], None]]] = {}


class _PatchFinder(importlib.abc.MetaPathFinder):
    """Wraps the real loader of a hooked module so its patches run once it has executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in _AFTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader, hooks = spec.loader, _AFTER.pop(name)
        run = loader.exec_module  # type: ignore[union-attr]

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            for fn in hooks:
                fn(module)

        loader.exec_module = exec_module  # type: ignore[union-attr,method-assign]
        return spec


def after_import(name: str, fn: Callable[[types.ModuleType], None]) -> None:
    """Run ``fn(module)`` when ``name`` has been imported (at once when it already is)."""
    if name in sys.modules:
        fn(sys.modules[name])
        return
    _AFTER.setdefault(name, []).append(fn)


# -- 1. the CPU platform ----------------------------------------------------------------------


class _CpuDevice(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes on its device module (no-ops on CPU)."""

    def __init__(self) -> None:
        super().__init__("ppo_watchdog.trainer.verl_cpu.device")

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"  # verl's flops table key for the host (utils/flops_counter.py:77-80)

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def manual_seed(seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device: Any = None) -> Any:
        import torch

        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: Any, device: Any = None) -> None:
        import torch

        torch.set_rng_state(state)


DEVICE = _CpuDevice()


def _register_platform(pm: Any) -> None:
    from contextlib import contextmanager

    require(hasattr(pm, "PlatformRegistry"), "verl/plugin/platform/platform_manager.py", "no PlatformRegistry")
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface on the host CPU: gloo, and one logical Ray "GPU" per rank."""

        device_name = "cpu"  # type: ignore[assignment]
        vendor_name = "cpu"  # type: ignore[assignment]

        @property
        def device_module(self) -> types.ModuleType:
            return DEVICE

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: Any) -> None:
            return None

        def synchronize(self, device_index: Any = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            DEVICE.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            DEVICE.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):  # type: ignore[no-untyped-def]
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            # verl's resource pool counts only GPU/NPU (single_controller/ray/base.py:146-148, :226-242):
            # each rank takes one logical Ray GPU (ray_init.num_gpus in the overrides).
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    abstract = sorted(getattr(PlatformCPU, "__abstractmethods__", ()))
    require(not abstract, "verl/plugin/platform/platform_base.py", f"new abstract members {abstract}")
    pm.PlatformRegistry.register(platform=PLATFORM)(PlatformCPU)


# -- 2. gloo twice ----------------------------------------------------------------------------


def _patch_init_process_group() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_verl_cpu", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "," in backend:
            pairs = list(dict.fromkeys(p.strip() for p in backend.split(",")))  # drops cpu:gloo,cpu:gloo's twin
            kwargs["backend"] = ",".join(pairs)
        return original(*args, **kwargs)

    init_process_group._verl_cpu = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


def _check_backend_string(mod: Any) -> None:
    src = inspect.getsource(mod.initialize_global_process_group_ray)
    require("cpu:gloo," in src, "verl/utils/distributed.py:89", "the 'cpu:gloo,{device}:{backend}' backend string")


# -- 3. the critic's value-head load ------------------------------------------------------------


def _patch_valuehead(mod: Any) -> None:
    original = getattr(mod, "load_valuehead_model", None)
    require(original is not None and "flash_attention_2" in inspect.getsource(original),
            "verl/utils/model.py:641-674", "load_valuehead_model hard-coding flash_attention_2")

    def load_valuehead_model(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation="sdpa", trust_remote_code=trust_remote_code)

    mod.load_valuehead_model = load_valuehead_model


# -- 3b. trl without its value head ---------------------------------------------------------------


def trl_has_value_head() -> bool:
    """Whether the installed trl still ships ``AutoModelForCausalLMWithValueHead`` (trl 1.x dropped it)."""
    import importlib

    for where in ("trl.experimental.ppo", "trl"):
        try:
            if hasattr(importlib.import_module(where), "AutoModelForCausalLMWithValueHead"):
                return True
        except ImportError:
            continue
    return False


def _patch_trl_check(mod: Any) -> None:
    # verl's apply_monkey_patch (models/transformers/monkey_patch.py:352-360) imports trl's value-head
    # class whenever trl is installed at all; trl 1.16 has none, so every model build raised ImportError.
    require(hasattr(mod, "is_trl_available") and "AutoModelForCausalLMWithValueHead" in inspect.getsource(mod),
            "verl/models/transformers/monkey_patch.py:26, :352-360", "is_trl_available() guarding trl's value head")
    mod.is_trl_available = trl_has_value_head


# -- 4. no pinned memory without an accelerator ---------------------------------------------------


def _patch_offload_policy(mod: Any) -> None:
    policy: Any = getattr(mod, "CPUOffloadPolicy", None)
    require(policy is not None, "verl/workers/engine/fsdp/transformer_impl.py:43, :462",
            "CPUOffloadPolicy(pin_memory=True) for the ref model")

    def cpu_offload_policy(*args: Any, **kwargs: Any) -> Any:
        kwargs["pin_memory"] = False
        return policy(*args, **kwargs)

    mod.CPUOffloadPolicy = cpu_offload_policy


# -- 5. the hf rollout --------------------------------------------------------------------------


def _register_rollout(mod: Any) -> None:
    reg: Any = getattr(mod, "_ROLLOUT_REGISTRY", None)
    require(isinstance(reg, dict) and ("vllm", "async") in reg, "verl/workers/rollout/base.py:89-92",
            "_ROLLOUT_REGISTRY keyed by (name, mode)")
    reg[("hf", "async")] = "ppo_watchdog.trainer.verl_cpu.rollout.HFServerAdapter"


def _register_replica(mod: Any) -> None:
    reg: Any = getattr(mod, "RolloutReplicaRegistry", None)
    require(reg is not None and hasattr(reg, "register"), "verl/workers/rollout/replica.py:366-390",
            "RolloutReplicaRegistry.register")

    def load() -> type:
        from ppo_watchdog.trainer.verl_cpu.rollout import HFReplica

        return HFReplica

    reg.register("hf", load)


# -- fault injection ----------------------------------------------------------------------------


def _once(name: str) -> bool:
    """True the first time a one-shot fault fires (a marker in VERL_CPU_INJECT_DIR), else False."""
    where = os.environ.get(INJECT_DIR_ENV)
    if not where:
        return True
    marker = Path(where) / f"{name}.fired"
    try:
        Path(where).mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def oom_budget() -> tuple[int, int] | None:
    """``(step, max_micro)`` of VERL_CPU_INJECT_OOM, or None."""
    raw = os.environ.get(INJECT_OOM_ENV)
    if not raw:
        return None
    step, _, micro = raw.partition(":")
    return int(step), int(micro or 0)


def lr_spike() -> tuple[int, float] | None:
    """``(step, factor)`` of VERL_CPU_INJECT_LR_SPIKE, or None."""
    raw = os.environ.get(INJECT_LR_ENV)
    if not raw:
        return None
    step, _, factor = raw.partition(":")
    return int(step), float(factor)


#: Whether this process already multiplied its lr (without VERL_CPU_INJECT_DIR there is no marker).
_SPIKED: list[bool] = [False]


def spike_lr(engine: Any, step: int) -> None:
    """Multiply the engine's lr by the spike's factor, once, from the spike's step on (see the module doc)."""
    spike = lr_spike()
    if spike is None or step < spike[0] or _SPIKED[0] or not _once(f"lrspike.rank{os.environ.get('RANK', '0')}"):
        return
    _SPIKED[0] = True
    for group in engine.optimizer.param_groups:
        group["lr"] *= spike[1]
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None:
        scheduler.base_lrs = [lr * spike[1] for lr in scheduler.base_lrs]
    log.warning("injected: lr x%g from step %d", spike[1], step)


def _step_env(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw else None


def _patch_injection(mod: Any) -> None:
    cls: Any = getattr(mod, "ActorRolloutRefWorker", None)
    require(cls is not None and hasattr(cls, "update_actor"), "verl/workers/engine_workers.py:707-712",
            "ActorRolloutRefWorker.update_actor")
    original = cls.update_actor

    @functools.wraps(original)
    def update_actor(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = CURRENT_STEP[0]
        budget = oom_budget()
        if budget is not None and step >= budget[0]:
            micro = int(self.config.actor.ppo_micro_batch_size_per_gpu or 0)
            if micro > budget[1]:
                import torch

                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by ppo_watchdog.trainer.verl_cpu: "
                    f"{INJECT_OOM_ENV} allows ppo_micro_batch_size_per_gpu <= {budget[1]}, got {micro} at step {step})")
        spike_lr(self.actor.engine, step)
        nan_at = _step_env(INJECT_NAN_ENV)
        if nan_at is not None and step == nan_at and _once(f"nan.step{nan_at}.rank{os.environ.get('RANK', '0')}"):
            worker = self.actor
            loss_fn = worker.loss_fn

            def nan_loss(*a: Any, **k: Any) -> Any:
                loss, metrics = loss_fn(*a, **k)
                return loss * float("nan"), metrics

            log.warning("injected: NaN actor loss at step %d", step)
            worker.set_loss_fn(nan_loss)
            try:
                return original(self, *args, **kwargs)
            finally:
                worker.set_loss_fn(loss_fn)
        return original(self, *args, **kwargs)

    cls.update_actor = update_actor


def rollout_should_fail(step: int) -> bool:
    """VERL_CPU_INJECT_ROLLOUT_FAIL: True once, for a generate call at that step."""
    at = _step_env(INJECT_ROLLOUT_ENV)
    return at is not None and step == at and _once(f"rollout.step{at}")


def abort_schedule() -> tuple[int, float] | None:
    """``(step, share)`` of VERL_CPU_INJECT_ROLLOUT_ABORT, or None; a clear error on a bad value."""
    raw = os.environ.get(INJECT_ABORT_ENV)
    if not raw:
        return None
    step, _, share = raw.partition(":")
    try:
        at, frac = int(step), float(share or 1.0)
    except ValueError:
        raise ValueError(f"{INJECT_ABORT_ENV}={raw!r}: expected STEP:SHARE, e.g. 20:0.5") from None
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"{INJECT_ABORT_ENV}={raw!r}: SHARE must be in (0, 1]")
    return at, frac


def rollout_should_abort(step: int, request_no: int) -> bool:
    """VERL_CPU_INJECT_ROLLOUT_ABORT: True for the aborted share of requests from that step on.

    ``request_no`` counts the server's requests from 0; request n is aborted when the running count
    of aborted requests, ``floor((n + 1) * share)``, goes up at n (an even spread, exactly ``share``)."""
    sched = abort_schedule()
    if sched is None or step < sched[0]:
        return False
    share = sched[1]
    return int((request_no + 1) * share) > int(request_no * share)


def _patch_aborted_output(mod: Any) -> None:
    """An aborted response (no tokens) reaches the batch, as verl's metrics expect, instead of failing its prompt.

    verl 0.9.1 puts a response's reward on its last token (experimental/agent_loop/agent_loop.py:144-147,
    ``rm_scores[-1] = reward_score``), which raises IndexError for a response of no tokens: the v1
    trainer then marks the whole prompt group failed and drops it (trainer/ppo/v1/agent_loop_tq.py:
    133-143), so ``response/aborted_ratio`` (trainer/ppo/metric_utils.py:468, :511), computed over
    the responses of length 0, would never see one. With no token to carry it, the reward of an
    empty response is dropped (an empty ``rm_scores``); the sample stays, of length 0. The same
    IndexError meets a real engine's aborted request on this path; here it is reached through the
    injected aborts of VERL_CPU_INJECT_ROLLOUT_ABORT."""
    cls: Any = getattr(mod, "AgentLoopOutput", None)
    require(cls is not None and callable(getattr(cls, "as_dict", None)),
            "verl/experimental/agent_loop/agent_loop.py:116-160", "AgentLoopOutput.as_dict")
    original = cls.as_dict

    @functools.wraps(original)
    def as_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = self.extra_fields.pop(ABORTED_LOGPROBS_FIELD, None)
        if len(self.response_ids) > 0:
            return original(self, *args, **kwargs)
        import torch

        # The loop turns an empty log-prob list into None (single_turn_agent_loop.py:88-89); the batch
        # then lacks rollout_log_probs for this sample alone (KeyError in the actor update).
        if wanted and self.response_logprobs is None:
            self.response_logprobs = []
        score, self.reward_score = self.reward_score, None
        try:
            out = original(self, *args, **kwargs)
        finally:
            self.reward_score = score
        if score is not None:
            out["rm_scores"] = torch.zeros(0, dtype=torch.float32)
        return out

    cls.as_dict = as_dict


# -- install -------------------------------------------------------------------------------------


def install() -> None:
    """Register everything; idempotent. verl calls it by importing this module."""
    if any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PatchFinder())
    _patch_init_process_group()
    after_import("verl.plugin.platform.platform_manager", _register_platform)
    after_import("verl.utils.distributed", _check_backend_string)
    after_import("verl.utils.model", _patch_valuehead)
    after_import("verl.models.transformers.monkey_patch", _patch_trl_check)
    after_import("verl.workers.engine.fsdp.transformer_impl", _patch_offload_policy)
    after_import("verl.workers.rollout.base", _register_rollout)
    after_import("verl.workers.rollout.replica", _register_replica)
    after_import("verl.workers.engine_workers", _patch_injection)
    after_import("verl.experimental.agent_loop.agent_loop", _patch_aborted_output)


install()
