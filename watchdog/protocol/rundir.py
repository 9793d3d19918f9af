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
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol.events import EVENT_KINDS, Event, EventError
from ppo_watchdog.protocol.inputs import open_nofollow, open_regular, read_file, short_repr

try:  # optional: a trainer's environment may lack it (verl's has it); the standard decoder stands in
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    _orjson = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
CONTROL = "control.json"
CHECKPOINTS = "checkpoints"
LATEST_MARKER = "latest_checkpointed_iteration.txt"  # verl's own marker file
#: The watchdog's record of a run's W&B run id and TensorBoard directory (ppo_watchdog.backends.trackers).
TRACKERS = "trackers.json"

#: Exit code of a trainer that stopped after a CUDA/CPU out-of-memory error (state saved).
EXIT_OOM = 75
#: Exit code of a trainer stopped by a ``stop`` command or SIGTERM after saving.
EXIT_STOPPED = 0
#: Exit code of a trainer that rejected its configuration before training (unknown key, bad
#: value): relaunching the same command cannot help, so a supervisor gives up instead of retrying.
EXIT_USAGE = 2

#: The run directory, in the environment of every trainer the watchdog launches (a script finds its run here).
RUN_DIR_ENV = "WATCHDOG_RUN_DIR"
#: A relaunch's ``key=value`` arguments (overrides, resume), as a JSON list of strings, for a trainer whose
#: run.json says ``"launch_args": "env"`` (a user's own script, whose argv is its own): its command is
#: relaunched as it is, with the arguments here instead of appended to it.
LAUNCH_ARGS_ENV = "WATCHDOG_LAUNCH_ARGS"


