"""Carrying out remediation: control.json versions, signals, restarts, alerts.

Every action is an entry of the store's journal, driven forward one phase at a time by
:meth:`Actuator.drive`. Each phase is idempotent, so a watchdog killed at any point and
restarted re-drives the open entries and nothing is lost or done twice:

- ``live_set`` / ``command``: a new control.json version (desired overrides plus the
  one-shot commands still unconfirmed) is reserved in SQLite *before* the file is
  written; the file write is skipped when control.json already carries that version;
  then SIGUSR1. Confirmed by the trainer's ``applied`` event for that version (and, for
  a command, its id). Unconfirmed past the deadline: a restart instead.
- ``restart``: resolve the checkpoint (recorded in the entry before acting), stop the
  trainer (SIGTERM, grace, SIGKILL), write control.json with the desired overrides,
  relaunch the command with the overrides as Hydra ``key=value`` arguments and
  ``trainer.resume_mode=resume_path trainer.resume_from_path=...``.
- ``rollback``: in process (a control.json ``rollback`` command) while the trainer
  lives, else by restart from the last known-good checkpoint; then the follow-on sets.
- ``pause`` / ``resume`` / ``notify``: commands plus an Alertmanager-compatible webhook.

Two modes change :meth:`Actuator.drive`, the one place every action reaches a run through: advise mode
says each entry as what would be done and does none; approval (``--approve KINDS``) holds an entry of
those kinds for a person's ``watchdog approve`` or ``deny``, and carries it out, or not, once answered.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import math
import os
import shlex
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ppo_watchdog.backends import trackers
from ppo_watchdog.backends.dialect import Dialect, ProtocolDialect
from ppo_watchdog.backends.local import (
    Backend,
    BackendUnavailable,
    LaunchRefused,
    LocalBackend,
    TrainerAlive,
    TrainerProcess,
)
from ppo_watchdog.control.store import UNLOADABLE, UNWATCHED, ActionRecord, BadSpan, Phase, RunRecord, Store
from ppo_watchdog.core.engine import evidence_text
from ppo_watchdog.core.planner import clip_bound_sets, config_value, snap_sets
from ppo_watchdog.core.pricing import DEFAULT_STARTUP_S, Cost, duration_text
from ppo_watchdog.core.summary import entry_words, sets_text
from ppo_watchdog.core.vocabulary import APPROVE_KINDS, ActionStatus, JournalKind
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import hydra, inputs, rundir
from ppo_watchdog.protocol.catalog import (
    CLIP_HIGH_KEY,
    CLIP_LOW_KEY,
    CLIP_RATIO_KEY,
    RESUME_MODE_KEY,
    RESUME_PATH_KEY,
    VERL_CLIP_DEFAULT,
)
from ppo_watchdog.protocol.control import (
    MAX_VERSION,
    MAX_VERSION_STEP,
    Command,
    Control,
    ControlError,
    applied_version,
    live_overrides,
    read_control,
    version_acceptable,
    write_control,
)
from ppo_watchdog.protocol.lock import TRAINER_LOCK
from ppo_watchdog.protocol.runinfo import RunInfo, RunInfoError

log = logging.getLogger(__name__)

#: A control.json version the watchdog never wrote (by hand, a script): applied by the trainer, or refused.
RULE_FOREIGN_CONTROL = "watchdog:foreign_control"


class ActuatorError(RuntimeError):
    """An action could not be carried out; the message names the run and the action."""


# -- pure helpers ---------------------------------------------------------------------


def restart_command(base: Sequence[str], overrides: Mapping[str, Any], resume_path: str | None,
                    fresh: bool = False) -> list[str]:
    """``base`` with every override (replacing the same key), then the resume arguments, in Hydra's grammar.

    ``fresh``: from the initial weights, whatever the base command says (``trainer.resume_mode=disable``).
    """
    resume = {RESUME_MODE_KEY: "disable"} if fresh else {}
    if resume_path and not fresh:
        resume = {RESUME_MODE_KEY: "resume_path", RESUME_PATH_KEY: resume_path}
    return hydra.with_overrides(base, overrides, [hydra.format_override(k, v) for k, v in resume.items()])


def launch_command(run_dir: str | Path, base: Sequence[str], overrides: Mapping[str, Any], resume_path: str | None,
                   fresh: bool = False, once: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of a launch: :func:`restart_command` plus ``once``, with the run directory in
    ``$WATCHDOG_RUN_DIR``; where run.json says ``"launch_args": "env"`` (a user's own script, whose argv is
    its own), the command as it is and the ``key=value`` arguments in ``$WATCHDOG_LAUNCH_ARGS`` instead."""
    env = {rundir.RUN_DIR_ENV: str(Path(run_dir).resolve())}
    if RunInfo.read(run_dir).launch_args != "env":
        return restart_command(base, overrides, resume_path, fresh=fresh) + list(once), env
    env[rundir.LAUNCH_ARGS_ENV] = json.dumps(restart_command([], overrides, resume_path, fresh=fresh) + list(once))
    return list(base), env


def choose_known_good(checkpoints: Sequence[Any], spans: Sequence[BadSpan]) -> Any | None:
    """Newest complete checkpoint not written while a divergence rule fired (not merely the newest)."""
    for info in sorted(checkpoints, key=lambda c: c.step, reverse=True):
        if not getattr(info, "complete", False):
            continue
        if any(s.covers(info.step, getattr(info, "ts", None)) for s in spans):
            continue
        return info
    return None


def approval_kind(kind: str, payload: Mapping[str, Any]) -> str | None:
    """Which of :data:`APPROVE_KINDS` a journal entry is (None: none, it never waits for a person)."""
    if kind == JournalKind.ROLLBACK:
        return "rollback"
    if kind == JournalKind.RESTART:
        return "relaunch"
    if kind == JournalKind.STOP:
        return "stop"
    if kind == JournalKind.COMMAND and (payload.get("command") or {}).get("kind") == "pause":
        return "pause"
    return None


def check_approve(kinds: Sequence[str] | str) -> tuple[str, ...]:
    """``--approve``'s kinds (a list, or one comma-separated text), checked; ValueError naming an unknown one."""
    items = kinds.split(",") if isinstance(kinds, str) else list(kinds)
    out = []
    for k in (str(k).strip() for k in items):
        if not k:
            continue
        if k not in APPROVE_KINDS:
            raise ValueError(f"approve: {inputs.short_repr(k, 40)} is not an action that can wait for approval "
                             f"(one of {', '.join(APPROVE_KINDS)})")
        if k not in out:
            out.append(k)
    return tuple(out)


def alert_payload(
    run_id: str, rule: str, severity: str, summary: str, description: str,
    status: str = "firing", now: float | None = None, external_url: str = "", mode: str = "",
) -> dict[str, Any]:
    """One alert in Alertmanager's webhook format (version 4), so existing receivers take it as is.
    ``mode``: ``advise`` (what the watchdog would have done in advise mode), ``approve`` (an action that waits
    for a person), ``denied`` (one a person refused, or nobody answered in time): the label ``mode``, so a
    receiver can route them apart."""
    ts = datetime.fromtimestamp(now if now is not None else time.time(), tz=timezone.utc)
    labels = {"alertname": "PPOWatchdogEscalation", "run": run_id, "rule": rule, "severity": severity or "critical"}
    if mode:
        labels["mode"] = mode
    fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    alert = {
        "status": status,
        "labels": labels,
        "annotations": {"summary": summary, "description": description},
        "startsAt": ts.isoformat().replace("+00:00", "Z"),
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": external_url,
        "fingerprint": fingerprint,
    }
    return {
        "version": "4",
        "groupKey": f'{{}}:{{run="{run_id}"}}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "ppo-watchdog",
        "groupLabels": {"run": run_id},
        "commonLabels": labels,
        "commonAnnotations": alert["annotations"],
        "externalURL": external_url,
        "alerts": [alert],
    }


# -- I/O shells -----------------------------------------------------------------------


WEBHOOK_URL_ENV = "WATCHDOG_WEBHOOK_URL"
WEBHOOK_URL_FILE_ENV = "WATCHDOG_WEBHOOK_URL_FILE"


