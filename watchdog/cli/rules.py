"""`watchdog rules ...`, `watchdog replay`, `watchdog check` and `watchdog eval`: rule packs and recorded runs.

Exit codes (the convention of every command, see ppo_watchdog.cli): 0 success; 1 the thing judged
failed (a rule test, a labelled run of ``eval``); 2 bad input or usage (a missing file, an
unreadable log, a rule file that does not load, ``rules check`` finding errors). Messages for a
person go to stderr; ``--json`` output alone goes to stdout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ppo_watchdog.cli.console import CliConsole
from ppo_watchdog.core.actions import value_problem
from ppo_watchdog.core.rulefile import DEFAULT_PACK, RULES_ENV, rule_paths
from ppo_watchdog.core.vocabulary import DecisionKind
from ppo_watchdog.protocol import catalog, hydra, rundir
from ppo_watchdog.protocol.events import Event
from ppo_watchdog.protocol.runinfo import RunInfo, RunInfoError

log = logging.getLogger(__name__)

rules_app = typer.Typer(
    help="Rule packs: list, check, unit-test, explain and calibrate rules.",
    no_args_is_help=True,
)
commands = typer.Typer()
"""Top-level commands of this module (replay, eval), joined to the root app by ``ppo_watchdog.cli``."""


# -- helpers ------------------------------------------------------------------------------


def _console(stderr: bool = False) -> Console:
    # $COLUMNS, else the terminal's width, else wide (ppo_watchdog.cli.console); no markup: rule descriptions,
    # metric names and log names are printed as they are ("[/x]" too).
    return CliConsole(stderr=stderr, soft_wrap=False)


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _expand(paths: Sequence[Path]) -> list[Path]:
    """Files as given; a directory contributes its *.yaml / *.yml files, sorted."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            try:
                out.extend(sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml") and q.is_file()))
            except OSError as exc:
                _fail(f"{p}: cannot be listed ({exc.strerror or exc})")
        elif p.exists():
            out.append(p)
        else:
            _fail(f"{p}: no such file or directory")
    return out


def _load(paths: Sequence[Path] | None, extra: Sequence[Path] | None = None) -> Any:
    """Load a rule set (``--rules``, ``default`` by name, then ``--extra-rules``); every error on stderr as
    file:line:col and exit 2."""
    from ppo_watchdog.core.rulefile import RuleFileError, load_rules

    try:
        files = _expand(rule_paths(paths, extra or ()))
    except FileNotFoundError as exc:
        _fail(str(exc))
    if not files:
        _fail("no rule files given")
    try:
        return load_rules(files)
    except RuleFileError as exc:
        for err in exc.errors:
            typer.echo(str(err), err=True)
        _fail(f"{len(exc.errors)} error(s) in rule files", 2)
    except OSError as exc:
        _fail(f"{getattr(exc, 'filename', '') or ''}: {exc.strerror or exc}")


def _rules_of(ruleset: Any) -> list[Any]:
    rules = getattr(ruleset, "rules", ruleset)
    return list(rules.values()) if isinstance(rules, dict) else list(rules)


def _expr_text(rule: Any, attr: str) -> str:
    v = getattr(rule, attr, None)
    if v is None:
        return ""
    return str(getattr(v, "source", v))


def _budget_text(b: Any) -> str:
    if b is None:
        return ""
    esc = "; ".join(_describe_action(a) for a in getattr(b, "escalate", ()))
    return f"{b.max} fires per {b.window} steps, then {esc or 'escalate'}"


def _rule_json(rule: Any) -> dict[str, Any]:
    """A rule as plain JSON: every field of the rule file, plus the metrics it reads."""
    if hasattr(rule, "to_json"):
        return dict(rule.to_json())
    budget = getattr(rule, "budget", None)
    return {
        "name": rule.name,
        "description": getattr(rule, "description", ""),
        "expr": _expr_text(rule, "expr"),
        "clear": _expr_text(rule, "clear") or None,
        "for": getattr(rule, "for_", 0),
        "keep_firing_for": getattr(rule, "keep_firing_for", 0),
        "cooldown": getattr(rule, "cooldown", 0),
        "repeat": getattr(rule, "repeat", False),
        "budget": None if budget is None else {
            "max": budget.max, "window": budget.window,
            "escalate": [a.to_json() for a in getattr(budget, "escalate", ())],
        },
        "severity": getattr(rule, "severity", ""),
        "labels": dict(getattr(rule, "labels", {}) or {}),
        "enabled": getattr(rule, "enabled", True),
        "divergence": getattr(rule, "divergence", False),
        "actions": [a.to_json() for a in getattr(rule, "actions", ())],
        "metrics": _metrics_read(rule),
        "source": getattr(rule, "source", ""),
    }


def _metrics_read(rule: Any) -> list[str]:
    names: set[str] = set()
    for attr in ("expr", "clear", "condition", "clear_expr"):
        v = getattr(rule, attr, None)
        names |= set(getattr(v, "metrics", ()) or ())
    return sorted(names)


def _describe_action(a: Any) -> str:
    return a.describe() if hasattr(a, "describe") else json.dumps(a.to_json())


# -- rules --------------------------------------------------------------------------------

RulesOpt = Annotated[
    list[Path] | None,
    typer.Option("--rules", "-r", help=f"Rule file or directory (repeatable); '{DEFAULT_PACK}' names the shipped "
                                       f"default pack. Default: ${RULES_ENV}, else the default pack. Replaces the pack: "
                                       "to add to it, --extra-rules."),
]
ExtraRulesOpt = Annotated[
    list[Path] | None,
    typer.Option("--extra-rules", help="Rule file or overlay added to the pack (repeatable), after --rules or the "
                                       "default pack: your rules beside its NaN, KL and OOM protection."),
]


@rules_app.command("list")
def rules_list(
    files: Annotated[list[Path] | None, typer.Argument(help="Rule files or directories (default: the default pack).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rules as a JSON list.")] = False,
) -> None:
    """List the rules of FILES: name, severity, condition, `for`, cooldown and actions."""
    rules = _rules_of(_load(files))
    if as_json:
        typer.echo(json.dumps([_rule_json(r) for r in rules], indent=2, default=str))
        return
    t = Table(title=f"{len(rules)} rules", show_lines=False)
    for col in ("rule", "severity", "on", "condition", "for", "cooldown", "actions"):
        t.add_column(col, overflow="fold")
    for r in rules:
        t.add_row(
            r.name, str(getattr(r, "severity", "")), "yes" if getattr(r, "enabled", True) else "no",
            _expr_text(r, "expr"), str(getattr(r, "for_", getattr(r, "for_steps", ""))),
            str(getattr(r, "cooldown", "")),
            "; ".join(_describe_action(a) for a in getattr(r, "actions", ())),
        )
    _console().print(t)


@rules_app.command("check")
def rules_check(
    files: Annotated[list[Path], typer.Argument(help="Rule files or directories to validate.")],
) -> None:
    """Validate rule files: every error is printed as file:line:col; exit 2 when any (bad input)."""
    from ppo_watchdog.core.rulefile import RuleFileError, load_rules

    paths = _expand(rule_paths(files))
    if not paths:
        _fail("no rule files found in " + ", ".join(map(str, files)))
    try:
        ruleset = load_rules(paths)
    except RuleFileError as exc:
        for err in exc.errors:
            typer.echo(str(err), err=True)
        typer.echo(f"FAILED: {len(exc.errors)} error(s) in {len(paths)} file(s)", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        _fail(f"{getattr(exc, 'filename', '') or ''}: {exc.strerror or exc}")
    unsaid = unsaid_rules(ruleset)
    for line in unsaid:
        typer.echo(line, err=True)
    if unsaid:
        typer.echo(f"FAILED: {len(unsaid)} error(s) in {len(paths)} file(s)", err=True)
        raise typer.Exit(2)
    typer.echo(f"OK: {len(_rules_of(ruleset))} rules in {len(paths)} file(s)")


def unsaid_rules(ruleset: Any) -> list[str]:
    """``file:line: ...`` for each rule of the shipped default pack without a ``summary:``: every decision the
    default pack makes is said in words with its numbers (a pack of one's own may leave it out: its decisions
    then say the condition and its inputs)."""
    from ppo_watchdog.core.rulefile import shipped_default_pack

    try:
        default = shipped_default_pack().resolve()
    except (FileNotFoundError, OSError):
        return []
    out = []
    for rule in _rules_of(ruleset):
        file, _, line = rule.source.rpartition(":")
        if rule.summary is None and file and Path(file).resolve() == default:
            out.append(f"{file}:{line}:1: rule {rule.name!r}: summary: missing (every rule of the default pack says "
                       "its decision in one sentence with its numbers, e.g. summary: \"KL {{ kl }}, above 0.1\")")
    return out


@rules_app.command("test")
def rules_test(
    paths: Annotated[list[Path], typer.Argument(help="Rule test files or directories of them (e.g. rules/); the rule "
                                                     "packs in a directory are left out.")],
) -> None:
    """Run promtool-style rule unit tests: input series per step, expected decisions at given steps.

    Exit 0 when every test passes, 1 when any fails (each failure is listed).
    """
    from ppo_watchdog.core import ruletest

    for p in paths:
        if not p.exists():
            _fail(f"{p}: no such file or directory")
    try:
        results = ruletest.run_rule_tests(paths)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    if not results:
        _fail("no rule tests found in " + ", ".join(map(str, paths)))
    typer.echo(ruletest.format_results(results))
    raise typer.Exit(0 if all(r.passed for r in results) else 1)


@rules_app.command("explain")
def rules_explain(
    name: Annotated[str, typer.Argument(help="Rule name (see `watchdog rules list`).")],
    rules: RulesOpt = None,
    extra_rules: ExtraRulesOpt = None,
) -> None:
    """Explain one rule: rationale, condition, actions, and the metrics it reads."""
    all_rules = _rules_of(_load(rules, extra_rules))
    by_name = {r.name: r for r in all_rules}
    rule = by_name.get(name)
    if rule is None:
        import difflib

        near = difflib.get_close_matches(name, list(by_name), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else f" (known: {', '.join(sorted(by_name))})"
        _fail(f"no rule named {name!r}{hint}")
    con = _console()
    con.print(Text.assemble((rule.name, "bold"), f"  severity={getattr(rule, 'severity', '')}"
                            f"  enabled={getattr(rule, 'enabled', True)}"), highlight=False)
    desc = str(getattr(rule, "description", "") or "").strip()
    if desc:
        con.print(desc, highlight=False)
    con.print(f"when:  {_expr_text(rule, 'expr')}", highlight=False)
    for attr, label in (("clear", "clear: "), ("for_", "for:   "), ("keep_firing_for", "keep firing for: "),
                        ("cooldown", "cooldown: "), ("budget", "budget: ")):
        v = getattr(rule, attr, None)
        if v in (None, "", 0):
            continue
        text = _expr_text(rule, attr) if attr == "clear" else _budget_text(v) if attr == "budget" else f"{v} steps"
        con.print(f"{label}{text}", highlight=False)
    if getattr(rule, "repeat", False):
        con.print("repeat: yes (fires again every cooldown while the condition holds)", highlight=False)
    if getattr(rule, "divergence", False):
        con.print("divergence: yes (checkpoints taken while it fires are not known-good)", highlight=False)
    if getattr(rule, "source", ""):
        con.print(f"defined at {rule.source}", highlight=False)
    con.print("actions:", highlight=False)
    for a in getattr(rule, "actions", ()):
        con.print(f"  - {_describe_action(a)}", highlight=False)
    metrics = _metrics_read(rule)
    if metrics:
        t = Table(title="metrics read")
        for col in ("short", "verl key", "prometheus", "meaning"):
            t.add_column(col, overflow="fold")
        for short in metrics:
            m = catalog.lookup(short)
            key = (m.key + (f" (older: {', '.join(m.aliases)})" if m.aliases else "")) if m else "?"
            t.add_row(short, key, m.prom if m else "?", m.help if m else "")
        con.print(t)


@rules_app.command("calibrate")
def rules_calibrate(
    logs: Annotated[list[Path], typer.Argument(help="Healthy runs of one family (model, task, algorithm): "
                                                    "console logs, FileLogger JSONL, metrics.jsonl or run dirs.")],
    rules: RulesOpt = None,
    extra_rules: ExtraRulesOpt = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the overlay pack here.")] = None,
) -> None:
    """Propose the baseline-relative thresholds for a family from its healthy runs, as an overlay pack."""
    import tempfile

    from ppo_watchdog.core.rulefile import RuleFileError, load_rules
    from ppo_watchdog.judge import calibrate as cal
    from ppo_watchdog.judge import evaluation as ev
    from ppo_watchdog.sources import ingest

    ruleset = _load(rules, extra_rules)
    base = [str(p) for p in ruleset.sources]
    for p in logs:
        if not p.exists():
            _fail(f"{p}: no such file")
    usable: dict[Path, Any] = {}
    for p in logs:
        try:
            res = ingest.read_run(p)
        except ingest.IngestError as exc:
            _fail(str(exc))
        if res.records:
            usable[p] = res
            continue
        # Named with the lines it skipped: the user's file is at fault, not a temporary one of ours.
        typer.echo(f"warning: {res.path}: no usable metric records; left out", err=True)
        _skipped_lines(res)
    proposals = cal.calibrate_runs(ruleset, {p.name: res.records for p, res in usable.items()})
    if not any(prop.value is not None for prop in proposals):
        what = "no usable metric records" if not usable else "no data for any calibrated parameter's stat"
        _fail(f"nothing to propose: {what} in {', '.join(map(str, logs))}"
              + ("" if out is None else f"; {out} not written"))
    logs = list(usable)
    text = cal.overlay_yaml(proposals, logs, base)
    t = Table(title=f"calibration from {len(logs)} healthy run(s)")
    for col in ("param", "was", "peak (run)", "proposed", "margin per run"):
        t.add_column(col, overflow="fold")
    for prop in proposals:
        if prop.value is None:
            t.add_row(prop.param.name, f"{prop.param.value:g}", "no data", "-", "-")
            continue
        peak = max(prop.peaks, key=lambda k: prop.peaks[k])
        t.add_row(prop.param.name, f"{prop.param.value:g}", f"{prop.peaks[peak]:.4g} ({peak})",
                  f"{prop.value:g}" + (f" ({prop.bound} bound)" if prop.bound else ""),
                  ", ".join(f"{k}: {m:.2f}x" for k, m in prop.margins().items()))
    _console().print(t)
    with tempfile.TemporaryDirectory() as tmp:
        overlay = Path(tmp) / "overlay.yaml"
        overlay.write_text(text)
        try:  # checked before --out is written: a file that does not load is never left behind
            tuned = load_rules([*base, overlay])
        except RuleFileError as exc:
            _fail(f"the proposed overlay does not load: {exc}")
        if out is not None:
            out.write_text(text)
            typer.echo(f"wrote {out}")
        else:
            typer.echo(text)
        labels = [ev.Label(p.resolve(), "healthy") for p in logs]
        result = ev.evaluate_corpus(labels, tuned, ev.EvalConfig())
    typer.echo(f"eval of these runs with the overlay: {result.summary()}")


def _skipped_lines(res: Any, limit: int = 10) -> None:
    """Each line a read skipped, as file:line: reason on stderr (the first ``limit``, then a count)."""
    for issue in res.issues[:limit]:
        typer.echo(f"warning: skipped {issue}", err=True)
    if len(res.issues) > limit:
        typer.echo(f"warning: ... and {len(res.issues) - limit} more skipped in {res.path}", err=True)


# -- replay -------------------------------------------------------------------------------


def _parse_sets(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        try:
            ov = hydra.parse(item)
        except hydra.OverrideError as exc:
            _fail(f"--set expects KEY=NUMBER, got {item!r}: {exc.reason}")
        if isinstance(ov.value, bool) or not isinstance(ov.value, (int, float)):
            _fail(f"--set expects KEY=NUMBER, got {item!r}")
        if (problem := value_problem(ov.key, ov.value)) is not None:  # (nan, inf, an lr of 5: no run holds it)
            _fail(f"--set: {problem}")
        out[ov.key] = float(ov.value)
    return out


def _fmt_num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _replayed(source: Path, ruleset: Any, sets: Sequence[str], events_file: Path | None) -> tuple[Any, Any]:
    """(what was read, the replay) of a recorded run: ``watchdog replay``'s and ``watchdog check``'s one path
    from a file to decisions (a run directory's run.json and events.jsonl with it; exit 2 naming what is bad)."""
    from ppo_watchdog.core import replay
    from ppo_watchdog.sources import ingest

    try:
        res = ingest.read_run(source)
    except ingest.IngestError as exc:
        _fail(str(exc))
    if not res.records:
        _fail(f"{res.path}: no metric records found (expected verl FileLogger JSONL, console 'step:N - key:value' "
              "lines, TRL's trainer_state.json or TRL's printed logs)")
    config: dict[str, Any] = {}
    events: list[Event] = list(res.events)  # e.g. an OOM traceback in a console log
    try:
        if source.is_dir() and res.path.name == rundir.METRICS:
            config = replay.flatten_config(RunInfo.read(source).config)
            events = ingest.read_events(source)
        if events_file is not None:
            if not events_file.exists():
                _fail(f"{events_file}: no such file")
            chunk = rundir.read_jsonl(events_file)
            events = rundir.events_of(chunk)
    except RunInfoError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{exc.filename or source}: cannot be read ({exc.strerror or exc})")
    if events_file is not None:
        for e in chunk.errors:
            typer.echo(f"warning: skipped {e}", err=True)
    config.update(_parse_sets(sets))
    try:
        return res, replay.replay(res.records, ruleset, events=events, config=config)
    except ValueError as exc:
        _fail(f"replay failed: {exc}")


def _actions_text(d: Any, limit: int | None = 120) -> str:
    """What a replayed decision would do, its sets with their values (``0.0003 -> 0.00015``); a text past
    ``limit`` cut (an escalation's notice carries its whole rationale; --json has it all)."""
    acts = []
    for a in d.actions:
        text = str(a.get("text", a.get("kind", "?")))
        if limit is not None and len(text) > limit:
            text = text[:limit - 3] + "..."
        if "to" in a and "from" in a:
            text += f": {_fmt_num(a['from'])} -> {_fmt_num(a['to'])}"
        acts.append(text)
    return "; ".join(acts)


SourceArg = Annotated[Path, typer.Argument(
    help="Recorded run: verl's console log or FileLogger JSONL, a run's metrics.jsonl, TRL's trainer_state.json or "
         "printed logs, a run directory or a TRL output directory.")]
SetsOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Current value of a config key the log does not show, KEY=VALUE (repeatable), "
                  "e.g. --set actor_rollout_ref.actor.ppo_epochs=1.")]
EventsOpt = Annotated[Path | None, typer.Option(
    "--events", help="events.jsonl to replay with the metrics (default: the run directory's).")]


@commands.command("replay")
def replay_cmd(
    source: SourceArg,
    rules: RulesOpt = None,
    extra_rules: ExtraRulesOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the decisions as a JSON list (nothing else on stdout).")] = False,
    sets: SetsOpt = None,
    events_file: EventsOpt = None,
    show_resolve: Annotated[bool, typer.Option("--resolve/--no-resolve", help="Show resolve decisions in the table.")] = True,
) -> None:
    """Run the rules over a recorded run, step by step, and print what would have fired and what it would set."""
    ruleset = _load(rules, extra_rules)
    res, out = _replayed(source, ruleset, sets or [], events_file)
    from ppo_watchdog.core.engine import describe_blind

    for line in describe_blind(out.blind):
        typer.echo(f"warning: {line}", err=True)
    for line in out.ignored:
        typer.echo(f"warning: {line}", err=True)
    blind = {r for names in out.blind.values() for r in names}
    for name, err in out.unhealthy.items():
        if name not in blind:  # said once above, with the verl setting that logs the metric
            typer.echo(f"warning: rule {name} could not be evaluated at step {out.last_step}: {err}", err=True)
    _skipped_lines(res)
    if as_json:
        typer.echo(json.dumps(out.to_json(), indent=2))
        return
    con = _console()
    t = Table(title=f"{res.path.name}: {out.steps} steps ({out.first_step}..{out.last_step}), "
                    f"{len(out.decisions)} decisions")
    for col in ("step", "rule", "kind", "what it saw and would do"):
        t.add_column(col, overflow="fold")
    for d in out.decisions:
        if d.kind == DecisionKind.RESOLVE and not show_resolve:
            continue
        style = {"fire": "yellow", "escalate": "red", "resolve": "green"}.get(d.kind, "")
        t.add_row(str(d.step), d.rule, Text(d.kind, style), d.sentence)
    summary = ", ".join(f"{rule}: " + " ".join(f"{n} {k}" for k, n in kinds.items())
                        for rule, kinds in out.counts().items())
    t.caption = summary or "no rule fired"
    con.print(t)


# -- check --------------------------------------------------------------------------------


@commands.command("check")
def check_cmd(
    source: SourceArg,
    rules: RulesOpt = None,
    extra_rules: ExtraRulesOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the check as one JSON object (nothing else on "
                                                         "stdout).")] = False,
    sets: SetsOpt = None,
    events_file: EventsOpt = None,
) -> None:
    """Pre-flight on a log you already have: the metrics found and under which keys, the rules blind for lack of one,
    the logging cadence and steps, and what the pack would have done, in words (``watchdog replay`` has the table)."""
    from ppo_watchdog.cli import check

    ruleset = _load(rules, extra_rules)
    res, out = _replayed(source, ruleset, sets or [], events_file)
    report = check.build(res, out, ruleset)
    for line in out.ignored:
        typer.echo(f"warning: {line}", err=True)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    con = _console()
    for line in report.head():
        con.print(line, highlight=False)
    con.print(check.metrics_table(report))
    for line in report.tail(_actions_text):
        con.print(line, highlight=False)


# -- eval ---------------------------------------------------------------------------------


@commands.command("eval")
def eval_cmd(
    labels: Annotated[Path, typer.Argument(help="Labels file (labels.yaml): each recorded run and its verdict.")],
    rules: RulesOpt = None,
    extra_rules: ExtraRulesOpt = None,
    mode: Annotated[str, typer.Option("--mode", help="Run mode to price: verl (zero-patch, every set a relaunch) "
                                                     "or embedded (live sets).")] = "verl",
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole evaluation as JSON (nothing else on "
                                                         "stdout).")] = False,
    save_freq: Annotated[int, typer.Option("--save-freq", min=1, help="Checkpoint every N steps, for logs whose "
                                                                      "label gives no save_freq.")] = 10,
    startup_s: Annotated[float, typer.Option("--startup-s", min=0.0, help="Start-up of a relaunch in seconds, for "
                                                                          "logs whose label gives none.")] = 240.0,
) -> None:
    """Judge a rule pack on labelled runs: never roll back a healthy run; act on a failure in time. Exit 1 on any fail."""
    import sys

    from rich.progress import Progress

    from ppo_watchdog.judge import evaluation as ev

    try:
        cfg = ev.EvalConfig(mode=mode, save_freq=save_freq, startup_s=startup_s)
        items = ev.load_labels(labels)
    except (ValueError, ev.LabelsError) as exc:
        _fail(str(exc))
    ruleset = _load(rules, extra_rules)
    err = _console(stderr=True)
    with Progress(console=err, transient=True, disable=not sys.stderr.isatty() or len(items) < 5) as bar:
        task = bar.add_task("eval", total=len(items))

        def step(label: ev.Label) -> None:
            bar.update(task, advance=1, description=label.file.name[:40])

        try:
            result = ev.evaluate_corpus(items, ruleset, cfg, progress=step)
        except ingest_error() as exc:
            _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        con = _console()
        con.print(eval_table(result))
        typer.echo(("PASS: " if result.passed else "FAIL: ") + result.summary())
        typer.echo(result.headline_text())
        con.print(rule_rates_table(result))
    if not result.passed:
        raise typer.Exit(1)


