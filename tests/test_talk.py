"""It talks (issue 46, items 1-3): every decision said in one sentence with its numbers, the moment it happens, and
the run's story at its end.

1. a rule's ``summary:`` rendered with the decision's values, and what was done, advised or held, in words;
2. ``watchdog run`` says each rule that fires and each action that completes, live, and each action goes to the
   webhook in words;
3. the end-of-run summary (``watchdog history RUN`` prints the same): a header whose counts agree with the journal,
   then one line per action.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_watchdog.cli import app
from ppo_watchdog.cli.rules import unsaid_rules
from ppo_watchdog.cli.run import Progress
from ppo_watchdog.cli.story import counts, story
from ppo_watchdog.control.store import RunRecord, Store
from ppo_watchdog.core.engine import run_series
from ppo_watchdog.core.rulefile import RuleFileError, load_rules, parse_rules, shipped_default_pack
from ppo_watchdog.core.summary import TemplateError, evidence, number, parse_summary, render, sentence

ROOT = Path(__file__).resolve().parents[1]
#: `make run`'s fault schedule and settings (the Makefile's DEMO).
DEMO = ["--faults", "kl_collapse@8:0.1,lr_spike@8:x3,oom@30,lr_spike@59:x30", "--on-escalate", "stop",
        "--set", "algorithm.kl_ctrl.kl_coef=0.001", "--set", "data.train_size=128",
        "--set", "trainer.total_training_steps=80"]

PACK = """version: 1
params:
  kl_jump: {value: 2.0, description: KL doubled}
rules:
  - name: kl_jump
    description: KL jumped against its median
    expr: kl > $kl_jump * median(kl, 5, 1)
    summary: "KL {{ kl }}, {{ kl / median(kl, 5, 1) }}x its median of the 5 steps before ({{ median(kl, 5, 1) }})"
    actions:
      - rollback: {skip_batches: 2}
      - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.5}
