"""An ``hf`` async rollout for verl on CPU: HF ``generate`` behind verl's token-in-token-out server API.

verl 0.9.x registers only vLLM, SGLang and TRT-LLM rollouts (workers/rollout/base.py:89-92,
replica.py:388-390); its ``hf_rollout.py`` / ``naive_rollout.py`` are dead code (old constructor,
removed sync API; ``rollout.mode=sync`` is refused at workers/config/rollout.py:281-284). Three
pieces, registered as ``("hf", "async")`` by :mod:`ppo_watchdog.trainer.verl_cpu.plugin`:

- :class:`HFServer`, a Ray actor holding an fp32 copy of the policy that answers verl's agent loop
  (``generate(prompt_ids, sampling_params, request_id) -> TokenOutput``: temperature, top_p, top_k,
  max_tokens, the eos cut, log-probs of the sampled tokens), ``load_weights`` and
  ``set_global_steps``, with the memory calls (wake_up, sleep, kv cache, abort) as no-ops; under verl's
  ``rollout.full_determinism`` each sample's draw is seeded by its place in the batch and the step
  (:func:`sampling_seed`), so a step samples the same answers for the same weights whatever the order
  the requests arrive in, which replica serves them, or what the server sampled before;
- :class:`HFReplica`, the ``RolloutReplica`` whose ``launch_servers`` starts one per replica;
- :class:`HFServerAdapter`, the ``BaseRollout`` in verl's FSDP worker: its ``update_weights``
  consumes the engine's full-tensor generator and pushes the weights to the server, so every
  rollout samples the policy the actor just trained (verl's naive weight sync).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np
import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from ppo_watchdog.trainer.verl_cpu import plugin

log = logging.getLogger(__name__)


def server_name(replica_rank: int) -> str:
    """The Ray actor name of a replica's server (the adapter finds it by name)."""
    return f"hf_server_{replica_rank}_0"


def sampling_seed(seed: int, step: int, request_id: str) -> int | None:
    """The seed of one sample's draw under verl's ``rollout.full_determinism``, or None without it.

    verl then names each request by its sample's index in the batch (``det-<priority>``,
    agent_loop/single_turn_agent_loop.py); that index, the rollout seed and the step mix into one seed
    (numpy's ``SeedSequence``), so no two samples of a step share a draw and the same sample of the same
    step always gets the same one, whatever happened before it: a relaunch from a checkpoint and a
    rollback inside the running trainer sample a restored step alike.
    """
    kind, _, index = request_id.partition("-")
    if kind != "det" or not index.isdigit():
        return None
    return int(np.random.SeedSequence([seed, step, int(index)]).generate_state(1)[0])


