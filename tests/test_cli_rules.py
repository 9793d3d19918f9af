"""The `watchdog` CLI: rules list/check/test/explain and replay, through Typer's CliRunner and a real process."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner
from verl_logs import HEALTHY, NAN, needs_logs

from ppo_watchdog import cli
from ppo_watchdog.core import rulefile
from ppo_watchdog.core.rulefile import load_rules
from ppo_watchdog.protocol import catalog, rundir

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "rules" / "default.yaml"
DEFAULT_TESTS = ROOT / "rules" / "tests"

needs_default = pytest.mark.skipif(not DEFAULT.exists(), reason="rules/default.yaml not written yet")

runner = CliRunner()

GOOD = """\
version: 1
rules:
  - name: kl_over
    description: KL above the seed's 0.1 threshold; raise kl_coef, capped.
    expr: kl > 0.1
    for: 2
    clear: kl < 0.09
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.2, max: 0.01}
    cooldown: 5
  - name: vf_nan
    description: Non-finite value loss; restore the last good checkpoint.
    expr: not isfinite(vf_loss) or event("nan") > 0
    actions:
      - rollback: {skip_batches: 1}
      - notify: {message: value loss is not finite}
    severity: critical
"""

# Three mistakes in one file, each must be reported with its own line and column.
BROKEN = """\
version: 1
rules:
  - name: kl_over
    description: x
    expr: kl > 0.1 and
    actions: [notify]
  - name: typo
    description: y
    expr: klx > 0.1
    colour: red
    actions: [notify]
"""


@pytest.fixture()
def good(tmp_path: Path) -> Path:
    p = tmp_path / "good.yaml"
    p.write_text(GOOD)
    return p


def invoke(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(cli.app, [str(a) for a in args], env=env)


def test_rules_check_accepts_a_valid_file(good: Path) -> None:
    r = invoke("rules", "check", good)
    assert r.exit_code == 0, r.output
    assert "OK: 2 rules in 1 file(s)" in r.stdout


def test_rules_check_reports_every_error_as_file_line_col_and_fails(good: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN)
    r = invoke("rules", "check", good, bad)
    assert r.exit_code == 2  # a bad file is bad input
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith(str(bad) + ":")]
    assert len(errors) >= 3, r.stderr
    lines = {int(e.split(":")[1]) for e in errors}
    assert {5, 9, 10} <= lines  # the dangling 'and', the unknown metric, the unknown key
    assert any("klx" in e for e in errors) and any("colour" in e for e in errors)
    for e in errors:
        _, line, col, _msg = e.split(":", 3)
        assert line.isdigit() and col.isdigit()


def test_rules_check_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    r = invoke("rules", "check", tmp_path / "absent.yaml")
    assert r.exit_code == 2
    assert "absent.yaml: no such file or directory" in r.stderr


def test_rules_list_prints_a_table_and_json(good: Path) -> None:
    r = invoke("rules", "list", good)
    assert r.exit_code == 0, r.output
    assert "kl_over" in r.stdout and "vf_nan" in r.stdout
    assert "set algorithm.kl_ctrl.kl_coef x1.2 (max 0.01)" in r.stdout
    r = invoke("rules", "list", good, "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert [d["name"] for d in doc] == ["kl_over", "vf_nan"]
    assert doc[0]["for"] == 2 and doc[0]["cooldown"] == 5 and doc[0]["clear"] == "kl < 0.09"
    assert doc[0]["metrics"] == ["kl"]
    assert doc[1]["actions"] == [{"kind": "rollback", "skip_batches": 1},
                                 {"kind": "notify", "message": "value loss is not finite"}]


def test_rules_explain_shows_rationale_actions_and_catalog_descriptions(good: Path) -> None:
    r = invoke("rules", "explain", "kl_over", "--rules", good)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "KL above the seed's 0.1 threshold" in out
    assert "kl > 0.1" in out and "kl < 0.09" in out
    assert "set algorithm.kl_ctrl.kl_coef x1.2 (max 0.01)" in out
    m = catalog.BY_SHORT["kl"]
    assert m.key in out and m.prom in out and m.help[:40] in out


def test_rules_explain_of_an_unknown_rule_suggests_the_near_one(good: Path) -> None:
    r = invoke("rules", "explain", "kl_ovr", "-r", good)
    assert r.exit_code == 2
    assert "no rule named 'kl_ovr'" in r.stderr and "kl_over" in r.stderr


def test_rules_test_passes_and_fails_with_exit_codes(good: Path, tmp_path: Path) -> None:
    t = tmp_path / "t.yaml"
    t.write_text(f"""\
