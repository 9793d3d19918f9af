"""Paper cuts a user or a reader trips over (issue 24): each test failed on the main of its day.

Causes shown where the user looks, one exit-code convention (0 ok, 1 the judged thing failed,
2 bad input or usage), foreign control versions reported, evidence before thresholds.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_watchdog.cli import app
from ppo_watchdog.control.actuator import Notifier, alert_payload, resolve_webhook_url
from ppo_watchdog.control.daemon import build_watchdog
from ppo_watchdog.control.store import Phase, RunRecord, Store
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import Control, ControlApplier, write_control

REPO = Path(__file__).resolve().parents[1]
KL = "actor/reward_kl_penalty"
RULE_FOREIGN_CONTROL = "watchdog:foreign_control"  # ppo_watchdog.control.controller.RULE_FOREIGN_CONTROL


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ppo_watchdog", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _steps(run: Path, values: list[float], start: int = 1) -> None:
    for i, v in enumerate(values, start=start):
        rundir.append_metrics(run, i, {KL: v, "critic/score/mean": 0.5})


def _rules(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text("version: 1\nrules:\n" + textwrap.indent(textwrap.dedent(body), "  "))
    return path


# -- 1. a trainer's configuration refusal is not a crash -----------------------------------------


@pytest.mark.parametrize(("option", "cause"), [
    (["--faults", "bogus@x"], "trainer.faults item 1 'bogus@x': expected kind@step[:arg]"),
    (["--set", "trainer.total_training_steps=nan"], "trainer.total_training_steps"),
])
def test_a_config_the_trainer_refuses_is_said_on_the_console_and_in_history_given_up_at_once_exit_2(
        tmp_path: Path, option: list[str], cause: str) -> None:
    state = tmp_path / "state"
    proc = _cli("run", "--run-dir", str(tmp_path / "run"), "--state-dir", str(state), "--tick", "0.2",
                "--no-report", *option)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert cause in " ".join(out.split()), out  # the trainer's own line, on the console (rich may wrap it)
    (run,) = Store(state).list_runs()
    assert run.phase == Phase.FAILED and run.restarts == 0 and run.exit_code == rundir.EXIT_USAGE
    history = _cli("history", "--json", "--state-dir", str(state))
    (decision,) = json.loads(history.stdout)
    assert decision["rule"] == "watchdog:config" and cause in decision["inputs"]["error"]
    table = _cli("history", "--state-dir", str(state))
    assert cause.split(":")[0] in " ".join(table.stdout.split())


# -- 2. one exit-code convention ------------------------------------------------------------------

BROKEN_RULES = "version: 1\nrules:\n  - name: x\n    expr: kl >\n    actions: [notify]\n"


@pytest.fixture
def state_with_runs(tmp_path: Path) -> Path:
    """A state with one finished run (with metrics) and one paused run."""
    state = tmp_path / "state"
    store = Store(state)
    for rid, phase in (("done", Phase.FINISHED), ("held", Phase.PAUSED)):
        run_dir = tmp_path / rid
        run_dir.mkdir()
        _steps(run_dir, [0.01, 0.02])
        store.upsert_run(RunRecord(rid, str(run_dir), ["python", "-m", "ppo_watchdog.trainer"], phase=phase))
    store.close()
    return state


def _case(tmp_path: Path, state: Path, name: str) -> tuple[list[str], int]:
    """The argv of one command in one situation and the exit code the convention gives it."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN_RULES)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    s = ["--state-dir", str(state)]
    cases: dict[str, tuple[list[str], int]] = {
        "rules list of a bad file": (["rules", "list", str(bad)], 2),
        "rules check of a bad file": (["rules", "check", str(bad)], 2),
        "rules check of the default pack": (["rules", "check", str(REPO / "rules" / "default.yaml")], 0),
        "rules test of no such file": (["rules", "test", str(tmp_path / "nosuch.yaml")], 2),
        "rules explain of no such rule": (["rules", "explain", "nosuch"], 2),
        "rules calibrate of no such log": (["rules", "calibrate", str(tmp_path / "nosuch.log")], 2),
        "replay of no such log": (["replay", str(tmp_path / "nosuch.log")], 2),
        "eval of no such labels file": (["eval", str(tmp_path / "labels.yaml")], 2),
        "run with a bad option": (["run", "--tick", "0", "--run-dir", str(tmp_path / "r")], 2),
        "status of a state dir that is not there": (["status", "--state-dir", str(tmp_path / "nonexistent" / "x")], 2),
        "status of no such run": (["status", "nosuch", *s], 2),
        "status of all runs": (["status", *s], 0),
        "history of no such run": (["history", "nosuch", *s], 2),
        "history of a run": (["history", "done", *s], 0),
        "resume of no such run": (["resume", "nosuch", *s], 2),
        "resume of a finished run": (["resume", "done", *s], 2),
        "resume of a paused run": (["resume", "held", *s], 0),
        "report of no such run": (["report", "nosuch", "--out", str(tmp_path / "r.html"), *s], 2),
        "report as .txt": (["report", "done", "--out", str(tmp_path / "r.txt"), *s], 2),
        "dashboards export into a file": (["dashboards", "export", str(a_file / "sub")], 2),
    }
    return cases[name]


