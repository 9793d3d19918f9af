"""CLI: ``watchdog run | daemon | status | history | resume | approve | deny | report`` (registered by
ppo_watchdog.cli)."""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from ppo_watchdog.backends.local import SupervisorError
from ppo_watchdog.cli.console import CliConsole
from ppo_watchdog.cli.story import acted, story
from ppo_watchdog.control.controller import DONE_PHASES, RULE_CONFIG, RULE_TICK, EngineRules
from ppo_watchdog.control.daemon import (
    DaemonConfigError,
    build_watchdog,
    load_daemon_config,
    run_daemon,
    state_dir_default,
)
from ppo_watchdog.control.store import NoState, Phase, RunRecord, Store, StoreError
from ppo_watchdog.core.pricing import cost_text, duration_text
from ppo_watchdog.core.rulefile import (
    DEFAULT_PACK,
    RULES_ENV,
    RuleFileError,
    load_rules,
    packs_text,
    rule_paths,
)
from ppo_watchdog.core.summary import number, sentence
from ppo_watchdog.core.vocabulary import ActionStatus, DecisionStatus, JournalKind, RuleStatus
from ppo_watchdog.observe.report import decision_text, shown_in_history
from ppo_watchdog.protocol import hydra, rundir
from ppo_watchdog.protocol import lock as locks
from ppo_watchdog.sources.prometheus import PROMETHEUS_URL_ENV, source_config

run_app = typer.Typer(help="Supervise and remediate training runs.", no_args_is_help=True)
log = logging.getLogger(__name__)


class ReaderSafeStdout:
    """``sys.stdout`` as it is at each write (a test's runner swaps it), outliving its reader.

    ``watchdog run ... | tee run.log`` and Ctrl-C: the terminal's SIGINT ends tee first, and the next
    write raises BrokenPipeError. Raised in the stop path, it would leave the trainer training on
    unsupervised; so once the reader is gone, stdout (and stderr, when it is the same pipe: ``2>&1``) is
    pointed at /dev/null, every later write goes nowhere, and the interpreter's last flush succeeds too.
    A terminal that is gone (its window closed, an ssh session dropped: SIGHUP) fails writes with EIO
    instead, and is gone the same way.
    """

    def write(self, text: str) -> int:
        try:
            return sys.stdout.write(text)
        except OSError as exc:
            if exc.errno not in READER_GONE:
                raise
            reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            sys.stdout.flush()
        except OSError as exc:
            if exc.errno not in READER_GONE:
                raise
            reader_gone()

    def isatty(self) -> bool:
        return sys.stdout.isatty()

    def fileno(self) -> int:
        return sys.stdout.fileno()

    @property
    def encoding(self) -> str:
        return getattr(sys.stdout, "encoding", None) or "utf-8"


#: What a write to stdout fails with once nobody reads it: a pipe's reader gone (EPIPE), a terminal hung up (EIO).
READER_GONE = (errno.EPIPE, errno.EIO)


def reader_gone() -> None:
    """Point stdout at /dev/null (stderr too when it is the same pipe), its reader having gone."""
    try:
        out = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # (a runner's in-memory stdout: nothing to point elsewhere)
        return
    fds = [out]
    try:
        if os.path.sameopenfile(out, sys.stderr.fileno()):
            fds.append(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)


# $COLUMNS, else the terminal's width, else wide enough for the history table in a file or a CI log; no
# markup (styles are given as ``style=``, emphasis as rich Text): ppo_watchdog.cli.console. Written through
# ReaderSafeStdout: a pipe's reader gone does not stop the stop path.
console = CliConsole(file=ReaderSafeStdout())  # type: ignore[arg-type]

StateDir = Annotated[str, typer.Option("--state-dir", help="Watchdog state directory (SQLite); "
                                       "default $WATCHDOG_STATE_DIR or ./.watchdog.")]


def _store(state_dir: str | None, read_only: bool = True) -> Store:
    """An existing state, for the commands that read it (a new directory is not created, nothing is written
    into a state only looked at; a lock held by a writer is waited for a few seconds, then said)."""
    try:
        return Store(state_dir or state_dir_default(), create=False, busy_timeout_s=5.0, read_only=read_only)
    except StoreError as exc:
        console.print(f"{exc}", style="red")
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
    makes the watchdog SIGKILL itself right after that phase of an action (a real kill -9 mid-action);
    with WATCHDOG_TEST_CRASH_SIGNAL=TERM it sends itself SIGTERM there instead (a stop mid-action), once."""
    at = os.environ.get("WATCHDOG_TEST_CRASH_AT")
    if not at:
        return None
    sig = signal.SIGTERM if os.environ.get("WATCHDOG_TEST_CRASH_SIGNAL", "KILL").upper() == "TERM" else signal.SIGKILL
    sent: list[str] = []

    def hook(phase: str) -> None:
        if phase == at and not sent:
            sent.append(phase)
            if sig == signal.SIGKILL:
                logging.shutdown()
            os.kill(os.getpid(), sig)

    return hook


def _check_ray(address: str, token_file: Path | None) -> None:
    """Exit 2 naming the address when its Ray job server does not answer or refuses the token (before
    anything is written)."""
    from ppo_watchdog.backends.ray_jobs import check_job_server

    try:
        version = check_job_server(address, token_file)
    except SupervisorError as exc:
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    log.info("Ray job server at %s (Ray %s)", address, version)


def _checked_overrides(items: list[str], option: str) -> list[str]:
    """The ``key=value`` items of an option, each checked with Hydra's parser (exit 2 naming a bad one)."""
    for item in items:
        try:
            hydra.parse(item)
        except hydra.OverrideError as exc:
            console.print(f"{option}: {exc}", style="red")
            raise typer.Exit(2) from exc
    return list(items)


def _check_mode(mode: str, cmd: list[str]) -> None:
    """Exit 2 on a bad --mode (nothing written yet: zero-patch mode writes run.json for verl, which writes
    none, in Watchdog.add_run, once the run directory is this watchdog's)."""
    from ppo_watchdog.backends import zero_patch as verl_mode

    try:
        resolved = verl_mode.resolve_mode(mode, cmd)
    except verl_mode.VerlModeError as exc:
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    if resolved == verl_mode.MODE_VERL:
        console.print("zero-patch mode: verl changes nothing live; every change is a restart with resume")


