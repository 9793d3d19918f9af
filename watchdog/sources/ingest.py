"""Read a run's per-step metrics and events: whole files for replay, or tailed for live runs.

These sources are understood, detected from the content, not the file name:

- verl's FileLogger JSONL (``VERL_FILE_LOGGER_PATH``) and the trainer's ``metrics.jsonl``:
  one ``{"step": N, "data": {...}}`` object a line. verl writes it with orjson, which
  turns NaN and inf into ``null``; a ``null`` metric is read back as NaN because a NaN
  is the only thing verl ever logs that orjson cannot spell.
- verl's console logger: ``step:N - key:value - key:value ...`` lines among any other
  output, possibly behind ANSI colour codes and Ray's ``(TaskRunner pid=...)`` prefix,
  with values like ``nan``, ``-inf``, ``1e-06`` or ``np.float64(0.1)``.
- Hugging Face TRL's ``trainer_state.json`` (its ``log_history``: one dict a logging step, with its
  ``step``), and TRL's printed logs (transformers prints each logging step's dict,
  ``{'loss': '0.0123', 'reward': '1.25', ..., 'epoch': '0.0078'}``, without its step: the records are
  numbered 1, 2, ... in order, :attr:`ReadResult.steps_counted`). Both go under verl's keys through
  :func:`ppo_watchdog.protocol.catalog.trl_metrics`, TRL's own names kept as ``trl/<name>``.
- a run directory: its ``metrics.jsonl`` (and ``events.jsonl`` via :func:`read_events`); a TRL output
  directory: its ``trainer_state.json``, else its newest ``checkpoint-N/trainer_state.json``.

Steps are deduplicated the way a training engineer reads a log: a later line for a
step replaces the earlier one (a resumed run rewrites steps), a step that goes back
drops the abandoned steps after it (a rollback or a restart from a checkpoint), and a
second line with *different* keys for the same step is merged into it (verl logs the
validation metrics of a step on their own line). :func:`apply_records` is that rule;
reading a file whole and tailing it poll by poll give the same timeline.

Older verl logs a scaled learning rate as ``actor/lr(1e-4):0.010``; it is also
recorded under ``actor/lr`` in real units so rules and replay see one name.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import catalog, inputs, rundir
from ppo_watchdog.protocol.events import MAX_STEP, Event

try:  # a dependency (pyproject): decodes and type-checks a metrics line in one C pass; an install without
    # it still reads every line, through orjson (tested)
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - exercised where msgspec is absent
    _msgspec = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FORMAT_JSONL = "jsonl"
FORMAT_CONSOLE = "console"
FORMAT_TRL_STATE = "trl_state"
FORMAT_TRL_PRINTED = "trl_printed"
#: What each format is, for a person (``watchdog check``).
FORMAT_NAMES = {
    FORMAT_JSONL: "FileLogger JSONL (verl's file logger or a run's metrics.jsonl)",
    FORMAT_CONSOLE: "verl console log (step:N - key:value lines)",
    FORMAT_TRL_STATE: "TRL trainer_state.json (log_history)",
    FORMAT_TRL_PRINTED: "TRL printed logs (one dict a logging step)",
}
TRL_STATE = "trainer_state.json"

# CSI sequences (colours, cursor moves) and the two-byte escapes terminals also accept.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# ``step:N`` must start a token (not ``global_step:3`` nor ``training/step:3``) and be
# followed by `` - key:value`` items: "saved at step:3" alone is prose, not metrics.
_STEP = re.compile(r"(?<![\w/.@-])step:(\d+)(?=\s+-\s)")
# numpy / torch scalar reprs as pprint.pformat prints them: np.float64(0.1), tensor(0.5).
_WRAPPED = re.compile(r"^(?:np|numpy)\.\w+\((.*)\)$|^tensor\((.*?)(?:,.*)?\)$")
# verl's old scaled keys: ``actor/lr(1e-4)`` holds lr / 1e-4.
_SCALED_KEY = re.compile(r"^(?P<base>.+)\((?P<scale>\d+(?:\.\d+)?e[-+]?\d+)\)$")


# Out-of-memory signatures in verl / Ray / torch console output, most specific first.
# CUDA: torch's OutOfMemoryError (also wrapped as RayTaskError(OutOfMemoryError)) and the
# allocator's "CUDA error: out of memory". Host: Ray's memory monitor killing a worker.
_OOM_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Task was killed due to the node running low on memory"
                r"|killed due to memory pressure \(OOM\)"
                r"|ActorDiedError.*(?:memory|OOM)", re.I), "host"),
    (re.compile(r"CUDA out of memory|CUDA error: out of memory|torch\.(?:cuda\.)?OutOfMemoryError"
                r"|RayTaskError\(OutOfMemoryError\)", re.I), "cuda"),
)


class IngestError(rundir.PathError):
    """A metrics source cannot be read at all (missing, a directory without metrics, ...)."""


@dataclass(frozen=True)
class ParseIssue:
    """One line (or one item of a line) that was skipped, with where it is."""

    file: str
    """Path of the file the line is in."""
    line: int
    """1-based line number."""
    message: str
    """What is wrong, naming the offending key or text."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass
class ReadResult:
    """Everything :func:`read_run` found in one metrics source."""

    records: list[dict[str, Any]]
    """Deduplicated ``{"step": N, "data": {verl key: float}}`` records, ascending by step."""
    format: str
    """``jsonl`` or ``console``."""
    path: Path
    """The file that was read (``metrics.jsonl`` for a run directory)."""
    issues: list[ParseIssue] = field(default_factory=list)
    """Lines or items that were skipped."""
    lines: int = 0
    """Raw step lines seen, before deduplication."""
    events: list[Event] = field(default_factory=list)
    """Events found in a console log (``oom`` with ``device`` cuda|host), at the last step logged before them."""
    steps_counted: bool = False
    """The log names no steps (TRL's printed logs): its records were numbered 1, 2, ... in file order."""


# ---------------------------------------------------------------------------
# values and keys


def parse_value(text: str) -> float | None:
    """A console value as a float (``nan``, ``-inf``, ``1e-06``, ``np.float64(0.1)``), else None."""
    text = text.strip()
    m = _WRAPPED.match(text)
    if m:
        text = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
    if text in ("True", "False"):
        return None  # verl logs a few flags; a flag is not a series value
    try:
        return float(text)
    except ValueError:
        return None


_FLOATS = frozenset({float})
_NUMBERS = frozenset({float, int})


def normalize_data(data: Mapping[str, Any]) -> dict[str, float]:
    """Numeric metrics only, as floats: ``null`` -> NaN (orjson's NaN), scaled keys unscaled, plus the values the
    catalog derives (:func:`ppo_watchdog.protocol.catalog.derive`)."""
    values = data.values()
    types = set(map(type, values))  # one pass in C; a FileLogger line is floats, ints now and then
    if types <= _FLOATS:
        out = dict(data)
    elif types <= _NUMBERS:
        out = dict(zip(data, map(float, values), strict=True))
    else:
        out = {}
        for key, value in data.items():
            if type(value) is float:
                out[key] = value
            elif value is None:
                out[key] = math.nan
            elif isinstance(value, bool):
                continue
            elif isinstance(value, (int, float)):
                out[key] = float(value)
            elif isinstance(value, str):
                parsed = parse_value(value)
                if parsed is not None:
                    out[key] = parsed
    return _complete(out)


def _complete(data: dict[str, float]) -> dict[str, float]:
    """A step's numbers (this line's own dict) with its scaled keys unscaled (``x(1e-3)``) and the catalog's
    derived values added."""
    for key, base, scale in _scaled_keys(tuple(data)):
        if base not in data:
            data[base] = data[key] * scale
    catalog.derive(data)
    return data