@pytest.mark.parametrize("name", [
    "rules list of a bad file", "rules check of a bad file", "rules check of the default pack",
    "rules test of no such file", "rules explain of no such rule", "rules calibrate of no such log",
    "replay of no such log", "eval of no such labels file", "run with a bad option",
    "status of a state dir that is not there", "status of no such run", "status of all runs",
    "history of no such run", "history of a run", "resume of no such run", "resume of a finished run",
    "resume of a paused run", "report of no such run", "report as .txt", "dashboards export into a file",
])
def test_every_command_exits_0_ok_1_judged_failed_2_bad_input(tmp_path: Path, state_with_runs: Path,
                                                              name: str) -> None:
    argv, code = _case(tmp_path, state_with_runs, name)
    r = CliRunner().invoke(app, argv, env={"WATCHDOG_RULES": None})
    assert r.exit_code == code, f"{name}: exit {r.exit_code}\n{r.output}"
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)  # no traceback


def test_a_daemon_config_with_no_runs_is_refused_with_exit_2_not_run_watching_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nruns: []\n")
    proc = _cli("daemon", "--config", str(cfg), timeout=60)  # a daemon watching nothing would never return
    assert proc.returncode == 2 and f"{cfg}: no runs to watch" in " ".join((proc.stdout + proc.stderr).split())


def test_resume_of_a_finished_run_is_refused_and_queues_nothing(state_with_runs: Path) -> None:
    r = CliRunner().invoke(app, ["resume", "done", "--state-dir", str(state_with_runs)])
    assert r.exit_code == 2 and "finished" in r.output and "nothing to resume" in r.output
    assert Store(state_with_runs, create=False).journal("done") == []


def test_rules_test_exits_1_when_a_rule_test_fails(tmp_path: Path) -> None:
    pack = _rules(tmp_path, """\
        - name: kl_over
          description: KL over 0.1
          expr: kl > 0.1
          actions: [notify]
        """)
    t = tmp_path / "t.yaml"
    t.write_text(f"rule_files: [{pack}]\ntests:\n  - name: t\n    input_series:\n      kl: '0.02x3'\n"
                 "    expect:\n      - {step: 2, rule: kl_over, kind: fire}\n")
    r = CliRunner().invoke(app, ["rules", "test", str(t)])
    assert r.exit_code == 1 and "FAIL" in r.output, r.output


def test_the_readme_states_the_exit_code_convention() -> None:
    text = " ".join((REPO / "README.md").read_text().split())
    assert "## Exit codes" in (REPO / "README.md").read_text()
    assert "0 ok" in text and "1 the judged thing failed" in text and "2 bad input or usage" in text


# -- 3. calibrate with no usable records ----------------------------------------------------------


