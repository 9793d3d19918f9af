"""Pushing dashboards and posting annotations, against a local server that speaks Grafana's documented API.

The server (http.server on 127.0.0.1, in the test) checks what Grafana checks: method, path,
the bearer token, the JSON content type and the body's fields and types, and answers as
Grafana does; anything else gets Grafana's error status, so a wrong request fails the test.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from ppo_watchdog.cli.dashboards import dashboards_app
from ppo_watchdog.observe import dashboards, grafana

TOKEN = "glsa_test-token-5f0c1e"  # never a real one; we check it leaks nowhere

# Body fields of Grafana's HTTP API (docs: "Dashboard API: Create / Update dashboard",
# "Annotations API: Create Annotation").
DASHBOARD_FIELDS = {"dashboard", "overwrite", "folderUid", "folderId", "message"}
ANNOTATION_FIELDS = {"time", "timeEnd", "tags", "text", "dashboardUID", "dashboardUid", "dashboardId", "panelId"}


@dataclass
class FakeGrafana:
    """What the server saw, and how it should answer."""

    token: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    fail_with: int | None = None
    url: str = ""


def _make_handler(state: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply(404, {"message": "Not found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            record = {"method": "POST", "path": self.path, "headers": dict(self.headers), "raw": raw}
            state.requests.append(record)
            if self.headers.get("Authorization") != f"Bearer {state.token}":
                return self._reply(401, {"message": "Unauthorized"})
            if not (self.headers.get("Content-Type") or "").startswith("application/json"):
                return self._reply(415, {"message": "Unsupported Media Type"})
            try:
                body = json.loads(raw)
            except ValueError:
                return self._reply(400, {"message": "bad request data"})
            record["body"] = body
            if state.fail_with:
                return self._reply(state.fail_with, {"message": "Internal Server Error"})
            if self.path == "/api/dashboards/db":
                problem = _check_dashboard(body)
                if problem:
                    return self._reply(400, {"message": problem})
                d = body["dashboard"]
                return self._reply(200, {"id": 1, "uid": d["uid"], "url": f"/d/{d['uid']}/x",
                                         "status": "success", "version": 1, "slug": "x"})
            if self.path == "/api/annotations":
                problem = _check_annotation(body)
                if problem:
                    return self._reply(400, {"message": problem})
                return self._reply(200, {"id": len(state.requests), "message": "Annotation added"})
            return self._reply(404, {"message": "Not found"})

    return Handler


def _check_dashboard(body: Any) -> str | None:
    if not isinstance(body, dict) or set(body) - DASHBOARD_FIELDS:
        return f"unexpected fields {sorted(set(body) - DASHBOARD_FIELDS)}"
    d = body.get("dashboard")
    if not isinstance(d, dict) or not d.get("title") or not d.get("uid"):
        return "dashboard must be an object with title and uid"
    if "id" in d and d["id"] is not None:
        return "id of an exported dashboard must not be sent (it belongs to another Grafana)"
    if not isinstance(body.get("overwrite"), bool):
        return "overwrite must be a boolean"
    if "folderUid" in body and not isinstance(body["folderUid"], str):
        return "folderUid must be a string"
    return None


def _check_annotation(body: Any) -> str | None:
    if not isinstance(body, dict) or set(body) - ANNOTATION_FIELDS:
        return f"unexpected fields {sorted(set(body) - ANNOTATION_FIELDS)}"
    if not isinstance(body.get("time"), int) or isinstance(body.get("time"), bool):
        return "time must be epoch milliseconds (integer)"
    if "timeEnd" in body and not isinstance(body["timeEnd"], int):
        return "timeEnd must be epoch milliseconds (integer)"
    if not isinstance(body.get("text"), str) or not body["text"]:
        return "text is required"
    tags = body.get("tags")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return "tags must be a list of strings"
    if any(v is None for v in body.values()):
        return "null fields"
    return None


@pytest.fixture
def fake_grafana() -> Iterator[FakeGrafana]:
    state = FakeGrafana(TOKEN)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def assert_no_token_anywhere(caplog: pytest.LogCaptureFixture, *texts: str) -> None:
    assert TOKEN not in caplog.text
    for t in texts:
        assert TOKEN not in t


def test_push_sends_each_dashboard_to_the_documented_endpoint_with_the_bearer_token(
    fake_grafana: FakeGrafana, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    client = grafana.Grafana(fake_grafana.url, grafana.GrafanaToken(TOKEN))
    uids = grafana.push_all(client, folder_uid="ppo")
    assert uids == [dashboards.PPO_RUN_UID, dashboards.WATCHDOG_UID]
    assert [r["path"] for r in fake_grafana.requests] == ["/api/dashboards/db"] * 2
    for req, build in zip(fake_grafana.requests, dashboards.DASHBOARDS.values(), strict=True):
        assert req["headers"]["Authorization"] == f"Bearer {TOKEN}"
        body = req["body"]
        assert body["overwrite"] is True and body["folderUid"] == "ppo"
        expected = build()
        expected.pop("id", None)
        assert body["dashboard"] == expected
    assert_no_token_anywhere(caplog, repr(client))


def test_a_wrong_token_is_refused_and_the_error_names_the_path_not_the_token(
    fake_grafana: FakeGrafana, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    client = grafana.Grafana(fake_grafana.url, grafana.GrafanaToken("glsa_wrong"))
    with pytest.raises(grafana.GrafanaError, match="/api/dashboards/db") as err:
        client.push_dashboard(dashboards.ppo_run())
    assert "glsa_wrong" not in str(err.value) and "glsa_wrong" not in caplog.text


def test_action_annotation_has_the_documented_body(fake_grafana: FakeGrafana) -> None:
    client = grafana.Grafana(fake_grafana.url, grafana.GrafanaToken(TOKEN))
    annotate = grafana.ActionAnnotator(client, dashboard_uid=dashboards.PPO_RUN_UID)
    ok = annotate("run-7", "kl_high", "set", "applied", step=42, message="kl_coef 0.001 -> 0.0012",
                  ts=1_700_000_000.25)
    assert ok is True and annotate.failures == 0
    (req,) = fake_grafana.requests
    assert req["path"] == "/api/annotations"
    assert req["headers"]["Authorization"] == f"Bearer {TOKEN}"
    body = req["body"]
    assert body["time"] == 1_700_000_000_250
    assert "timeEnd" not in body  # optional fields are left out, not sent as null
    assert body["dashboardUID"] == dashboards.PPO_RUN_UID
    assert body["text"] == "watchdog: kl_high -> set (applied) at step 42 on run run-7: kl_coef 0.001 -> 0.0012"
    # the "PPO run" dashboard's annotation query selects on this tag
    assert dashboards.ACTION_TAG in body["tags"] and "run:run-7" in body["tags"] and "rule:kl_high" in body["tags"]
    ppo = dashboards.ppo_run()
    selected = [a["target"]["tags"] for a in ppo["annotations"]["list"] if a.get("target")]
    assert [dashboards.ACTION_TAG, "run:$run"] in selected  # the dashboard shows the selected runs' actions


def test_region_annotation_carries_time_end(fake_grafana: FakeGrafana) -> None:
    client = grafana.Grafana(fake_grafana.url, grafana.GrafanaToken(TOKEN))
    ann = grafana.Annotation(1000, "rollback 40 -> 30", ("watchdog-action",), time_end_ms=5000)
    client.annotate(ann)
    assert fake_grafana.requests[0]["body"] == {
        "time": 1000, "timeEnd": 5000, "tags": ["watchdog-action"], "text": "rollback 40 -> 30",
    }


def test_annotator_logs_and_counts_a_refusal_instead_of_raising(
    fake_grafana: FakeGrafana, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    fake_grafana.fail_with = 500
    annotate = grafana.ActionAnnotator(grafana.Grafana(fake_grafana.url, grafana.GrafanaToken(TOKEN)))
    assert annotate("r", "nan", "rollback", "applied", step=3) is False
    assert annotate.failures == 1
    assert "could not annotate" in caplog.text
    assert_no_token_anywhere(caplog)


def test_annotator_survives_grafana_being_down(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    annotate = grafana.ActionAnnotator(grafana.Grafana(f"http://127.0.0.1:{port}", grafana.GrafanaToken(TOKEN),
                                                       timeout=2))
    assert annotate("r", "oom", "restart", "applied") is False
    assert_no_token_anywhere(caplog)


def test_push_command_reads_the_token_from_a_file_and_never_prints_it(
    fake_grafana: FakeGrafana, tmp_path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    result = CliRunner().invoke(
        dashboards_app, ["push", "--url", fake_grafana.url, "--token-file", str(token_file)],
        env={"GRAFANA_TOKEN": "", "GRAFANA_TOKEN_FILE": ""},
    )
    assert result.exit_code == 0, result.output
    assert f"pushed {dashboards.PPO_RUN_UID}" in result.output
    assert len(fake_grafana.requests) == 2
    assert_no_token_anywhere(caplog, result.output)


def test_push_command_takes_the_token_from_the_environment(fake_grafana: FakeGrafana) -> None:
    result = CliRunner().invoke(dashboards_app, ["push", "--url", fake_grafana.url],
                                env={"GRAFANA_TOKEN": TOKEN, "GRAFANA_TOKEN_FILE": ""})
    assert result.exit_code == 0, result.output
    assert all(r["headers"]["Authorization"] == f"Bearer {TOKEN}" for r in fake_grafana.requests)
    assert TOKEN not in result.output


def test_push_command_without_a_token_exits_2_and_sends_nothing(fake_grafana: FakeGrafana) -> None:
    result = CliRunner().invoke(dashboards_app, ["push", "--url", fake_grafana.url],
                                env={"GRAFANA_TOKEN": None, "GRAFANA_TOKEN_FILE": None})
    assert result.exit_code == 2
    assert "no Grafana token" in result.output
    assert fake_grafana.requests == []


def test_push_command_reports_a_refusal_with_exit_2(fake_grafana: FakeGrafana) -> None:
    result = CliRunner().invoke(dashboards_app, ["push", "--url", fake_grafana.url],
                                env={"GRAFANA_TOKEN": "glsa_wrong", "GRAFANA_TOKEN_FILE": None})
    assert result.exit_code == 2  # a wrong token is a setting to fix (bad input)
    assert "401" in result.output or "Unauthorized" in result.output
    assert "glsa_wrong" not in result.output


def test_token_loading_prefers_the_file_and_rejects_an_empty_token_file(tmp_path) -> None:
    f = tmp_path / "t"
    f.write_text("from-file\n")
    assert grafana.load_token(f, env={"GRAFANA_TOKEN": "from-env"}).reveal() == "from-file"
    assert grafana.load_token(None, env={"GRAFANA_TOKEN_FILE": str(f)}).reveal() == "from-file"
    assert grafana.load_token(None, env={"GRAFANA_TOKEN": "from-env"}).reveal() == "from-env"
    assert grafana.load_token(None, env={}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(grafana.TokenError, match="empty"):
        grafana.load_token(tmp_path / "empty", env={})
    with pytest.raises(grafana.TokenError, match="missing"):
        grafana.load_token(tmp_path / "missing", env={})
    assert grafana.load_token(None, env={"GRAFANA_TOKEN": "  "}) is None  # compose's ${GRAFANA_TOKEN:-}


def test_a_token_never_shows_in_repr_or_str() -> None:
    t = grafana.GrafanaToken(TOKEN)
    assert TOKEN not in repr(t) and TOKEN not in str(t) and TOKEN not in f"{t}"
    assert TOKEN not in repr([t, {"token": t}])


def test_urls_are_logged_without_credentials() -> None:
    assert grafana.redact_url("http://admin:s3cret@127.0.0.1:3000/grafana") == "http://127.0.0.1:3000/grafana"
    assert grafana.redact_url("http://127.0.0.1:3000") == "http://127.0.0.1:3000"
    assert "s3cret" not in repr(grafana.Grafana("http://admin:s3cret@127.0.0.1:3000"))


def test_background_annotator_posts_queued_actions_in_order(fake_grafana: FakeGrafana) -> None:
    annotate = grafana.ActionAnnotator(grafana.Grafana(fake_grafana.url, grafana.GrafanaToken(TOKEN)),
                                       background=True, clock=lambda: 1_700_000_000.0)
    for step in (10, 11, 12):
        assert annotate("r", "kl_high", "set", "applied", step=step) is True
    annotate.close()
    assert annotate.posted == 3 and annotate.failures == 0
    assert [r["body"]["text"].split(" at step ")[1][:2] for r in fake_grafana.requests] == ["10", "11", "12"]
    assert all(r["body"]["time"] == 1_700_000_000_000 for r in fake_grafana.requests)


def test_annotator_hooks_onto_the_actuators_on_action_signature(fake_grafana: FakeGrafana) -> None:
    # Actuator(on_action=...) calls on_action(run, rule, kind, outcome, step, said): the action in words
    from ppo_watchdog.control.actuator import Actuator

    annotate = grafana.annotator_from_env(fake_grafana.url, env={"GRAFANA_TOKEN": TOKEN}, background=False)
    assert annotate is not None
    import inspect

    hook = inspect.signature(Actuator.__init__).parameters["on_action"]
    assert "OnAction" in str(hook.annotation)
    annotate("run-1", "oom", "restart", "ok", 31, "relaunched from step 30 with ppo_micro_batch_size_per_gpu 8 -> 4")
    (req,) = fake_grafana.requests
    assert "rule:oom" in req["body"]["tags"] and "action:restart" in req["body"]["tags"]
    assert req["body"]["text"].endswith("at step 31 on run run-1: relaunched from step 30 with "
                                        "ppo_micro_batch_size_per_gpu 8 -> 4")


def test_no_grafana_url_means_no_annotator() -> None:
    assert grafana.annotator_from_env(None, env={"GRAFANA_TOKEN": TOKEN}) is None


def test_the_watchdog_annotates_each_action_on_the_ppo_run_dashboard_without_waiting_for_grafana(
    fake_grafana: FakeGrafana, tmp_path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ppo_watchdog.control.daemon import build_watchdog
    from ppo_watchdog.protocol import rundir
    from ppo_watchdog.protocol.control import ControlApplier

    monkeypatch.setenv(grafana.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(grafana.TOKEN_FILE_ENV, raising=False)
    # The same server, answering only when the test lets it: a tick that waited for Grafana would hang.
    gate = threading.Event()

    class Gated(_make_handler(fake_grafana)):  # type: ignore[misc]
        def do_POST(self) -> None:
            gate.wait(30)
            super().do_POST()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gated)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n  - name: kl_high\n    description: d\n    expr: kl > 0.1\n"
                     "    actions:\n      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 2.0}\n")
    run_dir = tmp_path / "ext"
    run_dir.mkdir()
    rundir.append_metrics(run_dir, 1, {"actor/reward_kl_penalty": 0.5, "actor/reward_kl_penalty_coeff": 0.001})
    wd = build_watchdog(tmp_path / "state", [rules], grafana_url=f"http://127.0.0.1:{server.server_address[1]}")
    try:
        wd.add_run(run_dir, managed=False)
        wd.tick()  # kl_high fires: control.json v1
        applier = ControlApplier(run_dir)  # the trainer's side: apply at its next step boundary
        changes = applier.poll(2)
        assert changes is not None
        applier.mark_applied(changes, 2, changes.changed)
        wd.tick()  # the applied event confirms the live set: the action's outcome
        (decision,) = wd.store.decisions("ext")
        assert decision["status"] == "applied"
        assert fake_grafana.requests == []  # the tick is over while Grafana has not answered
    finally:
        gate.set()
        wd.close()
        server.shutdown()
        server.server_close()
    (req,) = fake_grafana.requests
    body = req["body"]
    assert req["path"] == "/api/annotations" and body["dashboardUID"] == dashboards.PPO_RUN_UID
    assert {dashboards.ACTION_TAG, "run:ext", "rule:kl_high", "action:live_set"} <= set(body["tags"])
    assert wd.annotator.posted == 1
    # The telemetry counter still counts the same action (both hooks see it).
    assert wd.telemetry.registry.get_sample_value(
        "watchdog_actions_total", {"run": "ext", "rule": "kl_high", "kind": "live_set", "outcome": "ok"}) == 1


def test_a_named_but_unreadable_grafana_token_file_is_a_config_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_watchdog.control.daemon import DaemonConfigError, build_watchdog

    monkeypatch.setenv(grafana.TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(DaemonConfigError, match="missing"):
        build_watchdog(tmp_path / "state", grafana_url="http://127.0.0.1:3000")


def test_the_command_line_imports_the_dashboard_builders_only_to_build_dashboards() -> None:
    # A daemon's every process runs the command line: the builders (grafana_foundation_sdk, about 3 MiB a
    # process) are for `dashboards export|push` and a daemon that annotates a Grafana.
    import subprocess
    import sys

    probe = ("import sys, ppo_watchdog.cli, ppo_watchdog.control.daemon; print('grafana_foundation_sdk' in sys.modules); "
             "from ppo_watchdog.cli.dashboards import export; print('grafana_foundation_sdk' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"]
    annotation = grafana.action_annotation("r", "kl_high", "live_set", "ok", ts=0.0)
    assert dashboards.ACTION_TAG in annotation.tags  # (imported where it is used)
