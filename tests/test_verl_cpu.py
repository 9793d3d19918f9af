"""trainer/verl_cpu's plugin against the installed verl: every fix finds what it patches, and a verl
that no longer has it is refused loudly, naming the file and the version (no verl run here: see
tests/test_verl_e2e.py for that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("verl")

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, verl
from verl.plugin.platform.platform_manager import get_platform
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class
import verl.utils.model as model
import verl.models.transformers.monkey_patch as mp
import verl.workers.engine.fsdp.transformer_impl as impl
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
p = get_platform()
print(json.dumps({
    "device": get_device_name(), "backend": get_nccl_backend(), "resource": p.ray_resource_name(),
    "rollout": get_rollout_class("hf", "async").__name__, "replica": get_rollout_replica_class("hf").__name__,
    "valuehead": model.load_valuehead_model.__module__, "trl_check": mp.is_trl_available.__module__,
    "offload": impl.CPUOffloadPolicy.__module__, "injection": hasattr(ActorRolloutRefWorker.update_actor, "__wrapped__"),
    "empty_cache": get_torch_device().empty_cache() is None,
    "aborted_output": hasattr(AgentLoopOutput.as_dict, "__wrapped__"),
}))
"""


def test_the_plugin_loaded_by_verl_registers_the_cpu_platform_the_hf_rollout_and_every_fix() -> None:
    from ppo_watchdog.trainer.verl_cpu import overrides

    env = overrides.verl_env()
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["device"] == "cpu" and got["backend"] == "gloo" and got["resource"] == "GPU"
    assert got["rollout"] == "HFServerAdapter" and got["replica"] == "HFReplica"
    plugin = "ppo_watchdog.trainer.verl_cpu.plugin"
    assert got["valuehead"] == got["trl_check"] == got["offload"] == plugin
    assert got["injection"] and got["empty_cache"] and got["aborted_output"]


def test_a_verl_without_what_a_fix_patches_is_refused_naming_the_file_and_the_version() -> None:
    from ppo_watchdog.trainer.verl_cpu import plugin

    for patch, where in ((plugin._patch_valuehead, "verl/utils/model.py"),
                         (plugin._patch_offload_policy, "transformer_impl.py"),
                         (plugin._register_rollout, "verl/workers/rollout/base.py"),
                         (plugin._patch_injection, "verl/workers/engine_workers.py"),
                         (plugin._patch_aborted_output, "verl/experimental/agent_loop/agent_loop.py")):
        with pytest.raises(plugin.VerlPatchError) as err:
            patch(types.SimpleNamespace())
        assert where in str(err.value) and plugin.TESTED_VERL in str(err.value)


def test_the_oom_budget_and_one_shot_faults_read_their_environment(tmp_path: Path, monkeypatch) -> None:
    from ppo_watchdog.trainer.verl_cpu import plugin

    monkeypatch.setenv(plugin.INJECT_OOM_ENV, "8:1")
    assert plugin.oom_budget() == (8, 1)
    monkeypatch.setenv(plugin.INJECT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(plugin.INJECT_ROLLOUT_ENV, "4")
    assert not plugin.rollout_should_fail(3)
    assert plugin.rollout_should_fail(4) and not plugin.rollout_should_fail(4)  # once: a marker in the dir
    assert os.listdir(tmp_path) == ["rollout.step4.fired"]


def test_injected_aborted_rollouts_are_an_exact_even_share_from_their_step_on(monkeypatch) -> None:
    from ppo_watchdog.trainer.verl_cpu import plugin

    monkeypatch.setenv(plugin.INJECT_ABORT_ENV, "15:0.6")
    assert plugin.abort_schedule() == (15, 0.6)
    assert not any(plugin.rollout_should_abort(14, n) for n in range(40))
    aborted = [plugin.rollout_should_abort(15, n) for n in range(40)]
    assert sum(aborted) == 24 and sum(aborted[:5]) == 3  # 60%, spread evenly: every batch of 16 loses ~10
    for bad in ("x:0.5", "15:0", "15:1.5"):
        monkeypatch.setenv(plugin.INJECT_ABORT_ENV, bad)
        with pytest.raises(ValueError, match=plugin.INJECT_ABORT_ENV):
            plugin.abort_schedule()


def test_an_injected_lr_spike_multiplies_the_real_optimizers_lr_once_and_the_schedule_keeps_it(
        tmp_path: Path, monkeypatch) -> None:
    """The spike goes into the optimizer's groups and verl's own lr schedule (constant with warmup, what
    verl builds): after the scheduler steps on, the lr it reports (what verl logs as actor/lr) is still x100;
    before its step, or in a second process of the same run (the marker), nothing changes."""
    import torch
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    from ppo_watchdog.trainer.verl_cpu import plugin

    monkeypatch.setenv(plugin.INJECT_LR_ENV, "10:100")
    monkeypatch.setenv(plugin.INJECT_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(plugin, "_SPIKED", [False])
    assert plugin.lr_spike() == (10, 100.0)

    def engine() -> types.SimpleNamespace:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-4)
        return types.SimpleNamespace(optimizer=opt, lr_scheduler=get_constant_schedule_with_warmup(opt, 0))

    e = engine()
    plugin.spike_lr(e, 9)
    assert e.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)
    plugin.spike_lr(e, 10)
    plugin.spike_lr(e, 11)  # once per process
    e.optimizer.step()
    e.lr_scheduler.step()
    assert e.lr_scheduler.get_last_lr()[0] == pytest.approx(3e-2)
    monkeypatch.setattr(plugin, "_SPIKED", [False])  # a relaunch: a new process, the run's marker is there
    again = engine()
    plugin.spike_lr(again, 12)
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)


def test_under_full_determinism_the_hf_rollout_samples_each_request_by_its_place_not_its_turn(tmp_path: Path) -> None:
    """verl's ``rollout.full_determinism`` names each request ``det-<its index in the batch>``: the hf server
    then draws each one from its own seed, so the same step's samples come out the same in any arrival order and
    after any other draws (what a rollback in process and a relaunch must share); two samples of one prompt
    still differ, and without the option the server's one stream goes on as before."""
    import asyncio

    from ppo_watchdog.trainer.verl_cpu import assets
    from ppo_watchdog.trainer.verl_cpu.rollout import HFServer, sampling_seed

    assets.build_model(tmp_path / "model")
    prompt = [int(t) for t in range(20, 28)]
    params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6, "logprobs": True}

    def server(deterministic: bool) -> HFServer:
        config = types.SimpleNamespace(seed=7, full_determinism=deterministic, prompt_length=16, response_length=8)
        s = HFServer(config, types.SimpleNamespace(path=str(tmp_path / "model")), replica_rank=0)
        asyncio.run(s.set_global_steps(4))
        return s

    def sample(s: HFServer, ids: list[str]) -> dict[str, list[int]]:
        return {i: asyncio.run(s.generate(prompt, params, request_id=i)).token_ids for i in ids}

    first = sample(server(True), ["det-0", "det-1", "det-2"])
    other = server(True)
    sample(other, ["det-9"])  # draws the server made before: another step's, validation's
    again = sample(other, ["det-2", "det-0", "det-1"])
    assert again == first
    assert len({tuple(t) for t in first.values()}) == 3  # one prompt, three samples: three draws
    assert sampling_seed(7, 5, "det-0") != sampling_seed(7, 4, "det-0")  # the next step draws anew
    assert sampling_seed(7, 5, "0123abcd") is None  # verl's uuid request ids: no per-request seed
    plain = server(False)
    assert sample(plain, ["det-0"]) != sample(plain, ["det-0"])  # one stream, as without the option
