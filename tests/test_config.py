"""Config: verl's dotted keys, key=value overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_watchdog.protocol import catalog
from ppo_watchdog.trainer.config import Config, ConfigError, known_keys, load_config, parse_override


def test_defaults_validate_and_every_live_key_exists() -> None:
    cfg = Config()
    flat = cfg.to_flat()
    for key in catalog.LIVE_KEYS:
        assert key in flat, key
    assert set(flat) == set(known_keys())


def test_overrides_use_verl_keys_and_yaml_values_with_an_optional_plus() -> None:
    cfg = load_config([
        "algorithm.kl_ctrl.kl_coef=0.001",
        "+trainer.faults='nan@3,oom@5'",
        "++actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.reward_clip=[-1, 1]",
        "trainer.memory_budget_tokens=null",
        "trainer.logger=[console]",
    ])
    assert cfg.get("algorithm.kl_ctrl.kl_coef") == 0.001
    assert cfg.trainer.faults == "nan@3,oom@5"
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.algorithm.reward_clip == [-1.0, 1.0]
    assert cfg.trainer.memory_budget_tokens is None
    assert cfg.trainer.logger == ["console"]


def test_an_unknown_key_names_itself_and_the_closest_known_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm.kl_ctrl.kl_coeff=0.1"])
    assert "'algorithm.kl_ctrl.kl_coeff'" in str(err.value)
    assert "'algorithm.kl_ctrl.kl_coef'" in str(err.value)
    assert err.value.key == "algorithm.kl_ctrl.kl_coeff"
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.lr"):
        load_config(["actor.optim.lr=1e-3"])


def test_a_value_of_the_wrong_type_names_key_and_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["trainer.seed=abc"])
    assert "trainer.seed" in str(err.value) and "'abc'" in str(err.value)
    with pytest.raises(ConfigError, match="trainer.oom_retry_live"):
        load_config(["trainer.oom_retry_live=maybe"])
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        load_config(["data.train_batch_size=2.5"])


def test_mini_batch_must_be_divisible_by_micro_batch() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"])
    assert err.value.key == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    assert "divisible" in str(err.value)
    with pytest.raises(ConfigError, match="critic.ppo_mini_batch_size"):
        load_config(["critic.ppo_mini_batch_size=48"])  # 128 prompts are not whole mini batches of 48


def test_a_failed_set_leaves_the_old_value_in_place() -> None:
    cfg = Config()
    old = cfg.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    with pytest.raises(ConfigError):
        cfg.set("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 7)
    assert cfg.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") == old
    assert cfg.set("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "16") == 16


def test_cross_field_checks_name_the_key() -> None:
    for override, key in [
        ("trainer.resume_mode=resume_path", "trainer.resume_from_path"),
        ("trainer.resume_mode=sometimes", "trainer.resume_mode"),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type"),
        ("algorithm.reward_clip=[2, -2]", "algorithm.reward_clip"),
        ("data.offline=true", "data.train_files"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config([override])
        assert err.value.key == key, override


def test_a_group_is_not_a_value() -> None:
    with pytest.raises(ConfigError, match="group"):
        load_config(["algorithm.kl_ctrl=0.1"])


def test_a_yaml_config_file_is_read_with_safe_load_and_overrides_win(tmp_path: Path) -> None:
    f = tmp_path / "ppo.yaml"
    f.write_text("algorithm:\n  kl_ctrl:\n    kl_coef: 0.002\n    type: adaptive\ntrainer:\n  seed: 7\n")
    cfg = load_config(["trainer.seed=9"], f)
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.002 and cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.trainer.seed == 9
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  sead: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*trainer.sead.*trainer.seed"):
        load_config([], bad)
    evil = tmp_path / "evil.yaml"
    evil.write_text("trainer: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(Exception, match="could not determine a constructor|constructor"):
        load_config([], evil)


def test_parse_override_requires_key_equals_value() -> None:
    assert parse_override("+a.b=[1,2]") == ("a.b", [1, 2])
    assert parse_override("a.b=") == ("a.b", "")
    with pytest.raises(ConfigError):
        parse_override("a.b")


def test_to_dict_round_trips_through_from_dict() -> None:
    from ppo_watchdog.trainer.config import from_dict

    cfg = load_config(["algorithm.kl_ctrl.kl_coef=0.003", "trainer.faults=nan@2"])
    again = from_dict(cfg.to_dict())
    assert again.to_flat() == cfg.to_flat()
