"""A picture of the daemon's busy tick, before issue 22 and now, against its target.

Reads committed results (bench/results/daemon_scale*.json): the daemon at 1,000 runs with 4 new steps a run a tick
over the bench's whole hour (the simulated runs turn unhealthy as their logs play backwards). Before: one process
at the issue's start, 2026-12-01 (``daemon_scale_before_i22.json``, the figures the issue cites; its p99 is its
slowest of 60 ticks, and its last three ran under tracemalloc, as the bench then ran every time, which the bars of
one process now leave out). Now: one to four processes (``shards: N``) on one state database, run one after the
other on 2026-12-04 (``python bench/daemon_scale.py --runs 1000 --hours 1 --traced-ticks 0 [--shards N]``, 11,067
decisions each); the target's 300 ms p50 and 1 s p99 drawn across, on a log scale.

Usage: ``python bench/plot_daemon_ticks.py [--out bench/results/daemon_ticks.png]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

#: (label, result file, kind): the bars, left to right.
BARS = [
    ("1 process\nbefore issue 22", "daemon_scale_before_i22.json", "tick"),
    ("1 process\nnow", "daemon_scale_fourteenth_one_process.json", "untraced"),
    ("2 shards\nnow", "daemon_scale_fourteenth_2shards.json", "tick"),
    ("3 shards\nnow", "daemon_scale.json", "tick"),
    ("4 shards\nnow", "daemon_scale_fourteenth_4shards.json", "tick"),
]


def tick_ms(path: Path, kind: str) -> tuple[float, float]:
    """A result's tick wall time, p50 and p99 (ms)."""
    d = json.loads(path.read_text())
    if kind == "untraced":  # (one process: its last ticks may run under tracemalloc, left out)
        p50, p99, _ = d["untraced_tick_ms_p50_p99_max"]
        return p50, p99
    return d["tick_ms_p50"], d["tick_ms_p99"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "daemon_ticks.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [tick_ms(RESULTS / name, kind) for _, name, kind in BARS]
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    xs = range(len(BARS))
    ax.bar([x - 0.2 for x in xs], [v[0] for v in values], 0.4, label="tick p50", color="#4c72b0")
    ax.bar([x + 0.2 for x in xs], [v[1] for v in values], 0.4, label="tick p99", color="#dd8452")
    ax.axhline(300, color="#4c72b0", ls="--", lw=1, label="target p50 (300 ms)")
    ax.axhline(1000, color="#dd8452", ls="--", lw=1, label="target p99 (1 s)")
    ax.set_xticks(list(xs), [label for label, _, _ in BARS])
    ax.set_yscale("log")
    ax.set_ylabel("tick wall time (ms, log scale)")
    ax.set_title("Daemon tick, 1,000 runs, 4 new steps a run a tick, the whole hour (2 cores)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
