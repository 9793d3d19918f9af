"""What ending a journal entry costs as a daemon's journal grows: ``Store.settle_decision`` by journal size.

Each time a journal entry ends (done, failed, dropped), the store settles its decision from the decision's
entries. The journal keeps every entry a daemon ever wrote, so a read that scans it costs more every hour;
the index ``journal_decision`` (``ppo_watchdog.control.store._INDEXES``) makes it a lookup. This builds a real
state database with N decisions of one finished entry each (as a daemon's decision storm leaves them:
``daemon_scale.py --hours 1`` ends with 11,067 decisions), then times settling the last ``--settle`` of them,
with the index and with it dropped (what a state had before it).

Usage: ``python bench/store_settle.py [--sizes 1000 10000 100000] [--settle 500] [--out DIR]``. Writes
DIR/store_settle.json and .md (default bench/results).
"""

from __future__ import annotations

import argparse
import json
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

from ppo_watchdog.control.store import RunRecord, Store  # noqa: E402


def settle_ms(store: Store, ids: list[int]) -> float:
    """Median milliseconds of one ``settle_decision`` over ``ids``."""
    times = []
    for i in ids:
        a = time.perf_counter()
        store.settle_decision(i)
        times.append(time.perf_counter() - a)
    return statistics.median(times) * 1e3


def measure(size: int, settle: int, tmp: Path) -> dict[str, Any]:
    store = Store(tmp / f"state{size}")
    store.upsert_run(RunRecord("run", str(tmp / "run")))
    ids = []
    with store.transaction():
        for k in range(size):
            d = store.add_decision("run", k, "reward_stall", "fire", [{"kind": "set"}], {"reward": 0.5})
            store.add_action("run", "live_set", {"set": {"lr": 1e-6}}, decision_id=d, status="done")
            ids.append(d)
    last = ids[-settle:]
    settle_ms(store, ids[:50])  # (warm: the connection's first statements and the file's pages)
    indexed = settle_ms(store, last)
    with store.transaction() as db:
        db.execute("DROP INDEX journal_decision")
    scanned = settle_ms(store, last)
    store.close()
    return {"journal_entries": size, "settle_ms_p50_indexed": round(indexed, 4),
            "settle_ms_p50_without_index": round(scanned, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--settle", type=int, default=500, help="decisions settled at each size (the newest)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="store_settle_"))
    try:
        rows = [measure(n, min(args.settle, n), tmp) for n in args.sizes]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {**provenance("Store.settle_decision by journal size, with and without the journal_decision index",
                        "store_settle.py", argv), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_settle.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "store_settle.md").write_text(
        "# Settling a decision as the journal grows\n\n"
        f"`Store.settle_decision` on a real state database of N decisions with one finished journal entry each, "
        f"the median of settling the newest {args.settle}, with the `journal_decision` index and without it. "
        f"Python {doc['python']}, {doc['cpus']} cores (load average {doc['loadavg']}), {doc['date']}. "
        f"Command: `{doc['command']}`.\n\n"
        "| journal entries | ms a settle, indexed | ms a settle, without the index |\n|---:|---:|---:|\n"
        + "".join(f"| {r['journal_entries']:,} | {r['settle_ms_p50_indexed']} | {r['settle_ms_p50_without_index']} |\n"
                  for r in rows))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
