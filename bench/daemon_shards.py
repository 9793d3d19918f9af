"""What sharding a daemon's runs over processes gives: the same load as daemon_scale.py, ticked by N.

A measurement for a design question (issue 22: "how far it scales and what bounds it"), the question
behind the daemon's ``shards: N``. N worker processes each build the daemon over the share of the run
directories the product's partition gives them (``DaemonConfig.for_shard``, as ``watchdog daemon`` with
``shards: N`` does; ``prepare_daemon`` not exclusive, all on one state database by default, or one each
with ``--state-per-shard``) and tick on the parent's word (not on their own schedulers); the parent plays the
trainers once an interval (daemon_scale.py's simulated trainers, the same lines and control.json replies).

A run is judged by its shard's tick, so "a tick" here is one shard's tick over its runs, timed by the shard
around ``Watchdog.tick`` (as daemon_scale.py times one process's), and the percentiles are over every
shard's ticks, whichever way they are worded. By default the shards tick in turns, as the daemon's do
(``shards.tick_phase``: shard K at K/N of each interval): shard 0's word, its answer, then shard 1's, and so
on. ``--together`` words every shard at once instead, as if their turns were the same instant: the shards
side by side on the machine's cores, SQLite's one writer at a time included; it also reports the time from
the word to the last answer (every run of the interval judged).

Usage: ``python bench/daemon_shards.py [--runs 1000] [--hours 0.25] [--shards 2] [--together]
[--state-per-shard] [--out DIR]``. Writes DIR/daemon_shards.json and .md (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_rules import base_trajectory  # noqa: E402
from daemon_scale import Trainer, pct, served_daemon  # noqa: E402

from watchdog.control.daemon import DaemonConfig, RunSpec  # noqa: E402


def shard(conn: Connection, run_dirs: list[str], state_dir: str, tick_s: float) -> None:
    """One shard: the daemon over its runs, a tick per word from the parent; answers (wall s, CPU s)."""
    wd = served_daemon(DaemonConfig(runs=[RunSpec(d) for d in run_dirs], state_dir=state_dir, tick_s=tick_s),
                       exclusive=False)
    conn.send("ready")
    while True:
        now = conn.recv()
        if now is None:
            break
        a, c = time.perf_counter(), time.process_time()
        wd.tick(now)
        conn.send((time.perf_counter() - a, time.process_time() - c))
    decisions = len([d for d in wd.store.decisions() if d["run_id"] in wd.controllers])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    wd.close()
    conn.send((decisions, peak))


def answer(conn: Connection, timeout_s: float = 600.0) -> Any:
    """A shard's next answer; a shard that died or hangs stops the bench, said."""
    if not conn.poll(timeout_s):
        raise SystemExit(f"a shard gave no answer in {timeout_s:g} s")
    return conn.recv()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=0.25, help="simulated hours")
    ap.add_argument("--step-s", type=float, default=15.0)
    ap.add_argument("--tick-s", type=float, default=60.0)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--state-per-shard", action="store_true", help="a state database each (no shared writer)")
    ap.add_argument("--together", action="store_true",
                    help="every shard's tick at the same instant, not in the daemon's turns")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="daemon_shards_"))
    ctx = mp.get_context("fork")
    procs: list[Any] = []
    try:
        base = base_trajectory()
        trainers = [Trainer(tmp / "runs" / f"run{r:04d}", r, base, args.ckpt_every) for r in range(args.runs)]
        conns = []
        everything = DaemonConfig(runs=[RunSpec(str(t.dir)) for t in trainers], shards=args.shards)
        for i in range(args.shards):
            dirs = [spec.run_dir for spec in everything.for_shard(i).runs]
            state = tmp / (f"state{i}" if args.state_per_shard else "state")
            parent, child = ctx.Pipe()
            p = ctx.Process(target=shard, args=(child, dirs, str(state), args.tick_s), daemon=True)
            p.start()
            child.close()  # (so that a shard that dies is an EOFError here, not a wait forever)
            procs.append(p)
            conns.append(parent)
            if not args.state_per_shard and i == 0:
                answer(parent)  # (the first creates the shared database; the others open it)
        for c in conns[0 if args.state_per_shard else 1:]:
            answer(c)
        n_ticks = int(round(args.hours * 3600 / args.tick_s))
        per_tick = args.tick_s / args.step_s
        owed, now = 0.0, 1_700_000_000.0
        all_done: list[float] = []  # --together: from the word to the last answer
        shard_wall: list[list[float]] = []
        shard_cpu: list[list[float]] = []
        for _ in range(n_ticks):
            now += args.tick_s
            owed += per_tick
            k = int(owed)
            owed -= k
            for t in trainers:
                t.advance(k, now)
            if args.together:
                a = time.perf_counter()
                for c in conns:
                    c.send(now)
                answers = [answer(c) for c in conns]
                all_done.append(time.perf_counter() - a)
            else:  # each in its turn (the interval's share between turns is not slept: nothing else runs)
                answers = []
                for i, c in enumerate(conns):
                    c.send(now + i * args.tick_s / args.shards)
                    answers.append(answer(c))
            shard_wall.append([w for w, _ in answers])
            shard_cpu.append([cpu for _, cpu in answers])
        for c in conns:
            c.send(None)
        ends = [answer(c) for c in conns]
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    cpu_sum = [sum(x) for x in shard_cpu]
    ticks = [w for each in shard_wall for w in each]
    doc: dict[str, Any] = {
        "benchmark": "the daemon's runs sharded over processes (shard_of's partition, ticked on the parent's word)",
        "command": " ".join(["python bench/daemon_shards.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "runs": args.runs, "shards": args.shards, "shared_state": not args.state_per_shard,
        "ticks_in_turns": not args.together,
        "ticks": n_ticks, "steps_per_run": trainers[0].step,
        "tick_ms_p50": round(statistics.median(ticks) * 1e3, 1),
        "tick_ms_p99": round(pct(ticks, 0.99) * 1e3, 1),
        "shard_wall_ms_p50": [round(statistics.median([w[i] for w in shard_wall]) * 1e3, 1)
                              for i in range(args.shards)],
        "all_shards_done_ms_p50_p99": ([round(statistics.median(all_done) * 1e3, 1), round(pct(all_done, 0.99) * 1e3, 1)]
                                       if all_done else None),
        "cpu_ms_all_shards_p50": round(statistics.median(cpu_sum) * 1e3, 1),
        "decisions": sum(d for d, _ in ends),
        "peak_rss_mib_per_shard": [round(peak, 1) for _, peak in ends],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "daemon_shards.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "daemon_shards.md").write_text(
        "# The daemon's runs sharded over processes\n\n"
        f"{doc['runs']:,} runs over {doc['shards']} processes "
        f"({'one shared state database' if doc['shared_state'] else 'a state database each'}), "
        f"{doc['ticks']} ticks, "
        + ("each shard in its turn of the interval, as the daemon's" if doc["ticks_in_turns"] else
           "every shard's at the same instant (`--together`; every shard done, from the word to the last answer: "
           f"p50 {doc['all_shards_done_ms_p50_p99'][0]} ms, p99 {doc['all_shards_done_ms_p50_p99'][1]} ms)")
        + f", {doc['cpus']} cores, load average {doc['loadavg']}, {doc['date']}. Command: `{doc['command']}`. "
        "A tick: one shard's over its runs (what a run waits for), its percentiles over every shard's ticks.\n\n"
        "| tick p50 ms | tick p99 ms | each shard's tick p50 ms | CPU of all shards a tick, p50 ms | decisions "
        "| peak RSS MiB a shard |\n|---:|---:|---|---:|---:|---|\n"
        f"| {doc['tick_ms_p50']} | {doc['tick_ms_p99']} | {' / '.join(map(str, doc['shard_wall_ms_p50']))} "
        f"| {doc['cpu_ms_all_shards_p50']} | {doc['decisions']:,} "
        f"| {' / '.join(map(str, doc['peak_rss_mib_per_shard']))} |\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
