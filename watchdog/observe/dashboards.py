"""Grafana dashboards as code: "PPO run" and "Watchdog", built with grafana-foundation-sdk.

Every metric name comes from ``ppo_watchdog.protocol.catalog`` (the trainer's gauges) or
``ppo_watchdog.observe.telemetry`` (the watchdog's own metrics), so renaming a metric breaks this
module's tests, not a dashboard in production. The generated JSON is committed under
``dashboards/`` with fixed uids (provisioning and links rely on them); ``watchdog
dashboards export`` regenerates it and a test checks that regenerating changes nothing.

The module also holds the pure helpers the tests and the integration check use:
:func:`queries` lists every PromQL expression of a dashboard (targets, variables,
annotations) and :func:`render` substitutes Grafana's template variables so the result
parses as plain PromQL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from ppo_watchdog.observe import telemetry
from ppo_watchdog.protocol import catalog, exporter

#: Fixed dashboard uids: provisioning, annotations (dashboardUID) and links depend on them.
PPO_RUN_UID = "ppo-watchdog-run"
WATCHDOG_UID = "ppo-watchdog-daemon"
#: Tag on every dashboard, and on every annotation the watchdog posts.
TAG = "ppo-watchdog"
#: Tag of the watchdog's action annotations (posted by ``ppo_watchdog.observe.grafana``).
ACTION_TAG = "watchdog-action"

#: Name of the datasource template variable; panels use ``${datasource}``.
DS_VAR = "datasource"
_DS = dm.DataSourceRef(type_val="prometheus", uid="${" + DS_VAR + "}")
# Grafana's built-in annotation store (where POST /api/annotations lands).
_GRAFANA_DS = dm.DataSourceRef(type_val="grafana", uid="-- Grafana --")

#: Threshold lines, drawn only where a rule of the default pack compares a metric with an absolute level
#: (tests/test_dashboards.py holds them to rules/default.yaml): KL above 0.05 (kl_above_target) and 0.1
#: (kl_high), value loss above 0.5 (value_loss_high), rollout/trainer probability difference above 0.01
#: (rollout_mismatch), half the batch truncated ($truncation_share). The rules judged against a run's own
#: baseline (a KL explosion, a reward collapse, a length runaway) have no fixed line to draw.
KL_WARN, KL_ACT, VF_LOSS_TARGET, MISMATCH_LINE, TRUNCATION_LINE = 0.05, 0.1, 0.5, 0.01, 0.5
#: The run-selector every per-run query carries.
RUN_SEL = f'{catalog.RUN_LABEL}=~"$run"'


#: The trainer exporter's series beyond the per-step catalog gauges.
TRAINER_EXTRA = frozenset({exporter.EVENTS_METRIC, exporter.LAST_UPDATE_METRIC})


def prom(key: str) -> str:
    """The Prometheus name of a catalog metric given its verl key (KeyError if not in the catalog)."""
    return catalog.BY_KEY[key].prom


# ---- small builders -------------------------------------------------------------------------


class _Ids:
    """Sequential panel ids, so the JSON is stable between regenerations."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _q(expr: str, legend: str, ref: str = "A") -> pb.Dataquery:
    return pb.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range().datasource(_DS)


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps]
    )


def _series(
    ids: _Ids, title: str, desc: str, targets: list[tuple[str, str]], unit: str = "short",
    thresholds: list[tuple[float | None, str]] | None = None, w: int = 8, h: int = 8,
    bars: bool = False, log: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel().id(ids()).title(title).description(desc).datasource(_DS)
        .unit(unit).span(w).height(h).line_width(1).fill_opacity(10)
        # A gap stays a gap: a hang, a crash or a relaunch is what this tool watches for, and a line drawn
        # across it would hide it.
        .span_nulls(False)
        .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.BOTTOM)
                .show_legend(True).calcs(["lastNotNull", "max"]))
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.NONE))
    )
    if log:
        panel = panel.scale_distribution(cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LOG).log(10))
    if bars:
        panel = panel.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80)
    for i, (expr, legend) in enumerate(targets):
        panel = panel.with_target(_q(expr, legend, chr(ord("A") + i)))
    if thresholds:
        panel = panel.thresholds(_thresholds(*thresholds)).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    return panel


def _stat(ids: _Ids, title: str, desc: str, expr: str, legend: str, unit: str = "short", w: int = 6) -> stat.Panel:
    return (
        stat.Panel().id(ids()).title(title).description(desc).datasource(_DS).unit(unit)
        .span(w).height(4).with_target(_q(expr, legend))
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .color_mode(cm.BigValueColorMode.VALUE).graph_mode(cm.BigValueGraphMode.AREA)
    )