def _restoring_signals(fn: Any) -> Any:
    """The stop-signal handlers a command installs are put back as they were when it returns (a CLI test
    runner, or anything else calling the command in process, keeps its own)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        saved = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, CHECKPOINT_STOP_SIGNAL)}
        try:
            return fn(*args, **kwargs)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    return wrapper


#: Where :class:`RunCommand` leaves the trainer command (the words after ``--``; None: no ``--``).
TRAINER_COMMAND = "trainer_command"


class RunCommand(TyperCommand):
    """``watchdog run``'s parsing: the trainer command is everything after the first ``--``, taken before the
    options are parsed, so a word before it is the watchdog's: an unknown option is refused with a did-you-mean
    (``--rule`` is not a trainer command), and a word that is no option says the trainer command goes after ``--``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta[TRAINER_COMMAND] = args[cut + 1:]
            args = args[:cut]
        else:
            ctx.meta[TRAINER_COMMAND] = None
        try:
            return super().parse_args(ctx, args)
        except typer.BadParameter:
            raise
        except Exception as exc:  # click's UsageError: an extra word is a trainer command without its --
            if getattr(exc, "message", "").startswith("Got unexpected extra argument"):
                exc.message += ("; a trainer command goes after --: watchdog run [OPTIONS] -- COMMAND ..."  # type: ignore[attr-defined]
                                " (with no command, the embedded demo trainer runs)")
            raise


P_TRAINER, P_RULES, P_SOURCE, P_RAY, P_TIMING, P_OUT = (
    "Trainer", "Rules and remediation", "Where the metrics come from", "Ray cluster", "Timing and budgets",
    "Alerts and output")

RUN_EPILOG = """Examples:

watchdog run                                                      the embedded demo trainer (make run adds faults)

watchdog run -- python3 -m verl.trainer.main_ppo ...              an unmodified verl run (zero-patch)

watchdog run --extra-rules mine.yaml -- COMMAND ...               the default pack and your rules

watchdog run --rules default --rules family.yaml -- COMMAND ...   the default pack and a calibrated overlay

watchdog run --advise -- COMMAND ...                              say what it would do, do nothing

watchdog check LOG_OR_RUN_DIR                                     first: what the pack makes of a log you have"""


