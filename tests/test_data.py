"""The synthetic task: deterministic verl-format parquet, scored by verl's gsm8k rule."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
import pytest

from ppo_watchdog.trainer import data as data_mod


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_same_seed_writes_the_same_rows_and_another_seed_does_not(tmp_path: Path) -> None:
    a = data_mod.write_synthetic(tmp_path / "a", 64, 16, max_operand=9, seed=3)
    b = data_mod.write_synthetic(tmp_path / "b", 64, 16, max_operand=9, seed=3)
    c = data_mod.write_synthetic(tmp_path / "c", 64, 16, max_operand=9, seed=4)
    assert pd.read_parquet(a[0]).equals(pd.read_parquet(b[0]))
    assert pd.read_parquet(a[1]).equals(pd.read_parquet(b[1]))
    assert not pd.read_parquet(a[0]).equals(pd.read_parquet(c[0]))


def test_rows_have_verl_gsm8k_columns_and_correct_answers(tmp_path: Path) -> None:
    train, _ = data_mod.write_synthetic(tmp_path, 50, 10, max_operand=9, seed=0)
    df = pd.read_parquet(train)
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(df.columns)
    for row in df.to_dict("records"):
        assert row["reward_model"]["style"] == "rule"
        msg = row["prompt"][0]
        assert msg["role"] == "user"
        a, rest = msg["content"].rstrip("=?").replace("-", " - ").replace("+", " + ").split(" ", 1)
        op, b = rest.split()
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["reward_model"]["ground_truth"] == str(expected)
        # the reference solution scores 1 under verl's own gsm8k rule
        assert data_mod.score(row["extra_info"]["answer"], row["reward_model"]["ground_truth"]) == 1.0


def test_heldout_validation_problems_never_appear_in_training() -> None:
    rows = data_mod.synthetic_rows(300, 40, max_operand=9, seed=1, heldout=True)
    train_q = {r["extra_info"]["question"] for r in rows["train"]}
    val_q = {r["extra_info"]["question"] for r in rows["val"]}
    assert len(val_q) == 40 and not (train_q & val_q)


@pytest.mark.parametrize("response,truth,expected", [
    ("#### 12", "12", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 12", "13", 0.0),
    ("12", "12", 0.0),           # no #### -> strict gsm8k gives nothing
    ("#### 1 #### 7", "7", 1.0),  # the last answer counts
])
def test_scoring_is_verl_gsm8k_strict(response: str, truth: str, expected: float) -> None:
    assert data_mod.score(response, truth) == expected


def test_any_verl_format_parquet_loads_and_a_broken_one_names_the_column(tmp_path: Path) -> None:
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
             "extra_info": {"split": "test", "index": 0}}]
    good = data_mod.write_parquet(rows, tmp_path / "g.parquet")
    ex = data_mod.load_examples(good)
    assert ex[0].prompt == "Be brief.\n1+1?\n" and ex[0].ground_truth == "2" and ex[0].data_source == "openai/gsm8k"
    bad = data_mod.write_parquet([{"prompt": "x"}], tmp_path / "b.parquet")
    with pytest.raises(data_mod.DataError, match=r"b.parquet.*reward_model"):
        data_mod.load_examples(bad)


def test_offline_rows_carry_responses_and_optional_stored_rewards(tmp_path: Path) -> None:
    path = data_mod.write_parquet(data_mod.offline_rows(40, p_correct=0.5, seed=2), tmp_path / "off.parquet")
    ex = data_mod.load_examples(path, response_key="response", reward_key="reward")
    assert all(e.response and e.response.startswith("#### ") for e in ex)
    # the stored reward agrees with the rule on every row
    assert all(e.reward == data_mod.score(e.response or "", e.ground_truth) for e in ex)
    assert 0 < sum(e.reward or 0 for e in ex) < 40
    no_reward = data_mod.write_parquet(data_mod.offline_rows(8, seed=2, with_reward=False), tmp_path / "n.parquet")
    assert all(e.reward is None for e in data_mod.load_examples(no_reward, response_key="response",
                                                                  reward_key="reward"))
    with pytest.raises(data_mod.DataError, match="answer_text"):
        data_mod.load_examples(tmp_path / "n.parquet", response_key="answer_text")


def test_batch_sampler_order_is_reproducible_from_its_state_and_skip_moves_past_batches() -> None:
    s = data_mod.BatchSampler(10, 3, seed=5)
    first = [s.next() for _ in range(4)]  # 3 batches per epoch: the 4th starts epoch 1
    assert [e for e, _ in first] == [0, 0, 0, 1]
    assert len({i for _, b in first[:3] for i in b}) == 9
    state = s.state_dict()
    after = [s.next() for _ in range(3)]
    t = data_mod.BatchSampler(10, 3, seed=5)
    t.load_state_dict(state)
    assert [t.next() for _ in range(3)] == after
    u = data_mod.BatchSampler(10, 3, seed=5)
    u.load_state_dict(state)
    u.skip(2)
    assert u.next() == after[2]
