"""One run's control loop: tail -> rules engine -> decisions -> actuator, one tick at a time.

The pure half (:func:`heartbeat_timeout`, :func:`span_start`, and
:mod:`ppo_watchdog.core.planner` and :mod:`ppo_watchdog.core.pricing`, shared with replay and eval) takes data
and returns data; :class:`RunController` is the thin shell
that reads the run directory, persists to the store and hands journal entries to the
:class:`~ppo_watchdog.control.actuator.Actuator`.

Ordering inside a tick is what makes a restarted watchdog lose nothing and double
nothing: the engine's new state, the decisions, their journal intents and the tail
offsets are committed in one SQLite transaction *before* any action is carried out;
actions are then driven from the journal, each phase idempotent.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import re
import statistics
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ppo_watchdog.backends.local import (
    Backend,
    LaunchRefused,
    LocalBackend,
    SupervisorError,
    not_the_trainer,
    read_tail,
)
from ppo_watchdog.control.actuator import (
    RULE_FOREIGN_CONTROL,
    Actuator,
    RunHandle,
    alert_payload,
    check_approve,
    check_finite,
    needs_approval,
    restores_in_process,
    run_config,
    run_world_size,
)
from ppo_watchdog.control.store import UNLOADABLE, UNWATCHED, ActionRecord, Phase, RunRecord, Store
from ppo_watchdog.core.engine import BLIND_AFTER_STEPS, Verdict
from ppo_watchdog.core.planner import (
    ON_ESCALATE,
    PlanContext,
    Planned,
    config_value,
    left_out_reason,
    oom_remedy,
    plan_decision,
)
from ppo_watchdog.core.pricing import DEFAULT_STARTUP_S, CostModel, RelaunchPolicy, Waiting, release
from ppo_watchdog.core.vocabulary import OPEN_ACTION_STATUSES, ActionStatus, DecisionKind, JournalKind
from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol.events import STEP_SLACK, Event, outside_message, past_the_end, resume_failure
from ppo_watchdog.protocol.runinfo import RunInfo, RunInfoError

if TYPE_CHECKING:
    from ppo_watchdog.backends.zero_patch import RunSetup

log = logging.getLogger(__name__)

#: Failed ticks in a row at one read position before the watchdog says so (once): a store locked
#: for one tick is weather; three in a row is something a human must look at.
FAILED_TICKS_NOTICE = 3

STATE_VERSION = 1
#: Seconds an event may predate its attempt's launch and still be that attempt's (the trainer's clock
#: and the watchdog's are one machine's, read at different instants).
ATTEMPT_SLACK_S = 1.0
#: Phases after which a run needs no more watching (``stopped``: ended by the watchdog with a verdict).
DONE_PHASES = (Phase.FINISHED, Phase.FAILED, Phase.STOPPED)
#: Rule names of the controller's own decisions (not from a rule file).
RULE_OOM = "watchdog:oom"
RULE_CRASH = "watchdog:crash"
RULE_HANG = "watchdog:hang"
RULE_BUDGET = "watchdog:budget"
RULE_LIVE_TIMEOUT = "watchdog:live_timeout"
#: Every tick of the run failed the same way (``watchdog run`` only): given up, ``watchdog run`` exits 2.
RULE_TICK = "watchdog:tick"
#: The trainer could not load the checkpoint a relaunch named: relaunched from the one before it.
RULE_RESUME = "watchdog:resume"
#: The trainer refused its configuration (exit 2 / verl's config error): given up at once, ``watchdog run`` exits 2.
RULE_CONFIG = "watchdog:config"
#: A trainer relaunched from a checkpoint that exited as finished without training a step past it, short of its
#: run's length: given up with why (a relaunch would do the same nothing).
RULE_NO_PROGRESS = "watchdog:no_progress"

@dataclass
class ControllerConfig:
    """Budgets and timings of the controller."""

    restart_budget: int = 3
    """Restarts for crash, hang and live-apply timeouts before the run is handed to a human."""
    oom_retry_budget: int = 3
    """OOM restarts (each with a smaller micro batch) before giving up."""
    heartbeat_min_s: float = 30.0
    """Hang timeout floor: no new step for this long (and ``heartbeat_factor`` step times) is a hang."""
    heartbeat_factor: float = 10.0
    """Hang timeout in median step times."""
    startup_timeout_s: float = 600.0
    """Allowed time from launch to the first new step (model build, SFT warm start)."""
    window_size: int | None = None
    """Steps of history the rules see (None: what the loaded rules read, their longest window and the
    current step, at most ``ppo_watchdog.core.series.MAX_WINDOW_STEPS``). A daemon holds one window per run."""
    rollback_margin_steps: int = 1
    """Checkpoints this many steps before a divergence rule's condition first held count as bad too:
    the checkpoint at step N holds the weights that produced step N+1's diverged metrics."""
    live_keys: tuple[str, ...] = catalog.LIVE_KEYS
    """Keys the trainer changes at a step boundary; others go by restart."""
    tuning_relaunch_every: int = 100
    """Steps trained between two relaunches made only for tuning sets (at most one per this many)."""
    startup_s: float = DEFAULT_STARTUP_S
    """Cost of a relaunch before the run has measured its own (stop to first new step), seconds."""
    on_escalate: str = "pause"
    """What a pause for a human becomes: pause (wait for `watchdog resume`), stop (end with a verdict), continue."""
    pause_timeout_s: float | None = None
    """A run paused for a human this long with nobody resuming it is stopped with a verdict (None: wait)."""
    advise: bool = False
    """Advise mode: every decision is made, priced, journaled and announced, worded as what the watchdog would
    do, and none is carried out (no signal, control.json, stop, relaunch, rollback or pause): the run is never
    touched (``watchdog run --advise``; the daemon's ``advise: true``)."""
    approve: tuple[str, ...] = ()
    """Actions that wait for a person (``--approve rollback,relaunch,pause,stop``; the daemon's ``approve:``):
    held, announced with why and what they cost, carried out on ``watchdog approve``, closed on ``deny``."""
    approve_timeout_s: float = 1800.0
    """An action unanswered this long is denied, said (``--approve-timeout``)."""

    def __post_init__(self) -> None:
        check_finite(self)
        self.approve = check_approve(self.approve)  # (a YAML list or a comma text; said when unknown)
        if not self.approve_timeout_s > 0:
            raise ValueError(f"approve_timeout_s must be > 0 seconds, got {self.approve_timeout_s!r}")
        if self.heartbeat_min_s <= 0 or self.heartbeat_factor <= 0:
            raise ValueError(f"heartbeat_min_s and heartbeat_factor must be > 0, got "
                             f"{self.heartbeat_min_s}, {self.heartbeat_factor}")
        if self.restart_budget < 0 or self.oom_retry_budget < 0:
            raise ValueError("budgets must be >= 0")
        bad_window = self.window_size is not None and self.window_size < 1
        if self.startup_timeout_s <= 0 or self.startup_s < 0 or bad_window or self.rollback_margin_steps < 0:
            raise ValueError(f"startup_timeout_s must be > 0, startup_s >= 0, window_size >= 1 and "
                             f"rollback_margin_steps >= 0; got {self.startup_timeout_s!r}, {self.startup_s!r}, "
                             f"{self.window_size!r}, {self.rollback_margin_steps!r}")
        if self.on_escalate not in ON_ESCALATE:
            raise ValueError(f"on_escalate must be one of {', '.join(ON_ESCALATE)}, got {self.on_escalate!r}")
        if self.pause_timeout_s is not None and not self.pause_timeout_s > 0:
            raise ValueError(f"pause_timeout_s must be > 0 seconds, got {self.pause_timeout_s!r}")
        RelaunchPolicy(self.tuning_relaunch_every)  # validates the spacing

    @property
    def relaunch_policy(self) -> RelaunchPolicy:
        """When a tuning relaunch may go."""
        return RelaunchPolicy(self.tuning_relaunch_every)


# -- pure core ------------------------------------------------------------------------


def heartbeat_timeout(step_times: Sequence[float], cfg: ControllerConfig) -> float:
    """Seconds without a new step that count as a hang: max(floor, factor x median step time)."""
    finite = [t for t in step_times if t == t and t > 0]
    if not finite:
        return cfg.heartbeat_min_s
    return max(cfg.heartbeat_min_s, cfg.heartbeat_factor * statistics.median(finite))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and catalog.is_finite(float(v))


_TICK_FIELDS = ("_rewind_pending", "_rewind_to", "_step_times", "_last_checkpoint", "_saw_finished", "_saw_oom",
                "_saw_resume_failed", "_events_since_eval", "_launch_seen", "_started_ts", "latest", "_held", "_last_tuning_clock",
                "_paused_since", "_control_errors")
"""What a tick's read and decide change of the controller besides the engine state and read positions, put
back when the tick fails (``_blind_warned`` is not: its warning was said, and is not said twice)."""
_TICK_CHANGED_IN_PLACE = ("latest", "_control_errors")
"""Those of them a tick changes in place, copied for the undo; the others it replaces, never changes."""
_TICK_RUN_FIELDS = ("last_step", "last_progress_ts", "last_evaluated_step", "phase", "overrides", "startup_s")
"""What they change of the run's record, each replaced, never changed in place (the rest changes only in
:meth:`RunController.act`, after the commit)."""
_tick_fields = operator.attrgetter(*_TICK_FIELDS)
_tick_run_fields = operator.attrgetter(*_TICK_RUN_FIELDS)


#: Steps of recovery past a rewind's target after which a divergence is a new one, for a rule whose budget
#: states no ``progress`` (the default pack's divergence rules state 30).
RECUR_STEPS = 30


def span_start(fire_step: int, for_steps: int, margin: int) -> int:
    """First step whose checkpoint is suspect when a divergence rule fires at ``fire_step``."""
    return fire_step - max(1, for_steps) + 1 - max(0, margin)


# -- the rules engine, behind a narrow interface ---------------------------------------


class RulesEngine(Protocol):
    """What the controller needs from the rules engine."""

    def new_window(self, size: int | None) -> Any: ...

    def initial_state(self) -> Any: ...

    def state_from_json(self, d: dict[str, Any]) -> Any: ...

    def evaluate(self, window: Any, state: Any, step: int) -> tuple[list[Any], Any]: ...

    def for_steps(self, rule: str) -> int: ...


