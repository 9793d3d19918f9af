"""The watchdog's own /metrics: values, exposition that passes promtool, serving, file_sd."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ppo_watchdog.observe import telemetry
from ppo_watchdog.observe.telemetry import WatchdogMetrics

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make test installs Debian's prometheus)")


def promtool_check_metrics(text: bytes) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text.decode(), capture_output=True, text=True, timeout=30,
    )


def busy_metrics() -> WatchdogMetrics:
    """Every metric with at least one sample, as after a few ticks of a real daemon."""
    m = WatchdogMetrics()
    m.rule_state("run-a", "kl_high", "firing")
    m.rule_state("run-a", "vf_loss_high", "pending")
    m.rule_state("run-b", "kl_high", "resolved")
    m.action("run-a", "kl_high", "set", "applied")
    m.action("run-a", "kl_high", "set", "applied")
    m.action("run-a", "nan", "rollback", "failed")
    m.escalation("run-a", "kl_high")
    m.eval_seconds(0.003)
    m.eval_seconds(0.2)
    m.data_age("run-a", 4.5)
    m.approvals_waiting("run-a", 1)
    m.planned_relaunch("run-a", True)
    m.runs_watched(2)
    m.last_tick(1_700_000_000.0)
    m.error("run-b", "ingest")
    return m


def test_rule_states_use_prometheus_alert_state_numbers() -> None:
    m = busy_metrics()
    get = m.registry.get_sample_value
    assert get("watchdog_rule_state", {"run": "run-a", "rule": "kl_high"}) == 2
    assert get("watchdog_rule_state", {"run": "run-a", "rule": "vf_loss_high"}) == 1
    # the engine's transient "resolved" means the condition no longer holds
    assert get("watchdog_rule_state", {"run": "run-b", "rule": "kl_high"}) == 0
    m.rule_state("run-a", "kl_high", 0)
    assert get("watchdog_rule_state", {"run": "run-a", "rule": "kl_high"}) == 0


def test_an_unknown_rule_state_is_rejected_naming_the_rule_and_the_value() -> None:
    m = WatchdogMetrics()
    with pytest.raises(ValueError, match=r"'burning'.*'kl_high'"):
        m.rule_state("r", "kl_high", "burning")
    with pytest.raises(ValueError, match="kl_high.*7"):
        m.rule_state("r", "kl_high", 7)


def test_actions_are_counted_by_rule_kind_and_outcome() -> None:
    get = busy_metrics().registry.get_sample_value
    assert get("watchdog_actions_total", {"run": "run-a", "rule": "kl_high", "kind": "set", "outcome": "applied"}) == 2
    assert get("watchdog_actions_total", {"run": "run-a", "rule": "nan", "kind": "rollback", "outcome": "failed"}) == 1
    assert get("watchdog_escalations_total", {"run": "run-a", "rule": "kl_high"}) == 1
    assert get("watchdog_errors_total", {"run": "run-b", "where": "ingest"}) == 1


def test_escalation_counter_exists_at_zero_once_a_rule_is_known() -> None:
    # so Prometheus sees the first escalation as an increase (alerts.yml relies on increase())
    m = WatchdogMetrics()
    m.rule_state("run-c", "oom", "inactive")
    assert m.registry.get_sample_value("watchdog_escalations_total", {"run": "run-c", "rule": "oom"}) == 0


def test_evaluation_time_lands_in_the_histogram_buckets() -> None:
    get = busy_metrics().registry.get_sample_value
    assert get("watchdog_evaluation_seconds_count") == 2
    assert get("watchdog_evaluation_seconds_sum") == pytest.approx(0.203)
    assert get("watchdog_evaluation_seconds_bucket", {"le": "0.005"}) == 1
    assert get("watchdog_evaluation_seconds_bucket", {"le": "0.25"}) == 2


def test_tick_phase_times_are_summed_over_the_runs_and_observed_once_a_tick() -> None:
    m = WatchdogMetrics()
    get = m.registry.get_sample_value
    m.phase_time("read", 0.002)
    m.phase_time("read", 0.003)
    m.phase_time("decide", 0.2)
    m.tick_phases_done()
    assert get("watchdog_tick_phase_seconds_count", {"phase": "read"}) == 1
    assert get("watchdog_tick_phase_seconds_sum", {"phase": "read"}) == pytest.approx(0.005)
    assert get("watchdog_tick_phase_seconds_bucket", {"phase": "decide", "le": "0.1"}) == 0
    assert get("watchdog_tick_phase_seconds_bucket", {"phase": "decide", "le": "0.25"}) == 1
    m.tick_phases_done()  # the next tick starts from zero
    assert get("watchdog_tick_phase_seconds_sum", {"phase": "read"}) == pytest.approx(0.005)
    assert get("watchdog_tick_phase_seconds_count", {"phase": "commit"}) == 2


def test_gauges_hold_what_the_controller_set() -> None:
    get = busy_metrics().registry.get_sample_value
    assert get("watchdog_data_age_seconds", {"run": "run-a"}) == 4.5
    assert get("watchdog_runs_watched") == 2
    assert get("watchdog_last_tick_timestamp_seconds") == 1_700_000_000.0
    assert get("watchdog_planned_relaunch", {"run": "run-a"}) == 1


def test_each_instance_has_its_own_registry() -> None:
    a, b = WatchdogMetrics(), WatchdogMetrics()
    a.runs_watched(3)
    assert b.registry.get_sample_value("watchdog_runs_watched") == 0
    shared = CollectorRegistry()
    WatchdogMetrics(shared)
    with pytest.raises(ValueError):  # a second set of the same names in one registry is refused
        WatchdogMetrics(shared)


def test_forgetting_a_run_drops_its_gauges() -> None:
    m = busy_metrics()
    m.forget_run("run-a", ["kl_high", "vf_loss_high"])
    get = m.registry.get_sample_value
    assert get("watchdog_rule_state", {"run": "run-a", "rule": "kl_high"}) is None
    assert get("watchdog_data_age_seconds", {"run": "run-a"}) is None
    assert get("watchdog_approvals_waiting", {"run": "run-a"}) is None
    assert get("watchdog_planned_relaunch", {"run": "run-a"}) is None
    assert get("watchdog_rule_state", {"run": "run-b", "rule": "kl_high"}) == 0


def test_every_exposed_series_is_declared_in_the_module() -> None:
    text = generate_latest(busy_metrics().registry).decode()
    exposed = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    # prometheus_client adds *_created; nothing queries them
    exposed = {n for n in exposed if not n.endswith("_created")}
    assert exposed == set(telemetry.series_names())


@needs_promtool
def test_exposition_passes_promtool_check_metrics() -> None:
    result = promtool_check_metrics(generate_latest(busy_metrics().registry))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


@needs_promtool
def test_promtool_check_metrics_does_flag_a_badly_named_counter() -> None:
    # the check above can fail: a counter without _total is what promtool lints
    bad = b"# HELP requests Requests.\n# TYPE requests counter\nrequests 1\n"
    result = promtool_check_metrics(bad)
    assert result.returncode != 0
    assert "_total" in result.stdout + result.stderr


def test_serve_exposes_metrics_over_http_on_loopback() -> None:
    m = busy_metrics()
    port = m.serve(0)
    try:
        assert m.port == port > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'watchdog_rule_state{rule="kl_high",run="run-a"} 2.0' in body
    finally:
        m.close()
    assert m.port == 0


def test_file_sd_announces_and_withdraws_a_run(tmp_path) -> None:
    path = telemetry.write_file_sd(tmp_path, "ppo/run 1", "127.0.0.1:9400", {"run_dir": "/srv/runs/x"})
    assert path.parent == tmp_path and path.name == "ppo_run_1.json"
    assert json.loads(path.read_text()) == [{"targets": ["127.0.0.1:9400"],
                                             "labels": {"run": "ppo/run 1", "run_dir": "/srv/runs/x"}}]
    assert telemetry.remove_file_sd(tmp_path, "ppo/run 1") is True
    assert not path.exists()
    assert telemetry.remove_file_sd(tmp_path, "ppo/run 1") is False
    with pytest.raises(ValueError, match="host:port"):
        telemetry.write_file_sd(tmp_path, "r", "localhost")


def test_the_real_daemon_feeds_these_metrics_and_its_exposition_passes_promtool(tmp_path) -> None:
    # A cross-check of the controller's calls against this module: a real Watchdog ticking
    # once over a real run directory (three healthy steps written through the run-dir protocol).
    from ppo_watchdog.control.daemon import build_watchdog
    from ppo_watchdog.protocol import rundir

    run_dir = tmp_path / "run-ok"
    run_dir.mkdir()
    for step in (1, 2, 3):
        rundir.append_metrics(run_dir, step, {"actor/reward_kl_penalty": 0.01, "critic/score/mean": 0.2,
                                              "critic/vf_loss": 0.1, "training/global_step": step})
    wd = build_watchdog(tmp_path / "state")
    wd.add_run(run_dir, None, None, managed=False)
    wd.tick(1_800_000_000.0)
    metrics = wd.telemetry
    assert isinstance(metrics, WatchdogMetrics)
    get = metrics.registry.get_sample_value
    assert get("watchdog_runs_watched") == 1
    assert get("watchdog_last_tick_timestamp_seconds") is not None
    assert get("watchdog_evaluation_seconds_count") == 1
    for phase in telemetry.TICK_PHASES:  # one observation a phase a tick, the runs' times summed
        assert get("watchdog_tick_phase_seconds_count", {"phase": phase}) == 1, phase
    assert get("watchdog_tick_phase_seconds_sum", {"phase": "read"}) > 0
    assert get("watchdog_tick_phase_seconds_sum", {"phase": "decide"}) > 0
    phases = sum(get("watchdog_tick_phase_seconds_sum", {"phase": p}) for p in telemetry.TICK_PHASES)
    assert phases <= get("watchdog_evaluation_seconds_sum")
    assert get("watchdog_data_age_seconds", {"run": "run-ok"}) is not None
    text = generate_latest(metrics.registry)
    exposed = {s.name for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert {n for n in exposed if not n.endswith("_created")} <= telemetry.series_names()
    if PROMTOOL is not None:
        result = promtool_check_metrics(text)
        assert result.returncode == 0, result.stdout + result.stderr
