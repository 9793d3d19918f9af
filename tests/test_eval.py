"""`watchdog eval`: scoring small synthetic logs with known answers, the default pack on the real
labelled corpus, the KL signal of each verl configuration, and the blind-rules warning."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner
from verl_logs import LOGS, needs_logs

from ppo_watchdog.cli import app
from ppo_watchdog.core.replay import replay
from ppo_watchdog.core.rulefile import load_rules, parse_rules
from ppo_watchdog.judge import evaluation as ev
from ppo_watchdog.protocol import rundir

ROOT = Path(__file__).resolve().parents[1]
LABELS = LOGS / "labels.yaml"
CORPUS = ROOT / "bench" / "corpus" / "labels.yaml"
INJECTED = ROOT / "bench" / "corpus_injected" / "labels.yaml"
TRL = ROOT / "bench" / "corpus_trl" / "labels.yaml"
TRL_REGIMES = ROOT / "bench" / "corpus_trl_regimes" / "labels.yaml"
VERL_CORPUS = ROOT / "bench" / "corpus_verl" / "labels.yaml"

#: A pack with one rule of each consequence, on a metric the tests steer by hand.
PACK = textwrap.dedent("""\
    version: 1
    rules:
      - name: drastic
        description: a score below 0 rolls back
        expr: reward < 0
        actions: [rollback]
        cooldown: 1000
        divergence: true
      - name: alarm
        description: a score above 5 is only an alert
        expr: reward > 5
        actions: [notify]
        cooldown: 1000
      - name: tune
        description: a score of exactly 2 asks for a gentler lr, every 5 steps while it holds
        expr: reward == 2
        actions:
          - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.9}
        cooldown: 5
        repeat: true
