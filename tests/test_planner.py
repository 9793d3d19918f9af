"""The one planner: what a decision becomes, for the live controller, replay and eval alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_watchdog.core.actions import CheckpointAction, NotifyAction, PauseAction, RollbackAction, SetAction
from ppo_watchdog.core.engine import Decision
from ppo_watchdog.core.planner import PlanContext, current_value, plan_decision, snap_micro_batch
from ppo_watchdog.core.rulefile import load_rules
from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol.runinfo import RunInfo

KL = "algorithm.kl_ctrl.kl_coef"
LR = "actor_rollout_ref.actor.optim.lr"
LIVE = catalog.LIVE_KEYS


def _decision(kind="fire", actions=(), rule="r", step=10, repeat=1, urgent=False):
    return Decision(rule, step, kind, list(actions), {}, "warning", "m", urgent=urgent, repeat=repeat)


def _ctx(overrides=None, latest=None, config=None, live=LIVE, **kw) -> PlanContext:
    return PlanContext(overrides or {}, latest or {}, config or {}, live, **kw)


def test_live_key_set_is_planned_live_from_the_trainers_current_kl_coef():
    d = _decision(actions=[SetAction(KL, "scale", 1.2, max=0.02)])
    (p,) = plan_decision(d, _ctx(latest={"kl_coef": 0.01}))
    assert p.kind == "live_set" and p.payload["set"] == {KL: pytest.approx(0.012)}
    assert p.payload["from"] == {KL: 0.01}


def test_set_is_clamped_by_the_rules_max():
    d = _decision(actions=[SetAction(KL, "scale", 1.2, max=0.02)])
    (p,) = plan_decision(d, _ctx({KL: 0.019}, {"kl_coef": 0.019}))
    assert p.payload["set"][KL] == 0.02


def test_a_key_the_trainer_cannot_change_live_is_planned_as_a_restart():
    d = _decision(actions=[SetAction("algorithm.gamma", "to", 0.99)])
    (p,) = plan_decision(d, _ctx(config={"algorithm": {"gamma": 1.0}}))
    assert p.kind == "restart" and p.payload["set"] == {"algorithm.gamma": 0.99}
    assert p.payload["urgent"] is False  # a tuning relaunch: it may wait for the next checkpoint


def test_sets_after_a_rollback_follow_it_instead_of_going_live():
    d = _decision(actions=[RollbackAction(skip_batches=2), SetAction(LR, "scale", 0.5)])
    (p,) = plan_decision(d, _ctx(config={"actor_rollout_ref": {"actor": {"optim": {"lr": 2e-4}}}}))
    assert p.kind == "rollback" and p.payload["skip_batches"] == 2
    assert p.payload["set"] == {LR: pytest.approx(1e-4)}


def test_micro_batch_set_is_rounded_down_to_a_divisor_of_the_mini_batch():
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    cfg = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8}}}
    d = _decision(actions=[SetAction(micro, "add", -1, min=1)])
    (p,) = plan_decision(d, _ctx(config=cfg))
    assert p.payload["set"] == {micro: 4}
    assert [snap_micro_batch(v, 12) for v in (12, 11, 5, 1, 0)] == [12, 6, 4, 1, 1]


def test_escalation_pauses_and_alerts_even_without_actions():
    kinds = [(p.kind, p.payload.get("command", {}).get("kind")) for p in plan_decision(_decision("escalate"), _ctx())]
    assert kinds == [("command", "pause"), ("notify", None)]


def test_a_notify_only_escalation_never_pauses():
    planned = plan_decision(_decision("escalate", [NotifyAction("kl_high keeps firing")]), _ctx())
    assert [p.kind for p in planned] == ["notify"]


def test_pause_and_checkpoint_actions_become_commands_and_resolve_does_nothing():
    d = _decision(actions=[CheckpointAction(), PauseAction("too many rollbacks")])
    assert [p.payload.get("command", {}).get("kind") for p in plan_decision(d, _ctx())] == \
        ["checkpoint", "pause", None]
    assert plan_decision(_decision("resolve", [SetAction(KL, "scale", 2)]), _ctx()) == []


@pytest.mark.parametrize(("policy", "kinds"), [
    ("pause", ["command", "notify"]), ("stop", ["stop", "notify"]), ("continue", ["notify"]),
])
def test_a_pause_for_a_human_follows_the_runs_escalation_policy(policy, kinds):
    planned = plan_decision(_decision("escalate", [PauseAction("no progress")]), _ctx(on_escalate=policy))
    assert [p.kind for p in planned] == kinds
    if policy == "stop":
        assert "no progress" in planned[0].payload["verdict"]


def test_a_growing_remedy_reaches_its_bound_in_the_expected_number_of_rollbacks():
    # lr 2e-3 (10x too high), halved and compounding: x0.5, x0.25, x0.125 -> 1e-3, 2.5e-4, 3.125e-5, then
    # the floor 5e-5 holds it: three rollbacks reach the bound, and a fourth would change nothing, so
    # the remedy is exhausted and the rule's escalation goes instead (here: a pause for a human).
    grow = SetAction(LR, "scale", 0.5, min=5e-5, grow=True)
    lr, seen = 2e-3, []
    for repeat in (1, 2, 3):
        (p,) = plan_decision(_decision(actions=[RollbackAction(), grow], repeat=repeat), _ctx({LR: lr}))
        lr = p.payload["set"][LR]
        seen.append(lr)
    assert seen == pytest.approx([1e-3, 2.5e-4, 5e-5])
    d = Decision("r", 10, "fire", [RollbackAction(), grow], {}, "critical", "m", repeat=4,
                 escalate=[PauseAction("nothing gentler left"), NotifyAction()])
    planned = plan_decision(d, _ctx({LR: lr}))
    assert [p.kind for p in planned] == ["command", "notify", "notify"]
    assert planned[0].payload["command"]["kind"] == "pause" and planned[0].payload["exhausted"] is True


def test_kl_coef_means_the_kl_loss_coefficient_when_the_run_logs_the_kl_loss():
    d = _decision(actions=[SetAction("kl_coef", "scale", 2.0)])
    (p,) = plan_decision(d, _ctx(latest={"kl_coef": 0.001}, signals={"kl": "actor/kl_loss"}))
    assert p.payload["set"] == {"actor_rollout_ref.actor.kl_loss_coef": pytest.approx(0.002)}
    (p,) = plan_decision(d, _ctx(latest={"kl_coef": 0.001}, signals={"kl": "actor/reward_kl_penalty"}))
    assert p.payload["set"] == {KL: pytest.approx(0.002)}


def test_a_key_nobody_set_starts_from_verls_own_default():
    assert current_value("actor_rollout_ref.actor.ppo_epochs", _ctx()) == 1
    assert current_value(LR, _ctx(latest={"lr": 0.0})) == 1e-6  # a console's "actor/lr:0.000" is not a value
    assert current_value(LR, _ctx(latest={"lr": 3e-6})) == 3e-6
    assert current_value("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", _ctx()) is None


# -- replay and the live controller plan alike ---------------------------------------------------

SAME_PLAN_RULES = """\
version: 1
rules:
  - name: kl_up
    description: KL above 0.1 raises kl_coef 1.2x per fire, from the coefficient the trainer logs
    expr: kl > 0.1
    actions:
      - set: {key: kl_coef, scale: 1.2, max: 0.02}
    cooldown: 2
    repeat: true
  - name: shrink
    description: an OOM shrinks the micro batch, snapped to a divisor of the mini batch
    expr: event("oom") > 0
    actions:
      - set: {key: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, add: -1, min: 1}
    urgent: true
  - name: discount
    description: a restart-only key, planned as a (tuning) relaunch
    expr: step == 6
    actions:
      - set: {key: algorithm.gamma, scale: 0.99}
  - name: diverge
    description: a rollback with a growing lr cut
    expr: reward < 0
    actions:
      - rollback: {skip_batches: 1}
      - set: {key: actor_rollout_ref.actor.optim.lr, scale: 0.5, grow: true}
    cooldown: 1000
    divergence: true
