"""The watchdog's own Prometheus metrics: what it watches, how its rules stand, what it did.

The names here are the second half of the product's metric vocabulary (the first is
``ppo_watchdog.protocol.catalog``): dashboards and alert rules import them rather than typing them, so a
rename breaks the build, not a dashboard. :class:`WatchdogMetrics` takes its registry as
an argument (a fresh ``CollectorRegistry`` per instance by default) so tests and several
watchdogs in one process never share state; the controller calls its small methods.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ppo_watchdog.protocol import rundir

log = logging.getLogger(__name__)

#: Prometheus job names of the scrape config in deploy/ (dashboards and alert rules select on them).
TRAINER_JOB = "ppo-trainer"
WATCHDOG_JOB = "ppo-watchdog"

#: Numeric values of ``watchdog_rule_state`` (Prometheus's own alert states, in order).
RULE_STATES: dict[str, int] = {"inactive": 0, "pending": 1, "firing": 2}

# Evaluation of one tick is pure Python over a few hundred steps per run; buckets span a
# fast tick on one run to a slow one over thousands of runs (bench goal: 1,000 runs in 0.1 s).
EVAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class TelemetryMetric:
    """One metric the watchdog exposes."""

    name: str
    """Name as exposed; counters carry their ``_total`` suffix here."""
    kind: str
    """``gauge``, ``counter`` or ``histogram``."""
    labels: tuple[str, ...]
    """Label names, in order."""
    help: str
    """HELP text."""

    def series(self) -> tuple[str, ...]:
        """Every series name this metric puts into the exposition (what a query may reference)."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


RULE_STATE = TelemetryMetric(
    "watchdog_rule_state", "gauge", ("run", "rule"),
    "State of a rule for a run: 0 inactive, 1 pending, 2 firing.",
)
ACTIONS = TelemetryMetric(
    "watchdog_actions_total", "counter", ("run", "rule", "kind", "outcome"),
    "Remediation actions taken, by rule, action kind and outcome (ok, failed; advised: said as what would be "
    "done in advise mode; awaiting: held for a person's approval; denied: refused, or unanswered in time).",
)
APPROVALS_WAITING = TelemetryMetric(
    "watchdog_approvals_waiting", "gauge", ("run",),
    "Actions of a run waiting now for a person's `watchdog approve` or `deny` (--approve).",
)
PLANNED_RELAUNCH = TelemetryMetric(
    "watchdog_planned_relaunch", "gauge", ("run",),
    "1 while the watchdog itself stops and relaunches a run's trainer (a restart, a rollback or a tuning set by "
    "relaunch), 0 otherwise: the trainer's /metrics is down on purpose then (PPOTrainerDown keeps quiet).",
)
ESCALATIONS = TelemetryMetric(
    "watchdog_escalations_total", "counter", ("run", "rule"),
    "Escalations to a human (a rule's budget exhausted or repeated rollbacks).",
)
EVALUATION = TelemetryMetric(
    "watchdog_evaluation_seconds", "histogram", (),
    "Wall time of one evaluation tick over all watched runs.",
)
TICK_PHASE = TelemetryMetric(
    "watchdog_tick_phase_seconds", "histogram", ("phase",),
    "Wall time of one tick spent in each phase, summed over the watched runs: read (new metric and "
    "event bytes parsed), decide (rules evaluated), commit (decisions, intents and positions stored), "
    "act (journal entries driven, checkpoints protected, liveness).",
)
#: The phases of :data:`TICK_PHASE`, in a tick's order.
TICK_PHASES = ("read", "decide", "commit", "act")
DATA_AGE = TelemetryMetric(
    "watchdog_data_age_seconds", "gauge", ("run",),
    "Seconds since the newest metric record of a run was seen.",
)
RUNS_WATCHED = TelemetryMetric(
    "watchdog_runs_watched", "gauge", (),
    "Number of runs the watchdog currently watches.",
)
LAST_TICK = TelemetryMetric(
    "watchdog_last_tick_timestamp_seconds", "gauge", (),
    "Unix time of the last completed evaluation tick.",
)
ERRORS = TelemetryMetric(
    "watchdog_errors_total", "counter", ("run", "where"),
    "Errors the watchdog recorded and carried on from (ingest, evaluate, act).",
)

#: Every metric this module defines.
METRICS: tuple[TelemetryMetric, ...] = (
    RULE_STATE, ACTIONS, APPROVALS_WAITING, PLANNED_RELAUNCH, ESCALATIONS, EVALUATION, TICK_PHASE, DATA_AGE,
    RUNS_WATCHED, LAST_TICK, ERRORS,
)


def series_names() -> frozenset[str]:
    """Every series name the watchdog's /metrics can expose."""
    return frozenset(s for m in METRICS for s in m.series())


