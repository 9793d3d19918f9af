"""The trainer's /metrics: every catalog metric with its run label and catalog HELP, served on loopback."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ppo_watchdog.protocol import catalog
from ppo_watchdog.protocol.exporter import (
    EPHEMERAL,
    EVENTS_METRIC,
    LAST_UPDATE_METRIC,
    MetricsExporter,
    free_port,
)

GOLDEN = Path(__file__).parent / "golden" / "exporter_metrics.prom"


def _exporter(**kw) -> MetricsExporter:
    return MetricsExporter("run-a", registry=CollectorRegistry(), clock=lambda: 1700000000.0, **kw)


def _step_data() -> dict[str, float]:
    # one value per catalog metric, distinct so a crossed wire shows
    return {m.key: 0.5 + i for i, m in enumerate(catalog.METRICS)}


def test_update_sets_each_catalog_gauge_with_the_run_label() -> None:
    exp = _exporter()
    data = _step_data()
    exp.update(12, data)
    for m in catalog.METRICS:
        assert exp.registry.get_sample_value(m.prom, {"run": "run-a"}) == data[m.key], m.key
    assert exp.registry.get_sample_value(LAST_UPDATE_METRIC, {"run": "run-a"}) == 1700000000.0


def test_every_catalog_metric_is_present_before_the_first_step_as_nan() -> None:
    exp = _exporter()
    for m in catalog.METRICS:
        value = exp.registry.get_sample_value(m.prom, {"run": "run-a"})
        assert value is not None and math.isnan(value), m.prom


def test_help_text_comes_from_the_catalog() -> None:
    families = {f.name: f for f in text_string_to_metric_families(_exporter().exposition())}
    for m in catalog.METRICS:
        assert families[m.prom].documentation == m.help
        assert families[m.prom].type == "gauge"


def test_aliased_and_per_source_keys_land_on_the_catalog_gauge_and_unknown_keys_are_skipped() -> None:
    exp = _exporter()
    exp.update(3, {"critic/kl": 0.07, "val-core/gsm8k/reward/mean@1": 0.31, "timing_s/gen": 1.0, "note": "x"})  # type: ignore[dict-item]
    assert exp.registry.get_sample_value("ppo_kl_mean", {"run": "run-a"}) == 0.07
    assert exp.registry.get_sample_value("ppo_val_score", {"run": "run-a"}) == 0.31
    assert exp.registry.get_sample_value("ppo_global_step", {"run": "run-a"}) == 3.0  # from the step argument


def test_a_nan_loss_is_exported_as_nan_so_rules_on_prometheus_see_it() -> None:
    exp = _exporter()
    exp.update(1, {"critic/vf_loss": float("nan"), "actor/grad_norm": float("inf")})
    assert math.isnan(exp.registry.get_sample_value("ppo_value_loss", {"run": "run-a"}))  # type: ignore[arg-type]
    assert exp.registry.get_sample_value("ppo_actor_grad_norm", {"run": "run-a"}) == math.inf


def test_count_event_counts_by_kind() -> None:
    exp = _exporter()
    exp.count_event("oom")
    exp.count_event("oom")
    exp.count_event("checkpoint")
    assert exp.registry.get_sample_value(EVENTS_METRIC, {"run": "run-a", "kind": "oom"}) == 2.0
    assert exp.registry.get_sample_value(EVENTS_METRIC, {"run": "run-a", "kind": "checkpoint"}) == 1.0


def test_exposition_matches_the_golden_file() -> None:
    exp = _exporter()
    exp.update(12, _step_data())
    exp.count_event("checkpoint")
    # the counter's *_created sample is a wall-clock timestamp: not golden material
    text = "".join(line for line in exp.exposition().splitlines(keepends=True) if "_created" not in line)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_exposition() -> None:
    exp = _exporter()
    exp.update(12, _step_data())
    exp.count_event("oom")
    proc = subprocess.run(["promtool", "check", "metrics"], input=exp.exposition(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_port_zero_serves_nothing() -> None:
    exp = _exporter(port=0)
    assert exp.port == 0 and exp._server is None
    exp.close()


def test_serves_metrics_over_http_on_loopback_by_default() -> None:
    with _exporter(port=EPHEMERAL) as exp:
        assert exp.port > 0
        assert exp._server.server_address[0] == "127.0.0.1"
        exp.update(5, {"actor/reward_kl_penalty": 0.042})
        body = urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=10).read().decode()
    assert 'ppo_kl_mean{run="run-a"} 0.042' in body
    assert exp.port == 0


def test_a_chosen_free_port_is_used() -> None:
    port = free_port()
    with _exporter(port=port) as exp:
        assert exp.port == port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "ppo_global_step" in body


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="port"):
        _exporter(port=70000)
    with pytest.raises(ValueError, match="run_id"):
        MetricsExporter("", registry=CollectorRegistry())
