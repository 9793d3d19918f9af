"""CLI: ``watchdog run | daemon | status | history | resume | report`` (registered by watchdog.cli)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from watchdog.backends.local import SupervisorError
from watchdog.control.controller import DONE_PHASES, RULE_CONFIG
from watchdog.control.daemon import (
    DaemonConfigError,
    build_watchdog,
    load_daemon_config,
    run_daemon,
    state_dir_default,
)
from watchdog.control.store import NoState, Phase, Store, StoreError
from watchdog.core.engine import evidence_text
from watchdog.core.pricing import cost_text
from watchdog.core.vocabulary import ActionStatus, JournalKind, RuleStatus
from watchdog.protocol import hydra
from watchdog.sources.prometheus import PROMETHEUS_URL_ENV, source_config

run_app = typer.Typer(help="Supervise and remediate training runs.", no_args_is_help=True)
log = logging.getLogger(__name__)
# Wide enough for the history table when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 150)

StateDir = Annotated[str, typer.Option("--state-dir", help="Watchdog state directory (SQLite); "
                                       "default $WATCHDOG_STATE_DIR or ./.watchdog.")]


def _store(state_dir: str | None) -> Store:
    """An existing state, for the commands that read it (a new directory is not created; a lock held by
    a writer is waited for a few seconds, then said)."""
    try:
        return Store(state_dir or state_dir_default(), create=False, busy_timeout_s=5.0)
    except StoreError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc


def _logging(verbose: bool) -> None:
    # force: the root callback has configured logging already (`watchdog -v run` or `run --verbose`).
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                            stream=sys.stderr, force=True)
    # A tick skipped while the previous one waits for a trainer to stop is expected, not news.
    logging.getLogger("apscheduler").setLevel(logging.ERROR)


def _crash_hook() -> Any:
    """Test seam: WATCHDOG_TEST_CRASH_AT=PHASE (one of actuator.CRASH_POINTS, e.g. control_written)
    makes the watchdog SIGKILL itself right after that phase of an action (a real kill -9 mid-action)."""
    at = os.environ.get("WATCHDOG_TEST_CRASH_AT")
    if not at:
        return None

    def hook(phase: str) -> None:
        if phase == at:
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _check_ray(address: str, token_file: Path | None) -> None:
    """Exit 2 naming the address when its Ray job server does not answer or refuses the token (before
    anything is written)."""
    from watchdog.backends.ray_jobs import check_job_server

    try:
        version = check_job_server(address, token_file)
    except SupervisorError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    log.info("Ray job server at %s (Ray %s)", address, version)


def _checked_overrides(items: list[str], option: str) -> list[str]:
    """The ``key=value`` items of an option, each checked with Hydra's parser (exit 2 naming a bad one)."""
    for item in items:
        try:
            hydra.parse(item)
        except hydra.OverrideError as exc:
            console.print(f"[red]{option}: {exc}[/red]")
            raise typer.Exit(2) from exc
    return list(items)


def _prepare_mode(mode: str, cmd: list[str], rd: Path, run_metrics_port: int | None) -> None:
    """Zero-patch mode writes run.json for verl (which writes none); exit 2 on a bad --mode."""
    from watchdog.backends import zero_patch as verl_mode

    try:  # shared with the daemon (Watchdog.add_run), so both set a verl run up alike
        resolved = verl_mode.prepare_run(rd, cmd, mode, metrics_port=run_metrics_port)
    except verl_mode.VerlModeError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    if resolved == verl_mode.MODE_VERL:
        console.print("zero-patch mode: verl changes nothing live; every change is a restart with resume")