""")


def _log(path: Path, rewards: dict[int, float], steps: int) -> Path:
    with path.open("w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "data": {"critic/score/mean": rewards.get(s, 1.0)}}) + "\n")
    return path


def _pack(tmp_path: Path) -> Path:
    p = tmp_path / "pack.yaml"
    p.write_text(PACK)
    return p


def _score(tmp_path: Path, label: str, rewards: dict[int, float], steps: int = 30, **cfg) -> ev.LogScore:
    _log(tmp_path / "run.jsonl", rewards, steps)
    labels = tmp_path / "labels.yaml"
    labels.write_text("version: 1\nlogs:\n  - file: run.jsonl\n" + textwrap.indent(textwrap.dedent(label), "    "))
    (lab,) = ev.load_labels(labels)
    return ev.evaluate_log(lab, load_rules([_pack(tmp_path)]), ev.EvalConfig(**cfg))


def test_a_rolled_back_healthy_run_fails_naming_its_first_false_action(tmp_path: Path) -> None:
    s = _score(tmp_path, "verdict: healthy\n", {5: -1.0, 12: -1.0})
    assert not s.passed and s.rollbacks == 1  # the rule's cooldown keeps it to one
    assert (s.first_false.step, s.first_false.rule, s.first_false.kind) == (5, "drastic", "rollback")


def test_a_failure_caught_between_onset_and_deadline_passes_with_its_delay(tmp_path: Path) -> None:
    s = _score(tmp_path, "verdict: failure\nonset: 10\ndeadline: 15\n", {12: -1.0})
    assert s.passed and s.detected.step == 12 and s.delay == 2
    assert s.first_false is None


def test_a_rollback_two_steps_before_the_onset_is_on_time_three_is_a_false_action(tmp_path: Path) -> None:
    assert _score(tmp_path, "verdict: failure\nonset: 10\ndeadline: 15\n", {8: -1.0}).passed
    s = _score(tmp_path, "verdict: failure\nonset: 10\ndeadline: 15\n", {7: -1.0})
    assert not s.passed and s.first_false.step == 7 and "before the onset 10" in s.reason


def test_a_failure_caught_after_its_deadline_fails(tmp_path: Path) -> None:
    s = _score(tmp_path, "verdict: failure\nonset: 10\ndeadline: 15\n", {20: -1.0})
    assert not s.passed and s.detected.step == 20 and "after the deadline 15" in s.reason


def test_an_alert_is_enough_where_the_label_expects_one_but_not_where_it_expects_a_rollback(tmp_path: Path) -> None:
    assert _score(tmp_path, "verdict: failure\nonset: 10\ndeadline: 15\nexpect: alert\n", {11: 9.0}).passed
    s = _score(tmp_path, "verdict: failure\nonset: 10\ndeadline: 15\nexpect: rollback\n", {11: 9.0})
    assert not s.passed and s.detected is None and s.alerts == 1


def test_tuning_relaunches_of_a_zero_patch_run_wait_for_checkpoints_and_are_merged(tmp_path: Path) -> None:
    # reward == 2 on every step: the tuning rule fires every 5 steps (50 set decisions in 250 steps).
    rewards = {s: 2.0 for s in range(1, 251)}
    s = _score(tmp_path, "verdict: healthy\n", rewards, steps=250, save_freq=10)
    assert s.set_decisions == 50 and s.passed
    zp = s.zero_patch
    # One tuning relaunch per 100 steps trained, counted from the launch: at steps 100 and 200, each
    # carrying the 20 sets that waited for it (19 merged into the first), the last 10 still waiting.
    assert (zp.relaunches, zp.tuning_relaunches) == (2, 2) and zp.deferred == 50
    assert zp.merged == 19 + 19 and zp.dropped == 0
    assert zp.seconds == pytest.approx(2 * ev.DEFAULT_STARTUP_S)  # at a checkpoint: no step trained again
    # Spaced 10 steps instead, it would relaunch every 10 steps: more than the run's allowance.
    s = _score(tmp_path, "verdict: healthy\n", rewards, steps=250, save_freq=10, relaunch_every=10)
    assert s.zero_patch.relaunches == 25 and not s.passed and "zero-patch relaunches" in s.reason


def test_embedded_mode_prices_the_same_sets_as_free_live_changes(tmp_path: Path) -> None:
    s = _score(tmp_path, "verdict: healthy\n", {s: 2.0 for s in range(1, 51)}, steps=50, mode="embedded")
    assert s.priced.live_sets == 10 and s.priced.relaunches == 0 and s.priced.seconds == 0


def test_a_waiting_set_whose_rule_stops_firing_is_dropped(tmp_path: Path) -> None:
    s = _score(tmp_path, "verdict: healthy\n", {3: 2.0}, steps=150, save_freq=10)  # fires once, clears at 4
    assert s.zero_patch.deferred == 1 and s.zero_patch.dropped == 1 and s.zero_patch.relaunches == 0


def test_a_fragment_is_replayed_but_not_scored(tmp_path: Path) -> None:
    s = _score(tmp_path, "verdict: fragment\n", {2: -1.0}, steps=3)
    assert s.passed and s.rollbacks == 1 and s.reason.startswith("fragment")


def test_a_bad_labels_file_names_every_problem_with_its_line(tmp_path: Path) -> None:
    labels = tmp_path / "labels.yaml"
    labels.write_text("version: 1\nlogs:\n  - file: nope.jsonl\n    verdict: healthy\n"
                      "  - file: x.jsonl\n    verdict: sick\n  - {file: y, verdict: failure, onset: 3, colour: red}\n")
    with pytest.raises(ev.LabelsError) as err:
        ev.load_labels(labels)
    text = str(err.value)
    assert "labels.yaml:3:11: logs[0].file:" in text and "does not exist" in text
    assert "labels.yaml:6:14: logs[1].verdict must be one of healthy, failure, fragment" in text
    assert "unknown key 'colour'" in text and "a failure needs 'deadline'" in text
    r = CliRunner().invoke(app, ["eval", str(labels)])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_eval_exits_non_zero_when_a_log_fails_and_prints_a_summary(tmp_path: Path) -> None:
    _log(tmp_path / "ok.jsonl", {}, 20)
    _log(tmp_path / "bad.jsonl", {5: -1.0}, 20)
    labels = tmp_path / "labels.yaml"
    labels.write_text("version: 1\nlogs:\n  - {file: ok.jsonl, verdict: healthy}\n  - {file: bad.jsonl, verdict: healthy}\n")
    r = CliRunner().invoke(app, ["eval", str(labels), "--rules", str(_pack(tmp_path))])
    assert r.exit_code == 1
    assert "FAIL: 1/2 logs passed: healthy 1/2, failures 0/0" in r.output
    r = CliRunner().invoke(app, ["eval", str(labels), "--rules", str(_pack(tmp_path)), "--json"])
    doc = json.loads(r.stdout)
    assert [x["passed"] for x in doc["logs"]] == [True, False] and doc["logs"][1]["first_false"]["step"] == 5


@needs_logs
def test_the_default_pack_passes_every_labelled_real_verl_log() -> None:
    r = CliRunner().invoke(app, ["eval", str(LABELS), "--json"])
    doc = json.loads(r.stdout)
    failed = [(x["file"], x["reason"]) for x in doc["logs"] if not x["passed"]]
    assert r.exit_code == 0 and failed == []
    for x in doc["logs"]:
        if x["verdict"] == "healthy":
            assert x["rollbacks"] == 0 and x["pauses"] == 0
            assert x["zero_patch"]["relaunches"] <= max(1, x["steps"] // 100), x["file"]


def test_the_default_pack_passes_the_embedded_trainers_own_labelled_corpus() -> None:
    r = CliRunner().invoke(app, ["eval", str(CORPUS), "--mode", "embedded", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0, [(x["file"], x["reason"]) for x in doc["logs"] if not x["passed"]]
    assert {x["verdict"] for x in doc["logs"]} == {"healthy", "failure"}


def test_the_default_pack_rolls_back_every_hostile_trl_run_including_a_collapse_at_its_second_step() -> None:
    # TRL's GRPO logs KL 0 at step 1, so an lr 100x too high collapses at step 2, before any
    # baseline exists: kl_leap (a per-token KL past 1 nat from the reference, still past half a nat on the
    # next record: one batch's estimate from a few answers can leap alone) catches it at step 3.
    r = CliRunner().invoke(app, ["eval", str(TRL), "--mode", "embedded", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0, [(x["file"], x["reason"]) for x in doc["logs"] if not x["passed"]]
    lr_high = [x for x in doc["logs"] if x["file"].startswith("lr_high")]
    assert lr_high and all(x["detected"]["step"] <= 3 and x["detected"]["kind"] == "rollback" for x in lr_high)


#: What CI holds the default pack to on every labelled corpus (issue 21): every failure caught on
#: time, no false rollback or pause, at most one zero-patch relaunch per 100 healthy steps, and not
#: one set that would change nothing.
CORPORA = [pytest.param(LABELS, "verl", marks=needs_logs, id="verl-logs"),
           pytest.param(CORPUS, "embedded", id="embedded"),
           pytest.param(INJECTED, "embedded", id="injected"),
           pytest.param(TRL, "embedded", id="trl"),
           pytest.param(TRL_REGIMES, "embedded", id="trl-regimes"),
           pytest.param(VERL_CORPUS, "verl", id="real-verl")]


@pytest.mark.parametrize(("labels", "mode"), CORPORA)
def test_the_headline_figures_of_each_corpus_hold_the_default_pack_to_its_promises(labels: Path, mode: str) -> None:
    r = CliRunner().invoke(app, ["eval", str(labels), "--mode", mode, "--json"])
    h = json.loads(r.stdout)["headline"]
    assert h["failures"] >= 1 and h["detection_rate"] == 1.0, h
    assert h["false_actions"] == 0 and h["false_per_1000_healthy_steps"] == 0.0, h
    assert h["relaunches_per_100_healthy_steps"] <= 1.0, h
    assert h["noop_sets"] == 0, h
    assert h["lead_median"] is not None and h["lead_worst"] is not None, h


def test_the_headline_counts_detections_lead_time_false_actions_and_changes_that_change_nothing(tmp_path: Path) -> None:
    _log(tmp_path / "sick.jsonl", {12: -1.0, 8: 9.0}, 30)       # an alert at 8, a rollback at 12; onset 10
    _log(tmp_path / "well.jsonl", {5: -1.0}, 40)                 # a false rollback in 40 healthy steps
    labels = tmp_path / "labels.yaml"
    labels.write_text("version: 1\nlogs:\n  - {file: sick.jsonl, verdict: failure, onset: 10, deadline: 15}\n"
                      "  - {file: well.jsonl, verdict: healthy}\n")
    res = ev.evaluate_corpus(ev.load_labels(labels), load_rules([_pack(tmp_path)]), ev.EvalConfig())
    h = res.headline()
    assert (h["failures"], h["detected"], h["detection_rate"]) == (1, 1, 1.0)
    assert (h["lead_median"], h["lead_worst"]) == (2, 2)          # warned at 8, two steps before the onset
    assert h["false_actions"] == 1 and h["healthy_steps"] == 40 + 7   # the failure's steps 1-7 count as healthy
    assert h["false_per_1000_healthy_steps"] == pytest.approx(1000 / 47, abs=0.01)
    assert h["noop_sets"] == 0 and "sets that changed nothing 0" in res.headline_text()


def _table_rows(output: str, first_cells: set[str]) -> dict[str, list[str]]:
    """The rows of a printed rich table whose first cell is one of ``first_cells``, cell by cell."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells and cells[0] in first_cells:
            rows[cells[0]] = cells[1:]
    return rows