def launch_args(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``key=value`` arguments in ``$WATCHDOG_LAUNCH_ARGS`` (empty when unset); ValueError naming the
    variable when it is not a JSON list of strings."""
    raw = (os.environ if environ is None else environ).get(LAUNCH_ARGS_ENV, "")
    if not raw.strip():
        return []
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"${LAUNCH_ARGS_ENV}: not JSON ({exc.msg})") from None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"${LAUNCH_ARGS_ENV}: expected a JSON list of key=value strings, got {short_repr(args)}")
    return args


class PathError(ValueError):
    """A file or directory that cannot be used; the message is ``path: reason``."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        """The file or directory at fault."""
        self.reason = reason
        """What is wrong, in words."""


def atomic_write_json(path: Path | str, obj: Any) -> None:
    """Write JSON to ``path`` so a reader sees the old file or the new one, never a torn one."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write bytes to ``path`` via a fsynced temp file in the same directory and a rename.

    Plain descriptors, not a buffered file object, and the directory made only when it is missing: the
    watchdog writes a control.json for each live change, and each costs this (bench/daemon_scale.py --part live-set).
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_jsonl(path: Path | str, record: dict[str, Any]) -> None:
    """Append one record as one line; a single write so concurrent readers see whole lines."""
    line = json.dumps(record, sort_keys=True, allow_nan=True) + "\n"
    with os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def check_writable(directory: Path | str) -> None:
    """Raise OSError unless a file can be created in ``directory`` (made when missing): a probe of a name
    nobody else has (two starts at once never race on it), created without following a symlink."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-test-")
    os.close(fd)
    os.unlink(probe)


def append_metrics(run_dir: Path | str, step: int, data: dict[str, float]) -> None:
    """Append one step in verl's FileLogger format: ``{"step": N, "data": {...}}``."""
    append_jsonl(Path(run_dir) / METRICS, {"step": int(step), "data": data})


def append_event(run_dir: Path | str, kind: str, step: int | None, **fields: Any) -> Event:
    """Append one event to events.jsonl and return it."""
    event = Event.new(kind, step, time.time(), **fields)
    append_jsonl(Path(run_dir) / EVENTS, event)
    return event


@dataclass
class JsonlChunk:
    """Records read from a JSONL file starting at an offset."""

    records: list[Any]
    """The JSON objects of the lines, in order (``dict``; what a ``typed`` decoder returned, where one read them)."""
    offset: int
    """Byte offset to resume from (after the last complete line)."""
    errors: list[str]
    """One message per complete line that was not a JSON object (``file:line: reason``)."""
    lines: list[int] = field(default_factory=list)
    """The line number of each record (for messages about its content)."""
    path: str = ""
    """The file read."""
    next_line: int = 1
    """The line number at ``offset`` (where the next read starts counting)."""
    last_start: int = -1
    """Byte offset where the last complete line begins (-1: the chunk has none); it ends at ``offset``."""


def loads_line(raw: bytes) -> Any:
    """One JSON line: orjson where it can (several times faster on a ~100-key metrics line), else the
    standard decoder, which also takes what orjson refuses (``NaN``, huge integers) and words the errors."""
    if _orjson is not None:
        try:
            return _orjson.loads(raw)
        except _orjson.JSONDecodeError:
            pass  # the standard decoder decides, and says why
    return json.loads(raw)


def _all_finite(obj: Any) -> bool:
    """No NaN or infinity anywhere in ``obj`` (which orjson would write as ``null``). A large container of
    numbers only is summed in C (a non-finite value, or a sum overflowing, gives a non-finite sum)."""
    if isinstance(obj, float):
        return obj - obj == 0
    if not isinstance(obj, (dict, list, tuple)):
        return True
    items = obj.values() if isinstance(obj, dict) else obj
    if len(items) > 16:  # a metrics record's values
        try:
            s = sum(items)
        except TypeError:  # not numbers only: look at each
            pass
        else:
            return s - s == 0
    for v in items:
        if type(v) is float:
            if v - v != 0:
                return False
        elif v and isinstance(v, (dict, list, tuple, float)) and not _all_finite(v):
            return False
    return True


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` as ``json.dumps`` reads it back: orjson where nothing in it is NaN or infinite
    (several times faster on a daemon's per-run state, written every tick), else the standard encoder
    (which spells ``NaN`` / ``Infinity``; orjson would write ``null``) - also for integers past 64 bits."""
    if _orjson is not None and _all_finite(obj):
        try:
            return _orjson.dumps(obj).decode()
        except TypeError:  # orjson.JSONEncodeError: an integer past 64 bits, a key that is not a string
            pass
    return json.dumps(obj)


def read_jsonl(path: Path | str, offset: int = 0, first_line: int = 1, until: int | None = None,
               typed: Callable[[bytes], Any] | None = None) -> JsonlChunk:
    """Read complete JSONL lines from ``offset``; an unterminated last line is left for later.

    Garbled lines are reported in ``errors`` (with file and line number) and skipped, so
    one bad line never hides the rest of a run. ``first_line`` is the line number at
    ``offset``, for messages. ``until``: read only the lines before this byte offset (what a
    reader had consumed at a saved offset: a restarted watchdog rebuilds its window from it;
    a tailer that has just stat'ed the file passes its size, and the bytes are read in one call).
    ``typed``: see :func:`parse_jsonl`.
    """
    spath = os.fspath(path)
    try:
        data = _read_bytes(spath, offset, until)
    except FileNotFoundError:
        return JsonlChunk([], offset, [], [], spath, first_line)
    return parse_jsonl(data, offset, first_line, spath, typed)


def _read_bytes(path: str, offset: int, until: int | None) -> bytes:
    """The bytes of ``path`` from ``offset`` to ``until`` (or the end): one pread where the end is known. A path
    that is not a regular file (a FIFO) raises :class:`~ppo_watchdog.protocol.inputs.NotRegularFileError`."""
    if until is None:
        return read_file(path, offset=offset)
    want = max(0, until - offset)
    fd = open_regular(path)
    try:
        data = os.pread(fd, want, offset)
        if 0 < len(data) < want:  # a short read (not at the end of the file): take the rest the same way
            parts = [data]
            got = len(data)
            while got < want:
                more = os.pread(fd, want - got, offset + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def parse_jsonl(data: bytes, offset: int = 0, first_line: int = 1, path: str = "",
                typed: Callable[[bytes], Any] | None = None) -> JsonlChunk:
    """The complete lines of ``data`` (read from ``offset`` of ``path``, ``first_line`` there) as a chunk.

    One split of the bytes, one decoder call a line: a line goes straight to orjson, or to ``typed``
    where given (a decoder of the shape the lines nearly always have, e.g. a msgspec decoder that
    checks the types as it parses; what it returns is taken as it is, a record of its own type, and
    what it refuses - raising ValueError - is read as any line). Only a line orjson refuses (blank,
    NaN, a huge integer, garbled) takes :func:`loads_line`'s standard decoder, which words the error.
    Lines are counted by newlines only.
    """
    parts = data.split(b"\n")
    partial = parts.pop()  # after the last newline: an unterminated line (or nothing), left for later
    records: list[Any] = []
    errors: list[str] = []
    lines: list[int] = []
    fast = typed if typed is not None else _orjson.loads if _orjson is not None else json.loads
    n = first_line - 1
    for raw in parts:
        n += 1
        try:
            obj = fast(raw)
        except (ValueError, RecursionError):  # orjson's and msgspec's decode errors are ValueErrors
            pass
        else:
            if typed is not None or isinstance(obj, dict):
                records.append(obj)
                lines.append(n)
                continue
        if not raw.strip():
            continue
        try:
            obj = loads_line(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            errors.append(f"{path}:{n}: not JSON ({exc})")
            continue
        except RecursionError:  # the decoder recurses once per nesting level
            errors.append(f"{path}:{n}: JSON nested too deeply")
            continue
        if not isinstance(obj, dict):
            errors.append(f"{path}:{n}: not a JSON object")
            continue
        records.append(obj)
        lines.append(n)
    end = offset + len(data) - len(partial)
    return JsonlChunk(records, end, errors, lines, path, n + 1, end - len(parts[-1]) - 1 if parts else -1)


def events_of(chunk: JsonlChunk) -> list[Event]:
    """The valid events of a chunk of events.jsonl; each invalid line, and each event of a kind no
    rule can read, joins ``chunk.errors`` (``file:line: ...``)."""
    out: list[Event] = []
    for obj, line in zip(chunk.records, chunk.lines, strict=True):
        try:
            event = Event.parse(obj, f"{chunk.path}:{line}")
        except EventError as exc:
            chunk.errors.append(str(exc))
            continue
        if event.kind not in EVENT_KINDS:  # a rule may only name known kinds: said, never acted on
            chunk.errors.append(f"{event.where}: unknown event kind {short_repr(event.kind, 60)} (known: "
                                f"{', '.join(sorted(EVENT_KINDS))}): ignored")
            continue
        out.append(event)
    return out


def iter_events(run_dir: Path | str, kinds: Iterable[str] | None = None) -> list[Event]:
    """All valid events of a run (optionally only some kinds), in file order; invalid lines are logged."""
    wanted = set(kinds) if kinds is not None else None
    chunk = read_jsonl(Path(run_dir) / EVENTS)
    events = events_of(chunk)
    for err in chunk.errors:
        log.warning("skipped %s", err)
    return [e for e in events if wanted is None or e.kind in wanted]