class EngineRules:
    """The real rules engine (ppo_watchdog.core.engine) over a loaded rule set."""

    def __init__(self, paths: Sequence[str | Path]) -> None:
        from ppo_watchdog.core import engine, series
        from ppo_watchdog.core.rulefile import load_rules

        self._engine = engine
        self._series = series
        self.ruleset = load_rules([str(p) for p in paths])

    def new_window(self, size: int | None) -> Any:
        # Only what the rules read (metrics and steps): a daemon holds one window per run it watches.
        if size is None:
            size = self._series.window_steps(self.ruleset.max_window)
        return self._series.Window(size, self.ruleset.metrics)

    def initial_state(self) -> Any:
        return self._engine.EngineState()

    def state_from_json(self, d: dict[str, Any]) -> Any:
        return self._engine.EngineState.from_json(d)

    def evaluate(self, window: Any, state: Any, step: int,
                 verdicts: Sequence[Verdict] | None = None) -> tuple[list[Any], Any]:
        return self._engine.evaluate(self.ruleset, window, state, step, verdicts)

    def screen(self, batch: Sequence[tuple[Any, int, Any]]) -> list[list[Verdict] | None]:
        """Per (window, step, engine state): what is sure of each rule at that step (``ppo_watchdog.core.screen``,
        imported when first screened: numpy stays out of a command's start-up)."""
        from ppo_watchdog.core.screen import screen_for

        return screen_for(self.ruleset)([(w, step, state.event_seq) for w, step, state in batch])

    def rule_names(self) -> list[str]:
        """Names of the loaded rules, in file order."""
        return [str(r.name) for r in getattr(self.ruleset, "rules", ())]

    def said(self, decision: Any) -> str:
        """What the decision's rule saw, in words (its ``summary:`` rendered with the decision's inputs)."""
        from ppo_watchdog.core.summary import evidence

        return evidence(self.ruleset.get(decision.rule), decision.kind, decision.step, decision.inputs,
                        decision.message)

    def progress_steps(self, rule: str) -> int | None:
        """The steps of recovery after which ``rule``'s budget forgets its fires (its ``progress``), or None."""
        budget = getattr(self.ruleset.get(rule), "budget", None) if hasattr(self.ruleset, "get") else None
        progress = getattr(budget, "progress", None)
        return progress if isinstance(progress, int) else None

    def for_steps(self, rule: str) -> int:
        for r in getattr(self.ruleset, "rules", ()):
            if getattr(r, "name", None) == rule:
                for attr in ("for_steps", "for_", "hold"):
                    v = getattr(r, attr, None)
                    if isinstance(v, int):
                        return v
        return 1


# -- the shell ------------------------------------------------------------------------


class NullTelemetry:
    """Stands in for :class:`ppo_watchdog.observe.telemetry.WatchdogMetrics` when none is given."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


@dataclass
class TickResult:
    """What one tick did (for logs and tests)."""

    new_steps: list[int] = field(default_factory=list)
    """Steps evaluated."""
    decisions: list[int] = field(default_factory=list)
    """Decision ids recorded."""
    done: bool = False
    """The run needs no more watching (finished or given up)."""


class _Undo(NamedTuple):
    """A run as the last commit left it, for :meth:`RunController._restore`."""

    offsets: Any
    """The read positions."""
    state: Any
    """The engine state."""
    fields: dict[str, Any]
    """The controller's tick fields (:data:`_TICK_FIELDS`)."""
    run_fields: dict[str, Any]
    """The run record's (:data:`_TICK_RUN_FIELDS`)."""
    rebuild: bool = True
    """The window may have moved since: it is rebuilt from the files up to ``offsets``."""


@dataclass
class _Read:
    """What :meth:`RunController.read_and_evaluate` found, for :meth:`RunController.decide` to write."""

    steps: list[int]
    """The steps of the records read (not the records: their values are in the window now, and a daemon holds
    a group's reads until their chunk is written)."""
    events: list[Event]
    decisions: list[Any]
    fresh: bool
    """Anything to evaluate or save: new lines, held events, moved positions."""
    first_step: int | None
    """The run's first step this watchdog saw, when it is in this read (the steps before it were never judged)."""
    undo: _Undo
    """The run as the last commit left it."""