@run_app.command("run", cls=RunCommand, options_metavar="[OPTIONS] [-- TRAINER COMMAND ...]", epilog=RUN_EPILOG)
@_restoring_signals
def run_cmd(
    ctx: typer.Context,
    run_dir: Annotated[str | None, typer.Option("--run-dir", help="Run directory (default runs/run-<time>).",
                                                rich_help_panel=P_TRAINER)] = None,
    tick: Annotated[float, typer.Option("--tick", help="Seconds between evaluations.", rich_help_panel=P_TIMING)] = 1.0,
    state_dir: StateDir = "",
    faults: Annotated[str, typer.Option("--faults", help="Embedded demo trainer: fault schedule "
                                        "(trainer.faults), e.g. 'kl_collapse@8,oom@20,lr_spike@30:x20'.",
                                        rich_help_panel=P_TRAINER)] = "",
    sets: Annotated[list[str] | None, typer.Option("--set", help="Embedded demo trainer: extra KEY=VALUE.",
                                                   rich_help_panel=P_TRAINER)] = None,
    mode: Annotated[str, typer.Option("--mode", help="auto | embedded | verl. verl (zero-patch): an unmodified "
                                      "`python -m verl.trainer.main_ppo ...`, metrics through verl's file "
                                      "logger, every change by restart with resume. auto: verl for a "
                                      "verl.trainer.main_ppo command, else embedded.", rich_help_panel=P_TRAINER)] = "auto",
    rules: Annotated[list[str] | None, typer.Option(
        "--rules", help=f"Rule file(s) (repeatable); '{DEFAULT_PACK}' names the shipped default pack. Default: "
                        f"${RULES_ENV}, else the default pack. Replaces the pack: to add to it, --extra-rules.",
        rich_help_panel=P_RULES)] = None,
    extra_rules: Annotated[list[str] | None, typer.Option(
        "--extra-rules", help="Rule file or overlay added to the pack (repeatable), after --rules or the default "
                              "pack: your rules beside its NaN, KL and OOM protection.", rich_help_panel=P_RULES)] = None,
    run_metrics_port: Annotated[int | None, typer.Option(
        "--run-metrics-port", help="verl mode: the watchdog serves the run's metrics (catalog names) on "
                                   "127.0.0.1:PORT (-1: any free port; written to run.json).",
        rich_help_panel=P_SOURCE)] = None,
    webhook_url_file: Annotated[Path | None, typer.Option(
        "--webhook-url-file", help="A file whose first line is the Alertmanager-compatible webhook URL "
                                   "(default $WATCHDOG_WEBHOOK_URL_FILE, else $WATCHDOG_WEBHOOK_URL; never argv: "
                                   "a URL there is readable by every user of the machine).",
        rich_help_panel=P_OUT)] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Serve the watchdog's "
                                                     "/metrics on 127.0.0.1:PORT.", rich_help_panel=P_OUT)] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", envvar="RAY_ADDRESS", show_envvar=True,
        help="Ray job server (http://HEAD:8265): run the trainer there as a Ray Job, resubmitted for "
             "restarts. The run directory must be a path the head shares.", rich_help_panel=P_RAY)] = None,
    ray_token_file: Annotated[Path | None, typer.Option(
        "--ray-token-file", help="A file holding the Ray cluster's auth token (token authentication, on by "
                                 "default in current Ray). Default: where Ray looks ($RAY_AUTH_TOKEN, "
                                 "$RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token). Never argv: a token there is "
                                 "readable by every user of the machine.", rich_help_panel=P_RAY)] = None,
    source: Annotated[str, typer.Option("--source", help="Where the rules read the run's metrics: files "
                                        "(run_dir/metrics.jsonl), prometheus (Prometheus's HTTP API, aligned "
                                        "to steps by ppo_global_step; events still from events.jsonl) or "
                                        "rl_insight (the same, from verl's own RL-Insight series, by "
                                        "trainer.experiment_name: no second exporter).",
                                        rich_help_panel=P_SOURCE)] = "files",
    prometheus_url: Annotated[str | None, typer.Option(
        "--prometheus-url", envvar=PROMETHEUS_URL_ENV, show_envvar=True,
        help="Prometheus base URL for --source prometheus, e.g. http://127.0.0.1:9090.",
        rich_help_panel=P_SOURCE)] = None,
    file_sd_dir: Annotated[str | None, typer.Option(
        "--file-sd-dir", help="--source prometheus: announce the trainer's /metrics in this Prometheus "
                              "file_sd directory (withdrawn when the run ends).", rich_help_panel=P_SOURCE)] = None,
    restart_budget: Annotated[int, typer.Option(help="Crash/hang restarts before giving up.",
                                                rich_help_panel=P_TIMING)] = 3,
    oom_retries: Annotated[int, typer.Option(help="OOM restarts before giving up.", rich_help_panel=P_TIMING)] = 3,
    heartbeat_min: Annotated[float, typer.Option(help="Hang timeout floor in seconds.",
                                                 rich_help_panel=P_TIMING)] = 30.0,
    startup_timeout: Annotated[float, typer.Option(help="Seconds allowed until the first step.",
                                                   rich_help_panel=P_TIMING)] = 600.0,
    live_timeout: Annotated[float, typer.Option(help="Seconds for a live change to be applied.",
                                                rich_help_panel=P_TIMING)] = 60.0,
    stop_grace: Annotated[float, typer.Option(help="SIGTERM grace before SIGKILL.", rich_help_panel=P_TIMING)] = 15.0,
    tuning_relaunch_every: Annotated[int, typer.Option(
        min=0, help="Steps trained between two relaunches made only for tuning sets (they wait for the next "
                    "checkpoint and are merged); divergence and OOM relaunches go at once.",
        rich_help_panel=P_RULES)] = 100,
    startup_s: Annotated[float, typer.Option(
        min=0.0, help="Seconds a relaunch costs before the run has measured its own (pricing).",
        rich_help_panel=P_RULES)] = 240.0,
    on_escalate: Annotated[str, typer.Option(
        "--on-escalate", help="When a human is needed: pause (wait for `watchdog resume`), stop (end the run "
                              "with a verdict), or continue (alert only).", rich_help_panel=P_RULES)] = "pause",
    pause_timeout: Annotated[float | None, typer.Option(
        help="Seconds a pause for a human may last unresumed before the run is stopped with a verdict "
             "(default: wait).", rich_help_panel=P_RULES)] = None,
    advise: Annotated[bool, typer.Option(
        "--advise", help="Advise mode: every decision is made, priced, journaled and announced (console, webhook, "
                         "Grafana, report, history) as what the watchdog WOULD do, and nothing is carried out: "
                         "no signal, control.json, stop, relaunch, rollback or pause. The run is never touched.",
        rich_help_panel=P_RULES)] = False,
    approve: Annotated[str, typer.Option(
        "--approve", help="Actions that wait for a person: a comma list of rollback, relaunch, pause, stop. Each is "
                          "said (console, webhook) with why, what it would cost and the command to answer it; "
                          "`watchdog approve RUN` carries it out, `watchdog deny RUN` refuses it and the run "
                          "carries on. Actions of other kinds go on meanwhile.", rich_help_panel=P_RULES)] = "",
    approve_timeout: Annotated[float, typer.Option(
        "--approve-timeout", help="Seconds an action waits for `watchdog approve` before it is denied, said.",
        rich_help_panel=P_RULES)] = 1800.0,
    report: Annotated[bool, typer.Option(help="Write report.html and report.png into the run dir.",
                                         rich_help_panel=P_OUT)] = True,
    checkpoint_wait: Annotated[float, typer.Option(
        "--checkpoint-wait", min=0.0, help="On SIGUSR1 (a batch system's warning before its time limit, e.g. "
                                           "Slurm's --signal=B:USR1@300): seconds the trainer has to save a "
                                           "checkpoint and stop before it is stopped.", rich_help_panel=P_TRAINER)] = 240.0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", rich_help_panel=P_OUT)] = False,
) -> None:
    """Start a trainer, watch it and remediate until it finishes; then summarise.

    The trainer command goes after `--`; with none, the embedded demo trainer (a tiny CPU PPO) runs.
    """
    _logging(verbose)
    command: list[str] | None = ctx.meta.get(TRAINER_COMMAND)
    if command is not None and not command:  # an empty $CMD: never the demo trainer in its place
        console.print("nothing after --: give the trainer command after it (watchdog run [OPTIONS] -- COMMAND ...), "
                      "or leave -- out to train the embedded demo trainer", style="red")
        raise typer.Exit(2)
    # Ctrl-C (SIGINT), SIGTERM (what `timeout`, systemd, docker and Kubernetes send) and SIGHUP (the
    # terminal closed) all stop the run cleanly, even when this process was started in the background
    # by a shell, which starts it with SIGINT ignored (a supervisor's `kill -INT` must still work).
    # SIGUSR1: save a checkpoint first, then stop (the allocation's time limit is near).
    stop = _stop_on_signals(checkpoint_stop=True)
    if not (math.isfinite(tick) and tick > 0):
        console.print(f"--tick must be a positive number of seconds, got {tick!r}", style="red")
        raise typer.Exit(2)
    if ray_address:
        _check_ray(ray_address, ray_token_file)
    elif ray_token_file is not None:
        console.print("--ray-token-file is for a Ray cluster: give --ray-address too", style="red")
        raise typer.Exit(2)
    try:
        src = source_config(source, prometheus_url, file_sd_dir)
    except ValueError as exc:
        console.print(f"--source: {exc}", style="red")
        raise typer.Exit(2) from exc
    rd = Path(run_dir or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    _check_run_dir_name(rd, bool(command))
    try:
        rundir.check_writable(rd)  # the trainer and the watchdog both write here
    except OSError as exc:
        console.print(f"--run-dir {rd}: cannot be written ({exc.strerror or exc})", style="red")
        raise typer.Exit(2) from exc
    if command:
        cmd = list(command)
    else:
        cmd = [sys.executable, "-m", "ppo_watchdog.trainer", f"trainer.run_dir={rd}", "trainer.progress=false"]
        if faults:
            cmd.append(hydra.format_override("trainer.faults", faults))
        cmd += _checked_overrides(sets or [], "--set")
        if src.kind == "prometheus" and not any(s.startswith("trainer.metrics_port=") for s in sets or []):
            cmd.append("trainer.metrics_port=-1")  # Prometheus must scrape it: any free port, in run.json
    _check_mode(mode, cmd)
    try:
        wd = build_watchdog(
            state_dir or state_dir_default(), rule_paths(rules, extra_rules or ()), None,
            controller={"restart_budget": restart_budget, "oom_retry_budget": oom_retries,
                        "heartbeat_min_s": heartbeat_min, "startup_timeout_s": startup_timeout,
                        "tuning_relaunch_every": tuning_relaunch_every, "startup_s": startup_s,
                        "on_escalate": on_escalate, "pause_timeout_s": pause_timeout, "advise": advise,
                        "approve": approve, "approve_timeout_s": approve_timeout},
            actuator={"live_timeout_s": live_timeout, "stop_grace_s": stop_grace},
            metrics_port=metrics_port, crash_hook=_crash_hook(), webhook_url_file=webhook_url_file,
            exclusive=True, tell=_say_line,
        )
    except (ValueError, StoreError, locks.LockHeld) as exc:  # a bad setting (--on-escalate maybe), a state dir
        console.print(f"{exc}", style="red")                   # that is a file, one another watchdog holds
        raise typer.Exit(2) from exc
    except (FileNotFoundError, OSError) as exc:  # a --rules file that is not there
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    try:
        # Shared with the daemon: the run dir is taken, then set up for its mode, then registered.
        ctl = wd.add_run(rd, command=cmd, ray_address=ray_address, ray_token_file=ray_token_file, source=src,
                         mode=mode, run_metrics_port=run_metrics_port)
    except (OSError, ValueError) as exc:  # the run dir another watchdog or a live trainer holds; a bad run.json
        wd.close()
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    console.print(Text.assemble("watchdog: run ", (ctl.run.run_id, "bold"), f" in {rd} (state {wd.store.path})"))
    if isinstance(wd.rules, EngineRules):  # (what build_watchdog builds; the protocol has no files)
        console.print(packs_text(wd.rules.ruleset))
    if not command:
        console.print("no trainer command (after --): training the embedded demo trainer (python -m ppo_watchdog.trainer"
                      f"{', faults ' + faults if faults else ''}); its console is in {rd / wd.actuator.config.log_name}")
    if advise:
        console.print("advise mode: every decision is said as what the watchdog would do; nothing is carried out")
    elif ctl.config.approve:
        console.print(f"approval: each {', '.join(ctl.config.approve)} waits for `watchdog approve {ctl.run.run_id}` "
                      f"(or `deny`) up to {duration_text(approve_timeout)}")
    try:
        # A progress line on a terminal only: piped (a log, CI), the lines are the events alone.
        wd.serve_forever(tick, until_done=True, stop=stop.event, beside=Progress(ctl) if sys.stdout.isatty() else None)
    except KeyboardInterrupt:  # a second signal while the scheduler was finishing its tick
        stop.signals.append(signal.SIGINT)
    if stop.signals:
        _interrupted(wd, ctl, stop.signals[0], checkpoint_wait)
        raise typer.Exit(128 + stop.signals[0])
    wd.close(withdraw_targets=True)
    run = wd.store.require_run(ctl.run.run_id)
    decisions = wd.store.decisions(run.run_id)
    _print_story(run, decisions)
    verdict = next((j.result.get("outcome", "") for j in reversed(wd.store.journal(run.run_id))
                    if j.kind == JournalKind.STOP and j.status == ActionStatus.DONE), "")
    if verdict:
        console.print(f"verdict: {verdict}", style="red")
    # The newest give-up, when it was a refused configuration (not one of an earlier attempt in this run dir).
    given_up = next((d for d in reversed(decisions) if d["kind"] == "escalate"), None)
    refused = given_up if given_up and given_up["rule"] in (RULE_CONFIG, RULE_TICK) and run.phase == Phase.FAILED \
        else None
    if refused is not None:  # the cause, where the user looks (it is also in trainer.log and `history`)
        console.print(f"{refused['message']}", style="red")
    if report:
        try:
            from ppo_watchdog.observe.report import restart_spans, write_report

            for suffix in (".html", ".png"):
                path = write_report(rd, decisions, rd / f"report{suffix}", restart_spans(decisions), run)
            console.print(f"report: {rd / 'report.html'} and {path}")
        except Exception as exc:  # a failed report must not hide the run's outcome
            console.print(f"report not written: {exc}", style="yellow")
    console.print(f"history: watchdog history {run.run_id} --json")
    # 2: the trainer refused its configuration (bad input, as a bad option would be); 1: the run failed.
    raise typer.Exit(0 if run.phase == Phase.FINISHED else 2 if refused is not None else 1)


#: Seconds between two progress lines of ``watchdog run`` on a terminal.
PROGRESS_EVERY_S = 5.0


class Progress:
    """``watchdog run``'s progress line on a terminal: step, steps a second, the last score (and validation score),
    at most every ``every_s`` seconds and only when the step moved; called between ticks (``serve_forever``'s
    ``beside``)."""

    def __init__(self, ctl: Any, every_s: float = PROGRESS_EVERY_S, clock: Any = time.monotonic,
                 say: Any = None) -> None:
        self.ctl, self.every_s, self.clock = ctl, every_s, clock
        self.say = say or (lambda line: console.print(line, style="dim", highlight=False))
        self.at, self.step = clock(), ctl.run.last_step

    def __call__(self) -> bool:
        now, step = self.clock(), self.ctl.run.last_step
        if now - self.at < self.every_s or step is None or step == self.step:
            return True
        rate = (step - (self.step or 0)) / (now - self.at)
        latest = self.ctl.latest
        val = f", validation {number(latest['val_score'])}" if "val_score" in latest else ""
        self.say(f"step {step}, {rate:.2g} steps/s, score {number(latest.get('reward', math.nan))}{val}")
        self.at, self.step = now, step
        return True


class _Stop:
    """The first stop signal sets ``event`` (the scheduler finishes its tick, then the run is stopped);
    a second one raises KeyboardInterrupt (kill the trainer now)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signals: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.signals.append(signum)
        self.event.set()


#: How each stop signal is named on the console (the exit code is 128 + its number: 130, 143, 129).
STOP_SIGNALS: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
#: `watchdog run` only: ask the trainer for a checkpoint, then stop (exit 138): what a batch system sends
#: before its wall-clock limit (Slurm's ``--signal=B:USR1@SECONDS``, forwarded by the batch script).
CHECKPOINT_STOP_SIGNAL = signal.SIGUSR1


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop_on_signals(checkpoint_stop: bool = False) -> _Stop:
    stop = _Stop()
    for sig in (*STOP_SIGNALS, *([CHECKPOINT_STOP_SIGNAL] if checkpoint_stop else [])):
        signal.signal(sig, stop)
    return stop


def _check_run_dir_name(rd: Path, own_command: bool) -> None:
    """The embedded trainer gets its run dir as a Hydra override: a path Hydra's grammar cannot carry (a
    non-ASCII letter, a quote) would fail at every launch; exit 2 naming it before anything starts."""
    if own_command:
        return
    try:
        hydra.parse(f"trainer.run_dir={rd}")
    except hydra.OverrideError as exc:
        console.print(f"--run-dir {rd}: not a path the trainer can be given as trainer.run_dir ({exc}); "
                      "use ASCII letters, digits and - _ . / in it", style="red")
        raise typer.Exit(2) from exc


def _interrupted(wd: Any, ctl: Any, signum: int = signal.SIGINT, checkpoint_wait: float = 240.0) -> None:
    """Ctrl-C, SIGTERM or SIGHUP: stop the trainer (SIGTERM: it saves; a second signal kills it) and record
    the run as stopped, with what stopped it. SIGUSR1: ask the trainer for a checkpoint (the protocol's
    ``stop`` command), give it ``checkpoint_wait`` seconds, then the same. A ``watchdog run`` owns its
    trainer: it never leaves it running unwatched."""
    name = STOP_SIGNALS.get(signum, signal.Signals(signum).name)
    for sig in (*STOP_SIGNALS, CHECKPOINT_STOP_SIGNAL):  # before it is said: a second signal kills the trainer
        signal.signal(sig, _raise_interrupt)
    code: int | None = None
    saved = ""
    try:
        if signum == CHECKPOINT_STOP_SIGNAL:
            console.print(f"{name}: asking the trainer to save a checkpoint and stop (up to {checkpoint_wait:g} s; "
                          "Ctrl-C or a second signal kills it)")
            saved, code = wd.actuator.checkpoint_and_stop(ctl.h, f"{name}: the allocation's time limit is near",
                                                          checkpoint_wait)
        else:
            console.print(f"interrupted: stopping the trainer ({name}; it saves a checkpoint first; Ctrl-C or {name} "
                          "again kills it)")
            code = wd.actuator.stop(ctl.h)
    except KeyboardInterrupt:
        console.print("interrupted again: killing the trainer")
        if ctl.h.proc is not None:
            ctl.h.proc.signal(signal.SIGKILL)
    alive = ctl.h.proc is not None and ctl.h.proc.alive()
    step = ctl.run.last_step if ctl.run.last_step is not None else 0
    outcome = (f"watchdog stopped by {name}: {saved or f'trainer stopped (exit {code})'}" if not alive else
               f"watchdog stopped by {name}: trainer pid {ctl.h.proc.pid} still alive, UNSUPERVISED")
    wd.store.add_decision(ctl.run.run_id, step, "watchdog:shutdown", "escalate", [], {"signal": float(signum)},
                          "warning", outcome, status="applied", outcome=outcome)
    wd.store.update_run(ctl.run.run_id, phase=Phase.STOPPED, **({"exit_code": code} if code is not None else {}))
    wd.close(withdraw_targets=True)
    console.print(f"run {ctl.run.run_id} stopped by {name}; `watchdog run` with the same --run-dir resumes it")


@run_app.command("daemon")
@_restoring_signals
def daemon_cmd(
    config: Annotated[Path, typer.Option("--config", help="Daemon YAML: runs, rules, state_dir, tick_s, "
                                         "metrics_port, webhook_url, controller, actuator, shards.")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    shard: Annotated[int | None, typer.Option(
        "--shard", hidden=True, help="A sharded daemon's child K (1 .. shards-1), started by shard 0.")] = None,
) -> None:
    """Watch many run directories and serve the watchdog's own /metrics."""
    _logging(verbose)
    try:
        cfg = load_daemon_config(config)
    except DaemonConfigError as exc:
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    if shard is None:
        console.print(f"watchdog daemon: {len(cfg.runs)} run(s), tick {cfg.tick_s}s, state {cfg.state_dir}"
                      + (f", {cfg.shards} shards (processes)" if cfg.shards > 1 else ""))
        try:  # said, and refused whole with every error, before anything is started
            console.print(packs_text(load_rules(rule_paths(cfg.rules))))
        except RuleFileError as exc:
            for err in exc.errors:
                console.print(f"{err}", style="red")
            console.print(f"{config}: rules: {len(exc.errors)} error(s) in rule files", style="red")
            raise typer.Exit(2) from exc
        except FileNotFoundError as exc:
            console.print(f"{config}: rules: {exc}", style="red")
            raise typer.Exit(2) from exc
    stop = _stop_on_signals()
    try:
        wd = run_daemon(cfg, stop=stop.event, config_path=config, shard=shard,
                        say=functools.partial(console.print, highlight=False))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    except (DaemonConfigError, StoreError, locks.LockHeld) as exc:  # e.g. a Grafana token file that cannot be
        console.print(f"{config}: {exc}", style="red")                # read, a state another watchdog holds
        raise typer.Exit(2) from exc
    # A daemon that stops leaves its trainers running for the next daemon to adopt (a deploy, a reboot
    # of the watchdog's host): said here, and `watchdog status` says it of each run until then.
    left = [(c.run, c.h.proc.pid) for c in wd.controllers.values() if c.h.proc is not None and c.h.proc.alive()]
    name = STOP_SIGNALS.get(stop.signals[0], "a signal") if stop.signals else "request"
    who = f"watchdog daemon shard {shard or 0}" if cfg.shards > 1 else "watchdog daemon"
    console.print(f"{who} stopped by {name}; {len(left)} trainer(s) left running UNSUPERVISED until a "
                  f"daemon or `watchdog run` adopts them" + "".join(
                      f"\n  {run.run_id}: pid {pid} in {run.run_dir}" for run, pid in left))