def test_eval_reports_each_rules_fires_on_healthy_steps_per_1000_and_what_they_became(tmp_path: Path) -> None:
    _log(tmp_path / "tuned.jsonl", {s: 2.0 for s in range(1, 13)}, 40)  # healthy; tune fires at 1, 6, 11
    _log(tmp_path / "quiet.jsonl", {}, 60)                                # healthy; nothing fires
    _log(tmp_path / "sick.jsonl", {5: 9.0, 12: -1.0}, 30)                # alarm at 5 (healthy), rollback at 12 (not)
    labels = tmp_path / "labels.yaml"
    labels.write_text("version: 1\nlogs:\n  - {file: tuned.jsonl, verdict: healthy}\n"
                      "  - {file: quiet.jsonl, verdict: healthy}\n"
                      "  - {file: sick.jsonl, verdict: failure, onset: 10, deadline: 15}\n")
    pack = str(_pack(tmp_path))
    doc = json.loads(CliRunner().invoke(app, ["eval", str(labels), "--rules", pack, "--json"]).stdout)
    # 40 + 60 healthy-run steps and the failure's steps 1-7: the headline's healthy steps, the same 107.
    assert doc["headline"]["healthy_steps"] == doc["rule_rates"]["healthy_steps"] == 107
    assert doc["rule_rates"]["rules"] == [
        {"rule": "tune", "fires": 3, "per_1000_healthy_steps": 28.04, "actions": {"relaunch_set": 3}},
        {"rule": "alarm", "fires": 1, "per_1000_healthy_steps": 9.35, "actions": {"notify": 1}},
        {"rule": "drastic", "fires": 0, "per_1000_healthy_steps": 0.0, "actions": {}},
    ]
    assert {x["file"]: x["healthy_fires"] for x in doc["logs"]} == {
        "tuned.jsonl": {"tune": {"relaunch_set": 3}}, "quiet.jsonl": {}, "sick.jsonl": {"alarm": {"notify": 1}}}

    r = CliRunner().invoke(app, ["eval", str(labels), "--rules", pack])
    assert "rules on the 107 healthy steps" in r.output
    assert _table_rows(r.output, {"tune", "alarm", "drastic"}) == {"tune": ["3", "28.04", "relaunch set"],
                                                                   "alarm": ["1", "9.35", "notify"]}
    assert "1 other rule(s) never fired on a healthy step" in r.output
    # Embedded, the same lr sets are applied live: no relaunch waits for a checkpoint.
    r = CliRunner().invoke(app, ["eval", str(labels), "--rules", pack, "--mode", "embedded"])
    assert _table_rows(r.output, {"tune"}) == {"tune": ["3", "28.04", "live set"]}


