"""Benchmark: what a daemon tick costs when its runs have nothing new (issue 22: close to nothing).

``--runs`` run directories, each with a ``started`` event and 20 steps already written; one daemon
(:func:`ppo_watchdog.control.daemon.prepare_daemon`, files source, default pack) reads them in a first
tick, then ``--ticks`` ticks run with nothing new in any run. Reported: the process's CPU time a tick
(what other work on shared cores does not inflate) and wall time, p50 and max, and CPU per run.

Usage: ``python bench/daemon_idle.py [--runs 1000] [--ticks 10] [--out DIR]``; writes
``daemon_idle.json`` and ``.md`` under DIR (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_rules import provenance  # noqa: E402
from daemon_scale import served_daemon  # noqa: E402

from ppo_watchdog.control.daemon import DaemonConfig, RunSpec  # noqa: E402
from ppo_watchdog.protocol import rundir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--ticks", type=int, default=10, help="idle ticks measured")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="daemon_idle_"))
    try:
        dirs = []
        for r in range(args.runs):
            d = tmp / f"run{r:05d}"
            d.mkdir()
            (d / rundir.RUN_JSON).write_text(json.dumps({"id": d.name, "pid": None}))
            rundir.append_event(d, "started", 0)
            with open(d / rundir.METRICS, "w") as f:
                for s in range(1, 21):
                    f.write(json.dumps({"step": s, "data": {"actor/reward_kl_penalty": 0.01, "critic/score/mean": 0.5,
                                                            "actor/entropy": 1.0}}) + "\n")
            dirs.append(d)
        wd = served_daemon(DaemonConfig(runs=[RunSpec(str(d)) for d in dirs], state_dir=str(tmp / "state"),
                                        tick_s=60))
        now = 1_700_000_000.0
        wd.tick(now)  # reads the 20 steps of every run
        cpu: list[float] = []
        wall: list[float] = []
        for _ in range(args.ticks):
            now += 60
            a, c = time.perf_counter(), time.process_time()
            wd.tick(now)
            wall.append(time.perf_counter() - a)
            cpu.append(time.process_time() - c)
        wd.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc: dict[str, Any] = {
        **provenance("daemon ticks with nothing new in any run", "daemon_idle.py", argv),
        "runs": args.runs, "idle_ticks": args.ticks,
        "cpu_ms_p50": round(statistics.median(cpu) * 1e3, 1), "cpu_ms_max": round(max(cpu) * 1e3, 1),
        "wall_ms_p50": round(statistics.median(wall) * 1e3, 1), "wall_ms_max": round(max(wall) * 1e3, 1),
        "cpu_us_per_run": round(statistics.median(cpu) * 1e6 / args.runs, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "daemon_idle.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "daemon_idle.md").write_text("\n".join([
        "# Daemon ticks with nothing new", "",
        f"{doc['runs']:,} runs, each with 20 steps already read; {doc['idle_ticks']} ticks with nothing new. "
        f"Python {doc['python']}, {doc['cpus']} cores shared (load average {doc['loadavg']}), {doc['date']}. "
        f"Command: `{doc['command']}`.", "",
        "| CPU ms a tick p50 | CPU max | CPU us a run | wall ms p50 | wall max |",
        "|---:|---:|---:|---:|---:|",
        f"| {doc['cpu_ms_p50']} | {doc['cpu_ms_max']} | {doc['cpu_us_per_run']} | {doc['wall_ms_p50']} | "
        f"{doc['wall_ms_max']} |", ""]))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
