"""Prometheus as the watchdog's metric source: one run's series read through Prometheus's HTTP API.

In production the trainer's numbers already flow into Prometheus (the trainer, or the verl
glue, serves the catalog gauges labelled ``run``); reading them back from there lets the
same rules run where the run directory's ``metrics.jsonl`` is out of reach or absent.
:class:`PrometheusSource` keeps :class:`~ppo_watchdog.sources.ingest.RunTailer`'s contract
(``poll() -> (records, events)``, persisted ``offsets``), so the controller does not care
which one it holds.

Prometheus stores a gauge's value at each scrape, not per training step. Every scrape of
one target shares one timestamp, so each scrape is a consistent picture: the metrics and
``ppo_global_step`` side by side. :class:`StepAligner` (the pure half) turns scrapes into
``{"step": N, "data": {verl key: float}}`` records:

- a scrape belongs to the step its ``ppo_global_step`` sample says; the last scrape of a
  step wins (a scrape that raced the exporter's update is overwritten by the next one);
- a step is handed out once it is complete: a different step was scraped since, it was
  scraped twice (the second scrape is after the update that set it, so nothing of that
  step can change any more), or the trainer ended (``finished``/``stopped``/``oom``);
- the exporter shows NaN for a metric it has not measured yet (its convention), so a NaN is
  passed on only once the same trainer process had a finite value for that metric: then it
  is a measured NaN, which the ``nonfinite()`` rules must see. A ``started`` event begins a
  new process (a fresh exporter starts all-NaN again).

What a source of gauges cannot give: steps shorter than the scrape interval are sampled,
not all seen; a metric logged only now and then (validation) repeats its last value at
the steps between; the last step of a run is seen only if a scrape lands before the
trainer exits.

Events (``applied``, ``oom``, ``checkpoint``, ``started``...) still come from the run
directory's ``events.jsonl`` through a RunTailer: they are the protocol's coupling, and
live sets are confirmed by them. When Prometheus is down or answers an error the poll logs
the URL and the reason, counts a telemetry error and returns the events only; the next
poll asks again from where the last good one stopped, so nothing Prometheus holds is lost.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol.events import Event
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.sources.ingest import RunTailer

log = logging.getLogger(__name__)

#: Environment variable with the Prometheus base URL (``--prometheus-url`` / ``prometheus_url`` default).
PROMETHEUS_URL_ENV = "WATCHDOG_PROMETHEUS_URL"
#: Metric sources the watchdog can read a run from: the run directory, Prometheus holding the
#: catalog's gauges (the trainer's or the glue's exporter), or Prometheus holding verl's own
#: RL-Insight series (no second exporter; :data:`ppo_watchdog.protocol.catalog.BY_RL_INSIGHT`).
SOURCES = ("files", "prometheus", "rl_insight")
#: The sources read through Prometheus.
PROMETHEUS_SOURCES = ("prometheus", "rl_insight")
#: verl's default ``trainer.experiment_name`` (trainer/config/ppo_trainer.yaml).
VERL_EXPERIMENT_NAME = "gsm8k"
#: The gauge that says which step a scrape belongs to.
STEP_METRIC = catalog.BY_KEY["training/global_step"].prom
#: Events after which the trainer process exports nothing more (its pending step is complete).
ENDING_EVENTS = frozenset({"finished", "stopped", "oom"})
OFFSETS_VERSION = 1
#: Seconds before the first ``started`` event still read (clock skew between trainer and Prometheus).
SKEW_MARGIN_S = 30.0


class PrometheusError(RuntimeError):
    """A query failed; the message names the URL (without credentials) and the reason."""


class MetricSource(Protocol):
    """What the controller reads a run through (RunTailer and PrometheusSource)."""

    def poll(self) -> tuple[list[dict[str, Any]], list[Event]]: ...

    @property
    def offsets(self) -> dict[str, Any]: ...


# -- configuration ------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceConfig:
    """Where a run's metrics are read from (``watchdog run --source``, the daemon's ``source``)."""

    kind: str = "files"
    """``files`` (tail run_dir/metrics.jsonl) or ``prometheus`` (query Prometheus's HTTP API)."""
    prometheus_url: str | None = None
    """Prometheus base URL, e.g. http://127.0.0.1:9090 (required for ``prometheus``)."""
    file_sd_dir: str | None = None
    """Prometheus file_sd directory: the source announces the run's trainer there (None: not at all)."""
    timeout_s: float = 5.0
    """Seconds one HTTP request to Prometheus may take."""
    lookback_s: float = 6 * 3600.0
    """Most seconds of history read at once (first poll, and the window rebuilt after a restart)."""

    def __post_init__(self) -> None:
        if self.kind not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.kind!r}")
        if self.kind in PROMETHEUS_SOURCES and not self.prometheus_url:
            raise ValueError(f"source {self.kind} needs a Prometheus URL (prometheus_url, --prometheus-url "
                             f"or ${PROMETHEUS_URL_ENV})")
        if self.prometheus_url and urllib.parse.urlsplit(self.prometheus_url).scheme not in ("http", "https"):
            raise ValueError(f"prometheus_url must be an http(s) URL, got {redact_url(self.prometheus_url)!r}")
        if self.timeout_s <= 0 or self.lookback_s <= 0:
            raise ValueError("timeout_s and lookback_s must be > 0")