def test_an_infrastructure_failure_answered_by_a_policy_rollback_fails_its_label(tmp_path: Path) -> None:
    s = _score(tmp_path, "verdict: failure\nonset: 10\ndeadline: 15\nexpect: restart\n", {12: -1.0})
    assert not s.passed and "rollout machinery" in s.reason and s.rollbacks == 1


# -- the KL signal of each verl configuration ---------------------------------------------------

KL_RULE = textwrap.dedent("""\
    version: 1
    rules:
      - name: kl_up
        description: any KL above 0.1 raises its coefficient
        expr: kl > 0.1
        actions:
          - set: {key: kl_coef, scale: 2.0}
        cooldown: 1000
""")


@pytest.mark.parametrize(("key", "coef_key", "coef_metric"), [
    ("actor/reward_kl_penalty", "algorithm.kl_ctrl.kl_coef", "actor/reward_kl_penalty_coeff"),  # use_kl_in_reward
    ("actor/kl_loss", "actor_rollout_ref.actor.kl_loss_coef", "actor/kl_coef"),                 # use_kl_loss
    ("critic/kl", "algorithm.kl_ctrl.kl_coef", "critic/kl_coeff"),                               # older verl
])
def test_the_kl_signal_is_resolved_from_each_verl_key_and_the_decision_says_which(key, coef_key, coef_metric) -> None:
    rules, errors = parse_rules(KL_RULE)
    assert not errors
    recs = [{"step": s, "data": {key: kl, coef_metric: 0.001}} for s, kl in enumerate([0.01, 0.2], start=1)]
    (d,) = replay(recs, rules).decisions
    assert d.signals == {"kl": key}
    assert d.planned[0].payload["set"] == {coef_key: pytest.approx(0.002)}
    if key != "actor/reward_kl_penalty":
        assert f"(kl = {key})" in d.message