"""


def test_replay_plans_exactly_what_the_live_controller_journals(tmp_path) -> None:
    """The same decisions give the same entries and values. (What replay cannot know, and does not
    model: live, a relaunch or a tuning live set decided while a rollback is still in flight is
    covered by it; the OOM rule here is urgent, as the default pack's, so its live set goes.)"""
    from ppo_watchdog.control.daemon import build_watchdog
    from ppo_watchdog.core.replay import flatten_config, replay
    from ppo_watchdog.core.rulefile import load_rules
    from ppo_watchdog.sources import ingest

    rules = tmp_path / "rules.yaml"
    rules.write_text(SAME_PLAN_RULES)
    run = tmp_path / "run"
    run.mkdir()
    config = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 12, "ppo_micro_batch_size_per_gpu": 12,
                                              "optim": {"lr": 2e-4}}}, "algorithm": {"gamma": 1.0}}
    RunInfo(id="run", config=config).write(run)
    wd = build_watchdog(tmp_path / "state", [rules])
    ctl = wd.add_run(run, managed=False)  # watched: the controller plans and journals, launches nothing
    series = [(0.05, 0.5), (0.2, 0.5), (0.3, 0.5), (0.3, -1.0), (0.3, -1.0), (0.3, 0.5), (0.3, 0.5), (0.05, -1.0)]
    for step, (kl, reward) in enumerate(series, start=1):
        rundir.append_metrics(run, step, {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": 0.01,
                                          "critic/score/mean": reward})
        if step == 5:
            rundir.append_event(run, "oom", 5, micro_batch_size=12)
        ctl.tick()
    live = [(d["step"], d["rule"], [(j["kind"], j["payload"].get("set")) for j in d["journal"]
                                    if j["kind"] in ("live_set", "restart", "rollback") and "carried" not in j["payload"]
                                    and j["payload"].get("resume") not in ("path", "scratch")])  # not the rollback's own restart
            for d in wd.store.decisions("run") if d["kind"] != "resolve"]
    wd.close()
    out = replay(ingest.read_records(run), load_rules([rules]), events=ingest.read_events(run),
                 config=flatten_config(RunInfo.read(run).config))
    replayed = [(d.step, d.rule, [(p.kind, p.payload.get("set")) for p in d.planned if p.relaunch or p.kind == "live_set"])
                for d in out.decisions if d.kind != "resolve"]
    assert replayed == live
    # and the plans are the interesting ones: the logged KL coefficient as the truth (the watched
    # trainer never applied 0.012, it still logs 0.01), snapping, a deferred restart
    flat = {(s, r): p for s, r, p in replayed}
    assert flat[(2, "kl_up")] == [("live_set", {"algorithm.kl_ctrl.kl_coef": pytest.approx(0.012)})]
    assert flat[(4, "kl_up")] == [("live_set", {"algorithm.kl_ctrl.kl_coef": pytest.approx(0.012)})]
    assert flat[(5, "shrink")] == [("live_set", {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 6})]
    assert flat[(6, "discount")] == [("restart", {"algorithm.gamma": pytest.approx(0.99)})]
    assert flat[(4, "diverge")][0][0] == "rollback"