def source_config(kind: str | None, prometheus_url: str | None = None, file_sd_dir: str | None = None,
                  env: Mapping[str, str] | None = None) -> SourceConfig:
    """A SourceConfig with the URL defaulting to ``$WATCHDOG_PROMETHEUS_URL``; ValueError when invalid."""
    env = os.environ if env is None else env
    url = prometheus_url or env.get(PROMETHEUS_URL_ENV) or None
    return SourceConfig(kind or "files", url, file_sd_dir or None)


def make_source(cfg: SourceConfig | None, run_dir: Path | str, run_id: str, telemetry: Any = None) -> Any:
    """The source a controller reads ``run_dir`` through: None for files (the controller's RunTailer)."""
    if cfg is None or cfg.kind == "files":
        return None
    assert cfg.prometheus_url  # checked by SourceConfig
    client = PrometheusClient(cfg.prometheus_url, cfg.timeout_s)
    return PrometheusSource(client, run_dir, run_id=run_id, telemetry=telemetry, file_sd_dir=cfg.file_sd_dir,
                            lookback_s=cfg.lookback_s, names="rl_insight" if cfg.kind == "rl_insight" else "catalog")


def redact_url(url: str) -> str:
    """``url`` without user and password (for logs and errors)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


# -- the HTTP API -----------------------------------------------------------------------------


class PrometheusClient:
    """``GET /api/v1/query`` with urllib (no dependency); every failure becomes a PrometheusError."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.safe_url = redact_url(self.url)
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"PrometheusClient({self.safe_url!r})"

    def query(self, promql: str, at: float) -> dict[str, Any]:
        """Evaluate ``promql`` at Unix time ``at``; returns the API's ``data`` object."""
        params = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
        where = f"{self.safe_url}/api/v1/query"
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=self.timeout_s) as r:
                body = r.read()
        except urllib.error.HTTPError as exc:
            raise PrometheusError(f"{where}: HTTP {exc.code} {_api_error(exc.read())}".rstrip()) from None
        except urllib.error.URLError as exc:
            raise PrometheusError(f"{where}: {exc.reason}") from None
        except (TimeoutError, OSError) as exc:
            raise PrometheusError(f"{where}: {exc or type(exc).__name__} (timeout {self.timeout_s}s)") from None
        try:
            doc = json.loads(body)
        except ValueError:
            raise PrometheusError(f"{where}: the answer is not JSON: {body[:120]!r}") from None
        if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(doc.get("data"), dict):
            raise PrometheusError(f"{where}: {_api_error(body) or 'unexpected answer'}")
        return doc["data"]