"""


# -- 1. the sentence -------------------------------------------------------------------------------------------


def test_a_summary_is_rendered_with_the_decisions_own_values_to_three_significant_digits() -> None:
    rules, errors = parse_rules(PACK, "pack.yaml")
    assert not errors
    records = [{"step": s, "data": {"actor/reward_kl_penalty": v}}
               for s, v in enumerate([0.07, 0.074, 0.08, 0.071, 0.074, 5.87], start=1)]
    fired = [d for r in run_series(rules, records) for d in r.decisions]
    (d,) = fired
    said = evidence(rules[0], d.kind, d.step, d.inputs, d.message)
    assert said == "KL 5.87, 79.3x its median of the 5 steps before (0.074)"
    assert [number(v) for v in (1.6e-4, 8e-5, 0.0012, 62.0, float("nan"))] == ["1.6e-4", "8e-5", "0.0012", "62", "n/a"]


def test_a_hole_is_walked_never_evaluated_and_a_missing_value_reads_n_a() -> None:
    s = parse_summary("lr {{ $lr_cut * 2 }} at step {{ step }}; KL {{ kl }}")
    assert render(s, {"$lr_cut": 0.25}, 7) == "lr 0.5 at step 7; KL n/a"  # (kl not recorded at that step)
    for bad, why in (("{{ kl > 1 }}", "is a condition"), ("{{ }}", "empty"), ("KL }} 3", "without its pair"),
                     ("{{ kl +", "without its pair"), ("{{ __import__('os') }}", "unknown function"),
                     ("{{ __import__ }}", "unknown metric")):
        with pytest.raises(TemplateError, match=why):
            parse_summary(bad)


def test_a_summary_reading_what_its_rule_does_not_compute_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    pack = tmp_path / "mine.yaml"
    pack.write_text(PACK.replace("median(kl, 5, 1) }})", "median(kl, 10) }})").replace("{{ kl }}", "{{ reward }}"))
    with pytest.raises(RuleFileError) as exc:
        load_rules([pack])
    said = [str(e) for e in exc.value.errors]
    assert len(said) == 2 and all(s.startswith(f"{pack}:8:") for s in said), said
    assert any("{{ median(kl, 10) }} is not computed by the rule's expr (did you mean median(kl, 5, 1)?)" in s
               for s in said), said
    r = CliRunner().invoke(app, ["rules", "check", str(pack)])
    assert r.exit_code == 2 and f"{pack}:8:" in r.output


def test_every_rule_of_the_default_pack_has_a_summary_and_rules_check_refuses_one_without() -> None:
    default = shipped_default_pack()
    assert all(r.summary is not None for r in load_rules([default]))
    ok = CliRunner().invoke(app, ["rules", "check", str(default)])
    assert ok.exit_code == 0, ok.output
    # The default pack's text with one summary taken out, read as the default pack (its file name).
    text = default.read_text()
    stripped = re.sub(r"\n    summary: .*(?=\n  - name: kl_high\b)|(?<=  - name: kl_high)\n    summary: .*", "", text)
    assert stripped.count("summary:") == text.count("summary:") - 1
    rules, errors = parse_rules(stripped, str(default))
    assert not errors
    (line,) = unsaid_rules(rules)
    assert line.startswith(f"{default}:") and "rule 'kl_high': summary: missing" in line


def _decision(store: Store, status: str, journal: list[tuple[str, str, dict, dict]]) -> dict:
    did = store.add_decision("r", 61, "kl_explosion", "fire", [], {"kl": 5.87}, "critical",
                             "KL 5.87, 79x its median of the 5 steps before (0.074)")
    for kind, st, payload, result in journal:
        aid = store.add_action("r", kind, {"rule": "kl_explosion", **payload}, decision_id=did)
        store.update_action(aid, status=st, result=result)
    store.settle_decision(did)
    (d,) = [x for x in store.decisions("r") if x["id"] == did]
    return d


def test_the_sentence_says_what_was_done_advised_or_held_from_the_journal(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("r", str(tmp_path / "r")))
    sets = {"set": {"actor_rollout_ref.actor.optim.lr": 8e-5, "algorithm.kl_ctrl.kl_coef": 0.002},
            "from": {"actor_rollout_ref.actor.optim.lr": 1.6e-4, "algorithm.kl_ctrl.kl_coef": 0.001}}
    done = _decision(store, "done", [
        ("rollback", "done", {"skip_batches": 2, "resume_step": 55, **sets}, {"outcome": "rolled back in process"}),
        ("live_set", "done", {"set": sets["set"]}, {"outcome": "applied v6 at step 57"})])
    assert sentence(done) == ("KL 5.87, 79x its median of the 5 steps before (0.074): rolled back to step 55, "
                              "skipping 2 batches; lr 1.6e-4 -> 8e-5, kl_coef 0.001 -> 0.002")
    by_relaunch = _decision(store, "done", [
        ("rollback", "done", {"skip_batches": 2, **sets}, {"handed_to": 99}),
        ("restart", "done", {"skip_batches": 2, "resume": "path", "resume_step": 55, **sets}, {})])
    assert sentence(by_relaunch).endswith(": rolled back to step 55, skipping 2 batches; lr 1.6e-4 -> 8e-5, "
                                          "kl_coef 0.001 -> 0.002")
    advised = _decision(store, "advised", [("rollback", "advised", {"skip_batches": 2, **sets}, {
        "outcome": "would roll back to step 55 (the last known-good checkpoint), skipping 2 batches"})])
    assert sentence(advised).endswith(": would roll back to step 55 (the last known-good checkpoint), skipping 2 batches")
    waiting = _decision(store, "awaiting", [("rollback", "awaiting", {"skip_batches": 2, "chosen_step": 55, **sets}, {
        "would": "roll back to step 55 (the last known-good checkpoint), skipping 2 batches"})])
    assert sentence(waiting).endswith(": waits for approval: roll back to step 55 (the last known-good checkpoint), "
                                      "skipping 2 batches")
    failed = _decision(store, "failed", [("live_set", "failed", {"set": {"critic.optim.lr": 1e-6}},
                                          {"error": "control v3 not applied within 60 s"})])
    assert sentence(failed).endswith(": could not critic lr -> 1e-6: control v3 not applied within 60 s")


# -- 2. live lines and a webhook message per action ---------------------------------------------------------------


def test_the_progress_line_comes_at_most_every_few_seconds_and_only_when_the_step_moved() -> None:
    class Ctl:
        run = RunRecord("r", "/nowhere", last_step=10)
        latest = {"reward": 0.4062, "val_score": 0.31}

    said: list[str] = []
    now = [100.0]
    progress = Progress(Ctl(), every_s=5.0, clock=lambda: now[0], say=said.append)
    Ctl.run.last_step = 20
    now[0] = 104.0
    assert progress() and said == []  # within 5 s of the last line
    now[0] = 105.0
    assert progress() and said == ["step 20, 2 steps/s, score 0.406, validation 0.31"]
    now[0] = 111.0
    assert progress() and len(said) == 1  # the step did not move: nothing new to say


@pytest.mark.slow
def test_watchdog_run_on_the_demo_faults_talks_live_in_at_most_40_lines_and_each_action_reaches_the_webhook(
        tmp_path: Path, webhook: tuple[str, list[dict]]) -> None:
    url, received = webhook
    state = tmp_path / "state"  # (the run dir "run" relative to tmp_path: a short path on the console)
    env = {**os.environ, "WATCHDOG_WEBHOOK_URL": url, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "ppo_watchdog", "run", *DEMO, "--run-dir", "run",
                             "--state-dir", str(state), "--no-report"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: list[tuple[float, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # each line as it is printed (a pipe: no progress line, events only)
        seen.append((time.time(), line.rstrip("\n")))
    assert proc.wait(timeout=60) in (0, 1), "\n".join(s for _, s in seen)
    out = [s for _, s in seen]
    text = "\n".join(out)
    assert len(out) <= 40, text
    assert not any(re.match(r"^step \d+, [\d.e+-]+ steps/s", s) for s in out), text  # piped: no progress line
    store = Store(state)
    decisions = store.decisions("run")
    entries = [j for d in decisions for j in d["journal"]]
    rollbacks = [j for j in entries if j["status"] == "done" and (
        (j["kind"] == "rollback" and j["result"].get("handed_to") is None)
        or (j["kind"] == "restart" and "skip_batches" in j["payload"]))]
    assert rollbacks, text
    for j in rollbacks:  # a live line within seconds of each rollback's completion
        at = [t for t, s in seen if re.search(rf"rolled back to step {j['payload']['resume_step']}\b", s)]
        assert at and abs(at[0] - j["updated"]) < 10, (j, text)
    # Each rule that acted said as it fired (one covered by a rollback: --all; the watchdog's own restarts: when done).
    fired = [d for d in decisions if d["kind"] == "fire" and d["journal"] and not d["rule"].startswith("watchdog:")]
    assert all(any(s.startswith(f"step {d['step']}: {d['rule']}: ") for s in out) for d in fired), text
    # The webhook: one message in words per action carried out (an alert is its own message).
    said = [a for p in received for a in p["body"]["alerts"] if a["labels"].get("mode") in ("done", "failed")]
    acted = [j for j in entries if j["status"] in ("done", "failed") and j["kind"] != "notify"
             and j["result"].get("handed_to") is None
             and not (j["status"] == "done" and (j["payload"].get("follows") or j["result"].get("carried_by")))]
    assert len(said) == len(acted), (said, acted)
    summaries = [a["annotations"]["summary"] for a in said]
    assert any("rolled back to step" in s for s in summaries), summaries
    assert any(re.search(r"lr [\d.e-]+ -> [\d.e-]+", s) for s in summaries), summaries
    assert not any(re.search(r"\bset; set\b|\(journal \d+\)|applied v\d", s) for s in summaries), summaries
    # 3. its end: the header, then a line per action, the same as `watchdog history run`.
    told = story(store.require_run("run"), decisions)
    assert told.header[0] in text and all(line in text for line in told.lines), text
    assert re.search(r"^run run: (finished|stopped: .+); 80 steps in ", told.header[0]), told.header
    hist = CliRunner().invoke(app, ["history", "run", "--state-dir", str(state)], env={"COLUMNS": "200"})
    assert hist.exit_code == 0 and told.header[0] in hist.output and told.lines[0] in hist.output, hist.output
    n = counts(decisions)
    assert f"{n['rollbacks']} rollbacks" in told.header[-1] and n["rollbacks"] == len(rollbacks)
    relaunches = len([j for j in entries if j["kind"] == "restart" and j["status"] == "done"])
    assert n["relaunches"] == relaunches and (relaunches == 0 or f"{relaunches} relaunches" in told.header[-1])
    assert "last step None" not in text and "cost live" not in text


# -- 3. the end-of-run summary -------------------------------------------------------------------------------------


def test_the_story_counts_what_the_journal_holds_and_shows_resolves_and_no_ops_only_with_all(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": {"val-core/reward/mean@1": v}}) + "\n"
                                                  for s, v in ((0, 0.242), (40, 0.3), (80, 0.406))))
    store = Store(tmp_path / "state")
    store.upsert_run(RunRecord("r", str(run_dir), phase="finished", last_step=80, created=time.time() - 100.2,
                               overrides={"actor_rollout_ref.actor.optim.lr": 8e-5}))
    sets = {"set": {"actor_rollout_ref.actor.optim.lr": 8e-5}, "from": {"actor_rollout_ref.actor.optim.lr": 1.6e-4}}
    _decision(store, "done", [("rollback", "done", {"skip_batches": 2, **sets}, {"handed_to": 9}),
                              ("restart", "done", {"skip_batches": 2, "resume": "path", "resume_step": 55, **sets}, {})])
    store.add_decision("r", 62, "kl_drift", "fire", [], {}, "critical", "KL 0.9", status="skipped",
                       outcome="covered by the rollback in progress")
    store.add_decision("r", 70, "kl_drift", "resolve", [], {}, "critical", "kl_drift no longer holds at step 70",
                       status="skipped", outcome="resolved")
    decisions = store.decisions("r")
    told = story(store.require_run("r"), decisions)
    assert told.header == ["run r: finished; 80 steps in 100 s", "changed: lr 1.6e-4 -> 8e-5",
                           "validation score 0.242 at step 0, 0.406 at step 80",
                           "actions: 1 rollbacks, 1 relaunches"]
    assert told.lines[0].startswith("step    61  kl_explosion: KL 5.87") and "rolled back to step 55" in told.lines[0]
    assert told.lines[1] == "(2 more decision(s) that did nothing or resolved: --all)"
    every = story(store.require_run("r"), decisions, all_decisions=True)
    assert len(every.lines) == 3 and "covered by the rollback in progress" in every.lines[1]
    assert every.lines[2] == "step    70  kl_drift: kl_drift no longer holds at step 70"
    r = CliRunner().invoke(app, ["history", "r", "--json", "--state-dir", str(tmp_path / "state")])
    rows = json.loads(r.output)
    assert rows[0]["sentence"] == sentence(decisions[0]) and rows[0]["inputs"] == {"kl": 5.87}
