"""deploy/: every file parses, and every checker that runs here passes on it.

promtool (check config, check rules, test rules, check metrics), amtool, kustomize and
systemd-analyze run where installed; a missing one skips its test with the reason.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppo_watchdog.observe import dashboards, telemetry
from ppo_watchdog.protocol import catalog
from ppo_watchdog.protocol.exporter import MetricsExporter

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (make test installs Debian's prometheus; amtool: prometheus-alertmanager)")
    return path


def run(args: list[str], cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=60)


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_every_yaml_file_under_deploy_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        docs = list(yaml.safe_load_all(f.read_text()))
        assert docs and all(d is not None for d in docs), f


# ---- Prometheus ---------------------------------------------------------------------------


def test_promtool_accepts_the_prometheus_config() -> None:
    result = run([tool("promtool"), "check", "config", "prometheus.yml"], cwd=PROM)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_promtool_accepts_the_alert_rules() -> None:
    result = run([tool("promtool"), "check", "rules", "alerts.yml"], cwd=PROM)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rule_unit_tests_pass() -> None:
    result = run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=PROM)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_rule_unit_tests_can_fail(tmp_path: Path) -> None:
    # the same tests with one expectation flipped must fail: promtool really compares
    shutil.copy(PROM / "alerts.yml", tmp_path / "alerts.yml")
    text = (PROM / "alerts_test.yml").read_text()
    assert "summary: \"Trainer /metrics at 127.0.0.1:9400 is down\"" in text
    (tmp_path / "alerts_test.yml").write_text(text.replace("at 127.0.0.1:9400 is down", "at elsewhere is down"))
    result = run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=tmp_path)
    assert result.returncode != 0 and "PPOTrainerDown" in result.stdout + result.stderr


def test_every_alert_exists_and_is_unit_tested() -> None:
    alerts = {r["alert"] for g in load(PROM / "alerts.yml")["groups"] for r in g["rules"]}
    assert {"PPOWatchdogEscalated", "PPOTrainerDown", "PPOTrainerMetricsStale", "PPOWatchdogDataStale",
            "PPOWatchdogDown", "PPOWatchdogNotTicking"} <= alerts
    tested = {c["alertname"] for t in load(PROM / "alerts_test.yml")["tests"] for c in t.get("alert_rule_test", [])}
    assert alerts == tested
    fired = {c["alertname"] for t in load(PROM / "alerts_test.yml")["tests"]
             for c in t.get("alert_rule_test", []) if c.get("exp_alerts")}
    assert fired == alerts, "every alert needs a case where it fires"


def test_alert_rules_reference_only_known_metrics() -> None:
    known = dashboards.known_metric_names()
    for group in load(PROM / "alerts.yml")["groups"]:
        for rule in group["rules"]:
            unknown = dashboards.metric_names(rule["expr"]) - known
            assert not unknown, f"{rule['alert']}: {sorted(unknown)}"
            assert rule["labels"]["severity"] in {"page", "warning"}
            assert rule["annotations"]["summary"]


def test_every_alert_has_a_summary_and_a_runbook_url_to_an_anchor_the_readme_has() -> None:
    readme = (ROOT / "README.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", readme, re.M)}
    for group in load(PROM / "alerts.yml")["groups"]:
        for rule in group["rules"]:
            page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
            assert page == "README.md" and anchor in anchors, rule["alert"]
            assert f"`{rule['alert']}`" in readme.split("### Alerts: what to do")[1].split("\n## ")[0], rule["alert"]
            assert rule["annotations"]["summary"].strip(), rule["alert"]


def test_the_trainer_down_alert_keeps_quiet_through_the_watchdogs_own_relaunch_of_that_run() -> None:
    (rule,) = [r for g in load(PROM / "alerts.yml")["groups"] for r in g["rules"] if r["alert"] == "PPOTrainerDown"]
    assert "unless on(run)" in rule["expr"] and telemetry.PLANNED_RELAUNCH.name in rule["expr"]


def test_scrape_config_has_trainer_file_sd_and_watchdog_jobs() -> None:
    cfg = load(PROM / "prometheus.yml")
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {telemetry.TRAINER_JOB, telemetry.WATCHDOG_JOB}
    trainer = jobs[telemetry.TRAINER_JOB]
    # the exporter's own `run` label must win over any target label
    assert trainer["honor_labels"] is True
    (sd,) = trainer["file_sd_configs"]
    matched = [p for pattern in sd["files"] for p in PROM.glob(pattern)]
    assert matched, "the example file_sd target must match the pattern"
    for path in matched:
        groups = json.loads(path.read_text())
        assert all(":" in t for g in groups for t in g["targets"])
    # the alerts' job selectors are the scrape jobs
    exprs = " ".join(r["expr"] for g in load(PROM / "alerts.yml")["groups"] for r in g["rules"])
    assert f'job="{telemetry.TRAINER_JOB}"' in exprs and f'job="{telemetry.WATCHDOG_JOB}"' in exprs


def test_file_sd_targets_written_by_telemetry_are_valid_for_prometheus(tmp_path: Path) -> None:
    promtool = tool("promtool")
    sd = tmp_path / "targets"
    telemetry.write_file_sd(sd, "run-1", "127.0.0.1:9400", {"run_dir": "/srv/runs/run-1"})
    cfg = load(PROM / "prometheus.yml")
    cfg.pop("rule_files")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    result = run([promtool, "check", "config", "prometheus.yml"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_trainer_exporter_output_passes_promtool_check_metrics() -> None:
    promtool = tool("promtool")
    exp = MetricsExporter("run-x")
    exp.update(3, {m.key: 0.25 for m in catalog.METRICS})
    for kind in ("checkpoint", "oom", "applied"):
        exp.count_event(kind)
    result = run([promtool, "check", "metrics"], stdin=exp.exposition())
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip() == ""


def test_watchdog_exposition_passes_promtool_check_metrics() -> None:
    from prometheus_client import generate_latest

    promtool = tool("promtool")
    m = telemetry.WatchdogMetrics()
    m.rule_state("r", "kl_high", "firing")
    m.action("r", "kl_high", "set", "applied")
    m.eval_seconds(0.01)
    result = run([promtool, "check", "metrics"], stdin=generate_latest(m.registry).decode())
    assert result.returncode == 0, result.stdout + result.stderr


# ---- Alertmanager -------------------------------------------------------------------------


def test_alertmanager_routes_pages_and_warnings_to_existing_receivers() -> None:
    cfg = load(DEPLOY / "alertmanager" / "alertmanager.yml")
    receivers = {r["name"] for r in cfg["receivers"]}
    routes = [cfg["route"], *cfg["route"]["routes"]]
    assert all(r["receiver"] in receivers for r in routes)
    severities = {m for r in cfg["route"]["routes"] for m in r["matchers"]}
    assert severities == {'severity="page"', 'severity="warning"'}
    assert "run" in cfg["route"]["group_by"]


def test_amtool_accepts_the_alertmanager_config_and_routes_pages_to_oncall() -> None:
    amtool = tool("amtool")
    cfg = DEPLOY / "alertmanager" / "alertmanager.yml"
    result = run([amtool, "check-config", str(cfg)])
    assert result.returncode == 0, result.stdout + result.stderr
    routed = run([amtool, "config", "routes", "test", f"--config.file={cfg}", "severity=page", "alertname=PPOTrainerDown"])
    assert routed.stdout.strip() == "ml-oncall", routed.stdout + routed.stderr


# ---- Grafana provisioning -----------------------------------------------------------------


def test_grafana_provisioning_points_at_prometheus_and_the_mounted_dashboards() -> None:
    ds = load(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http://127.0.0.1:9090")
    prov = load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "ppo-watchdog.yml")
    (provider,) = prov["providers"]
    path = provider["options"]["path"]
    compose = load(DEPLOY / "docker-compose.yml")
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"../dashboards:{path}:ro" in mounts


# ---- docker compose -----------------------------------------------------------------------


def test_compose_has_the_whole_stack_with_existing_files_and_loopback_servers() -> None:
    compose = load(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"prometheus", "alertmanager", "grafana", "watchdog", "trainer"}
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: {src} does not exist"
    build = services["watchdog"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    assert "--web.listen-address=127.0.0.1:9093" in services["alertmanager"]["command"]
    assert services["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    # secrets come from the environment of `docker compose`, never as literals in the file
    assert services["watchdog"]["environment"]["GRAFANA_TOKEN"] == "${GRAFANA_TOKEN:-}"
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert services["watchdog"]["environment"]["GRAFANA_URL"] == "http://127.0.0.1:3000"
    # the trainer serves /metrics where file_sd's example target points
    trainer_port = next(a.split("=")[1] for a in services["trainer"]["command"] if a.startswith("trainer.metrics_port="))
    targets = json.loads((PROM / "targets" / "example.json").read_text())
    assert targets[0]["targets"] == [f"127.0.0.1:{trainer_port}"]


def test_daemon_config_is_valid_and_serves_metrics_where_prometheus_scrapes_the_watchdog() -> None:
    from ppo_watchdog.control.daemon import load_daemon_config

    daemon = load_daemon_config(DEPLOY / "watchdog" / "daemon.yaml")  # the daemon's own parser
    cfg = load(PROM / "prometheus.yml")
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == telemetry.WATCHDOG_JOB)
    assert job["static_configs"][0]["targets"] == [f"{daemon.metrics_addr}:{daemon.metrics_port}"]
    # the on-call receiver of alertmanager.yml gets the daemon's escalation webhooks too
    am = load(DEPLOY / "alertmanager" / "alertmanager.yml")
    oncall = next(r for r in am["receivers"] if r["name"] == "ml-oncall")
    assert daemon.webhook_url == oncall["webhook_configs"][0]["url"]


def test_k8s_daemon_config_is_valid_and_matches_the_service_port(tmp_path: Path) -> None:
    from ppo_watchdog.control.daemon import load_daemon_config

    cm = next(d for d in k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ppo-watchdog-config")
    (tmp_path / "daemon.yaml").write_text(cm["data"]["daemon.yaml"])
    daemon = load_daemon_config(tmp_path / "daemon.yaml")
    svc = next(d for d in k8s_docs() if d["kind"] == "Service" and d["metadata"]["name"] == "ppo-watchdog")
    deploy = next(d for d in k8s_docs() if d["kind"] == "Deployment")
    ports = {p["name"]: p["containerPort"] for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports[svc["spec"]["ports"][0]["targetPort"]] == daemon.metrics_port
    assert daemon.metrics_addr == "0.0.0.0"  # inside a pod, loopback is unreachable for the Service


# ---- Kubernetes ---------------------------------------------------------------------------


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if f.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def test_k8s_manifests_have_the_expected_kinds_and_wiring() -> None:
    docs = k8s_docs()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), d
        by_kind.setdefault(d["kind"], []).append(d)
    assert {"Deployment", "ConfigMap", "Service", "ServiceMonitor", "PrometheusRule"} <= set(by_kind)
    (deploy,) = by_kind["Deployment"]
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    svc = services["ppo-watchdog"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    monitor = next(m for m in by_kind["ServiceMonitor"] if m["metadata"]["name"] == "ppo-watchdog")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    # config maps the pod mounts exist here, except the rule pack, made from rules/ (documented)
    configmaps = {c["metadata"]["name"] for c in by_kind["ConfigMap"]}
    mounted = {v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v}
    assert mounted - configmaps == {"ppo-watchdog-rules"}
    assert "create configmap ppo-watchdog-rules --from-file=rules/" in (DEPLOY / "k8s" / "watchdog.yaml").read_text()
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert deploy["spec"]["replicas"] == 1


def test_k8s_alert_rules_are_generated_from_the_prometheus_rule_file() -> None:
    spec = importlib.util.spec_from_file_location("gen_alerts", DEPLOY / "k8s" / "gen_alerts.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    source = (PROM / "alerts.yml").read_text()
    assert (DEPLOY / "k8s" / "alerts.yaml").read_text() == gen.render(source), (
        "deploy/k8s/alerts.yaml is stale: run `python deploy/k8s/gen_alerts.py`"
    )
    rule, cm = yaml.safe_load_all(gen.render(source))
    assert rule["spec"]["groups"] == yaml.safe_load(source)["groups"]
    assert cm["data"]["alerts.yml"] == source


def test_kustomize_builds_the_k8s_directory() -> None:
    kubectl = tool("kubectl")
    result = run([kubectl, "kustomize", str(DEPLOY / "k8s")])
    if result.returncode != 0 and "unknown command" in result.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert "Namespace" in kinds and "Deployment" in kinds


# ---- systemd, Ray -------------------------------------------------------------------------


def test_systemd_unit_runs_the_daemon_hardened() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "systemd" / "ppo-watchdog.service").read_text())
    svc = unit["Service"]
    assert svc["ExecStart"].split()[1:] == ["daemon", "--config", "/etc/ppo-watchdog/daemon.yaml"]
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["User"] != "root"
    assert "GRAFANA_TOKEN=" not in (DEPLOY / "systemd" / "ppo-watchdog.service").read_text()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_analyze_finds_nothing_but_the_uninstalled_binary(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze")
    unit = tmp_path / "ppo-watchdog.service"
    shutil.copy(DEPLOY / "systemd" / "ppo-watchdog.service", unit)
    result = run([analyze, "verify", str(unit)])
    problems = [ln for ln in (result.stdout + result.stderr).splitlines()
                if ln.strip() and "is not executable" not in ln]
    assert problems == []
    # and it does report a mistyped key (the check can fail)
    unit.write_text(unit.read_text().replace("ProtectHome=", "ProtectHom="))
    bad = run([analyze, "verify", str(unit)])
    assert "ProtectHom" in bad.stdout + bad.stderr


def test_ray_job_example_builds_the_trainer_entrypoint() -> None:
    spec = importlib.util.spec_from_file_location("submit_job", DEPLOY / "ray" / "submit_job.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cmd = mod.entrypoint("/srv/runs/a b", 9400, ["algorithm.kl_ctrl.kl_coef=0.001"])
    assert cmd == ("python -m ppo_watchdog.trainer 'trainer.run_dir=/srv/runs/a b' trainer.metrics_port=9400 "
                   "trainer.progress=false algorithm.kl_ctrl.kl_coef=0.001")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