def test_the_blind_rules_warning_is_printed_once_naming_the_verl_setting(tmp_path: Path) -> None:
    log = tmp_path / "grpo.jsonl"
    with log.open("w") as f:
        for s in range(1, 40):
            f.write(json.dumps({"step": s, "data": {"critic/score/mean": 0.5, "actor/entropy": 0.3}}) + "\n")
    r = CliRunner().invoke(app, ["replay", str(log)])
    assert r.exit_code == 0
    kl_lines = [ln for ln in r.stderr.splitlines() if "no KL to the reference" in ln]
    assert len(kl_lines) == 1
    assert "algorithm.use_kl_in_reward=True" in kl_lines[0] and "use_kl_loss=True" in kl_lines[0]
    assert "kl_explosion" in kl_lines[0] and "kl_high" in kl_lines[0]
    assert "reward_collapse" not in kl_lines[0]  # it reads the KL only as an optional confirmation
    assert "could not be evaluated" not in r.stderr  # no warning per rule on top


def test_the_live_controller_warns_about_blind_rules_once(tmp_path: Path, caplog) -> None:
    from ppo_watchdog.control.daemon import build_watchdog

    run = tmp_path / "run"
    run.mkdir()
    wd = build_watchdog(tmp_path / "state", [ROOT / "rules" / "default.yaml"])
    ctl = wd.add_run(run, managed=False)
    with caplog.at_level(logging.WARNING, logger="ppo_watchdog.control.controller"):
        for s in range(1, 12):
            rundir.append_metrics(run, s, {"critic/score/mean": 0.5, "actor/entropy": 0.3})
            ctl.tick()
    lines = [r.getMessage() for r in caplog.records if "no KL to the reference" in r.getMessage()]
    assert len(lines) == 1 and "actor_rollout_ref.actor.use_kl_loss=True" in lines[0]
    wd.close()


# -- judgment v3 on the synthetic fault injection (issue 21) -------------------------------------


@pytest.fixture(scope="module")
def injected() -> dict[str, dict]:
    r = CliRunner().invoke(app, ["eval", str(INJECTED), "--mode", "embedded", "--json"])
    return {x["file"]: x for x in json.loads(r.stdout)["logs"]}