rule_files: [{good.name}]
tests:
  - name: KL above 0.1 for two steps raises kl_coef
    rules: [kl_over]
    input_series:
      kl: "0.02x3 0.15x2"   # steps 1-4 at 0.02, steps 5-7 at 0.15 (promtool: axn is n+1 values)
    expect:
      - {{step: 6, rule: kl_over, kind: fire, actions: [set]}}
""")
    r = invoke("rules", "test", t)
    assert r.exit_code == 0, r.output
    assert "1 passed, 0 failed" in r.stdout
    t.write_text(t.read_text().replace("step: 6", "step: 5"))
    r = invoke("rules", "test", tmp_path)
    assert r.exit_code == 1
    assert "FAIL" in r.stdout


@needs_logs
def test_replay_of_verl_console_log_prints_the_kl_fire_with_would_set_values(good: Path) -> None:
    r = invoke("replay", HEALTHY, "--rules", good)
    assert r.exit_code == 0, r.output
    assert "106 steps (0..105)" in r.stdout
    assert "kl_over" in r.stdout and "0.001 -> 0.0012" in r.stdout


@needs_logs
def test_replay_json_is_a_list_of_decisions(good: Path) -> None:
    r = invoke("replay", NAN, "--rules", good, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert isinstance(doc, list) and doc
    first = doc[0]
    assert (first["step"], first["rule"], first["kind"]) == (1, "vf_nan", "fire")
    assert [a["kind"] for a in first["actions"]] == ["rollback", "notify"]
    assert "NAN_single" not in r.stdout  # warnings go to stderr only
    assert "verl_issue_nan_single_step_excerpts.txt:7" in r.stderr


def test_replay_of_a_run_dir_uses_its_events_and_set_values(good: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for s in range(1, 5):
        rundir.append_metrics(run, s, {"actor/reward_kl_penalty": 0.2, "actor/reward_kl_penalty_coeff": 0.002,
                                       "critic/vf_loss": 0.1})
    rundir.append_event(run, "nan", 3, what="loss")
    r = invoke("replay", run, "-r", good, "--json")
    assert r.exit_code == 0, r.output
    got = [(d["step"], d["rule"], d["kind"]) for d in json.loads(r.stdout)]
    assert (2, "kl_over", "fire") in got and (3, "vf_nan", "fire") in got
    kl = next(d for d in json.loads(r.stdout) if d["rule"] == "kl_over")
    assert (kl["actions"][0]["from"], kl["actions"][0]["to"]) == (0.002, pytest.approx(0.0024))


def test_replay_of_a_missing_file_is_a_clean_error(good: Path, tmp_path: Path) -> None:
    r = invoke("replay", tmp_path / "nope.jsonl", "-r", good)
    assert r.exit_code == 2
    assert "nope.jsonl: no such file" in r.stderr
    assert "Traceback" not in r.output


def test_replay_of_a_file_without_metrics_is_a_clean_error(good: Path, tmp_path: Path) -> None:
    p = tmp_path / "empty.log"
    p.write_text("nothing to see here\n")
    r = invoke("replay", p, "-r", good)
    assert r.exit_code == 2 and "no metric records found" in r.stderr


def test_broken_rules_for_replay_exit_2_with_every_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN)
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 1, "data": {"critic/kl": 0.1}}\n')
    r = invoke("replay", log, "-r", bad)
    assert r.exit_code == 2 and f"{bad}:9:" in r.stderr


def test_rules_env_variable_overrides_the_default_pack(good: Path) -> None:
    r = invoke("rules", "list", "--json", env={rulefile.RULES_ENV: str(good)})
    assert r.exit_code == 0, r.output
    assert [d["name"] for d in json.loads(r.stdout)] == ["kl_over", "vf_nan"]


@needs_default
def test_default_pack_is_found_and_checks_clean() -> None:
    assert rulefile.default_rules_paths() == [DEFAULT]
    r = invoke("rules", "check", DEFAULT)
    assert r.exit_code == 0, r.output
    r = invoke("rules", "list")
    assert r.exit_code == 0, r.output


@needs_default
@pytest.mark.skipif(not list(DEFAULT_TESTS.glob("*.y*ml")), reason="rules/tests/ not written yet")
def test_default_pack_rule_tests_pass() -> None:
    r = invoke("rules", "test", DEFAULT_TESTS)
    assert r.exit_code == 0, r.output


def test_python_dash_m_watchdog_runs_as_a_real_process(good: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "ppo_watchdog", "rules", "check", str(good)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "OK: 2 rules" in p.stdout
    p = subprocess.run([sys.executable, "-m", "ppo_watchdog", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "rules" in p.stdout and "replay" in p.stdout


def _bench(script: str, result: str, tmp_path: Path, *args: str, timeout: float) -> dict:
    """Run bench/SCRIPT with ARGS writing into TMP_PATH; its RESULT.json, once it exited 0."""
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads((tmp_path / f"{result}.json").read_text())


@needs_default
def test_rules_benchmark_script_writes_its_json_and_table(tmp_path: Path) -> None:
    doc = _bench("bench_rules.py", "rules_bench", tmp_path, "--sizes", "1,10", "--repeats", "2", timeout=120)
    assert [r["runs"] for r in doc["results"]] == [1, 10]
    assert all(r["eval_ms_median"] > 0 and r["repeats"] == 2 for r in doc["results"])
    assert doc["rules"] == len(load_rules([DEFAULT]))
    assert "| 10 |" in (tmp_path / "rules_bench.md").read_text()


@needs_default
def test_daemon_scale_floor_part_adds_the_read_and_the_rules_for_each_split(tmp_path: Path) -> None:
    doc = _bench("daemon_scale.py", "daemon_scale_floor", tmp_path, "--part", "floor", "--runs", "20", "--steps", "2",
                 "--processes", "1,2", "--repeats", "3", timeout=180)
    assert doc["command"].startswith("python bench/daemon_scale.py --part floor --runs 20")
    assert [(r["processes"], r["runs_a_process"]) for r in doc["results"]] == [(1, 20), (2, 10)]
    for r in doc["results"]:
        assert r["read_cpu_ms"] > 0 and r["rules_ms_a_step"] > 0
        assert r["rules_ms"] == pytest.approx(2 * r["rules_ms_a_step"], abs=0.1)
        assert r["to_short_ms"] > 0  # (the read's mapping of its records: the rules' append maps them again)
        assert r["floor_ms"] == pytest.approx(r["read_cpu_ms"] + r["rules_ms"] - r["to_short_ms"], abs=0.1)
        assert r["left_for_the_rest_ms"] == pytest.approx(300.0 - r["floor_ms"], abs=0.1)
    assert "| 2 | 10 |" in (tmp_path / "daemon_scale_floor.md").read_text()


def test_daemon_scale_idle_journal_and_live_set_parts_write_their_figures(tmp_path: Path) -> None:
    idle = _bench("daemon_scale.py", "daemon_scale_idle", tmp_path, "--part", "idle", "--runs", "5", "--ticks", "2",
                  timeout=120)
    assert (idle["runs"], idle["idle_ticks"]) == (5, 2) and 0 < idle["cpu_ms_p50"] <= idle["cpu_ms_max"]
    journal = _bench("daemon_scale.py", "daemon_scale_journal", tmp_path, "--part", "journal", "--sizes", "50", "200",
                     "--settle", "20", timeout=120)
    assert [r["journal_entries"] for r in journal["rows"]] == [50, 200]
    assert all(r["settle_ms_p50_indexed"] > 0 and r["settle_ms_p50_without_index"] > 0 for r in journal["rows"])
    live = _bench("daemon_scale.py", "daemon_scale_live_set", tmp_path, "--part", "live-set", "--n", "20", "--dirs",
                  "2", "--rounds", "2", timeout=120)
    assert len(live["parts"]) == 4 and all(len(p["wall_ms_rounds"]) == 2 for p in live["parts"].values())
    for name in ("idle", "journal", "live_set"):
        md = (tmp_path / f"daemon_scale_{name}.md").read_text()
        assert "Command: `python bench/daemon_scale.py --part" in md and "commit " in md


def test_daemon_scale_refuses_a_part_it_does_not_have() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "daemon_scale.py"), "--part", "tick_floor"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--part must be one of floor, idle, journal, live-set, instructions" in p.stderr


def _kernel_shows_frames() -> bool:
    """Whether /proc/self/pagemap gives this process the frame of a page it has written (as the bench's shards'
    would: they run as this process does)."""
    page = os.sysconf("SC_PAGE_SIZE")
    buf = ctypes.create_string_buffer(b"x" * 2 * page)  # (written: a page of it is surely present)
    inside = (ctypes.addressof(buf) // page + 1) * page
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(inside // page * 8)
            (entry,) = struct.unpack("Q", pagemap.read(8))
    except OSError:
        return False
    return entry & ((1 << 55) - 1) != 0


@needs_default
def test_daemon_scale_with_shards_counts_the_frames_they_share_once(tmp_path: Path) -> None:
    d = _bench("daemon_scale.py", "daemon_scale", tmp_path, "--runs", "6", "--hours", "0.05", "--shards", "2",
               timeout=180)
    assert (d["shards"], d["ticks"], len(d["shard_tick_ms_p50"])) == (2, 3, 2)
    for rss, pss in zip(d["peak_rss_mib_per_shard"], d["peak_pss_mib_per_shard"], strict=True):
        assert 0 < pss < rss  # (each maps libraries the other maps too)
    md = (tmp_path / "daemon_scale.md").read_text()
    if not _kernel_shows_frames():  # (without CAP_SYS_ADMIN: every frame reads as 0)
        assert d["end_held_mib_all_shards"] is None and "only to a process with CAP_SYS_ADMIN" in md
        return
    ends = d["end_rss_mib_per_shard"]
    assert max(ends) < d["end_held_mib_all_shards"] < sum(ends)  # each its own pages, the libraries once
    assert f"**{d['end_held_mib_all_shards']} MiB held together**" in md


def test_replay_of_a_console_log_ending_in_cuda_oom_fires_the_oom_rule(tmp_path: Path) -> None:
    rules = tmp_path / "oom.yaml"
    rules.write_text("""\
