"""Prometheus exposition of a training run: one gauge per catalog metric, labelled ``run``.

Names and HELP text come from :mod:`ppo_watchdog.protocol.catalog`, so a renamed metric breaks the
build, not a dashboard. Besides the per-step gauges the exporter serves:

- ``ppo_events_total{run,kind}``: events the trainer recorded (oom, nan, checkpoint, ...);
- ``ppo_last_update_timestamp_seconds{run}``: when the last step's metrics arrived, for
  "metrics stale" alerts (``time() - ppo_last_update_timestamp_seconds > ...``).

Every catalog gauge exists from the start with the value NaN, so every series is
present (dashboards and ``promtool`` see the full set) yet none claims a value before
the trainer measured one.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server

from ppo_watchdog.protocol import catalog

log = logging.getLogger(__name__)

EVENTS_METRIC = "ppo_events_total"
LAST_UPDATE_METRIC = "ppo_last_update_timestamp_seconds"
#: ``port`` value that binds an OS-chosen free port (read it back from :attr:`MetricsExporter.port`).
EPHEMERAL = -1


def free_port(addr: str = "127.0.0.1") -> int:
    """A port free right now on ``addr`` (for tests that pass a port to a subprocess)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


class MetricsExporter:
    """Exposes one run's per-step metrics at /metrics."""

    def __init__(
        self,
        run_id: str,
        port: int = 0,
        addr: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``port=0`` serves nothing (metrics are still kept, see :meth:`exposition`);
        ``port=EPHEMERAL`` binds a free port; a fresh registry unless one is passed
        (the process-global one would refuse a second exporter in the same process);
        ``clock`` stamps ``ppo_last_update_timestamp_seconds``.
        """
        self._clock = clock
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self.run_id = run_id
        self.registry = registry if registry is not None else CollectorRegistry()
        label = catalog.RUN_LABEL
        self._gauges: dict[str, Gauge] = {}
        for m in catalog.METRICS:
            gauge = Gauge(m.prom, m.help, [label], registry=self.registry)
            gauge.labels(run_id).set(math.nan)
            self._gauges[m.key] = gauge
        self._events = Counter(
            EVENTS_METRIC.removesuffix("_total"),
            "Events the trainer recorded in events.jsonl, by kind (oom, nan, checkpoint, applied, ...).",
            [label, "kind"],
            registry=self.registry,
        )
        self._last_update = Gauge(
            LAST_UPDATE_METRIC, "Unix time at which the last training step's metrics were exported.",
            [label], registry=self.registry,
        )
        self._unknown_logged: set[str] = set()
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._port = 0
        if port != 0:
            if port < EPHEMERAL or port > 65535:
                raise ValueError(f"port must be 0 (off), -1 (any free port) or 1..65535, got {port!r}")
            self._server, self._thread = start_http_server(max(port, 0), addr=addr, registry=self.registry)
            self._port = int(self._server.server_port)
            log.info("serving metrics of run %s at http://%s:%d/metrics", run_id, addr, self._port)

    @property
    def port(self) -> int:
        """The bound port, 0 when not serving."""
        return self._port

    def update(self, step: int, data: Mapping[str, float]) -> None:
        """Set the gauges of one step from verl-keyed data; keys outside the catalog are skipped."""
        with self._lock:
            # The rules' own mapping: the best-ranked key wins, and the KL loss stands in for the KL
            # penalty a run without use_kl_in_reward lacks, so ppo_kl_mean is the KL the rules judge.
            shorts = catalog.to_short(data)
            for short, value in shorts.items():
                self._gauges[catalog.BY_SHORT[short].key].labels(self.run_id).set(value)
            for raw in data:
                if not catalog.sources_of(raw) and raw not in self._unknown_logged:
                    self._unknown_logged.add(raw)
                    log.debug("not exported (not in the catalog): %s", raw)
            if "step" not in shorts:
                self._gauges["training/global_step"].labels(self.run_id).set(float(step))
            self._last_update.labels(self.run_id).set(self._clock())

    def count_event(self, kind: str) -> None:
        """Count one event of ``kind``."""
        self._events.labels(self.run_id, kind).inc()

    def exposition(self) -> str:
        """The text /metrics serves (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
        self._port = 0

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
