"""Prometheus as the watchdog's metric source.

The pure aligner (scrapes + events -> step records) is checked on hand-made scrapes; the rest
runs against a real Prometheus (Debian's binary, tests/promserver.py) scraping a real trainer:
the watchdog, reading the run only through Prometheus, acts on a KL it read there, and what it
reads equals the trainer's own metrics.jsonl. An outage (an error answer, then Prometheus
stopped and restarted) costs nothing but time.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from promserver import PromServer, prometheus_server, wait_for
from typer.testing import CliRunner

from ppo_watchdog.cli import app
from ppo_watchdog.control.daemon import DaemonConfigError, build_watchdog, load_daemon_config
from ppo_watchdog.control.store import Store
from ppo_watchdog.observe import telemetry
from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol.exporter import EPHEMERAL, MetricsExporter, free_port
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.sources.prometheus import (
    STEP_METRIC,
    PrometheusClient,
    PrometheusSource,
    StepAligner,
    run_selector,
    source_config,
)

KL, KL_COEF, STEP = "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "training/global_step"
P = {m.key: m.prom for m in catalog.METRICS}


def scrape(ts: float, step: float, **values: float) -> tuple[float, dict[str, float]]:
    """A scrape as Prometheus returns it: the exporter shows NaN for what it has not measured."""
    out = {m.prom: math.nan for m in catalog.METRICS}
    out[STEP_METRIC] = step
    out.update({P[k.replace("__", "/")]: v for k, v in values.items()})
    return ts, out


# -- the pure aligner ------------------------------------------------------------------------------


def test_a_step_is_handed_out_when_scraped_twice_with_the_last_scrape_winning() -> None:
    a = StepAligner()
    assert a.feed([scrape(1.0, 1, actor__reward_kl_penalty=0.5)]) == []  # may have raced the update
    (rec,) = a.feed([scrape(2.0, 1, actor__reward_kl_penalty=0.25)])
    assert rec == {"step": 1, "data": {KL: 0.25, STEP: 1.0}}
    assert a.feed([scrape(3.0, 1, actor__reward_kl_penalty=0.25)]) == []  # handed out once


def test_a_step_seen_once_is_complete_when_the_next_step_shows() -> None:
    a = StepAligner()
    out = a.feed([scrape(1.0, 3, actor__reward_kl_penalty=0.1), scrape(2.0, 5, actor__reward_kl_penalty=0.2)])
    assert [r["step"] for r in out] == [3]
    assert a.pending is not None and a.pending["step"] == 5


def test_a_rollback_to_an_earlier_step_starts_a_new_timeline() -> None:
    a = StepAligner()
    steps = [r["step"] for r in a.feed([scrape(t, s, actor__reward_kl_penalty=0.1)
                                        for t, s in [(1, 4), (2, 4), (3, 5), (4, 2), (5, 2), (6, 3), (7, 3)]])]
    assert steps == [4, 5, 2, 3]


def test_nan_is_passed_on_only_after_the_process_measured_the_metric() -> None:
    a = StepAligner()
    out = a.feed([scrape(1.0, 1, actor__reward_kl_penalty=0.1), scrape(2.0, 2, actor__reward_kl_penalty=math.nan)])
    out += a.feed([], [{"kind": "finished", "ts": 3.0}])
    first, second = out
    assert set(first["data"]) == {KL, STEP}  # the never-measured gauges (NaN) are not metrics
    assert math.isnan(second["data"][KL])  # a measured NaN: nonfinite() must see it
    # A new process: its exporter starts all-NaN, so its NaN means "not measured" again.
    out = a.feed([scrape(5.0, 3), scrape(6.0, 3)], [{"kind": "started", "ts": 4.0}])
    assert out == [{"step": 3, "data": {STEP: 3.0}}]


def test_the_last_step_of_a_finished_run_is_handed_out_and_the_state_round_trips() -> None:
    a = StepAligner()
    assert a.feed([scrape(1.0, 7, actor__reward_kl_penalty=0.3)]) == []
    b = StepAligner.from_json(json.loads(json.dumps(a.to_json())))
    assert b.feed([], [{"kind": "finished", "ts": 2.0}]) == [{"step": 7, "data": {KL: 0.3, STEP: 7.0}}]


def test_the_selector_quotes_the_run_label() -> None:
    sel = run_selector('a"b\\c')
    assert sel.endswith('run="a\\"b\\\\c"}') and STEP_METRIC in sel and P[KL] in sel


# -- configuration: CLI and daemon -----------------------------------------------------------------


def test_source_prometheus_needs_a_url_and_takes_it_from_the_environment() -> None:
    with pytest.raises(ValueError, match="WATCHDOG_PROMETHEUS_URL"):
        source_config("prometheus", env={})
    assert source_config("prometheus", env={"WATCHDOG_PROMETHEUS_URL": "http://p:9090"}).prometheus_url == "http://p:9090"
    with pytest.raises(ValueError, match="files, prometheus"):
        source_config("graphite", "http://p:9090", env={})


def test_watchdog_run_refuses_source_prometheus_without_a_url(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run", "--source", "prometheus", "--run-dir", str(tmp_path / "r"),
                                      "--state-dir", str(tmp_path / "s")], env={"WATCHDOG_PROMETHEUS_URL": ""})
    assert result.exit_code == 2, result.output
    assert "needs a Prometheus URL" in result.output
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_daemon_config_takes_a_global_and_a_per_run_source(tmp_path: Path) -> None:
    cfg_file = tmp_path / "daemon.yaml"
    cfg_file.write_text("source: prometheus\nprometheus_url: http://127.0.0.1:9090\nfile_sd_dir: /t\n"
                        "runs:\n  - run_dir: /r/a\n  - {run_dir: /r/b, source: files}\n"
                        "  - {run_dir: /r/c, prometheus_url: 'http://10.0.0.2:9090'}\n")
    cfg = load_daemon_config(cfg_file)
    a, b, c = (cfg.source_for(s) for s in cfg.runs)
    assert (a.kind, a.prometheus_url, a.file_sd_dir) == ("prometheus", "http://127.0.0.1:9090", "/t")
    assert b.kind == "files" and c.prometheus_url == "http://10.0.0.2:9090"


@pytest.mark.parametrize("text, where", [
    ("runs:\n  - {run_dir: /r/a, source: prometheus}\n", "runs[0].source"),
    ("source: influx\n", "source must be one of"),
    ("runs:\n  - {run_dir: /r/a, prom_url: x}\n", "unknown key runs[0].prom_url"),
])
def test_daemon_config_names_a_bad_source_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                              where: str) -> None:
    monkeypatch.delenv("WATCHDOG_PROMETHEUS_URL", raising=False)
    (tmp_path / "d.yaml").write_text(text)
    with pytest.raises(DaemonConfigError, match=r"d\.yaml") as err:
        load_daemon_config(tmp_path / "d.yaml")
    assert where in str(err.value)


# -- rule states every tick ----------------------------------------------------------------------


def test_every_rule_state_is_published_for_every_run_each_tick(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n"
                     "  - {name: kl_sustained, description: d, expr: kl > 0.1, for: 3, actions: [notify]}\n"
                     "  - {name: kl_far, description: d, expr: kl > 5, actions: [notify]}\n")
    run_dir = tmp_path / "ext"
    run_dir.mkdir()
    rundir.append_metrics(run_dir, 1, {KL: 0.5})
    wd = build_watchdog(tmp_path / "state", [rules])
    wd.add_run(run_dir, managed=False)
    wd.tick()
    get = wd.telemetry.registry.get_sample_value
    # Neither rule decided anything yet; both states are out there anyway.
    assert get("watchdog_rule_state", {"run": "ext", "rule": "kl_sustained"}) == telemetry.RULE_STATES["pending"]
    assert get("watchdog_rule_state", {"run": "ext", "rule": "kl_far"}) == telemetry.RULE_STATES["inactive"]
    assert wd.store.decisions("ext") == []


# -- a real Prometheus, a real trainer, the watchdog reading only Prometheus -------------------

KL_RULE = """version: 1
rules:
  - name: kl_high
    description: KL to the reference above 0.1 -> kl_coef x2 (the seed table's remedy, doubled to see it)
    expr: kl > 0.1
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 2.0, max: 1.0}
    cooldown: 1000
    severity: warning
