"""`watchdog check`: the pre-flight on a log a person has, on each format ingest reads (files in the repository)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ppo_watchdog import cli
from ppo_watchdog.core import rulefile
from ppo_watchdog.sources import ingest

#: Rules in the shipped default pack, as `packs_text` counts them.
DEFAULT_RULES = len(rulefile.load_rules(rulefile.default_rules_paths()))

ROOT = Path(__file__).resolve().parents[1]
VERL = ROOT / "bench" / "corpus_verl"
NAN_CONSOLE = VERL / "nan_at_15_grpo_seed5.console.log"
HEALTHY_JSONL = VERL / "healthy_ppo_seed1.filelogger.jsonl"
QUIET_JSONL = VERL / "healthy_grpo_seed2.filelogger.jsonl"
TRL_DIR = ROOT / "tests" / "data" / "trl" / "lr_high"
TRL_PRINTED = ROOT / "tests" / "data" / "trl" / "lr_high.printed.log"
TRL_RUN = ROOT / "bench" / "corpus_trl" / "lr_high_seed1"

runner = CliRunner()


def check(*args: object, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    r = runner.invoke(cli.app, ["check", *map(str, args)], env=env)
    return r.exit_code, r.stdout, r.stderr


def check_json(*args: object) -> dict:
    code, out, err = check(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_check_of_a_verl_console_log_names_keys_blind_rules_cadence_and_the_rollback_it_would_make() -> None:
    code, out, _ = check(NAN_CONSOLE)
    assert code == 0
    assert f"read {NAN_CONSOLE}: verl console log" in out and "31 steps (0..30)" in out
    assert "cadence: a record every step" in out
    # GRPO with a KL loss: the rules' kl is read from actor/kl_loss (the catalog's fallback), and no critic
    assert any(line.split("│")[1:3] == [" kl                        ", " actor/kl_loss                          "]
               for line in out.splitlines() if line.startswith("│ kl "))
    assert "blind: this run logs no vf_loss (critic/vf_loss): rule(s) value_loss_explosion, value_loss_high" in out
    assert "step 15: nan_or_inf fired (nonfinite()=1" in out
    assert "would do: rollback to last known-good, skip 1 batches" in out
    assert "the default pack would have acted 1 time(s) on its 31 steps (1 rollback, 1 set; rules nan_or_inf)" in out
    assert f"rules: default.yaml ({DEFAULT_RULES} rules)" in out


def test_check_of_a_healthy_filelogger_jsonl_says_what_the_pack_would_have_done_or_that_it_would_do_nothing() -> None:
    rep = check_json(QUIET_JSONL)
    assert rep["format"] == "jsonl" and (rep["first_step"], rep["last_step"], rep["records"]) == (0, 30, 31)
    assert rep["decisions"] == []
    assert rep["summary"] == "the default pack would have done nothing: no rule fired on its 31 steps"
    rep = check_json(HEALTHY_JSONL)  # PPO, KL in the reward: the gentle tier raises kl_coef once
    assert rep["summary"] == ("the default pack would have acted 1 time(s) on its 31 steps (1 set; rules "
                              "kl_above_target), first at step 19 (kl_above_target)")
    kl = next(m for m in rep["metrics"] if m["short"] == "kl")
    assert kl["keys"] == ["actor/reward_kl_penalty"] and "kl_explosion" in kl["rules"]
    assert not any(b["metric"] == "vf_loss" for b in rep["blind"])  # PPO with a critic: the value rules see


def test_check_says_the_cadence_of_a_log_that_records_every_few_steps(tmp_path: Path) -> None:
    lines = HEALTHY_JSONL.read_text().splitlines()
    every5 = tmp_path / "every5.jsonl"
    every5.write_text("\n".join(ln for ln in lines if json.loads(ln)["step"] % 5 == 0) + "\n")
    rep = check_json(every5)
    assert rep["cadence"] == "a record every 5 steps" and rep["gaps"] == {"5": 6}
    uneven = tmp_path / "uneven.jsonl"
    uneven.write_text("\n".join(ln for ln in lines if json.loads(ln)["step"] in (0, 5, 10, 15, 16, 26)) + "\n")
    assert check_json(uneven)["cadence"] == "records 1 to 10 steps apart, mostly 5"


def test_check_of_a_trl_output_directory_reads_its_newest_trainer_state_and_names_trl_keys() -> None:
    rep = check_json(TRL_DIR)
    assert rep["path"] == str(TRL_DIR / "checkpoint-12" / "trainer_state.json")
    assert rep["format"] == "trl_state" and (rep["first_step"], rep["last_step"]) == (1, 12)
    assert rep["cadence"] == "a record every step" and not rep["steps_counted"]
    keys = {m["short"]: m["keys"] for m in rep["metrics"]}
    assert keys["kl"] == ["actor/kl_loss (TRL: kl)"] and keys["reward"] == ["critic/score/mean (TRL: reward)"]
    assert keys["lr"] == ["actor/lr (TRL: learning_rate)"]
    assert "frac_reward_zero_std" in rep["other_keys"]  # a TRL value no rule reads, by its TRL name
    # lr 1e-2: the KL leaps from 0 to 8.1 at step 2 and stays past a nat at 3: the pack rolls back at its second
    # look (one batch's KL estimate alone is no leap)
    first = rep["decisions"][0]
    assert first["step"] == 3 and first["kind"] == "fire" and first["rule"] in {"kl_leap", "kl_explosion"}, first
    assert {a["kind"] for a in first["actions"]} == {"rollback", "set"}


def test_check_of_trl_printed_logs_counts_records_as_steps_and_decides_as_on_trainer_state() -> None:
    printed, state = check_json(TRL_PRINTED), check_json(TRL_DIR)
    assert printed["format"] == "trl_printed" and printed["steps_counted"] and printed["records"] == 12
    assert printed["cadence"].startswith("TRL's printed logs name no steps: the 12 records are counted as steps 1..12")
    # printed to 4 significant digits, logged every step: the same decisions at the same steps
    assert ([(d["step"], d["rule"], d["kind"]) for d in printed["decisions"]]
            == [(d["step"], d["rule"], d["kind"]) for d in state["decisions"]])
    code, out, _ = check(TRL_PRINTED)
    assert code == 0 and "TRL printed logs (one dict a logging step), 12 steps (1..12)" in out


def test_check_of_a_run_directory_reads_its_metrics_and_events() -> None:
    rep = check_json(TRL_RUN)
    assert rep["path"] == str(TRL_RUN / "metrics.jsonl") and rep["format"] == "jsonl"
    assert rep["decisions"] and rep["decisions"][0]["rule"] in ("kl_leap", "kl_explosion")


def test_check_with_extra_rules_says_both_packs_and_a_replaced_pack_is_not_called_the_default(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("version: 1\nrules:\n  - name: reward_low\n    description: the score fell under 1.\n"
                    "    expr: reward < 1\n    actions:\n      - notify: {message: low score}\n")
    rep = check_json(TRL_DIR, "--extra-rules", mine)
    assert rep["packs"] == f"rules: default.yaml ({DEFAULT_RULES} rules), mine.yaml (1 rule)"
    assert rep["summary"].startswith("the default pack") is False and "reward_low" in rep["summary"]
    alone = check_json(TRL_DIR, "--rules", mine)
    assert alone["packs"] == "rules: mine.yaml (1 rule)" and alone["summary"].startswith("the pack would have acted")
    assert check_json(TRL_DIR, "--rules", "default")["summary"].startswith("the default pack would have acted")


def test_check_of_bad_input_exits_2_naming_the_file(tmp_path: Path) -> None:
    code, _, err = check(tmp_path / "missing.log")
    assert code == 2 and f"{tmp_path / 'missing.log'}: no such file" in err
    prose = tmp_path / "notes.txt"
    prose.write_text("training went fine\nnothing to see\n")
    code, _, err = check(prose)
    assert code == 2 and f"{prose}: no metric records found" in err and "Traceback" not in err
    code, _, err = check(tmp_path)
    assert code == 2 and "a directory without metrics.jsonl or TRL's trainer_state.json" in err


def test_trl_readers_map_trl_names_onto_verl_keys_and_skip_what_is_not_a_step(tmp_path: Path) -> None:
    res = ingest.read_run(TRL_PRINTED)
    assert res.format == ingest.FORMAT_TRL_PRINTED and [r["step"] for r in res.records] == list(range(1, 13))
    step2 = res.records[1]["data"]
    assert step2["actor/kl_loss"] == 8.133 and step2["trl/kl"] == 8.133  # '8.133': the .4g string printed
    assert step2["actor/lr"] == 0.01 and "actor/kl_coef" not in step2  # TRL does not log its beta
    # the end-of-training summary ({'train_runtime': ...}) and the console's other lines are not steps
    assert all("trl/train_runtime" not in r["data"] for r in res.records)
    state = ingest.read_run(TRL_DIR / "checkpoint-8" / "trainer_state.json")
    assert state.format == ingest.FORMAT_TRL_STATE and [r["step"] for r in state.records] == list(range(1, 9))
    # a nested dict (verl prints its config so) is no TRL log; an entry with a bad step is named
    bad = tmp_path / "trainer_state.json"
    bad.write_text(json.dumps({"log_history": [{"loss": 0.1, "epoch": 0.1, "step": 1},
                                               {"loss": 0.2, "epoch": 0.2, "step": "two"}]}))
    res = ingest.read_run(bad)
    assert [r["step"] for r in res.records] == [1]
    assert [str(i) for i in res.issues] == [f"{bad}:1: log_history[1]: 'step' must be an integer >= 0, got 'two'"]
    config = tmp_path / "console.log"
    config.write_text("{'actor': {'entropy_coeff': 0, 'optim': {'lr': 1e-06}}, 'epoch': 1}\n")
    assert ingest.read_run(config).records == []
