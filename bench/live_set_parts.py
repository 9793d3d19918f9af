"""What carrying out one live set costs, part by part: the file write (and its fsync) against the store's writes.

A live set (``Actuator._drive_live_set``) reserves its control.json version in a transaction of its own, writes
the file (``rundir.atomic_write_bytes``: a temporary file in the run directory, written, fsynced, renamed over
control.json), records the version and marks the entry sent. At the bench's whole hour
(``daemon_scale.py --hours 1``) a shard carries out dozens a tick, so which part bounds it decides what is worth
changing: fewer store transactions a tick, or the file write. This times each part on this machine's disk and a
real SQLite state (WAL, ``synchronous=NORMAL``, as the daemon opens it), wall and CPU:

- ``atomic_write_bytes`` of a control.json-sized document into one of ``--dirs`` run directories, and the same
  with ``os.fsync`` made a no-op (what the fsync alone costs);
- ``Store.update_action`` as its own transaction (what each of the live set's store writes is today) and inside
  one transaction of ten (what batching them would make it).

Usage: ``python bench/live_set_parts.py [--n 2000] [--dirs 50] [--rounds 3] [--out DIR]``. Writes
DIR/live_set_parts.json and .md (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_rules import provenance, timed  # noqa: E402

from ppo_watchdog.control.store import RunRecord, Store  # noqa: E402
from ppo_watchdog.protocol import rundir  # noqa: E402
from ppo_watchdog.protocol.control import Control  # noqa: E402

DOC = Control(7, {"actor_rollout_ref.actor.optim.lr": 9.0e-7, "actor_rollout_ref.actor.ppo_epochs": 2}, ()).to_json()


def per_call_ms(fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds a call of ``fn(i)`` for i < n."""
    def calls() -> None:
        for i in range(n):
            fn(i)

    wall, cpu = timed(calls)
    return wall / n * 1e3, cpu / n * 1e3


def measure(tmp: Path, n: int, dirs: int) -> dict[str, tuple[float, float]]:
    paths = []
    for d in range(dirs):
        (tmp / f"run{d:03d}").mkdir()
        paths.append(tmp / f"run{d:03d}" / rundir.CONTROL)
    data = json.dumps(DOC, sort_keys=True).encode()
    store = Store(tmp / "watchdog.db")
    store.upsert_run(RunRecord(run_id="r", run_dir=str(tmp / "run000")))
    entry = store.add_action("r", "live_set", {"set": {"actor_rollout_ref.actor.optim.lr": 9.0e-7}})

    def batched(i: int) -> None:
        if i % 10 == 0:
            with store.transaction():
                for j in range(10):
                    store.update_action(entry, status="sent", deadline=float(i + j))

    def write(i: int) -> None:
        rundir.atomic_write_bytes(paths[i % dirs], data)

    out = {"file write, fsynced (atomic_write_bytes)": per_call_ms(write, n)}
    with mock.patch.object(os, "fsync", lambda fd: None):  # the same function, its fsync a no-op
        out["file write, no fsync"] = per_call_ms(write, n)
    out["store write, a transaction each"] = per_call_ms(
        lambda i: store.update_action(entry, status="sent", deadline=float(i)), n)
    out["store write, ten to a transaction"] = per_call_ms(batched, n)  # (divided by n: a write's share)
    store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="calls of each part a round")
    ap.add_argument("--dirs", type=int, default=50, help="run directories the files are written into")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.n < 10 or args.dirs < 1 or args.rounds < 1:
        ap.error("--n must be at least 10, --dirs and --rounds at least 1")
    rounds: list[dict[str, tuple[float, float]]] = []
    for _ in range(args.rounds):
        tmp = Path(tempfile.mkdtemp(prefix="live_set_parts_"))
        try:
            rounds.append(measure(tmp, args.n, args.dirs))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    parts: dict[str, Any] = {}
    for name in rounds[0]:
        walls = [r[name][0] for r in rounds]
        cpus = [r[name][1] for r in rounds]
        parts[name] = {"wall_ms_median": round(statistics.median(walls), 4), "wall_ms_rounds": [round(w, 4) for w in walls],
                       "cpu_ms_median": round(statistics.median(cpus), 4)}
    doc = {
        **provenance("what one live set's file write and store writes cost", "live_set_parts.py", argv),
        "n": args.n, "dirs": args.dirs, "rounds": args.rounds, "parts": parts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "live_set_parts.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# What one live set's parts cost",
        "",
        f"`{doc['command']}`: {args.n} calls of each part a round, {args.rounds} rounds, files spread over {args.dirs} "
        f"run directories in a temporary directory on this machine's disk (Python {doc['python']}, {doc['cpus']} cores, "
        f"load average {doc['loadavg']}, {doc['date']}).",
        "",
        "| part | wall ms a call, median of rounds | each round | CPU ms a call |",
        "|---|---:|---|---:|",
    ]
    for name, p in parts.items():
        lines.append(f"| {name} | {p['wall_ms_median']:.3f} | {', '.join(f'{w:.3f}' for w in p['wall_ms_rounds'])} "
                     f"| {p['cpu_ms_median']:.3f} |")
    (args.out / "live_set_parts.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