def _base(name: str) -> str:
    # prometheus_client appends ``_total`` to counters itself and refuses a name that has it.
    return name.removesuffix("_total")


class _RuleSeries:
    """``watchdog_rule_state`` and ``watchdog_escalations_total`` of every (run, rule), kept as plain numbers
    and made into samples when /metrics is scraped.

    A daemon over 1,000 runs of a 24-rule pack holds 24,000 series of each. As prometheus_client children
    (``labels()``) each costs ~25 us to create and ~0.8 KB to hold: 0.55 s of its first tick and 38 MiB at
    1,000 runs, ten times that at 10,000. Here a (run, rule) is an entry in a dict.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.states: dict[str, dict[str, int]] = {}
        """run -> rule -> its RULE_STATES number."""
        self.escalations: dict[tuple[str, str], float] = {}
        """(run, rule) -> escalations counted (absent: 0)."""
        self.created: dict[str, float] = {}
        """run -> when its first series appeared (the counters' ``_created``, as prometheus_client gives it)."""

    def set_state(self, run: str, rule: str, value: int) -> None:
        rules = self.states.get(run)
        if rules is None:
            with self._lock:
                rules = self.states.setdefault(run, {})
                self.created.setdefault(run, time.time())
        rules[rule] = value

    def escalate(self, run: str, rule: str) -> None:
        with self._lock:
            self.created.setdefault(run, time.time())
            self.escalations[run, rule] = self.escalations.get((run, rule), 0.0) + 1

    def forget(self, run: str, rules: Iterable[str]) -> None:
        with self._lock:
            kept = self.states.get(run, {})
            for rule in rules:
                kept.pop(rule, None)
                self.escalations.pop((run, rule), None)
            if not kept:
                self.states.pop(run, None)
                if not any(r == run for r, _ in self.escalations):
                    self.created.pop(run, None)

    def describe(self) -> list[Any]:
        return [GaugeMetricFamily(RULE_STATE.name, RULE_STATE.help, labels=RULE_STATE.labels),
                CounterMetricFamily(_base(ESCALATIONS.name), ESCALATIONS.help, labels=ESCALATIONS.labels)]

    def collect(self) -> list[Any]:
        state, esc = self.describe()
        with self._lock:  # (the tick thread adds runs under it; a rule of a known run is one dict store)
            runs = [(run, dict(rules)) for run, rules in self.states.items()]
            escalations = dict(self.escalations)
            created = dict(self.created)
        for run, rules in runs:
            for rule, value in rules.items():
                state.add_metric([run, rule], value)
                # The counter exists at 0 as soon as a rule is known, so the first escalation is an increase
                # Prometheus can see (a series born at 1 has no increase).
                esc.add_metric([run, rule], escalations.pop((run, rule), 0.0), created=created.get(run))
        for (run, rule), count in escalations.items():  # (a rule escalated before its state was ever set)
            esc.add_metric([run, rule], count, created=created.get(run))
        return [state, esc]


class WatchdogMetrics:
    """The watchdog's metrics in one registry, with the methods the controller calls."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._rules = _RuleSeries()
        r.register(self._rules)
        self._actions = Counter(_base(ACTIONS.name), ACTIONS.help, ACTIONS.labels, registry=r)
        self._eval = Histogram(EVALUATION.name, EVALUATION.help, registry=r, buckets=EVAL_BUCKETS)
        self._phase = Histogram(TICK_PHASE.name, TICK_PHASE.help, TICK_PHASE.labels, registry=r, buckets=EVAL_BUCKETS)
        self._phase_children = {p: self._phase.labels(phase=p) for p in TICK_PHASES}
        self._phase_acc = dict.fromkeys(TICK_PHASES, 0.0)
        self._data_age = Gauge(DATA_AGE.name, DATA_AGE.help, DATA_AGE.labels, registry=r)
        self._age_children: dict[str, Any] = {}
        self._waiting = Gauge(APPROVALS_WAITING.name, APPROVALS_WAITING.help, APPROVALS_WAITING.labels, registry=r)
        self._relaunch = Gauge(PLANNED_RELAUNCH.name, PLANNED_RELAUNCH.help, PLANNED_RELAUNCH.labels, registry=r)
        self._runs = Gauge(RUNS_WATCHED.name, RUNS_WATCHED.help, registry=r)
        self._last_tick = Gauge(LAST_TICK.name, LAST_TICK.help, registry=r)
        self._errors = Counter(_base(ERRORS.name), ERRORS.help, ERRORS.labels, registry=r)
        self._server: object | None = None
        self._port = 0

    def rule_state(self, run: str, rule: str, state: str | int) -> None:
        """Set a rule's state for a run: ``inactive``/``pending``/``firing`` (or 0/1/2).

        ``resolved`` (the engine's transient state) is shown as inactive: the rule no longer holds.
        """
        if isinstance(state, str):
            value = RULE_STATES.get("inactive" if state == "resolved" else state)
            if value is None:
                raise ValueError(f"unknown rule state {state!r} for rule {rule!r} (known: {', '.join(RULE_STATES)})")
        else:
            if state not in RULE_STATES.values():
                raise ValueError(f"rule state for rule {rule!r} must be 0, 1 or 2, got {state!r}")
            value = int(state)
        self._rules.set_state(run, rule, value)

    def action(self, run: str, rule: str, kind: str, outcome: str) -> None:
        """Count one action (``kind``: set/rollback/restart/...; ``outcome``: applied/failed/...)."""
        self._actions.labels(run=run, rule=rule, kind=kind, outcome=outcome).inc()

    def approvals_waiting(self, run: str, n: int) -> None:
        """Set how many of a run's actions wait for a person now."""
        self._waiting.labels(run=run).set(n)

    def planned_relaunch(self, run: str, relaunching: bool) -> None:
        """Say whether the watchdog is relaunching a run's trainer now (its /metrics down on purpose)."""
        self._relaunch.labels(run=run).set(1 if relaunching else 0)

    def escalation(self, run: str, rule: str) -> None:
        """Count one escalation to a human."""
        self._rules.escalate(run, rule)

    def eval_seconds(self, seconds: float) -> None:
        """Observe the wall time of one evaluation tick."""
        self._eval.observe(seconds)

    def phase_time(self, phase: str, seconds: float) -> None:
        """Add one run's time in a tick phase (read, decide, commit, act) to the tick being timed."""
        self._phase_acc[phase] += seconds

    def tick_phases_done(self) -> None:
        """Observe the tick's time in each phase (summed over its runs) and start the next tick's sums."""
        for phase, seconds in self._phase_acc.items():
            self._phase_children[phase].observe(seconds)
        self._phase_acc = dict.fromkeys(TICK_PHASES, 0.0)

    def data_age(self, run: str, seconds: float) -> None:
        """Set how old a run's newest data is."""
        child = self._age_children.get(run)
        if child is None:
            child = self._age_children[run] = self._data_age.labels(run=run)
        child.set(seconds)

    def runs_watched(self, n: int) -> None:
        """Set the number of runs watched."""
        self._runs.set(n)

    def last_tick(self, ts: float) -> None:
        """Record the Unix time of a completed tick (alerts fire when it stops advancing)."""
        self._last_tick.set(ts)

    def error(self, run: str, where: str) -> None:
        """Count an error the watchdog recorded and went on from."""
        self._errors.labels(run=run, where=where).inc()

    def forget_run(self, run: str, rules: Iterable[str] = ()) -> None:
        """Drop a run's gauges once it is no longer watched, so dashboards don't show stale states."""
        self._rules.forget(run, rules)
        self._age_children.pop(run, None)
        for gauge in (self._data_age, self._waiting, self._relaunch):
            try:
                gauge.remove(run)
            except KeyError:
                pass

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``addr:port`` (0 picks a free port) in a thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        self._port = int(server.server_address[1])
        log.info("watchdog metrics on http://%s:%d/metrics", addr, self._port)
        return self._port

    @property
    def port(self) -> int:
        """The bound port of :meth:`serve`, 0 when not serving."""
        return self._port

    def close(self) -> None:
        """Stop the /metrics server if one runs."""
        server = self._server
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            self._server = None
            self._port = 0


# ---- Prometheus file_sd: one target file per run ---------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def file_sd_path(directory: Path | str, run: str) -> Path:
    """The target file of ``run`` in a file_sd directory (run ids made safe as file names)."""
    return Path(directory) / f"{_SAFE.sub('_', run)}.json"


def write_file_sd(
    directory: Path | str, run: str, address: str, labels: Mapping[str, str] | None = None,
) -> Path:
    """Announce a trainer's /metrics (``host:port``) to Prometheus's file_sd (job ppo-trainer), atomically.

    The exporter labels its series with ``run`` itself (the scrape job honours it); the target carries ``run``
    too, for the scrape's own ``up`` series, and the extras passed in ``labels`` (``run_dir``).
    """
    if not address or ":" not in address:
        raise ValueError(f"file_sd target for run {run!r} must be host:port, got {address!r}")
    path = file_sd_path(directory, run)
    # The run on the target, so its `up` series names the run (PPOTrainerDown matches it against the watchdog's
    # planned relaunch of that run).
    rundir.atomic_write_json(path, [{"targets": [address], "labels": {"run": run, **(labels or {})}}])
    return path


def remove_file_sd(directory: Path | str, run: str) -> bool:
    """Withdraw a run's target (a finished run should not page as "trainer down"); True if one existed."""
    path = file_sd_path(directory, run)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
