"""The watchdog process: many runs, one APScheduler 3.x interval job calling ``tick(now)``.

The scheduler only calls :meth:`Watchdog.tick`; everything it does is in the controller,
so tests drive ``tick`` directly and the daemon adds nothing but timing. The job runs
with ``max_instances=1`` (a slow tick is never overlapped by the next), ``coalesce=True``
(ticks missed while one ran collapse into one) and a ``misfire_grace_time``.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import re
import stat
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ppo_watchdog.backends.local import Backend, LocalBackend, SupervisorError, TrainerAlive, not_the_trainer
from ppo_watchdog.backends.zero_patch import (
    MODE_VERL,
    MODES,
    RunSetup,
    VerlModeError,
    resolve_mode,
    setup_run,
)
from ppo_watchdog.control.actuator import (
    Actuator,
    ActuatorConfig,
    Notifier,
    OnAction,
    alert_payload,
    check_approve,
    resolve_webhook_url,
    webhook_target,
)
from ppo_watchdog.control.controller import (
    DONE_PHASES,
    RULE_TICK,
    ControllerConfig,
    EngineRules,
    RulesEngine,
    RunController,
    TickResult,
    read_and_evaluate_all,
)
from ppo_watchdog.control.shards import (
    MAX_SHARDS,
    NotStartedBySupervisor,
    ShardSupervisor,
    die_with_supervisor,
    shard_of,
    supervisor_alive,
    tick_phase,
)
from ppo_watchdog.control.store import Phase, RunRecord, Store, StoreError
from ppo_watchdog.core.planner import ON_ESCALATE
from ppo_watchdog.core.rulefile import rule_paths as resolve_rule_paths
from ppo_watchdog.observe.telemetry import WatchdogMetrics
from ppo_watchdog.protocol import inputs, rundir
from ppo_watchdog.protocol import lock as locks
from ppo_watchdog.sources.prometheus import SOURCES, SourceConfig, make_source, source_config

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = ".watchdog"

#: The largest daemon config read (a config of a thousand runs is about 100 KB; past this it is not one).
CONFIG_MAX_BYTES = 16 * 2**20


def state_dir_default() -> str:
    """``$WATCHDOG_STATE_DIR`` or ``./.watchdog``."""
    return os.environ.get("WATCHDOG_STATE_DIR", DEFAULT_STATE_DIR)


#: Runs whose reads and decisions share one SQLite transaction in a tick (one commit per this many runs
#: instead of one per run; what a failed commit makes the tick undo in memory is bounded by it).
DECIDE_CHUNK = 256

#: ``watchdog run`` gives its run up once this many ticks in a row failed the same way (30 s at its default
#: ``--tick`` of 1 s): long enough for weather (a store locked, a metric source restarting) to pass.
STUCK_TICKS = 30

#: Runs read and screened together (their rules' steps in lockstep, one screen pass a step over all of them),
#: then written :data:`DECIDE_CHUNK` at a time. A screen pass costs per node as well as per run: the rules of
#: 1,000 runs took 34.3 ms a step screened 1,024 at a time against 40.4 ms 256 at a time, 10,000 runs 341
#: against 476 ms (bench/results/rules_bench.md, ``--screen-chunk 256``). What a tick holds read but not yet
#: written is bounded by it.
READ_GROUP = 4 * DECIDE_CHUNK


#: Allocations between two passes of the cyclic garbage collector over the youngest objects, in a daemon
#: (CPython's default: 700). At 1,000 runs and four steps a run a tick, 10,000 took the middle generation's
#: passes from about 70 to none in 15 ticks and the collector's time inside a tick from 17-20 ms to 14-17 ms
#: (bench/results/daemon_scale.md, issue 22's seventh pass).
GC_YOUNG_EVERY = 10_000

#: How often a daemon's cyclic garbage collector makes a full pass over what earlier ticks left alive
#: (seconds), after a tick's work (:meth:`Watchdog._freeze_survivors`).
FULL_GC_EVERY_S = 3600.0


def real_path(path: Path | str) -> Path:
    """``path`` with its symlinks resolved; where they cannot be (a symlink loop), made absolute as it is (what
    the daemon files a run it cannot watch under, and shards it by; :meth:`Watchdog.add_run` says why)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # (Python 3.11's resolve raises RuntimeError on a loop)
        return Path(os.path.abspath(path))


class DaemonConfigError(ValueError):
    """The daemon's config file is invalid; names the file and the key."""


@dataclass
class RunSpec:
    """One run directory the daemon watches."""

    run_dir: str
    """The run directory (written by a trainer the daemon may not have started)."""
    id: str | None = None
    """Run id (default: the directory's name)."""
    restart_command: list[str] | None = None
    """Command that relaunches the trainer; without it the run gets live actions only."""
    ray_address: str | None = None
    """Ray job server (``http://HEAD:8265``): the restart command runs there as a Ray Job."""
    ray_token_file: str | None = None
    """A file holding that cluster's auth token (default: where Ray looks: $RAY_AUTH_TOKEN,
    $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token). Read at each connection; the token goes nowhere else."""
    source: str | None = None
    """Where this run's metrics are read from: files | prometheus (default: the daemon's ``source``)."""
    prometheus_url: str | None = None
    """Prometheus for this run (default: the daemon's ``prometheus_url``)."""
    mode: str = "auto"
    """auto | embedded | verl, as ``watchdog run --mode``. verl (zero-patch): the restart_command is an
    unmodified ``python -m verl.trainer.main_ppo ...``; the daemon relays verl's file logger and makes
    every change a restart with resume. auto: verl for a verl.trainer.main_ppo restart_command, else
    embedded; without a restart_command, what run.json already says."""
    run_metrics_port: int | None = None
    """verl mode: the daemon serves the run's metrics (catalog names) on 127.0.0.1:PORT (-1: any free
    port, written to run.json), as ``watchdog run --run-metrics-port``."""
    on_escalate: str | None = None
    """When this run needs a human: pause | stop | continue (default: the daemon's ``controller.on_escalate``,
    itself pause: a daemon has a human to page)."""
    advise: bool | None = None
    """Advise mode for this run: decide and announce what would be done, carry out nothing (default: the
    daemon's ``advise``)."""
    approve: list[str] | None = None
    """Actions of this run that wait for a person's ``watchdog approve`` or ``deny``: some of rollback,
    relaunch, pause, stop (default: the daemon's ``approve``; ``[]``: none)."""

    def shard_key(self) -> str:
        """What this run's shard is decided on: the id the daemon gives it, ``id`` else the directory's name
        (as :meth:`Watchdog.add_run` names a new run). Two runs whose ids could collide land in one process."""
        return self.id if self.id is not None else real_path(self.run_dir).name