class HFServer:
    """One rollout replica: a Hugging Face causal LM sampling one request at a time."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        # verl's rollout seed (rollout.seed, vLLM's sampling seed): the same seed samples the same
        # answers for the same weights (one request at a time, under the lock below); under
        # full_determinism each request is seeded on its own (sampling_seed).
        self.seed = int(getattr(config, "seed", 42) or 0)
        self.full_determinism = bool(getattr(config, "full_determinism", False))
        torch.manual_seed(self.seed + int(replica_rank))
        self.config = config
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config.path
        self.model: Any = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        gen = self.model.generation_config
        self.eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        self.pad = gen.pad_token_id if gen.pad_token_id is not None else self.eos[0]
        self.max_len = int(config.prompt_length) + int(config.response_length)
        self.global_steps: int | None = None
        self.requests = 0  # counts generate calls, for the injected abort share
        self.lock = asyncio.Lock()

    def _generate(self, prompt_ids: list[int], params: dict[str, Any],
                  seed: int | None = None) -> tuple[list[int], list[float], str]:
        if seed is not None:
            torch.manual_seed(seed)
        temperature = float(params.get("temperature", 1.0) or 0.0)
        room = self.max_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room within {self.max_len}")
        max_tokens = max(1, min(int(params.get("max_tokens") or self.config.response_length), room))
        top_k = int(params.get("top_k", -1) or -1)
        kwargs: dict[str, Any] = dict(max_new_tokens=max_tokens, do_sample=temperature > 0, eos_token_id=self.eos,
                                      pad_token_id=self.pad, output_logits=True, return_dict_in_generate=True)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=float(params.get("top_p", 1.0)), top_k=top_k if top_k > 0 else 0)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.no_grad():
            out: Any = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        logps: list[float] = []
        for i, tok in enumerate(tokens):
            logits = out.logits[i][0].float()
            # The actor scores sampled tokens at the rollout temperature: compare like with like.
            logps.append(float(torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)[tok]))
        reason = "stop"
        for i, tok in enumerate(tokens):
            if tok in self.eos:
                tokens, logps = tokens[: i + 1], logps[: i + 1]
                break
        else:
            reason = "length"
        return tokens, logps, reason

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        """verl's token-in-token-out call (the vLLM server's signature, multimodal inputs ignored)."""
        step = (self.global_steps or 0) + 1
        if plugin.rollout_should_fail(step):
            raise RuntimeError(f"rollout failed (injected by ppo_watchdog.trainer.verl_cpu: {plugin.INJECT_ROLLOUT_ENV}={step})")
        n, self.requests = self.requests, self.requests + 1
        want_logprobs = bool(sampling_params.get("logprobs", False)) or sampling_params.get("logprobs") == 0
        if plugin.rollout_should_abort(step, n):
            # vLLM's answer to an aborted request: no tokens; verl counts it in response/aborted_ratio.
            return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted",
                               extra_fields={"global_steps": self.global_steps,
                                             plugin.ABORTED_LOGPROBS_FIELD: want_logprobs})
        params = dict(sampling_params)
        want_logprobs = bool(params.pop("logprobs", False)) or params.get("logprobs") == 0
        seed = sampling_seed(self.seed, step, request_id) if self.full_determinism else None
        async with self.lock:
            tokens, logps, _ = await asyncio.to_thread(self._generate, list(map(int, prompt_ids)), params, seed)
        return TokenOutput(token_ids=tokens, log_probs=logps if want_logprobs else None, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    async def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load the actor's full tensors (HF names); returns how many matched."""
        own = self.model.state_dict()
        sd = {k: v.to(own[k].dtype) for k, v in named if k in own}
        unknown = [k for k, _ in named if k not in own]
        if not sd or unknown:
            raise RuntimeError(f"weight sync: {len(sd)} tensors matched the rollout model, unknown: {unknown[:5]}")
        self.model.load_state_dict(sd, strict=False)
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        return len(sd)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # Memory management and request control: nothing to free or abort on CPU, one request at a time.
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        return {}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """A rollout replica served by :class:`HFServer`."""

    async def launch_servers(self) -> None:
        """Start this replica's server actor (one node, no HTTP: token in, token out over Ray)."""
        server: Any = ray.remote(HFServer).options(
            name=server_name(self.replica_rank), max_concurrency=self.max_concurrency, num_cpus=0,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = "127.0.0.1:0"  # no OpenAI endpoint: tool agents need vLLM/SGLang


class HFServerAdapter(BaseRollout):
    """The rollout seen from verl's FSDP worker: weight sync to the replica's :class:`HFServer`."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size * \
            self.config.pipeline_model_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.owner = rank % world == 0
        self.sleep_level = 1

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Push the engine's full tensors to the server; note the step for fault injection."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout: wire_format {wire_format!r} (only named_tensors)")
        named = [(name, t.detach().to("cpu", torch.float32).clone()) for name, t in weights]
        steps = kwargs.get("global_steps")
        if steps is not None:
            plugin.CURRENT_STEP[0] = int(steps) + 1
        if not self.owner:
            return
        server = ray.get_actor(server_name(self.replica_rank))
        await server.load_weights.remote(named)
        if steps is not None:
            await server.set_global_steps.remote(int(steps))
