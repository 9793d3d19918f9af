"""Benchmark: the instructions a daemon's ticks execute, counted by callgrind (a figure machine noise cannot move).

On this shared 2-core machine the same code's tick moves by 15% and more between runs minutes apart
(``bench/results/daemon_scale.md``), so a change worth a few percent cannot be told from noise in
milliseconds. Valgrind's callgrind counts the instructions a process executes: the count does not depend on
what else the machine runs.

This runs ``daemon_scale.py`` (one process, ``--runs`` runs over ``--hours`` of simulated training) twice under
``valgrind --tool=callgrind``, both at once (a core each):

- as it is;
- with ``Watchdog.tick`` made a no-op: what the bench does besides the ticks (the interpreter, the imports, the
  daemon's start-up, the simulated trainers' writes).

The difference is what the ticks execute, and a little that follows from them: the trainers applying the
control.json versions the ticks write, the bench measuring the windows the ticks filled (at each quarter) and
counting the decisions at the end. ``PYTHONHASHSEED=0`` in both. The number of decisions is reported with the
count: two codes compared must have made as many.

Callgrind counts the process's own instructions, not the kernel's: the time the ticks spend in system calls
(control.json's fsync, opening and stat'ing files, SQLite's locks) is not in the count; ``daemon_scale.py``'s
milliseconds have it.

Under callgrind a tick of many runs takes longer than the simulated interval, which ``daemon_scale.py`` reports
as late ticks (exit status 1): counted all the same.

Callgrind runs a process many times slower than it runs alone: 50 runs over the hour took 5 minutes here.
To compare two codes, run this in a worktree of each (``git worktree add``) and compare the instructions a
run-step.

Usage: ``python bench/tick_instructions.py [--runs 50] [--hours 1] [--out DIR]``. Writes DIR/tick_instructions.json
and .md (default DIR bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rules import RESULTS, provenance  # noqa: E402

BENCH = Path(__file__).resolve().parent

#: What each callgrind process runs: daemon_scale.py, its ticks kept or made no-ops (argv: kind, runs, hours, out, script).
RUNNER = """
import runpy, sys
kind, runs, hours, out, script = sys.argv[1:6]
if kind == "without_ticks":
    from ppo_watchdog.control import daemon
    daemon.Watchdog.tick = lambda self, now=None: False
sys.argv = [script, "--runs", runs, "--hours", hours, "--traced-ticks", "0", "--out", out]
runpy.run_path(script, run_name="__main__")
"""


def _stop(p: subprocess.Popen[bytes]) -> None:
    """End a child still running: SIGINT first (a KeyboardInterrupt, so that daemon_scale.py removes its run
    directories on the way out), then SIGKILL."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def instructions(callgrind_out: Path) -> int:
    """The instructions a callgrind output file counts (its ``totals:`` line, or ``summary:``)."""
    for line in callgrind_out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError(f"{callgrind_out}: no totals: line")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50, help="runs the daemon watches")
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours (daemon_scale.py's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("tick_instructions: valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    print(f"tick_instructions: daemon_scale.py at {args.runs} runs over {args.hours:g} h, twice under callgrind at once "
          f"(it runs them many times slower: minutes)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tick_instructions_") as tmp, ExitStack() as stack:
        procs = {}
        for kind in ("with_ticks", "without_ticks"):
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/{kind}.callgrind",
                   sys.executable, "-c", RUNNER, kind, str(args.runs), str(args.hours), f"{tmp}/{kind}",
                   str(BENCH / "daemon_scale.py")]
            log = stack.enter_context(open(f"{tmp}/{kind}.log", "w"))
            procs[kind] = stack.enter_context(subprocess.Popen(cmd, cwd=BENCH.parent, env=env,
                                                               stdout=subprocess.DEVNULL, stderr=log))
            stack.callback(_stop, procs[kind])  # (an interrupted bench leaves no callgrind running)
        for kind, p in procs.items():
            # 1: late ticks (see above), the results written all the same.
            if p.wait() not in (0, 1) or not Path(f"{tmp}/{kind}/daemon_scale.json").exists():
                tail = Path(f"{tmp}/{kind}.log").read_text().splitlines()[-15:]
                print(f"tick_instructions: the run {kind} failed (exit {p.returncode}):", *tail, sep="\n",
                      file=sys.stderr)
                return 1
        counts = {kind: instructions(Path(f"{tmp}/{kind}.callgrind")) for kind in procs}
        scale = json.loads(Path(f"{tmp}/with_ticks/daemon_scale.json").read_text())
    ticks = counts["with_ticks"] - counts["without_ticks"]
    run_steps = scale["runs"] * scale["steps_per_run"]
    doc: dict[str, Any] = {**provenance("instructions a daemon's ticks execute (callgrind)", "tick_instructions.py",
                                        argv),
                           "runs": args.runs, "simulated_hours": args.hours}
    doc.update(instructions=counts, tick_instructions=ticks, ticks=scale["ticks"],
               steps_per_run=scale["steps_per_run"], decisions=scale["decisions"],
               tick_instructions_per_tick=round(ticks / scale["ticks"]),
               tick_instructions_per_run_step=round(ticks / run_steps))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tick_instructions.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "tick_instructions.md").write_text(markdown(doc))
    print(f"{ticks:,} instructions in {scale['ticks']} ticks: {doc['tick_instructions_per_run_step']:,} a run-step "
          f"({scale['decisions']:,} decisions); wrote {args.out / 'tick_instructions.json'} and .md")
    return 0


def markdown(doc: dict[str, Any]) -> str:
    c = doc["instructions"]
    return "\n".join([
        "# Instructions a daemon's ticks execute",
        "",
        f"`{doc['command']}`: `daemon_scale.py` at {doc['runs']} runs over {doc['simulated_hours']:g} simulated "
        f"hour(s), one process, under `valgrind --tool=callgrind`, with its ticks and with `Watchdog.tick` made a "
        f"no-op; `PYTHONHASHSEED=0` (Python {doc['python']}, {doc['date']}).",
        "",
        "| run | instructions |",
        "|---|---:|",
        f"| with the ticks | {c['with_ticks']:,} |",
        f"| without them | {c['without_ticks']:,} |",
        f"| **the ticks** | **{doc['tick_instructions']:,}** |",
        "",
        f"{doc['ticks']} ticks, {doc['steps_per_run']} steps a run, {doc['decisions']:,} decisions: "
        f"**{doc['tick_instructions_per_run_step']:,} instructions a run-step**, "
        f"{doc['tick_instructions_per_tick']:,} a tick.",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