@run_app.command("status")
def status_cmd(
    run: Annotated[str | None, typer.Argument(help="Run id (default: all runs).")] = None,
    state_dir: StateDir = "",
    as_json: Annotated[bool, typer.Option("--json", help="Every field, as JSON.")] = False,
) -> None:
    """Runs as an operator reads them: phase, step, age of the newest metric, start, last action, why it ended
    or waits, and the pids that are alive."""
    try:
        store = Store(state_dir or state_dir_default(), create=False, busy_timeout_s=5.0, read_only=True)
    except NoState as exc:  # exit 2 as `history` does: a state directory that is not there is bad input
        console.print(f"no runs in {exc.path}: no watchdog state there{_empty_note(exc.path)} "
                      "(give --state-dir or set $WATCHDOG_STATE_DIR to look elsewhere)", style="red")
        raise typer.Exit(2) from exc
    except StoreError as exc:
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    try:
        runs = [store.require_run(run)] if run else store.list_runs()
    except StoreError as exc:
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    now = time.time()
    rows: list[dict[str, Any]] = []
    for r in runs:
        engine = (store.load_engine_state(r.run_id) or {}).get("engine", {})
        # A run that has ended fires nothing: its rules' last states are history, not an alarm.
        firing = [] if r.phase in DONE_PHASES else sorted(
            n for n, s in engine.get("rules", {}).items() if s.get("status") == RuleStatus.FIRING)
        open_n = len(store.open_actions(r.run_id))
        watcher, trainer = supervision(r.run_dir, store.path.parent)
        decisions = store.decisions(r.run_id)
        shown = [d for d in decisions if shown_in_history(d)]
        waiting = [f"{j.kind} (decision {j.decision_id})" for j in store.awaiting(r.run_id)]
        rows.append({"why": _why(r, decisions, waiting),
                     "run": r.run_id, "phase": r.phase, "pid": r.pid, "job_id": r.job_id, "last_step": r.last_step,
                     "control_version": r.control_version, "restarts": r.restarts, "oom_retries": r.oom_retries,
                     "open_actions": open_n, "firing": firing, "overrides": r.overrides, "run_dir": r.run_dir,
                     "watchdog": watcher, "trainer_alive": trainer is not None,
                     "supervised": _supervised_text(r.phase, watcher, trainer),
                     "started": r.created or None, "last_progress": r.last_progress_ts,
                     "last_action": decision_text(shown[-1]) if shown else None,
                     "pids": _live_pids(r.pid, r.job_id, watcher, trainer),
                     "waiting_approval": waiting,
                     "advised": store.decision_counts(r.run_id).get(DecisionStatus.ADVISED.value, 0)})
    if as_json:
        typer.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if not rows:
        console.print(f"no runs in {store.path} (give --state-dir or set $WATCHDOG_STATE_DIR to look elsewhere)")
        return
    t = Table(title="watchdog runs")
    for col in ("run", "phase", "step", "age", "started", "last action", "why", "pids"):
        t.add_column(col, overflow="fold")
    for row in rows:
        phase = str(row["phase"]) + (f" (firing: {', '.join(row['firing'])})" if row["firing"] else "")
        t.add_row(row["run"], phase, "-" if row["last_step"] is None else str(row["last_step"]),
                  _ago(now, row["last_progress"]), _when(row["started"]), row["last_action"] or "-",
                  row["why"] or "-", row["pids"] or "-")
    console.print(t)
    for row in rows:
        if str(row["supervised"]).startswith("UNSUPERVISED"):
            console.print(f"{row['run']}: {row['supervised']}", style="red")
        if isinstance(waits := row["waiting_approval"], list) and waits:
            console.print(f"{row['run']}: {', '.join(map(str, waits))} waits for a person: `watchdog history "
                          f"{row['run']} --advised` says what and why; `watchdog approve {row['run']}` or `deny`",
                          style="yellow")