@run_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_cmd(
    command: Annotated[list[str] | None, typer.Argument(help="Trainer command after `--` (default: the "
                                                        "embedded trainer).")] = None,
    rules: Annotated[list[str] | None, typer.Option("--rules", help="Rule file(s); default rules/default.yaml.")] = None,
    run_dir: Annotated[str | None, typer.Option("--run-dir", help="Run directory (default runs/run-<time>).")] = None,
    tick: Annotated[float, typer.Option("--tick", help="Seconds between evaluations.")] = 1.0,
    state_dir: StateDir = "",
    faults: Annotated[str, typer.Option("--faults", help="Embedded trainer: fault schedule "
                                        "(trainer.faults), e.g. 'kl_collapse@8,oom@20,lr_spike@30:x20'.")] = "",
    sets: Annotated[list[str] | None, typer.Option("--set", help="Embedded trainer: extra KEY=VALUE.")] = None,
    mode: Annotated[str, typer.Option("--mode", help="auto | embedded | verl. verl (zero-patch): an unmodified "
                                      "`python -m verl.trainer.main_ppo ...`, metrics through verl's file "
                                      "logger, every change by restart with resume. auto: verl for a "
                                      "verl.trainer.main_ppo command, else embedded.")] = "auto",
    run_metrics_port: Annotated[int | None, typer.Option(
        "--run-metrics-port", help="verl mode: the watchdog serves the run's metrics (catalog names) on "
                                   "127.0.0.1:PORT (-1: any free port; written to run.json).")] = None,
    webhook_url_file: Annotated[Path | None, typer.Option(
        "--webhook-url-file", help="A file whose first line is the Alertmanager-compatible webhook URL "
                                   "(default $WATCHDOG_WEBHOOK_URL_FILE, else $WATCHDOG_WEBHOOK_URL; never argv: "
                                   "a URL there is readable by every user of the machine).")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Serve the watchdog's "
                                                     "/metrics on 127.0.0.1:PORT.")] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", envvar="RAY_ADDRESS", show_envvar=True,
        help="Ray job server (http://HEAD:8265): run the trainer there as a Ray Job, resubmitted for "
             "restarts. The run directory must be a path the head shares.")] = None,
    ray_token_file: Annotated[Path | None, typer.Option(
        "--ray-token-file", help="A file holding the Ray cluster's auth token (token authentication, on by "
                                 "default in current Ray). Default: where Ray looks ($RAY_AUTH_TOKEN, "
                                 "$RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token). Never argv: a token there is "
                                 "readable by every user of the machine.")] = None,
    source: Annotated[str, typer.Option("--source", help="Where the rules read the run's metrics: files "
                                        "(run_dir/metrics.jsonl), prometheus (Prometheus's HTTP API, aligned "
                                        "to steps by ppo_global_step; events still from events.jsonl) or "
                                        "rl_insight (the same, from verl's own RL-Insight series, by "
                                        "trainer.experiment_name: no second exporter).")] = "files",
    prometheus_url: Annotated[str | None, typer.Option(
        "--prometheus-url", envvar=PROMETHEUS_URL_ENV, show_envvar=True,
        help="Prometheus base URL for --source prometheus, e.g. http://127.0.0.1:9090.")] = None,
    file_sd_dir: Annotated[str | None, typer.Option(
        "--file-sd-dir", help="--source prometheus: announce the trainer's /metrics in this Prometheus "
                              "file_sd directory (withdrawn when the run ends).")] = None,
    restart_budget: Annotated[int, typer.Option(help="Crash/hang restarts before giving up.")] = 3,
    oom_retries: Annotated[int, typer.Option(help="OOM restarts before giving up.")] = 3,
    heartbeat_min: Annotated[float, typer.Option(help="Hang timeout floor in seconds.")] = 30.0,
    startup_timeout: Annotated[float, typer.Option(help="Seconds allowed until the first step.")] = 600.0,
    live_timeout: Annotated[float, typer.Option(help="Seconds for a live change to be applied.")] = 60.0,
    stop_grace: Annotated[float, typer.Option(help="SIGTERM grace before SIGKILL.")] = 15.0,
    tuning_relaunch_every: Annotated[int, typer.Option(
        min=0, help="Steps trained between two relaunches made only for tuning sets (they wait for the next "
                    "checkpoint and are merged); divergence and OOM relaunches go at once.")] = 100,
    startup_s: Annotated[float, typer.Option(
        min=0.0, help="Seconds a relaunch costs before the run has measured its own (pricing).")] = 240.0,
    on_escalate: Annotated[str, typer.Option(
        "--on-escalate", help="When a human is needed: pause (wait for `watchdog resume`), stop (end the run "
                              "with a verdict), or continue (alert only).")] = "pause",
    pause_timeout: Annotated[float | None, typer.Option(
        help="Seconds a pause for a human may last unresumed before the run is stopped with a verdict "
             "(default: wait).")] = None,
    report: Annotated[bool, typer.Option(help="Write report.html and report.png into the run dir.")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Start a trainer, watch it and remediate until it finishes; then summarise."""
    _logging(verbose)
    # Ctrl-C (SIGINT) stops the run cleanly even when this process was started in the background by a
    # shell, which starts it with SIGINT ignored (a supervisor's `kill -INT` must still work).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not (math.isfinite(tick) and tick > 0):
        console.print(f"[red]--tick must be a positive number of seconds, got {tick!r}[/red]")
        raise typer.Exit(2)
    if ray_address:
        _check_ray(ray_address, ray_token_file)
    elif ray_token_file is not None:
        console.print("[red]--ray-token-file is for a Ray cluster: give --ray-address too[/red]")
        raise typer.Exit(2)
    try:
        src = source_config(source, prometheus_url, file_sd_dir)
    except ValueError as exc:
        console.print(f"[red]--source: {exc}[/red]")
        raise typer.Exit(2) from exc
    rd = Path(run_dir or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    try:
        rd.mkdir(parents=True, exist_ok=True)
        probe = rd / ".watchdog-write-test"
        probe.write_bytes(b"")  # the trainer and the watchdog both write here
        probe.unlink()
    except OSError as exc:
        console.print(f"[red]--run-dir {rd}: cannot be written ({exc.strerror or exc})[/red]")
        raise typer.Exit(2) from exc
    if command:
        cmd = list(command)
    else:
        cmd = [sys.executable, "-m", "trainer", f"trainer.run_dir={rd}", "trainer.progress=false"]
        if faults:
            cmd.append(hydra.format_override("trainer.faults", faults))
        cmd += _checked_overrides(sets or [], "--set")
        if src.kind == "prometheus" and not any(s.startswith("trainer.metrics_port=") for s in sets or []):
            cmd.append("trainer.metrics_port=-1")  # Prometheus must scrape it: any free port, in run.json
    _prepare_mode(mode, cmd, rd, run_metrics_port)
    try:
        wd = build_watchdog(
            state_dir or state_dir_default(), rules, None,
            controller={"restart_budget": restart_budget, "oom_retry_budget": oom_retries,
                        "heartbeat_min_s": heartbeat_min, "startup_timeout_s": startup_timeout,
                        "tuning_relaunch_every": tuning_relaunch_every, "startup_s": startup_s,
                        "on_escalate": on_escalate, "pause_timeout_s": pause_timeout},
            actuator={"live_timeout_s": live_timeout, "stop_grace_s": stop_grace},
            metrics_port=metrics_port, crash_hook=_crash_hook(), webhook_url_file=webhook_url_file,
        )
    except (ValueError, StoreError) as exc:  # a bad setting (--on-escalate maybe), a state dir that is a file
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    try:
        ctl = wd.add_run(rd, command=cmd, ray_address=ray_address, ray_token_file=ray_token_file, source=src)
    except SupervisorError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    console.print(f"watchdog: run [bold]{ctl.run.run_id}[/bold] in {rd} (state {wd.store.path})")
    try:
        wd.serve_forever(tick, until_done=True)
    except KeyboardInterrupt:
        _interrupted(wd, ctl)
        raise typer.Exit(130) from None
    wd.close(withdraw_targets=True)
    run = wd.store.require_run(ctl.run.run_id)
    decisions = wd.store.decisions(run.run_id)
    _print_history(decisions, title=f"What the watchdog did in run {run.run_id}")
    console.print(f"phase [bold]{run.phase}[/bold], last step {run.last_step}, restarts {run.restarts}, "
                  f"OOM retries {run.oom_retries}, control version {run.control_version}")
    verdict = next((j.result.get("outcome", "") for j in reversed(wd.store.journal(run.run_id))
                    if j.kind == JournalKind.STOP and j.status == ActionStatus.DONE), "")
    if verdict:
        console.print(f"[red]verdict: {verdict}[/red]")
    # The newest give-up, when it was a refused configuration (not one of an earlier attempt in this run dir).
    given_up = next((d for d in reversed(decisions) if d["kind"] == "escalate"), None)
    refused = given_up if given_up and given_up["rule"] == RULE_CONFIG and run.phase == Phase.FAILED else None
    if refused is not None:  # the cause, where the user looks (it is also in trainer.log and `history`)
        console.print(f"[red]{escape(refused['message'])}[/red]")
    if report:
        try:
            from watchdog.observe.report import restart_spans, write_report

            for suffix in (".html", ".png"):
                path = write_report(rd, decisions, rd / f"report{suffix}", restart_spans(decisions))
            console.print(f"report: {rd / 'report.html'} and {path}")
        except Exception as exc:  # a failed report must not hide the run's outcome
            console.print(f"[yellow]report not written: {exc}[/yellow]")
    console.print(f"history: watchdog history {run.run_id} --json")
    # 2: the trainer refused its configuration (bad input, as a bad option would be); 1: the run failed.
    raise typer.Exit(0 if run.phase == Phase.FINISHED else 2 if refused is not None else 1)


def _interrupted(wd: Any, ctl: Any) -> None:
    """Ctrl-C: stop the trainer (SIGTERM: it saves; a second Ctrl-C kills it) and record the run as stopped."""
    console.print("interrupted: stopping the trainer (it saves a checkpoint first; Ctrl-C again kills it)")
    try:
        wd.actuator.stop(ctl.h)
    except KeyboardInterrupt:
        console.print("interrupted again: killing the trainer")
        if ctl.h.proc is not None:
            ctl.h.proc.signal(signal.SIGKILL)
    wd.store.update_run(ctl.run.run_id, phase=Phase.STOPPED)
    wd.close(withdraw_targets=True)
    console.print(f"run {ctl.run.run_id} stopped by Ctrl-C; `watchdog run` with the same --run-dir resumes it")


@run_app.command("daemon")
def daemon_cmd(
    config: Annotated[Path, typer.Option("--config", help="Daemon YAML: runs, rules, state_dir, tick_s, "
                                         "metrics_port, webhook_url, controller, actuator.")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Watch many run directories and serve the watchdog's own /metrics."""
    _logging(verbose)
    try:
        cfg = load_daemon_config(config)
    except DaemonConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    console.print(f"watchdog daemon: {len(cfg.runs)} run(s), tick {cfg.tick_s}s, state {cfg.state_dir}")
    try:
        run_daemon(cfg)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    except DaemonConfigError as exc:  # e.g. a Grafana token file that cannot be read
        console.print(f"[red]{config}: {exc}[/red]")
        raise typer.Exit(2) from exc


@run_app.command("status")
def status_cmd(
    run: Annotated[str | None, typer.Argument(help="Run id (default: all runs).")] = None,
    state_dir: StateDir = "",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Runs with their phase, step, restarts, control version and open actions."""
    try:
        store = Store(state_dir or state_dir_default(), create=False, busy_timeout_s=5.0)
    except NoState as exc:  # exit 2 as `history` does: a state directory that is not there is bad input
        console.print(f"[red]no runs in {exc.path}: no watchdog state there "
                      "(give --state-dir or set $WATCHDOG_STATE_DIR to look elsewhere)[/red]")
        raise typer.Exit(2) from exc
    except StoreError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    try:
        runs = [store.require_run(run)] if run else store.list_runs()
    except StoreError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    rows = []
    for r in runs:
        engine = (store.load_engine_state(r.run_id) or {}).get("engine", {})
        firing = sorted(n for n, s in engine.get("rules", {}).items() if s.get("status") == RuleStatus.FIRING)
        open_n = len(store.open_actions(r.run_id))
        rows.append({"run": r.run_id, "phase": r.phase, "pid": r.pid, "job_id": r.job_id, "last_step": r.last_step,
                     "control_version": r.control_version, "restarts": r.restarts, "oom_retries": r.oom_retries,
                     "open_actions": open_n, "firing": firing, "overrides": r.overrides, "run_dir": r.run_dir})
    if as_json:
        typer.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if not rows:
        console.print(f"no runs in {store.path} (give --state-dir or set $WATCHDOG_STATE_DIR to look elsewhere)")
        return
    t = Table(title="watchdog runs")
    for col in ("run", "phase", "pid", "last_step", "control_version", "restarts", "oom_retries", "open_actions",
                "firing"):
        t.add_column(col)
    for row in rows:
        t.add_row(*(", ".join(map(str, v)) if isinstance(v := row[c], list) else str(v) for c in (
            "run", "phase", "pid", "last_step", "control_version", "restarts", "oom_retries", "open_actions",
            "firing")))
    console.print(t)


def _history_rows(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{
        "id": d["id"], "run": d["run_id"], "step": d["step"], "rule": d["rule"], "kind": d["kind"],
        "severity": d["severity"], "message": d["message"], "inputs": d["inputs"], "actions": d["actions"],
        "status": d["status"], "outcome": d["outcome"], "signals": d.get("signals", {}),
        "cost": cost_text(d["journal"]),
        "journal": [{"id": j["id"], "kind": j["kind"], "status": j["status"], "control_version": j["control_version"],
                     "set": j["payload"].get("set"), "cost": j["payload"].get("cost"), "result": j["result"]}
                    for j in d["journal"]],
    } for d in decisions]


def _print_history(decisions: list[dict[str, Any]], title: str) -> None:
    t = Table(title=title)
    for col in ("step", "rule", "kind", "inputs", "actions", "status", "cost", "outcome"):
        t.add_column(col, overflow="fold")
    for d in decisions:
        inputs = evidence_text(d["inputs"])  # the measured values first, the $param thresholds after
        actions = "; ".join(str(a.get("kind", a)) if isinstance(a, dict) else str(a) for a in d["actions"])
        actions = actions or ", ".join(j["kind"] for j in d["journal"]) or "-"
        t.add_row(str(d["step"]), d["rule"], d["kind"], inputs, actions, d["status"], cost_text(d["journal"]),
                  d["outcome"])
    console.print(t)


def shown_in_history(d: dict[str, Any]) -> bool:
    """Decisions ``watchdog history`` lists without --all: not resolves, not no-ops (a dropped or
    covered set is shown: what was not done, and why, is part of the record)."""
    return d["kind"] != "resolve" and d["outcome"] not in ("no action", "resolved")


@run_app.command("history")
def history_cmd(
    run: Annotated[str | None, typer.Argument(help="Run id (default: all runs).")] = None,
    state_dir: StateDir = "",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list: step, rule, inputs, outcome, journal.")] = False,
    all_decisions: Annotated[bool, typer.Option("--all", help="Include resolves and no-op decisions.")] = False,
) -> None:
    """Every remediation with its step, rule, inputs and outcome."""
    store = _store(state_dir)
    if run and store.get_run(run) is None:
        console.print(f"[red]{store.path}: no run {run!r}[/red]")
        raise typer.Exit(2)
    decisions = [d for d in store.decisions(run) if all_decisions or shown_in_history(d)]
    if as_json:
        typer.echo(json.dumps(_history_rows(decisions), indent=2, sort_keys=True))
    else:
        _print_history(decisions, title=f"history of {run or 'all runs'}")


@run_app.command("resume")
def resume_cmd(run: Annotated[str, typer.Argument(help="Run id.")], state_dir: StateDir = "") -> None:
    """Clear a pause or escalation: the watchdog sends `resume` at its next tick."""
    store = _store(state_dir)
    try:
        r = store.require_run(run)
    except StoreError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    if r.phase in DONE_PHASES:  # nothing watches it any more: a queued resume would never be sent
        console.print(f"[red]run {run} has {r.phase}: there is nothing to resume (start it again with "
                      f"`watchdog run --run-dir {r.run_dir}`)[/red]")
        raise typer.Exit(2)
    aid = store.add_action(run, "resume", {"rule": "human:resume", "requested_phase": r.phase})
    console.print(f"resume of {run} queued (journal {aid}); the watchdog applies it at its next tick")


@run_app.command("report")
def report_cmd(
    run: Annotated[str, typer.Argument(help="Run id.")],
    out: Annotated[Path, typer.Option("--out", help="FILE.png or FILE.html")],
    state_dir: StateDir = "",
) -> None:
    """KL, reward, value loss, lr and kl_coef over steps with the watchdog's actions."""
    from watchdog.observe.report import ReportError, restart_spans, write_report

    store = _store(state_dir)
    try:
        r = store.require_run(run)
        decisions = store.decisions(run)
        path = write_report(r.run_dir, decisions, out, restart_spans(decisions))
    except (StoreError, ReportError) as exc:  # no such run, nothing to plot, not .png/.html: bad input
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    console.print(f"report written: {path}")