"""
STEPS = 18


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory: pytest.TempPathFactory, tiny_sft, trainer_env) -> Iterator[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """`watchdog run --source prometheus` over a trainer whose KL crosses 0.1 near step 11.

    The tiny trainer steps in well under a scrape interval; a hang fault (the trainer's own sleep,
    served metrics and all) at every step from 8 on makes each step last longer than one 1 s scrape,
    and a pause at step 1 gives Prometheus's target discovery time to pick the trainer up.
    """
    tmp = tmp_path_factory.mktemp("promsource")
    run_dir, state = tmp / "run", tmp / "state"
    wd_port = free_port()
    (tmp / "rules.yaml").write_text(KL_RULE)
    with prometheus_server(tmp / "prom", {telemetry.WATCHDOG_JOB: [f"127.0.0.1:{wd_port}"]}) as prom:
        sets = [s for s in tiny_sft.overrides(run_dir, STEPS) if not s.startswith("trainer.run_dir=")]
        sets += ["algorithm.kl_ctrl.kl_coef=0.0001", "actor_rollout_ref.actor.optim.lr=0.004"]
        faults = ",".join(["hang@1:3"] + [f"hang@{s}:1.1" for s in range(8, STEPS + 1)])
        cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--source", "prometheus", "--prometheus-url", prom.url,
               "--file-sd-dir", str(prom.sd_dir), "--rules", str(tmp / "rules.yaml"), "--run-dir", str(run_dir),
               "--state-dir", str(state), "--tick", "0.3", "--metrics-port", str(wd_port), "--no-report",
               "--faults", faults]
        for s in sets:
            cmd += ["--set", s]
        env = {**trainer_env, "WATCHDOG_PROMETHEUS_URL": "", "GRAFANA_URL": ""}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
        yield {"proc": proc, "run_dir": run_dir, "state": state, "prom": prom, "tmp": tmp}


def _by_step(prom: PromServer, run: str, metric: str) -> dict[int, float]:
    """What Prometheus holds of one metric, per step (the step gauge of the same scrape, last scrape wins)."""
    steps = dict(prom.samples(STEP_METRIC, run))
    return {int(steps[t]): v for t, v in prom.samples(metric, run) if t in steps and math.isfinite(steps[t])}


@pytest.mark.slow
@pytest.mark.prometheus
def test_the_watchdog_acts_on_the_kl_it_reads_from_prometheus(watched_run: dict[str, Any]) -> None:
    proc, run_dir, prom = watched_run["proc"], watched_run["run_dir"], watched_run["prom"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = RunInfo.read(run_dir).id
    assert run == run_dir.name  # one name for the run: the trainer's label is the watchdog's run id
    store = Store(watched_run["state"])
    saved = (store.load_engine_state(run) or {})["tailer"]
    assert saved["source"] == "prometheus" and saved["prometheus"]["last_ts"] is not None
    (decision,) = [d for d in store.decisions(run) if d["rule"] == "kl_high"]
    assert decision["status"] == "applied"
    held = _by_step(prom, run, P[KL])
    # The KL that fired the rule is the one Prometheus holds for that step.
    assert decision["inputs"]["kl"] == pytest.approx(held[decision["step"]], rel=1e-12)
    assert decision["inputs"]["kl"] > 0.1
    # The trainer then applied the new kl_coef: twice what Prometheus showed at the decision's step.
    (applied,) = [e for e in rundir.iter_events(run_dir, ["applied"]) if e["version"] == 1]
    coef = _by_step(prom, run, P[KL_COEF])[decision["step"]]
    assert applied["applied"] == {"algorithm.kl_ctrl.kl_coef": pytest.approx(2 * coef)}
    assert applied["step"] >= decision["step"]
    # The watchdog registered the trainer with file_sd (Prometheus scraped it) and withdrew it at the end.
    assert list(prom.sd_dir.glob("*.json")) == []
    # Its own /metrics published the rule's state every tick: inactive before the KL rose, firing after.
    result = prom.query(f'watchdog_rule_state{{run="{run}",rule="kl_high"}}[600s]')
    states = {float(v) for r in result for _, v in r["values"]}
    assert {telemetry.RULE_STATES["inactive"], telemetry.RULE_STATES["firing"]} <= states


@pytest.mark.slow
@pytest.mark.prometheus
def test_records_read_from_prometheus_equal_the_trainers_metrics_jsonl(watched_run: dict[str, Any]) -> None:
    run_dir, prom = watched_run["run_dir"], watched_run["prom"]
    source = PrometheusSource(PrometheusClient(prom.url), run_dir)
    records, events = source.poll()
    assert any(e["kind"] == "finished" for e in events)
    file_records = {r["step"]: r["data"] for r in rundir.read_jsonl(run_dir / rundir.METRICS).records}
    assert len(records) >= 8, f"only steps {[r['step'] for r in records]} were scraped"
    assert [r["step"] for r in records] == sorted({r["step"] for r in records})
    for rec in records:
        expected = {catalog.canonical_key(k): v for k, v in file_records[rec["step"]].items()
                    if catalog.canonical_key(k)}
        assert set(expected) <= set(rec["data"]), rec["step"]
        for key, value in expected.items():
            assert rec["data"][key] == pytest.approx(value, rel=1e-12), (rec["step"], key)


# -- an outage: an error answer, then Prometheus stopped and started again ---------------------


class _Gate:
    """A proxy in front of Prometheus that can answer 503 instead (an unhealthy Prometheus)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.failing = False
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if gate.failing:
                    body = json.dumps({"status": "error", "errorType": "unavailable",
                                       "error": "TSDB not ready"}).encode()
                    status = 503
                else:
                    try:
                        with urllib.request.urlopen(gate.upstream + self.path, timeout=5) as r:
                            body, status = r.read(), r.status
                    except OSError as exc:  # upstream down: close like a dead server would
                        self.close_connection = True
                        self.send_error(502, str(exc))
                        return
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.mark.prometheus
def test_an_outage_is_logged_counted_and_caught_up_on_without_losing_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="ppo_watchdog.sources.prometheus")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    exporter = MetricsExporter("outage", port=EPHEMERAL)
    RunInfo(id="outage", metrics_port=exporter.port).write(run_dir)
    rundir.append_event(run_dir, "started", 0)
    metrics = telemetry.WatchdogMetrics()
    errors = lambda: metrics.registry.get_sample_value(  # noqa: E731
        "watchdog_errors_total", {"run": "outage", "where": "prometheus"}) or 0
    seen: list[dict[str, Any]] = []

    def poll_until(step: int) -> bool:
        seen.extend(source.poll()[0])
        return any(r["step"] == step for r in seen)

    with prometheus_server(tmp_path / "prom") as prom:
        gate = _Gate(prom.url)
        try:
            # The source announces the trainer to Prometheus's file_sd itself (run.json's port).
            source = PrometheusSource(PrometheusClient(gate.url, timeout_s=3), run_dir, run_id="outage",
                                      telemetry=metrics, file_sd_dir=prom.sd_dir)
            exporter.update(1, {KL: 0.01})
            wait_for(lambda: poll_until(1), 30, "step 1 through Prometheus")
            assert (prom.sd_dir / "outage.json").exists()

            # Prometheus answers an error: logged with the URL and the reason, counted, nothing returned.
            gate.failing = True
            exporter.update(2, {KL: 0.02})
            wait_for(lambda: sum(v == 2 for _, v in prom.samples(STEP_METRIC, "outage")) >= 2, 30,
                     "Prometheus scraping step 2 twice")
            assert source.poll()[0] == []
            assert errors() == 1 and not source.healthy
            assert f"{gate.url}/api/v1/query: HTTP 503 unavailable: TSDB not ready" in caplog.text
            # Back: the steps scraped meanwhile arrive, none lost.
            gate.failing = False
            wait_for(lambda: poll_until(2), 30, "step 2 after the error")
            assert source.healthy

            # Prometheus stopped: no exception, a log line, a count; started again: caught up.
            prom.stop()
            assert source.poll()[0] == []
            assert errors() == 2
            exporter.update(3, {KL: 0.03})
            prom.start()
            wait_for(lambda: poll_until(3), 40, "step 3 after Prometheus restarted")
        finally:
            gate.close()
            exporter.close()
    assert [r["step"] for r in seen] == [1, 2, 3]
    assert [r["data"][KL] for r in seen] == [0.01, 0.02, 0.03]
    assert "answers again" in caplog.text


