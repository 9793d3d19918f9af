"""The top entries of a py-spy sampling profile, below one frame (a daemon's tick): inclusive and own share.

cProfile times every Python call, so it inflates code made of many small calls against code that spends
its time in C (numpy, msgspec, SQLite); a sampling profiler does not. py-spy attributes time in C to the
Python frame that called it (``--native`` not used), so "own" below includes the C functions a frame calls.

    pip install py-spy
    py-spy record -r 250 -f raw -o /tmp/tick.txt -- python bench/daemon_scale.py --runs 1000 --hours 0.25 \\
        --traced-ticks 0 --out /tmp/ds
    python bench/pyspy_top.py /tmp/tick.txt --below "Watchdog.tick (" > bench/results/daemon_tick_pyspy.txt

``--below``: the frame whose samples count (the start of its text in py-spy's raw format); ``--top``: rows.
A last table puts every sample in one part of a tick (:data:`PARTS`): the part of its deepest frame that
belongs to one, so that the store's time under the act phase counts as the store's.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

_LINE = re.compile(r":\d+\)$")

#: The parts of a daemon's tick, each by the starts of its functions' names (py-spy's ``name (file)``).
PARTS: dict[str, tuple[str, ...]] = {
    "read: the new lines polled and mapped": ("RunTailer.poll ", "to_short ", "RunController._values "),
    "rules: windows appended": ("Window.append ", "Window.add_event"),
    "rules: the screen": ("EngineRules.screen ",),
    "rules: the engine": ("evaluate ",),
    "store: SQLite": ("Store.", "_Transaction.", "_WriterGate."),
    "files: control.json, run.json and events, read or written": (
        "atomic_write_bytes ", "read_control ", "write_control ", "RunInfo.read ", "append_event ", "append_jsonl "),
    "JSON encoded or decoded": ("dumps ", "loads ", "JSONEncoder.", "JSONDecoder."),
}
REST = "the rest: the controller's and the daemon's own code"


def _samples(path: Path, below: str) -> Iterator[tuple[list[str], int]]:
    """Each stack of ``path`` at and below the frame ``below`` (line numbers dropped), with its count."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(below)), None)
        if at is not None and count.isdigit():
            yield [_LINE.sub(")", f) for f in frames[at:]], int(count)


def top(path: Path, below: str) -> tuple[int, Counter[str], Counter[str]]:
    """(samples under ``below``, inclusive samples per function, own samples per function)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for names, n in _samples(path, below):
        total += n
        for name in set(names):  # a recursive function counts once per sample
            inclusive[name] += n
        own[names[-1]] += n
    return total, inclusive, own


def by_part(path: Path, below: str) -> Counter[str]:
    """Samples under ``below`` per part of :data:`PARTS` (its deepest frame's), the others under :data:`REST`."""
    parts: Counter[str] = Counter()
    for names, n in _samples(path, below):
        parts[next((part for name in reversed(names) for part, starts in PARTS.items()
                    if name.startswith(starts)), REST)] += n
    return parts


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
    print("\n## by part (each sample in the part of its deepest frame that has one)\n")
    for part, n in by_part(args.raw, args.below).most_common():
        print(f"{100 * n / total:5.1f}%  {part}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
