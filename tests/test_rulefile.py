"""Rule files: the default pack loads; every bad file fails with file:line:col and a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_watchdog.core import actions as act
from ppo_watchdog.core.rulefile import RuleError, RuleFileError, load_rules, parse_rules
from ppo_watchdog.protocol import catalog

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "data" / "bad_rules"

# (file, [(line, col or None, substring of the message), ...]): every listed error must be
# reported, and no others.
BAD_FILES = [
    ("unknown_key.yaml", [(6, 5, "rule 'kl_high': unknown key 'thresold'")]),
    ("unknown_metric.yaml", [(5, 15, "unknown metric 'kll' (did you mean 'kl'?)")]),
    ("unknown_function.yaml", [(5, 12, "unknown function 'mean'")]),
    ("bad_set_key.yaml", [(7, 20, "'algorithm.kl_ctrl.klcoef' is not a tunable key (did you mean 'algorithm.kl_ctrl.kl_coef'?)")]),
    ("syntax_error.yaml", [(5, None, "YAML syntax error")]),
    ("wrong_version.yaml", [(1, 10, "unsupported version 2")]),
    ("duplicate_name.yaml", [(7, 5, "rule 'kl_high' is defined twice (first at line 3)")]),
    ("not_a_condition.yaml", [(5, 11, "expression must be a condition, got a number")]),
    (
        "repeat_without_cooldown.yaml",
        [(6, 13, "repeat needs a cooldown >= 1"), (8, None, "min 0.5 is above max 0.1")],
    ),
    (
        "many_errors.yaml",
        [
            (3, 5, "rule 'first': missing required key 'description'"),
            (5, 10, "for must be a whole number >= 0, got -1"),
            (6, 15, "severity must be one of info, warning, critical, got 'huge'"),
            (8, None, "give exactly one of scale, add, to (got scale, add)"),
            (12, 16, "rule 'second': clear: expected a number"),
            (13, 19, "budget.max must be a whole number >= 1, got 0"),
            (14, 15, "unknown action 'explode'"),
        ],
    ),
]


@pytest.mark.parametrize("name,expected", BAD_FILES, ids=[f for f, _ in BAD_FILES])
def test_bad_rule_file_reports_every_error_with_file_line_and_column(name: str, expected: list) -> None:
    path = BAD / name
    with pytest.raises(RuleFileError) as info:
        load_rules([path])
    errors = info.value.errors
    assert len(errors) == len(expected), "\n".join(map(str, errors))
    for err, (line, col, text) in zip(errors, expected, strict=True):
        assert err.file == str(path)
        assert err.line == line, str(err)
        if col is not None:
            assert err.col == col, str(err)
        assert text in err.message, str(err)
        assert str(err).startswith(f"{path}:{line}:{err.col}: ")
    # The exception text lists all of them, one per line, so a CLI can print it as is.
    assert str(info.value).count("\n") == len(expected) - 1


def test_errors_from_several_files_are_reported_together() -> None:
    with pytest.raises(RuleFileError) as info:
        load_rules([BAD / "unknown_key.yaml", BAD / "unknown_metric.yaml"])
    assert {Path(e.file).name for e in info.value.errors} == {"unknown_key.yaml", "unknown_metric.yaml"}


def test_the_same_rule_name_in_two_files_is_an_error(tmp_path: Path) -> None:
    text = "version: 1\nrules:\n  - {name: a, description: x, expr: kl > 1, actions: [notify]}\n"
    (tmp_path / "one.yaml").write_text(text)
    (tmp_path / "two.yaml").write_text(text)
    with pytest.raises(RuleFileError, match=r"two.yaml:3:1: rule 'a' is already defined at .*one.yaml:3"):
        load_rules([tmp_path])


def test_rule_error_prints_as_file_line_col() -> None:
    assert str(RuleError("r.yaml", 3, 7, "boom")) == "r.yaml:3:7: boom"


def test_missing_file_and_empty_file_are_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(RuleFileError) as info:
        load_rules([tmp_path / "nope.yaml", tmp_path / "empty.yaml"])
    text = str(info.value)
    assert "nope.yaml:1:1: cannot read rule file" in text
    assert "empty.yaml:1:1: empty rule file" in text


def test_the_default_pack_loads_with_a_rationale_for_every_rule() -> None:
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    assert len(rules) >= 10
    for rule in rules:
        assert len(rule.description) > 80, rule.name  # a rationale, not a title
        for a in rule.actions:
            if isinstance(a, act.SetAction):
                assert a.key in act.TUNABLE_KEYS
    divergence = {r.name for r in rules if r.divergence}
    assert {"nan_or_inf", "kl_explosion", "reward_collapse", "value_loss_explosion"} <= divergence
    assert rules.params and all(len(p.description) > 80 for p in rules.params)  # each number with its reason
    # Every rule that rolls back is a divergence rule (its checkpoints are not known-good).
    for rule in rules:
        if any(isinstance(a, act.RollbackAction) for a in rule.actions):
            assert rule.divergence, rule.name


def test_kl_coef_raising_is_capped_in_the_default_pack() -> None:
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    for rule in rules:
        for a in rule.actions:
            if isinstance(a, act.SetAction) and a.key in ("algorithm.kl_ctrl.kl_coef", "kl_coef") \
                    and a.op == "scale" and a.value > 1:
                assert a.max is not None and a.max <= 0.05, rule.name


def test_all_action_forms_parse() -> None:
    text = """
