"""run.json as a typed, validated :class:`RunInfo`.

run.json is written by whoever launches or runs the trainer (the embedded trainer, the verl
glue's launcher and trainer actor, the watchdog's zero-patch glue) and read by the watchdog.
Each writer fills the fields it knows; every field is optional on disk. A field this version
does not know is kept as it was (``extra``), so a newer trainer's run.json survives an older
watchdog's update. A field of the wrong type, or a file that is not a JSON object, raises
:class:`RunInfoError` naming the file and the field, never a bare traceback.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import inputs, rundir

MODE_VERL = "verl"
"""``mode`` of a run an unmodified verl trains, watched through the watchdog's zero-patch glue."""
MODE_VERL_INPROCESS = "verl_inprocess"
"""``mode`` of a verl run through the in-process glue (``ppo_watchdog.trainer.verl_glue``): it speaks the protocol."""


#: A run.json this many seconds old when read is parsed once per version (see :meth:`RunInfo.read`).
READ_CACHE_AFTER_S = 1.0
_READ_CACHE_MAX = 65536
_READ_CACHE: dict[str, tuple[tuple[int, ...], Any]] = {}


class RunInfoError(rundir.PathError):
    """run.json cannot be used; the message names the file and, where one is at fault, the field."""

    def __init__(self, path: Path | str, reason: str, field_: str | None = None) -> None:
        super().__init__(path, f"{field_!r}: {reason}" if field_ else reason)
        self.field = field_


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return _int(v) or isinstance(v, float)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


#: What each field must hold on disk (``None`` is accepted for every field: "not known").
_CHECKS: dict[str, tuple[str, Any]] = {
    "id": ("a string", lambda v: isinstance(v, str)),
    "mode": ("a string", lambda v: isinstance(v, str)),
    "command": ("a list of strings", _str_list),
    "base_command": ("a list of strings", _str_list),
    "cwd": ("a string", lambda v: isinstance(v, str)),
    "pid": ("an integer", _int),
    "trainer_pid": ("an integer", _int),
    "trainer_host": ("a string", lambda v: isinstance(v, str)),
    "trainer_mode": ("a string", lambda v: isinstance(v, str)),
    "started": ("a number", _num),
    "config": ("an object", lambda v: isinstance(v, dict)),
    "live_keys": ("a list of strings", _str_list),
    "commands": ("a list of strings", _str_list),
    "metrics_port": ("an integer", _int),
    "run_metrics_port": ("an integer", _int),
    "checkpoint_dir": ("a string", lambda v: isinstance(v, str)),
    "world_size": ("an integer", _int),
    "total_steps": ("an integer", _int),
    "steps_per_epoch": ("an integer", _int),
    "sft_dir": ("a string", lambda v: isinstance(v, str)),
    "exit_codes": ("an object of integers", lambda v: isinstance(v, dict) and all(_int(x) for x in v.values())),
    "skip_batches_key": ("a string", lambda v: isinstance(v, str)),
    "launch_args": ("argv or env", lambda v: v in ("argv", "env")),
    "ray_job_id": ("a string", lambda v: isinstance(v, str)),
    "launches": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v)),
}


#: Fields whose empty value means "not said" (the others' ``None`` does).
_EMPTY_UNSAID = frozenset({"command", "config", "exit_codes", "launches"})


