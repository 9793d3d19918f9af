"""The run-directory protocol: the only coupling between a trainer and the watchdog.

::

    run_dir/
      run.json          id, command, config snapshot, pid, live-settable keys, and the one-shot
                        commands done in process ("commands"; all of COMMAND_KINDS when absent)
      metrics.jsonl     {"step": N, "data": {...}}  (verl FileLogger format), one line a step
      events.jsonl      {"ts": ..., "step": N, "kind": "...", ...}
      control.json      {"version": 7, "overrides": {...}, "commands": [{"id": ..., "kind": ...}]}
      checkpoints/      global_step_N/ + manifest.json, latest_checkpointed_iteration.txt

Writers append whole lines (JSONL) or replace whole files atomically (JSON), so a
reader never sees half a record except possibly an unterminated last line, which
:func:`read_jsonl` leaves for the next read. This module does file I/O only; it
imports nothing heavy so both the trainer and the watchdog use it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
CONTROL = "control.json"
CHECKPOINTS = "checkpoints"
LATEST_MARKER = "latest_checkpointed_iteration.txt"  # verl's own marker file

#: Event kinds a trainer records in events.jsonl.
EVENT_KINDS = frozenset(
    {
        "started", "finished", "checkpoint", "oom", "nan", "applied", "error",
        "paused", "resumed", "rollback", "stopped", "fault", "validation",
    }
)

#: One-shot commands the watchdog can put in control.json.
COMMAND_KINDS = frozenset({"checkpoint", "pause", "resume", "stop", "rollback"})

#: Config keys (verl's Hydra names) the embedded trainer can change at a step boundary.
LIVE_KEYS = (
    "algorithm.kl_ctrl.kl_coef",
    "actor_rollout_ref.actor.optim.lr",
    "critic.optim.lr",
    "actor_rollout_ref.actor.ppo_epochs",
    "critic.ppo_epochs",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
)

#: Exit code of a trainer that stopped after a CUDA/CPU out-of-memory error (state saved).
EXIT_OOM = 75
#: Exit code of a trainer stopped by a ``stop`` command or SIGTERM after saving.
EXIT_STOPPED = 0
#: Exit code of a trainer that rejected its configuration before training (unknown key, bad
#: value): relaunching the same command cannot help, so a supervisor gives up instead of retrying.
EXIT_USAGE = 2


class PathError(ValueError):
    """A file or directory that cannot be used; the message is ``path: reason``."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        """The file or directory at fault."""
        self.reason = reason
        """What is wrong, in words."""


class ControlError(PathError):
    """control.json is not a valid control document; carries the path and the reason."""


@dataclass(frozen=True)
class Command:
    """A one-shot command (applied once, identified by ``id``)."""

    id: str
    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, **self.args}


@dataclass(frozen=True)
class Control:
    """Desired state written by the watchdog: overrides plus one-shot commands."""

    version: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    commands: tuple[Command, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "overrides": dict(self.overrides),
            "commands": [c.to_json() for c in self.commands],
        }


def parse_control(text: str, path: Path | str = CONTROL) -> Control:
    """Parse and validate control.json text; raise :class:`ControlError` naming what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ControlError(path, f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(doc, dict):
        raise ControlError(path, "top level must be an object")
    unknown = set(doc) - {"version", "overrides", "commands"}
    if unknown:
        raise ControlError(path, f"unknown key(s): {', '.join(sorted(unknown))}")
    version = doc.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ControlError(path, f"'version' must be a non-negative integer, got {version!r}")
    overrides = doc.get("overrides", {})
    if not isinstance(overrides, dict):
        raise ControlError(path, "'overrides' must be an object")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ControlError(path, f"override {key!r} must be a number or string, got {value!r}")
    raw_commands = doc.get("commands", [])
    if not isinstance(raw_commands, list):
        raise ControlError(path, "'commands' must be a list")
    commands = []
    for i, raw in enumerate(raw_commands):
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw.get("id"):
            raise ControlError(path, f"commands[{i}] must be an object with a string 'id'")
        kind = raw.get("kind")
        if kind not in COMMAND_KINDS:
            raise ControlError(path, f"commands[{i}]: unknown kind {kind!r} (known: {', '.join(sorted(COMMAND_KINDS))})")
        args = {k: v for k, v in raw.items() if k not in ("id", "kind")}
        commands.append(Command(raw["id"], kind, args))
    return Control(version, dict(overrides), tuple(commands))


def read_control(run_dir: Path | str) -> Control | None:
    """The current control.json, or None when there is none; raises :class:`ControlError` when garbled."""
    path = Path(run_dir) / CONTROL
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return parse_control(text, path)


def write_control(run_dir: Path | str, control: Control) -> None:
    """Replace control.json atomically (temp file + rename)."""
    atomic_write_json(Path(run_dir) / CONTROL, control.to_json())


def atomic_write_json(path: Path | str, obj: Any) -> None:
    """Write JSON to ``path`` so a reader sees the old file or the new one, never a torn one."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write bytes to ``path`` via a fsynced temp file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_jsonl(path: Path | str, record: dict[str, Any]) -> None:
    """Append one record as one line; a single write so concurrent readers see whole lines."""
    line = json.dumps(record, sort_keys=True, allow_nan=True) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def append_metrics(run_dir: Path | str, step: int, data: dict[str, float]) -> None:
    """Append one step in verl's FileLogger format: ``{"step": N, "data": {...}}``."""
    append_jsonl(Path(run_dir) / METRICS, {"step": int(step), "data": data})


def append_event(run_dir: Path | str, kind: str, step: int | None, **fields: Any) -> dict[str, Any]:
    """Append one event to events.jsonl and return it."""
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    record = {"ts": time.time(), "step": step, "kind": kind, **fields}
    append_jsonl(Path(run_dir) / EVENTS, record)
    return record


@dataclass
class JsonlChunk:
    """Records read from a JSONL file starting at an offset."""

    records: list[dict[str, Any]]
    offset: int
    """Byte offset to resume from (after the last complete line)."""
    errors: list[str]
    """One message per complete line that was not a JSON object (``file:line: reason``)."""


def read_jsonl(path: Path | str, offset: int = 0, first_line: int = 1) -> JsonlChunk:
    """Read complete JSONL lines from ``offset``; an unterminated last line is left for later.

    Garbled lines are reported in ``errors`` (with file and line number) and skipped, so
    one bad line never hides the rest of a run. ``first_line`` is the line number at
    ``offset``, for messages.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return JsonlChunk([], offset, [])
    end = data.rfind(b"\n") + 1
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    for n, raw in enumerate(data[:end].splitlines(), start=first_line):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            errors.append(f"{path}:{n}: not JSON ({exc})")
            continue
        if not isinstance(obj, dict):
            errors.append(f"{path}:{n}: not a JSON object")
            continue
        records.append(obj)
    return JsonlChunk(records, offset + end, errors)


def read_jsonl_prefix(path: Path, offset: int) -> list[dict[str, Any]]:
    """JSON objects of the complete lines in the first ``offset`` bytes of a JSONL file.

    What a reader had consumed at a saved offset (a restarted watchdog rebuilds its window
    from it); garbled lines are skipped, as the reader skipped them then.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(offset)
    except FileNotFoundError:
        return []
    out = []
    for raw in data.splitlines():
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_run_json(run_dir: Path | str) -> dict[str, Any]:
    """run.json as a dict (empty when absent)."""
    path = Path(run_dir) / RUN_JSON
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def write_run_json(run_dir: Path | str, info: dict[str, Any]) -> None:
    """Write run.json atomically."""
    atomic_write_json(Path(run_dir) / RUN_JSON, info)


def iter_events(run_dir: Path | str, kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """All events of a run (optionally only some kinds), in file order."""
    wanted = set(kinds) if kinds is not None else None
    chunk = read_jsonl(Path(run_dir) / EVENTS)
    return [e for e in chunk.records if wanted is None or e.get("kind") in wanted]