def _per_run(key: str) -> tuple[str, str]:
    """A catalog gauge for the selected runs, legend ``run``."""
    return f"{prom(key)}{{{RUN_SEL}}}", "{{run}} " + catalog.BY_KEY[key].short


def _ds_variable() -> db.DatasourceVariable:
    return db.DatasourceVariable(DS_VAR).label("Data source").type("prometheus")


def _run_variable(metric: str) -> db.QueryVariable:
    # label_values() is Grafana's templating function, not PromQL: :func:`queries` reports the
    # metric inside it so the tests still check the name against the catalog.
    return (
        db.QueryVariable("run").label("Run").datasource(_DS)
        .query({"query": f"label_values({metric}, {catalog.RUN_LABEL})", "refId": "run"})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True).include_all(True).all_value(".*")
    )


def _links() -> db.DashboardLink:
    # Both dashboards carry TAG: a tag link lists the other, keeping the time range and $run.
    return (
        db.DashboardLink("PPO watchdog").type(dm.DashboardLinkType.DASHBOARDS).tags([TAG])
        .as_dropdown(False).include_vars(True).keep_time(True).target_blank(False)
    )


def _events(kind: str) -> str:
    return f'{exporter.EVENTS_METRIC}{{{RUN_SEL}, kind="{kind}"}}'


# ---- the dashboards -------------------------------------------------------------------------