@dataclass
class DaemonConfig:
    """``watchdog daemon --config FILE`` (YAML)."""

    runs: list[RunSpec] = field(default_factory=list)
    """Run directories to watch."""
    rules: list[str] = field(default_factory=list)
    """Rule files (default: $WATCHDOG_RULES, else the default pack); ``default`` names the shipped default pack, so
    ``[default, family.yaml]`` adds to it."""
    state_dir: str = field(default_factory=state_dir_default)
    """Where the SQLite state lives."""
    tick_s: float = 5.0
    """Seconds between ticks."""
    metrics_port: int | None = None
    """Port of the watchdog's own /metrics (None: off; 0: any free port)."""
    metrics_addr: str = "127.0.0.1"
    """Bind address of /metrics."""
    webhook_url: str | None = None
    """Alertmanager-compatible webhook for escalations (default: $WATCHDOG_WEBHOOK_URL_FILE's first line,
    else $WATCHDOG_WEBHOOK_URL). A secret: prefer ``webhook_url_file`` or the environment."""
    webhook_url_file: str | None = None
    """A file whose first line is the webhook URL."""
    controller: dict[str, Any] = field(default_factory=dict)
    """ControllerConfig fields (restart_budget, heartbeat_min_s, ...)."""
    actuator: dict[str, Any] = field(default_factory=dict)
    """ActuatorConfig fields (live_timeout_s, stop_grace_s, ...)."""
    source: str = "files"
    """Where runs' metrics are read from: ``files`` (run_dir/metrics.jsonl) or ``prometheus`` (its HTTP
    API; events still come from run_dir/events.jsonl)."""
    prometheus_url: str | None = None
    """Prometheus base URL for the prometheus source (default: $WATCHDOG_PROMETHEUS_URL)."""
    file_sd_dir: str | None = None
    """Prometheus file_sd directory where the prometheus source announces each run's trainer (None: not)."""
    grafana_url: str | None = None
    """Grafana for an annotation per action on the "PPO run" dashboard (default: $GRAFANA_URL; token from
    $GRAFANA_TOKEN_FILE or $GRAFANA_TOKEN, never from this file)."""
    advise: bool = False
    """Advise mode for every run (a run's own ``advise`` wins): each decision is made, priced, journaled and
    announced as what the watchdog would do, and none is carried out; the runs are never touched."""
    approve: list[str] = field(default_factory=list)
    """Actions that wait for a person's ``watchdog approve`` or ``deny`` in every run (a run's own ``approve``
    wins): some of rollback, relaunch, pause, stop; unanswered after ``controller.approve_timeout_s`` (30 min)
    they are denied."""
    shards: int = 1
    """Daemon processes sharing the runs (1 .. 256), all on the one state database: for more runs than one
    core ticks in time. The process started is shard 0 and starts shards 1..N-1 as its children; each run is
    watched by the one :func:`~ppo_watchdog.control.shards.shard_of` gives it. Shard K serves /metrics on
    ``metrics_port`` + K (0: each a free port)."""

    def __post_init__(self) -> None:
        if not self.tick_s > 0:
            raise DaemonConfigError(f"tick_s must be > 0, got {self.tick_s!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise DaemonConfigError(f"metrics_port must be 0 (any free port) .. 65535, got {self.metrics_port!r}")
        if self.source not in SOURCES:
            raise DaemonConfigError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        try:
            check_approve(self.approve)
        except ValueError as exc:
            raise DaemonConfigError(str(exc)) from exc
        if not (isinstance(self.shards, int) and not isinstance(self.shards, bool) and 1 <= self.shards <= MAX_SHARDS):
            raise DaemonConfigError(f"shards must be an integer from 1 to {MAX_SHARDS} (daemon processes), "
                                    f"got {self.shards!r}")
        # Shard K serves on metrics_port + K: the last one's port must exist too.
        if self.metrics_port and self.metrics_port + self.shards - 1 > 65535:
            raise DaemonConfigError(f"shards: {self.shards} processes serve /metrics on metrics_port "
                                    f"{self.metrics_port} .. {self.metrics_port + self.shards - 1}, past 65535")

    def for_shard(self, shard: int) -> DaemonConfig:
        """What one process of a sharded daemon watches, as a config of one process: its share of the runs,
        its /metrics port."""
        port = self.metrics_port + shard if self.metrics_port else self.metrics_port
        return replace(self, runs=[s for s in self.runs if shard_of(s.shard_key(), self.shards) == shard],
                       metrics_port=port, shards=1)

    def source_for(self, spec: RunSpec) -> SourceConfig:
        """The run's metric source: its own ``source``/``prometheus_url`` over the daemon's."""
        return source_config(spec.source or self.source, spec.prometheus_url or self.prometheus_url,
                             self.file_sd_dir)


def load_daemon_config(path: Path | str) -> DaemonConfig:
    """Parse the daemon YAML (safe_load); unknown keys are errors naming the file and key."""
    path = Path(path)
    try:
        doc = yaml.safe_load(inputs.read_text(path, CONFIG_MAX_BYTES, stream_ok=True)) or {}
    except OSError as exc:
        raise DaemonConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise DaemonConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8): not a daemon "
                                "config") from exc
    except yaml.YAMLError as exc:
        raise DaemonConfigError(f"{path}: {exc}") from exc
    except RecursionError as exc:  # PyYAML recurses once per nesting level
        raise DaemonConfigError(f"{path}: YAML nested too deeply (hundreds of levels): not a daemon config") from exc
    if not isinstance(doc, dict):
        raise DaemonConfigError(f"{path}: top level must be a mapping")
    _check_fields(path, "", doc, DaemonConfig)
    raw_runs = doc.get("runs", []) or []
    if not isinstance(raw_runs, list):
        raise DaemonConfigError(f"{path}: runs must be a list of run directories, got {inputs.short_repr(raw_runs, 60)}")
    runs = []
    for i, r in enumerate(raw_runs):
        if isinstance(r, str):
            r = {"run_dir": r}
        if not isinstance(r, dict) or "run_dir" not in r:
            raise DaemonConfigError(f"{path}: runs[{i}] needs a run_dir")
        _check_fields(path, f"runs[{i}].", r, RunSpec)
        runs.append(RunSpec(**r))
    for section, cls in (("controller", ControllerConfig), ("actuator", ActuatorConfig)):
        _check_fields(path, f"{section}.", doc.get(section, {}), cls)
        try:
            cls(**doc.get(section, {}))
        except (TypeError, ValueError) as exc:
            raise DaemonConfigError(f"{path}: {section}: {exc}") from exc
    rest = {k: v for k, v in doc.items() if k != "runs"}
    try:
        cfg = DaemonConfig(runs=runs, **rest)
    except (TypeError, ValueError) as exc:
        raise DaemonConfigError(f"{path}: {exc}") from exc
    for i, spec in enumerate(cfg.runs):
        try:
            cfg.source_for(spec)
        except ValueError as exc:
            where = f"runs[{i}].source" if spec.source else "source"
            raise DaemonConfigError(f"{path}: {where}: {exc}") from exc
        _check_mode(path, f"runs[{i}].", spec)
        if spec.on_escalate is not None and spec.on_escalate not in ON_ESCALATE:
            raise DaemonConfigError(f"{path}: runs[{i}].on_escalate must be one of {', '.join(ON_ESCALATE)}, "
                                    f"got {spec.on_escalate!r}")
        if spec.ray_token_file is not None and not spec.ray_address:
            raise DaemonConfigError(f"{path}: runs[{i}].ray_token_file is for a Ray cluster: give ray_address too")
        if spec.approve is not None:
            try:
                check_approve(spec.approve)
            except ValueError as exc:
                raise DaemonConfigError(f"{path}: runs[{i}].{exc}") from exc
        _say_if_meant_from_the_config(path, i, spec.run_dir)
    if cfg.webhook_url:
        try:
            webhook_target(cfg.webhook_url)
        except ValueError as exc:
            raise DaemonConfigError(f"{path}: webhook_url: {exc}") from exc
        try:
            mode = path.stat().st_mode
        except OSError:  # (a pipe read already)
            mode = 0
        if stat.S_ISREG(mode) and mode & 0o077:  # as a Ray token file: the URL is a secret (it posts to a channel)
            log.warning("%s holds webhook_url and can be read by other users (mode %o): chmod 600 it, or give "
                        "webhook_url_file or $WATCHDOG_WEBHOOK_URL instead", path, mode & 0o777)
    return cfg


