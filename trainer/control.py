"""Apply control.json at step boundaries: desired overrides plus one-shot commands.

control.json is desired state written only by the watchdog, each write with a higher
``version``. The trainer polls it at every step boundary (and at once on SIGUSR1):

- a version not newer than the last applied one is a no-op, so re-reading the same
  file after a crash on either side doubles nothing;
- a garbled file records one ``error`` event per distinct bad content (naming the
  file and the parse position) and training goes on with what it has;
- a version that sets a key the trainer cannot change live is refused as a whole
  with an ``error`` event naming the key: the watchdog, seeing no ``applied`` event,
  falls back to a restart with the overrides as Hydra arguments;
- one-shot commands run once per run directory: their ids are remembered in
  ``run_dir/.control_state.json`` with the applied version, so a restarted trainer
  never re-runs a command but does re-apply the overrides (``current_overrides``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer import rundir

log = logging.getLogger(__name__)

STATE_FILE = ".control_state.json"
STATE_FORMAT = 1


@dataclass
class Changes:
    """A new control.json version to apply at this step boundary."""

    version: int
    """The control.json version these changes come from."""
    overrides: dict[str, Any]
    """All desired overrides of that version (desired state: applying them twice is harmless)."""
    commands: list[rundir.Command]
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
        live_keys: Iterable[str] = rundir.LIVE_KEYS,
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
            doc = json.loads(self.state_path.read_text())
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

    def _read(self, step: int) -> rundir.Control | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            self._error_once(repr(exc), step, f"{self.path}: unreadable ({exc})")
            return None
        try:
            control = rundir.parse_control(text, self.path)
        except rundir.ControlError as exc:
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
        self._event("applied", step, version=changes.version, applied=dict(applied), commands=ids)

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
            control = rundir.read_control(self.run_dir)
        except (rundir.ControlError, OSError, UnicodeDecodeError):
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