@dataclass
class RunInfo:
    """One run.json. ``None`` (or an empty container) means the writer did not say."""

    id: str | None = None
    """The run's id: its directory's name unless a launcher chose one; the ``run`` label of its series."""
    mode: str | None = None
    """``verl`` for a zero-patch run (:data:`MODE_VERL`); absent for a trainer that speaks the protocol."""
    command: list[str] = field(default_factory=list)
    """The command of the current launch (argv)."""
    base_command: list[str] | None = None
    """Zero-patch: the user's command before the glue's overrides (tells a re-attaching watchdog its run)."""
    cwd: str | None = None
    pid: int | None = None
    """The process to signal (the trainer, or verl's driver)."""
    trainer_pid: int | None = None
    """In-process verl: the trainer actor's own pid (it may run on another host)."""
    trainer_host: str | None = None
    trainer_mode: str | None = None
    started: float | None = None
    """Unix time the current launch started."""
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved config (verl's names), as the trainer runs it."""
    live_keys: list[str] | None = None
    """Config keys the trainer changes at a step boundary; ``None``: the protocol's full list."""
    commands: list[str] | None = None
    """One-shot commands done in process; ``None``: all of them."""
    metrics_port: int | None = None
    """Port of the trainer's own ``/metrics`` (127.0.0.1)."""
    run_metrics_port: int | None = None
    """Zero-patch: the port the watchdog was asked to serve the run's metrics on (-1: any)."""
    checkpoint_dir: str | None = None
    """Where checkpoints are saved, when not ``run_dir/checkpoints``."""
    world_size: int | None = None
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    sft_dir: str | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)
    """The trainer's exit codes by meaning (``oom``, ``stopped``)."""
    skip_batches_key: str | None = None
    """The config key a rollback by restart sets to skip the batches that led to the spike."""
    launch_args: str | None = None
    """How a relaunch passes its ``key=value`` arguments: ``argv`` (appended to the command; the default) or
    ``env`` (the command as it is, the arguments in ``$WATCHDOG_LAUNCH_ARGS``: a user's own script)."""
    ray_job_id: str | None = None
    launches: list[dict[str, Any]] = field(default_factory=list)
    """Zero-patch: the last launches (attempt, command, resume_from)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this version does not know, kept as they were."""

    def __copy__(self) -> RunInfo:
        # What copy.copy does for a dataclass (the same field values, a new object), without its generic
        # __reduce_ex__ path: a daemon's cached read of run.json hands one out per run several times a tick.
        new = object.__new__(RunInfo)
        new.__dict__.update(self.__dict__)
        return new

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def from_json(cls, doc: Any, path: Path | str = rundir.RUN_JSON) -> RunInfo:
        """Validate a decoded run.json; raise :class:`RunInfoError` naming the field at fault."""
        if not isinstance(doc, dict):
            raise RunInfoError(path, f"top level must be an object, got {type(doc).__name__}")
        known: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in doc.items():
            check = _CHECKS.get(key)
            if check is None:
                extra[key] = value
                continue
            if value is None:
                continue
            what, ok = check
            if not ok(value):
                raise RunInfoError(path, f"must be {what}, got {inputs.short_repr(value, 80)}", key)
            known[key] = float(value) if key == "started" else value
        return cls(**known, extra=extra)

    @classmethod
    def read(cls, run_dir: Path | str) -> RunInfo:
        """The run directory's run.json (an empty :class:`RunInfo` when there is none yet)."""
        # (The path as text: a daemon asks for every run's run.json at every tick; a Path only to parse it.)
        key = os.path.join(run_dir, rundir.RUN_JSON)
        try:
            st = os.stat(key)
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise RunInfoError(key, f"cannot be read ({exc})") from exc
        # A daemon asks for a run's run.json several times a tick; it changes rarely (atomic
        # replaces: a new inode each). Parsed once per version of the file: the signature is its
        # inode, size and times, and only a file already READ_CACHE_AFTER_S old when read is
        # remembered, so a rewrite within the file system's timestamp granularity is never missed.
        sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = _READ_CACHE.get(key)
        if hit is not None and hit[0] == sig:
            return copy.copy(hit[1])
        info = cls._parse(Path(key))
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > READ_CACHE_AFTER_S * 1e9:
            if len(_READ_CACHE) >= _READ_CACHE_MAX:
                _READ_CACHE.clear()
            _READ_CACHE[key] = (sig, copy.copy(info))
        else:
            _READ_CACHE.pop(key, None)
        return info

    @classmethod
    def _parse(cls, path: Path) -> RunInfo:
        try:
            text = inputs.read_text(path)
        except FileNotFoundError:
            return cls()
        except (OSError, UnicodeDecodeError) as exc:
            raise RunInfoError(path, f"cannot be read ({inputs.reason(exc)})") from exc
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RunInfoError(path, f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
        except RecursionError as exc:  # the decoder recurses once per nesting level
            raise RunInfoError(path, "JSON nested too deeply (hundreds of levels): not a run.json") from exc
        return cls.from_json(doc, path)

    # -- writing ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The JSON object, without fields nobody set."""
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None or (f.name in _EMPTY_UNSAID and not value):
                continue  # not said (an empty live_keys is said: nothing is live)
            out[f.name] = value
        return out

    def write(self, run_dir: Path | str) -> None:
        """Replace run.json atomically (a reader sees the old file or this one)."""
        rundir.atomic_write_json(Path(run_dir) / rundir.RUN_JSON, self.to_json())

    def replace(self, **fields_: Any) -> RunInfo:
        """A copy with some fields changed (a field this version does not know goes to ``extra``)."""
        known = {k: v for k, v in fields_.items() if k in _CHECKS}
        extra = {**self.extra, **{k: v for k, v in fields_.items() if k not in _CHECKS}}
        return dataclasses.replace(self, **known, extra=extra)

    def without(self, *names: str) -> RunInfo:
        """A copy with some fields cleared (a stale pid or port another process will write again)."""
        cleared = {n: _empty(self, n) for n in names if n in _CHECKS}
        return dataclasses.replace(self, **cleared, extra={k: v for k, v in self.extra.items() if k not in names})

    # -- what readers ask ------------------------------------------------------------------
    @property
    def zero_patch(self) -> bool:
        """True for a run an unmodified verl trains (the watchdog's glue speaks for it)."""
        return self.mode == MODE_VERL


def _empty(info: RunInfo, name: str) -> Any:
    current = getattr(info, name)
    return type(current)() if isinstance(current, (list, dict)) else None


def update(run_dir: Path | str, **fields_: Any) -> RunInfo:
    """Read run.json, change some fields, write it back; returns what was written."""
    info = RunInfo.read(run_dir).replace(**fields_)
    info.write(run_dir)
    return info