def ingest_error() -> type[Exception]:
    from ppo_watchdog.sources.ingest import IngestError

    return IngestError


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def eval_table(result: Any) -> Table:
    """The per-log table of ``watchdog eval`` (also written under bench/results/)."""
    t = Table(title=f"watchdog eval: {', '.join(Path(r).name for r in result.rules)} "
                    f"(priced as {result.config.mode}, checkpoint every {result.config.save_freq} steps)")
    for col in ("log", "verdict", "result", "first false action", "detected (delay)", "rollback/pause/alert",
                "sets/100 steps", "zero-patch relaunches (allowed): deferred, merged, dropped",
                f"{result.config.mode}: relaunches, cost", "KL read", "blind to"):
        t.add_column(col, overflow="fold")
    for s in result.scores:
        ff = f"{s.first_false.kind} {s.first_false.rule}@{s.first_false.step}" if s.first_false else "-"
        det = f"{s.detected.kind} {s.detected.rule}@{s.detected.step} ({s.delay:+d})" if s.detected else "-"
        res = (Text("fragment", "dim") if s.label.verdict == "fragment"
               else Text("PASS", "green") if s.passed else Text("FAIL", "red"))
        zp, pr = s.zero_patch, s.priced
        t.add_row(s.label.file.stem, s.label.verdict, res, ff, det, f"{s.rollbacks}/{s.pauses}/{s.alerts}",
                  f"{s.sets_per_100:.1f}",
                  f"{zp.relaunches} ({s.relaunch_allowance}): {zp.deferred}, {zp.merged}, {zp.dropped}",
                  f"{pr.relaunches}, {_duration(pr.seconds)}", s.kl_source or "-", ", ".join(sorted(s.blind)) or "-")
    return t


def rule_rates_table(result: Any) -> Table:
    """Each rule that fired on a healthy step: how often, per 1,000 healthy steps, and what it did."""
    rows = result.rule_rates()
    fired = [r for r in rows if r["fires"]]
    t = Table(title=f"rules on the {result.healthy_steps} healthy steps")
    t.add_column("rule")
    t.add_column("fires on healthy steps", justify="right")
    t.add_column("per 1,000 healthy steps", justify="right")
    t.add_column("action")
    for r in fired:
        rate = "-" if r["per_1000_healthy_steps"] is None else f"{r['per_1000_healthy_steps']:g}"
        t.add_row(r["rule"], str(r["fires"]), rate, _fire_kinds(r["actions"]))
    quiet = len(rows) - len(fired)
    t.caption = (f"{quiet} other rule(s) never fired on a healthy step" if fired else "no rule fired on a healthy step")
    return t


def _fire_kinds(kinds: dict[str, int]) -> str:
    """``relaunch 2, notify 1`` (one kind alone: its name only); live_set shown as "live set"."""
    if len(kinds) == 1:
        return next(iter(kinds)).replace("_", " ")
    return ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in kinds.items())