def _why(r: Any, decisions: list[dict[str, Any]], waiting: list[str]) -> str | None:
    """Why a run ended stopped or failed, or why it waits: its newest escalation's outcome (a signal, a verdict, a
    give-up), an approval it waits for, or the trainer's exit code."""
    if waiting:
        return f"waits for approval: {', '.join(waiting)}"
    if r.phase not in (Phase.STOPPED, Phase.FAILED, Phase.PAUSED, Phase.ESCALATED):
        return None
    ended = [d for d in decisions if d["kind"] == "escalate"]
    if r.phase == Phase.PAUSED and not ended:
        ended = [d for d in decisions if shown_in_history(d)]
    if ended:
        return str(ended[-1]["outcome"] or ended[-1]["message"])
    return f"the trainer exited with code {r.exit_code}" if r.exit_code is not None else None


def _live_pids(pid: int | None, job_id: str | None, watcher: dict[str, Any] | None,
               trainer: dict[str, Any] | None) -> str:
    """The trainer's and the watchdog's pids, each only while its lock says it is alive (a dead pid may be
    another process's by now)."""
    out = []
    if trainer is not None:
        out.append(f"trainer {trainer.get('pid') or pid or '?'}")
    elif job_id:
        out.append(f"ray job {job_id}")
    if watcher is not None:
        out.append(f"watchdog {watcher.get('pid', '?')}")
    return ", ".join(out)