version: 1
rules:
  - name: all_forms
    description: every action form.
    expr: kl > 1
    actions:
      - set: {key: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, add: -1, min: 1}
      - set: {key: data.train_batch_size, to: 64}
      - rollback: {skip_batches: 3}
      - rollback
      - checkpoint
      - checkpoint: {}
      - pause: {reason: why}
      - pause:
      - notify: {message: hello}
    budget: {max: 2, window: 10, escalate: [notify]}
    labels: {team: rl, tier: 1}
    severity: info
    enabled: false
"""
    rules, errors = parse_rules(text, "inline.yaml")
    assert errors == []
    r = rules[0]
    assert [a.kind for a in r.actions] == [
        "set", "set", "rollback", "rollback", "checkpoint", "checkpoint", "pause", "pause", "notify",
    ]
    assert r.actions[2] == act.RollbackAction(3)
    assert r.actions[6] == act.PauseAction("why")
    assert r.budget is not None and r.budget.escalate == (act.NotifyAction(),)
    assert r.labels == {"team": "rl", "tier": "1"}
    assert not r.enabled and r.severity == "info" and r.source == "inline.yaml:4"
    assert r.actions[0].live and not r.actions[1].live  # type: ignore[union-attr]


def test_set_action_scales_adds_and_clamps() -> None:
    up = act.SetAction("algorithm.kl_ctrl.kl_coef", "scale", 1.2, max=0.02)
    assert up.apply(0.001) == pytest.approx(0.0012)
    assert up.apply(0.019) == 0.02  # capped
    down = act.SetAction("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "add", -1, min=1)
    assert down.apply(4) == 3 and isinstance(down.apply(4), int)
    assert down.apply(1) == 1  # never below 1
    assert act.SetAction("actor_rollout_ref.actor.ppo_epochs", "add", 1, max=4).apply(4) == 4
    assert act.SetAction("critic.optim.lr", "to", 1e-5).apply(3.0) == 1e-5
    assert up.describe() == "set algorithm.kl_ctrl.kl_coef x1.2 (max 0.02)"
    # A bound never turns a raise into a cut (or a cut into a raise): past the bound, keep the value.
    assert up.apply(0.1) == 0.1
    assert act.SetAction("critic.ppo_micro_batch_size_per_gpu", "add", -8, min=16).apply(8) == 8
    assert act.SetAction("actor_rollout_ref.actor.optim.lr", "scale", 0.5, min=1e-6).apply(1e-7) == 1e-7
    assert act.SetAction("critic.optim.lr", "to", 1e-5, max=1e-6).apply(3.0) == 1e-6  # absolute: clamp
    for a in (up, down, act.RollbackAction(2), act.CheckpointAction(), act.PauseAction("x"), act.NotifyAction("y")):
        assert act.action_from_json(a.to_json()) == a


def test_every_live_key_of_the_run_directory_protocol_is_tunable() -> None:
    for key in catalog.LIVE_KEYS:
        assert act.TUNABLE_KEYS[key].live
    assert not set(act.TUNABLE_KEYS[k.key].live for k in act.RESTART_KEYS) - {False}