def test_a_run_that_died_after_learning_is_rolled_back_by_the_dead_after_learning_rule(injected) -> None:
    x = injected["dead_after_learning_at_30"]
    assert x["passed"] and x["detected"]["rule"] == "dead_after_learning" and x["detected"]["kind"] == "rollback"


def test_a_run_dead_from_its_first_step_is_only_alerted(injected) -> None:
    x = injected["dead_from_start"]
    assert x["passed"] and x["rollbacks"] == 0 and x["pauses"] == 0 and x["alerts"] >= 1


def test_a_run_broken_before_the_watchdog_saw_it_is_alerted_and_never_rolled_back(injected) -> None:
    x = injected["broken_before_watching"]
    assert x["passed"] and x["rollbacks"] == 0 and x["detected"]["kind"] == "notify"


def test_truncation_is_an_alert_naming_the_setting_to_raise(injected) -> None:
    x = injected["truncation_from_30"]
    hits = [a for a in x["actions"] if a["rule"] == "truncation" and a["kind"] == "notify"]
    assert x["passed"] and hits and "data.max_response_length" in hits[0]["detail"]
    assert hits[0]["step"] <= 45


def test_a_growing_gradient_norm_warns_steps_before_the_collapse_and_eval_reports_the_lead(injected) -> None:
    x = injected["grad_growth_then_collapse_at_50"]
    assert x["passed"] and x["warned"]["rule"] == "grad_norm_growth" and x["lead"] >= 5


def test_a_rising_train_rollout_mismatch_warns_before_the_collapse(injected) -> None:
    x = injected["mismatch_rising_then_collapse_at_50"]
    assert x["passed"] and x["warned"]["rule"] == "mismatch_rising" and x["lead"] >= 3


def test_failing_rollouts_restart_the_trainer_and_never_roll_back_and_a_blip_does_nothing(injected) -> None:
    x = injected["infra_rollout_failure_at_40"]
    assert x["passed"] and x["restarts"] >= 1 and x["rollbacks"] == 0
    blip = injected["infra_rollout_blip_healthy"]
    assert blip["passed"] and blip["restarts"] == 0 and blip["rollbacks"] == 0


def test_every_real_verl_run_is_labelled_in_both_of_verls_formats_and_both_read_the_same_steps() -> None:
    """bench/corpus_verl: each run's console log (stdout) and FileLogger JSONL carry one label each,
    the same label, and the watchdog reads the same steps and numbers from both."""
    import yaml

    from ppo_watchdog.sources.ingest import read_records

    logs = yaml.safe_load(VERL_CORPUS.read_text())["logs"]
    by_run: dict[str, dict[str, dict]] = {}
    for x in logs:
        run, fmt = x["file"].split(".", 1)
        by_run.setdefault(run, {})[fmt] = x
    assert by_run and all(set(v) == {"console.log", "filelogger.jsonl"} for v in by_run.values()), by_run.keys()
    verdicts = [v["console.log"]["verdict"] for v in by_run.values()]
    assert verdicts.count("healthy") >= 4 and verdicts.count("failure") >= 6
    for run, both in by_run.items():
        strip = {k: v for k, v in both["console.log"].items() if k != "file"}
        assert strip == {k: v for k, v in both["filelogger.jsonl"].items() if k != "file"}, run
        console = read_records(VERL_CORPUS.parent / both["console.log"]["file"])
        jsonl = read_records(VERL_CORPUS.parent / both["filelogger.jsonl"]["file"])
        assert [r["step"] for r in console] == [r["step"] for r in jsonl] and len(jsonl) >= 20, run
        for c, j in zip(console, jsonl, strict=True):
            for key in ("critic/score/mean", "actor/entropy", "response_length/clip_ratio", "response/aborted_ratio"):
                if key in j["data"]:
                    assert c["data"][key] == pytest.approx(j["data"][key], rel=1e-3, nan_ok=True), (run, c["step"], key)
