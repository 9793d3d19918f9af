"""The CLI refuses what it cannot mean and says what it does: `watchdog run`'s `--`, unknown options, the packs it
loads (`default` by name, `--extra-rules`), `rules test` on a folder of packs and tests, help panels, $COLUMNS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_watchdog_run import TINY
from typer.testing import CliRunner

from ppo_watchdog import cli
from ppo_watchdog.cli import run as run_cli
from ppo_watchdog.cli.console import WIDE, CliConsole
from ppo_watchdog.control.daemon import build_watchdog
from ppo_watchdog.core import rulefile

#: Rules in the shipped default pack, as `packs_text` counts them.
DEFAULT_RULES = len(rulefile.load_rules(rulefile.default_rules_paths()))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "rules" / "default.yaml"
MINE = """version: 1
rules:
  - name: reward_low
    description: the score fell under 1.
    expr: reward < 1
    actions:
      - notify: {message: low score}
"""

runner = CliRunner()


def invoke(*args: object, env: dict[str, str] | None = None):
    # Wide: click's usage errors are boxed at the width, and a folded line would split the words looked for.
    return runner.invoke(cli.app, [str(a) for a in args], env={"COLUMNS": "300", **(env or {})})


@pytest.fixture
def mine(tmp_path: Path) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(MINE)
    return path


def test_run_refuses_an_unknown_option_with_a_did_you_mean_and_starts_nothing(tmp_path: Path) -> None:
    r = invoke("run", "--rule", "x.yaml", "--run-dir", tmp_path / "run", "--state-dir", tmp_path / "state")
    assert r.exit_code == 2
    assert "No such option: --rule" in r.output and "--rules" in r.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "state").exists()


def test_run_refuses_a_trainer_command_without_its_dashes(tmp_path: Path) -> None:
    r = invoke("run", "--run-dir", tmp_path / "run", "python", "train.py")
    assert r.exit_code == 2
    assert "a trainer command goes after --" in r.output
    assert not (tmp_path / "run").exists()


def test_run_with_nothing_after_the_dashes_is_an_error_not_the_demo_trainer(tmp_path: Path) -> None:
    r = invoke("run", "--run-dir", tmp_path / "run", "--state-dir", tmp_path / "state", "--")
    assert r.exit_code == 2
    assert "nothing after --: give the trainer command after it" in " ".join(r.output.split())
    assert not (tmp_path / "run").exists() and not (tmp_path / "state").exists()


def test_options_after_the_dashes_belong_to_the_trainer(tmp_path: Path) -> None:
    seen = {}

    def parse(*args: str) -> None:
        ctx = run_cli.RunCommand("run", params=[]).make_context("run", list(args))
        seen["cmd"] = ctx.meta[run_cli.TRAINER_COMMAND]

    parse("--", "python", "-m", "x", "--rules", "theirs")
    assert seen["cmd"] == ["python", "-m", "x", "--rules", "theirs"]
    parse()
    assert seen["cmd"] is None


@pytest.mark.slow
def test_run_says_its_packs_and_the_embedded_demo_trainer_at_start(tmp_path: Path, mine: Path) -> None:
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--rules", "default", "--extra-rules", str(mine),
           "--run-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"), "--tick", "0.3", "--no-report"]
    for s in [*TINY, "trainer.total_training_steps=2"]:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == f"rules: default.yaml ({DEFAULT_RULES} rules), mine.yaml (1 rule)"
    assert lines[2].startswith("no trainer command (after --): training the embedded demo trainer "
                               "(python -m ppo_watchdog.trainer); its console is in ")


def test_rules_default_by_name_is_the_shipped_pack_and_extra_rules_add_to_it(tmp_path: Path, mine: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rulefile.RULES_ENV, str(mine))  # what runs with no --rules; 'default' is still the shipped pack
    assert rulefile.rule_paths() == [mine]
    assert rulefile.rule_paths(["default"], [mine]) == [DEFAULT.resolve(), mine]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_text(MINE)  # a file of that name is that file
    assert rulefile.rule_paths(["default"]) == [Path("default")]
    monkeypatch.delenv(rulefile.RULES_ENV)
    r = invoke("rules", "explain", "reward_low", "--rules", str(DEFAULT), "--extra-rules", mine)
    assert r.exit_code == 0 and "when:  reward < 1" in r.stdout
    r = invoke("rules", "explain", "nan_or_inf", "--extra-rules", mine)  # the pack is still there
    assert r.exit_code == 0, r.output


def test_the_daemon_loads_default_by_name_and_says_its_packs(tmp_path: Path, mine: Path) -> None:
    wd = build_watchdog(tmp_path / "state", ["default", str(mine)])
    try:
        assert rulefile.packs_text(wd.rules.ruleset) == f"rules: default.yaml ({DEFAULT_RULES} rules), mine.yaml (1 rule)"
    finally:
        wd.close()
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(f"rules: [default, {tmp_path / 'broken.yaml'}]\nstate_dir: {tmp_path / 's'}\n"
                   f"runs: [{{run_dir: {tmp_path / 'r'}}}]\n")
    (tmp_path / "broken.yaml").write_text("version: 1\nrules:\n  - name: x\n")
    r = invoke("daemon", "--config", cfg)
    assert r.exit_code == 2
    said = " ".join(r.output.split())
    assert f"{tmp_path / 'broken.yaml'}:3:" in said and f"{cfg}: rules: 3 error(s) in rule files" in said


def test_rules_test_of_the_shipped_rules_folder_reads_its_tests_not_its_packs() -> None:
    r = invoke("rules", "test", ROOT / "rules")
    assert r.exit_code == 0, r.output
    assert "default.yaml:" not in r.stdout and "verl_cpu.yaml" not in r.stdout and " 0 failed" in r.stdout
    r = invoke("rules", "test", DEFAULT)
    assert r.exit_code == 2 and "a rule pack, not a file of rule tests" in r.stderr


def test_run_help_is_grouped_into_panels_with_examples() -> None:
    r = invoke("run", "--help", env={"COLUMNS": "120"})
    assert r.exit_code == 0
    for panel in ("Trainer", "Rules and remediation", "Timing and budgets", "Where the metrics come from",
                  "Ray cluster", "Alerts and output"):
        assert f"─ {panel} ─" in r.stdout
    assert "Usage: watchdog run [OPTIONS] [-- TRAINER COMMAND ...]" in r.stdout
    assert "Examples:" in r.stdout and "watchdog run --extra-rules mine.yaml -- COMMAND ..." in r.stdout


def test_tables_follow_columns_when_piped(monkeypatch: pytest.MonkeyPatch) -> None:
    r = invoke("rules", "list", env={"COLUMNS": "80"})
    assert r.exit_code == 0
    assert max(map(len, r.stdout.splitlines())) == 80
    monkeypatch.delenv("COLUMNS", raising=False)
    assert CliConsole().width == WIDE  # not a terminal, no $COLUMNS: wide, for a file or a CI log
    monkeypatch.setenv("COLUMNS", "90")
    assert run_cli.console.width == 90  # a console made at import reads $COLUMNS when it prints
