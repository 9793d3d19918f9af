"""Replaying recorded runs through rules: the real verl logs, run directories with events, would-set values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from verl_logs import HEALTHY, NAN, needs_logs

from ppo_watchdog.core import replay
from ppo_watchdog.core.rulefile import load_rules
from ppo_watchdog.protocol import rundir
from ppo_watchdog.sources import ingest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "rules" / "default.yaml"

needs_default = pytest.mark.skipif(not DEFAULT.exists(), reason="rules/default.yaml not written yet")

PACK = """\
version: 1
rules:
  - name: kl_over
    description: KL above the seed's threshold.
    expr: kl > 0.1
    clear: kl < 0.09
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.2, max: 0.01}
  - name: oom_seen
    description: An OOM; one micro-batch less.
    expr: event("oom") > 0
    actions:
      - set: {key: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, add: -1, min: 1}
  - name: vf_nan
    description: Non-finite value loss.
    expr: not isfinite(vf_loss)
    actions:
      - rollback: {skip_batches: 1}
    severity: critical
"""


@pytest.fixture()
def pack(tmp_path: Path):
    p = tmp_path / "pack.yaml"
    p.write_text(PACK)
    return load_rules([p])


@needs_logs
def test_kl_rule_fires_at_the_first_step_kl_passes_threshold_with_the_logged_coef(pack) -> None:
    records = ingest.read_records(HEALTHY)
    # the expectation straight from the records: first step with critic/kl > 0.1
    first = next(r for r in records if r["data"]["critic/kl"] > 0.1)
    coef = first["data"]["critic/kl_coeff"]
    out = replay.replay(records, pack)
    fires = [d for d in out.decisions if d.rule == "kl_over" and d.kind == "fire"]
    assert fires and fires[0].step == first["step"]
    act = fires[0].actions[0]
    assert act["kind"] == "set" and act["key"] == "algorithm.kl_ctrl.kl_coef"
    assert act["from"] == pytest.approx(coef)
    assert act["to"] == pytest.approx(coef * 1.2)
    assert fires[0].inputs["kl"] == pytest.approx(first["data"]["critic/kl"])
    assert out.steps == 106 and (out.first_step, out.last_step) == (0, 105)


@needs_logs
def test_nan_excerpt_triggers_the_rollback_rule_at_its_step(pack) -> None:
    out = replay.replay(ingest.read_records(NAN), pack)
    fired = [(d.step, d.rule) for d in out.decisions if d.kind == "fire"]
    assert (1, "vf_nan") in fired
    assert math.isnan(next(d for d in out.decisions if d.rule == "vf_nan").inputs["vf_loss"])


def test_run_dir_events_drive_event_rules_and_config_comes_from_set_values(tmp_path: Path, pack) -> None:
    for s in range(1, 6):
        rundir.append_metrics(tmp_path, s, {"actor/reward_kl_penalty": 0.01, "critic/vf_loss": 0.2})
    rundir.append_event(tmp_path, "oom", 3, micro_batch_size=4)
    out = replay.replay(ingest.read_records(tmp_path), pack, events=ingest.read_events(tmp_path),
                        config={"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4})
    fires = [d for d in out.decisions if d.rule == "oom_seen" and d.kind == "fire"]
    assert [d.step for d in fires] == [3]
    assert (fires[0].actions[0]["from"], fires[0].actions[0]["to"]) == (4.0, 3)


def test_a_set_without_a_known_current_value_reports_only_the_action(tmp_path: Path, pack) -> None:
    rundir.append_metrics(tmp_path, 1, {"critic/vf_loss": 0.2})
    rundir.append_event(tmp_path, "oom", 1)
    out = replay.replay(ingest.read_records(tmp_path), pack, events=ingest.read_events(tmp_path))
    act = out.decisions[0].actions[0]
    assert "from" not in act and act["text"].startswith("set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")


def test_json_timeline_is_strict_json_even_with_nan_inputs(pack) -> None:
    import json

    recs = [{"step": 1, "data": {"critic/vf_loss": math.nan}}]
    doc = replay.replay(recs, pack).to_json()
    text = json.dumps(doc, allow_nan=False)  # raises if a NaN slipped through
    assert json.loads(text)[0]["inputs"]["vf_loss"] == "nan"


def test_rules_reading_a_metric_the_log_lacks_are_reported_unhealthy(pack) -> None:
    recs = [{"step": s, "data": {"critic/vf_loss": 0.1}} for s in range(1, 4)]
    out = replay.replay(recs, pack)
    assert set(out.unhealthy) == {"kl_over"}
    assert "kl" in out.unhealthy["kl_over"]
    assert out.counts() == {}


def test_decision_counts_per_rule_and_kind(tmp_path: Path, pack) -> None:
    recs = [{"step": s, "data": {"critic/kl": kl, "critic/vf_loss": 0.1}}
            for s, kl in enumerate([0.05, 0.2, 0.2, 0.05, 0.2], start=1)]
    out = replay.replay(recs, pack)
    assert [(d.step, d.kind) for d in out.decisions if d.rule == "kl_over"] == [(2, "fire"), (4, "resolve"), (5, "fire")]
    assert out.counts()["kl_over"] == {"fire": 2, "resolve": 1}


def test_flatten_config_flattens_nested_and_dotted_keys() -> None:
    cfg = {"algorithm": {"kl_ctrl": {"kl_coef": 0.001}}, "trainer.save_freq": 5}
    assert replay.flatten_config(cfg) == {"algorithm.kl_ctrl.kl_coef": 0.001, "trainer.save_freq": 5}


@needs_logs
@needs_default
def test_default_pack_on_the_healthy_verl_log_never_rolls_back_or_pauses() -> None:
    out = replay.replay(ingest.read_records(HEALTHY), load_rules([DEFAULT]))
    drastic = [(d.step, d.rule, a["kind"]) for d in out.decisions for a in d.actions
               if a["kind"] in ("rollback", "pause")]
    assert drastic == []


@needs_logs
@needs_default
def test_default_pack_fires_a_rollback_on_each_nan_excerpt() -> None:
    out = replay.replay(ingest.read_records(NAN), load_rules([DEFAULT]))
    rolled = {d.step for d in out.decisions if d.kind in ("fire", "escalate")
              and any(a["kind"] in ("rollback", "pause") for a in d.actions)}
    assert rolled >= {1, 59, 83}


@pytest.mark.slow
@needs_default
def test_replay_of_a_bad_config_trainer_run_shows_kl_high_after_kl_passes_threshold(
    tmp_path: Path, tiny_trainer_args, trainer_env
) -> None:
    """A real tiny trainer run with a tiny kl_coef and a huge lr, replayed with the default pack.

    The session's tiny model never scores, so the push away from the reference comes from
    an entropy bonus (the only gradient when every reward is 0) and a 30x lr spike.
    """
    import json
    import subprocess

    from typer.testing import CliRunner

    from ppo_watchdog import cli

    run = tmp_path / "bad"
    argv = tiny_trainer_args(run, "algorithm.kl_ctrl.kl_coef=0.0001", "actor_rollout_ref.actor.entropy_coeff=1.0",
                             "actor_rollout_ref.actor.optim.lr=0.003", "trainer.faults=lr_spike@2:x30",
                             "trainer.metrics_port=-1", steps=8)
    proc = subprocess.run(argv, env=trainer_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = ingest.read_records(run)
    kl = {r["step"]: r["data"]["actor/reward_kl_penalty"] for r in records if "actor/reward_kl_penalty" in r["data"]}
    over = sorted(s for s, v in kl.items() if v > 0.1)
    assert over, f"the bad config did not push KL over 0.1: {kl}"
    r = CliRunner().invoke(cli.app, ["replay", str(run), "--json", "--rules", str(DEFAULT)])
    assert r.exit_code == 0, r.output
    decisions = json.loads(r.stdout)
    kl_fires = [d for d in decisions if d["rule"] in ("kl_high", "kl_far_above") and d["kind"] == "fire"]
    assert kl_fires, f"no KL rule fired although KL was {kl}"
    # never before KL passed 0.1, and the input it reports is the recorded value
    assert kl_fires[0]["step"] >= over[0]
    assert kl_fires[0]["inputs"]["kl"] == pytest.approx(kl[kl_fires[0]["step"]])
