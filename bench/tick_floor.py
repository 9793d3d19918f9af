"""Benchmark: what one daemon process's tick cannot go below, from two benches of its own parts.

A tick reads every run's new lines and judges every new step before it stores or acts on anything. Both
parts have a bench of their own, each timing the product's code alone on one core:

- the read path (``bench_read.measure``): a ``RunTailer`` per run polled and each record mapped onto
  short names, over run directories ``daemon_scale.py``'s simulated trainer wrote (lines of 100 keys);
- the rules (``bench_rules.bench_size``): per step, every run's ``Window.append_record`` and then the
  default pack's ``engine.evaluate``, screened a read group at a time as the daemon screens.

This runs both at the runs one process has (``--runs`` split over each of ``--processes``, as shards split
them) and ``--steps`` new steps a run a tick, in one process pinned to one core, and adds them: the read
once, the rules once a step, less the mapping of each record onto short names (``catalog.to_short``), which
both benches do (the read maps what it read, ``Window.append_record`` maps again) and the daemon does once.
That sum is a floor: it leaves out the store's transactions, control.json's fsynced writes, the events and
the lockstep that carries the runs through their steps together, which ``daemon_scale.py`` measures with the
rest. Figures are medians over the repeats: CPU time, but the append's and the mapping's wall time (their
benches time them so).

Usage: ``python bench/tick_floor.py [--runs 1000] [--steps 4] [--processes 1,2,3,4] [--target-ms 300]
[--out DIR]``. Writes DIR/tick_floor.json and .md (default DIR bench/results).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_read import measure  # noqa: E402
from bench_rules import RESULTS, base_trajectory, bench_size, pin_one_core, provenance  # noqa: E402

from ppo_watchdog.core.rulefile import load_rules  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000, help="runs the whole daemon watches")
    ap.add_argument("--steps", type=int, default=4, help="new steps a run a tick (daemon_scale: 60 s / 15 s)")
    ap.add_argument("--processes", default="1,2,3,4", help="daemon processes the runs are split over")
    ap.add_argument("--target-ms", type=float, default=300.0, help="the tick p50 to compare with")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    doc: dict[str, Any] = {**provenance("what a tick cannot go below: the read path and the rules alone",
                                        "tick_floor.py", argv),
                           "pinned": pin_one_core(), "runs": args.runs, "steps_per_tick": args.steps,
                           "target_ms": args.target_ms, "results": []}
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    base = base_trajectory()
    for k in (int(x) for x in args.processes.split(",")):
        n = math.ceil(args.runs / k)
        read = measure(n, args.steps, repeats=15)
        judged = bench_size(rules, n, max(5, min(200, 20_000 // n)), base, profile=False, per_rule=False)
        step_ms = judged["eval_cpu_ms_median"] + judged["append_ms_median"]
        row = {"processes": k, "runs_a_process": n, "read_cpu_ms": read["read_cpu_ms_p50"],
               "rules_ms_a_step": round(step_ms, 2), "rules_ms": round(args.steps * step_ms, 1),
               "mapped_twice_ms": read["to_short_ms_p50"]}
        row["floor_ms"] = round(row["read_cpu_ms"] + row["rules_ms"] - row["mapped_twice_ms"], 1)
        row["left_for_the_rest_ms"] = round(args.target_ms - row["floor_ms"], 1)
        doc["results"].append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tick_floor.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_md(doc, args.out / "tick_floor.md")
    return 0


def write_md(d: dict[str, Any], path: Path) -> None:
    lines = [
        "# What a tick cannot go below",
        "",
        f"{d['runs']:,} runs split over each number of processes, {d['steps_per_tick']} new steps a run a tick; one "
        f"core ({d['pinned']}), Python {d['python']}, {d['date']}, load average at start {d['loadavg']}. "
        f"Command: `{d['command']}`.",
        "",
        "The read path (`bench_read.py`'s loop: every run polled, its records mapped) once, plus the rules "
        "(`bench_rules.py`'s cycle: every run's append, then the screened pack) once a step, less the records' "
        "mapping onto short names, which both benches time and the daemon does once: medians of CPU ms (the "
        "append's and the mapping's wall ms: their benches time them so). "
        "A floor: the store's transactions, the fsynced control.json writes, the events and the lockstep come "
        f"on top (`daemon_scale.md`). The last column is what a tick p50 of {d['target_ms']:g} ms leaves them.",
        "",
        "| processes | runs a process | read ms | rules ms a step | rules ms a tick | mapped twice, ms | floor ms "
        f"| left of {d['target_ms']:g} ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["results"]:
        lines.append(f"| {r['processes']} | {r['runs_a_process']:,} | {r['read_cpu_ms']} | {r['rules_ms_a_step']} "
                     f"| {r['rules_ms']} | {r['mapped_twice_ms']} | {r['floor_ms']} | {r['left_for_the_rest_ms']} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