def ppo_run() -> dict[str, Any]:
    """The "PPO run" dashboard: training health of the selected runs, with the watchdog's actions."""
    ids = _Ids()
    kl, kl_std = _per_run("actor/reward_kl_penalty"), _per_run("actor/reward_kl_penalty_std")
    actions = f"{telemetry.ACTIONS.name}{{{RUN_SEL}}}"
    b = (
        db.Dashboard("PPO run").uid(PPO_RUN_UID).tags([TAG]).editable().refresh("30s")
        .time("now-6h", "now").timezone("browser").tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .description("Training health of PPO/RLHF runs (verl metric catalog) and the watchdog's actions.")
        .with_variable(_ds_variable())
        .with_variable(_run_variable(prom("training/global_step")))
        .link(_links())
        .annotation(
            # The selected runs' actions only: each is tagged run:<id> (ppo_watchdog.observe.grafana).
            db.AnnotationQuery().name("Watchdog actions").datasource(_GRAFANA_DS).enable(True)
            .icon_color("red").target(db.AnnotationTarget().type("tags").tags([ACTION_TAG, "run:$run"])
                                      .match_any(False).limit(500))
        )
        .annotation(
            # Works without a Grafana token: derived from the watchdog's own counter in Prometheus.
            db.AnnotationQuery().name("Watchdog actions (Prometheus)").datasource(_DS).enable(False)
            .icon_color("orange").expr(f"sum by (run, rule, kind, outcome) (increase({actions}[2m])) > 0")
        )
        .with_row(db.Row("Health").id(ids()))
        .with_panel(_series(ids, "Reward", "Task score (mean, max, min), reward after the KL penalty, and validation "
                            "score.", [
            _per_run("critic/score/mean"), _per_run("critic/score/max"), _per_run("critic/score/min"),
            _per_run("critic/rewards/mean"), _per_run("val-core/reward/mean@1"),
        ]))
        .with_panel(_series(
            ids, "KL to the reference (mean, std)",
            f"Per-token KL of the policy to the reference policy. Target below {KL_WARN}; "
            f"the watchdog raises kl_coef above {KL_ACT}.",
            [kl, kl_std], thresholds=[(None, "green"), (KL_WARN, "orange"), (KL_ACT, "red")],
        ))
        .with_panel(_series(
            ids, "Value loss", f"Clipped value-function loss; target below {VF_LOSS_TARGET}.",
            [_per_run("critic/vf_loss")], thresholds=[(None, "green"), (VF_LOSS_TARGET, "red")],
        ))
        .with_panel(_series(ids, "Policy loss", "Clipped PPO policy-gradient loss and the clipped fraction.", [
            _per_run("actor/pg_loss"), _per_run("actor/pg_clipfrac"),
        ]))
        .with_panel(_series(ids, "Entropy", "Mean per-token policy entropy; a collapse means a collapsed policy.", [
            _per_run("actor/entropy"),
        ]))
        .with_panel(_series(ids, "Grad norm", "Actor and critic gradient norms before clipping.", [
            _per_run("actor/grad_norm"), _per_run("critic/grad_norm"),
        ]))
        .with_panel(_series(ids, "Response length", "Mean response length in tokens; a runaway or a collapse "
                            "against the run's own recent median is a rule of the pack.", [
            _per_run("response_length/mean"),
        ]))
        .with_row(db.Row("Rollouts").id(ids()))
        .with_panel(_series(
            ids, "Truncated share", f"Share of the batch cut at data.max_response_length; the pack tells a human "
            f"at {TRUNCATION_LINE:.0%} sustained over 10 steps (truncation).",
            [_per_run("response_length/clip_ratio")], unit="percentunit",
            thresholds=[(None, "green"), (TRUNCATION_LINE, "red")], w=6,
        ))
        .with_panel(_series(
            ids, "Aborted share", "Share of the batch's rollouts aborted (empty); judged against the run's own "
            "usual share (rollout_failure): no fixed line.", [_per_run("response/aborted_ratio")],
            unit="percentunit", w=6,
        ))
        .with_panel(_series(
            ids, "Rollout mismatch", f"Mean difference of the rollout engine's token probabilities from the "
            f"trainer's; above {MISMATCH_LINE} for 5 steps is a training-inference mismatch (rollout_mismatch).",
            [_per_run("training/rollout_probs_diff_mean")], unit="sci",
            thresholds=[(None, "green"), (MISMATCH_LINE, "red")], w=6,
        ))
        .with_panel(_series(ids, "Rollout time", "Wall time of the step's rollout (generation); 3x its median "
                            "or a third of it confirms failing rollouts.", [_per_run("timing_s/gen")], unit="s", w=6))
        .with_panel(_series(ids, "Sequences a step", "Sequences in the step's batch (derived: verl's token total over "
                            "its mean prompt and response lengths); a batch short of its own usual count with no "
                            "aborted response is the rollout engine dropping requests (batch_shrink).",
                            [_per_run(catalog.SEQUENCES_KEY)], w=6))
        .with_row(db.Row("Knobs the watchdog turns").id(ids()))
        .with_panel(_series(ids, "Learning rate", "Actor and critic learning rates (log axis).", [
            _per_run("actor/lr"), _per_run("critic/lr"),
        ], unit="sci", log=True, w=12))
        .with_panel(_series(ids, "KL coefficient", "kl_ctrl coefficient of the KL penalty in the reward.", [
            _per_run("actor/reward_kl_penalty_coeff"),
        ], unit="sci", w=12))
        .with_row(db.Row("Progress").id(ids()))
        .with_panel(_series(ids, "Throughput", "Tokens per second per device.", [
            _per_run("perf/throughput"),
        ], unit="short", w=6))
        .with_panel(_series(ids, "Step time", "Wall time of a training step.", [
            _per_run("perf/time_per_step"),
        ], unit="s", w=6))
        .with_panel(_series(ids, "Global step", "Training step; drops mark a rollback.", [
            _per_run("training/global_step"),
        ], w=6))
        .with_panel(_series(
            ids, "Since last step", "Seconds since the trainer exported its last step; a hung run climbs here.",
            [(f"time() - {exporter.LAST_UPDATE_METRIC}{{{RUN_SEL}}}", "{{run}}")], unit="s", w=6,
        ))
        .with_panel(_series(
            ids, "Checkpoints", "Checkpoints written (trainer's checkpoint events).",
            [(f'sum by (run) (increase({_events("checkpoint")}[$__rate_interval]))', "{{run}} checkpoints")],
            w=6, bars=True,
        ))
        .with_panel(_series(
            ids, "Trainer events", "Events the trainer recorded, by kind (oom, nan, rollback, applied, ...).",
            [(f"sum by (run, kind) (increase({exporter.EVENTS_METRIC}{{{RUN_SEL}}}[$__rate_interval]))",
              "{{run}} {{kind}}")],
            w=18, bars=True,
        ))
    )
    return _to_dict(b)