def test_calibrate_with_no_usable_records_names_the_file_and_its_skipped_lines_and_writes_nothing(
        tmp_path: Path) -> None:
    log = tmp_path / "junk.jsonl"
    log.write_text('banner\n{"step": "x", "data": {}}\nnot json\n')
    out = tmp_path / "family.yaml"
    r = CliRunner().invoke(app, ["rules", "calibrate", str(log), "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert f"{log}:2: 'step' must be an integer" in r.output and f"{log}:1:" in r.output
    assert "overlay.yaml" not in r.output and "tmp" not in r.output.replace(str(tmp_path), "")
    assert not out.exists()


# -- 4. replay decides a format from the lines that parse ---------------------------------------


def test_replay_reads_a_jsonl_whose_first_line_is_garbage_and_names_that_line(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    lines = ["garbage from a banner"] + [json.dumps({"step": i, "data": {KL: 0.01 * i}}) for i in range(1, 6)]
    log.write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(app, ["replay", str(log), "--json"])
    assert r.exit_code == 0, r.output
    assert f"{log}:1: not JSON" in r.stderr
    from ppo_watchdog.sources import ingest

    res = ingest.read_run(log)
    assert res.format == "jsonl" and [x["step"] for x in res.records] == [1, 2, 3, 4, 5]


# -- 5. events outside the run, events of unknown kinds -------------------------------------------

NAN_EVENT_RULE = """\
- name: nan_event
  description: a nan event
  expr: event("nan") > 0
  actions: [notify]
  severity: critical
"""


def test_a_nan_event_past_the_runs_end_and_an_unknown_kind_are_said_and_never_acted_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _steps(run, [0.01] * 5)
    with open(run / rundir.EVENTS, "a") as f:
        f.write(json.dumps({"ts": 1.0, "step": 2, "kind": "explosion"}) + "\n")
        f.write(json.dumps({"ts": 2.0, "step": 999, "kind": "nan"}) + "\n")
    rules = _rules(tmp_path, NAN_EVENT_RULE)
    r = CliRunner().invoke(app, ["replay", str(run), "--rules", str(rules), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == []  # nothing fired
    events = run / rundir.EVENTS
    assert f"{events}:1: unknown event kind 'explosion'" in r.stderr
    assert f"{events}:2: a 'nan' event at step 999, past the run's last step 5" in r.stderr
    # One step past the last metric line is inside the run (a NaN raised in the middle of step 6).
    with open(events, "a") as f:
        f.write(json.dumps({"ts": 3.0, "step": 6, "kind": "nan"}) + "\n")
    r = CliRunner().invoke(app, ["replay", str(run), "--rules", str(rules), "--json"])
    assert [d["rule"] for d in json.loads(r.stdout)] == ["nan_event"]


ENDS_WITH_A_FAR_NAN = textwrap.dedent('''
    """Stands in for a trainer: three steps, then a nan event at step 500 (another run's line), then ends."""
    import json, sys, time
    from ppo_watchdog.protocol import rundir

    run_dir = sys.argv[1]
    rundir.append_event(run_dir, "started", 0)
    for step in (1, 2, 3):
        rundir.append_metrics(run_dir, step, {"actor/reward_kl_penalty": 0.01})
    with open(f"{run_dir}/events.jsonl", "a") as f:
        f.write(json.dumps({"ts": time.time(), "step": 500, "kind": "nan"}) + "\\n")
    rundir.append_event(run_dir, "finished", 3)
''')


def test_a_live_run_never_acts_on_an_event_past_its_last_step_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import time

    (tmp_path / "trainer.py").write_text(ENDS_WITH_A_FAR_NAN)
    run = tmp_path / "run"
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path, NAN_EVENT_RULE)])
    ctl = wd.add_run(run, command=[sys.executable, str(tmp_path / "trainer.py"), str(run)])
    deadline = time.monotonic() + 60
    with caplog.at_level(logging.WARNING):
        while ctl.run.phase != Phase.FINISHED and time.monotonic() < deadline:
            wd.tick()
            time.sleep(0.1)
    assert ctl.run.phase == Phase.FINISHED
    assert [d["rule"] for d in wd.store.decisions(ctl.run.run_id)] == []  # the nan at step 500 was not acted on
    assert "events.jsonl:2: a 'nan' event at step 500, past the run's last step 3" in caplog.text
    wd.close()


# -- 6. a control.json version the watchdog never wrote -------------------------------------------

LR_RULE = """\
- name: kl_high
  description: KL high lowers the lr
  expr: kl > 0.5
  actions:
    - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.5}
  cooldown: 1000
"""
LR = "actor_rollout_ref.actor.optim.lr"


def test_a_foreign_control_version_is_reported_naming_what_it_changed_and_the_next_set_starts_from_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path, LR_RULE)])
    ctl = wd.add_run(run, managed=False)
    _steps(run, [0.01, 0.02])
    wd.tick()
    # A human writes control.json by hand; the trainer applies it at its next step boundary.
    write_control(run, Control(7, {LR: 1e-5, "algorithm.kl_ctrl.kl_coef": 0.0}))
    applier = ControlApplier(run)
    changes = applier.poll(2)
    applier.mark_applied(changes, 2, dict(changes.overrides))
    with caplog.at_level(logging.WARNING):
        wd.tick()
    (d,) = [d for d in wd.store.decisions(ctl.run.run_id) if d["rule"] == RULE_FOREIGN_CONTROL]
    for said in (d["message"], caplog.text):  # history and console
        assert "version 7" in said and "not written by the watchdog" in said
        assert f"{LR} -> 1e-05" in said and "algorithm.kl_ctrl.kl_coef -> 0.0" in said
    alerts = [p["alerts"][0] for p in wd.actuator.notifier.sent]  # the webhook's payloads
    assert any(a["labels"]["rule"] == RULE_FOREIGN_CONTROL and "version 7" in a["annotations"]["description"]
               for a in alerts), alerts
    # The rules' next set starts from the values in force (the foreign ones), as RELIABILITY.md says.
    _steps(run, [0.9], start=3)
    wd.tick()
    (fire,) = [d for d in wd.store.decisions(ctl.run.run_id) if d["rule"] == "kl_high"]
    (entry,) = [j for j in fire["journal"] if j["payload"].get("set")]
    assert entry["payload"]["set"][LR] == pytest.approx(5e-6)
    assert wd.store.require_run(ctl.run.run_id).overrides["algorithm.kl_ctrl.kl_coef"] == 0.0  # kept, not undone
    table = CliRunner().invoke(app, ["history", "--state-dir", str(tmp_path / "state")])
    assert RULE_FOREIGN_CONTROL in table.output
    wd.close()