def _api_error(body: bytes) -> str:
    """``errorType: error`` of a Prometheus error body, or the start of the body."""
    try:
        doc = json.loads(body)
        return f"{doc.get('errorType', 'error')}: {doc.get('error', '')}"
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace").strip()


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal for a label value."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def run_selector(run: str) -> str:
    """Every catalog gauge of one run, as one series selector."""
    names = "|".join(sorted(m.prom for m in catalog.METRICS))
    return f'{{__name__=~"{names}",{catalog.RUN_LABEL}={promql_string(run)}}}'


def rl_insight_selector(experiment: str) -> str:
    """Every RL-Insight series of one verl experiment the catalog knows, as one series selector."""
    names = "|".join(sorted(catalog.BY_RL_INSIGHT))
    return f'{{__name__=~"{names}",{catalog.RL_INSIGHT_RUN_LABEL}={promql_string(experiment)}}}'


def experiment_name(config: Mapping[str, Any]) -> str:
    """verl's ``trainer.experiment_name`` in run.json's config (flat or nested), else verl's default."""
    if "trainer.experiment_name" in config:
        return str(config["trainer.experiment_name"])
    trainer = config.get("trainer")
    if isinstance(trainer, Mapping) and trainer.get("experiment_name"):
        return str(trainer["experiment_name"])
    return VERL_EXPERIMENT_NAME


Scrape = tuple[float, dict[str, float]]
"""One scrape: (timestamp, {Prometheus name: value})."""


def scrapes_from_matrix(data: Mapping[str, Any]) -> list[Scrape]:
    """Group a range-vector answer's raw samples by timestamp (one scrape each), oldest first."""
    if data.get("resultType") != "matrix":
        raise PrometheusError(f"expected a matrix answer, got {data.get('resultType')!r}")
    by_ts: dict[float, dict[str, float]] = {}
    for series in data.get("result") or []:
        name = (series.get("metric") or {}).get("__name__")
        if name in catalog.BY_RL_INSIGHT:  # verl's own series: the same number under the catalog's name
            name = catalog.BY_RL_INSIGHT[name].prom
        if name not in catalog.BY_PROM:
            continue
        for ts, raw in series.get("values") or []:
            by_ts.setdefault(round(float(ts), 3), {})[name] = float(raw)  # "NaN", "+Inf" parse as floats
    return sorted(by_ts.items())


# -- the pure core: scrapes + events -> step records --------------------------------------------


