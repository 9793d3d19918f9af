"""A real Prometheus for tests: Debian's ``prometheus`` binary on 127.0.0.1 with a generated config.

The trainer job finds its targets through file_sd (as deploy/prometheus/prometheus.yml does),
other jobs are static. Scrapes every second, so a test sees data within a few seconds.
Used by the dashboard test (every query returns data) and the Prometheus source test (the
watchdog acting on what Prometheus holds).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppo_watchdog.observe import telemetry
from ppo_watchdog.protocol.exporter import free_port


def prometheus_binary() -> str:
    """The ``prometheus`` binary, or skip the test (``make test`` installs Debian's package)."""
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus not installed (make test installs Debian's prometheus)")
    return path


def get_json(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET a JSON document."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def is_ready(url: str) -> bool:
    """True when ``url`` answers 200 (Prometheus's /-/ready answers 503 while starting)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False


def wait_for(pred: Callable[[], Any], timeout: float, what: str, proc: subprocess.Popen | None = None) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail naming ``what`` on timeout
    or when ``proc`` exits first. Connection errors count as "not yet"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}")
        try:
            value = pred()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def scrape_config(sd_dir: Path, static: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """Prometheus config: the trainer job on file_sd (honouring the exporter's ``run`` label), plus static jobs."""
    jobs: list[dict[str, Any]] = [
        {"job_name": telemetry.TRAINER_JOB, "honor_labels": True,
         "file_sd_configs": [{"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}]},
    ]
    for job, targets in (static or {}).items():
        jobs.append({"job_name": job, "honor_labels": True, "static_configs": [{"targets": list(targets)}]})
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": jobs}


@dataclass
class PromServer:
    """One Prometheus process (restartable on the same port and data, to test an outage)."""

    root: Path
    """Config, data, file_sd targets and log live here."""
    static: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Static scrape jobs: job name -> host:port targets."""
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def sd_dir(self) -> Path:
        """The trainer job's file_sd directory."""
        return self.root / "targets"

    def start(self) -> None:
        """Start (or restart) Prometheus and wait until it is ready."""
        binary = prometheus_binary()
        self.port = self.port or free_port()
        self.sd_dir.mkdir(parents=True, exist_ok=True)
        config = self.root / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(self.sd_dir, self.static)))
        with open(self.root / "prometheus.log", "a") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={self.root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        wait_for(lambda: is_ready(f"{self.url}/-/ready"), 30, "prometheus ready", self.proc)

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM, then SIGKILL after 10 s)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """``/api/v1/query`` result list (evaluated now unless ``at``)."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        return get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}")["data"]["result"]

    def samples(self, metric: str, run: str, seconds: int = 600) -> list[tuple[float, float]]:
        """Raw (timestamp, value) samples of one run's series over the last ``seconds``."""
        result = self.query(f'{metric}{{run="{run}"}}[{seconds}s]')
        return sorted((float(t), float(v)) for r in result for t, v in r["values"])


@contextmanager
def prometheus_server(root: Path, static: Mapping[str, Sequence[str]] | None = None) -> Iterator[PromServer]:
    """A started Prometheus under ``root``, stopped on exit (also when the test fails)."""
    root.mkdir(parents=True, exist_ok=True)
    server = PromServer(root, dict(static or {}))
    try:
        server.start()
        yield server
    finally:
        server.stop()
