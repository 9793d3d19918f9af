"""What an out-of-memory error looks like in verl's output, and which of verl's passes raised it.

An ``oom`` event carries ``memory`` (``cuda`` or ``host``) and, when the traceback says so,
``site``: the pass that ran out, because each has its own knob in verl 0.9.1 and lowering the
PPO micro batch cures none but one of them:

==============  ====================================================================
site            where it ran out (the Ray method the driver called, or the frames)
==============  ====================================================================
actor_update    the policy update (``update_actor``)
critic_update   the value update (``train_mini_batch`` / ``update_critic`` of the critic)
critic_values   the critic's forward over the batch (``infer_batch`` / ``compute_values``)
log_prob        the old-policy log-probs (``compute_log_prob``)
ref_log_prob    the reference policy's log-probs (``compute_ref_log_prob``)
rollout         generation: vLLM / SGLang (``generate_sequences``, the rollout servers, ``wake_up``)
==============  ====================================================================

The text patterns are those of the installed torch and Ray: a CUDA OOM in a worker reaches the
driver as ``ray.exceptions.RayTaskError(OutOfMemoryError): ray::WorkerDict.actor_rollout_ref_update_actor()``
over ``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...``; Ray's memory monitor
killing a worker is an ``ActorDiedError`` whose exit type is ``NODE_OUT_OF_MEMORY``, or Ray's own
``ray.exceptions.OutOfMemoryError``. Host markers are checked first because
``RayTaskError(OutOfMemoryError)`` also wraps Ray's own error. Pure text in, names out; the
trainer side (:mod:`ppo_watchdog.trainer.verl_glue.runner`) and the watchdog's zero-patch glue
(:mod:`ppo_watchdog.backends.verl_exits`) read OOMs with the same rules.
"""

from __future__ import annotations

import re

SITES = ("actor_update", "critic_update", "critic_values", "log_prob", "ref_log_prob", "rollout")

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_METRIC_LINE = re.compile(r"(?<![\w/.@-])step:\d+\s+-\s")

HOST = re.compile(
    r"Worker exit type: NODE_OUT_OF_MEMORY"
    r"|worker\(s\) were killed due to the node running low on memory"
    r"|Memory on the node \(IP: [^)]*\) was "
    r"|ray\.exceptions\.OutOfMemoryError"
)
CUDA = re.compile(
    r"CUDA out of memory\. Tried to allocate"
    r"|CUDA error: out of memory"
    r"|torch\.(?:cuda\.)?OutOfMemoryError"
    r"|RayTaskError\(OutOfMemoryError\)"
)
# ``ray::WorkerDict.actor_rollout_ref_update_actor()`` (a colocated worker: role prefix) or
# ``ray::ActorRolloutRefWorker.update_actor()``.
_RAY_CALL = re.compile(r"ray::(?P<cls>[\w.]+)\.(?P<method>\w+)\(")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+, in (?P<func>\w+)')
#: How many lines before the OOM line belong to its traceback, at most.
_WINDOW = 200


def clean_lines(text: str) -> list[str]:
    """The text's lines without colour codes, blank lines and verl's console metric lines
    (``step:3 - critic/vf_loss:nan ...`` is a number, not an exit reason)."""
    out = []
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.rstrip()
        if line and not _METRIC_LINE.search(line):
            out.append(line)
    return out


def find_last(pattern: re.Pattern[str], lines: list[str]) -> int | None:
    """Index of the last line matching ``pattern``, or None."""
    for i in range(len(lines) - 1, -1, -1):
        if pattern.search(lines[i]):
            return i
    return None


def memory_of(lines: list[str]) -> tuple[str, int] | None:
    """``(memory, index of the evidence line)`` of the last OOM in ``lines``: host first, then cuda."""
    host = find_last(HOST, lines)
    if host is not None:
        return "host", host
    cuda = find_last(CUDA, lines)
    if cuda is not None:
        return "cuda", cuda
    return None


def _site_of_call(cls: str, method: str) -> str | None:
    m, c = method.lower(), cls.lower()
    critic = "critic" in m or "critic" in c or c.endswith("trainingworker")
    if "compute_ref_log_prob" in m:
        return "ref_log_prob"
    if m.endswith("compute_log_prob"):
        return "log_prob"
    if "update_actor" in m:
        return "actor_update"
    if critic and ("train_mini_batch" in m or "update_critic" in m):
        return "critic_update"
    if critic and ("infer_batch" in m or "compute_values" in m):
        return "critic_values"
    if ("generate" in m or "wake_up" in m or "rollout" in c or "vllm" in c or "sglang" in c
            or "agentloop" in c or "server" in c):
        return "rollout"
    return None


def _site_of_frames(frames: list[tuple[str, str]]) -> str | None:
    # Innermost first: the frame that ran out decides.
    for file, func in reversed(frames):
        f = file.replace("\\", "/")
        if "/vllm/" in f or "/sglang/" in f:
            return "rollout"
        if func in ("compute_ref_log_prob",):
            return "ref_log_prob"
        if func in ("update_policy", "update_actor"):
            return "actor_update"
        if func in ("update_critic",) or ("critic" in f and func in ("train_mini_batch", "train_batch")):
            return "critic_update"
        if func in ("compute_values",):
            return "critic_values"
        if func in ("compute_log_prob",):
            return "log_prob"
        if func in ("generate_sequences", "wake_up"):
            return "rollout"
    return None


def site_of(lines: list[str], at: int | None = None) -> str | None:
    """The pass that ran out of memory (one of :data:`SITES`), from the traceback ending at line
    ``at`` (default: the last OOM line); None when the text does not say."""
    if at is None:
        found = memory_of(lines)
        if found is None:
            return None
        at = found[1]
    window = lines[max(0, at - _WINDOW): at + 1]
    # The nearest Ray call before the OOM line names the worker method the driver was waiting on.
    for line in reversed(window):
        for call in reversed(list(_RAY_CALL.finditer(line))):
            site = _site_of_call(call.group("cls"), call.group("method"))
            if site is not None:
                return site
    frames = [(f.group("file"), f.group("func")) for line in window if (f := _FRAME.search(line))]
    return _site_of_frames(frames)


def read_oom(text: str) -> tuple[str, str | None, str] | None:
    """``(memory, site, evidence line)`` of the last OOM in ``text``, or None when it holds none."""
    lines = clean_lines(text)
    found = memory_of(lines)
    if found is None:
        return None
    memory, at = found
    return memory, site_of(lines, at), lines[at].strip()