class RunController:
    """Watches and remediates one run; call :meth:`tick` periodically (never concurrently)."""

    def __init__(
        self, store: Store, run_id: str, rules: RulesEngine, actuator: Actuator,
        config: ControllerConfig | None = None, telemetry: Any = None, backend: Backend | None = None,
        source: Any = None, setup: RunSetup | None = None,
    ) -> None:
        """``backend``: this run's own (a Ray Job backend for its cluster); default the actuator's.
        ``source``: what the run's metrics and events are read through (``poll()``, ``offsets``, as
        :class:`~ppo_watchdog.sources.ingest.RunTailer`; e.g. a :class:`~ppo_watchdog.sources.prometheus.PrometheusSource`);
        default a RunTailer on the run directory. ``setup``: the run directory as the attach read it
        (:class:`~ppo_watchdog.backends.zero_patch.RunSetup`: run.json read once, the mode, dialect and
        checkpoint directory decided there); default read here."""
        self.store = store
        self.rules = rules
        self.actuator = actuator
        self.config = config or ControllerConfig()
        self.telemetry = telemetry or NullTelemetry()
        run = store.require_run(run_id)
        from ppo_watchdog.backends.zero_patch import RunSetup as _RunSetup

        self.setup = setup if setup is not None else _RunSetup.read(run.run_dir)
        """run.json as this attach read it, and the mode, dialect and checkpoint directory that follow."""
        self.h = RunHandle(run, backend=backend, dialect=self.setup.dialect(run_id),
                           on_live_timeout=self._on_live_timeout, advise=self.config.advise,
                           approve=self.config.approve, approve_timeout_s=self.config.approve_timeout_s,
                           on_answer=self._on_answer)
        from ppo_watchdog.sources.ingest import RunTailer

        saved = store.load_engine_state(run_id) or {}
        self.tailer = source if source is not None else RunTailer(run.run_dir)
        if saved.get("tailer"):
            self.tailer.offsets = saved["tailer"]
        self.window = rules.new_window(self.config.window_size)
        self.state = rules.state_from_json(saved["engine"]) if saved.get("engine") else rules.initial_state()
        self._rebuild_window(saved.get("tailer"))
        self.latest: dict[str, float] = {}
        """The newest logged value of each metric, by catalog short name (what a set starts from)."""
        ctl = saved.get("controller") or {}
        self._last_checkpoint: int | None = ctl.get("last_checkpoint")
        """Step of the newest checkpoint event (a tuning relaunch waits for one)."""
        self._last_tuning_clock: int | None = ctl.get("last_tuning_relaunch")
        """Engine clock at the last relaunch made for tuning only."""
        self._blind_warned = bool(ctl.get("blind_warned"))
        self._paused_since: float | None = None
        """When the run last entered a pause for a human (the pause timeout counts from there)."""
        self._published_for: Any = None
        """The engine state last published (the same object: nothing to set)."""
        self._published_states: dict[str, Any] = {}
        """Each rule's state as last set on the telemetry gauges (only a change is set again)."""
        self._published_rules: Any = None
        """The engine state's rules mapping last published (the engine keeps it when no rule changed)."""
        self._rule_names: tuple[str, ...] | None = None
        self._saved_state: Any = None
        """The engine-state blob last committed (a tick that changed nothing does not write it again)."""
        self._undo: _Undo | None = None
        """What this tick's read changed, as it stood before (see :meth:`undo_decide`)."""
        self._read: _Read | None = None
        """This tick's read and evaluation, until :meth:`decide` writes it."""
        self.verdicts: Sequence[Verdict] | None = None
        """For the rules' next step, what a screen found of each rule (:func:`read_and_evaluate_all`, the engine's
        ``verdicts``); None: every rule is evaluated."""
        self._failed_ticks = 0
        """Ticks in a row that failed at the same read position (``_failed_at``)."""
        self._failed_at: Mapping[str, Any] | None = None
        self._step_times: list[float] = []
        self._saw_finished = False
        self._saw_oom: dict[str, Any] | None = None
        self._saw_resume_failed: Event | None = None
        """This attempt's ``error`` event saying it could not load the checkpoint it resumed from."""
        self._control_errors: dict[int, list[str]] = {}  # version -> the trainer's refusals, until its ``applied``
        self._events_since_eval = False
        self._held: list[Event] = []
        """Events past the run's last step, delivered once it gets there (never, when it ends first)."""
        # True from a rollback (or restart from a checkpoint) being decided until the metrics show
        # the trainer back on an earlier step: divergence rules keep firing on the abandoned steps
        # meanwhile, and those fires are the same divergence, not a new one.
        self._rewind_pending = any(e.kind in (JournalKind.ROLLBACK, JournalKind.RESTART)
                                   and e.status not in (ActionStatus.WAITING, ActionStatus.AWAITING)
                                   for e in store.open_actions(run_id))
        self._published_awaiting = 0
        """Entries of this run waiting for a person, as last set on the telemetry gauge."""
        self._published_relaunch = False
        """Whether a relaunch of the watchdog's is under way, as last set on the telemetry gauge."""
        self._rewind_to: int | None = None
        """Step the trainer went back to (its rollback / started event); the next step there ends the wait."""
        # launched_ts of the launch whose first step has been seen; until then the (long)
        # startup timeout applies instead of the heartbeat. A re-attached run counts as started.
        self._attempt_ts: float | None = run.launched_ts
        """launched_ts of the attempt the run's ``oom`` / ``finished`` events are judged for."""
        self._launch_seen: float | None = run.launched_ts if run.last_step is not None else None
        self._started_ts: float | None = run.launched_ts if run.last_step is not None else None
        if run.phase in (Phase.RUNNING, Phase.PAUSED, Phase.ESCALATED, Phase.RESTARTING):
            self._attach()

    @property
    def run(self) -> RunRecord:
        return self.h.run

    def _attach(self) -> None:
        """Adopt the trainer an earlier watchdog started: by Ray job id, else by pid."""
        run, backend = self.run, self.h.backend or self.actuator.backend
        if run.job_id is not None:
            attach_job = getattr(backend, "attach_job", None)
            if attach_job is None:
                raise SupervisorError(f"run {run.run_id}: its trainer runs as Ray job {run.job_id}; "
                                      "give the run its Ray address to watch it")
            # Kept even when it has ended: the job server still knows its exit code.
            self.h.proc = attach_job(run.job_id, Path(run.run_dir) / self.actuator.config.log_name)
            log.info("%s: attached to Ray job %s", run.run_id, run.job_id)
        elif run.pid is not None:
            if isinstance(backend, LocalBackend):
                # A pid is an identity only with its start: a trainer that ended may have left its pid to
                # another process, which must never be watched, signalled or killed as the trainer.
                why = not_the_trainer(run.pid, run.run_dir, info=self.setup.info)
                if why is not None:
                    if "is not running" not in why:
                        log.error("%s: not adopted: %s", run.run_id, why)
                    return
            proc = backend.attach(run.pid)
            if proc.alive():
                self.h.proc = proc
                log.info("%s: attached to running trainer pid %d", run.run_id, run.pid)

    def _rebuild_window(self, offsets: Mapping[str, Any] | None) -> None:
        """After a watchdog restart: the window as it stood (records and events read so far)."""
        if not offsets:
            return
        replay = getattr(self.tailer, "replay", None)
        if callable(replay):  # a source other than the run's files (Prometheus) reads its own history
            records, events = replay()
            for rec in records:
                self.window.append_record(rec)
            self.window.add_events(events)
            return
        from ppo_watchdog.sources.ingest import dedup_records, forward_only, record_from_json, rewind_targets

        run_dir = Path(self.run.run_dir)
        m_off = int(offsets.get("metrics", {}).get("offset", 0))
        e_off = int(offsets.get("events", {}).get("offset", 0))
        chunk = rundir.read_jsonl(run_dir / rundir.METRICS, until=m_off)
        events = rundir.events_of(rundir.read_jsonl(run_dir / rundir.EVENTS, until=e_off))
        valid = [(rec, line) for rec, line in ((record_from_json(obj)[0], n) for obj, n in
                                               zip(chunk.records, chunk.lines, strict=False)) if rec is not None]
        # The lines the tailer ignored (a step below the last with nothing to explain it) stay ignored.
        recs, _, _ = forward_only([r for r, _ in valid], [n for _, n in valid], chunk.path, None,
                                  rewind_targets(events))
        for rec in dedup_records(recs):
            self.window.append_record(rec)
        # Events in file order so their sequence numbers match what the engine state remembers.
        self.window.add_events(events)

    # -- tick --------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> TickResult:
        """Launch if new, ingest, evaluate, plan (committed), watch liveness, drive actions.

        The four stages (:meth:`prepare`, :meth:`read_and_evaluate`, :meth:`decide`, :meth:`act`) are
        what a daemon runs over all its runs, with many runs' :meth:`decide` in one transaction
        (``Watchdog.tick``); alone, a run commits its own."""
        now = time.time() if now is None else now
        result = TickResult()
        failed = self.prepare(now, result)
        if result.done:
            return result
        if failed is None:
            failed = self.read_and_evaluate(now, result)
            if failed is None:
                failed = self.decide(now, result)
        self.committed()
        if failed is None and result.decisions:
            self.actuator.crash_hook("decided")
        return self.act(now, result, failed)

    def prepare(self, now: float, result: TickResult) -> Exception | None:
        """Launch a new run (its pid committed at once, never inside a tick's transaction) and let the
        dialect relay what the trainer wrote; returns the error that stops this tick's read, if any.
        ``result.done`` is set when the launch was refused for good."""
        if self.run.phase == Phase.NEW:
            try:
                self.actuator.launch(self.h, None, now)
            except LaunchRefused as exc:  # no such program: every retry would fail the same way
                self._give_up("watchdog:launch", str(exc))
                result.done = True
                return None
        if self.run.launched_ts != self._attempt_ts:
            # A new attempt (this watchdog's launch or restart): what the last one said about how it
            # ended (an ``oom``, ``finished``) is not this one's.
            self._attempt_ts = self.run.launched_ts
            self._saw_finished, self._saw_oom, self._saw_resume_failed = False, None, None
        try:
            # verl writes no events: its dialect relays the metrics, notes the checkpoints and classifies the
            # exit (not that of a trainer the watchdog stopped itself to pause the run).
            t0 = time.perf_counter()
            self.h.dialect.poll(self.h.proc, watch_exit=self.run.phase not in (Phase.PAUSED, Phase.ESCALATED))
            self.telemetry.phase_time("read", time.perf_counter() - t0)
        except Exception as exc:
            return exc
        return None

    def read_and_evaluate(self, now: float, result: TickResult) -> Exception | None:
        """Read what is new and run the rules over it, in memory only: nothing is written, so no lock is
        held (a daemon reads and evaluates a group of runs before it opens their chunks' transactions).
        Returns the error if it failed, in which case the run is back where the last commit left it.

        The rules read the run's metrics and events alone, never the store, so what they decide here is
        what they would decide inside the transaction; planning those decisions against the journal
        is :meth:`decide`'s, inside it (RELIABILITY.md: no action on stale data)."""
        return read_and_evaluate_all([(self, now, result)])[0]

    def reading(self, now: float, result: TickResult) -> Generator[int, None, Exception | None]:
        """:meth:`read_and_evaluate` in steps: it pauses (yields the step) before the rules run at each new
        step, the window holding that step as its newest, so a daemon can screen many runs' rules at once
        (:func:`read_and_evaluate_all`) and set :attr:`verdicts` for each."""
        self._undo, self._read, self.verdicts = None, None, None
        try:
            self._read = yield from self._read_ahead(now, result)
        except Exception as exc:  # put back (or putting it back failed too): this run's tick fails alone
            return exc
        self._undo = self._read.undo
        return None

    def _read_ahead(self, now: float, result: TickResult) -> Generator[int, None, _Read]:
        offsets = self.tailer.offsets
        if not getattr(self.tailer, "offsets_are_snapshots", False):
            offsets = json.loads(json.dumps(offsets))  # a copy that the poll below cannot change
        fields = dict(zip(_TICK_FIELDS, _tick_fields(self), strict=True))
        for name in _TICK_CHANGED_IN_PLACE:
            fields[name] = fields[name].copy()
        undo = _Undo(offsets, self.state, fields, dict(zip(_TICK_RUN_FIELDS, _tick_run_fields(self.run), strict=True)))
        try:
            t0 = time.perf_counter()
            records, events = self.tailer.poll()  # files (or a metric source) only
            self.telemetry.phase_time("read", time.perf_counter() - t0)
            fresh = (bool(records or events or self._held or self._events_since_eval)
                     or self.tailer.offsets != offsets)
            t0 = time.perf_counter()
            rows = self._values(records)
            del records  # (each line's record let go before the lockstep's first pause: see _values)
            self.telemetry.phase_time("decide", time.perf_counter() - t0)
            steps = [step for step, _, _, _ in rows]
            first_step = steps[0] if steps and self.run.last_step is None else None
            decisions = (yield from self._evaluate(rows, events, now, result)) if fresh else []
        except BaseException as exc:  # GeneratorExit too: a lockstep abandoned half-way puts this run back
            self._restore(undo, result, exc if isinstance(exc, Exception) else RuntimeError("tick abandoned"))
            raise
        # Nothing read: the window and positions did not move, and a failure later keeps them as they are
        # (a chunk whose transaction cannot begin does not read 256 runs' history again).
        return _Read(steps, events, decisions, fresh, first_step, undo if fresh else undo._replace(rebuild=False))

    def decide(self, now: float, result: TickResult) -> Exception | None:
        """Plan and write what :meth:`read_and_evaluate` found, with the read positions (a savepoint in the
        caller's transaction, or a transaction of its own): all or nothing.

        A tick that fails (a store that stays locked, an unforeseen error) keeps neither its
        decisions nor its positions: the window, engine state and positions go back to where the
        last commit left them, so the next tick reads the same lines again and decides on them.
        A failure that repeats at the same position is said, once, to the console and the webhook.
        Inside a daemon's tick transaction this is a savepoint: when the tick's commit itself fails
        afterwards, the daemon calls :meth:`undo_decide` to put this run back the same way. Returns
        the error if it failed; the trainer is still watched (a run whose files cannot be read right
        now, a garbled run.json, is still seen to end, or to hang)."""
        read, self._read = self._read, None
        if read is None:
            raise RuntimeError("decide() before read_and_evaluate()")
        try:
            self._write(read, now, result)
        except Exception as exc:  # put back (or putting it back failed too): this run's tick fails alone
            return exc
        self._failed_ticks = 0
        return None

    def _write(self, read: _Read, now: float, result: TickResult) -> None:
        offsets, state = read.undo.offsets, read.undo.state
        try:
            if not read.fresh and self._controller_state() == self._saved_state and not self._waiting():
                # Nothing new, nothing held back, nothing waiting to be released, nothing unsaved: the engine
                # did not run and nothing is written. A run with nothing new costs two stats.
                return
            # Everything this read writes (confirmations of applied versions, closed spans, decisions,
            # intents, engine state, positions) is kept together or not at all.
            with self.store.savepoint():
                t0 = time.perf_counter()
                self._handle_events(read.events, now)
                self._after_events(read, now)
                t1 = time.perf_counter()
                self.telemetry.phase_time("decide", t1 - t0)
                # Nothing read, nothing decided, the engine not run, the positions where they were: the
                # stored state is still this one (an idle run costs a stat per file, no write).
                changed = (bool(read.steps or read.events or read.decisions) or self.state is not state
                           or self.tailer.offsets != offsets)
                self._commit(read.decisions, result, changed)
                self.telemetry.phase_time("commit", time.perf_counter() - t1)
        except Exception as exc:
            self._undo = None  # put back here: the chunk's failure, if any, does not put it back again
            self._restore(read.undo, result, exc)
            raise

    def _after_events(self, read: _Read, now: float) -> None:
        """What the read's steps mean once its events are handled (the rules ran before them, in memory;
        events change the run's record and journal, never what the rules see)."""
        if not read.steps:
            return
        if read.first_step is not None:
            # The first step this watchdog sees of the run: the steps before it were never judged,
            # and their checkpoints are not known-good (a run may be broken before it is watched).
            self.store.mark_unwatched(self.run.run_id, read.first_step)
        if self._rewind_to is not None and min(read.steps) <= self._rewind_to + 1:
            # A step of the new timeline: metrics from there on are after the rollback.
            self._rewind_pending, self._rewind_to = False, None
            self._measure_restore(now)
        if self._started_ts is not None and self._started_ts >= (self.run.launched_ts or 0):
            # A step from the process launched last (not a stale line of the one stopped before).
            if self._launch_seen != self.run.launched_ts:
                self._measure_startup(now)
            self._launch_seen = self.run.launched_ts

    def act(self, now: float, result: TickResult, failed: Exception | None) -> TickResult:
        """After the decisions are committed: protect known-good checkpoints, watch liveness, drive the
        journal's open actions; raises ``failed`` (the read's error) unless the run has ended."""
        t_act = time.perf_counter()
        if failed is None:
            try:
                self._protect_known_good()
            except Exception as exc:
                failed = exc
        self._watch_liveness(now)
        self._check_pause_timeout(now)
        entries = self.store.open_actions(self.run.run_id)
        for entry in entries:
            if entry.status == ActionStatus.WAITING:
                continue
            if self.run.phase in DONE_PHASES and entry.kind not in (JournalKind.NOTIFY, JournalKind.STOP):
                # The run has ended (stopped with a verdict, given up, finished): nothing may relaunch
                # it, and a live change can never be confirmed. Closed, said, not left open forever.
                self.store.update_action(entry.id, status=ActionStatus.FAILED,
                                         result={**entry.result, "error": f"the run had {self.run.phase}"})
                if entry.decision_id is not None:
                    self.store.settle_decision(entry.decision_id)
                continue
            if (entry.kind == JournalKind.RESTART and entry.status in (ActionStatus.INTENT, ActionStatus.SENT)
                    and not self._published_relaunch):
                # Said before the stop (a relaunch holds the tick while the old trainer shuts down), and until the
                # new trainer's first step: its /metrics is down on purpose, PPOTrainerDown keeps quiet.
                self.telemetry.planned_relaunch(self.run.run_id, True)
                self._published_relaunch = True
            self.actuator.drive(self.h, entry, now)
        if entries or self._published_awaiting:
            awaiting = sum(e.status == ActionStatus.AWAITING for e in self.store.open_actions(self.run.run_id))
            if awaiting != self._published_awaiting:  # (set on a change only: most runs never hold one)
                self.telemetry.approvals_waiting(self.run.run_id, awaiting)
                self._published_awaiting = awaiting
        if self._published_relaunch or self.run.phase == Phase.RESTARTING:
            relaunching = self._relaunching(now)
            if relaunching != self._published_relaunch:
                self.telemetry.planned_relaunch(self.run.run_id, relaunching)
                self._published_relaunch = relaunching
        if self.latest:
            self.telemetry.data_age(self.run.run_id, max(0.0, now - (self.run.last_progress_ts or now)))
        self._publish_rule_states()
        self.telemetry.phase_time("act", time.perf_counter() - t_act)
        if self.run.phase in DONE_PHASES:
            if any(e.status != ActionStatus.WAITING for e in entries):  # driven above: as they stand now
                entries = self.store.open_actions(self.run.run_id)
            result.done = not any(e.status != ActionStatus.WAITING for e in entries)
        if failed is not None:
            if not result.done:
                raise failed
            log.warning("%s: the run has ended; what was left unread of it could not be read: %s",
                        self.run.run_id, failed)
        return result

    def committed(self) -> None:
        """The transaction of the last :meth:`decide` committed: what it would undo is let go (a run's last
        record and engine state, held by no one else once the tick is over)."""
        self._undo = None

    def undo_decide(self, result: TickResult, exc: Exception) -> None:
        """The transaction this run's last :meth:`decide` was part of did not commit (or never began): back
        to before this tick's read."""
        undo, self._undo, self._read = self._undo, None, None
        if undo is not None:
            self._restore(undo, result, exc)

    def _restore(self, undo: _Undo, result: TickResult, exc: Exception) -> None:
        self.tailer.offsets = undo.offsets
        self.state = undo.state
        self._saved_state = None  # what the store holds is the last committed blob, not this tick's
        for name, value in undo.fields.items():
            setattr(self, name, value)
        for name, value in undo.run_fields.items():
            setattr(self.run, name, value)
        if undo.rebuild:
            self.window = self.rules.new_window(self.config.window_size)
            self._rebuild_window(undo.offsets)
        result.decisions.clear()
        result.new_steps.clear()
        self._note_failed_tick(undo.offsets, exc)

    def _note_failed_tick(self, offsets: Mapping[str, Any], exc: Exception) -> None:
        same = offsets == self._failed_at
        self._failed_at = offsets
        self._failed_ticks = self._failed_ticks + 1 if same else 1
        if self._failed_ticks == FAILED_TICKS_NOTICE:
            msg = (f"{self.run.run_id}: {self._failed_ticks} ticks in a row failed at the same read position "
                   f"({type(exc).__name__}: {exc}); nothing read since is decided on until this is fixed, "
                   f"and every tick tries again")
            log.error(msg)
            self.actuator.notifier.notify(alert_payload(self.run.run_id, "watchdog:tick", "critical",
                                                      "the watchdog cannot decide on this run", msg))

    def _before_attempt(self, e: Event) -> bool:
        """An event written before the current attempt was launched (a trainer of an earlier attempt, or
        of before this watchdog started): what it says about how a trainer ended is not this one's."""
        ts, launched = e.get("ts"), self.run.launched_ts
        return isinstance(ts, (int, float)) and launched is not None and ts < launched - ATTEMPT_SLACK_S

    def _handle_events(self, events: list[Event], now: float) -> None:
        for e in events:
            kind = e.get("kind")
            if kind in ("finished", "oom") and self._before_attempt(e):
                log.info("%s: %s event of step %s is from before the current attempt: not counted against it",
                         self.run.run_id, kind, e.get("step"))
                continue
            if kind == "error" and e.get("source") == "control" and isinstance(e.get("version"), int):
                version, message = int(e["version"]), str(e.get("message", ""))
                said = self._control_errors.get(version, [])
                if message not in said:  # a tick read again after a failure sees it twice
                    # (a new list: the copy a failed tick puts back shares the old one)
                    self._control_errors[version] = [*said, message]
            elif kind == "applied":
                ids = [c if isinstance(c, str) else c.get("id", "") for c in e.get("commands", [])]
                version = int(e.get("version", 0))
                raw = e.get("overrides")  # the version's content as the trainer read it
                content = dict(raw) if isinstance(raw, Mapping) else None
                written = self._written_control(version)
                # Checked by content, not by number alone: a file written by hand at the watchdog's own number.
                over_own = written is not None and content is not None and content != written["overrides"]
                refusals = self._control_errors.pop(version, [])
                if over_own or (written is None and version > self.run.control_version):
                    applied = e.get("applied")
                    seen = content if content is not None else dict(applied) if isinstance(applied, Mapping) else {}
                    hidden = self.actuator.confirm(self.h, version, e.get("step"), ids, refusals, foreign=seen)
                    self._foreign_control(e, version, ids, hidden, over_own, refusals)
                else:
                    self.actuator.confirm(self.h, version, e.get("step"), ids, refusals)
            elif kind == JournalKind.ROLLBACK:
                self._rewind_to = int(e.get("to_step") or 0)
                self.store.close_bad_spans(self.run.run_id, int(e.get("from_step") or e.get("to_step") or 0))
                self.run.last_progress_ts = now
            elif kind == "paused":
                if self.run.phase == Phase.RUNNING:
                    self._set_phase(Phase.PAUSED)
            elif kind == "resumed":
                self.run.last_progress_ts = now
                self._set_phase(Phase.RUNNING)
            elif kind == "finished":
                self._saw_finished = True
            elif kind == "checkpoint" and isinstance(e.get("step"), int):
                self._last_checkpoint = int(e["step"])
            elif kind == "oom":
                self._saw_oom = e
            elif resume_failure(e) is not None and not self._before_attempt(e):
                self._saw_resume_failed = e
            elif kind == "started":
                self._saw_finished = False
                self._saw_oom = None
                self.run.last_progress_ts = now
                self._started_ts = float(e.get("ts") or now)
                if self._rewind_pending:
                    self._rewind_to = int(e.get("resumed_from") or e.get("step") or 0)

    def _written_control(self, version: int) -> dict[str, Any] | None:
        """The store's record of the control.json version the watchdog wrote at ``version`` (None: none)."""
        return next((v for v in self.store.control_versions(self.run.run_id) if v["version"] == version), None)

    def _foreign_control(self, e: Event, version: int, command_ids: Sequence[str],
                         hidden: Sequence[ActionRecord] = (), over_own: bool = False,
                         refusals: Sequence[str] = ()) -> None:
        """A version the watchdog never wrote was applied: said at once (console, history, webhook) with
        the values it changed, and adopted as the run's desired state. The trainer runs with those
        values, so the rules' next sets start from them and the watchdog's next version keeps them
        (a relaunch too) rather than silently undoing a human's change (RELIABILITY.md). ``hidden``: the
        watchdog's own changes still waiting for the trainer that this version left out (re-opened by
        :meth:`Actuator.confirm`): they are sent again on top, and said so. ``over_own``: it was written at
        the number of a version the watchdog wrote, over it. ``refusals``: the trainer's ``error`` messages
        about that version (a key it cannot change live, and why), said with it: those keys did not change."""
        raw = e.get("applied")
        applied: dict[str, Any] = dict(raw) if isinstance(raw, Mapping) else {}
        changed = {k: v for k, v in applied.items() if self.run.overrides.get(k) != v}
        cfg = run_config(self.run.run_dir)
        was = {k: self.run.overrides.get(k, config_value(cfg, k)) for k in changed}
        said = ", ".join(f"{k} {was[k]!r} -> {v!r}" if was[k] is not None else f"{k} -> {v!r}"
                         for k, v in changed.items()) or "no override"
        cmds = f"; commands {', '.join(command_ids)}" if command_ids else ""
        over = " (it replaced the watchdog's own version of that number)" if over_own else ""
        message = (f"control.json version {version}, applied at step {e.get('step')}, was not written by the "
                   f"watchdog{over}: it changed {said}{cmds}. The watchdog adopts these values: its next sets start "
                   f"from them")
        if refusals:
            message += "; the trainer refused part of it: " + "; ".join(refusals)
        if hidden:
            what = "; ".join(f"set {', '.join(f'{k}={v!r}' for k, v in (h.payload.get('set') or {}).items())}"
                             if h.kind == JournalKind.LIVE_SET else
                             f"command {(h.payload.get('command') or {}).get('kind', h.kind)}" for h in hidden)
            message += (f"; it left out the watchdog's own change still waiting for the trainer ({what}), "
                        "which is sent again in a new version on top")
        log.warning("%s: %s", self.run.run_id, message)
        overrides = {**self.run.overrides, **applied}
        with self.store.transaction():
            did = self.store.add_decision(self.run.run_id, e.get("step") or self.run.last_step or 0,
                                          RULE_FOREIGN_CONTROL, "fire", [], {**changed, "version": version},
                                          "warning", message)
            self.store.add_action(self.run.run_id, "notify", {
                "rule": RULE_FOREIGN_CONTROL, "severity": "warning",
                "summary": f"control.json version {version} was not written by the watchdog",
                "description": message}, decision_id=did)
            self.store.update_run(self.run.run_id, overrides=overrides)
        self.run.overrides = overrides

    @staticmethod
    def _values(records: list[dict[str, Any]]) -> list[tuple[int, dict[str, float], dict[str, str], Any]]:
        """Each record read as (step, the values the rules read under their short names, the verl key each came
        from, ``perf/time_per_step``): mapped before the rules run, so that a lockstep over a thousand runs holds
        these, not every line's hundred keys of verl's until its step comes."""
        rows = []
        for rec in records:
            data = rec.get("data", {})
            if not isinstance(data, Mapping):
                data = {}
            sources: dict[str, str] = {}
            # Mapped once, for the window (what the rules read) and for ``latest`` (what a set starts from).
            rows.append((int(rec["step"]), catalog.to_short(data, sources), sources, data.get("perf/time_per_step")))
        return rows

    def _evaluate(self, rows: list[tuple[int, dict[str, float], dict[str, str], Any]], events: list[Event],
                  now: float, result: TickResult) -> Generator[int, None, list[Any]]:
        """The new steps (:meth:`_values`) into the window and the rules run at each, pausing before each step's
        rules (see :meth:`reading`). Its own time, not the pauses, is the tick's decide phase."""
        began = time.perf_counter()
        pending = sorted([*self._held, *events], key=lambda e: int(e["step"]) if isinstance(e.get("step"), int) else -1)
        self._held = []
        decisions: list[Any] = []
        for step, short, sources, t in rows:
            while pending and isinstance(pending[0].get("step"), int) and pending[0]["step"] <= step:
                self.window.add_event(pending.pop(0))
            while pending and not isinstance(pending[0].get("step"), int):
                self.window.add_event(pending.pop(0))
            self.window.sources.update(sources)  # (as of this step: a decision names the key its value came from)
            self.window.append(step, short)
            self.latest.update(short)
            if _finite(t):
                self._step_times = (self._step_times + [float(t)])[-50:]
            self.run.last_progress_ts = now
            self.run.last_step = step
            self._events_since_eval = False
            self.telemetry.phase_time("decide", time.perf_counter() - began)
            yield step
            began = time.perf_counter()
            decisions += self._run_engine(step, result)
        alive = self.h.proc is not None and self.h.proc.alive()
        # Read from files, every step is seen (a Prometheus source samples steps: its last step may lag).
        files = not callable(getattr(self.tailer, "replay", None))
        if pending and files and self.run.last_step is not None:
            # An event past the run's last step (a hand-edited line, another run's) is not taken for
            # something that happened at the last step: it waits until the run gets there, and once
            # the trainer has ended (it never will) it is said and never acted on.
            pending, outside = past_the_end(pending, self.run.last_step)
            if self.h.proc is not None and not alive:
                for e in outside:
                    log.warning("%s: %s", self.run.run_id, outside_message(e, self.run.last_step))
            else:
                self._held = outside
        if pending:
            self.window.add_events(pending)
            self._events_since_eval = True
        if self._events_since_eval and not alive and self.run.last_step is not None:
            # The trainer ended after events no metric line followed (an OOM mid-step): let the
            # rules see them now, at the step the trainer was in.
            steps = [e.step for e in events if e.step is not None]
            step = max([self.run.last_step] + [s for s in steps if not files or s <= self.run.last_step + STEP_SLACK])
            self._events_since_eval = False
            decisions += self._run_engine(step, result)
        self.telemetry.phase_time("decide", time.perf_counter() - began)
        return decisions

    def _warn_blind(self) -> None:
        """Once per run, a few steps in: the rules that read a metric this run does not log, and why."""
        self._blind_warned = True
        from ppo_watchdog.core.engine import blind_rules, describe_blind

        for line in describe_blind(blind_rules(getattr(self.rules, "ruleset", ()), self.window.sources)):
            log.warning("%s: %s", self.run.run_id, line)

    def _run_engine(self, step: int, result: TickResult) -> list[Any]:
        verdicts, self.verdicts = self.verdicts, None  # for this step only, whatever happens next
        if not self._blind_warned and len(self.window.steps()) >= BLIND_AFTER_STEPS:
            self._warn_blind()
        try:
            if verdicts is not None:
                decisions, self.state = self.rules.evaluate(self.window, self.state, step, verdicts)  # type: ignore[call-arg]
            else:
                decisions, self.state = self.rules.evaluate(self.window, self.state, step)
        except Exception:  # recorded; the loop goes on with the old state
            log.exception("%s: rules failed at step %d", self.run.run_id, step)
            self.telemetry.error(self.run.run_id, "evaluate")
            return []
        result.new_steps.append(step)
        return list(decisions)

    def _plan_context(self, overrides: Mapping[str, Any], cfg: Mapping[str, Any]) -> PlanContext:
        # The trainer says what it can change live (run.json); without that, the configured list.
        # An empty list is an answer too: a zero-patch verl run changes nothing live.
        live = RunInfo.read(self.run.run_dir).live_keys
        live_keys = live if live is not None else self.config.live_keys
        return PlanContext(overrides, self.latest, cfg, live_keys, dict(self.window.sources), self.config.on_escalate,
                           run_world_size(self.run.run_dir))

    def cost_model(self) -> CostModel:
        """This run's prices: its measured start-up (else the configured one) and median step time."""
        times = sorted(self._step_times)
        return CostModel(self.run.startup_s if self.run.startup_s is not None else self.config.startup_s,
                         times[len(times) // 2] if times else 0.0)

    def _steps_since_checkpoint(self) -> int:
        if self.run.last_step is None:
            return 0
        return max(0, self.run.last_step - (self._last_checkpoint if self._last_checkpoint is not None else 0))

    def _commit(self, decisions: list[Any], result: TickResult, changed: bool = True) -> None:
        """Decisions, intents, engine state and offsets in one transaction (before acting); the engine
        state and read positions only when the tick ``changed`` them."""
        cfg: dict[str, Any] | None = None  # run.json's config, read only when there is a decision to plan
        with self.store.transaction():
            waiting = self._waiting()
            overrides = {**self.run.overrides, **{k: v for e in waiting for k, v in e.payload.get("set", {}).items()}}
            for d in decisions:
                if cfg is None:
                    cfg = run_config(self.run.run_dir)
                said = self.rules.said(d) if hasattr(self.rules, "said") else getattr(d, "message", "")
                if said != getattr(d, "message", said):
                    d = dataclasses.replace(d, message=said)  # the sentence: stored, alerted, annotated
                recurrence = self._recurrence(d) if getattr(d, "divergence", False) else None
                if recurrence is not None and recurrence[1] > getattr(d, "repeat", 1):
                    # The same trouble again after a rewind: every growing set cuts as its n-th fire.
                    d = dataclasses.replace(d, repeat=recurrence[1])
                ctx = self._plan_context(overrides, cfg)
                planned = plan_decision(d, ctx)
                if recurrence is not None:
                    for p in planned:
                        if p.kind == JournalKind.ROLLBACK:
                            p.payload["rewind"] = recurrence[1]
                covered = "" if planned else left_out_reason(d, ctx)
                if self._saw_finished and any(p.kind not in (JournalKind.NOTIFY, JournalKind.ROLLBACK) for p in planned):
                    # The trainer wrote its last step and ended: nothing is left to change live. Said, not
                    # done. A rollback still goes: it re-runs the tail from the known-good checkpoint,
                    # since the final weights are what the run is for.
                    covered = "too late: the trainer had finished"
                    planned = [p for p in planned if p.kind in (JournalKind.NOTIFY, JournalKind.ROLLBACK)]
                planned, merged = self._merge_into_pending_relaunch(planned)
                covered = covered or merged
                tuning_live = not getattr(d, "urgent", False) and any(p.kind == JournalKind.LIVE_SET for p in planned)
                if (tuning_live or any(p.relaunch for p in planned)) and self._rollback_in_flight():
                    # Decided on the abandoned timeline: a tuning live set written now would reach the
                    # trainer the rollback relaunches and overwrite the rollback's own remedy (found on
                    # TRL: a tuning lr x0.8 of the abandoned steps undid a rollback's lr x0.1). An urgent
                    # one (an OOM's smaller micro batch) is about the machine, not the timeline: it goes.
                    covered = "covered by the rollback in progress"
                    planned = []
                for p in planned:
                    if p.kind == JournalKind.LIVE_SET or self._deferrable(p):
                        overrides.update(p.payload.get("set", {}))  # a repeat compounds on what is wanted
                actions = [a.to_json() for a in d.actions]
                did = self.store.add_decision(
                    self.run.run_id, d.step, d.rule, d.kind, actions, dict(d.inputs),
                    getattr(d, "severity", ""), getattr(d, "message", ""),
                    status="pending" if planned else "skipped",
                    outcome="" if planned else covered or ("resolved" if d.kind == DecisionKind.RESOLVE else "no action"),
                    signals=dict(getattr(d, "signals", {}) or {}),
                )
                result.decisions.append(did)
                if d.kind != DecisionKind.RESOLVE and planned:
                    # Said live when it acts (a fire covered by a rollback in progress is history's, under --all),
                    # with what it tells a person (an alert's advice, a pause) in its own words.
                    told = [t for p in planned if p.kind == JournalKind.NOTIFY
                            and (t := str(p.payload.get("summary", "")).removeprefix(f"{d.rule}: ")) and t != said]
                    line = f"step {d.step}: {d.rule}: {said}" + (f"; tells a person: {'; '.join(told)}" if told else "")
                    self.store.after_commit(functools.partial(self.actuator.tell, self.run.run_id, line))
                if d.kind == DecisionKind.ESCALATE:
                    self.telemetry.escalation(self.run.run_id, d.rule)
                if planned and (getattr(d, "divergence", False) or any(p.kind == JournalKind.ROLLBACK for p in planned)):
                    # (A divergence covered by the rollback in progress is the abandoned timeline's: that
                    # rollback closes its span; a span opened for it would never close.)
                    self.store.open_bad_span(self.run.run_id, d.rule, self._suspect_from(d, recurrence), did)
                for p in planned:
                    self._journal(p, did, d.kind == DecisionKind.ESCALATE)
            self._release_waiting(None if decisions else waiting)  # (a decision may have added one)
            controller = self._controller_state()
            if not changed and controller == self._saved_state:
                return
            # The stored state as text: the engine's rules part comes encoded from its memo (unchanged most ticks).
            self.store.save_engine_state(self.run.run_id, STATE_VERSION, (
                f'{{"version": {STATE_VERSION}, "engine": {self.state.to_json_text(rundir.dumps)}, '
                f'"tailer": {rundir.dumps(self.tailer.offsets)}, "controller": {rundir.dumps(controller)}}}'))
            self._saved_state = controller
            if result.new_steps:
                self.run.last_evaluated_step = result.new_steps[-1]
            self.store.update_run(self.run.run_id, last_step=self.run.last_step,
                                  last_evaluated_step=self.run.last_evaluated_step,
                                  last_progress_ts=self.run.last_progress_ts)

    @staticmethod
    def _deferrable(p: Planned) -> bool:
        """A relaunch wanted only for tuning: it waits for the next checkpoint."""
        return p.kind == JournalKind.RESTART and p.payload.get("urgent") is False

    def _suspect_from(self, d: Any, recurrence: tuple[int, int, int | None] | None) -> int:
        """The first step whose checkpoints divergence ``d`` makes suspect (its rollback goes before it).

        As the rule says (its ``for`` and the margin), and on a recurrence (:meth:`_recurrence`) at the
        previous rewind's target at the latest, and twice as far back from ``d`` as that rewind went
        from its own detection: the cause took hold at a step nobody saw, and a rewind that proved too
        short doubles the distance back (a backoff: the start is reached in a few rewinds, not one
        checkpoint per rewind, and a run whose cause came late keeps most of what it learned).
        """
        start = self._recurring_start(d.rule, d.step, span_start(d.step, self.rules.for_steps(d.rule),
                                                                 self.config.rollback_margin_steps))
        if recurrence is None:
            return start
        target, _, lost = recurrence
        start = min(start, target)
        return start if lost is None else min(start, d.step - 2 * lost)

    def _recurring_start(self, rule: str, step: int, start: int) -> int:
        """Where the suspect steps begin when ``rule`` fires again on the timeline its last rollback began.

        The run diverged again before it got past the steps of the last divergence: the checkpoint
        it went back to already held the cause (a detection later than the rule's ``for``, say), so
        it is suspect too and the next rollback goes further back.
        """
        ends = [s.end_step for s in self.store.bad_spans(self.run.run_id) if s.rule == rule and s.end_step is not None]
        if not ends or step > ends[-1]:
            return start
        last = next((resumed for e, resumed in self._resumes() if e.payload.get("rule") == rule), None)
        return start if last is None else min(start, last)

    def _resumes(self) -> Iterator[tuple[Any, int]]:
        """This run's done rollbacks and restarts, newest first, each with the step it resumed from (its result's,
        else what it planned); entries with no such step are left out."""
        for e in reversed(self.store.journal(self.run.run_id)):
            if e.kind in (JournalKind.ROLLBACK, JournalKind.RESTART) and e.status == ActionStatus.DONE:
                step = e.result.get("resume_step", e.payload.get("resume_step"))
                if isinstance(step, int) and not isinstance(step, bool):
                    yield e, step

    def _recurrence(self, d: Any) -> tuple[int, int, int | None] | None:
        """(the previous rewind's target step, which rewind this one is, how many steps back that rewind
        went from the step it was decided at, None when unknown) when divergence ``d`` is the same trouble
        as the run's last rewind (a rollback of a divergence rule); None when it is a new one.

        It is the same trouble when the run has not trained the firing rule's budget ``progress`` steps
        (:data:`RECUR_STEPS` without one) past the step that rewind resumed from, whichever divergence rule
        fires: an lr 100x too high caught by kl_leap at step 2 and cut 10x drifts at 10x until kl_drift fires.
        Every checkpoint since that target was trained under the cause, so the span opens at the target (or
        further back: :meth:`_suspect_from`) and the rollback goes to a known-good checkpoint before it, or the
        start (the initial weights) when none is left; the n-th rewind in a row plans its sets as the rule's
        n-th fire (``grow: true`` sets compound: x0.5, then x0.25 on top, then x0.125; the schedule is in
        ``ppo_watchdog.core.planner``).
        """
        spans = {s.rule for s in self.store.bad_spans(self.run.run_id) if s.rule not in (UNWATCHED, UNLOADABLE)}
        found = next(((e, resumed) for e, resumed in self._resumes()
                      if e.payload.get("rule") in spans and e.payload.get("resume") != "latest"), None)
        if found is None:
            return None
        last, target = found
        progress = getattr(self.rules, "progress_steps", lambda _r: None)(d.rule) or RECUR_STEPS
        if d.step - target >= progress:
            return None  # the run trained ``progress`` steps past it: recovered, a new divergence
        decided = last.payload.get("step")
        lost = decided - target if isinstance(decided, int) and decided > target else None
        return target, int(last.payload.get("rewind", 1)) + 1, lost

    def _journal(self, p: Planned, did: int, escalation: bool) -> None:
        """Write one planned entry (priced; a tuning relaunch as ``waiting``)."""
        payload = dict(p.payload)
        if p.kind == JournalKind.LIVE_SET:
            payload["cost"] = CostModel.LIVE.to_json()
        elif p.kind == JournalKind.ROLLBACK and restores_in_process(self.h):
            payload["cost"] = self.cost_model().restore(self._steps_since_checkpoint()).to_json()
        elif p.relaunch:
            payload["cost"] = self.cost_model().relaunch(self._steps_since_checkpoint()).to_json()
        if self._deferrable(p):
            payload["clock"] = self.state.clock
            self.store.add_action(self.run.run_id, p.kind, payload, decision_id=did, status=ActionStatus.WAITING)
            self.store.set_decision(did, "pending", "deferred: waits for the next checkpoint (a relaunch "
                                                    "loses the steps since the last one)")
            return
        held = needs_approval(self.h, p.kind, payload)  # (it waits for a person: what follows, once approved)
        if held and payload.get("pause"):
            payload["escalation"] = escalation
        if p.relaunch:
            if not held:
                self._expect_relaunch()
            payload = self._absorb_waiting(payload)
        aid = self.store.add_action(self.run.run_id, p.kind, payload, decision_id=did)
        if p.kind == "command":
            self.store.update_action(aid, payload={**payload, "command": {**payload["command"], "id": f"c{aid}"}})
        if p.relaunch:
            self._settle_absorbed(aid)
        if payload.get("pause") and not self.h.advise and not held:  # (advise mode: the run trains on)
            self._set_phase(Phase.ESCALATED if escalation else Phase.PAUSED)

    def _expect_relaunch(self, counter: str | None = None) -> None:
        """The run's record as a relaunch just journaled leaves it: the steps from now on are the abandoned
        timeline's until the trainer shows it went back, and a restart counts against ``counter``'s budget.

        In advise mode nothing relaunches, so none of that is true and the record stays as it is: the rules'
        state, by contrast, evolves exactly as it would live (a fire counts against its rule's cooldown and
        budget whether or not its action is carried out), so advice is given once per fire, as live, and the
        decisions are those ``watchdog replay`` gives on the same logs. A trainer that stays hung is advised
        again once per heartbeat timeout (its clock starts again here), never every tick, and never given up."""
        if self.h.advise:
            if counter is not None:
                self.run.last_progress_ts = time.time()
            return
        self._rewind_pending = True
        if counter is not None:
            setattr(self.run, counter, getattr(self.run, counter) + 1)
            self.store.update_run(self.run.run_id, **{counter: getattr(self.run, counter)}, phase=Phase.RESTARTING)
            self.run.phase = Phase.RESTARTING

    def _relaunch_journaled(self, payload: Mapping[str, Any], counter: str | None = None) -> None:
        """A restart just journaled: expected now (:meth:`_expect_relaunch`), or, when it waits for a person,
        once approved (:meth:`_on_answer`: the ``counter`` it counts against is in its payload)."""
        if not needs_approval(self.h, JournalKind.RESTART, payload):
            self._expect_relaunch(counter)

    def _on_answer(self, entry: ActionRecord, approved: bool) -> None:
        """A person answered an action that waited (or its deadline did). Approved: what its journaling left
        for then (a relaunch expected and counted, the run paused). Denied: the run carries on as it is; a
        denied rollback leaves the steps it would have undone to the run (their divergence span closes here,
        so the checkpoints from now on count as known-good again); a denied relaunch of a trainer that has
        ended ends the run (nothing else will relaunch it); a denied stop restarts the pause timeout."""
        p = entry.payload
        if approved:
            if entry.kind in (JournalKind.RESTART, JournalKind.ROLLBACK):
                self._expect_relaunch(p.get("counter"))
            if p.get("pause"):
                self._set_phase(Phase.ESCALATED if p.get("escalation") else Phase.PAUSED)
            return
        if entry.kind == JournalKind.ROLLBACK:
            self.store.close_bad_spans(self.run.run_id, self.run.last_step or 0)
        elif entry.kind == JournalKind.STOP:
            self._paused_since = None
        alive = self.h.proc is not None and self.h.proc.alive()
        if entry.kind == JournalKind.RESTART and self.run.managed and not alive and self.run.phase not in DONE_PHASES:
            self._give_up(str(p.get("rule") or RULE_CRASH), f"the relaunch was denied ({entry.result.get('outcome')}) "
                                                            "and the trainer has ended")

    # -- deferred tuning relaunches -------------------------------------------------------

    def _waiting(self) -> list[ActionRecord]:
        return [e for e in self.store.open_actions(self.run.run_id) if e.status == ActionStatus.WAITING]

    def _waiting_sets(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in self._waiting():
            out.update(e.payload.get("set", {}))
        return out

    def _as_waiting(self, entries: list[ActionRecord]) -> list[Waiting]:
        return [Waiting(e.id, str(e.payload.get("rule", "")), int(e.payload.get("step", 0)), e.payload.get("set", {}))
                for e in entries]

    def _absorb_waiting(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A relaunch that goes anyway carries every waiting set whose rule still fires (its own sets win)."""
        entries = self._waiting()
        if not entries:
            return payload
        rel = release(self._as_waiting(entries), firing=self.state.firing(), checkpoint_step=self._last_checkpoint,
                      clock=self.state.clock, last_tuning_relaunch=self._last_tuning_clock,
                      policy=self.config.relaunch_policy, relaunching=True)
        self._drop(rel.dropped)
        if rel.carry:
            payload = {**payload, "set": {**rel.merged(), **payload.get("set", {})},
                       "carried": [w.id for w in rel.carry]}
        return payload

    def _settle_absorbed(self, relaunch_id: int) -> None:
        entry = self.store.get_action(relaunch_id)
        for wid in (entry.payload.get("carried", []) if entry else []):
            self._close(wid, "done", f"carried by the relaunch of journal {relaunch_id} (it went anyway)")

    def _controller_state(self) -> dict[str, Any]:
        """The controller's part of the stored state."""
        return {"last_checkpoint": self._last_checkpoint, "last_tuning_relaunch": self._last_tuning_clock,
                "blind_warned": self._blind_warned}

    def _release_waiting(self, entries: list[ActionRecord] | None = None) -> None:
        """Waiting tuning sets: dropped when their rule stopped firing, carried at a checkpoint, merged.
        ``entries``: the waiting entries, when the caller has just read them."""
        entries = self._waiting() if entries is None else entries
        if not entries:
            return
        rel = release(self._as_waiting(entries), firing=self.state.firing(), checkpoint_step=self._last_checkpoint,
                      clock=self.state.clock, last_tuning_relaunch=self._last_tuning_clock,
                      policy=self.config.relaunch_policy, relaunching=False)
        self._drop(rel.dropped)
        if not rel.carry:
            return
        first = next(e for e in entries if e.id == rel.carry[0].id)
        rules = sorted({w.rule for w in rel.carry})
        payload = {**first.payload, "set": rel.merged(), "resume": "latest",
                   "cost": self.cost_model().relaunch(self._steps_since_checkpoint()).to_json(),
                   "reason": f"tuning relaunch at the step-{self._last_checkpoint} checkpoint "
                             f"({len(rel.carry)} set(s) of {', '.join(rules)} merged)"}
        self.store.update_action(first.id, status=ActionStatus.INTENT, payload=payload)
        for w in rel.carry[1:]:
            self._close(w.id, "done", f"merged into the tuning relaunch of journal {first.id}")
        self._last_tuning_clock = self.state.clock
        self._relaunch_journaled(payload)
        log.info("%s: %s", self.run.run_id, payload["reason"])

    def _drop(self, dropped: Sequence[Waiting]) -> None:
        for w in dropped:
            self._close(w.id, "dropped", f"dropped: {w.rule} stopped firing while the set waited for a checkpoint")

    def _close(self, action_id: int, status: str, outcome: str) -> None:
        entry = self.store.get_action(action_id)
        if entry is None:
            return
        self.store.update_action(action_id, status=status, result={**entry.result, "outcome": outcome})
        if entry.decision_id is not None:
            self.store.settle_decision(entry.decision_id)

    def _relaunching(self, now: float) -> bool:
        """A relaunch of the watchdog's is under way: a restart not carried out yet, or one whose new trainer has
        not logged its first step (within the startup timeout: a trainer that never comes up is down, not
        relaunching)."""
        if self.run.phase in DONE_PHASES:
            return False
        if self.run.phase == Phase.RESTARTING:
            return True
        restarts = [e for e in self.store.journal(self.run.run_id) if e.kind == JournalKind.RESTART]
        if any(e.status in (ActionStatus.INTENT, ActionStatus.SENT) for e in restarts):
            return True
        done = [e for e in restarts if e.status == ActionStatus.DONE]
        stopped = done[-1].result.get("stopped_ts") if done else None
        return (isinstance(stopped, (int, float)) and "relaunch_s" not in done[-1].result
                and now - stopped < self.config.startup_timeout_s)

    def _measure_startup(self, now: float) -> None:
        """The first step of a relaunch: what the relaunch cost, stop to this step (kept for pricing)."""
        done = [e for e in self.store.journal(self.run.run_id) if e.kind == JournalKind.RESTART and e.status == ActionStatus.DONE
                and isinstance(e.result.get("stopped_ts"), (int, float))]
        if not done or done[-1].result.get("pid") != self.run.pid or "relaunch_s" in done[-1].result:
            return  # not a relaunch of the watchdog's (the first launch), or measured already
        startup = max(0.0, now - float(done[-1].result["stopped_ts"]))
        self.run.startup_s = startup
        self.store.update_run(self.run.run_id, startup_s=startup)
        self.store.update_action(done[-1].id, result={**done[-1].result, "relaunch_s": round(startup, 3)})
        log.info("%s: relaunch took %.1f s (stop to first new step)", self.run.run_id, startup)

    def _measure_restore(self, now: float) -> None:
        """The first step after a rollback done in process: decision to this step (``first_step_s``, on its entry)."""
        last = next((e for e in reversed(self.store.journal(self.run.run_id)) if e.kind == JournalKind.ROLLBACK), None)
        if (last is None or last.status != ActionStatus.DONE or "command" not in last.payload
                or "handed_to" in last.result or "first_step_s" in last.result):
            return  # none, by restart (measured as relaunch_s), or measured already
        self.store.update_action(last.id, result={**last.result, "first_step_s": round(now - last.created, 3)})
        log.info("%s: rolled back in process: %.1f s from the decision to the first new step", self.run.run_id,
                 now - last.created)

    def _protect_known_good(self) -> None:
        """Keep the last known-good checkpoints, and the one a rollback waiting for approval chose, out of reach
        of the trainer's own pruning (verl's ``max_*_ckpt_to_keep``); the bad spans are read only when the
        dialect has something to judge."""
        spans: list[Any] | None = None

        def is_bad(step: int, ts: float | None) -> bool:
            nonlocal spans
            if spans is None:
                spans = self.store.bad_spans(self.run.run_id)
            return any(s.covers(step, ts) for s in spans)

        # A rollback that waits for a person goes, once approved, to the checkpoint it chose: kept meanwhile.
        hold = [e.payload["chosen_step"] for e in self.store.open_actions(self.run.run_id)
                if e.kind == JournalKind.ROLLBACK and isinstance(e.payload.get("chosen_step"), int)]
        try:
            self.h.dialect.protect(is_bad, hold)
        except OSError as exc:  # a full disk, a permission: said, and the run goes on
            log.warning("%s: cannot keep the known-good checkpoint out of the trainer's pruning: %s",
                        self.run.run_id, exc)

    def _publish_rule_states(self) -> None:
        """Every rule's state for this run, every tick (a gauge set only on decisions would miss
        pending, and would keep a state the engine has long left)."""
        names = getattr(self.rules, "rule_names", None)
        rule = getattr(self.state, "rule", None)
        if not callable(names) or not callable(rule):
            return
        if self.state is self._published_for:
            return  # the engine has not run since: every gauge holds this state already
        self._published_for = self.state
        rules = getattr(self.state, "rules", None)
        if rules is not None and rules is self._published_rules:
            return  # the engine ran, and kept every rule's state (its mapping is the one already published)
        self._published_rules = rules
        if self._rule_names is None:
            self._rule_names = tuple(names())
        published = self._published_states
        for name in self._rule_names:
            status = rule(name).status
            if published.get(name) != status:  # a gauge keeps its value: set only what changed
                self.telemetry.rule_state(self.run.run_id, name, status)
                published[name] = status

    def _merge_into_pending_relaunch(self, planned: list[Planned]) -> tuple[list[Planned], str]:
        """Sets that need a relaunch join one about to happen (not carried out yet) instead of waiting."""
        target = next((e for e in self.store.open_actions(self.run.run_id) if e.kind in (JournalKind.RESTART, JournalKind.ROLLBACK)
                       and e.status == ActionStatus.INTENT and "resume_path" not in e.payload), None)
        if target is None:
            return planned, ""
        keep = [p for p in planned if not (p.kind == JournalKind.RESTART and p.payload.get("resume") == "latest")]
        merged = {k: v for p in planned if p not in keep for k, v in p.payload.get("set", {}).items()}
        if not merged:
            return planned, ""
        target.payload = {**target.payload, "set": {**target.payload.get("set", {}), **merged}}
        self.store.update_action(target.id, payload=target.payload)
        return keep, f"merged into the pending {target.kind} (journal {target.id})"

    def _rollback_in_flight(self) -> bool:
        """A rollback or restart is open, or done but the trainer's metrics do not show it yet."""
        # (One that waits for a person is not under way: the run trains on, and other actions go on meanwhile.)
        statuses = [s for s in self.store.journal_statuses(self.run.run_id, (JournalKind.ROLLBACK, JournalKind.RESTART))
                    if s not in (ActionStatus.WAITING, ActionStatus.DROPPED, ActionStatus.AWAITING, ActionStatus.DENIED)]
        if any(s in OPEN_ACTION_STATUSES for s in statuses):
            return True
        return self._rewind_pending and bool(statuses) and statuses[-1] == ActionStatus.DONE

    def _set_phase(self, phase: str) -> None:
        waiting = phase in (Phase.PAUSED, Phase.ESCALATED) and self.run.phase not in (Phase.PAUSED, Phase.ESCALATED)
        self.run.phase = phase
        self.store.update_run(self.run.run_id, phase=phase)
        if waiting:
            self._paused_since = None  # the pause timeout counts from the next tick's clock
            after = (f"; stopped with a verdict after {self.config.pause_timeout_s:.0f} s unresumed"
                     if self.config.pause_timeout_s else "")
            log.warning("%s: paused for a human: waiting for `watchdog resume %s --state-dir %s`%s",
                        self.run.run_id, self.run.run_id, self.store.path.parent, after)

    def _check_pause_timeout(self, now: float) -> None:
        """A pause nobody answers ends the run with a verdict instead of waiting forever."""
        limit = self.config.pause_timeout_s
        if limit is None or self.run.phase not in (Phase.PAUSED, Phase.ESCALATED) or self._stop_open():
            return
        since = self._paused_since if self._paused_since is not None else now
        self._paused_since = since
        if now - since <= limit:
            return
        verdict = f"paused {now - since:.0f} s for a human and nobody resumed it (pause timeout {limit:.0f} s)"
        with self.store.transaction():
            did = self._own_decision(RULE_BUDGET, verdict, {"paused_s": now - since}, kind="escalate")
            self.store.add_action(self.run.run_id, "stop", {"rule": RULE_BUDGET, "verdict": verdict},
                                  decision_id=did)

    def _stop_open(self) -> bool:
        return any(e.kind == JournalKind.STOP for e in self.store.open_actions(self.run.run_id))

    # -- liveness ------------------------------------------------------------------------

    def _restart_open(self) -> bool:
        """A relaunch is under way (a deferred one waiting for a checkpoint is not)."""
        return any(e.kind in (JournalKind.RESTART, JournalKind.ROLLBACK) and e.status != ActionStatus.WAITING
                   for e in self.store.open_actions(self.run.run_id))

    def _watch_liveness(self, now: float) -> None:
        if not self.run.managed or self.run.phase in (*DONE_PHASES, Phase.NEW):
            return
        proc = self.h.proc
        if self._restart_open():
            return
        if not self.h.dialect.live and self.run.phase in (Phase.PAUSED, Phase.ESCALATED):
            return  # the zero-patch pause stopped verl on purpose; `watchdog resume` restarts it
        if proc is None or not proc.alive():
            code = proc.poll() if proc is not None else self.run.exit_code
            how = self.h.dialect.classify_exit(code, self._saw_finished, self._saw_oom is not None)
            self.run.exit_code = code
            self.store.update_run(self.run.run_id, exit_code=code)
            if how != "finished" and self._saw_resume_failed is not None and self._on_resume_failed(code):
                return
            if how == "finished" and (short := self._finished_short()) is not None:
                self._give_up(RULE_NO_PROGRESS, short)
            elif how == "finished":
                log.info("%s: trainer finished (exit %s)", self.run.run_id, code)
                self._set_phase(Phase.FINISHED)
                for e in self.store.open_actions(self.run.run_id):
                    if e.status == ActionStatus.WAITING:
                        self._close(e.id, "dropped", "dropped: the run finished before the next checkpoint")
                        continue
                    self.store.update_action(e.id, status=ActionStatus.FAILED, result={**e.result,
                                             "error": f"run finished before the {e.kind} was confirmed"})
                    if e.decision_id is not None:
                        self.store.settle_decision(e.decision_id)
            elif how == "oom":
                self._on_oom(code)
            elif how == "usage":
                # A rejected config fails the same way every time: say why (the trainer's own error
                # line, where the user looks: console, history, webhook) instead of retrying.
                why = error_line(Path(self.run.run_dir) / self.actuator.config.log_name)
                log.error("%s: the trainer rejected its configuration (exit %s): %s; given up, nothing to retry",
                          self.run.run_id, code, why)
                self._give_up(RULE_CONFIG, f"the trainer rejected its configuration (exit {code}): {why}",
                              {"exit_code": code, "error": why})
            else:
                self._on_crash(RULE_CRASH, f"trainer exited with code {code}", {"exit_code": code})
            return
        if self.run.phase != Phase.RUNNING:
            return  # paused or escalated: no steps expected
        if not getattr(self.tailer, "healthy", True):
            return  # the metric source is down (Prometheus): no new step says nothing about the trainer
        starting = self._launch_seen != self.run.launched_ts  # no step yet since the last launch
        limit = self.config.startup_timeout_s if starting else heartbeat_timeout(self._step_times, self.config)
        idle = now - (self.run.last_progress_ts or now)
        if idle > limit:
            self._on_crash(RULE_HANG, f"no new step for {idle:.0f}s (timeout {limit:.0f}s)",
                           {"idle_s": idle, "timeout_s": limit})

    def _finished_short(self) -> str | None:
        """Why a trainer that exited as finished did not finish, or None: it was relaunched from a checkpoint and
        trained no step past it, short of the steps its run.json names (a resume that loads, trains nothing and
        reports success: verl issue 7401). A run without a relaunch, or with no stated length, is taken at its word."""
        last = next(self._resumes(), None)
        if last is None or self._launch_seen == self.run.launched_ts:
            return None  # (no relaunch, or a step of this launch was seen: it trained)
        try:
            total = RunInfo.read(self.run.run_dir).total_steps
        except RunInfoError:
            return None  # (no length it can be held to: said where run.json is read)
        if total is None:
            return None
        resumed = last[1]
        if resumed >= total:
            return None
        return (f"the trainer exited as finished, having trained no step since it resumed from step {resumed}'s "
                f"checkpoint, short of its {total} steps: the resume loaded and did nothing")

    def _on_resume_failed(self, code: int | None) -> bool:
        """The attempt died loading the checkpoint a relaunch of the watchdog's chose: relaunch from the one
        before it (:meth:`Actuator.resume_failed`), not counted against the restart budget (each checkpoint
        is given up once, so the fallbacks end at the start). False: the watchdog did not choose it."""
        e, self._saw_resume_failed = self._saw_resume_failed, None
        if e is None:
            return False
        path, why = str(e["path"]), str(e.get("message", ""))
        chose = self.actuator.chose_resume(self.h, path)
        if chose is None:
            return False
        with self.store.transaction():
            did = self._own_decision(RULE_RESUME, f"the trainer could not load {path} (exit {code}): {why}",
                                     {"exit_code": code, "path": path})
            rid = self.actuator.resume_failed(self.h, chose, why, did)
            self._relaunch_journaled(self.store.get_action(rid).payload)  # type: ignore[union-attr]
        return True

    def _own_decision(self, rule: str, message: str, inputs: dict[str, Any], kind: str = "fire") -> int:
        step = self.run.last_step if self.run.last_step is not None else 0
        did = self.store.add_decision(self.run.run_id, step, rule, kind, [], inputs, "critical", message)
        if kind == DecisionKind.ESCALATE:  # (a restart of its own is said when it is done, with why)
            self.store.after_commit(functools.partial(self.actuator.tell, self.run.run_id,
                                                      f"step {step}: {rule}: {message}"))
        return did

    def _on_oom(self, code: int | None) -> None:
        oom = self._saw_oom or {}
        self._saw_oom = None
        if self.run.oom_retries >= self.config.oom_retry_budget:
            self._give_up(RULE_OOM, f"OOM again after {self.run.oom_retries} retries")
            return
        failed_mb = oom.get("micro_batch_size")
        site = oom.get("site") if isinstance(oom.get("site"), str) else None
        # The knob of the pass that ran out (a vLLM OOM is not cured by a smaller PPO micro batch).
        sets = oom_remedy(site, run_config(self.run.run_dir), self.run.overrides, run_world_size(self.run.run_dir),
                          int(failed_mb) if isinstance(failed_mb, int) else None)
        inputs = {"exit_code": code, "micro_batch_size": failed_mb, "site": site}
        where = f" in {site}" if site else ""
        with self.store.transaction():
            did = self._own_decision(RULE_OOM, f"out of memory{where} at micro batch {failed_mb}: restart with "
                                               f"{', '.join(f'{k}={v}' for k, v in sets.items()) or 'the same settings'}",
                                     inputs)
            payload = self._absorb_waiting({"rule": RULE_OOM, "resume": "latest", "set": sets, "reason": "oom",
                                            "cost": self.cost_model().relaunch(self._steps_since_checkpoint()).to_json(),
                                            "counter": "oom_retries"})
            self._settle_absorbed(self.store.add_action(self.run.run_id, "restart", payload, decision_id=did))
            self._relaunch_journaled(payload, "oom_retries")

    def _on_crash(self, rule: str, message: str, inputs: dict[str, Any], resume: str = "known_good") -> int | None:
        """A restart counted against the restart budget (a crash, a hang, a live change not applied);
        gives the run up once the budget is spent. Returns the restart's journal id (None: given up)."""
        if self.run.restarts >= self.config.restart_budget:
            if self.h.proc is not None:
                self.actuator.stop(self.h)
            self._give_up(rule, f"{message}; restart budget ({self.config.restart_budget}) exhausted")
            return None
        log.warning("%s: %s: restarting from the %s checkpoint", self.run.run_id, message,
                    "last known-good" if resume == "known_good" else resume)
        with self.store.transaction():
            did = self._own_decision(rule, message, inputs)
            payload = self._absorb_waiting({"rule": rule, "resume": resume, "reason": message,
                                            "cost": self.cost_model().relaunch(self._steps_since_checkpoint()).to_json(),
                                            "counter": "restarts"})
            rid = self.store.add_action(self.run.run_id, "restart", payload, decision_id=did)
            self._settle_absorbed(rid)
            self._relaunch_journaled(payload, "restarts")
        return rid

    def _on_live_timeout(self, entry: ActionRecord, message: str) -> int | None:
        """The trainer runs but did not apply a control version in time: restart with the overrides."""
        return self._on_crash(RULE_LIVE_TIMEOUT, message, {"control_version": entry.control_version}, resume="latest")

    def give_up(self, rule: str, message: str, inputs: dict[str, Any] | None = None) -> None:
        """End the run as ``failed``: a human is needed (said, alerted); what is open in its journal fails."""
        self._give_up(rule, message, inputs)

    def _give_up(self, rule: str, message: str, inputs: dict[str, Any] | None = None) -> None:
        with self.store.transaction():
            # A refused configuration and a run that cannot be watched are their own rules (``watchdog run``
            # exits 2 on them); the rest are budgets.
            did = self._own_decision(rule if rule in (RULE_CONFIG, RULE_TICK) else RULE_BUDGET, f"{rule}: {message}",
                                     inputs or {}, kind="escalate")
            self.store.add_action(self.run.run_id, "notify", {
                "rule": rule, "severity": "critical", "summary": f"{rule}: run given up, a human is needed",
                "description": message,
            }, decision_id=did)
        self._set_phase(Phase.FAILED)
        for e in self.store.open_actions(self.run.run_id):
            if e.kind != JournalKind.NOTIFY:
                self.store.update_action(e.id, status=ActionStatus.FAILED, result={"error": "run given up"})
                if e.decision_id is not None:
                    self.store.settle_decision(e.decision_id)
        for e in self.store.open_actions(self.run.run_id):
            self.actuator.drive(self.h, e, time.time())


#: Fewer runs than this at a step are not screened: numpy's fixed cost per operation outweighs what it saves.
SCREEN_MIN_RUNS = 8


def read_and_evaluate_all(runs: Sequence[tuple[RunController, float, TickResult]]) -> list[Exception | None]:
    """:meth:`RunController.read_and_evaluate` of every run, their rules' steps in lockstep: each round, the
    runs about to evaluate their next new step are screened together (``RulesEngine.screen``, one numpy pass
    over all of them, when the engine has one) and each evaluates only what its screen left. The same
    decisions and states as one run after the other (``tests/test_screen.py``), in a fraction of the time
    at hundreds of runs. Returns each run's error, as :meth:`RunController.read_and_evaluate` does."""
    out: list[Exception | None] = [None] * len(runs)
    steps = [ctl.reading(now, result) for ctl, now, result in runs]
    going = list(range(len(runs)))
    try:
        while going:
            going = _round(runs, steps, going, out)
    except BaseException:
        for (ctl, _, _), gen in zip(runs, steps, strict=True):  # each run left half-read is put back
            try:
                gen.close()  # (nothing for a run already done)
            except Exception:  # (its files unreadable now): its next tick rebuilds from the store
                log.exception("%s: could not put back a read abandoned half-way", ctl.run.run_id)
        raise
    return out


def _round(runs: Sequence[tuple[RunController, float, TickResult]], steps: list[Generator[int, None, Any]],
           going: list[int], out: list[Exception | None]) -> list[int]:
    """One round of :func:`read_and_evaluate_all`: the runs of ``going`` on to their next step, screened
    together; returns those not done."""
    paused: dict[int, list[int]] = {}  # by rules engine (a daemon has one)
    at: dict[int, int] = {}  # the step each paused run is about to evaluate
    for i in going:
        try:
            at[i] = next(steps[i])
        except StopIteration as done:
            out[i] = done.value
        else:
            paused.setdefault(id(runs[i][0].rules), []).append(i)
    for members in paused.values():
        ctls = [runs[i][0] for i in members]
        screen = getattr(ctls[0].rules, "screen", None)
        if screen is None or len(ctls) < SCREEN_MIN_RUNS:
            continue
        t0 = time.perf_counter()
        try:
            verdicts = screen([(ctl.window, at[i], ctl.state) for ctl, i in zip(ctls, members, strict=True)])
            if len(verdicts) != len(ctls):
                raise ValueError(f"{len(verdicts)} answers for {len(ctls)} runs")
        except Exception:  # a screen that fails costs its time, never a decision: every rule is evaluated
            log.exception("the rules' screen failed; these runs' rules are evaluated one by one")
            verdicts = [None] * len(ctls)
        ctls[0].telemetry.phase_time("decide", time.perf_counter() - t0)
        for ctl, run_verdicts in zip(ctls, verdicts, strict=True):
            ctl.verdicts = run_verdicts
    return [i for members in paused.values() for i in members]


def log_tail(path: Path, lines: int = 3, max_chars: int = 600) -> str:
    """The last non-empty lines of a trainer log, for a message a human reads."""
    text = read_tail(path, size=8192)
    if not text:
        return f"(nothing in the log at {path})"
    tail = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    return " | ".join(tail)[-max_chars:]


#: How a trainer says it refused its configuration (the embedded trainer, verl's Hydra and its config checks).
_ERROR_LINE = re.compile(r"^(?:config error|Error|[A-Za-z_.]*(?:Error|Exception))\b.*", re.M)


def error_line(path: Path, max_chars: int = 400) -> str:
    """The trainer's own error line from the end of its log (``config error: ...``, ``ValueError: ...``),
    else its last lines: what a human needs to see to fix a refused configuration."""
    text = read_tail(path, size=8192)
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if _ERROR_LINE.match(lines[i]):
            # "config error: 2 config errors:" is followed by one line per error: keep them with it.
            said = " | ".join(lines[i:i + 6]) if lines[i].endswith(":") else lines[i]
            return said[:max_chars]
    return log_tail(path, max_chars=max_chars)


def open_entries(store: Store, run_id: str) -> int:
    """How many journal entries of a run are still open."""
    return sum(1 for e in store.journal(run_id) if e.status in OPEN_ACTION_STATUSES)