def _ago(now: float, ts: float | None) -> str:
    """``42s``, ``7m``, ``3h05m``, ``2d4h``: how long ago, as kubectl's AGE reads."""
    if not ts:
        return "-"
    s = max(0, int(now - ts))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def supervision(run_dir: str, state_dir: Path | None = None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the watchdog holding the run directory, the trainer holding it), each None when none does: read from
    their locks, which die with their holders (a killed watchdog's record still says "running").

    A run lock that is no lock file any more (removed, or replaced by a FIFO or a directory after the watchdog
    took it: the watchdog holds the old file) tells nothing; the watchdog holding ``state_dir``, the one that
    watches the runs of that state, is asked then, and its note says why."""
    run_lock = Path(run_dir) / locks.RUN_LOCK
    watcher = locks.holder_if_held(run_lock)
    if watcher is None and state_dir is not None:
        try:
            mode = run_lock.lstat().st_mode
            unusable = None if stat.S_ISREG(mode) else f"{run_lock} is not a regular file"
        except FileNotFoundError:
            unusable = f"{run_lock} is gone"
        except OSError as exc:
            unusable = f"{run_lock} cannot be read ({exc.strerror or exc})"
        state = locks.holder_if_held(state_dir / locks.STATE_LOCK) if unusable else None
        if state is not None:
            watcher = {**state, "note": f"{unusable}: told by the state's lock"}
    return watcher, locks.holder_if_held(Path(run_dir) / locks.TRAINER_LOCK)


def _supervised_text(phase: str, watcher: dict[str, Any] | None, trainer: dict[str, Any] | None) -> str:
    if watcher is not None:
        return f"by {locks.describe_holder(watcher)}" + (f" ({watcher['note']})" if watcher.get("note") else "")
    if trainer is not None:
        return (f"UNSUPERVISED: {locks.describe_holder(trainer)} runs with no watchdog watching it "
                "(`watchdog run` on its run dir, or a daemon, adopts it)")
    if phase in (Phase.RUNNING, Phase.PAUSED, Phase.ESCALATED, Phase.RESTARTING):
        return "no watchdog and no trainer (the watchdog that ran it is gone)"
    return "-"


def _empty_note(path: Path) -> str:
    try:
        return " (an empty file: nothing was written to it)" if path.is_file() and path.stat().st_size == 0 else ""
    except OSError:
        return ""


def _history_rows(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{
        "id": d["id"], "run": d["run_id"], "step": d["step"], "rule": d["rule"], "kind": d["kind"],
        "severity": d["severity"], "message": d["message"], "inputs": d["inputs"], "actions": d["actions"],
        "status": d["status"], "outcome": d["outcome"], "signals": d.get("signals", {}),
        "cost": cost_text(d["journal"]), "sentence": sentence(d),
        "journal": [{"id": j["id"], "kind": j["kind"], "status": j["status"], "control_version": j["control_version"],
                     "set": j["payload"].get("set"), "cost": j["payload"].get("cost"), "result": j["result"]}
                    for j in d["journal"]],
    } for d in decisions]


def _print_history(decisions: list[dict[str, Any]], title: str, by_run: bool = False) -> None:
    """The decisions as a table, each said in one sentence; ``by_run``: each row names its run."""
    t = Table(title=title)
    for col in ("run",) * by_run + ("step", "rule", "what happened", "cost"):
        t.add_column(col, overflow="fold")
    for d in decisions:
        t.add_row(*(d["run_id"],) * by_run, str(d["step"]), d["rule"], sentence(d), cost_text(d["journal"]))
    console.print(t)


def _print_story(run: RunRecord, decisions: list[dict[str, Any]], all_decisions: bool = False) -> None:
    """A run's story: the header (outcome, steps, duration, values changed, validation, actions), then one line
    per decision that acted, was advised or waits (all with ``all_decisions``)."""
    told = story(run, decisions, all_decisions)
    first, *rest = told.header
    console.print(first, style="bold", highlight=False, soft_wrap=True)
    for line in rest + told.lines:
        _say_line(run.run_id, line)


def _say_line(run: str, line: str) -> None:
    """One line of what happened: never broken by the console (a terminal wraps it; a pipe or a log keeps it one
    line, as grep and the line count want it)."""
    console.print(line, highlight=False, soft_wrap=True)


@run_app.command("history")
def history_cmd(
    run: Annotated[str | None, typer.Argument(help="Run id (default: all runs).")] = None,
    state_dir: StateDir = "",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list: step, rule, inputs, outcome, journal.")] = False,
    all_decisions: Annotated[bool, typer.Option("--all", help="Include resolves and no-op decisions.")] = False,
    advised: Annotated[bool, typer.Option(
        "--advised", help="What the watchdog would have done: each advised, waiting or denied decision with its "
                          "step, rule, the action in words and what it would have cost; totals.")] = False,
) -> None:
    """What the watchdog did in a run, in words: its outcome, then each action with its step, rule and why
    (one run: the end-of-run summary; all runs: a table). --json keeps the raw inputs and journal."""
    store = _store(state_dir)
    if run and store.get_run(run) is None:
        console.print(f"{store.path}: no run {run!r}", style="red")
        raise typer.Exit(2)
    if advised:
        rows, totals = would_have_done(store.decisions(run))
        if as_json:
            typer.echo(json.dumps({"decisions": rows, "totals": totals}, indent=2, sort_keys=True))
        else:
            _print_would_have_done(rows, totals, run)
        return
    decisions = [d for d in store.decisions(run) if all_decisions or acted(d)]
    if as_json:
        typer.echo(json.dumps(_history_rows(decisions), indent=2, sort_keys=True))
    elif run:  # one run: its story, as `watchdog run` ends with it
        _print_story(store.require_run(run), store.decisions(run), all_decisions)
    else:
        _print_history(decisions, title="history of all runs", by_run=True)


#: Decisions whose actions were not carried out by the watchdog itself: advised, waiting for a person, denied.
NOT_DONE = (DecisionStatus.ADVISED.value, DecisionStatus.WAITING.value, DecisionStatus.DENIED.value)


def would_have_done(decisions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``history --advised``: per advised, waiting or denied decision, its step, rule, status, each action in
    words and what it would have cost; and the totals (decisions, actions by kind, relaunches, the seconds and
    steps they would have cost)."""
    rows: list[dict[str, Any]] = []
    by_kind: dict[str, int] = {}
    seconds, steps, relaunches = 0.0, 0, 0
    for d in decisions:
        if d["status"] not in NOT_DONE:
            continue
        entries = [j for j in d["journal"] if j["status"] in (ActionStatus.ADVISED, ActionStatus.AWAITING,
                                                               ActionStatus.DENIED)]
        said = []
        for j in entries:
            by_kind[j["kind"]] = by_kind.get(j["kind"], 0) + 1
            words = str(j["result"].get("would") or j["result"].get("outcome") or j["kind"])
            said.append(words.removeprefix("would "))
            cost = j["payload"].get("cost")
            if isinstance(cost, dict) and cost.get("relaunch"):
                relaunches += 1
                seconds += float(cost.get("seconds") or 0.0)
                steps += int(cost.get("steps_lost") or 0)
            elif isinstance(cost, dict) and cost.get("in_process"):
                steps += int(cost.get("steps_lost") or 0)  # (a restore in process: its steps, no relaunch)
        rows.append({"decision": d["id"], "run": d["run_id"], "step": d["step"], "rule": d["rule"],
                     "status": d["status"], "actions": said, "cost": cost_text(d["journal"]),
                     "outcome": d["outcome"]})
    totals = {"decisions": len(rows), "actions": by_kind, "relaunches": relaunches,
              "relaunch_seconds": round(seconds, 3), "steps_trained_again": steps}
    return rows, totals


def _print_would_have_done(rows: list[dict[str, Any]], totals: dict[str, Any], run: str | None) -> None:
    t = Table(title=f"What the watchdog would have done in {f'run {run}' if run else 'all runs'}")
    for col in ("decision",) + ("run",) * (run is None) + ("step", "rule", "status", "action", "cost"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(str(r["decision"]), *(r["run"],) * (run is None), str(r["step"]), r["rule"], r["status"],
                  "; ".join(r["actions"]) or "-", r["cost"])
    console.print(t)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(totals["actions"].items())) or "no action"
    console.print(f"{totals['decisions']} decision(s) not carried out: {kinds}; {totals['relaunches']} relaunch(es) "
                  f"that would have cost ~{totals['relaunch_seconds']:.0f} s and {totals['steps_trained_again']} "
                  "step(s) trained again")


def _answer(run: str, decision: int | None, state_dir: str, approved: bool, reason: str) -> None:
    """``approve`` / ``deny``: the answer written into the state, once, for the watchdog watching the run to
    carry out at its next tick (as ``resume`` reaches it)."""
    verb = "approve" if approved else "deny"
    store = _store(state_dir, read_only=False)
    try:
        r = store.require_run(run)
        entries = store.awaiting(run)
    except StoreError as exc:
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    waiting = sorted({e.decision_id for e in entries if e.decision_id is not None})
    listed = ", ".join(f"{e.decision_id} ({e.kind}: {e.result.get('would', '')})" for e in entries)
    if decision is not None:
        entries = [e for e in entries if e.decision_id == decision]
    if not entries:
        what = f"decision {decision} of run {run}" if decision is not None else f"run {run}"
        console.print(f"nothing to {verb}: no action of {what} waits for approval"
                      + (f" (waiting: {listed})" if listed else ""), style="red")
        raise typer.Exit(2)
    if decision is None and len(waiting) > 1:
        console.print(f"run {run}: {len(waiting)} decisions wait for approval: {listed}; name one "
                      f"(`watchdog {verb} {run} DECISION`)", style="red")
        raise typer.Exit(2)
    who = os.environ.get("USER") or os.environ.get("LOGNAME") or f"uid {os.getuid()}"
    answer = {"approved": approved, "by": who, "ts": time.time(), **({"reason": reason} if reason else {})}
    said = []
    try:
        for e in entries:
            if store.answer_approval(e.id, answer):
                said.append(f"{e.kind} (decision {e.decision_id}, journal {e.id}): {e.result.get('would', e.kind)}")
    except StoreError as exc:  # locked past the timeout by a writer: said, nothing recorded
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    if not said:  # the deadline or another person answered between the read and the write
        console.print(f"nothing to {verb}: the action of run {run} was answered meanwhile "
                      f"(`watchdog history {run}` says how)", style="red")
        raise typer.Exit(2)
    watcher, _ = supervision(r.run_dir)
    when = ("the watchdog carries it out at its next tick" if approved else
            "the watchdog closes it at its next tick, alerted, and the run carries on")
    if watcher is None:
        when += " (no watchdog watches this run now: the one that next does)"
    console.print(f"{'approved' if approved else 'denied'} by {who}: " + "; ".join(said) + f"; {when}")


Decision = Annotated[int | None, typer.Argument(help="The decision (its id in `watchdog history`); default: the "
                                                     "one that waits.")]


@run_app.command("approve")
def approve_cmd(run: Annotated[str, typer.Argument(help="Run id.")], decision: Decision = None,
                state_dir: StateDir = "",
                reason: Annotated[str, typer.Option("--reason", help="Why, for the record.")] = "") -> None:
    """Carry out an action that waits for approval (--approve): at the watchdog's next tick."""
    _answer(run, decision, state_dir, True, reason)


@run_app.command("deny")
def deny_cmd(run: Annotated[str, typer.Argument(help="Run id.")], decision: Decision = None,
             state_dir: StateDir = "",
             reason: Annotated[str, typer.Option("--reason", help="Why, for the record.")] = "") -> None:
    """Refuse an action that waits for approval: it is never carried out, the run carries on, alerted."""
    _answer(run, decision, state_dir, False, reason)


@run_app.command("resume")
def resume_cmd(run: Annotated[str, typer.Argument(help="Run id.")], state_dir: StateDir = "") -> None:
    """Clear a pause or escalation: the watchdog sends `resume` at its next tick."""
    store = _store(state_dir, read_only=False)
    try:
        r = store.require_run(run)
    except StoreError as exc:
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    if r.phase in DONE_PHASES:  # nothing watches it any more: a queued resume would never be sent
        console.print(f"run {run} has {r.phase}: there is nothing to resume (start it again with "
                      f"`watchdog run --run-dir {r.run_dir}`)", style="red")
        raise typer.Exit(2)
    try:
        aid = store.add_action(run, "resume", {"rule": "human:resume", "requested_phase": r.phase})
    except StoreError as exc:  # locked past the timeout by a writer: said, nothing queued
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    console.print(f"resume of {run} queued (journal {aid}); the watchdog applies it at its next tick")


@run_app.command("report")
def report_cmd(
    run: Annotated[str, typer.Argument(help="Run id.")],
    out: Annotated[Path, typer.Option("--out", help="FILE.png or FILE.html")],
    state_dir: StateDir = "",
) -> None:
    """KL, reward, value loss, lr and kl_coef over steps with the watchdog's actions."""
    from ppo_watchdog.observe.report import ReportError, restart_spans, write_report

    store = _store(state_dir)
    try:
        r = store.require_run(run)
        decisions = store.decisions(run)
        path = write_report(r.run_dir, decisions, out, restart_spans(decisions), r)
    except (StoreError, ReportError) as exc:  # no such run, nothing to plot, not .png/.html: bad input
        console.print(f"{exc}", style="red")
        raise typer.Exit(2) from exc
    except OSError as exc:  # --out in a directory that cannot be created or written
        console.print(f"--out {out}: cannot be written ({exc.strerror or exc})", style="red")
        raise typer.Exit(2) from exc
    console.print(f"report written: {path}")