@functools.lru_cache(maxsize=256)
def _scaled_keys(keys: tuple[str, ...]) -> tuple[tuple[str, str, float], ...]:
    """(key, base, scale) of the scaled keys among ``keys`` (``x(1e-3)``), in order; a trainer logs one key set
    line after line, so the patterns are matched once per key set."""
    out = []
    for key in keys:
        m = _SCALED_KEY.match(key)
        if m:
            out.append((key, m.group("base"), float(m.group("scale"))))
    return tuple(out)


def parse_console_line(line: str) -> tuple[int, dict[str, float], list[str]] | None:
    """Parse one console line: (step, data, problems), or None when it is not a step line."""
    clean = _ANSI.sub("", line).rstrip("\r\n")
    m = _STEP.search(clean)
    if not m:
        return None
    step = int(m.group(1))
    data: dict[str, Any] = {}
    problems: list[str] = []
    rest = clean[m.end():]
    for piece in rest.split(" - "):
        piece = piece.strip()
        if not piece or piece == "-":
            continue
        key, sep, raw = piece.partition(":")
        key = key.strip()
        if not sep or not key or " " in key:
            problems.append(f"item {piece[:60]!r} is not key:value")
            continue
        # The whole value first (torch prints tensor(0.5, device='cuda:0')), else its first word.
        value = parse_value(raw)
        if value is None and raw.split():
            value = parse_value(raw.split()[0])
        if value is None:
            problems.append(f"key {key!r}: value {raw[:40]!r} is not a number")
            continue
        data[key] = value
    return step, normalize_data(data), problems


# ---------------------------------------------------------------------------
# deduplication