def _say_if_meant_from_the_config(path: Path, i: int, run_dir: str) -> None:
    """A relative run directory is the daemon's working directory's (as ever: changing that would move
    existing runs). Where it is not there but is beside the config, which is what was most likely meant (a
    daemon under systemd works from /), say so before the daemon makes an empty one and watches that."""
    rel = Path(run_dir)
    if rel.is_absolute() or os.path.lexists(rel):
        return
    if run_dir.startswith("~"):  # no shell reads the config: a directory named ~ would be made
        log.warning("%s: runs[%d] %s: a ~ is not expanded (no shell reads this file), and %s does not exist: write "
                    "the run directory's absolute path", path, i, run_dir, Path.cwd() / rel)
        return
    beside = path.parent / rel
    if path.parent.resolve() != Path.cwd().resolve() and beside.is_dir():
        log.warning("%s: runs[%d] %s is relative to the daemon's working directory %s, where it does not exist; "
                    "%s does: write the run directory's absolute path", path, i, run_dir, Path.cwd(), beside)


def _check_mode(path: Path, prefix: str, spec: RunSpec) -> None:
    """A run's mode checked at load time, so a typo stops the daemon before it touches any run dir."""
    if spec.mode not in MODES:
        raise DaemonConfigError(f"{path}: {prefix}mode must be one of {', '.join(MODES)}, got {spec.mode!r}")
    if spec.mode == MODE_VERL and not spec.restart_command:
        raise DaemonConfigError(f"{path}: {prefix}mode: verl needs a restart_command (the verl command line): "
                                "the daemon launches every attempt itself")
    if spec.run_metrics_port is not None and (
            not spec.restart_command or resolve_mode(spec.mode, spec.restart_command) != MODE_VERL):
        raise DaemonConfigError(f"{path}: {prefix}run_metrics_port is for mode verl with a restart_command (the "
                                "embedded trainer serves its own: trainer.metrics_port)")


def _check_fields(path: Path, prefix: str, doc: Any, cls: type) -> None:
    """Every key of a config section is a field of ``cls`` and holds a value of its type (numbers finite)."""
    if not isinstance(doc, dict):
        raise DaemonConfigError(f"{path}: {prefix.rstrip('.') or 'top level'} must be a mapping")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(doc) - set(hints))
    if unknown:
        raise DaemonConfigError(f"{path}: unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(hints))})")
    for key, value in doc.items():
        if key == "runs":
            continue  # checked run by run
        what = _type_error(value, hints[key])
        if what:
            raise DaemonConfigError(f"{path}: {prefix}{key} must be {what}, got {inputs.short_repr(value, 80)}")


_YAML11_TEXT_NUMBER = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")
"""A number PyYAML's YAML 1.1 resolver reads as a string (no point before the exponent: ``1e-3``)."""