def test_reliability_documents_foreign_control_versions() -> None:
    text = " ".join((REPO / "RELIABILITY.md").read_text().split())
    assert "never wrote" in text and "next sets start from" in text


# -- 7. webhooks ---------------------------------------------------------------------------------


class _Hook(BaseHTTPRequestHandler):
    received: list[dict[str, str | None]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append({"auth": self.headers["Authorization"], "path": self.path})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hook() -> Iterator[int]:
    _Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_a_webhook_url_with_user_and_password_is_sent_as_basic_auth_never_logged(
        hook: int, caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://alice:s3cr%40t@127.0.0.1:{hook}/pager?x=1"
    with caplog.at_level(logging.DEBUG):
        outcome = Notifier(url, timeout_s=5).notify(alert_payload("r", "rule", "critical", "s", "d"))
    assert outcome == "webhook 200", outcome
    (got,) = _Hook.received
    assert got["auth"] == "Basic " + base64.b64encode(b"alice:s3cr@t").decode() and got["path"] == "/pager?x=1"
    assert "s3cr" not in caplog.text + outcome
    from ppo_watchdog.control.actuator import webhook_target

    assert webhook_target("https://hooks.example/T0") == ("https://hooks.example/T0",
                                                           {"Content-Type": "application/json"})


@pytest.mark.parametrize("url", ["ftp://hooks.example/x", "file:///etc/passwd", "hooks.example/x", "http:///x"])
def test_a_webhook_url_that_is_not_http_or_https_is_refused_at_start_naming_where_it_came_from(
        tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_WEBHOOK_URL", url)
    with pytest.raises(ValueError, match="WATCHDOG_WEBHOOK_URL") as err:
        resolve_webhook_url()
    assert url not in str(err.value)  # a secret is never repeated
    monkeypatch.delenv("WATCHDOG_WEBHOOK_URL")
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'd'}\nwebhook_url: '{url}'\nruns: [{tmp_path / 'r'}]\n")
    proc = _cli("daemon", "--config", str(cfg), timeout=60)  # accepted, it would watch until stopped
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and f"{cfg}: webhook_url:" in out and url not in out, out


def test_watchdog_run_with_an_ftp_webhook_url_exits_2_before_a_trainer_starts(tmp_path: Path) -> None:
    url = "ftp://hooks.example/x"
    proc = _cli("run", "--run-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"), "--no-report",
                env={"WATCHDOG_WEBHOOK_URL": url})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "http:// or https://" in proc.stdout + proc.stderr and url not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / rundir.RUN_JSON).exists()  # refused before a trainer started


# -- 8. the evidence first ------------------------------------------------------------------------


