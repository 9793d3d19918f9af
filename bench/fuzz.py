"""The fuzz suite of tests/test_fuzz.py at length: thousands of inputs per reader.

    .venv/bin/python bench/fuzz.py               # 5,000 examples per property, ~10 min on 2 cores
    .venv/bin/python bench/fuzz.py --examples 500

Each property runs with ``--examples`` hypothesis examples; any input that makes a reader raise
something other than its own error (or an error that does not name the file and position)
fails the run with hypothesis's shrunk counterexample. Per reader: inputs tried, accepted and
refused with a clean error. Results: ``bench/results/fuzz.json`` and ``fuzz.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from bench_rules import provenance, provenance_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=5000, help="hypothesis examples per property")
    args = ap.parse_args()
    os.environ["WATCHDOG_FUZZ_EXAMPLES"] = str(args.examples)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    fuzz = importlib.import_module("test_fuzz")  # reads WATCHDOG_FUZZ_EXAMPLES at import
    properties = {name: fn for name, fn in vars(fuzz).items() if name.startswith("test_") and hasattr(fn, "hypothesis")}
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    for name, fn in properties.items():
        start = time.monotonic()
        fn()  # raises with the shrunk counterexample on any failure
        seconds[name] = round(time.monotonic() - start, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
    readers = {target: {"tried": sum(c.values()), "accepted": c["accepted"], "refused_cleanly": c["refused"],
                        "tracebacks": 0} for target, c in sorted(fuzz.COUNTS.items())}
    result = {**provenance("the fuzz suite at length", "fuzz.py", None), "command": f"python bench/fuzz.py --examples {args.examples}", "examples_per_property": args.examples,
              "properties": seconds, "readers": readers, "wall_s": round(time.monotonic() - t0, 1),
              "tried": sum(r["tried"] for r in readers.values())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fuzz.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| {t} | {r['tried']} | {r['accepted']} | {r['refused_cleanly']} | 0 |" for t, r in readers.items()]
    (RESULTS / "fuzz.md").write_text(
        f"# `{result['command']}`\n\n{provenance_line(result, with_command=False)}\n\n{result['tried']} inputs in {result['wall_s']} s, no traceback.\n\n"
        "| reader | inputs | accepted | refused with file and position | tracebacks |\n|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n")
    print(f"{result['tried']} inputs, 0 tracebacks -> {RESULTS / 'fuzz.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