@dataclass
class StepAligner:
    """Turns scrapes into whole-step records (see the module docstring for the rules)."""

    pending: dict[str, Any] | None = None
    """The newest step not yet handed out: ``{"step", "data", "scrapes"}``."""
    last_step: int | None = None
    """Step of the newest scrape (a scrape of another step completes the pending one)."""
    finite: set[str] = field(default_factory=set)
    """Verl keys with a finite value in this trainer process (their NaN is a measured one)."""
    ended: bool = False
    """The trainer process ended (finished/stopped/oom and no ``started`` since)."""

    def feed(self, scrapes: Iterable[Scrape], events: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """Records completed by these scrapes and events (merged in time order)."""
        items: list[tuple[float, int, Any]] = [(ts, 1, values) for ts, values in scrapes]
        for e in events:
            ts = e.get("ts")
            # An event without a time cannot be placed: it counts after this batch of scrapes.
            items.append((float(ts) if isinstance(ts, (int, float)) else math.inf, 0, e))
        out: list[dict[str, Any]] = []
        for _, is_scrape, item in sorted(items, key=lambda x: (x[0], x[1])):
            if is_scrape:
                self._scrape(item, out)
            else:
                self._event(item, out)
        if self.ended:
            self._flush(out)
        return out

    def _event(self, e: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
        kind = e.get("kind")
        if kind == "started":
            self._flush(out)  # the previous process exports nothing more
            self.finite.clear()
            self.ended = False
        elif kind in ENDING_EVENTS:
            self.ended = True

    def _scrape(self, values: Mapping[str, float], out: list[dict[str, Any]]) -> None:
        gs = values.get(STEP_METRIC)
        if gs is None or not math.isfinite(gs):
            return  # a fresh exporter before its first step: nothing measured yet
        step = int(gs)
        data: dict[str, float] = {}
        for name, v in values.items():
            key = catalog.BY_PROM[name].key
            if math.isnan(v) and key not in self.finite:
                continue  # not measured yet (the exporter's NaN), not a measured NaN
            if math.isfinite(v):
                self.finite.add(key)
            data[key] = v
        if step != self.last_step:
            self._flush(out)
            self.pending = {"step": step, "data": data, "scrapes": 1}
        elif self.pending is not None:
            self.pending["data"].update(data)
            self.pending["scrapes"] += 1
        # else: a step already handed out, scraped again: nothing new
        self.last_step = step
        if self.pending is not None and self.pending["scrapes"] >= 2:
            self._flush(out)

    def _flush(self, out: list[dict[str, Any]]) -> None:
        if self.pending is not None:
            out.append({"step": int(self.pending["step"]), "data": dict(self.pending["data"])})
            self.pending = None

    def to_json(self) -> dict[str, Any]:
        return {"pending": self.pending, "last_step": self.last_step, "finite": sorted(self.finite),
                "ended": self.ended}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StepAligner:
        pending = d.get("pending")
        if pending is not None:
            pending = {"step": int(pending["step"]), "data": {str(k): float(v) for k, v in pending["data"].items()},
                       "scrapes": int(pending["scrapes"])}
        last = d.get("last_step")
        return cls(pending, int(last) if last is not None else None, set(d.get("finite", ())),
                   bool(d.get("ended", False)))


# -- the shell --------------------------------------------------------------------------------


class PrometheusSource:
    """Reads one run's metrics from Prometheus and its events from the run directory.

    ``client`` is anything with ``query(promql, at) -> data`` and ``safe_url`` (a
    :class:`PrometheusClient`); ``clock`` gives the evaluation time of each poll. With
    ``file_sd_dir`` the source announces the trainer's /metrics (run.json's ``metrics_port``)
    to Prometheus's file_sd whenever a trainer process starts, and withdraws it when the run
    has finished.
    """

    #: Longest range one query asks for; longer gaps are read in pieces.
    MAX_RANGE_S = 3600.0

    def __init__(
        self, client: Any, run_dir: Path | str, offsets: Mapping[str, Any] | None = None, run_id: str | None = None,
        telemetry: Any = None, file_sd_dir: Path | str | None = None, lookback_s: float = 6 * 3600.0,
        clock: Callable[[], float] = time.time, names: str = "catalog",
    ) -> None:
        if names not in ("catalog", "rl_insight"):
            raise ValueError(f"names must be catalog or rl_insight, got {names!r}")
        self.names = names
        """``catalog``: the catalog's gauges labelled ``run``; ``rl_insight``: verl's RL-Insight series
        labelled ``experiment_name``."""
        self.client = client
        self.run_dir = Path(run_dir)
        self.run_id = run_id or self.run_dir.name
        """The watchdog's name for the run (telemetry labels, logs)."""
        self.telemetry = telemetry
        self.file_sd_dir = Path(file_sd_dir) if file_sd_dir else None
        self.lookback_s = lookback_s
        self._clock = clock
        self._events = RunTailer(self.run_dir, events_only=True)  # (metrics come from Prometheus)
        self._aligner = StepAligner()
        self._since: float | None = None
        self._last_ts: float | None = None
        self._held: list[dict[str, Any]] = []  # events the aligner has not seen (a failed query)
        self._target: str | None = None
        self._finished = False  # the last trainer process finished (its target can go)
        self.healthy = True
        """False while Prometheus cannot be queried (the controller then cannot tell a hang)."""
        self.last_error: str | None = None
        """The reason of the last failed query."""
        self.errors = 0
        """Failed queries so far."""
        if offsets is not None:
            self.offsets = offsets  # type: ignore[assignment]

    # -- persisted position -----------------------------------------------------------------

    @property
    def offsets(self) -> dict[str, Any]:
        """A JSON-able snapshot: the events cursor (RunTailer's shape), how far Prometheus was read
        and the aligner's state."""
        return {
            "version": OFFSETS_VERSION, "source": "prometheus", "events": self._events.offsets["events"],
            "prometheus": {"since": self._since, "last_ts": self._last_ts, "aligner": self._aligner.to_json(),
                           "held": self._held, "target": self._target},
        }

    @offsets.setter
    def offsets(self, value: Mapping[str, Any]) -> None:
        if value.get("version", OFFSETS_VERSION) != OFFSETS_VERSION:
            raise ValueError(f"prometheus source offsets: unsupported version {value.get('version')!r}")
        # Offsets a RunTailer saved (the run was watched from its files before) share the events cursor.
        self._events.offsets = {"version": RunTailer.OFFSETS_VERSION, "events": value.get("events") or {}}
        prom = value.get("prometheus") if value.get("source") == "prometheus" else None
        if not prom:
            return
        self._since = prom.get("since")
        self._last_ts = prom.get("last_ts")
        self._aligner = StepAligner.from_json(prom.get("aligner") or {})
        self._held = [dict(e) for e in prom.get("held") or []]
        self._target = prom.get("target")

    # -- polling ----------------------------------------------------------------------------

    def poll(self) -> tuple[list[dict[str, Any]], list[Event]]:
        """(new step records from Prometheus, new events from events.jsonl) since the last poll."""
        _, events = self._events.poll()
        self._note_events(events)
        self._held += [_slim(e) for e in events if e.get("kind") in ENDING_EVENTS | {"started"}]
        run = self.label()
        if run is None or self._since is None:
            return [], events  # no trainer has started yet: nothing to ask Prometheus about
        now = self._clock()
        start = self._last_ts if self._last_ts is not None else max(self._since, now - self.lookback_s)
        try:
            scrapes = self._read(run, start, now)
        except PrometheusError as exc:
            self._failed(exc)
            return [], events
        if not self.healthy:
            log.info("%s: Prometheus at %s answers again; reading from where it stopped",
                     self.run_id, self.client.safe_url)
        self.healthy, self.last_error = True, None
        records = self._aligner.feed(scrapes, self._held)
        self._held = []
        if scrapes:
            self._last_ts = scrapes[-1][0]
        return records, events

    def label(self) -> str | None:
        """The run's label value: run.json's id for the ``run`` label (None until a trainer wrote one),
        verl's experiment name for RL-Insight's ``experiment_name``."""
        info = RunInfo.read(self.run_dir)
        if self.names == "rl_insight":
            return experiment_name(info.config) if info.id else None
        return info.id or None

    def _read(self, run: str, start: float, end: float) -> list[Scrape]:
        """Scrapes with start < ts <= end, in pieces of at most MAX_RANGE_S."""
        out: list[Scrape] = []
        lo = start
        while lo < end:
            hi = min(end, lo + self.MAX_RANGE_S)
            rng = max(1, math.ceil(hi - lo))
            selector = rl_insight_selector(run) if self.names == "rl_insight" else run_selector(run)
            data = self.client.query(f"{selector}[{rng}s]", hi)
            out += [(ts, v) for ts, v in scrapes_from_matrix(data) if lo < ts <= hi]
            lo = hi
        return out

    def _failed(self, exc: PrometheusError) -> None:
        self.errors += 1
        if self.telemetry is not None:
            self.telemetry.error(self.run_id, "prometheus")
        reason = str(exc)
        # One warning per outage (and per new reason), not one per tick.
        level = logging.WARNING if self.healthy or reason != self.last_error else logging.DEBUG
        log.log(level, "%s: cannot read metrics from Prometheus: %s; nothing is lost, the next poll "
                "asks again from where the last good one stopped", self.run_id, reason)
        self.healthy, self.last_error = False, reason

    def _note_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        for e in events:
            kind = e.get("kind")
            if kind == "started":
                ts = e.get("ts")
                if self._since is None and isinstance(ts, (int, float)):
                    self._since = float(ts) - SKEW_MARGIN_S
                self._finished = False
                self._announce()
            elif kind == "finished":
                self._finished = True
                self._withdraw()
        if self._since is None:
            # Events read before (a source switched from files) or none written: run.json's start time.
            started = RunInfo.read(self.run_dir).started
            if started is not None:
                self._since = started - SKEW_MARGIN_S
                self._announce()

    # -- file_sd ------------------------------------------------------------------------------

    def _announce(self) -> None:
        """Point Prometheus's file_sd at the trainer's /metrics (run.json's metrics_port)."""
        if self.file_sd_dir is None:
            return
        from ppo_watchdog.observe.telemetry import write_file_sd

        info = RunInfo.read(self.run_dir)
        port, run = info.metrics_port, info.id
        if port is None or port <= 0 or not run:
            log.warning("%s: run.json has no metrics_port: Prometheus cannot scrape this trainer", self.run_id)
            return
        host = str((info.config.get("trainer") or {}).get("metrics_addr") or "127.0.0.1")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"  # a trainer the watchdog launched runs on the watchdog's machine
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if address != self._target:
            path = write_file_sd(self.file_sd_dir, str(run), address, {"run_dir": str(self.run_dir)})
            log.info("%s: Prometheus file_sd target %s -> %s", self.run_id, path, address)
            self._target = address

    def _withdraw(self) -> None:
        if self.file_sd_dir is None or self._target is None:
            return
        from ppo_watchdog.observe.telemetry import remove_file_sd

        run = RunInfo.read(self.run_dir).id or self.run_id
        remove_file_sd(self.file_sd_dir, str(run))
        self._target = None

    def close(self, withdraw: bool = False) -> None:
        """Withdraw the file_sd target when the run finished or ``withdraw`` says its trainer is gone.

        A daemon that stops leaves the targets of trainers still running, so they stay scraped.
        """
        if withdraw or self._finished:
            self._withdraw()

    # -- after a watchdog restart -------------------------------------------------------------

    def replay(self) -> tuple[list[dict[str, Any]], list[Event]]:
        """(records, events) read before the restored offsets, to rebuild the rules' window.

        Records are read again from Prometheus (up to ``lookback_s`` before the last poll);
        when it cannot be reached the window starts with the events only.
        """
        until = int(self._events.offsets["events"].get("offset", 0))
        events = rundir.events_of(rundir.read_jsonl(self.run_dir / rundir.EVENTS, until=until))
        run = self.label()
        if run is None or self._since is None or self._last_ts is None:
            return [], events
        start = max(self._since, self._last_ts - self.lookback_s)
        try:
            scrapes = self._read(run, start, self._last_ts)
        except PrometheusError as exc:
            self._failed(exc)
            return [], events
        # The steps before the restart are the ones a fresh aligner completes on the same data
        # (the step still pending then is still pending now, in the restored aligner).
        records = StepAligner().feed(scrapes, [_slim(e) for e in events])
        pending = self._aligner.pending
        if pending is not None and records and records[-1]["step"] == pending["step"]:
            records = records[:-1]
        return records, events


def _slim(e: Mapping[str, Any]) -> dict[str, Any]:
    """What the aligner needs of an event (kept small: it is persisted while a query fails)."""
    return {"kind": e.get("kind"), "ts": e.get("ts")}