def test_history_says_each_decision_in_its_sentence_and_json_keeps_the_measured_values(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = Store(state)
    store.upsert_run(RunRecord("a", str(tmp_path / "a")))
    inputs = {"$entropy_rise": 2.0, "$kl_floor": 0.05, "$kl_jump": 2.0, "$reward_drop": 3.0,
              "kl": 0.3125, "reward": 0.25}
    store.add_decision("a", 12, "kl_jump", "fire", [{"kind": "rollback"}], inputs, "critical", "KL 0.312, 2.5x its median")
    store.close()
    r = CliRunner().invoke(app, ["history", "--state-dir", str(state)], env={"COLUMNS": "300"})
    text = " ".join(r.output.split())
    assert "KL 0.312, 2.5x its median" in text and "$kl_jump" not in text, r.output  # (issue 46: no expression dumps)
    rows = json.loads(CliRunner().invoke(app, ["history", "--json", "--state-dir", str(state)]).output)
    assert rows[0]["inputs"] == inputs and rows[0]["sentence"] == "KL 0.312, 2.5x its median"
    from ppo_watchdog.core.engine import evidence_text  # (approval's "why" still lists them, measured first)

    assert evidence_text(inputs) == ("kl=0.3125, reward=0.25; thresholds $entropy_rise=2, $kl_floor=0.05, "
                                     "$kl_jump=2, $reward_drop=3")


# -- 9. the report's KL panel ----------------------------------------------------------------------


def test_the_reports_kl_panel_is_clipped_above_a_spike_that_is_marked(tmp_path: Path) -> None:
    from ppo_watchdog.observe import report

    run = tmp_path / "run"
    run.mkdir()
    kls = [0.02 + 0.001 * i for i in range(30)]
    kls[20] = 40.0  # one blow-up
    _steps(run, kls)
    fig = report.build_figure(run, [])
    ax = fig.axes[0]
    top = ax.get_ylim()[1]
    assert 0.1 < top < 1.0  # the 0.1 line and the ordinary KL stay readable
    marked = [line for line in ax.get_lines() if line.get_marker() == "^"]
    assert marked and list(marked[0].get_xdata()) == [21]
    assert any("40 @ 21" in t.get_text() for t in ax.texts)
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert report.clipped_top([0.02, 0.03, 0.05]) is None  # nothing to clip: a plain linear axis


# -- 10. the shared verl logs -----------------------------------------------------------------------


def test_the_shared_verl_logs_are_found_beside_the_checkout_or_through_the_environment_only(tmp_path: Path) -> None:
    checkout = tmp_path / "somewhere" / "repo"
    (checkout / "tests").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "verl_logs.py", checkout / "tests" / "verl_logs.py")
    probe = "import verl_logs; print(verl_logs.LOGS)"
    env = {k: v for k, v in os.environ.items() if k != "WATCHDOG_TESTDATA"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=checkout / "tests", env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == str(checkout.parent / "shared" / "testdata" / "verl-logs"), out.stdout + out.stderr
    env["WATCHDOG_TESTDATA"] = str(tmp_path / "td")
    (tmp_path / "td" / "verl-logs").mkdir(parents=True)
    out = subprocess.run([sys.executable, "-c", probe], cwd=checkout / "tests", env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == str(tmp_path / "td" / "verl-logs"), out.stdout + out.stderr
    assert "/work/" not in (REPO / "tests" / "verl_logs.py").read_text()


def test_a_history_of_all_runs_names_each_decisions_run_and_one_runs_does_not(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    for rid, rule in (("alpha", "kl_jump"), ("beta", "oom")):
        store.upsert_run(RunRecord(rid, str(tmp_path / rid)))
        store.add_decision(rid, 12, rule, "fire", [{"kind": "rollback"}], {"kl": 0.12})
    args = ["--state-dir", str(tmp_path / "state")]
    every = CliRunner().invoke(app, ["history", *args], terminal_width=200)
    rows = [line for line in every.output.splitlines() if "kl_jump" in line or "oom" in line]
    assert every.exit_code == 0 and len(rows) == 2, every.output
    assert "alpha" in rows[0] and "kl_jump" in rows[0] and "beta" in rows[1] and "oom" in rows[1]
    one = CliRunner().invoke(app, ["history", "alpha", *args], terminal_width=200)
    assert one.exit_code == 0 and "kl_jump" in one.output and "oom" not in one.output
    assert one.output.startswith("run alpha: ") and "step    12  kl_jump: " in one.output  # (its story: no run column)
    assert " run " in [line for line in every.output.splitlines() if " step " in line][0]