def _type_error(value: Any, hint: Any) -> str | None:
    """What ``value`` should be when it does not fit the type hint (None when it fits)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = [_type_error(value, a) for a in options]
        return None if any(e is None for e in errors) else " or ".join(e for e in errors if e)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            return "a list"
        inner = next((_type_error(v, args[0]) for v in value if args and _type_error(v, args[0])), None)
        return f"a list of {inner.removeprefix('a ').removeprefix('an ')}s" if inner else None
    if origin is dict or hint is dict:
        return None if isinstance(value, dict) else "a mapping"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok and isinstance(value, str) and _YAML11_TEXT_NUMBER.fullmatch(value.strip()):
            return f"a finite number (YAML 1.1 reads {value.strip()} as text: write it with a point, as 1.0e-3)"
        return None if ok else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    return None


class Watchdog:
    """Controllers for many runs sharing one store, rule set, actuator and telemetry."""

    def __init__(
        self, store: Store, rules: RulesEngine, backend: Backend | None = None, notifier: Notifier | None = None,
        controller_config: ControllerConfig | None = None, actuator_config: ActuatorConfig | None = None,
        telemetry: Any = None, crash_hook: Any = None, annotator: Any = None, exclusive: bool = False,
        state_lock: locks.HolderLock | None = None, tell: Callable[[str, str], None] | None = None,
    ) -> None:
        """``tell(run, line)``: a line for whoever watches, when a rule fires and when its action completes or
        fails (``watchdog run``'s console, the daemon's log; :meth:`Actuator.tell`).
        ``annotator``: called like the actuator's on_action for each action outcome (a
        :class:`~ppo_watchdog.observe.grafana.ActionAnnotator`); closed by :meth:`close`.
        ``exclusive``: hold the state directory and every run directory added, refusing (with
        :class:`~ppo_watchdog.protocol.lock.LockHeld`, naming the holder) what another watchdog holds
        (``watchdog run`` and the daemon; a library user building several in one process may not)."""
        self.exclusive = exclusive
        self._locks: list[locks.HolderLock] = [state_lock] if state_lock is not None else []
        if exclusive and state_lock is None:
            self._locks.append(hold_state(store))
        self.store = store
        self.rules = rules
        self.telemetry = telemetry
        self.annotator = annotator
        self.controller_config = controller_config or ControllerConfig()
        on_action = _fan_out(telemetry.action if telemetry is not None else None, annotator)
        self.actuator = Actuator(store, backend or LocalBackend(), notifier, actuator_config, on_action, crash_hook,
                                 tell)
        self.controllers: dict[str, RunController] = {}
        self._lock = threading.Lock()
        self.done = threading.Event()
        """Set when every run is finished or given up (``watchdog run`` exits then)."""
        self.unwatched: dict[str, str] = {}
        """Runs of the daemon's config it cannot watch now (run directory -> why), said and alerted once
        each; the others are watched all the same, and these are tried again (:meth:`retry_unwatched`)."""
        self._retry: dict[str, Callable[[], RunController]] = {}
        self._retry_at = 0.0
        self._tick_errors: dict[str, str] = {}
        """The last error said for each run's tick (a tick failing the same way is said once)."""
        self._tick_repeats: dict[str, int] = {}
        """Ticks in a row each run's tick failed with that same error."""
        self.stuck_ticks: int | None = None
        """Give a run up once its tick failed this many times in a row the same way (None: never, a daemon's
        runs are tried again for as long as it serves); :meth:`serve_forever` sets it for ``watchdog run``."""
        self.freeze_survivors = False
        """After each tick, move what it left alive out of the cyclic collector's reach (a daemon's runs'
        windows and states; see :meth:`_freeze_survivors`). Process-wide, so set by a daemon's
        :meth:`serve_forever` (``until_done=False``: many runs, for days), not by a library user's Watchdog."""
        self._froze = False
        self._gc_threshold: tuple[int, ...] = gc.get_threshold()
        """The collector's thresholds before this Watchdog took its full passes (:meth:`_freeze_survivors`)."""
        self._full_gc_at = time.monotonic()

    def add_run(self, run_dir: Path | str, run_id: str | None = None, command: Sequence[str] | None = None,
                managed: bool = True, ray_address: str | None = None,
                ray_token_file: Path | str | None = None, source: SourceConfig | None = None,
                mode: str | None = None,
                run_metrics_port: int | None = None, retry_ended: bool = True,
                on_escalate: str | None = None, advise: bool | None = None,
                approve: Sequence[str] | None = None) -> RunController:
        """Register (or take back from the store) a run and build its controller.

        ``ray_address``: launch the trainer as Ray Jobs on that cluster instead of as a local process.
        ``ray_token_file``: that cluster's auth token (default: where Ray looks).
        ``source``: where its metrics are read from (default: its files).
        ``mode``: auto | embedded | verl: the run directory is set up for it first
        (:func:`~ppo_watchdog.backends.zero_patch.prepare_run`, as ``watchdog run`` does), and the controller
        builds the zero-patch glue from that; None: the run directory is taken as it is.
        ``run_metrics_port``: verl mode's /metrics for the run (-1: any free port).
        ``retry_ended``: a run that finished or was given up is launched again (``watchdog run``
        on the same directory: the user asks for a new attempt); the daemon passes False, so
        restarting the daemon does not relaunch the runs of its config that already ended.
        ``on_escalate``: this run's escalation policy (default: the controller config's).
        ``advise``: this run in advise mode, or not (default: the controller config's ``advise``).
        ``approve``: the actions of this run that wait for a person (default: the controller config's)."""
        try:
            run_dir = Path(run_dir).resolve()
        except (OSError, RuntimeError) as exc:  # (Python 3.11's resolve raises RuntimeError on a symlink loop)
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "a symlink loop"
            raise SupervisorError(f"{run_dir}: cannot be resolved ({why}): not a run directory") from None
        # A run is its directory: the record of this very directory, whatever its name; a new
        # directory whose name another one has gets its own id (never the other's record).
        existing = self.store.run_for_dir(run_dir)
        if run_id is None:
            run_id = existing.run_id if existing is not None else self.store.new_run_id(run_dir)
        elif existing is not None and existing.run_id != run_id:
            raise DaemonConfigError(f"{run_dir} is run {existing.run_id!r} in {self.store.path}, not {run_id!r}")
        other = self.store.get_run(run_id)
        if other is not None and Path(other.run_dir) != run_dir:
            raise DaemonConfigError(f"run id {run_id!r} is {other.run_dir} in {self.store.path}, not {run_dir}")
        if run_id in self.controllers:
            raise DaemonConfigError(f"{run_dir}: watched twice (run {run_id!r})")
        held = self._hold_run_dir(run_dir, existing, managed and bool(command)) if self.exclusive else None
        try:
            ctl = self._add_run(run_dir, run_id, existing, command, managed, ray_address, ray_token_file, source,
                                mode, run_metrics_port, retry_ended, on_escalate, advise, approve)
        except BaseException:
            if held is not None:
                held.release()
            raise
        if held is not None:
            self._locks.append(held)
        return ctl

    def _add_run(self, run_dir: Path, run_id: str, existing: RunRecord | None, command: Sequence[str] | None,
                 managed: bool, ray_address: str | None, ray_token_file: Path | str | None,
                 source: SourceConfig | None, mode: str | None, run_metrics_port: int | None, retry_ended: bool,
                 on_escalate: str | None, advise: bool | None = None,
                 approve: Sequence[str] | None = None) -> RunController:
        # The one read of run.json for this attach (or the one write, for mode verl): the mode, dialect,
        # checkpoint directory and the trainer to adopt all come from this RunSetup, handed down.
        if mode is not None:
            try:
                setup = setup_run(run_dir, command, mode, metrics_port=run_metrics_port, ray_job=bool(ray_address))
            except VerlModeError as exc:
                raise VerlModeError(f"run {run_id}: {exc}") from exc
        else:
            setup = RunSetup.read(run_dir)
        backend: Backend | None = None
        if ray_address:
            from ppo_watchdog.backends.ray_jobs import RayJobBackend

            backend = RayJobBackend(ray_address, run_id, stop_wait_s=self.actuator.config.stop_grace_s,
                                    token_file=ray_token_file)
        if existing is None:
            self.store.upsert_run(RunRecord(run_id, str(run_dir), list(command or []), managed=managed,
                                            phase=Phase.NEW if (managed and command) else Phase.DETACHED))
        elif existing.phase in (Phase.FINISHED, Phase.FAILED, Phase.STOPPED) and managed and command and retry_ended:
            # Same run directory again: a new attempt (the trainer resumes from its checkpoints).
            self.store.update_run(run_id, phase=Phase.NEW, command=list(command), restarts=0, oom_retries=0)
        elif command and existing.command != list(command):
            self.store.update_run(run_id, command=list(command))
        config = self.controller_config
        if on_escalate is not None:
            config = replace(config, on_escalate=on_escalate)
        if advise is not None:
            config = replace(config, advise=advise)
        if approve is not None:
            config = replace(config, approve=tuple(approve))
        ctl = RunController(self.store, run_id, self.rules, self.actuator, config, self.telemetry,
                            backend, source=make_source(source, run_dir, run_id, self.telemetry), setup=setup)
        self.controllers[run_id] = ctl
        return ctl

    def _hold_run_dir(self, run_dir: Path, existing: RunRecord | None, launches: bool) -> locks.HolderLock:
        """Take the run directory for this watchdog (LockHeld naming the watchdog that has it); and refuse
        a run that would get a second trainer: one is alive there (it holds the trainer lock) that is not
        the one this state knows (adopted instead by :func:`prepare_daemon`, which passes through)."""
        try:
            if not launches and not os.path.lexists(run_dir):  # a trainer yet to start, or a path mistyped: said
                log.warning("%s: no such directory: made it, and watching it for a trainer to write there", run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            held = locks.HolderLock(run_dir / locks.RUN_LOCK, "the run").acquire()
        except locks.LockHeld:
            raise
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""  # (its lock file a symlink, say: named)
            raise SupervisorError(f"{run_dir}: cannot take the run directory{where}: {exc.strerror or exc}") from exc
        trainer = locks.holder_if_held(run_dir / locks.TRAINER_LOCK)
        if trainer is not None and launches and not self._adopting:
            known = existing is not None and existing.pid == trainer.get("pid") and existing.phase in (
                Phase.RUNNING, Phase.PAUSED, Phase.ESCALATED, Phase.RESTARTING)
            if not known:
                held.release()
                raise TrainerAlive(f"{run_dir}: a trainer is running there: {locks.describe_holder(trainer)}; "
                                   "not launching a second one into the same run directory (stop it, or let the "
                                   "watchdog that started it carry on)", trainer)
        return held

    _adopting = False
    """Set by :func:`prepare_daemon`: a live trainer in a run directory is adopted, not refused."""

    def retry_unwatched(self, now: float, every_s: float = 30.0) -> None:
        """Try again, every ``every_s``, the configured runs that could not be watched (fixed meanwhile?)."""
        if not self._retry or now < self._retry_at:
            return
        self._retry_at = now + every_s
        for run_dir, add in list(self._retry.items()):
            try:
                add()
            except Exception as exc:
                self.mark_unwatched(run_dir, exc)
                continue
            self._retry.pop(run_dir)
            self.unwatched.pop(run_dir, None)
            log.warning("%s: watched now (it could not be before)", run_dir)

    def mark_unwatched(self, run_dir: str, exc: Exception, retry: Callable[[], RunController] | None = None) -> None:
        """A configured run that cannot be watched: said on the console and alerted, once per reason."""
        why = str(exc) if isinstance(exc, (OSError, ValueError)) else f"{type(exc).__name__}: {exc}"
        if retry is not None:
            self._retry[run_dir] = retry
        if self.unwatched.get(run_dir) == why:
            return
        self.unwatched[run_dir] = why
        log.error("%s: NOT WATCHED: %s (the other runs are watched; tried again every 30 s)", run_dir, why)
        if self.telemetry is not None:
            self.telemetry.error(Path(run_dir).name, "config")
        self.actuator.notifier.notify(alert_payload(Path(run_dir).name, "watchdog:unwatched", "critical",
                                                    "a configured run cannot be watched", f"{run_dir}: {why}"))

    def tick(self, now: float | None = None) -> bool:
        """One pass over every run; True when all are done. Errors in one run never stop the others."""
        if not self._lock.acquire(blocking=False):
            return False  # a tick is still running (a sharded daemon's tick at start meeting the first of its turn)
        try:
            now = time.time() if now is None else now
            t0 = time.perf_counter()
            if self.freeze_survivors and not self._froze:
                self._freeze_survivors()  # what the start-up built (every run attached), before the first tick's work
            self.retry_unwatched(now)
            all_done = self._tick_runs(now)
            if self.telemetry is not None:
                self.telemetry.runs_watched(len(self.controllers))
                self.telemetry.last_tick(time.time())
                self.telemetry.eval_seconds(time.perf_counter() - t0)
                self.telemetry.tick_phases_done()
            if self.freeze_survivors:
                self._freeze_survivors()
            if all_done and self.controllers:
                self.done.set()
            return all_done
        finally:
            self._lock.release()

    def _freeze_survivors(self) -> None:
        """What a tick leaves alive is long-lived (the runs' windows, engine states, read positions): frozen
        (``gc.freeze``, O(1)) so that the collections inside the next tick scan only what that tick makes.
        Left to CPython's policy, a full pass over every run's windows (about 200 ms at 1,000 runs,
        ``bench/results/daemon_scale.md``) ran inside one tick in three. A pass over what this tick made
        comes first, so that no cycle already dead is frozen; cycles among frozen objects that die later
        are found by a full pass every :data:`FULL_GC_EVERY_S`, here, after a tick's work.

        The oldest generation's passes are the daemon's alone from then on (its threshold out of reach):
        CPython triggers one when the objects promoted since the last reach a quarter of those it kept, and
        after a freeze that count is small, so a tick that makes many long-lived objects (10,000 runs'
        windows filling) ran several inside it, each over everything that tick had made so far. The youngest
        generation's pass comes every :data:`GC_YOUNG_EVERY` allocations: a tick makes hundreds of thousands
        of objects that their last reference frees (a metrics line's dict), and at CPython's 700 the survivors
        of one pass were scanned again in seventy passes of the middle generation a tick."""
        if not self._froze:
            self._gc_threshold = gc.get_threshold()
            gc.set_threshold(max(self._gc_threshold[0], GC_YOUNG_EVERY), self._gc_threshold[1], 2**31 - 1)
        if time.monotonic() - self._full_gc_at >= FULL_GC_EVERY_S:
            gc.unfreeze()
            self._full_gc_at = time.monotonic()
        gc.collect()  # what this tick made (the rest is frozen): no cycle that is garbage already is frozen
        gc.freeze()
        self._froze = True

    def _tick_runs(self, now: float) -> bool:
        """Every run's tick in three passes: prepare (launches, relays), decide (the runs' reads, decisions,
        intents and positions in one transaction per :data:`DECIDE_CHUNK` runs, a savepoint per run so one
        bad run undoes only its own), then act (from the committed journal). A commit per chunk instead of
        one a run; acting still comes after every commit that records what to do (RELIABILITY.md: exactly
        once, all or nothing)."""
        runs = list(self.controllers.items())
        results: dict[str, TickResult] = {}
        failed: dict[str, Exception | None] = {}
        all_done = True
        for run_id, ctl in runs:
            results[run_id] = TickResult()
            try:
                failed[run_id] = ctl.prepare(now, results[run_id])
            except Exception as exc:  # a launch that failed: this run sits this tick out
                results.pop(run_id)
                self._tick_failed(run_id, exc)
                all_done = False
        deciding = [(r, ctl) for r, ctl in runs if r in results and not results[r].done and failed[r] is None]
        decided: set[str] = set()
        for i in range(0, len(deciding), READ_GROUP):
            self._decide_group(now, deciding[i:i + READ_GROUP], results, failed, decided)
        if any(results[r].decisions for r in decided):
            self.actuator.crash_hook("decided")
        for run_id, ctl in runs:
            result = results.get(run_id)
            if result is None:
                continue
            if result.done:  # given up before reading (a launch refused for good)
                continue
            try:
                all_done &= ctl.act(now, result, failed[run_id]).done
            except Exception as exc:
                self._tick_failed(run_id, exc)
                all_done = False
            else:
                if self._tick_errors.pop(run_id, None) is not None:
                    log.warning("%s: ticks work again", run_id)
        return all_done

    def _decide_group(self, now: float, group: list[tuple[str, RunController]], results: dict[str, TickResult],
                      failed: dict[str, Exception | None], decided: set[str]) -> None:
        """Some runs' reads and rules (in memory, no lock held; :data:`READ_GROUP` at most), then their writes
        :data:`DECIDE_CHUNK` at a time. (An interrupt ends the daemon: the store keeps the chunks committed
        before it, and the daemon started again reads the others' lines again.)"""
        for (run_id, _), error in zip(group, read_and_evaluate_all([(ctl, now, results[r]) for r, ctl in group]),
                                      strict=True):
            failed[run_id] = error
        for i in range(0, len(group), DECIDE_CHUNK):
            self._decide_chunk(now, group[i:i + DECIDE_CHUNK], results, failed, decided)

    def _decide_chunk(self, now: float, chunk: list[tuple[str, RunController]], results: dict[str, TickResult],
                      failed: dict[str, Exception | None], decided: set[str]) -> None:
        """Some runs' writes, read already, in one transaction (a savepoint each); when its commit fails, every
        one of them is put back as it was. Chunks bound what a failed commit undoes (and reads again) at
        :data:`DECIDE_CHUNK` runs, whatever the number of runs, and SQLite's one write lock is held for the
        writes alone: a ``watchdog`` command, or another process on the same state, waits for those, not
        for the rules."""
        read = [(run_id, ctl) for run_id, ctl in chunk if failed[run_id] is None]
        t_commit: float | None = None
        try:
            with self.store.transaction():
                # Which runs have nothing open in the journal, in one query: most runs' commit and act ask.
                self.store.note_open_actions([run_id for run_id, _ in read])
                for run_id, ctl in read:
                    failed[run_id] = ctl.decide(now, results[run_id])
                    if failed[run_id] is None:
                        decided.add(run_id)
                t_commit = time.perf_counter()
        except Exception as exc:  # the commit (locked past the timeout, a full disk): nothing of it kept
            for run_id, ctl in read:
                if failed[run_id] is None:  # read (and perhaps written): back to before the read
                    decided.discard(run_id)
                    failed[run_id] = exc
                    try:
                        ctl.undo_decide(results[run_id], exc)
                    except Exception as undo_exc:  # (its files unreadable now): its tick fails, the others go on
                        failed[run_id] = undo_exc
        else:
            for _, ctl in read:
                ctl.committed()
        finally:
            if t_commit is not None and self.telemetry is not None:
                # The chunk's COMMIT (its fsync) is part of the commit phase, not of any one run's.
                self.telemetry.phase_time("commit", time.perf_counter() - t_commit)

    def _tick_failed(self, run_id: str, exc: Exception) -> None:
        """Count a failed tick; say it (with the traceback when it is not a known kind of error) only when it
        fails differently from the last time: a run whose run.json stays garbled is said once, not every tick."""
        if self.telemetry is not None:
            self.telemetry.error(run_id, "tick")
        why = f"{type(exc).__name__}: {exc}"
        if self._tick_errors.get(run_id) == why:
            log.debug("%s: tick failed again: %s", run_id, why)
            self._tick_repeats[run_id] = self._tick_repeats.get(run_id, 1) + 1
            if self.stuck_ticks is not None and self._tick_repeats[run_id] >= self.stuck_ticks:
                self._give_up_stuck(run_id, exc)
            return
        self._tick_errors[run_id] = why
        self._tick_repeats[run_id] = 1
        if isinstance(exc, (OSError, ValueError)):  # a launch refused, a garbled file: the message says it all
            log.error("%s: tick failed: %s (said once; tried again every tick)", run_id, exc)
        else:
            log.exception("%s: tick failed (said once; tried again every tick)", run_id)

    def close(self, withdraw_targets: bool = False) -> None:
        """Post the queued Grafana annotations and close the metric sources (on shutdown).

        ``withdraw_targets``: the trainers are gone too (``watchdog run`` at its end), so their
        Prometheus file_sd targets go; a daemon that stops leaves running trainers scraped.
        """
        if self.annotator is not None:
            self.annotator.close()
        for ctl in self.controllers.values():
            close = getattr(ctl.tailer, "close", None)
            if callable(close):
                close(withdraw=withdraw_targets)
            ctl.h.dialect.close()  # a zero-patch run's /metrics server: a daemon restarted in process rebinds
            close_proc = getattr(ctl.h.proc, "close", None)  # a Ray job's log stream (the job runs on)
            if callable(close_proc):
                close_proc()
        for held in reversed(self._locks):
            held.release()
        self._locks.clear()
        if self._froze:
            gc.unfreeze()  # what it froze is the collector's again (a process that goes on, a test suite)
            gc.set_threshold(*self._gc_threshold)
            self._froze = False

    def _give_up_stuck(self, run_id: str, exc: Exception) -> None:
        """A run whose tick fails the same way every time (its trainer lock a directory, a sweep in its command)
        cannot be watched: given up with the cause (``watchdog run`` exits 2 and says it), not waited on forever."""
        ctl = self.controllers.get(run_id)
        if ctl is None or ctl.run.phase in DONE_PHASES:
            return
        message = (f"every tick failed the same way {self._tick_repeats[run_id]} times in a row: {exc}; "
                   "the run cannot be watched until that is fixed")
        log.error("%s: %s", run_id, message)
        try:
            if ctl.h.proc is not None:
                self.actuator.stop(ctl.h)
            ctl.give_up(RULE_TICK, message, {"error": str(exc)})
        except Exception:  # (the store itself failing): said, and the run is left as the store has it
            log.exception("%s: could not record the run as given up", run_id)
        self.done.set()

    def serve_forever(self, tick_s: float, until_done: bool = True, stop: threading.Event | None = None,
                      beside: Callable[[], bool] | None = None, on_stop: Callable[[], None] | None = None,
                      phase_s: float | None = None) -> None:
        """Run ticks on an APScheduler 3.x BackgroundScheduler until done (or ``stop`` is set): one at once,
        then every ``tick_s`` from it, or, given ``phase_s`` (a sharded daemon's turn, :func:`tick_trigger`),
        at ``phase_s`` past each multiple of ``tick_s``.

        ``beside`` is called in this thread between ticks: with ``until_done``, every 0.2 s (``watchdog run``'s
        progress line). A sharded daemon's hooks (``until_done=False``): ``beside`` every half
        second while the ticks run (the supervisor's look at its children, a child's look at its supervisor;
        False stops serving); ``on_stop`` once serving ends, before the tick in flight is waited for (the
        children then stop side by side with it)."""
        from apscheduler.schedulers.background import BackgroundScheduler

        self.freeze_survivors |= not until_done
        if until_done and self.stuck_ticks is None:
            self.stuck_ticks = STUCK_TICKS
        sched = BackgroundScheduler(daemon=True)
        grace = max(1, int(tick_s * 5))
        if phase_s is None:
            sched.add_job(self.tick, "interval", seconds=tick_s, max_instances=1, coalesce=True,
                          misfire_grace_time=grace, next_run_time=_now_dt())
        else:  # a tick now, then the ticks of its turn (one that finds the first still running is skipped)
            sched.add_job(self.tick, "date", misfire_grace_time=grace)  # (no run date: now, in the scheduler's zone)
            sched.add_job(self.tick, tick_trigger(tick_s, phase_s), max_instances=1, coalesce=True,
                          misfire_grace_time=grace)
        sched.start()
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                if until_done and self.done.wait(timeout=0.2):
                    break
                if until_done and beside is not None:
                    beside()  # (watchdog run's progress line: it never stops the run)
                    continue
                if not until_done and not stop.wait(timeout=0.5) and beside is not None and not beside():
                    break
        finally:
            if on_stop is not None:
                on_stop()
            sched.shutdown(wait=True)


def _now_dt() -> Any:
    from datetime import datetime

    return datetime.now()


def tick_trigger(tick_s: float, phase_s: float, now: float | None = None) -> Any:
    """APScheduler's interval trigger for ticks at ``phase_s`` past each multiple of ``tick_s`` since the epoch:
    the same instants in every process on hosts whose clocks agree, whenever each was started (``now``: the
    wall clock, by default)."""
    from datetime import datetime, timezone

    from apscheduler.triggers.interval import IntervalTrigger

    now = time.time() if now is None else now
    # Anchored at the multiple of tick_s just before now, not at the epoch: APScheduler counts whole intervals
    # from its start date in microseconds, and a tick_s of no whole number of them (1/3 s) would drift by the
    # rounding times the billions of intervals since 1970.
    anchor = math.floor(now / tick_s) * tick_s + phase_s
    return IntervalTrigger(seconds=tick_s, start_date=datetime.fromtimestamp(anchor, timezone.utc))


def build_watchdog(
    state_dir: str | Path, rule_paths: Sequence[str | Path] | None = None, webhook_url: str | None = None,
    controller: dict[str, Any] | None = None, actuator: dict[str, Any] | None = None,
    metrics_port: int | None = None, metrics_addr: str = "127.0.0.1", crash_hook: Any = None,
    grafana_url: str | None = None, webhook_url_file: str | Path | None = None, exclusive: bool = False,
    shard: int | None = None, tell: Callable[[str, str], None] | None = None,
) -> Watchdog:
    """A Watchdog from plain settings (the CLI and the daemon config both land here).

    With a Grafana URL (``grafana_url`` or ``$GRAFANA_URL``) every action outcome is also posted
    as an annotation on the "PPO run" dashboard, from a background thread: a slow or down
    Grafana never holds up a tick. A token file that is named but unreadable is a
    DaemonConfigError (someone meant to configure one). ``shard``: a sharded daemon's child K, which
    holds its shard's lock instead of the state's (:func:`hold_state`).
    """
    rules = EngineRules(resolve_rule_paths(rule_paths))  # ('default' by name: the shipped pack)
    try:
        notifier = Notifier(resolve_webhook_url(webhook_url_file, configured=webhook_url))
    except ValueError as exc:
        raise DaemonConfigError(str(exc)) from exc
    controller_config, actuator_config = ControllerConfig(**(controller or {})), ActuatorConfig(**(actuator or {}))
    store = Store(state_dir)
    # The state is taken before anything is served or launched: a second watchdog on it stops here.
    state_lock = hold_state(store, shard) if exclusive else None
    telemetry = WatchdogMetrics()
    if metrics_port is not None:
        try:
            port = telemetry.serve(metrics_port, metrics_addr)
        except (OSError, OverflowError, ValueError) as exc:
            if state_lock is not None:
                state_lock.release()
            store.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise DaemonConfigError(f"metrics port {metrics_port}: cannot serve /metrics on "
                                    f"{metrics_addr}:{metrics_port} ({reason})") from exc
        # (said, not warned: a Kubernetes pod must listen on 0.0.0.0 to be scraped, deploy/k8s does)
        loopback = metrics_addr in ("127.0.0.1", "::1", "localhost")
        log.info("watchdog /metrics on http://%s:%d/metrics%s", metrics_addr, port,
                 "" if loopback else " (reachable from other hosts: metrics_addr)")
    return Watchdog(
        store, rules, LocalBackend(), notifier, controller_config, actuator_config, telemetry, crash_hook,
        annotator=_annotator(grafana_url), exclusive=exclusive, state_lock=state_lock, tell=tell,
    )


def hold_state(store: Store, shard: int | None = None) -> locks.HolderLock:
    """Take the state directory for this watchdog; :class:`~ppo_watchdog.protocol.lock.LockHeld` names the one
    that has it (two watchdogs writing one state would journal every firing twice). ``shard`` K (1..N-1): a
    sharded daemon's child, which takes its shard's lock instead: its supervisor holds the state's."""
    if shard:
        held = locks.HolderLock(store.path.parent / locks.shard_lock(shard), f"shard {shard} of the state",
                                role=f"watchdog daemon shard {shard}")
    else:
        held = locks.HolderLock(store.path.parent / locks.STATE_LOCK, "the state")
    try:
        return held.acquire()
    except locks.LockHeld:
        store.close()
        raise
    except OSError as exc:
        store.close()
        raise StoreError(f"{store.path.parent}: cannot take the state directory ({exc.strerror or exc})") from exc


def _annotator(url: str | None) -> Any:
    """The background Grafana annotator when a Grafana URL is configured, else None."""
    if not (url or os.environ.get("GRAFANA_URL")):
        return None  # the dashboard builders (PPO_RUN_UID's module) weigh 3 MiB: imported only when used
    from ppo_watchdog.observe import grafana
    from ppo_watchdog.observe.dashboards import PPO_RUN_UID

    try:
        annotator = grafana.annotator_from_env(url, dashboard_uid=PPO_RUN_UID, background=True)
    except grafana.TokenError as exc:
        raise DaemonConfigError(f"Grafana annotations: {exc}") from exc
    if annotator is not None:
        log.info("annotating actions in Grafana at %s", grafana.redact_url(url or os.environ["GRAFANA_URL"]))
    return annotator


def _fan_out(count: Callable[[str, str, str, str], None] | None, annotate: Any = None) -> OnAction | None:
    """One on_action callback: ``count(run, rule, kind, outcome)`` (the /metrics counter) and
    ``annotate(run, rule, kind, outcome, step, said)`` (Grafana, with the action in words); None when neither."""
    if count is None and annotate is None:
        return None

    def on_action(run: str, rule: str, kind: str, outcome: str, step: int | None, said: str) -> None:
        if count is not None:
            count(run, rule, kind, outcome)
        if annotate is not None:
            annotate(run, rule, kind, outcome, step, said)

    return on_action


def run_daemon(cfg: DaemonConfig, stop: threading.Event | None = None, config_path: Path | str | None = None,
               shard: int | None = None, say: Callable[[str], None] = log.info) -> Watchdog:
    """``watchdog daemon``: watch every configured run until stopped.

    With ``shards`` > 1 this process is one shard (:func:`run_shard`): ``shard`` None or 0, the supervisor,
    which starts the others from ``config_path``; 1..N-1, a child it started. ``say``: the shards' news
    (which runs and port each has, a child that exited) for the daemon's console."""
    if shard is not None and not 0 <= shard < cfg.shards:
        raise DaemonConfigError(f"--shard {shard}: the config has shards: {cfg.shards}, whose processes are "
                                f"shards 0 .. {cfg.shards - 1}")
    if cfg.shards > 1:
        return run_shard(cfg, shard or 0, stop, config_path, say)
    wd = prepare_daemon(cfg, say=say)
    if not cfg.runs:  # a daemon that watches nothing is a config mistake, not a quiet success (said once
        wd.close()    # its state dir and port are checked: a config with no runs can get those wrong too)
        raise DaemonConfigError("no runs to watch: list run directories under 'runs:'")
    try:
        wd.serve_forever(cfg.tick_s, until_done=False, stop=stop)
    finally:
        wd.close()
    return wd


def run_shard(cfg: DaemonConfig, shard: int, stop: threading.Event | None = None,
              config_path: Path | str | None = None, say: Callable[[str], None] = log.info) -> Watchdog:
    """One process of a daemon of ``cfg.shards``: the runs :func:`~ppo_watchdog.control.shards.shard_of` gives
    ``shard``, on the shared state database. Shard 0 holds the state lock, starts the children from
    ``config_path`` once its own runs are added (the database exists by then), starts each again when it
    exits, and stops them when it stops. A child K holds its shard's lock and stops when its supervisor
    is gone (the kernel's SIGTERM on Linux; everywhere, its parent is no longer the supervisor)."""
    children: ShardSupervisor | None = None
    supervisor: int | None = None
    if shard:
        try:
            supervisor = die_with_supervisor()
        except NotStartedBySupervisor as exc:
            raise DaemonConfigError(f"--shard {shard}: {exc}") from exc
    elif config_path is None:
        raise ValueError("a sharded daemon's supervisor needs its config file's path (the children read it)")
    else:
        children = ShardSupervisor(config_path, cfg.shards, say)
    mine = cfg.for_shard(shard)
    wd = prepare_daemon(mine, shard=shard, say=say)
    if children is not None:
        def alert(child: int, why: str) -> None:
            wd.actuator.notifier.notify(alert_payload(f"shard-{child}", "watchdog:shard", "critical",
                                                      "a daemon shard keeps exiting", why))

        children.alert = alert
    if not cfg.runs:
        wd.close()
        raise DaemonConfigError("no runs to watch: list run directories under 'runs:'")
    port = wd.telemetry.port if wd.telemetry is not None else 0
    phase = tick_phase(shard, cfg.shards, cfg.tick_s)
    say(f"shard {shard} (pid {os.getpid()}): {len(mine.runs)} of {len(cfg.runs)} run(s), ticks {phase:g} s into "
        f"each {cfg.tick_s:g} s" + (f", /metrics on http://{cfg.metrics_addr}:{port}/metrics" if port else ""))
    beside: Callable[[], bool]
    if supervisor is not None:
        def beside() -> bool:
            if supervisor_alive(supervisor):
                return True
            say(f"shard {shard}: its supervisor (pid {supervisor}) is gone; stopping")
            return False
    elif children is not None:
        beside = children.poll
    try:
        if children is not None:
            children.start()
        wd.serve_forever(cfg.tick_s, until_done=False, stop=stop, beside=beside,
                         on_stop=children.terminate if children is not None else None, phase_s=phase)
    except KeyboardInterrupt:  # a second Ctrl-C while the last tick finished: the children go at once
        if children is not None:
            children.stop(grace_s=0.0)
        raise
    finally:
        try:
            if children is not None:
                children.stop()
        finally:
            wd.close()
    return wd


def prepare_daemon(cfg: DaemonConfig, exclusive: bool = True, shard: int | None = None,
                   say: Callable[[str], None] = log.info) -> Watchdog:
    """The daemon's Watchdog with every configured run added (adopting trainers already running).

    ``exclusive``: hold the state directory and each run directory (a second daemon or ``watchdog run``
    on either is refused). A run that cannot be watched (a garbled run.json, a directory another
    watchdog holds) is said and alerted once and tried again later; the others are watched.
    ``shard``: a sharded daemon's child K (1..N-1), which holds its shard's lock, not the state's;
    ``cfg`` is then its share (:meth:`DaemonConfig.for_shard`). ``say``: the daemon's log, where each rule that
    fires and each action that completes or fails is one line.
    """
    if exclusive:
        _raise_fd_limit(len(cfg.runs) + 256)
    controller = {**cfg.controller, **({"advise": True} if cfg.advise else {}),
                  **({"approve": cfg.approve} if cfg.approve else {})}
    wd = build_watchdog(cfg.state_dir, cfg.rules, cfg.webhook_url, controller, cfg.actuator,
                        cfg.metrics_port, cfg.metrics_addr, grafana_url=cfg.grafana_url,
                        webhook_url_file=cfg.webhook_url_file, exclusive=exclusive, shard=shard,
                        tell=lambda run, line: say(f"{run}: {line}"))
    wd._adopting = True
    for spec in cfg.runs:
        def add(spec: RunSpec = spec) -> RunController:
            return _add_spec(wd, cfg, spec)

        try:
            add()
        except Exception as exc:  # one bad run never blinds the daemon to the others
            wd.mark_unwatched(str(real_path(spec.run_dir)), exc, retry=add)
    return wd


def _raise_fd_limit(needed: int) -> None:
    """Each watched run holds one descriptor (its run-directory lock): lift the soft limit on open files
    towards the hard one when a large config needs it (1,024 is a common default)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            if target < needed:
                log.warning("open files limited to %d (hard limit): %d runs need about %d", target, needed - 256,
                            needed)
    except (ImportError, ValueError, OSError) as exc:  # no resource module (not POSIX), or not allowed
        log.warning("cannot raise the open-files limit for %d runs: %s", needed - 256, exc)


def _add_spec(wd: Watchdog, cfg: DaemonConfig, spec: RunSpec) -> RunController:
    """Add one configured run, adopting the trainer already running in it rather than starting a second."""
    cmd = spec.restart_command
    ctl = wd.add_run(spec.run_dir, spec.id, cmd, managed=bool(cmd), ray_address=spec.ray_address,
                     ray_token_file=spec.ray_token_file, source=cfg.source_for(spec), mode=spec.mode,
                     run_metrics_port=spec.run_metrics_port, retry_ended=False, on_escalate=spec.on_escalate,
                     advise=spec.advise, approve=spec.approve)
    if cmd and ctl.run.phase == Phase.NEW and spec.ray_address:
        # run.json's pid is a process on the Ray head, not one this machine can watch: its job id.
        _adopt_ray_job(wd, ctl)
    elif cmd and ctl.run.phase == Phase.NEW:
        _adopt_pid(wd, ctl)
    if cmd and ctl.run.phase == Phase.NEW and ctl.h.proc is None:
        _keep_finished(wd, ctl)
    return ctl


def _keep_finished(wd: Watchdog, ctl: RunController) -> None:
    """A run new to this state whose own events say it finished (its last attempt's ``finished`` after its
    ``started``: a ``watchdog run``, another state's daemon, or the trainer alone ran it to the end) is recorded
    finished, not launched again: the daemon's config names where runs are, not that they must train again."""
    last = None
    for e in rundir.iter_events(ctl.run.run_dir, ["started", "finished"]):
        last = e.get("kind")
    if last != "finished":
        return
    log.warning("%s: %s says it finished: recorded finished, not launched again (its run directory anew, or "
                "`watchdog run` on it, trains again)", ctl.run.run_id, Path(ctl.run.run_dir) / rundir.EVENTS)
    wd.store.update_run(ctl.run.run_id, phase=Phase.FINISHED)
    ctl.h.run.phase = Phase.FINISHED


def _adopt_pid(wd: Watchdog, ctl: RunController) -> None:
    """A run it did not start: adopt its running trainer (the trainer lock's holder, else run.json's pid)
    once it is sure the pid is that trainer, instead of launching a second one."""
    run_dir = Path(ctl.run.run_dir)
    holder = locks.holder_if_held(run_dir / locks.TRAINER_LOCK)
    info = ctl.setup.info  # run.json as this attach read it (not read again)
    pid = holder.get("pid") if holder else info.pid
    if not isinstance(pid, int):
        if holder is not None:  # alive, but it has not said which process it is yet: not one to launch beside
            raise TrainerAlive(f"{run_dir}: a trainer holds the run ({locks.describe_holder(holder)}) "
                               "without naming its pid; not adopted and nothing launched")
        return
    why = not_the_trainer(pid, run_dir, info=info)
    if why is not None:
        if holder is not None:
            raise TrainerAlive(f"{run_dir}: a trainer holds the run but {why}; not adopted and nothing launched",
                               holder)
        if "is not running" not in why:
            log.error("%s: run.json's pid not adopted: %s; a trainer is launched", ctl.run.run_id, why)
        return
    launched = info.started if info.started is not None else time.time()
    wd.store.update_run(ctl.run.run_id, phase=Phase.RUNNING, pid=pid, launched_ts=launched, last_progress_ts=time.time())
    ctl.h.run.phase, ctl.h.run.pid, ctl.h.run.launched_ts = Phase.RUNNING, pid, launched
    ctl.h.run.last_progress_ts = time.time()
    ctl._attempt_ts = launched
    ctl.h.proc = wd.actuator.backend.attach(pid)
    log.info("%s: adopted running trainer pid %d", ctl.run.run_id, pid)


def _adopt_ray_job(wd: Watchdog, ctl: RunController) -> None:
    """A Ray run with no record here: attach to the job run.json names while it runs, rather than
    submitting a second trainer into the same run directory."""
    job_id = ctl.setup.info.ray_job_id  # run.json as this attach read it
    adopt = getattr(ctl.h.backend, "adopt_job", None)
    if not job_id or adopt is None:
        return
    try:
        proc = adopt(job_id, Path(ctl.run.run_dir) / wd.actuator.config.log_name)
    except SupervisorError as exc:
        log.error("%s: ray job %s from run.json not adopted: %s", ctl.run.run_id, job_id, exc)
        return
    if proc is not None:
        wd.store.update_run(ctl.run.run_id, phase=Phase.RUNNING, job_id=job_id)
        ctl.h.run.phase, ctl.h.run.job_id = Phase.RUNNING, job_id
        ctl.h.proc = proc
        log.info("%s: adopted running ray job %s (from run.json)", ctl.run.run_id, job_id)