def resolve_webhook_url(url_file: str | Path | None = None, configured: str | None = None) -> str | None:
    """The webhook URL: ``url_file``'s first line, a config file's ``configured`` value,
    ``$WATCHDOG_WEBHOOK_URL_FILE``'s first line, or ``$WATCHDOG_WEBHOOK_URL``; None when none is set.

    Never from argv (world-readable in ``ps``); a file that cannot be read is a ValueError naming it.
    """
    path = url_file or (None if configured else os.environ.get(WEBHOOK_URL_FILE_ENV))
    if path:
        try:
            lines = inputs.read_text(path).splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"webhook URL file {path}: cannot be read ({exc})") from exc
        url = next((ln.strip() for ln in lines if ln.strip()), "")
        if not url:
            raise ValueError(f"webhook URL file {path}: empty")
        where = f"webhook URL file {path}"
    else:
        url = configured or os.environ.get(WEBHOOK_URL_ENV) or ""
        where = "the configured webhook URL" if configured else f"${WEBHOOK_URL_ENV}"
        if not url:
            return None
    try:  # refused at start, not at the first escalation hours later
        webhook_target(url)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return url


def webhook_target(url: str) -> tuple[str, dict[str, str]]:
    """The URL to POST to and its headers: ``user:password@`` moved into a Basic Authorization header
    (urllib would take it for part of the host name). ValueError, never quoting the URL (a secret),
    for anything but http(s) with a host."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https"):
        scheme = parts.scheme or "none"
        raise ValueError(f"scheme {inputs.short_repr(scheme, 20)} is not supported: a webhook URL is http:// or https://")
    try:
        host, port = parts.hostname, parts.port  # port: a ValueError when it is not a number in range
    except ValueError as exc:
        raise ValueError("the port is not a number from 0 to 65535") from exc
    if not host:
        raise ValueError("no host name")
    headers = {"Content-Type": "application/json"}
    netloc = host if ":" not in host else f"[{host}]"
    if port is not None:
        netloc += f":{port}"
    if parts.username is not None or parts.password is not None:
        user = urllib.parse.unquote(parts.username or "")
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), headers


@dataclass
class Notifier:
    """Posts Alertmanager-compatible JSON to a webhook (if configured) and always logs."""

    url: str | None = None
    """Webhook URL (an Alertmanager receiver, Slack bridge, ...); None: log only."""
    timeout_s: float = 5.0
    """HTTP timeout."""
    sent: list[dict[str, Any]] = field(default_factory=list)
    """Payloads posted (or attempted) by this process, newest last."""

    def notify(self, payload: dict[str, Any], quiet: bool = False) -> str:
        """Send; returns an outcome string (never raises: an alert failure must not stop remediation).
        ``quiet``: logged at INFO (the caller has said it to the person watching already)."""
        alert = payload["alerts"][0]
        (log.info if quiet else log.warning)("ALERT %s run=%s rule=%s: %s", alert["status"], alert["labels"]["run"],
                    alert["labels"]["rule"], alert["annotations"]["summary"])
        self.sent.append(payload)
        if not self.url:
            return "logged"
        try:
            url, headers = webhook_target(self.url)
            req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST", headers=headers)
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return f"webhook {resp.status}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # The URL is a secret (a Slack hook, a token in its query): named by where it came from, never shown.
            log.error("webhook failed (the configured webhook URL, not shown): %s", exc)
            return f"webhook failed: {exc}"


@dataclass
class RunHandle:
    """What the actuator needs about one run besides its store record."""

    run: RunRecord
    """The store record (kept in sync by the controller)."""
    proc: TrainerProcess | None = None
    """The trainer process, when one is running or attached."""
    last_step: int | None = None
    """Newest step seen."""
    applied_commands: set[str] = field(default_factory=set)
    """Command ids the trainer reported as executed."""
    backend: Backend | None = None
    """This run's own backend (a Ray Job backend for its cluster); None: the actuator's."""
    dialect: Dialect = None  # type: ignore[assignment]  # set in __post_init__
    """How the trainer speaks (:mod:`ppo_watchdog.backends.dialect`): the protocol, or the zero-patch glue of
    an unmodified verl run."""
    advise: bool = False
    """Advise mode: every entry is said as what would be done and none is carried out (:meth:`Actuator.drive`)."""
    approve: tuple[str, ...] = ()
    """Kinds of :data:`APPROVE_KINDS` whose entries wait for a person's ``watchdog approve`` or ``deny``."""
    approve_timeout_s: float = 1800.0
    """An entry unanswered this long is denied, said."""
    on_live_timeout: Callable[[ActionRecord, str], int | None] = field(default=lambda entry, message: None)
    """A live change the running trainer did not apply in time: the controller's restart instead
    (counted against its restart budget); returns its journal id, None when the budget is spent."""
    on_answer: Callable[[ActionRecord, bool], None] = field(default=lambda entry, approved: None)
    """A person's answer (or the deadline's) to an entry that waited, as it is carried out: the controller
    records what the action's journaling left for then (a relaunch expected, a pause)."""

    def __post_init__(self) -> None:
        if self.dialect is None:
            self.dialect = ProtocolDialect(self.run.run_dir)


@dataclass
class ActuatorConfig:
    """Timing and budgets of the actuator."""

    live_timeout_s: float = 60.0
    """An unconfirmed control.json version falls back to a restart after this long."""
    stop_grace_s: float = 15.0
    """SIGTERM grace before SIGKILL (the trainer saves a checkpoint on SIGTERM)."""
    signal_live: bool = True
    """Send SIGUSR1 after writing control.json (a local child reads it at once)."""
    log_name: str = "trainer.log"
    """File in the run directory receiving the trainer's output."""

    def __post_init__(self) -> None:
        check_finite(self)
        if not (self.live_timeout_s > 0 and self.stop_grace_s > 0):
            raise ValueError(f"live_timeout_s and stop_grace_s must be > 0 seconds, got "
                             f"{self.live_timeout_s!r}, {self.stop_grace_s!r}")