def test_a_decisions_cost_says_live_deferred_merged_dropped_or_what_the_relaunch_cost() -> None:
    from ppo_watchdog.core.pricing import cost_text

    live = {"payload": {"cost": {"relaunch": False, "seconds": 0, "steps_lost": 0}}, "status": "done", "result": {}}
    waiting = {"payload": {"cost": {"relaunch": True, "seconds": 240, "steps_lost": 0}, "clock": 3},
               "status": "waiting", "result": {}}
    merged = {**waiting, "status": "done", "result": {"outcome": "merged into the tuning relaunch of journal 7"}}
    dropped = {**waiting, "status": "dropped", "result": {"outcome": "dropped: kl_high stopped firing while ..."}}
    ran = {**waiting, "status": "done", "result": {"relaunch_s": 251.4, "steps_lost": 2}}
    assert cost_text([live]) == "live"
    assert cost_text([waiting]) == "deferred: waits for the next checkpoint"
    assert cost_text([merged]) == "merged into the tuning relaunch of journal 7"
    assert cost_text([dropped]) == "dropped"
    assert cost_text([ran]) == "relaunch 251 s measured, 2 steps again after waiting for a checkpoint"
    assert cost_text([{"payload": {}, "status": "done", "result": {}}]) == "-"


# -- no remedy that changes nothing (issue 21, item 6) ------------------------------------------