def apply_records(history: list[dict[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fold new records into a step-ordered history; returns the new history (inputs untouched).

    - a step beyond the last one is appended;
    - the last step again with disjoint keys is merged (a separate validation line);
    - otherwise a step at or before the last one starts a new timeline there: the old
      record for that step and every later one are dropped (restart, rollback, rewrite).
    """
    out = [dict(r) for r in history]
    for rec in new:
        step = int(rec["step"])
        data = dict(rec.get("data") or {})
        if not out or step > out[-1]["step"]:
            out.append({"step": step, "data": data})
            continue
        last = out[-1]
        if step == last["step"] and not (set(last["data"]) & set(data)):
            last["data"] = {**last["data"], **data}
            continue
        while out and out[-1]["step"] >= step:
            out.pop()
        out.append({"step": step, "data": data})
    return out


def dedup_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Deduplicate raw records in file order with :func:`apply_records`'s rule."""
    return apply_records([], records)


# ---------------------------------------------------------------------------
# whole files


def _resolve(path: Path | str) -> Path:
    p = Path(path)
    if p.is_dir():
        metrics = p / rundir.METRICS
        if metrics.exists():
            return metrics
        state = _trl_state_of(p)
        if state is None:
            raise IngestError(p, f"a directory without {rundir.METRICS} or TRL's {TRL_STATE}: not a run directory")
        return state
    if not p.exists():
        raise IngestError(p, "no such file")
    return p


def _trl_state_of(d: Path) -> Path | None:
    """A TRL output directory's ``trainer_state.json`` (written by ``save_state``), else its newest
    ``checkpoint-N``'s (each holds the whole log history up to N), else None."""
    if (d / TRL_STATE).is_file():
        return d / TRL_STATE
    found = [(int(c.name.rpartition("-")[2]), c / TRL_STATE) for c in d.glob("checkpoint-*")
             if c.name.rpartition("-")[2].isdigit() and (c / TRL_STATE).is_file()]
    return max(found)[1] if found else None


def record_from_json(obj: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Validate one FileLogger object: (record, None) or (None, reason)."""
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    step = obj.get("step")
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        return None, f"'step' must be an integer, got {inputs.short_repr(step, 40)}"
    if step < 0:  # would read as a rewind to before the run began and drop every step recorded
        return None, f"'step' must be >= 0, got {step}"
    if step > MAX_STEP:
        return None, f"'step' must be at most 2**53 - 1, got {inputs.short_repr(step, 40)}"
    data = obj.get("data")
    if not isinstance(data, dict):
        return None, f"'data' must be an object, got {type(data).__name__}"
    return {"step": step, "data": normalize_data(data)}, None


if _msgspec is not None:
    class _Line(_msgspec.Struct):
        """A FileLogger line as verl writes it nearly always: an integer step and numbers only (no null)."""

        step: int
        data: dict[str, float]  # a JSON integer is read as a float, as normalize_data makes it

    _LINE_TYPED: Any = _msgspec.json.Decoder(_Line).decode
    """Decodes a metrics line that is an integer step and numbers only, in one pass (what it refuses,
    raising a ValueError - a null, a flag, a float step, a garbled line - the general path reads)."""
else:  # pragma: no cover - exercised where msgspec is absent
    _Line = None  # type: ignore[assignment,misc]
    _LINE_TYPED = None


def _metrics_record(obj: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A metrics line as the tailer read it (the typed decoder's ``_Line``, or any JSON object) as a record."""
    return _typed_record(obj) if type(obj) is _Line else record_from_json(obj)


def _typed_record(line: Any) -> tuple[dict[str, Any] | None, str | None]:
    """record_from_json for a line the typed decoder read: its data is floats already."""
    data = line.data
    if not 0 <= line.step <= MAX_STEP:
        return record_from_json({"step": line.step, "data": data})  # says why
    return {"step": line.step, "data": _complete(data)}, None


def _parse_jsonl(path: Path, lines: Sequence[str]) -> tuple[list[dict[str, Any]], list[ParseIssue]]:
    raw: list[dict[str, Any]] = []
    issues: list[ParseIssue] = []
    for n, line in enumerate(lines, start=1):
        s = line.strip()
        if not s:
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            issues.append(ParseIssue(str(path), n, f"not JSON ({exc.msg} at column {exc.colno})"))
            continue
        except RecursionError:  # the decoder recurses once per nesting level: every log is tried as JSONL
            issues.append(ParseIssue(str(path), n, "JSON nested too deeply"))
            continue
        rec, reason = record_from_json(obj)
        if rec is None:
            issues.append(ParseIssue(str(path), n, reason or "bad record"))
            continue
        raw.append(rec)
    return raw, issues


def scan_oom(line: str) -> str | None:
    """``cuda`` or ``host`` when a console line reports an out-of-memory error, else None."""
    clean = _ANSI.sub("", line)
    if "memory" not in clean.lower() and "OOM" not in clean:
        return None  # cheap pre-check: most lines of a log are neither
    for pattern, device in _OOM_PATTERNS:
        if pattern.search(clean):
            return device
    return None


def _parse_console(
    path: Path, lines: Sequence[str]
) -> tuple[list[dict[str, Any]], list[ParseIssue], list[Event]]:
    raw: list[dict[str, Any]] = []
    issues: list[ParseIssue] = []
    events: list[Event] = []
    last_step: int | None = None
    for n, line in enumerate(lines, start=1):
        parsed = parse_console_line(line)
        if parsed is None:
            device = scan_oom(line)
            # One event per step and device: a traceback repeats the error on many lines.
            if device and not any(e["step"] == last_step and e["device"] == device for e in events):
                events.append(Event.parse({"kind": "oom", "step": last_step, "device": device,
                                           "source": f"{path}:{n}", "ts": None}))
            continue
        step, data, problems = parsed
        last_step = step
        issues.extend(ParseIssue(str(path), n, p) for p in problems)
        if data:
            raw.append({"step": step, "data": data})
        else:
            issues.append(ParseIssue(str(path), n, f"step:{step} line without any numeric metric"))
    return raw, issues, events


def _trl_record(logs: Mapping[str, Any]) -> dict[str, float] | None:
    """One TRL log dict's metrics under verl's keys, or None when it is not a training step's (the end of
    training's summary, an evaluation)."""
    if "train_runtime" in logs or not any(k in logs for k in ("loss", "kl", *catalog.TRL_KEYS)):
        return None
    return catalog.trl_metrics({k: v for k, v in normalize_data(logs).items() if k != "step"})


def _parse_trl_state(path: Path, text: str) -> tuple[list[dict[str, Any]], list[ParseIssue]] | None:
    """trainer_state.json's ``log_history`` as records; None when the text is not such a file."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("log_history"), list):
        return None
    raw: list[dict[str, Any]] = []
    issues: list[ParseIssue] = []
    for i, entry in enumerate(obj["log_history"]):
        data = _trl_record(entry) if isinstance(entry, dict) else None
        if data is None:
            continue
        step = entry.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            issues.append(ParseIssue(str(path), 1, f"log_history[{i}]: 'step' must be an integer >= 0, got "
                                                   f"{inputs.short_repr(step, 40)}"))
            continue
        raw.append({"step": step, "data": data})
    return raw, issues


# A dict transformers printed: its keys quoted, flat (a nested dict is a config, not a step's logs).
_PRINTED = re.compile(r"\{'[^{}]*\}")
_PRINTED_ITEM = re.compile(r"'((?:[^'\\]|\\.)*)'\s*:\s*('(?:[^'\\]|\\.)*'|[^,}]+)")


def _parse_trl_printed(path: Path, lines: Sequence[str]) -> tuple[list[dict[str, Any]], list[ParseIssue], bool]:
    """TRL's printed logs: each line holding a flat dict with ``epoch`` and a training value is a step's logs,
    numbered 1, 2, ... (transformers prints no step), or by its ``step`` where it has one; (records, issues,
    whether any was numbered)."""
    raw: list[dict[str, Any]] = []
    issues: list[ParseIssue] = []
    counted = False
    for n, line in enumerate(lines, start=1):
        if "{'" not in line:
            continue  # cheap pre-check: most lines of a log hold no dict
        m = _PRINTED.search(_ANSI.sub("", line))
        if m is None:
            continue
        logs: dict[str, Any] = {}
        for key, value in _PRINTED_ITEM.findall(m.group(0)):
            parsed = parse_value(value[1:-1] if value.startswith("'") else value)
            if parsed is not None:
                logs[key] = parsed
        if "epoch" not in logs:
            continue  # not transformers' (it adds the epoch to every log it prints)
        data = _trl_record(logs)
        if data is None:
            continue
        step = logs.get("step")
        if step is not None and not (float(step).is_integer() and 0 <= step <= MAX_STEP):
            issues.append(ParseIssue(str(path), n, f"'step' must be an integer >= 0, got {step!r}"))
            continue
        counted = counted or step is None
        raw.append({"step": int(step) if step is not None else len(raw) + 1, "data": data})
    return raw, issues, counted


def read_run(path: Path | str) -> ReadResult:
    """Read a metrics file or run directory whole; raises :class:`IngestError` when unreadable."""
    p = _resolve(path)
    try:
        text = inputs.read_text(p, errors="replace")
    except OSError as exc:
        raise IngestError(p, f"cannot read ({exc.strerror or exc})") from exc
    state = _parse_trl_state(p, text)
    if state is not None:  # a whole JSON document, not lines
        return ReadResult(dedup_records(state[0]), FORMAT_TRL_STATE, p, state[1], len(state[0]))
    # Newlines only, as the daemon's reader splits (a JSON string may hold U+2028, which splitlines() splits at).
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]
    # The format is the one more lines parse in, not the first line's: one garbage line (a banner, a
    # torn write) at the top of a FileLogger JSONL must not make it a console log with no steps. The
    # other format's lines are then this one's skipped lines, each named by file:line.
    raw, issues = _parse_jsonl(p, lines)
    c_raw, c_issues, c_events = _parse_console(p, lines)
    fmt, events = FORMAT_JSONL, []
    looks_json = any(ln.lstrip().startswith("{") for ln in lines) or not any(ln.strip() for ln in lines)
    if len(c_raw) > len(raw) or (not raw and not c_raw and not looks_json):
        fmt, raw, issues, events = FORMAT_CONSOLE, c_raw, c_issues, c_events
    t_raw, t_issues, t_counted = _parse_trl_printed(p, lines)
    counted = False
    if len(t_raw) > len(raw):
        fmt, raw, issues, events, counted = FORMAT_TRL_PRINTED, t_raw, t_issues, [], t_counted
    for issue in issues:
        log.debug("skipped %s", issue)  # returned to the caller, who reports them
    return ReadResult(dedup_records(raw), fmt, p, issues, len(raw), events, counted)


def read_records(path: Path | str) -> list[dict[str, Any]]:
    """Deduplicated ``{"step", "data"}`` records of a FileLogger JSONL, metrics.jsonl, console log or run dir."""
    return read_run(path).records


def read_events(run_dir: Path | str) -> list[Event]:
    """All events of a run directory in file order (garbled or invalid lines logged and skipped)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise IngestError(d, "not a run directory")
    return rundir.iter_events(d)


# ---------------------------------------------------------------------------
# tailing a live run


@dataclass
class _FileCursor:
    """Where the tailer stands in one JSONL file."""

    offset: int = 0
    """Byte offset after the last complete line read."""
    line: int = 1
    """Line number at ``offset`` (for messages)."""
    inode: int | None = None
    """Inode the offset belongs to: a replaced file (verl's FileLogger truncates on start) restarts at 0."""

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "line": self.line, "inode": self.inode}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> _FileCursor:
        return cls(int(d.get("offset", 0)), int(d.get("line", 1)), d.get("inode"))


def rewind_targets(events: Iterable[Mapping[str, Any]]) -> list[int]:
    """The steps ``started`` and ``rollback`` events say the trainer went back to (what explains a step
    below the last one: the next line is that step or the one after it)."""
    out = []
    for e in events:
        kind = e.get("kind")
        target = e.get("to_step") if kind == "rollback" else (
            e.get("resumed_from") if isinstance(e.get("resumed_from"), int) else e.get("step")) if kind == "started" \
            else None
        if isinstance(target, int) and not isinstance(target, bool):
            out.append(target)
    return out


def forward_only(records: Sequence[dict[str, Any]], lines: Sequence[int], path: Path | str, last: int | None,
                 rewinds: list[int]) -> tuple[list[dict[str, Any]], list[str], list[int]]:
    """Steps only go forward within an attempt: (records kept, one issue per line ignored, rewinds left).

    A record whose step is below the last one is a rewind only when a ``started`` / ``rollback`` event
    (``rewinds``, their target steps) explains it: the first line of the new timeline is at the target
    step or the one after it, and uses that event up. Any other such line (a stray append, a second
    writer) is reported with its file and line and ignored, never read as a rewind that drops the
    steps after it."""
    kept: list[dict[str, Any]] = []
    issues: list[str] = []
    left = list(rewinds)
    for rec, line in zip(records, lines, strict=False):
        step = int(rec["step"])
        if last is not None and step < last:
            match = next((t for t in left if t <= step <= t + 1), None)
            if match is None:
                issues.append(f"{path}:{line}: step {step} is below the last step {last} and no started or "
                              "rollback event explains it: ignored")
                continue
            left.remove(match)
        last = step
        kept.append(rec)
    return kept, issues, left[-16:]


#: Skipped lines said one by one in a read of a run's file; past them, one line says how many more.
SAY_SKIPPED = 10


class RunTailer:
    """Incremental reader of a run directory's ``metrics.jsonl`` and ``events.jsonl``.

    ``poll()`` returns what was appended since the last poll; an unterminated last line
    waits for the next poll. ``offsets`` / ``offsets=`` let a restarted watchdog carry on
    where it stopped (persist the dict). Each returned record is the *whole* record of its
    step as it now stands: a validation line for the previous poll's last step comes back
    merged with that step's metrics. So a consumer may simply replace a step it holds and
    drop anything after it (which is what ``Window.append_record`` and
    :func:`apply_records` do), and tailing in any chunks gives the same timeline as
    :func:`read_records` on the whole file.
    """

    OFFSETS_VERSION = 1
    offsets_are_snapshots = True
    """:attr:`offsets` is a snapshot nothing changes later (fresh cursors; the last record is replaced
    by a poll, never changed in place), so a caller keeps it as it is, without a deep copy."""

    def __init__(
        self,
        run_dir: Path | str,
        offsets: Mapping[str, Any] | None = None,
        events_only: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.events_only = events_only
        """Read events.jsonl alone (a Prometheus source: its metrics come from Prometheus)."""
        self.metrics_path = self.run_dir / rundir.METRICS
        self.events_path = self.run_dir / rundir.EVENTS
        # The paths as str, made once: a poll stats and reads them without building path objects.
        self._metrics_file = os.fspath(self.metrics_path)
        self._events_file = os.fspath(self.events_path)
        self._metrics = _FileCursor()
        self._events = _FileCursor()
        self._last: dict[str, Any] | None = None  # the newest step's record, for merging
        self._last_at: tuple[int, int] | None = None
        """Where in metrics.jsonl ``_last`` was read, when it is one line's record as it is (the usual poll):
        the saved positions then hold its place, not its ~100 values, and a restart reads it back."""
        self._rewinds: list[int] = []  # steps started/rollback events went back to, not yet seen in metrics
        self.issues: list[str] = []
        """Garbled lines seen so far (``file:line: reason``), oldest first; capped at 1000."""
        if offsets is not None:
            self.offsets = offsets  # type: ignore[assignment]

    @property
    def offsets(self) -> dict[str, Any]:
        """A JSON-able snapshot of the read positions (a daemon saves every run's at every tick)."""
        last = self._last
        if last is not None and self._last_at is not None:
            last = {"step": last["step"], "at": list(self._last_at)}
        return {
            "version": self.OFFSETS_VERSION,
            "metrics": self._metrics.to_json(),
            "events": self._events.to_json(),
            "last": last,
            "rewinds": list(self._rewinds),
        }

    @offsets.setter
    def offsets(self, value: Mapping[str, Any]) -> None:
        if value.get("version", self.OFFSETS_VERSION) != self.OFFSETS_VERSION:
            raise ValueError(f"tailer offsets: unsupported version {value.get('version')!r}")
        self._metrics = _FileCursor.from_json(value.get("metrics", {}))
        self._events = _FileCursor.from_json(value.get("events", {}))
        last = value.get("last")
        self._last, self._last_at = None, None
        if last and "data" not in last:
            start, end = last["at"]
            self._last, self._last_at = self._read_back(int(last["step"]), int(start), int(end))
        elif last:
            self._last = {"step": int(last["step"]), "data": dict(last["data"])}
        self._rewinds = [int(t) for t in value.get("rewinds", []) if isinstance(t, int)]

    def _read_back(self, step: int, start: int, end: int) -> tuple[dict[str, Any], tuple[int, int] | None]:
        """The last step's record read again from the bytes of metrics.jsonl it was read from (restored read
        positions); when the file no longer holds them (replaced, truncated), the step alone, said."""
        try:
            st = os.stat(self._metrics_file)
        except FileNotFoundError:
            st = None
        if st is not None and st.st_ino == self._metrics.inode and st.st_size >= end:
            chunk = rundir.read_jsonl(self._metrics_file, start, until=end, typed=_LINE_TYPED)
            if len(chunk.records) == 1 and chunk.offset == end:
                obj = chunk.records[0]
                rec, _ = _metrics_record(obj)
                if rec is not None and rec["step"] == step:
                    return rec, (start, end)
        log.warning("%s changed since its read positions were saved: step %d's record is not there to read "
                    "back (a later line of that step starts its record afresh)", self._metrics_file, step)
        return {"step": step, "data": {}}, None

    def _read(self, path: str, cur: _FileCursor, typed: Any = None) -> rundir.JsonlChunk | None:
        """The complete lines appended to ``path`` since ``cur`` (which moves past them); None when nothing is new."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        inputs.check_regular(path, st.st_mode)  # a FIFO or a directory there: this run's tick fails, said once
        size = st.st_size
        if (cur.inode is not None and st.st_ino != cur.inode) or size < cur.offset:
            log.info("%s was replaced or truncated; reading it from the start", path)
            cur.offset, cur.line = 0, 1
            if cur is self._metrics:
                self._last_at = None  # (its bytes are gone: saved whole from now on)
        cur.inode = st.st_ino
        if size == cur.offset:  # nothing new: the stat was enough
            return None
        # The new bytes up to the size just seen, read once; the chunk says where its complete lines end
        # and the line number there (a partial last line is read again, whole, by a later poll).
        chunk = rundir.read_jsonl(path, cur.offset, cur.line, until=size, typed=typed)
        cur.offset, cur.line = chunk.offset, chunk.next_line
        return chunk

    def _note_errors(self, errors: list[str]) -> None:
        for err in errors[:SAY_SKIPPED]:
            log.warning("skipped %s", err)
        if len(errors) > SAY_SKIPPED:  # (a binary file appended to: hundreds of lines a read)
            log.warning("skipped %d more line(s) in this read, the last %s", len(errors) - SAY_SKIPPED, errors[-1])
        self.issues = (self.issues + errors)[-1000:]

    def poll(self) -> tuple[list[dict[str, Any]], list[Event]]:
        """(new metric records, new events) since the last poll."""
        raw: list[dict[str, Any]] = []
        raw_lines: list[int] = []
        last = self._last
        prev = last["step"] if last is not None else -1
        ascending = True  # every step after the one before (the usual poll: nothing to merge or drop)
        metrics = None if self.events_only else self._read(self._metrics_file, self._metrics, _LINE_TYPED)
        if metrics is not None:
            if metrics.errors:
                self._note_errors(metrics.errors)
            for obj, line in zip(metrics.records, metrics.lines, strict=True):
                rec, reason = _metrics_record(obj)
                if rec is None:
                    msg = f"{self._metrics_file}:{line}: skipped a record: {reason}"
                    log.warning(msg)
                    self.issues.append(msg)
                    continue
                if rec["step"] <= prev:
                    ascending = False
                prev = rec["step"]
                raw.append(rec)
                raw_lines.append(line)
        # Events after metrics: a trainer writes its started/rollback event before the first line of the
        # new timeline, so a line read here has the event that explains it read too.
        events: list[Event] = []
        chunk = self._read(self._events_file, self._events)
        if chunk is not None:
            events = rundir.events_of(chunk)
            if chunk.errors:
                self._note_errors(chunk.errors)
            if events:
                self._rewinds += rewind_targets(events)
        if not raw:
            if len(self._rewinds) > 16:  # as forward_only keeps them
                self._rewinds = self._rewinds[-16:]
            return [], events
        if ascending:  # the usual poll: each record is its step's whole record as it is
            if len(self._rewinds) > 16:
                self._rewinds = self._rewinds[-16:]
            self._last = raw[-1]
            # (metrics is this poll's chunk: raw holds its records; the last one's bytes end the chunk)
            self._last_at = ((metrics.last_start, metrics.offset)  # type: ignore[union-attr]
                             if raw_lines[-1] == metrics.next_line - 1 else None)  # type: ignore[union-attr]
            return raw, events
        raw, backwards, self._rewinds = forward_only(raw, raw_lines, self._metrics_file,
                                                     last["step"] if last is not None else None, self._rewinds)
        if backwards:
            self._note_errors(backwards)
        if not raw:
            return [], events
        base = [last] if last is not None else []
        out = apply_records(base, raw)
        self._last, self._last_at = out[-1], None  # (a merge of lines: saved whole)
        if base and out[0] == base[0]:
            out = out[1:]  # the previous step, untouched: not news
        return out, events
