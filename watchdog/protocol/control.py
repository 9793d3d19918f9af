"""control.json: the watchdog's desired state for a run, and the one step-boundary dispatcher.

control.json is desired state written only by the watchdog, each write with a higher
``version``: the desired config overrides, and one-shot commands (checkpoint, pause,
resume, stop, rollback) listed until the trainer confirms them. A trainer polls it at every
step boundary (and at once on SIGUSR1) through :class:`StepBoundary`, the one dispatcher the
embedded trainer and the verl glue both call:

- a version not newer than the last applied one is a no-op, so re-reading the same file
  after a crash on either side doubles nothing; one more than ``MAX_VERSION_STEP`` above it
  (written by hand) is refused with an ``error`` event, so the version space is never used up;
- a garbled file records one ``error`` event per distinct bad content (naming the file and
  the parse position) and training goes on with what it has;
- a version that sets a key the trainer cannot change live is refused as a whole with an
  ``error`` event naming the key: the watchdog, seeing no ``applied`` event, falls back to a
  restart with the overrides as Hydra arguments;
- one-shot commands run once per run directory: their ids are remembered in
  ``run_dir/.control_state.json`` with the applied version, so a restarted trainer never
  re-runs a command but does re-apply the overrides (``current_overrides``);
- within one version: a checkpoint is taken at once; then the version is confirmed
  (``applied``); then a ``stop`` wins over everything else, a ``rollback`` restores before a
  ``pause`` waits. A trainer that cannot roll back in process leaves that command
  unconfirmed (an ``error`` event says so) and the watchdog rolls back by restart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn, Protocol

from ppo_watchdog.protocol import catalog, inputs, rundir
from ppo_watchdog.protocol.rundir import CONTROL, PathError, atomic_write_json

log = logging.getLogger(__name__)

#: One-shot commands the watchdog can put in control.json.
COMMAND_KINDS = frozenset({"checkpoint", "pause", "resume", "stop", "rollback"})


#: The highest control.json version (the largest integer JSON readers agree on, and SQLite stores).
MAX_VERSION = 2**53 - 1

#: How far above the last applied version a new one may be. The watchdog writes the next version above the
#: newest it knows of; a version further above (written by hand: ``2**53 - 1``) is refused by the trainer,
#: so it can never use up the version space and leave no room for the watchdog's later ones.
MAX_VERSION_STEP = 2**20


def version_acceptable(version: int, applied: int) -> bool:
    """Whether a trainer that applied ``applied`` takes ``version`` as its next one (newer, within the step)."""
    return applied < version <= applied + MAX_VERSION_STEP


def live_overrides(overrides: Mapping[str, Any], live_keys: Iterable[str] | None) -> dict[str, Any]:
    """The part of a desired state that control.json carries: the keys the running trainer changes live
    (its run.json's ``live_keys``; None: every key). A relaunch-only key (a micro batch an OOM remedy
    halved) stays in the desired state for the next relaunch's arguments; in control.json it would make
    the trainer refuse each later version whole."""
    if live_keys is None:
        return dict(overrides)
    live = set(live_keys)
    return {k: v for k, v in overrides.items() if k in live}


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
    except RecursionError as exc:  # the decoder recurses once per nesting level
        raise ControlError(path, "JSON nested too deeply (hundreds of levels)") from exc
    if not isinstance(doc, dict):
        raise ControlError(path, "top level must be an object")
    unknown = set(doc) - {"version", "overrides", "commands"}
    if unknown:
        raise ControlError(path, f"unknown key(s): {', '.join(sorted(unknown))}")
    version = doc.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise ControlError(path, f"'version' must be an integer from 0 to {MAX_VERSION}, got {inputs.short_repr(version, 40)}")
    overrides = doc.get("overrides", {})
    if not isinstance(overrides, dict):
        raise ControlError(path, "'overrides' must be an object")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ControlError(path, f"override {key!r} must be a number or string, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ControlError(path, f"override {key!r} must be a finite number, got {value!r}")
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
        text = inputs.read_text(path)
    except FileNotFoundError:
        return None
    return parse_control(text, path)


def write_control(run_dir: Path | str, control: Control) -> None:
    """Replace control.json atomically (temp file + rename)."""
    atomic_write_json(Path(run_dir) / CONTROL, control.to_json())


STATE_FILE = ".control_state.json"
STATE_FORMAT = 1


def applied_version(run_dir: Path | str) -> int:
    """The newest version the trainer of a run directory applied (its state file; 0 when none or unreadable).

    The watchdog writes above it: a trainer that applied a version the watchdog never wrote (a
    state directory started afresh, a file written by hand) would otherwise ignore every new one.
    """
    try:
        doc = json.loads(inputs.read_text(Path(run_dir) / STATE_FILE))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return 0
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) and 0 <= version <= MAX_VERSION else 0


@dataclass
class Changes:
    """A new control.json version to apply at this step boundary."""

    version: int
    """The control.json version these changes come from."""
    overrides: dict[str, Any]
    """All desired overrides of that version (desired state: applying them twice is harmless)."""
    commands: list[Command]
    """One-shot commands of that version not yet executed in this run directory, in file order."""
    changed: dict[str, Any] = field(default_factory=dict)
    """The subset of ``overrides`` that differs from the last applied version (for logs and events)."""


@dataclass
class _State:
    version: int = 0
    executed: list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "version": self.version, "executed": self.executed, "overrides": self.overrides}


class ControlApplier:
    """Reads control.json for one run directory and remembers what was applied."""

    def __init__(
        self,
        run_dir: Path | str,
        live_keys: Iterable[str] = catalog.LIVE_KEYS,
        state_path: Path | str | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``on_event`` sees every event this applier records (e.g. the exporter's event counter)."""
        self.on_event = on_event
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / rundir.CONTROL
        self.live_keys = frozenset(live_keys)
        self.state_path = Path(state_path) if state_path is not None else self.run_dir / STATE_FILE
        self._state = self._load_state()
        self._reported: str | None = None  # digest of the last bad content reported, so it is reported once
        self._wake = threading.Event()

    # -- persisted state -------------------------------------------------

    def _load_state(self) -> _State:
        try:
            doc = json.loads(inputs.read_text(self.state_path))
        except FileNotFoundError:
            return _State()
        except (OSError, json.JSONDecodeError) as exc:
            # Written atomically, so this means outside damage; starting from zero would
            # re-run one-shot commands, so refuse loudly instead.
            raise ValueError(f"{self.state_path}: unreadable control state ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
            raise ValueError(f"{self.state_path}: unknown control state format {doc.get('format') if isinstance(doc, dict) else doc!r}")
        return _State(int(doc.get("version", 0)), list(doc.get("executed", [])), dict(doc.get("overrides", {})))

    def _save_state(self) -> None:
        rundir.atomic_write_json(self.state_path, self._state.to_json())

    @property
    def applied_version(self) -> int:
        """The newest version applied in this run directory (0 before any)."""
        return self._state.version

    @property
    def executed(self) -> frozenset[str]:
        """Ids of the one-shot commands already executed in this run directory."""
        return frozenset(self._state.executed)

    # -- reading control.json -------------------------------------------

    def _error_once(self, text: str, step: int, message: str, **fields: Any) -> None:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest == self._reported:
            return
        self._reported = digest
        log.error("%s", message)
        self._event("error", step, message=message, source="control", path=str(self.path), **fields)

    def _event(self, kind: str, step: int, **fields: Any) -> None:
        record = rundir.append_event(self.run_dir, kind, step, **fields)
        if self.on_event is not None:
            self.on_event(record)

    def _read(self, step: int) -> Control | None:
        try:
            text = inputs.read_text(self.path)
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            self._error_once(repr(exc), step, f"{self.path}: unreadable ({exc})")
            return None
        try:
            control = parse_control(text, self.path)
        except ControlError as exc:
            self._error_once(text, step, str(exc))
            return None
        unknown = sorted(set(control.overrides) - self.live_keys)
        if unknown:
            self._error_once(
                text, step,
                f"{self.path}: version {control.version}: key(s) not settable live: {', '.join(unknown)} "
                f"(live keys: {', '.join(sorted(self.live_keys))}); version not applied",
                keys=unknown, version=control.version,
            )
            return None
        if control.version > self._state.version and not version_acceptable(control.version, self._state.version):
            self._error_once(
                text, step,
                f"{self.path}: version {control.version} is more than {MAX_VERSION_STEP:,} above the last applied "
                f"version {self._state.version}: refused (the watchdog writes the next version above it; this one "
                "would leave no room for later ones)",
                version=control.version,
            )
            return None
        self._reported = None
        return control

    def poll(self, step: int) -> Changes | None:
        """The changes of a control.json version newer than the last applied one, else None."""
        self._wake.clear()
        control = self._read(step)
        if control is None or control.version <= self._state.version:
            return None
        done = set(self._state.executed)
        commands = [c for c in control.commands if c.id not in done]
        changed = {k: v for k, v in control.overrides.items() if self._state.overrides.get(k) != v}
        return Changes(control.version, dict(control.overrides), commands, changed)

    def mark_applied(self, changes: Changes, step: int, applied: dict[str, Any]) -> None:
        """Record an ``applied`` event and remember the version and the executed command ids.

        The state file is written before the event so that, whatever the crash point, a
        command is never executed twice; the watchdog treats a missing event as "not yet".
        """
        ids = [c.id for c in changes.commands]
        self._state.version = max(self._state.version, changes.version)
        self._state.executed.extend(i for i in ids if i not in self._state.executed)
        self._state.overrides = dict(changes.overrides)
        self._save_state()
        # ``overrides``: the version's content as read, so the watchdog checks that what was applied is what it
        # wrote (a version written by hand over the watchdog's, at its very number, is told apart by it).
        self._event("applied", step, version=changes.version, applied=dict(applied), commands=ids,
                    overrides=dict(changes.overrides))

    def mark_executed(self, command_ids: Iterable[str]) -> None:
        """Remember commands as executed before their version is marked applied.

        For commands that end the process (``stop``) or restore state (``rollback``):
        call this just before acting so a crash mid-command cannot make it run again.
        """
        for i in command_ids:
            if i not in self._state.executed:
                self._state.executed.append(i)
        self._save_state()

    def current_overrides(self) -> dict[str, Any]:
        """All overrides of the newest valid control.json (else the last applied ones), for a restart."""
        try:
            control = read_control(self.run_dir)
        except (ControlError, OSError, UnicodeDecodeError):
            control = None
        if control is not None and not (set(control.overrides) - self.live_keys):
            return dict(control.overrides)
        return dict(self._state.overrides)

    # -- SIGUSR1 --------------------------------------------------------

    def wake(self) -> None:
        """Ask for a poll at the next opportunity (the SIGUSR1 handler calls this)."""
        self._wake.set()

    @property
    def woken(self) -> bool:
        """True when SIGUSR1 (or :meth:`wake`) arrived since the last :meth:`poll`."""
        return self._wake.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds or until woken (for paused trainers); True when woken."""
        return self._wake.wait(timeout)

    def install_signal_handler(self) -> None:
        """Make SIGUSR1 call :meth:`wake` (main thread only)."""
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.wake())


# -- the step boundary ------------------------------------------------------------------------

#: Seconds between two looks at control.json while paused (SIGUSR1 wakes a trainer at once).
PAUSE_POLL_S = 0.5


class BoundaryTarget(Protocol):
    """What a trainer lends the dispatcher: its own ways to apply, save, stop, restore and record."""

    can_rollback: bool
    """True when it restores a checkpoint in process; False leaves rollback commands unconfirmed."""

    def apply(self, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Apply live overrides; (values in force by key, one error message per refused key)."""
        ...

    def checkpoint(self, reason: str) -> None:
        """Save a checkpoint now (records its own ``checkpoint`` event)."""
        ...

    def stop(self, reason: str) -> NoReturn:
        """Save and end the run (raises whatever ends the trainer's loop)."""
        ...

    def rollback(self, args: Mapping[str, Any]) -> None:
        """Restore the checkpoint ``args`` name (``path``, ``to_step``) and skip ``skip_batches``."""
        ...

    def check_rollback(self, args: Mapping[str, Any]) -> str | None:
        """Why the checkpoint ``args`` name cannot be restored (missing, torn, incomplete); None when it can."""
        ...

    def event(self, kind: str, **fields: Any) -> None:
        """Record one event at the trainer's current step."""
        ...

    def should_stop(self) -> str | None:
        """A reason to stop now (SIGTERM arrived), else None; asked while paused too."""
        ...


class StepBoundary:
    """control.json at a trainer's step boundaries: overrides, one-shot commands, pauses."""

    def __init__(self, applier: ControlApplier, target: BoundaryTarget, poll_s: float = PAUSE_POLL_S) -> None:
        self.applier = applier
        self.target = target
        self.poll_s = poll_s
        self.wait: Callable[[float], bool] = applier.wait
        """How a paused trainer sleeps between polls (until SIGUSR1 or the timeout); a test's clock replaces it."""

    def start(self) -> tuple[dict[str, Any], list[str]]:
        """Before the first step: re-apply the newest overrides (a restarted run keeps what was set live)."""
        return self.target.apply(self.applier.current_overrides())

    def at_boundary(self, step: int) -> Changes | None:
        """Apply a newer control.json version, if any; ``step`` is the last completed step."""
        reason = self.target.should_stop()
        if reason is not None:
            self.target.stop(reason)
        changes = self.applier.poll(step)
        if changes is not None:
            self._apply(changes, step)
        return changes

    def _apply(self, changes: Changes, step: int, paused: bool = False) -> None:
        applied, errors = self.target.apply(changes.overrides)
        for message in errors:
            self.target.event("error", message=message, source="control", version=changes.version)
        confirmed: list[Command] = []
        stop = rollback = pause = None
        for cmd in changes.commands:
            if cmd.kind == "rollback":
                problem = ("rollback is not done in process by this trainer" if not self.target.can_rollback
                           else self.target.check_rollback(cmd.args))
                if problem:  # checked before confirming: a confirmed rollback is one that happened
                    self.target.event("error", source="control", version=changes.version, command=cmd.id,
                                      message=f"command {cmd.id}: {problem}; left unconfirmed so the watchdog "
                                              "rolls back by restart")
                    continue
            confirmed.append(cmd)
            if cmd.kind == "checkpoint":
                self.target.checkpoint(f"command {cmd.id}")
            elif cmd.kind == "stop":
                stop = stop or cmd
            elif cmd.kind == "rollback":
                rollback = rollback or cmd
            elif cmd.kind == "pause" and not paused:
                pause = pause or cmd
            # "resume" while running and "pause" while paused: nothing to do, but confirmed.
        if rollback is not None and stop is None:
            # Restored before it is confirmed: an ``applied`` rollback is one that happened. Marked executed
            # first, so a trainer that dies halfway never restores it again: its version stays unconfirmed,
            # and the watchdog rolls back by restart. Confirmed at the step it went back to.
            self.applier.mark_executed([rollback.id])
            self.target.rollback(rollback.args)
            to = rollback.args.get("to_step")
            step = to if isinstance(to, int) and not isinstance(to, bool) else step
        self.applier.mark_applied(replace(changes, commands=confirmed), step, applied)
        if stop is not None:
            self.target.stop(f"command {stop.id}")
        if pause is not None:
            self._pause(step, str(pause.args.get("reason", "")))

    def _pause(self, step: int, reason: str) -> None:
        """Wait between steps until resume, stop or rollback; overrides that arrive meanwhile are applied."""
        self.target.event("paused", reason=reason)
        log.warning("paused after step %d (%s): waiting for a resume command in control.json", step, reason)
        while True:
            why = self.target.should_stop()
            if why is not None:
                self.target.stop(f"{why} while paused")
            self.wait(self.poll_s)
            changes = self.applier.poll(step)
            if changes is None:
                continue
            ends = any(c.kind in ("resume", "stop") or (c.kind == "rollback" and self.target.can_rollback)
                       for c in changes.commands)
            if ends:
                self.target.event("resumed")
            self._apply(changes, step, paused=True)
            if ends:
                return
