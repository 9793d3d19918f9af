"""The fault-injection matrix, every cell run N times (issue 14; figures in RELIABILITY.md).

    .venv/bin/python bench/faults.py             # 3 rounds, ~25 min on 2 cores
    .venv/bin/python bench/faults.py --rounds 1
    .venv/bin/python bench/faults.py --rounds 1 --only SIGTERM --only racing   # some cells only

A cell is a test that makes one fault on purpose through the real code path and checks the
promise it threatens (tests/test_fault_matrix.py and the tests named below). Each round runs
every cell once in one pytest process (``WATCHDOG_FAULT_MATRIX=1``: all kill -9 phases and the
disk-full cells); per cell: runs, passes, and the failure text of any that failed.
Results: ``bench/results/faults.json`` and ``faults.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from bench_rules import provenance, provenance_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

#: (cell, pytest node id, the promise it tests)
CELLS = [
    *[(f"kill -9 watchdog: {kind} after {phase}",
       f"tests/test_fault_matrix.py::test_a_watchdog_killed_mid_action_then_rerun_acts_exactly_once[{kind}@{phase}]",
       "exactly-once actions")
      for kind, phases in (("live_set", ("decided", "control_written", "signalled")),
                           ("rollback", ("decided", "control_written", "signalled")),
                           ("restart", ("decided", "stopped", "launched")))
      for phase in phases],
    ("kill -9 trainer during a checkpoint write",
     "tests/test_checkpoint.py::test_a_save_killed_midway_leaves_no_visible_checkpoint", "never a torn load"),
    ("corrupt newest checkpoint", "tests/test_checkpoint.py::test_latest_complete_skips_a_corrupt_newest",
     "never a torn load"),
    ("checkpoint missing a part", "tests/test_reliability.py::test_a_checkpoint_missing_a_part_is_skipped_for_the_one_before",
     "never a torn load"),
    ("disk full during a checkpoint save",
     "tests/test_fault_matrix.py::test_disk_full_during_a_checkpoint_save_leaves_the_previous_one_the_newest",
     "never a torn load"),
    ("disk full during a state write",
     "tests/test_fault_matrix.py::test_disk_full_during_a_state_write_keeps_nothing_then_decides",
     "no silent loss of supervision"),
    ("Prometheus down and back",
     "tests/test_promsource.py::test_an_outage_is_logged_counted_and_caught_up_on_without_losing_steps",
     "no action on stale data"),
    ("state database locked past the timeout",
     "tests/test_reliability.py::test_a_tick_that_cannot_commit_keeps_nothing_and_the_next_one_decides",
     "no silent loss of supervision"),
    ("state database locked / corrupt (CLI)",
     "tests/test_reliability.py::test_a_corrupt_or_locked_state_is_said_not_a_traceback", "clean errors"),
    ("trainer that ignores SIGTERM",
     "tests/test_supervisor.py::test_stop_kills_a_process_that_ignores_sigterm_after_the_grace",
     "no unsupervised run"),
    ("bad event line beside a NaN",
     "tests/test_reliability.py::test_a_bad_event_line_is_skipped_and_the_nan_beside_it_still_decided",
     "no silent loss of supervision"),
    # issue 20
    ("two watchdogs racing on one run dir",
     "tests/test_reliability_v2.py::test_two_watchdogs_racing_on_one_run_dir_give_it_one_watchdog_and_one_trainer",
     "one watchdog per run"),
    *[(f"SIGTERM watchdog: {kind} after {phase}",
       f"tests/test_fault_matrix.py::test_a_watchdog_sigtermed_mid_action_stops_cleanly_then_a_rerun_acts_exactly_once"
       f"[{kind}@{phase}]", "SIGTERM is a clean stop")
      for kind, phases in (("live_set", ("decided", "control_written", "signalled")),
                           ("rollback", ("decided", "control_written", "signalled")),
                           ("restart", ("decided", "stopped", "launched")))
      for phase in phases],
    ("a pid reused by an unrelated process",
     "tests/test_reliability_v2.py::test_a_pid_reused_by_another_process_is_not_the_trainer", "a pid is an identity"),
    ("an unrelated pid in run.json",
     "tests/test_reliability_v2.py::test_an_unrelated_pid_in_run_json_is_never_adopted_signalled_or_killed",
     "a pid is an identity"),
    ("a garbled run.json beside 10 healthy runs in one daemon",
     "tests/test_reliability_v2.py::test_a_daemon_with_ten_healthy_runs_and_one_garbled_watches_all_ten",
     "bad run, not bad daemon"),
    # issue 48
    *[(f"hand-written control.json over a waiting live set ({how})",
       "tests/test_reliability_v3.py::test_a_hand_written_control_json_landing_before_the_step_boundary_never_hides"
       f"_the_watchdogs_set[{how}]", "a foreign version never hides the watchdog's change")
      for how in ("same-version", "next-version")],
    ("a relaunch-only key in the desired state",
     "tests/test_reliability_v3.py::test_a_relaunch_only_key_in_the_desired_state_never_reaches_control_json_so_live"
     "_sets_still_apply", "live control outlives a relaunch-only set"),
    *[(f"{name} with the console's reader gone (output piped to tee)",
       f"tests/test_reliability_v3.py::test_a_stop_signal_after_the_consoles_reader_is_gone_still_stops_the_trainer_and"
       f"_records_the_run[{name}]", "no unsupervised run")
      for name in ("Ctrl-C", "SIGTERM")],
    ("known-good checkpoint removed before its relaunch",
     "tests/test_reliability_v3.py::test_a_known_good_checkpoint_removed_before_its_relaunch_falls_back_to_the_one"
     "_before_with_an_alert", "never a torn load"),
    *[(f"verl's known-good checkpoint with a corrupt {what}",
       "tests/test_checkpoint_fallback.py::test_a_verl_file_verl_could_not_load_fails_verification_naming_it"
       f"[{what}]", "a checkpoint that cannot be loaded is resumed never")
      for what in ("data.pt", "actor/optim_world_size_1_rank_0.pt")],
    ("corrupt known-good checkpoints (verl's layout) chosen by a relaunch",
     "tests/test_checkpoint_fallback.py::test_a_corrupt_verl_known_good_checkpoint_falls_back_to_the_one_before_then"
     "_the_start_never_twice", "a checkpoint that cannot be loaded is resumed never"),
    ("a verl attempt that dies loading its checkpoint",
     "tests/test_checkpoint_fallback.py::test_a_verl_attempt_that_died_loading_its_checkpoint_is_a_resume_failure"
     "_naming_the_checkpoint", "a checkpoint that cannot be loaded is resumed never"),
    ("the embedded trainer cannot load a relaunch's checkpoint",
     "tests/test_checkpoint_fallback.py::test_the_embedded_trainer_that_cannot_load_a_relaunchs_checkpoint_is"
     "_relaunched_from_the_one_before", "a checkpoint that cannot be loaded is resumed never"),
]


def _round(junit: Path, cells: list[tuple[str, str, str]]) -> dict[str, tuple[bool, str]]:
    env = {**os.environ, "WATCHDOG_FAULT_MATRIX": "1"}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    *[node for _, node, _ in cells]], cwd=ROOT, env=env, capture_output=True, text=True)
    out: dict[str, tuple[bool, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{file}::{case.get('name')}"
        bad = case.find("failure") or case.find("error")
        skipped = case.find("skipped")
        out[node] = (bad is None and skipped is None,
                     (bad.get("message", "") if bad is not None else skipped.get("message", "") if skipped is not None
                      else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="times each cell runs")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="run only the cells whose name or promise holds TEXT (repeatable); results go to "
                         "faults-subset.json/.md, leaving the full matrix's files as they are")
    args = ap.parse_args()
    chosen = [c for c in CELLS if not args.only or any(t in c[0] or t in c[2] for t in args.only)]
    if not chosen:
        ap.error(f"no cell matches {args.only}")
    runs: dict[str, list[tuple[bool, str]]] = defaultdict(list)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.rounds):
            got = _round(Path(d) / f"round{i}.xml", chosen)
            for _, node, _ in chosen:
                runs[node].append(got.get(node, (False, "not run")))
            print(f"round {i + 1}/{args.rounds}: {sum(ok for ok, _ in got.values())}/{len(chosen)} cells held",
                  flush=True)
    cells = [{"cell": name, "test": node, "promise": promise, "runs": len(runs[node]),
              "held": sum(ok for ok, _ in runs[node]), "failures": sorted({m for ok, m in runs[node] if not ok})}
             for name, node, promise in chosen]
    only = "".join(f" --only {t!r}" for t in args.only)
    result = {**provenance("the fault-injection matrix", "faults.py", None), "command": f"python bench/faults.py --rounds {args.rounds}{only}", "rounds": args.rounds,
              "wall_s": round(time.monotonic() - t0, 1), "cells": cells,
              "held": sum(c["held"] for c in cells), "runs": sum(c["runs"] for c in cells)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "faults-subset" if args.only else "faults"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| {c['cell']} | {c['promise']} | {c['held']}/{c['runs']} | {'; '.join(c['failures'])[:120]} |"
            for c in cells]
    (RESULTS / f"{name}.md").write_text(
        f"# `{result['command']}`\n\n{provenance_line(result, with_command=False)}\n\n{result['held']} of {result['runs']} cell runs held their promise "
        f"({result['wall_s']} s).\n\n| cell | promise | held | failures |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(f"{result['held']}/{result['runs']} held -> {RESULTS / (name + '.md')}")
    return 0 if result["held"] == result["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