def check_finite(config: Any) -> None:
    """ValueError naming the first number of a config dataclass that is NaN or infinite (None passes)."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value!r}")


#: Where the fault matrix (bench/faults.py) kills the watchdog: after a tick committed its decisions,
#: after control.json was written, after the trainer was signalled, after it was stopped for a
#: restart, after the new trainer was launched.
CRASH_POINTS = ("decided", "control_written", "signalled", "stopped", "launched")


OnAction = Callable[[str, str, str, str, "int | None", str], None]
"""``on_action(run, rule, kind, outcome, step, said)``: an action's outcome (counted on /metrics by ``outcome``,
annotated in Grafana with ``said``, the action in words)."""


class Actuator:
    """Drives journal entries forward; each call does at most one idempotent phase."""

    def __init__(
        self, store: Store, backend: Backend, notifier: Notifier | None = None,
        config: ActuatorConfig | None = None, on_action: OnAction | None = None,
        crash_hook: Callable[[str], None] | None = None, tell: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_action(run, rule, kind, outcome, step, said)``: each action's outcome once committed (counted,
        annotated), ``said`` the action in words. ``tell(run, line)``: one line a person watching reads the
        moment an action completes or fails (``watchdog run``'s console, the daemon's log)."""
        self.store = store
        self.backend = backend
        self.notifier = notifier or Notifier()
        self.config = config or ActuatorConfig()
        self._on_action: OnAction = on_action or (lambda run, rule, kind, outcome, step, said: None)
        self.tell: Callable[[str, str], None] = tell or (lambda run, line: log.info("%s: %s", run, line))
        self._watched = tell is not None  # a person reads tell's lines: an alert is said there, not logged again
        # Test seam: called with a phase name right after that phase's effect (:data:`CRASH_POINTS`);
        # the fault matrix passes a function that SIGKILLs this very process there (a real kill -9).
        self.crash_hook = crash_hook or (lambda phase: None)

    # -- control.json ----------------------------------------------------------------

    def reserve_version(self, h: RunHandle, entry: ActionRecord | None, overrides: dict[str, Any]) -> int:
        """Reserve the next control version in SQLite (before the file exists) and the new desired overrides."""
        # Above the store's last version, and above anything the run directory has seen (a version the
        # watchdog never wrote would make the trainer ignore every lower one).
        try:
            on_file = (read_control(h.run.run_dir) or Control()).version
        except ControlError:
            on_file = 0
        known = max(h.run.control_version, applied_version(h.run.run_dir))
        if on_file > known and not version_acceptable(on_file, known):
            # Written by hand too far up (the protocol's largest version): the trainer refuses it, so it is no
            # floor for the next version; the watchdog's version replaces it, said to the console and webhook.
            message = (f"control.json version {on_file} was not written by the watchdog and is more than "
                       f"{MAX_VERSION_STEP:,} above the newest version known ({known}): the trainer refuses it, "
                       f"and the watchdog writes version {known + 1} over it")
            log.warning("%s: %s", h.run.run_id, message)
            self.notifier.notify(alert_payload(h.run.run_id, RULE_FOREIGN_CONTROL, "warning",
                                               f"control.json version {on_file} refused", message))
            on_file = 0
        version = max(known, on_file) + 1
        if version > MAX_VERSION:
            raise ActuatorError(f"run {h.run.run_id}: control.json version {version} is past {MAX_VERSION}")
        with self.store.transaction():
            self.store.update_run(h.run.run_id, control_version=version, overrides=overrides)
            if entry is not None:
                self.store.update_action(entry.id, control_version=version)
        h.run.control_version = version
        h.run.overrides = dict(overrides)
        return version

    def write_control(self, h: RunHandle, version: int) -> bool:
        """Write control.json at ``version`` unless it is already there; False when skipped."""
        run_dir = Path(h.run.run_dir)
        try:
            current = read_control(run_dir)
        except ControlError as exc:
            log.error("%s: replacing garbled control.json: %s", h.run.run_id, exc)
            current = None
        if current is not None and version_acceptable(current.version, version - 1):
            return False  # written already (a re-drive), or a newer version a trainer takes stands (said when applied)
        commands = self._pending_commands(h)
        # The keys the running trainer changes live, only: a relaunch-only key stays in the desired state for the
        # next relaunch's arguments (``launch``).
        try:
            live_keys = RunInfo.read(run_dir).live_keys
        except RunInfoError:
            live_keys = None
        overrides = live_overrides(h.run.overrides, live_keys)
        write_control(run_dir, Control(version, overrides, tuple(commands)))
        self.store.record_control(h.run.run_id, version, overrides, [c.to_json() for c in commands])
        return True

    def _pending_commands(self, h: RunHandle) -> list[Command]:
        """One-shot commands of open entries (listed again in each version until confirmed; ids dedupe)."""
        out = []
        for e in self.store.open_actions(h.run.run_id):
            cmd = e.payload.get("command")
            if cmd and e.status in (ActionStatus.INTENT, ActionStatus.SENT) and cmd["id"] not in h.applied_commands:
                args = {k: v for k, v in cmd.items() if k not in ("id", "kind")}
                out.append(Command(cmd["id"], cmd["kind"], args))
        return out

    def _signal(self, h: RunHandle) -> None:
        # Only a trainer that speaks the protocol (its run.json lists live keys) handles SIGUSR1;
        # to any other process (verl's main_ppo) the default action of SIGUSR1 is death.
        info = RunInfo.read(h.run.run_dir)
        if not info.live_keys:
            return
        if h.proc is not None and info.pid != h.proc.pid:
            # Not yet up: a relaunched trainer writes run.json with its pid just before installing
            # its handler, and reads control.json before its first step anyway.
            return
        if self.config.signal_live and h.proc is not None and h.proc.alive():
            try:
                # The trainer process alone: under a local ray.init() its group also holds Ray's raylet,
                # GCS and workers, whose default action on SIGUSR1 is death (found with verl's in-process
                # glue on CPU: the first live change killed the run).
                h.proc.signal(signal.SIGUSR1, group=False)
            except OSError as exc:
                log.warning("%s: SIGUSR1 failed: %s", h.run.run_id, exc)

    # -- processes -------------------------------------------------------------------

    def launch(self, h: RunHandle, resume_path: str | None, now: float, once: Sequence[str] = (),
               fresh: bool = False, resume_step: int | None = None) -> TrainerProcess:
        """Start the run's command with the desired overrides (and resume arguments).

        ``once``: arguments for this launch only (e.g. :func:`skip_batches_arg`, a rollback past the
        batches that led to a spike); ``fresh``: from the initial weights (no resume at all);
        ``resume_step``: the step of the checkpoint resumed from (0 with ``fresh``), for the trackers.
        """
        if not h.run.command:
            raise ActuatorError(f"run {h.run.run_id}: no command to launch (a watched run without a restart command)")
        overrides = {**h.run.overrides, **launch_clip_bounds(h.run.run_dir, h.run.overrides)}
        cmd, env = launch_command(h.run.run_dir, h.run.command, overrides, resume_path, fresh, once)
        # verl: its file logger, checkpoint dir and KL coefficient carried over; the protocol: as it is.
        cmd, more = h.dialect.prepare_launch(cmd, h.run.overrides, resume_path)
        env.update(more or {})
        # W&B and TensorBoard: one run and one log across attempts, rewound to the step resumed from.
        try:
            tracked = trackers.launch_env(h.run.run_dir, cmd, 0 if fresh else resume_step)
        except trackers.TrackerConfigError as exc:
            raise LaunchRefused(f"run {h.run.run_id}: {exc}") from None
        if tracked.said:
            log.info("%s: %s", h.run.run_id, tracked.sentence)
        env.update(tracked.env)
        backend = h.backend or self.backend
        log_path = Path(h.run.run_dir) / self.config.log_name
        if isinstance(backend, LocalBackend):
            # The trainer holds the run's trainer lock for its whole life: never a second one beside it.
            proc: TrainerProcess = backend.start(cmd, env=env, cwd=None, log_path=log_path,
                                                 lock_path=Path(h.run.run_dir) / TRAINER_LOCK)
        else:
            proc = backend.start(cmd, env=env, cwd=None, log_path=log_path)
        # Recorded before anything else can fail: a trainer that runs is a trainer the watchdog knows.
        job_id = getattr(proc, "job_id", None)  # a Ray Job has a submission id instead of a pid
        h.proc = proc
        h.run.pid = proc.pid
        h.run.job_id = job_id
        h.run.phase = Phase.RUNNING
        h.run.launched_ts = now
        h.run.last_progress_ts = now
        h.run.exit_code = None
        self.store.update_run(h.run.run_id, pid=proc.pid, job_id=job_id, phase=Phase.RUNNING,
                              launched_ts=now, last_progress_ts=now, exit_code=None)
        h.dialect.launched(proc.pid, cmd, resume_path)
        return proc

    def stop(self, h: RunHandle) -> int | None:
        """Stop the trainer (SIGTERM, grace, SIGKILL) and wait until what it started has ended too.

        Called even when the leader has already ended: a crashed verl leaves its Ray workers to
        shut down, and a relaunch must not race them for the GPUs (each backend's ``stop`` returns
        at once when nothing of the attempt is left)."""
        if h.proc is None:
            return None
        return h.proc.stop(self.config.stop_grace_s)

    def checkpoint_and_stop(self, h: RunHandle, reason: str, wait_s: float, poll_s: float = 0.2) -> tuple[str, int | None]:
        """Ask the trainer to save a checkpoint and stop (the protocol's ``stop`` command, journaled: it saves at
        its next step boundary, then exits 0), wait up to ``wait_s`` seconds for it, then stop what is left
        (:meth:`stop`); a trainer that reads no control.json (an unmodified verl) is stopped at once.
        Returns (the outcome in words, the trainer's exit code)."""
        info = RunInfo.read(h.run.run_dir)
        asks = (h.dialect.live and h.proc is not None and h.proc.alive()
                and (info.commands is None or "stop" in info.commands))
        since = time.time()
        entry = None
        if asks:
            payload = {"rule": "watchdog:checkpoint_stop", "reason": reason, "command": {"id": "", "kind": "stop"}}
            aid = self.store.add_action(h.run.run_id, JournalKind.COMMAND, payload)
            self.store.update_action(aid, payload={**payload, "command": {"id": f"c{aid}", "kind": "stop"}})
            entry = self.store.get_action(aid)
            assert entry is not None
            self.drive(h, entry, since)  # control.json with the command, then SIGUSR1
            deadline = time.monotonic() + wait_s
            while h.proc is not None and h.proc.alive() and time.monotonic() < deadline:
                time.sleep(poll_s)
        code = self.stop(h)  # what is left: all of a trainer that cannot be asked, else its stragglers
        saved = [e.step for e in rundir.iter_events(h.run.run_dir, ["checkpoint"])
                 if e.ts is not None and e.ts >= since and e.step is not None]
        latest = self._resolve_checkpoint(h, "latest")
        resumes = f"resumes from step {latest.step}" if latest is not None else "resumes from the start (no checkpoint)"
        if saved:
            outcome = f"checkpoint at step {saved[-1]} saved, trainer stopped (exit {code}); {resumes}"
        elif asks:
            outcome = f"no checkpoint saved within {wait_s:g} s: trainer stopped (exit {code}); {resumes}"
        else:
            outcome = (f"the trainer reads no control.json, so it cannot be asked for a checkpoint: stopped (exit "
                       f"{code}); {resumes}")
        if entry is not None:
            self._finish(h, entry, "done" if saved else "failed", outcome=outcome, exit_code=code)
        return outcome, code

    # -- journal driving -------------------------------------------------------------

    def drive(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        """Advance one journal entry by one phase (in advise mode: say it as what would be done, do nothing)."""
        if h.advise:
            # The one gate of advise mode: every action of the watchdog reaches the run through a journal
            # entry driven here, so nothing past this line is reached, and no backend needs to know.
            try:
                self._advise(h, entry, now)
            except Exception as exc:  # recorded and the loop goes on, as a failed action is
                log.exception("%s: advice %d (%s) failed", h.run.run_id, entry.id, entry.kind)
                self._finish(h, entry, "failed", error=f"{type(exc).__name__}: {exc}")
            return
        if entry.status == ActionStatus.AWAITING or (entry.status == ActionStatus.INTENT
                                                      and needs_approval(h, entry.kind, entry.payload)):
            # The one gate of approval, beside advise mode's: held for a person, then carried out (below, once
            # approved) or closed as denied. Nothing of the action reaches the run while it waits.
            try:
                if not self._await_approval(h, entry, now):
                    return
            except Exception as exc:  # recorded and the loop goes on, as a failed action is
                log.exception("%s: approval of %d (%s) failed", h.run.run_id, entry.id, entry.kind)
                self._finish(h, entry, "failed", error=f"{type(exc).__name__}: {exc}")
                return
        handler = getattr(self, f"_drive_{entry.kind}", None)
        if handler is None:
            self._finish(h, entry, "failed", error=f"unknown action kind {entry.kind!r}")
            return
        try:
            handler(h, entry, now)
        except (BackendUnavailable, TrainerAlive) as exc:
            # Nothing was started or stopped (the job server did not answer; the stopped trainer's last
            # process has not let go of the run yet): the entry stays open and the next tick drives the
            # same phase again.
            log.warning("%s: action %d (%s) waits: %s", h.run.run_id, entry.id, entry.kind, exc)
        except ActuatorError as exc:  # a known reason (e.g. a watched run has no command to relaunch)
            log.error("%s: action %d (%s) failed: %s", h.run.run_id, entry.id, entry.kind, exc)
            self._finish(h, entry, "failed", error=str(exc))
        except Exception as exc:  # recorded and the loop goes on (a daemon must not die of one run)
            log.exception("%s: action %d (%s) failed", h.run.run_id, entry.id, entry.kind)
            self._finish(h, entry, "failed", error=f"{type(exc).__name__}: {exc}")

    def _finish(self, h: RunHandle, entry: ActionRecord, status: str, **result: Any) -> None:
        merged = {**entry.result, **result}
        self.store.update_action(entry.id, status=status, result=merged)
        entry.status, entry.result = status, merged
        if entry.decision_id is not None:
            self.store.settle_decision(entry.decision_id)
        outcome = "ok" if status == ActionStatus.DONE else "failed"
        # Counted, annotated and said once the entry's new status is committed (a confirmation read inside a
        # tick that is then undone is read and confirmed again: said once, not twice).
        self._said(h, entry, outcome, announce=status in (ActionStatus.DONE, ActionStatus.FAILED))

    def _said(self, h: RunHandle, entry: ActionRecord, outcome: str, announce: bool = False) -> None:
        """After the commit: the action counted and annotated with its words; ``announce``: also one line to
        whoever watches (``tell``) and one webhook message in words, for every action but an alert (which is
        its own message) and one handed on to another entry (said by that one: a rollback by relaunch)."""
        run, rule, kind = h.run.run_id, str(entry.payload.get("rule", "")), entry.kind
        words = entry_words(entry)
        step = next((s for s in (entry.result.get("applied_step"), h.last_step, h.run.last_step) if s is not None), None)
        # Not said: an alert (its own message), an entry handed on (said by the one it went to: a rollback by
        # relaunch), sets applied by a relaunch or after an in-process rollback (said with that one).
        announce = (announce and kind != JournalKind.NOTIFY and entry.result.get("handed_to") is None
                    and not (outcome == "ok" and (entry.payload.get("follows") or entry.result.get("carried_by"))))
        severity = str(entry.payload.get("severity") or ("warning" if outcome == "ok" else "critical"))
        decision_id = entry.decision_id

        def said() -> None:
            self._on_action(run, rule, kind, outcome, step, words)
            if not announce:
                return
            self.tell(run, (f"step {step}: " if step is not None else "") + f"{rule}: {words}")
            decision = self.store.get_decision(decision_id) if decision_id is not None else None
            why = str(decision["message"]) if decision is not None else ""
            self.notifier.notify(alert_payload(
                run, rule, severity, f"{rule}: {words}", f"{why}: {words}" if why else words,
                mode="done" if outcome == "ok" else "failed"), quiet=True)

        self.store.after_commit(said)

    # -- advise mode --------------------------------------------------------------------

    def _advise(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        """Close ``entry`` as advised: its outcome says what would be done ("would roll back to step 55 ..."),
        said on the console and to the webhook (the notifier's alert, labelled ``mode="advise"``), counted and annotated as ``advised``. Nothing reaches the run:
        no control.json, no signal, no stop, no launch. What is read to say it (the checkpoint a rollback would
        go to) is read as the real action would read it."""
        p = entry.payload
        would = advice_text(entry.kind, p, self._advised_checkpoint(h, entry), h.dialect.live)
        alive = h.proc is not None and h.proc.alive()
        if entry.kind in (JournalKind.RESTART, JournalKind.ROLLBACK) and h.run.managed and not alive \
                and h.run.phase not in (Phase.FINISHED, Phase.STOPPED, Phase.FAILED):
            # The trainer has ended (a crash, an OOM) and advise mode relaunches nothing: the run is over.
            h.run.phase = Phase.FAILED
            self.store.update_run(h.run.run_id, phase=Phase.FAILED)
            would += "; advise mode: the trainer has ended and nothing relaunches it"
        summary = str(p.get("summary") or "") if entry.kind == JournalKind.NOTIFY else ""
        description = str(p.get("description") or p.get("reason") or p.get("verdict") or "")
        sent = self.notifier.notify(alert_payload(
            h.run.run_id, str(p.get("rule", "")), str(p.get("severity") or "warning"), f"advise: {would}",
            description or summary, now=now, mode="advise"))
        result = {**entry.result, "outcome": would, "announced": sent}
        self.store.update_action(entry.id, status=ActionStatus.ADVISED, result=result)
        entry.status, entry.result = ActionStatus.ADVISED, result
        if entry.decision_id is not None:
            self.store.settle_decision(entry.decision_id)
        self._said(h, entry, ActionStatus.ADVISED.value)

    # -- approval ------------------------------------------------------------------------

    def _await_approval(self, h: RunHandle, entry: ActionRecord, now: float) -> bool:
        """An entry of a kind ``--approve`` names: held (said once, with why, the cost and the commands), then
        each tick its answer looked for: approved, it goes on as it would have (True: drive it now); denied, or
        unanswered past its deadline, it is closed as ``denied`` and the run carries on, alerted (False)."""
        if entry.status == ActionStatus.INTENT:
            self._hold(h, entry, now)
            return False
        answer = entry.payload.get("answer")
        if answer is None and entry.deadline is not None and now > entry.deadline:
            expired = {"approved": False, "by": "the deadline", "expired": True, "ts": now}
            if not self.store.answer_approval(entry.id, expired):  # a person answered first: theirs stands
                fresh = self.store.get_action(entry.id)
                entry.payload = fresh.payload if fresh is not None else entry.payload
            else:
                entry.payload = {**entry.payload, "answer": expired}
            answer = entry.payload.get("answer")
        if answer is None:
            return False
        p, what = entry.payload, entry.result.get("would", entry.kind)
        who = str(answer.get("by") or "someone")
        why = f" ({answer['reason']})" if answer.get("reason") else ""
        run, rule = h.run.run_id, str(p.get("rule", ""))
        resolved = alert_payload(run, rule, str(p.get("severity") or "critical"), f"approval needed: {what}",
                                 "answered", status="resolved", now=now, mode="approve")
        if answer.get("approved"):
            self.notifier.notify(resolved)
            log.warning("%s: %s approved by %s%s: carrying it out", run, what, who, why)
            self.store.update_action(entry.id, status=ActionStatus.INTENT, deadline=None,
                                     result={**entry.result, "approved_by": who})
            entry.status, entry.deadline = ActionStatus.INTENT, None
            entry.result = {**entry.result, "approved_by": who}
            if entry.decision_id is not None:
                self.store.set_decision(entry.decision_id, "pending", f"approved by {who}{why}: {what}")
            h.on_answer(entry, True)
            return True
        if answer.get("expired"):
            limit = h.approve_timeout_s
            outcome = (f"denied: nobody approved it within {duration_text(limit)} (--approve-timeout); "
                       f"not carried out: {what}; the run carries on")
        else:
            outcome = f"denied by {who}{why}: not carried out: {what}; the run carries on"
        self.notifier.notify(resolved)
        announced = self.notifier.notify(alert_payload(
            run, rule, str(p.get("severity") or "critical"), f"{rule}: {outcome}",
            entry.result.get("why", ""), now=now, mode="denied"))
        log.warning("%s: %s", run, outcome)
        result = {**entry.result, "outcome": outcome, "announced": announced}
        self.store.update_action(entry.id, status=ActionStatus.DENIED, deadline=None, result=result)
        entry.status, entry.result = ActionStatus.DENIED, result
        if entry.decision_id is not None:
            self.store.settle_decision(entry.decision_id)
        self._said(h, entry, ActionStatus.DENIED.value)
        h.on_answer(entry, False)
        return False

    def _hold(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        """Hold ``entry`` for a person: the checkpoint a rollback would go to is chosen now (and kept from
        pruning while it waits: the payload's ``chosen_step``), and what waits, why, what it would
        cost and the exact commands go to the console and the webhook (label ``mode="approve"``)."""
        p = dict(entry.payload)
        checkpoint = self._advised_checkpoint(h, entry)
        if entry.kind == JournalKind.ROLLBACK:
            p["chosen_step"] = checkpoint.step if checkpoint is not None else None
        what = advice_text(entry.kind, p, checkpoint, h.dialect.live).removeprefix("would ")
        decision = self.store.get_decision(entry.decision_id) if entry.decision_id is not None else None
        why = str(p.get("reason") or p.get("verdict") or "")
        if decision is not None:
            evidence = evidence_text(decision["inputs"])
            said = decision["message"] or f"{decision['rule']} at step {decision['step']}"
            why = "; ".join(x for x in (said, evidence and f"evidence {evidence}", why) if x)
        cost = p.get("cost")
        priced = Cost(**cost).describe() if isinstance(cost, Mapping) else "not priced"
        target = f"{shlex.quote(h.run.run_id)}" + (f" {entry.decision_id}" if entry.decision_id is not None else "")
        state = shlex.quote(str(self.store.path.parent))
        limit = h.approve_timeout_s
        commands = (f"approve: watchdog approve {target} --state-dir {state}; deny: watchdog deny {target} "
                    f"--state-dir {state}; unanswered, it is denied in {duration_text(limit)}")
        deadline = now + limit
        result = {**entry.result, "outcome": f"waits for approval: {what}", "would": what, "why": why,
                  "priced": priced}
        self.store.update_action(entry.id, status=ActionStatus.AWAITING, deadline=deadline, payload=p, result=result)
        entry.status, entry.deadline, entry.payload, entry.result = ActionStatus.AWAITING, deadline, p, result
        if entry.decision_id is not None:
            self.store.settle_decision(entry.decision_id)
        log.warning("%s: waits for approval: %s. Why: %s. Cost: %s. To answer: %s", h.run.run_id, what,
                    why or "-", priced, commands)
        announced = self.notifier.notify(alert_payload(
            h.run.run_id, str(p.get("rule", "")), str(p.get("severity") or "critical"), f"approval needed: {what}",
            f"Why: {why or '-'}. Cost: {priced}. To answer: {commands}.", now=now, mode="approve"))
        self.store.update_action(entry.id, result={**result, "announced": announced})
        entry.result = {**result, "announced": announced}
        self._said(h, entry, ActionStatus.AWAITING.value)

    def _advised_checkpoint(self, h: RunHandle, entry: ActionRecord) -> Any | None:
        """The checkpoint a relaunch of ``entry`` would resume from (read, nothing moved or kept)."""
        if entry.kind == JournalKind.ROLLBACK:
            return self._chosen_checkpoint(h, entry.payload) or self._resolve_checkpoint(h, "known_good")
        if entry.kind == JournalKind.RESTART and entry.payload.get("resume") != "scratch":
            return self._resolve_checkpoint(h, str(entry.payload.get("resume", "latest")))
        return None

    def _drive_live_set(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        if not h.dialect.live and entry.status == ActionStatus.INTENT:
            self._drive_zero_patch(h, entry)
            return
        if entry.status == ActionStatus.INTENT:
            if entry.control_version is None:
                overrides = {**h.run.overrides, **entry.payload.get("set", {})}
                entry.control_version = self.reserve_version(h, entry, overrides)
            self._send(h, entry, entry.control_version, now)
            return
        if entry.status == ActionStatus.SENT and entry.deadline is not None and now > entry.deadline:
            if h.proc is not None and h.proc.alive():
                # The run's controller restarts instead, counted against its restart budget.
                message = f"control v{entry.control_version} not applied within {self.config.live_timeout_s:g} s"
                rid = h.on_live_timeout(entry, message)
                if rid is None:
                    self._finish(h, entry, "failed", error=f"{message}; restart budget exhausted")
                else:
                    self._finish(h, entry, "done", outcome=f"v{entry.control_version} timed out: applied by restart",
                                 handed_to=rid)

    _drive_command = _drive_live_set

    def _send(self, h: RunHandle, entry: ActionRecord, version: int, now: float, extra_s: float = 0.0) -> None:
        """Write control.json at the entry's ``version``, signal the trainer, and wait for its ``applied`` (SENT)
        ``live_timeout_s`` (and ``extra_s`` more)."""
        self.write_control(h, version)
        self.crash_hook("control_written")
        self._signal(h)
        self.crash_hook("signalled")
        deadline = now + self.config.live_timeout_s + max(0.0, extra_s)
        self.store.update_action(entry.id, status=ActionStatus.SENT, deadline=deadline)
        entry.status, entry.deadline = ActionStatus.SENT, deadline

    def _drive_zero_patch(self, h: RunHandle, entry: ActionRecord) -> None:
        """What a live entry becomes for a trainer that reads no control.json (unmodified verl)."""
        kind = "set" if entry.kind == JournalKind.LIVE_SET else (entry.payload.get("command") or {}).get("kind", entry.kind)
        if kind in ("set", "resume"):
            rid = self.store.add_action(h.run.run_id, "restart", {
                "rule": entry.payload.get("rule", ""), "resume": "latest", "set": dict(entry.payload.get("set", {})),
                "reason": f"{kind} in zero-patch mode (verl changes nothing in process)",
            }, decision_id=entry.decision_id)
            self._finish(h, entry, "done", outcome=f"by restart (journal {rid}): verl changes nothing in process",
                         handed_to=rid)
        elif kind == "pause":
            code = self.stop(h)
            self._finish(h, entry, "done", outcome=f"trainer stopped (exit {code}): verl cannot pause in place; "
                                                    "`watchdog resume` restarts it from its latest checkpoint")
        else:
            self._finish(h, entry, "failed", error=f"{kind}: verl reads no control.json (zero-patch mode)")

    def _drive_notify(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        p = entry.payload
        payload = alert_payload(h.run.run_id, p.get("rule", ""), p.get("severity", ""), p.get("summary", ""),
                                p.get("description", ""), now=now)
        self._finish(h, entry, "done", outcome=self.notifier.notify(payload, quiet=self._watched))

    def _drive_restart(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        p = dict(entry.payload)
        if "resume_path" not in p:
            # Resolve and record the checkpoint before acting: a re-drive uses the same one.
            info = self._resolve_checkpoint(h, p.get("resume", "latest"))
            p["resume_path"] = str(info.path) if info else None
            p["resume_step"] = info.step if info else None
            if p.get("set"):
                p["set"] = self._snap(h, p["set"])
            self.store.update_action(entry.id, payload=p)
            entry.payload = p
        if "lr_patch" not in p and "refused" not in p:
            # verl's resume trap: the checkpoint's lr wins over optim.lr. Its dialect resumes from a copy
            # that carries the new lr, or refuses the lr change (audited) rather than lose it silently.
            try:
                if p.get("resume_path") and "stopped_ts" not in p:
                    self._check_resumable(h, p["resume_path"], p.get("resume_step"))
                planned = h.dialect.plan_resume(p, {**h.run.overrides, **p.get("set", {})})
            except (FileNotFoundError, ckpt.CheckpointError) as exc:  # removed, or it cannot be loaded
                self._fall_back(h, entry, p, exc)
                return  # nothing was stopped yet: the next drive plans the relaunch from the fallback
            if planned != p:
                p = planned
                self.store.update_action(entry.id, payload=p)
                entry.payload = p
            if p.get("refused") and not p.get("set") and p.get("resume") == "latest" \
                    and h.proc is not None and h.proc.alive():
                self._finish(h, entry, "failed", error=p["refused"])  # nothing left worth a restart
                return
        rewinding = p.get("resume") in ("known_good", "path", "scratch")
        skip = int(p.get("skip_batches") or 0) if rewinding and p["resume_path"] else 0
        if not h.run.command:  # a watched run: its trainer is left as it is, a human restarts it
            raise ActuatorError(f"a watched run has no command to relaunch; restart it yourself"
                                f"{' from ' + str(p['resume_path']) if p.get('resume_path') else ''}")
        if "launched_pid" not in p and "stopped_ts" in p and h.run.pid not in (None, p.get("stopped_pid")):
            # Killed between the launch's commit and this entry's: the run row already holds the new trainer.
            p.update(launched_pid=h.run.pid)
            self.store.update_action(entry.id, payload=p)
        if "launched_pid" not in p:
            if "stopped_ts" not in p:
                p.update(trained_to=h.run.last_step, stopped_pid=h.run.pid)
                h.dialect.stopping(p.get("resume_step"))
                p["stop_exit"] = self.stop(h)
                p["stopped_ts"] = time.time()
                self.store.update_action(entry.id, payload=p)
                self.crash_hook("stopped")
            else:
                self.stop(h)  # a re-drive: whatever is left of the stopped trainer
            if p.get("resume") == "scratch":
                # Start over from the initial weights: nothing saved on the abandoned timeline (the
                # stopped trainer's SIGTERM checkpoint included) may be resumed by a later restart.
                moved = ckpt.set_aside(h.dialect.checkpoint_root, f"{entry.id}")
                if moved is not None:
                    p["set_aside"] = str(moved)
                    self.store.update_action(entry.id, payload=p)
            overrides = {k: v for k, v in {**h.run.overrides, **p.get("set", {})}.items()
                         if k not in p.get("refused_keys", ())}
            version = self.reserve_version(h, None, overrides)
            self.write_control(h, version)
            # A trainer that names a key skips by argument; verl's dialect moved its dataloader state in the
            # resume checkpoint instead (``skip_patch``) or said why not (``skip_note``).
            skip_arg = skip_batches_arg(h.run.run_dir, skip) if skip and not p.get("skip_patch") else None
            if skip and skip_arg is None and not p.get("skip_patch") and not p.get("skip_note"):
                p["skip_note"] = f"skip_batches={skip} not done (the trainer offers no key for it)"
            # launch() commits the new pid first: a watchdog killed from then on finds a pid other than
            # ``stopped_pid`` and adopts that trainer instead of launching a second (exactly once; RELIABILITY.md).
            self.launch(h, p["resume_path"], now, once=[skip_arg] if skip_arg else (),
                        fresh=p.get("resume") == "scratch", resume_step=p.get("resume_step"))
            p.update(launched_pid=h.run.pid, version=version)
            self.store.update_action(entry.id, payload=p)
            entry.payload = p
            self.crash_hook("launched")
        code, version, stopped_ts = p.get("stop_exit"), p.get("version", h.run.control_version), p["stopped_ts"]
        if rewinding and p.get("resume_step") is not None:
            # Went back past the divergence: checkpoints of these steps written from now on are re-runs.
            self.store.close_bad_spans(h.run.run_id, max(h.run.last_step or 0, int(p["resume_step"])))
        # Live entries older than this restart are carried by it (their overrides are in the args).
        for other in self.store.open_actions(h.run.run_id):
            if other.id != entry.id and other.kind == JournalKind.LIVE_SET:
                self._finish(h, other, "done", outcome=f"applied by restart (v{version})", carried_by=entry.id)
        where = ("the start" if p.get("resume") == "scratch" else
                 f"step {p['resume_step']}" if p.get("resume_step") is not None else "scratch")
        notes = "".join(f"; {p[k]}" for k in ("fallback", "lr_patch", "refused", "skip_patch", "skip_note")
                        if p.get(k) and p[k] != "none needed")
        if skip and not p.get("skip_note") and not p.get("skip_patch"):
            notes += f"; skipped {skip} batches"
        who = f"ray job {h.run.job_id}" if h.run.job_id else f"pid {h.run.pid}"
        self._finish(h, entry, "done", outcome=f"restarted from {where} ({who}, prior exit {code}){notes}",
                     pid=h.run.pid, job_id=h.run.job_id, resume_step=p.get("resume_step"), exit_code=code,
                     stopped_ts=stopped_ts, steps_lost=_steps_lost(p.get("trained_to"), p.get("resume_step")))

    def _check_resumable(self, h: RunHandle, path: str, step: Any) -> None:
        """Raise FileNotFoundError when the checkpoint a relaunch resumes from is gone, CheckpointError when it
        cannot be loaded: it failed verification (:meth:`Dialect.verify`) or a trainer died loading it before."""
        if not Path(path).exists():
            raise FileNotFoundError(errno.ENOENT, "no longer there", path)
        if isinstance(step, int) and self._unloadable(h, step, Path(path)):
            raise ckpt.CheckpointError(path, "a trainer could not load it before")
        h.dialect.verify(path)

    def _unloadable(self, h: RunHandle, step: int, path: Path) -> bool:
        """Was the checkpoint of ``step`` at ``path`` found unloadable (:meth:`Store.mark_unloadable`)?"""
        try:
            ts: float | None = max((f.stat().st_mtime for f in path.iterdir()), default=path.stat().st_mtime)
        except OSError:
            ts = None
        return any(s.rule == UNLOADABLE and s.covers(step, ts) for s in self.store.bad_spans(h.run.run_id))

    def _fall_back(self, h: RunHandle, entry: ActionRecord, p: dict[str, Any],
                   exc: OSError | ckpt.CheckpointError) -> None:
        """The one checkpoint fallback of a relaunch, for every trainer: its checkpoint vanished while it was
        prepared (removed by hand or by a pruning, before or during its relaunch copy), failed verification, or
        a trainer died loading it (:meth:`resume_failed`). It goes to the newest complete checkpoint before it
        (for a rollback, the newest still known-good), else the start; one that cannot be loaded is recorded
        (:meth:`Store.mark_unloadable`), so no relaunch goes there again; recorded in the entry and said to the
        console and the webhook. Nothing was stopped yet, so the next drive plans (and verifies) the relaunch
        from there."""
        gone, step = str(p.get("resume_path")), p.get("resume_step")
        if isinstance(exc, ckpt.CheckpointError) and isinstance(step, int):
            self.store.mark_unloadable(h.run.run_id, step)
        spans = self.store.bad_spans(h.run.run_id)
        older = [c for c in h.dialect.checkpoints() if c.complete and str(c.path) != gone
                 and (step is None or c.step < int(step))
                 and not any(s.rule == UNLOADABLE and s.covers(c.step, c.ts) for s in spans)]
        rewinding = p.get("resume") in ("known_good", "path")
        info = (choose_known_good(older, spans) if rewinding
                else max(older, key=lambda c: c.step, default=None))
        if info is not None:
            p.update(resume_path=str(info.path), resume_step=info.step)
            where = f"the checkpoint before it, step {info.step}"
        elif rewinding:
            p.update(resume="scratch", resume_path=None, resume_step=0)
            where = "the start (the initial weights: no earlier known-good checkpoint)"
        elif isinstance(exc, ckpt.CheckpointError):
            # Not "no resume argument": a trainer resuming on its own (verl's resume_mode auto) would find this
            # one again. The start, with what was saved set aside.
            p.update(resume="scratch", resume_path=None, resume_step=0)
            where = "the start (the initial weights: no earlier checkpoint)"
        else:
            p.update(resume_path=None, resume_step=None)
            where = "the start (no earlier checkpoint)"
        for key in ("lr_patch", "refused", "refused_keys", "checkpoint_path"):
            p.pop(key, None)  # planned for the checkpoint given up: planned again for the fallback
        if isinstance(exc, ckpt.CheckpointError):
            what, summary = f"cannot be loaded ({exc})", f"checkpoint of step {step} cannot be loaded"
        else:
            what = f"vanished while the relaunch was prepared ({exc.filename or gone}: {exc.strerror or exc})"
            summary = f"checkpoint of step {step} vanished"
        p["fallback"] = f"the checkpoint of step {step} ({gone}) {what}; resumed from {where} instead"
        self.store.update_action(entry.id, payload=p)
        entry.payload = p
        log.error("%s: %s", h.run.run_id, p["fallback"])
        self.notifier.notify(alert_payload(h.run.run_id, str(p.get("rule", "")), "warning",
                                           f"{summary}: relaunch falls back", p["fallback"]))

    def chose_resume(self, h: RunHandle, path: str) -> ActionRecord | None:
        """The restart of the watchdog's that launched the current attempt from the checkpoint at ``path`` (or
        from its patched copy there); None: the watchdog did not choose it (a person's own command named it)."""
        launched = next((e for e in reversed(self.store.journal(h.run.run_id)) if e.kind == JournalKind.RESTART
                         and h.run.pid is not None and e.payload.get("launched_pid") == h.run.pid), None)
        if launched is None or not isinstance(launched.payload.get("resume_step"), int):
            return None
        p = launched.payload
        named = {str(Path(x).resolve()) for x in (p.get("resume_path"), p.get("checkpoint_path")) if x}
        return launched if str(Path(path).resolve()) in named else None

    def resume_failed(self, h: RunHandle, launched: ActionRecord, why: str, decision_id: int | None) -> int:
        """The current attempt, launched by ``launched`` (:meth:`chose_resume`), died loading its checkpoint (an
        ``error`` event, ``what: resume``): that checkpoint is recorded unloadable and a new restart goes to the
        one before it (:meth:`_fall_back`, the same policy as a checkpoint that fails verification when the
        restart is driven). Returns the new restart's journal id."""
        p = launched.payload
        source = str(p.get("checkpoint_path") or p["resume_path"])
        payload: dict[str, Any] = {k: p[k] for k in ("rule", "resume", "set", "skip_batches", "reason") if k in p}
        payload.update(resume_path=source, resume_step=p["resume_step"], resume_error=why)
        self.store.mark_unloadable(h.run.run_id, int(p["resume_step"]))
        log.error("%s: the trainer could not load %s: %s", h.run.run_id, source, why)
        return self.store.add_action(h.run.run_id, "restart", payload, decision_id=decision_id)

    def _drive_stop(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        """Nothing is left to try and no human waits: stop the trainer and end the run with a verdict."""
        code = self.stop(h)
        verdict = str(entry.payload.get("verdict", "escalated"))
        h.run.phase = Phase.STOPPED
        self.store.update_run(h.run.run_id, phase=Phase.STOPPED)
        log.warning("%s: run stopped by the watchdog: %s", h.run.run_id, verdict)
        self._finish(h, entry, "done", outcome=f"run stopped (trainer exit {code}): {verdict}", exit_code=code)

    def _chosen_checkpoint(self, h: RunHandle, payload: Mapping[str, Any]) -> Any | None:
        """The checkpoint a rollback that waited for approval chose when it was held (None: none chosen, or
        it is not complete any more)."""
        step = payload.get("chosen_step")
        if not isinstance(step, int):
            return None
        found = next((c for c in h.dialect.checkpoints() if c.complete and c.step == step), None)
        if found is None:
            log.warning("%s: the step-%d checkpoint chosen for the rollback is gone: the last known-good instead",
                        h.run.run_id, step)
        return found

    def _drive_rollback(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        p = dict(entry.payload)
        if entry.status == ActionStatus.INTENT:
            # Approved after waiting: the checkpoint chosen when it was decided, not one found since.
            info = self._chosen_checkpoint(h, p) or self._resolve_checkpoint(h, "known_good")
            unwatched = [] if info else [s for s in self.store.bad_spans(h.run.run_id) if s.rule == UNWATCHED]
            if unwatched:
                # The watchdog started on a run already under way (or resumed from an unwatched one): it
                # never saw the run healthy before its first step, so neither an earlier checkpoint nor the
                # initial weights are a state it can vouch for. A human decides.
                first = max(s.end_step or 0 for s in unwatched) + 1
                self._finish(h, entry, "failed", error=f"no known-good checkpoint to roll back to: the watchdog "
                                                       f"first saw this run at step {first}, and no checkpoint "
                                                       "since then was taken while it looked healthy")
                return
            if info is None:
                # No checkpoint predates the divergence (none yet, or each one was taken while a divergence
                # rule fired: one step after the first checkpoint, the rules' margin makes it suspect): the
                # initial weights (the SFT model, which is also the reference) are the oldest known-good
                # state. Start over with the sets; the suspect checkpoints are set aside, out of any resume.
                latest = self._resolve_checkpoint(h, "latest")
                why = ("no checkpoint yet" if latest is None else
                       f"no known-good checkpoint (the newest, step {latest.step}, and any before it were "
                       "taken while diverging)")
                p.update(resume="scratch", resume_path=None, resume_step=0)
                if p.get("set"):
                    p["set"] = self._snap(h, p["set"])
                restart_id = self.store.add_action(h.run.run_id, "restart", p, decision_id=entry.decision_id)
                self._finish(h, entry, "done", outcome=f"by restart from the start (journal {restart_id}): {why}",
                             handed_to=restart_id)
                return
            p.update(resume_path=str(info.path), resume_step=info.step)
            if not restores_in_process(h):
                # No live trainer that restores in process (dead; verl, which reads no control.json; or
                # a trainer whose run.json leaves rollback out of its commands): a restart from that
                # checkpoint carries the sets.
                p["resume"] = "path"
                restart_id = self.store.add_action(h.run.run_id, "restart", p, decision_id=entry.decision_id)
                self._finish(h, entry, "done", outcome=f"by restart (journal {restart_id}) to step {info.step}",
                             handed_to=restart_id)
                return
            cmd = {"id": f"rb{entry.id}", "kind": "rollback", "path": str(info.path), "to_step": info.step,
                   "skip_batches": int(p.get("skip_batches", 0))}
            if p.get("set"):
                # Applied with the restore (a trainer that can: the verl glue), not one step later: the
                # checkpoint brings its own lr back, and the first restored step would train at it.
                cmd["set"] = self._snap(h, p["set"])
            p["command"] = cmd
            self.store.update_action(entry.id, payload=p)
            entry.payload = p
            entry.control_version = self.reserve_version(h, entry, dict(h.run.overrides))
            # A restore in process may take as long as the relaunch it replaces (which loads the same
            # checkpoint after its start-up): past that, the relaunch.
            startup = h.run.startup_s if h.run.startup_s is not None else DEFAULT_STARTUP_S
            self._send(h, entry, entry.control_version, now, extra_s=startup)
            return
        if entry.status == ActionStatus.SENT and entry.payload["command"]["id"] in h.applied_commands:
            sets = self._snap(h, p.get("set", {}))
            if sets:
                # Follow-on sets only now: restoring the checkpoint also restores the old lr / kl_coef.
                self.store.add_action(h.run.run_id, "live_set", {"set": sets, "rule": p.get("rule", ""),
                                                                 "follows": JournalKind.ROLLBACK.value},
                                      decision_id=entry.decision_id)
            self._finish(h, entry, "done", outcome=f"rolled back in process to step {p['resume_step']}")
            return
        ended = entry.status == ActionStatus.SENT and (h.proc is None or not h.proc.alive())
        if ended or (entry.status == ActionStatus.SENT and entry.deadline is not None and now > entry.deadline):
            p.pop("command", None)
            p["resume"] = "path"
            rid = self.store.add_action(h.run.run_id, "restart", p, decision_id=entry.decision_id)
            why = ("the trainer ended before rolling back in process: re-running the tail by restart" if ended
                   else f"the trainer could not roll back in process ({p['refused_in_process']}): by restart"
                   if p.get("refused_in_process") else "in-process rollback timed out: by restart")
            self._finish(h, entry, "done", outcome=f"{why} (journal {rid}) from step {p.get('resume_step')}",
                         handed_to=rid)

    def _drive_resume(self, h: RunHandle, entry: ActionRecord, now: float) -> None:
        if entry.status == ActionStatus.INTENT and "command" not in entry.payload:
            p = {**entry.payload, "command": {"id": f"rs{entry.id}", "kind": "resume"}}
            self.store.update_action(entry.id, payload=p)
            entry.payload = p
            h.run.phase = Phase.RUNNING
            h.run.last_progress_ts = now
            self.store.update_run(h.run.run_id, phase=Phase.RUNNING, last_progress_ts=now)
        if entry.status == ActionStatus.SENT and entry.payload["command"]["id"] in h.applied_commands:
            self._finish(h, entry, "done", outcome="resumed")
            return
        self._drive_live_set(h, entry, now)

    def confirm(self, h: RunHandle, version: int, step: int | None, command_ids: Sequence[str],
                refusals: Sequence[str] = (), foreign: Mapping[str, Any] | None = None) -> list[ActionRecord]:
        """The trainer's ``applied`` event: confirm every sent entry carried by ``version``. ``refusals``:
        the trainer's ``error`` messages about that version (a key it cannot change live, and why); a
        live set whose key one names says so in its outcome (``watchdog history``).

        ``foreign``: the overrides of a version the watchdog did not write (by hand, maybe over its own at
        that number). An entry counts as applied by it only when it carries what the entry asked (a set's
        values, a command's id); an entry it left out is re-opened (``intent``, no version) to be sent again
        in a new version above it. Returns the entries re-opened."""
        h.applied_commands.update(command_ids)
        if foreign is None:  # (a foreign version is no version the watchdog wrote, even at the same number)
            self.store.mark_control_applied(h.run.run_id, version, step)
        reopened = []
        for e in self.store.open_actions(h.run.run_id):
            # An ``intent`` with a version is confirmed too: the trainer applied it, so the file was
            # written (the watchdog died between writing it and marking it sent).
            if e.status not in (ActionStatus.INTENT, ActionStatus.SENT) or e.control_version is None or e.control_version > version:
                continue
            cmd = e.payload.get("command")
            if foreign is not None and e.kind in (JournalKind.LIVE_SET, JournalKind.COMMAND, JournalKind.RESUME,
                                                  JournalKind.ROLLBACK):
                sets = (e.payload.get("set") or {}) if e.kind == JournalKind.LIVE_SET else {}
                if (cmd and cmd["id"] not in h.applied_commands) or any(
                        k not in foreign or foreign[k] != v for k, v in sets.items()):
                    self.store.update_action(e.id, status=ActionStatus.INTENT, control_version=None, deadline=None)
                    e.status, e.control_version, e.deadline = ActionStatus.INTENT, None, None
                    reopened.append(e)
                    continue
            if cmd and cmd["id"] not in h.applied_commands:
                if (e.kind == JournalKind.ROLLBACK and foreign is None and e.status == ActionStatus.SENT
                        and e.control_version == version):
                    # The trainer applied the version and left the rollback out: it cannot restore this checkpoint
                    # in process (``check_rollback``). By restart at the next drive, not after the deadline.
                    why = next((m for m in refusals if cmd["id"] in m), "not confirmed with its version")
                    p = {**e.payload, "refused_in_process": why}
                    self.store.update_action(e.id, payload=p, deadline=0.0)
                    e.payload, e.deadline = p, 0.0
                continue
            if e.kind in (JournalKind.LIVE_SET, "command", JournalKind.RESUME):
                refused = [m for m in refusals if any(k in m for k in (e.payload.get("set") or {}))]
                outcome = f"applied v{version} at step {step}" + "".join(f"; refused by the trainer: {m}" for m in refused)
                self._finish(h, e, "done", outcome=outcome, applied_step=step)
        return reopened

    # -- helpers ---------------------------------------------------------------------

    def _resolve_checkpoint(self, h: RunHandle, which: str) -> Any | None:
        spans = [s for s in self.store.bad_spans(h.run.run_id) if s.rule == UNLOADABLE]
        infos = [c for c in h.dialect.checkpoints() if c.complete and not any(s.covers(c.step, c.ts) for s in spans)]
        if which == "known_good":
            return choose_known_good(infos, self.store.bad_spans(h.run.run_id))
        return max(infos, key=lambda c: c.step) if infos else None

    def _snap(self, h: RunHandle, sets: dict[str, Any]) -> dict[str, Any]:
        """Micro-batch sizes must divide their share of the batch (each data-parallel rank's, for verl);
        round down to one that does."""
        return snap_sets(sets, run_config(h.run.run_dir), run_world_size(h.run.run_dir))


def needs_approval(h: RunHandle, kind: str, payload: Mapping[str, Any]) -> bool:
    """An entry of a kind the run's ``--approve`` names, not answered yet (one handed on from an approved
    entry, a rollback's restart, carries its answer). Advise mode carries out nothing, so holds nothing."""
    return (bool(h.approve) and not h.advise and approval_kind(kind, payload) in h.approve
            and "answer" not in payload)


def advice_text(kind: str, payload: Mapping[str, Any], checkpoint: Any | None, live: bool = True) -> str:
    """What a journal entry would do, in words ("would roll back to step 55 ..."): advise mode's outcome."""
    sets = payload.get("set") or {}
    then = f", then set {sets_text(sets, payload.get('from') or {})}" if sets else ""
    skip = int(payload.get("skip_batches") or 0)
    skipped = f", skipping {skip} batch{'es' if skip != 1 else ''}" if skip else ""
    why = f" ({payload['reason']})" if payload.get("reason") else ""
    if kind == JournalKind.ROLLBACK:
        if checkpoint is None:
            return f"would restart from the start (no known-good checkpoint){then}"
        return f"would roll back to step {checkpoint.step} (the last known-good checkpoint){skipped}{then}"
    if kind == JournalKind.RESTART:
        where = ("the start" if payload.get("resume") == "scratch" or checkpoint is None
                 else f"step {checkpoint.step}")
        with_sets = f" with {sets_text(sets, payload.get('from') or {})}" if sets else ""
        return f"would restart from {where}{with_sets}{why}"
    if kind == JournalKind.LIVE_SET:
        how = "live (a new control.json version)" if live else "by restart from the latest checkpoint"
        return f"would set {sets_text(sets, payload.get('from') or {})} {how}"
    if kind in (JournalKind.COMMAND, JournalKind.RESUME):
        cmd = str((payload.get("command") or {}).get("kind") or kind)
        reason = f": {payload['reason']}" if payload.get("reason") else ""
        return {"pause": f"would pause the run for a human{reason}", "resume": "would resume the run",
                "checkpoint": "would ask the trainer for a checkpoint"}.get(cmd, f"would send the command {cmd}")
    if kind == JournalKind.STOP:
        return f"would stop the run: {payload.get('verdict', 'escalated')}"
    if kind == JournalKind.NOTIFY:
        return f"would alert: {payload.get('summary', '')}".rstrip(": ")
    return f"would carry out a {kind}"


def _steps_lost(trained_to: int | None, resume_step: int | None) -> int:
    """Steps the relaunch trains again: from the checkpoint it resumes to where the trainer was."""
    if trained_to is None:
        return 0
    return max(0, trained_to - (resume_step or 0))


def skip_batches_arg(run_dir: str | Path, n: int) -> str | None:
    """``KEY=n`` for the key the trainer's run.json offers for skipping batches on resume, else None.

    verl has no such key (Hydra rejects unknown keys), so it is passed only when the trainer asks
    for it by name; the embedded trainer names ``trainer.resume_skip_batches``.
    """
    key = RunInfo.read(run_dir).skip_batches_key
    return hydra.format_override(key, int(n)) if key and n > 0 else None


def restores_in_process(h: RunHandle) -> bool:
    """Whether a rollback now goes in process: a live trainer that reads control.json and restores a checkpoint
    itself (run.json's ``commands``, all when absent)."""
    if h.proc is None or not h.proc.alive() or not h.dialect.live:
        return False
    commands = RunInfo.read(h.run.run_dir).commands
    return commands is None or "rollback" in commands


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The trainer's config snapshot from run.json (empty when absent)."""
    return RunInfo.read(run_dir).config


def run_world_size(run_dir: str | Path) -> int | None:
    """GPUs a verl run's data-parallel ranks spread over: run.json's ``world_size`` (the zero-patch
    glue's, verl's 8 x 1 by default), else ``trainer.n_gpus_per_node x trainer.nnodes`` of the
    trainer's config (the in-process glue's); None for a one-process trainer (the embedded one)."""
    info = RunInfo.read(run_dir)
    if info.world_size:
        return int(info.world_size)
    gpn, nodes = config_value(info.config, "trainer.n_gpus_per_node"), config_value(info.config, "trainer.nnodes")
    if isinstance(gpn, int) and not isinstance(gpn, bool) and gpn > 0:
        return gpn * (nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else 1)
    return None


def launch_clip_bounds(run_dir: str | Path, overrides: Mapping[str, Any]) -> dict[str, float]:
    """The clip bounds a relaunch passes beside an overridden ``clip_ratio`` (verl reads the bounds,
    not ``clip_ratio``): moved from the run's config by the same factor; verl's 0.2 where a zero-patch
    run's command does not set them (:func:`ppo_watchdog.core.planner.clip_bound_sets`)."""
    if CLIP_RATIO_KEY not in overrides:
        return {}
    info = RunInfo.read(run_dir)
    defaults = ({CLIP_RATIO_KEY: VERL_CLIP_DEFAULT, CLIP_LOW_KEY: VERL_CLIP_DEFAULT, CLIP_HIGH_KEY: VERL_CLIP_DEFAULT}
                if info.zero_patch else {})
    return clip_bound_sets(overrides, info.config, defaults)



