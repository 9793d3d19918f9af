"""Benchmark: the daemon's read path alone - 1,000 run directories tailed, a few new lines each a tick.

Each run directory is written by bench/daemon_scale.py's simulated trainer (``metrics.jsonl`` lines of
~100 verl keys from the real verl log of ../shared/testdata, ``events.jsonl`` with ``started`` and a
``checkpoint`` now and then). A :class:`~ppo_watchdog.sources.ingest.RunTailer` per run is polled as the
daemon's controller polls it, and each record is mapped onto short names with
:func:`~ppo_watchdog.protocol.catalog.to_short` (into the run's own ``sources`` dict, as the window does):
what a tick spends reading, before the rules run. Per repeat: every trainer appends ``--lines`` steps
(not timed), then run by run, as the controller does, the run is polled and the records it returned
are mapped; the loop over all runs is timed (wall and process CPU time) and so is each call (poll and
to_short apart). One more pass with nothing new measures an idle run's cost. Figures are medians over
``--repeats`` (minimum and maximum too: the machine is shared); the files sit in the page cache (a
daemon reads what was just written).

Usage: ``python bench/bench_read.py [--runs 1000] [--lines 4] [--repeats 15] [--label NAME]
[--out DIR]``. Writes DIR/bench_read[_LABEL].json and .md (default DIR bench/results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_rules import base_trajectory  # noqa: E402
from daemon_scale import Trainer  # noqa: E402

from ppo_watchdog.protocol import catalog  # noqa: E402
from ppo_watchdog.sources.ingest import RunTailer  # noqa: E402


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def measure(runs: int, lines: int, repeats: int) -> dict[str, Any]:
    """The read path over ``runs`` fresh run directories, ``lines`` new lines a run a repeat: the figures of
    bench_read.json after its provenance (medians over ``repeats``)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_read_"))
    try:
        base = base_trajectory()
        trainers = [Trainer(tmp / f"run{r:04d}", r, base, ckpt_every=50) for r in range(runs)]
        tailers = [RunTailer(t.dir) for t in trainers]
        sources: list[dict[str, str]] = [{} for _ in trainers]
        now = 1_700_000_000.0
        for t in trainers:  # a first stretch of steps, read once: the tailers are past the start
            t.advance(lines, now)
        for tl in tailers:
            tl.poll()
        load_before = [round(x, 2) for x in os.getloadavg()]
        poll_wall: list[float] = []
        short_wall: list[float] = []
        total_wall: list[float] = []
        total_cpu: list[float] = []
        records = 0
        for _ in range(repeats):
            now += 60.0
            for t in trainers:
                t.advance(lines, now)
            gc.collect()
            # Run by run, as the daemon's controller does: poll, then map the records just read.
            p_wall = s_wall = 0.0
            records = 0
            pc = time.perf_counter
            a, c = pc(), time.process_time()
            for tl, src in zip(tailers, sources, strict=True):
                t0 = pc()
                recs = tl.poll()[0]
                t1 = pc()
                for rec in recs:
                    catalog.to_short(rec["data"], src)
                s_wall += pc() - t1
                p_wall += t1 - t0
                records += len(recs)
            total_wall.append(pc() - a)
            total_cpu.append(time.process_time() - c)
            poll_wall.append(p_wall)
            short_wall.append(s_wall)
        idle_wall = []
        for _ in range(repeats):
            a = time.perf_counter()
            for tl in tailers:
                tl.poll()
            idle_wall.append(time.perf_counter() - a)
        load_after = [round(x, 2) for x in os.getloadavg()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 2)

    return {
        "loadavg_before_after": [load_before, load_after],
        "runs": runs,
        "lines_per_run": lines,
        "keys_per_line": len(trainers[0].keys) + len(trainers[0].pad),
        "records_per_repeat": records,
        "repeats": repeats,
        "poll_ms_p50": ms(poll_wall),
        "to_short_ms_p50": ms(short_wall),
        "read_ms_p50": ms(total_wall),
        "read_cpu_ms_p50": ms(total_cpu),
        "read_ms_min_max": [round(min(total_wall) * 1e3, 2), round(max(total_wall) * 1e3, 2)],
        "us_per_record_p50": round(statistics.median(total_wall) * 1e6 / max(1, records), 2),
        "idle_poll_ms_p50": ms(idle_wall),
        "idle_us_per_run_p50": round(statistics.median(idle_wall) * 1e6 / runs, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--lines", type=int, default=4, help="new metric lines a run between two polls")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--label", default="", help="suffix of the result files (e.g. before)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    measured = measure(args.runs, args.lines, args.repeats)
    doc: dict[str, Any] = {
        "benchmark": "read path: RunTailer.poll + catalog.to_short over many run directories",
        "command": " ".join(["python bench/bench_read.py", *(argv if argv is not None else sys.argv[1:])]),
        "git": _git_rev(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        **measured,
    }
    suffix = f"_{args.label}" if args.label else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bench_read{suffix}.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_md(doc, args.out / f"bench_read{suffix}.md")
    print(json.dumps(doc))
    return 0


def write_md(d: dict[str, Any], path: Path) -> None:
    """The figures of one run as a short markdown page."""
    lines = [
        "# Read path (RunTailer.poll + catalog.to_short)",
        "",
        f"`{d['command']}` at commit `{d['git']}`, {d['date']}, Python {d['python']}, {d['cpus']} CPUs, "
        f"load average before / after {d['loadavg_before_after'][0]} / {d['loadavg_before_after'][1]} "
        "(a machine shared with other sessions: the CPU-time columns are what their load does not inflate).",
        "",
        f"{d['runs']:,} run directories, {d['lines_per_run']} new `metrics.jsonl` lines of {d['keys_per_line']} keys "
        f"each per run ({d['records_per_repeat']:,} records) between two polls; medians of {d['repeats']} repeats.",
        "",
        "| phase | wall ms (p50) | CPU ms (p50) |",
        "|---|---:|---:|",
        f"| RunTailer.poll, all runs | {d['poll_ms_p50']} | |",
        f"| catalog.to_short, every record | {d['to_short_ms_p50']} | |",
        f"| **read path** (the loop over the runs, timers included) | **{d['read_ms_p50']}** | **{d['read_cpu_ms_p50']}** |",
        "",
        f"Read path min / max over the repeats: {d['read_ms_min_max'][0]} / {d['read_ms_min_max'][1]} ms; "
        f"{d['us_per_record_p50']} µs a record. A poll of all runs with nothing new: {d['idle_poll_ms_p50']} ms "
        f"({d['idle_us_per_run_p50']} µs a run).",
        "",
    ]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