def watchdog() -> dict[str, Any]:
    """The "Watchdog" dashboard: rule states, actions (advised and waiting for approval too), evaluation time (tick
    and by phase), data age, runs watched."""
    ids = _Ids()
    t = telemetry

    def state() -> statetimeline.Panel:
        return (
        statetimeline.Panel().id(ids()).title("Rule states").datasource(_DS).span(24).height(10)
        .description("Per run and rule: inactive, pending (condition holds, waiting for `for`), firing.")
        .with_target(_q(f"{t.RULE_STATE.name}{{{RUN_SEL}}}", "{{run}} {{rule}}"))
        .mappings([dm.ValueMap(options={
            str(v): dm.ValueMappingResult(text=name, color=color, index=v)
            for (name, v), color in zip(t.RULE_STATES.items(), ("green", "orange", "red"), strict=True)
        })])
        .thresholds(_thresholds((None, "green"), (1, "orange"), (2, "red")))
        .show_value(cm.VisibilityMode.NEVER).merge_values(True).row_height(0.9)
        )
    quantile = (
        "histogram_quantile({q}, sum by (le) (rate({m}[$__rate_interval])))"
    )
    b = (
        db.Dashboard("Watchdog").uid(WATCHDOG_UID).tags([TAG]).editable().refresh("30s")
        .time("now-6h", "now").timezone("browser").tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .description("The PPO watchdog itself: what it watches, how its rules stand, what it did.")
        .with_variable(_ds_variable())
        .with_variable(_run_variable(t.DATA_AGE.name))
        .link(_links())
        # A sharded daemon (shards: N) is N scrape targets, each with its share: single numbers add them up
        # (or show the worst one), so the panels read the same for one process or many.
        .with_panel(_stat(ids, "Runs watched", "Runs the watchdog watches now (all its processes).",
                          f"sum({t.RUNS_WATCHED.name})", "runs"))
        .with_panel(_stat(
            ids, "Firing rules", "Rules firing now over the selected runs.",
            f"count({t.RULE_STATE.name}{{{RUN_SEL}}} == 2) or vector(0)", "firing",
        ))
        .with_panel(_stat(
            ids, "Since last tick", "Seconds since the watchdog's last completed evaluation (of its process that "
            "ticked longest ago, when it runs several).",
            f"max(time() - {t.LAST_TICK.name})", "age", unit="s",
        ))
        .with_panel(_stat(
            ids, "Escalations (24h)", "Escalations to a human over the last day.",
            f"sum(increase({t.ESCALATIONS.name}{{{RUN_SEL}}}[24h])) or vector(0)", "escalations",
        ))
        .with_panel(state())
        .with_panel(_series(
            ids, "Actions by rule and outcome", "Remediations taken, by rule, action kind and outcome.",
            [(f"sum by (rule, kind, outcome) (increase({t.ACTIONS.name}{{{RUN_SEL}}}[$__rate_interval]))",
              "{{rule}} {{kind}} {{outcome}}")],
            w=12, bars=True,
        ))
        .with_panel(_series(
            ids, "Escalations and errors", "Escalations to a human, and errors the watchdog carried on from.",
            [(f"sum by (rule) (increase({t.ESCALATIONS.name}{{{RUN_SEL}}}[$__rate_interval]))", "escalated {{rule}}"),
             (f"sum by (where) (increase({t.ERRORS.name}{{{RUN_SEL}}}[$__rate_interval]))", "error in {{where}}")],
            w=12, bars=True,
        ))
        .with_panel(_series(
            ids, "Advised and waiting for approval", "Actions said as what the watchdog would do (advise mode), "
            "actions waiting now for a person's `watchdog approve` or `deny` (--approve), and those denied or "
            "left unanswered past their deadline.",
            [(f"sum by (run) ({t.APPROVALS_WAITING.name}{{{RUN_SEL}}})", "{{run}} waiting for approval"),
             (f'sum by (run, kind, outcome) (increase({t.ACTIONS.name}{{{RUN_SEL}, outcome=~"advised|denied"}}'
              f"[$__rate_interval]))", "{{run}} {{kind}} {{outcome}}")],
            w=24, bars=True,
        ))
        .with_panel(_series(
            ids, "Evaluation time", "Wall time of one evaluation tick over all runs (quantiles and mean; with "
            "several processes, of a process's tick over its runs).",
            [(quantile.format(q="0.5", m=t.EVALUATION.series()[0]), "p50"),
             (quantile.format(q="0.99", m=t.EVALUATION.series()[0]), "p99"),
             (f"sum(rate({t.EVALUATION.series()[1]}[$__rate_interval])) / "
             f"sum(rate({t.EVALUATION.series()[2]}[$__rate_interval]))",
              "mean")],
            unit="s", w=12,
        ))
        .with_panel(_series(
            ids, "Tick time by phase", "Where a tick's time goes, summed over the runs: read (new bytes parsed), "
            "decide (rules), commit (store), act (journal driven, checkpoints kept, liveness); p50 and p99. A tick "
            "that nears the tick interval is falling behind.",
            [(f"histogram_quantile(0.5, sum by (le, phase) (rate({t.TICK_PHASE.series()[0]}[$__rate_interval])))",
              "{{phase}} p50"),
             (f"histogram_quantile(0.99, sum by (le, phase) (rate({t.TICK_PHASE.series()[0]}[$__rate_interval])))",
              "{{phase}} p99")],
            unit="s", w=12,
        ))
        .with_panel(_series(
            ids, "Data age", "Seconds since each run's newest metric record; a stuck trainer climbs here.",
            [(f"{t.DATA_AGE.name}{{{RUN_SEL}}}", "{{run}}")], unit="s", w=12,
        ))
        .with_panel(_series(
            ids, "Scrape targets up", "Prometheus's view of the trainer and watchdog endpoints.",
            [(f'up{{job=~"{t.TRAINER_JOB}|{t.WATCHDOG_JOB}"}}', "{{job}} {{instance}}")], w=12,
        ))
        .with_panel(_series(
            ids, "Relaunching", "1 while the watchdog stops and relaunches a run's trainer, until the new trainer's "
            "first step: its /metrics is down on purpose then (PPOTrainerDown keeps quiet).",
            [(f"{t.PLANNED_RELAUNCH.name}{{{RUN_SEL}}}", "{{run}}")], w=24, h=5,
        ))
    )
    return _to_dict(b)


