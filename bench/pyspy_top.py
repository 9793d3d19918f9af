"""The top entries of a py-spy sampling profile, below one frame (a daemon's tick): inclusive and own share.

cProfile times every Python call, so it inflates code made of many small calls against code that spends
its time in C (numpy, msgspec, SQLite); a sampling profiler does not. py-spy attributes time in C to the
Python frame that called it (``--native`` not used), so "own" below includes the C functions a frame calls.

    pip install py-spy
    py-spy record -r 250 -f raw -o /tmp/tick.txt -- python bench/daemon_scale.py --runs 1000 --hours 0.25 \\
        --traced-ticks 0 --out /tmp/ds
    python bench/pyspy_top.py /tmp/tick.txt --below "Watchdog.tick (" > bench/results/daemon_tick_pyspy.txt

``--below``: the frame whose samples count (the start of its text in py-spy's raw format); ``--top``: rows.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def top(path: Path, below: str) -> tuple[int, Counter[str], Counter[str]]:
    """(samples under ``below``, inclusive samples per function, own samples per function)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(below)), None)
        if at is None or not count.isdigit():
            continue
        n = int(count)
        total += n
        names = [_LINE.sub(")", f) for f in frames[at:]]
        for name in set(names):  # a recursive function counts once per sample
            inclusive[name] += n
        own[names[-1]] += n
    return total, inclusive, own


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, help="py-spy record -f raw output")
    ap.add_argument("--below", default="Watchdog.tick (")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    total, inclusive, own = top(args.raw, args.below)
    if not total:
        print(f"{args.raw}: no sample below a frame starting {args.below!r}")
        return 1
    print(f"# {total} samples below {args.below!r} in {args.raw.name}")
    for title, counts in (("inclusive", inclusive), ("own (with the C it calls)", own)):
        print(f"\n## {title}\n")
        for name, n in counts.most_common(args.top):
            print(f"{100 * n / total:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
