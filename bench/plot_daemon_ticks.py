"""A picture of the daemon's busy tick, before and now, against issue 22's target.

Reads committed results (bench/results/daemon_scale*.json, daemon_shards*.json): one process and 2 shards on
one state database at 1,000 runs with 4 new steps a run a tick. Before: main f4f0dd3's code (before the columnar
screen), over the first quarter hour, both measured back to back on an earlier session's machine. Now: this
code, over the first quarter hour (753 decisions) and over the bench's whole hour (11,067 decisions: the
simulated runs turn unhealthy as their logs play backwards), each pair back to back on this session's
(``python bench/daemon_scale.py --runs 1000 --hours 0.25|1 [--traced-ticks 0 | --shards 2]``); the target's
300 ms p50 and 1 s p99 drawn across.

Usage: ``python bench/plot_daemon_ticks.py [--out bench/results/daemon_ticks.png]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

#: (label, result file, kind): the bars, left to right.
BARS = [
    ("1 process\nbefore, ¼ h", "daemon_scale_before_i22g.json", "scale"),
    ("1 process\nnow, ¼ h", "daemon_scale_quarter_hour_one_process.json", "scale"),
    ("1 process\nnow, 1 h", "daemon_scale_one_process.json", "scale"),
    ("2 shards\nbefore, ¼ h", "daemon_shards_before_i22g.json", "shards"),
    ("2 shards\nnow, ¼ h", "daemon_scale_quarter_hour.json", "shards"),
    ("2 shards\nnow, 1 h", "daemon_scale.json", "shards"),
]


def tick_ms(path: Path, kind: str) -> tuple[float, float]:
    """A result's tick wall time, p50 and p99 (ms)."""
    d = json.loads(path.read_text())
    if kind == "scale":
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
    ax.set_ylabel("tick wall time (ms)")
    ax.set_title("Daemon tick, 1,000 runs, 4 new steps a run a tick (2 cores)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