def test_a_raise_of_kl_coef_already_past_its_cap_is_not_sent_and_the_rules_escalation_runs_instead():
    # kl_high raises kl_coef x1.2 capped at 0.02; the embedded trainer runs at 0.1: 0.1 -> 0.1 is no change.
    d = Decision("kl_high", 30, "fire", [SetAction("kl_coef", "scale", 1.2, max=0.02)], {}, "warning", "m",
                 escalate=[NotifyAction("kl_coef cannot go higher")])
    planned = plan_decision(d, _ctx(latest={"kl_coef": 0.1}))
    assert [p.kind for p in planned] == ["notify"]
    assert planned[0].payload["exhausted"] is True and "cannot go higher" in planned[0].payload["summary"]
    assert not any(p.payload.get("set") for p in planned)


def test_of_a_remedy_only_the_sets_that_move_their_key_are_sent():
    d = _decision(actions=[RollbackAction(skip_batches=2), SetAction(KL, "scale", 2.0, max=0.05, grow=True),
                           SetAction(LR, "scale", 0.5, min=1e-8, grow=True)])
    (p,) = plan_decision(d, _ctx({LR: 2e-4}, {"kl_coef": 0.1}))
    assert p.kind == "rollback" and p.payload["set"] == {LR: pytest.approx(1e-4)}
    assert KL not in p.payload["from"]


def test_a_lowering_remedy_at_its_floor_escalates_and_a_notify_only_budget_never_pauses():
    d = Decision("reward_stall", 40, "fire", [SetAction(LR, "scale", 0.9, min=1e-7)], {}, "info", "m",
                 escalate=[NotifyAction()])
    planned = plan_decision(d, _ctx({LR: 1e-7}))
    assert [p.kind for p in planned] == ["notify"]


def test_a_rule_without_a_budget_that_cannot_move_its_key_only_tells_a_human():
    from ppo_watchdog.core.engine import run_series
    from ppo_watchdog.core.rulefile import parse_rules

    rules, errors = parse_rules(
        "version: 1\nrules:\n  - name: up\n    description: raise kl_coef\n    expr: kl > 0.1\n"
        "    actions:\n      - set: {key: kl_coef, scale: 1.2, max: 0.02}\n")
    assert not errors
    recs = [{"step": 1, "data": {"actor/reward_kl_penalty": 0.2, "actor/reward_kl_penalty_coeff": 0.1}}]
    (d,) = [d for sr in run_series(rules, recs) for d in sr.decisions]
    planned = plan_decision(d, _ctx(latest={"kl_coef": 0.1}))
    assert [p.kind for p in planned] == ["notify"] and "remedy exhausted" in planned[0].payload["summary"]


# -- verl's adaptive KL controller (issue 21, item 7) -------------------------------------------

ADAPTIVE = {"algorithm": {"kl_ctrl": {"type": "adaptive", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000}}}


def test_with_an_adaptive_kl_controller_a_tuning_rule_never_sets_kl_coef():
    d = _decision(actions=[SetAction("kl_coef", "scale", 1.2, max=0.02)])
    assert plan_decision(d, _ctx(latest={"kl_coef": 0.004}, config=ADAPTIVE)) == []
    # The same set on a fixed controller is made.
    (p,) = plan_decision(d, _ctx(latest={"kl_coef": 0.004}, config={"algorithm": {"kl_ctrl": {"type": "fixed"}}}))
    assert p.payload["set"] == {KL: pytest.approx(0.0048)}


def test_a_tuning_set_left_out_under_an_adaptive_kl_controller_says_why_in_its_outcome():
    # Found on real verl (bench/verl_e2e.py's adaptive-KL run): the decision read "skipped, no action",
    # the reason only in an INFO log line nobody sees.
    from ppo_watchdog.core.planner import left_out_reason

    d = _decision(actions=[SetAction("kl_coef", "scale", 2.0, max=0.05)])
    why = left_out_reason(d, _ctx(latest={"kl_coef": 0.004}, config=ADAPTIVE))
    assert "adaptive KL controller" in why and KL in why
    assert left_out_reason(d, _ctx(latest={"kl_coef": 0.004}, config={"algorithm": {"kl_ctrl": {"type": "fixed"}}})) == ""
    # An urgent set of it is planned (and says nothing), and so is a tuning rule that also sets something else.
    urgent = _decision(actions=[SetAction("kl_coef", "scale", 2.0)], urgent=True)
    assert left_out_reason(urgent, _ctx(latest={"kl_coef": 0.004}, config=ADAPTIVE)) == ""
    both = _decision(actions=[SetAction("kl_coef", "scale", 2.0), SetAction(LR, "scale", 0.5)])
    assert left_out_reason(both, _ctx(latest={"kl_coef": 0.004}, config=ADAPTIVE)) == ""