#: File name under dashboards/ -> builder.
DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "ppo-run.json": ppo_run,
    "watchdog.json": watchdog,
}


def _to_dict(builder: db.Dashboard) -> dict[str, Any]:
    # Round-trip through the SDK's encoder so the dict is plain JSON data.
    out: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    out["schemaVersion"] = out.get("schemaVersion", 39)
    return out


def dump(dashboard: dict[str, Any]) -> str:
    """Canonical JSON text of a dashboard (sorted keys, stable between runs)."""
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


def export(directory: Path | str) -> list[Path]:
    """Write every dashboard as JSON into ``directory``; returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in DASHBOARDS.items():
        path = directory / name
        path.write_text(dump(build()))
        written.append(path)
    return written


# ---- pure helpers for checking queries ------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One PromQL expression found in a dashboard."""

    where: str
    """Where it sits: ``panel 3 "KL to the reference" target B``, ``variable run``, ``annotation ...``."""
    expr: str
    """The expression as written in the dashboard (with Grafana variables)."""
    templating: bool = False
    """True for a variable query (Grafana's ``label_values(metric, label)``, not PromQL)."""


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard.get("panels") or []:
        yield p
        yield from p.get("panels") or []  # collapsed rows keep their panels inside


def queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every query of a dashboard: panel targets, Prometheus annotations and variable queries."""
    out: list[Query] = []
    for p in _panels(dashboard):
        for t in p.get("targets") or []:
            if "expr" in t:
                out.append(Query(f'panel {p.get("id")} "{p.get("title")}" target {t.get("refId")}', t["expr"]))
    for a in (dashboard.get("annotations") or {}).get("list") or []:
        if a.get("expr"):
            out.append(Query(f'annotation "{a.get("name")}"', a["expr"]))
    for v in (dashboard.get("templating") or {}).get("list") or []:
        if v.get("type") == "query":
            q = v.get("query")
            text = q.get("query") if isinstance(q, dict) else q
            if text:
                out.append(Query(f'variable {v.get("name")}', str(text), templating=True))
    return out


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>[^,]+?)\s*,\s*(?P<label>[a-zA-Z_]\w*)\s*\)\s*$")


def render(expr: str, run: str = ".*", interval: str = "1m") -> str:
    """Substitute Grafana's variables so ``expr`` is plain PromQL (``$run`` is a regex, like ``All``)."""
    return (
        expr.replace("$__rate_interval", interval).replace("$__interval", interval)
        .replace("${run}", run).replace("$run", run)
    )


def to_promql(query: Query, run: str = ".*", interval: str = "1m") -> str:
    """The PromQL a query stands for: a variable's ``label_values(sel, label)`` becomes ``sel``."""
    text = render(query.expr, run, interval)
    if query.templating:
        m = _LABEL_VALUES.match(text)
        if not m:
            raise ValueError(f"{query.where}: unsupported variable query {query.expr!r}")
        return m.group("selector")
    return text


def metric_names(promql: str) -> set[str]:
    """Every metric name a PromQL expression selects (raises ValueError when it does not parse)."""
    import promql_parser  # test extra; only the checks need it

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    names.add(m.value)

    promql_parser.walk(promql_parser.parse(promql), visit)
    return names


def known_metric_names() -> frozenset[str]:
    """Names a dashboard or alert may reference: the catalog, the watchdog's own, the trainer's events, ``up``."""
    return frozenset(catalog.names("prom")) | telemetry.series_names() | TRAINER_EXTRA | {"up"}