version: 1
rules:
  - name: oom_seen
    description: An OOM; one micro-batch less.
    expr: event("oom") > 0
    actions:
      - set: {key: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, add: -1, min: 1}
""")
    log = tmp_path / "console.log"
    log.write_text("step:1 - critic/kl:0.01\nstep:2 - critic/kl:0.01\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB\n")
    r = invoke("replay", log, "-r", rules, "--json", "--set",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    assert r.exit_code == 0, r.output
    fires = [d for d in json.loads(r.stdout) if d["kind"] == "fire"]
    assert [(d["step"], d["rule"]) for d in fires] == [(2, "oom_seen")]
    assert (fires[0]["actions"][0]["from"], fires[0]["actions"][0]["to"]) == (8.0, 7)


def test_replay_rejects_a_malformed_set_option(good: Path, tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 1, "data": {"critic/kl": 0.01}}\n')
    r = invoke("replay", log, "-r", good, "--set", "lr")
    assert r.exit_code == 2 and "--set expects KEY=NUMBER, got 'lr'" in r.stderr


def test_a_missing_default_pack_names_the_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_watchdog.core import rulefile

    monkeypatch.setattr(rulefile, "__file__", str(tmp_path / "pkg" / "watchdog" / "rulefile.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(rulefile.RULES_ENV, raising=False)
    r = invoke("rules", "list")
    assert r.exit_code == 2
    assert "--rules" in r.stderr and rulefile.RULES_ENV in r.stderr


@needs_default
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_daemon_scale_instructions_part_counts_the_ticks_as_the_difference_of_two_callgrind_runs(
        tmp_path: Path) -> None:
    doc = _bench("daemon_scale.py", "daemon_scale_instructions", tmp_path, "--part", "instructions", "--runs", "2",
                 "--hours", "0.05", timeout=600)
    counts = doc["instructions"]
    assert counts["with_ticks"] > counts["without_ticks"] > 0
    assert doc["tick_instructions"] == counts["with_ticks"] - counts["without_ticks"]
    assert (doc["ticks"], doc["steps_per_run"]) == (3, 12)  # 0.05 h: three 60 s ticks of four 15 s steps
    assert doc["tick_instructions_per_run_step"] == round(doc["tick_instructions"] / (2 * 12))
    assert f"{doc['tick_instructions']:,}" in (tmp_path / "daemon_scale_instructions.md").read_text()