def test_with_an_adaptive_kl_controller_a_divergence_rollback_sets_the_value_it_resumes_from():
    d = Decision("kl_explosion", 12, "fire", [RollbackAction(2), SetAction("kl_coef", "scale", 2.0, max=0.05)],
                 {}, "critical", "m", divergence=True, urgent=True)
    (p,) = plan_decision(d, _ctx(latest={"kl_coef": 0.004}, config=ADAPTIVE))
    # The controller's own current value (logged), doubled: where it adapts from once the run resumes.
    assert p.kind == "rollback" and p.payload["set"] == {KL: pytest.approx(0.008)}
    assert p.payload["from"] == {KL: 0.004}


# -- infrastructure vs policy (issue 21, item 1) ------------------------------------------------


def test_a_restart_action_is_a_relaunch_from_the_latest_checkpoint_at_once_and_never_a_rollback():
    from ppo_watchdog.core.actions import RestartAction, StopAction

    d = Decision("rollout_failure", 22, "fire", [RestartAction("rollouts fail"), NotifyAction("x")], {}, "critical",
                 "m", urgent=True)
    planned = plan_decision(d, _ctx())
    assert [p.kind for p in planned] == ["restart", "notify"]
    p = planned[0]
    assert p.relaunch and p.payload["resume"] == "latest" and p.payload["urgent"] is True
    assert p.payload["fresh_engine"] is True and "rollouts fail" in p.payload["reason"]
    # Its escalation stops the run with the cause named, whatever --on-escalate says.
    e = Decision("rollout_failure", 32, "escalate", [StopAction("the rollout engine is broken")], {}, "critical", "m")
    stop, note = plan_decision(e, _ctx(on_escalate="continue"))
    assert stop.kind == "stop" and "the rollout engine is broken" in stop.payload["verdict"] and note.kind == "notify"


def test_the_default_pack_restarts_a_run_whose_rollouts_fail_and_stops_it_the_third_time():
    from pathlib import Path

    from ppo_watchdog.core.replay import replay
    from ppo_watchdog.core.rulefile import load_rules
    from ppo_watchdog.sources.ingest import read_records

    root = Path(__file__).resolve().parents[1]
    rules = load_rules([root / "rules" / "default.yaml"])
    records = read_records(root / "bench" / "corpus_injected" / "infra_rollout_failure_at_40")
    res = replay(records, rules)
    kinds = [(d.step, p.kind) for d in res.decisions for p in d.planned if p.kind in ("restart", "rollback", "stop")]
    assert kinds and kinds[0] == (41, "restart")
    assert not any(k == "rollback" for _, k in kinds)        # never a policy rollback
    assert [k for _, k in kinds].count("restart") == 2 and kinds[-1][1] == "stop"


def test_the_default_packs_kl_leap_takes_an_lr_100x_too_high_to_a_sane_one_in_two_rollbacks():
    # A leap of the per-token KL past 1 nat says the step was at least 10x too large; each fire is a
    # fresh measurement, so each cuts 10x: 1e-2 (100x the TRL bench's healthy 1e-4) -> 1e-3 -> 1e-4,
    # never the 1e-5 that a factor growing to x0.01 would overshoot to.
    rule = load_rules([Path(__file__).resolve().parents[1] / "rules" / "default.yaml"]).get("kl_leap")
    assert rule is not None
    lr, seen = 1e-2, []
    for repeat in (1, 2):
        d = Decision(rule.name, 2, "fire", list(rule.actions), {}, "critical", "m", repeat=repeat)
        (p,) = plan_decision(d, _ctx({LR: lr}, {"kl_coef": 0.04}, signals={"kl": "actor/kl_loss"}))
        assert p.kind == "rollback" and p.payload["skip_batches"] == 2
        lr = p.payload["set"][LR]
        seen.append(lr)
    assert seen == pytest.approx([1e-3, 1e-4])