def test_a_poll_before_any_trainer_started_asks_prometheus_nothing(tmp_path: Path) -> None:
    class Refuse:
        safe_url = "http://never"

        def query(self, promql: str, at: float) -> dict[str, Any]:
            raise AssertionError("queried before the run started")

    source = PrometheusSource(Refuse(), tmp_path)
    assert source.poll() == ([], [])


class Canned:
    """A stand-in for Prometheus's query API over fixed scrapes (for the offsets test only)."""

    safe_url = "http://canned"

    def __init__(self, scrapes: list[tuple[float, dict[str, float]]]) -> None:
        self.scrapes = scrapes

    def query(self, promql: str, at: float) -> dict[str, Any]:
        series: dict[str, list[list[Any]]] = {}
        for ts, values in self.scrapes:
            if ts <= at:
                for name, v in values.items():
                    series.setdefault(name, []).append([ts, str(v)])
        return {"resultType": "matrix",
                "result": [{"metric": {"__name__": n, "run": "r"}, "values": v} for n, v in series.items()]}


def test_a_restarted_watchdog_resumes_from_the_persisted_offsets(tmp_path: Path) -> None:
    RunInfo(id="r").write(tmp_path)
    rundir.append_event(tmp_path, "started", 0)
    started = rundir.iter_events(tmp_path)[0]["ts"]
    scrapes = [scrape(started + 1, 4, actor__reward_kl_penalty=0.2), scrape(started + 2, 4, actor__reward_kl_penalty=0.2),
               scrape(started + 3, 5, actor__reward_kl_penalty=0.3)]
    client = Canned(scrapes)
    first = PrometheusSource(client, tmp_path, clock=lambda: started + 3.5)
    records, events = first.poll()
    assert [r["step"] for r in records] == [4] and [e["kind"] for e in events] == ["started"]
    saved = json.loads(json.dumps(first.offsets))  # what the store keeps

    client.scrapes.append(scrape(started + 4, 6, actor__reward_kl_penalty=0.4))
    second = PrometheusSource(client, tmp_path, offsets=saved, clock=lambda: started + 4.5)
    replayed, old_events = second.replay()  # the window as it stood
    assert [r["step"] for r in replayed] == [4] and [e["kind"] for e in old_events] == ["started"]
    records, events = second.poll()
    assert [r["step"] for r in records] == [5] and events == []  # step 5 was pending: not lost, not doubled
    with pytest.raises(ValueError, match="version"):
        PrometheusSource(client, tmp_path, offsets={**saved, "version": 99})
