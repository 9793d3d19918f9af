"""Dashboards as code: committed JSON is what the code generates, every query is valid PromQL over
known metrics, and (with a real Prometheus scraping a real exporter) every query returns data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from promserver import get_json, prometheus_server, wait_for
from typer.testing import CliRunner

from ppo_watchdog.cli.dashboards import dashboards_app
from ppo_watchdog.observe import dashboards, telemetry
from ppo_watchdog.protocol import catalog
from ppo_watchdog.protocol.exporter import MetricsExporter
from ppo_watchdog.protocol.runinfo import RunInfo

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "dashboards"


def all_queries() -> list[tuple[str, dashboards.Query]]:
    return [(name, q) for name, build in dashboards.DASHBOARDS.items() for q in dashboards.queries(build())]


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_regenerating_gives_the_committed_json(name: str) -> None:
    committed = (COMMITTED / name).read_text()
    assert dashboards.dump(dashboards.DASHBOARDS[name]()) == committed, (
        f"dashboards/{name} is stale: run `watchdog dashboards export dashboards`"
    )


def test_export_command_writes_every_dashboard(tmp_path: Path) -> None:
    result = CliRunner().invoke(dashboards_app, ["export", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    for name in dashboards.DASHBOARDS:
        assert json.loads((tmp_path / "out" / name).read_text()) == json.loads((COMMITTED / name).read_text())


def test_dashboards_have_fixed_uids_and_a_run_variable() -> None:
    ppo, wd = dashboards.ppo_run(), dashboards.watchdog()
    assert (ppo["uid"], ppo["title"]) == (dashboards.PPO_RUN_UID, "PPO run")
    assert (wd["uid"], wd["title"]) == (dashboards.WATCHDOG_UID, "Watchdog")
    for d in (ppo, wd):
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["run"]["type"] == "query" and variables["run"]["multi"] is True
        assert variables[dashboards.DS_VAR]["type"] == "datasource"
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), "panel ids must be unique"
        for p in d["panels"]:
            pos = p["gridPos"]
            assert pos["x"] + pos["w"] <= 24, f"panel {p['title']} overflows the grid"


def test_every_query_parses_as_promql() -> None:
    queries = all_queries()
    assert len(queries) >= 25
    for name, q in queries:
        promql = dashboards.to_promql(q)
        try:
            dashboards.metric_names(promql)
        except ValueError as exc:
            pytest.fail(f"{name} {q.where}: {promql!r} does not parse: {exc}")


def test_the_parser_check_does_reject_broken_promql() -> None:
    with pytest.raises(ValueError):
        dashboards.metric_names('sum by (run (ppo_kl_mean{run=~".*"})')


def test_every_referenced_metric_is_in_the_catalog_or_the_watchdog_telemetry() -> None:
    known = dashboards.known_metric_names()
    for name, q in all_queries():
        unknown = dashboards.metric_names(dashboards.to_promql(q)) - known
        assert not unknown, f"{name} {q.where} references {sorted(unknown)}"


def test_an_unknown_metric_would_be_caught() -> None:
    names = dashboards.metric_names('rate(ppo_kl_meen{run=~".*"}[1m]) / on(run) up')
    assert names == {"ppo_kl_meen", "up"}
    assert names - dashboards.known_metric_names() == {"ppo_kl_meen"}


def test_ppo_run_dashboard_shows_the_seed_table_signals_with_threshold_lines() -> None:
    d = dashboards.ppo_run()
    panels = {p["title"]: p for p in d["panels"] if p["type"] != "row"}

    def metrics_of(title: str) -> set[str]:
        return {n for t in panels[title]["targets"] for n in dashboards.metric_names(dashboards.render(t["expr"]))}

    def thresholds_of(title: str) -> list[float]:
        steps = panels[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        return [s["value"] for s in steps if s["value"] is not None]

    kl = "KL to the reference (mean, std)"
    assert metrics_of(kl) == {catalog.BY_SHORT["kl"].prom, catalog.BY_SHORT["kl_std"].prom}
    assert thresholds_of(kl) == [0.05, 0.1]
    assert panels[kl]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"
    assert thresholds_of("Value loss") == [0.5]
    assert catalog.BY_SHORT["reward"].prom in metrics_of("Reward")
    for title, short in [("Policy loss", "pg_loss"), ("Entropy", "entropy"), ("Grad norm", "grad_norm"),
                         ("Learning rate", "lr"), ("KL coefficient", "kl_coef"), ("Throughput", "throughput"),
                         ("Step time", "step_time")]:
        assert catalog.BY_SHORT[short].prom in metrics_of(title), title
    checkpoints = panels["Checkpoints"]["targets"][0]["expr"]
    assert 'kind="checkpoint"' in checkpoints and "ppo_events_total" in checkpoints
    # the watchdog's actions: Grafana annotations by tag, and a Prometheus-derived fallback
    sources = {a["datasource"]["type"] for a in d["annotations"]["list"]}
    assert sources == {"grafana", "prometheus"}


def _timeseries(d: dict) -> list[dict]:
    return [p for p in dashboards._panels(d) if p["type"] == "timeseries"]


def test_no_line_is_drawn_across_a_gap_and_every_legend_says_last_and_max() -> None:
    for d in (dashboards.ppo_run(), dashboards.watchdog()):
        for p in _timeseries(d):
            assert p["fieldConfig"]["defaults"]["custom"]["spanNulls"] is False, p["title"]
            assert p["options"]["legend"]["calcs"] == ["lastNotNull", "max"], p["title"]
            assert p["options"]["legend"]["displayMode"] == "table", p["title"]


def test_the_action_annotations_are_those_of_the_selected_runs() -> None:
    (tags,) = [a for a in dashboards.ppo_run()["annotations"]["list"] if a["datasource"]["type"] == "grafana"]
    assert tags["target"]["tags"] == [dashboards.ACTION_TAG, "run:$run"] and tags["target"]["matchAny"] is False
    from ppo_watchdog.observe.grafana import action_annotation

    posted = action_annotation("r1", "kl_high", "set", "applied", step=3).tags
    assert dashboards.ACTION_TAG in posted and "run:r1" in posted  # what the query's run:$run matches


def test_every_signal_the_default_pack_reads_has_a_panel_on_the_ppo_run_dashboard() -> None:
    from ppo_watchdog.core.rulefile import default_rules_paths, load_rules

    used = {n for q in dashboards.queries(dashboards.ppo_run()) for n in dashboards.metric_names(dashboards.to_promql(q))}
    read = load_rules(default_rules_paths()).metrics
    assert read >= {"kl", "reward", "response_length", "aborted_ratio", "rollout_probs_diff", "response_clip_ratio"}
    missing = sorted(s for s in read if catalog.BY_SHORT[s].prom not in used)
    assert not missing, f"no panel for {missing}"


def test_units_and_axes_read_as_the_numbers_are() -> None:
    panels = {p["title"]: p for p in _timeseries(dashboards.ppo_run())}
    lr = panels["Learning rate"]["fieldConfig"]["defaults"]
    assert lr["unit"] == "sci" and lr["custom"]["scaleDistribution"] == {"type": "log", "log": 10}
    assert panels["KL coefficient"]["fieldConfig"]["defaults"]["unit"] == "sci"
    assert panels["Truncated share"]["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert panels["Rollout time"]["fieldConfig"]["defaults"]["unit"] == "s"


def test_threshold_lines_only_where_a_rule_of_the_pack_compares_with_an_absolute_level() -> None:
    from ppo_watchdog.core.rulefile import default_rules_paths, load_rules

    pack = load_rules(default_rules_paths())

    def source(rule: str) -> str:
        r = pack.get(rule)
        assert r is not None, rule
        return r.expr.source

    assert f"kl > {dashboards.KL_ACT}" in source("kl_high")
    assert f"avg(kl, 5) > {dashboards.KL_WARN}" in source("kl_above_target")
    assert f"min(vf_loss, 10) > {dashboards.VF_LOSS_TARGET}" in source("value_loss_high")
    assert source("rollout_mismatch") == f"rollout_probs_diff > {dashboards.MISMATCH_LINE}"
    assert {p.name: p.value for p in pack.params}["truncation_share"] == dashboards.TRUNCATION_LINE
    lines = {}
    for p in _timeseries(dashboards.ppo_run()):
        steps = ((p["fieldConfig"]["defaults"].get("thresholds") or {}).get("steps")) or []
        if [s for s in steps if s["value"] is not None]:
            lines[p["title"]] = [s["value"] for s in steps if s["value"] is not None]
    assert lines == {"KL to the reference (mean, std)": [dashboards.KL_WARN, dashboards.KL_ACT],
                     "Value loss": [dashboards.VF_LOSS_TARGET], "Rollout mismatch": [dashboards.MISMATCH_LINE],
                     "Truncated share": [dashboards.TRUNCATION_LINE]}


def test_watchdog_dashboard_covers_its_own_metrics() -> None:
    d = dashboards.watchdog()
    used = {n for q in dashboards.queries(d) for n in dashboards.metric_names(dashboards.to_promql(q))}
    for m in telemetry.METRICS:
        assert used & set(m.series()), f"{m.name} is on no panel"


def test_the_trainer_exporter_exposes_every_trainer_metric_the_dashboards_use() -> None:
    exp = MetricsExporter("run-x")
    exp.update(1, {m.key: 0.5 for m in catalog.METRICS})
    exp.count_event("checkpoint")
    from prometheus_client.parser import text_string_to_metric_families

    exposed = {s.name for f in text_string_to_metric_families(exp.exposition()) for s in f.samples}
    used = {n for _, q in all_queries() for n in dashboards.metric_names(dashboards.to_promql(q))}
    trainer_side = used - telemetry.series_names() - {"up"}
    assert trainer_side and trainer_side <= exposed, sorted(trainer_side - exposed)


# ---- every query returns data from a real Prometheus scraping a real run --------------------


@pytest.mark.slow
@pytest.mark.prometheus
def test_every_dashboard_query_returns_data_from_a_real_prometheus_scraping_a_real_run(
    tmp_path: Path, tiny_trainer_args, trainer_env,  # type: ignore[no-untyped-def]
) -> None:
    import math
    import subprocess
    import time
    import urllib.parse

    from ppo_watchdog.protocol.exporter import free_port

    # The watchdog side: its real metrics object, served, fed like the controller feeds it.
    wd = telemetry.WatchdogMetrics()
    wd_port = wd.serve(0)
    trainer_port = free_port()
    run_dir = tmp_path / "run"
    trainer = None
    try:
        with prometheus_server(tmp_path / "prom", {telemetry.WATCHDOG_JOB: [f"127.0.0.1:{wd_port}"]}) as prom:
            telemetry.write_file_sd(prom.sd_dir, "it", f"127.0.0.1:{trainer_port}")

            def tick(run: str, n: int) -> None:
                wd.runs_watched(1)
                wd.rule_state(run, "kl_high", "firing" if n % 4 == 3 else "inactive")
                wd.rule_state(run, "nan", "pending" if n % 5 == 4 else "inactive")
                wd.eval_seconds(0.001 * (1 + n % 7))
                for i, phase in enumerate(telemetry.TICK_PHASES):
                    wd.phase_time(phase, 0.001 * (1 + (n + i) % 5))
                wd.tick_phases_done()
                wd.data_age(run, 0.5 * (n % 3))
                wd.last_tick(time.time())
                wd.action(run, "kl_high", "set", "applied")
                wd.action(run, "kl_high", "rollback", "advised")
                wd.approvals_waiting(run, 1 + n % 2)
                wd.planned_relaunch(run, n % 4 == 1)
                if n % 3 == 0:
                    wd.escalation(run, "kl_high")
                    wd.error(run, "ingest")

            trainer = subprocess.Popen(
                tiny_trainer_args(run_dir, f"trainer.metrics_port={trainer_port}", "trainer.save_freq=2",
                                  "trainer.test_freq=10",
                                  # A pause near the end keeps the run alive for a few more 1 s scrapes, so
                                  # every counter has the two samples increase() needs even when the
                                  # machine is idle and the 30 steps take only a couple of seconds.
                                  "trainer.faults=hang@28:4", steps=30),
                env=trainer_env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "trainer.log", "w"),  # noqa: SIM115
            )
            wait_for(lambda: bool(RunInfo.read(run_dir).id), 60, "run.json", trainer)
            run = RunInfo.read(run_dir).id
            n = 0
            while trainer.poll() is None:
                tick(run, n)
                n += 1
                time.sleep(0.25)
            assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-2000:]
            assert n >= 8, "the run ended before Prometheus could scrape it a few times"

            # The trainer is gone now; evaluate at the last instant Prometheus scraped it.
            stamps = prom.query(f'max(timestamp(ppo_global_step{{run="{run}"}}))[300s:1s]')
            assert stamps, "Prometheus never scraped the trainer"
            at = max(float(v) for r in stamps for _, v in r["values"])

            failures = []
            verl_only = {catalog.BY_KEY[k].prom for k in catalog.VERL_ONLY_KEYS if k in catalog.BY_KEY}
            for name, query in all_queries():
                promql = dashboards.to_promql(query, run=run)
                result = prom.query(promql, at)
                if not result:
                    failures.append(f"{name} {query.where}: no data for {promql}")
                elif not any(math.isfinite(float(r["value"][1])) for r in result) and not (
                        dashboards.metric_names(promql) <= verl_only):
                    # (a gauge of a key only a real verl logs is there, NaN: its name is right; the tiny trainer
                    # never gives it a value)
                    failures.append(f"{name} {query.where}: only NaN for {promql}")
            assert not failures, "\n".join(failures)
            labels = get_json(f"{prom.url}/api/v1/label/run/values?"
                              + urllib.parse.urlencode({"match[]": "ppo_global_step"}))
            assert run in labels["data"]
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        wd.close()
