"""The parts of a daemon's tick measured alone, and the picture of the whole: ``daemon_scale.py --part NAME``.

``daemon_scale.py`` measures whole ticks. When a tick is slower than it should be, these say which part bounds
it, each on this machine's files and a real SQLite state, each with options of its own
(``python bench/daemon_scale.py --part NAME --help``), each writing ``daemon_scale_NAME.json`` and ``.md``:

- ``floor``: what one process's tick cannot go below. The read path (a ``RunTailer`` per run polled as the
  controller polls it, each record mapped onto short names) once, and the rules (``bench_rules.bench_size``:
  every run's ``Window.append_record``, then the screened default pack) once a new step, at the runs one
  process has (``--runs`` split over each of ``--processes``, as shards split them), less the records' mapping,
  which both do and the daemon does once. The store, control.json's fsynced writes, the events and the lockstep
  come on top.
- ``idle``: a tick when no run has anything new (``--runs`` runs with 20 steps already read).
- ``journal``: ``Store.settle_decision`` (each time a journal entry ends) as the journal grows, with the
  ``journal_decision`` index and without it.
- ``live-set``: one live set's parts: control.json's atomic, fsynced write (and without the fsync) against a
  store write, a transaction each or ten to one.
- ``instructions``: ``daemon_scale.py`` (one process) twice under ``valgrind --tool=callgrind``, as it is and with
  ``Watchdog.tick`` a no-op; the difference is what the ticks execute. Instructions do not move with what else
  the machine runs, so a change worth a few percent shows here when milliseconds move by 15% between two runs of
  the same code; to compare two codes, run it in a worktree of each. Kernel time (fsync, stat, SQLite's locks)
  is not counted. Minutes: callgrind runs a process many times slower.

``daemon_scale.py --plot`` draws ``daemon_ticks.png`` from the committed whole-hour results at 1 to 4 processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from bench_rules import (  # noqa: E402
    RESULTS,
    base_trajectory,
    bench_size,
    pin_one_core,
    provenance,
    provenance_line,
    timed,
)
from daemon_scale import Trainer, served_daemon  # noqa: E402

from ppo_watchdog.control.daemon import DaemonConfig, RunSpec  # noqa: E402
from ppo_watchdog.control.store import RunRecord, Store  # noqa: E402
from ppo_watchdog.core.rulefile import load_rules  # noqa: E402
from ppo_watchdog.protocol import catalog, rundir  # noqa: E402
from ppo_watchdog.protocol.control import Control  # noqa: E402
from ppo_watchdog.sources.ingest import RunTailer  # noqa: E402


def _parser(part: str, doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"daemon_scale.py --part {part}", description=doc)
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the result's .json and .md")
    return ap


def _write(out: Path, part: str, doc: dict[str, Any], md: list[str]) -> None:
    name = f"daemon_scale_{part.replace('-', '_')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / name}.json and .md")


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)


# -- floor: the read path and the rules alone --------------------------------------------------------------

def read_path(runs: int, lines: int, repeats: int) -> dict[str, Any]:
    """The read path over ``runs`` fresh run directories, ``lines`` new lines a run a repeat (medians over
    ``repeats``): run by run, as the controller does, each run polled and the records it returned mapped."""
    tmp = Path(tempfile.mkdtemp(prefix="tick_floor_"))
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
        poll_wall: list[float] = []
        short_wall: list[float] = []
        total_cpu: list[float] = []
        pc = time.perf_counter
        for _ in range(repeats):
            now += 60.0
            for t in trainers:  # (the trainers' writes are not timed)
                t.advance(lines, now)
            gc.collect()
            p_wall = s_wall = 0.0
            c = time.process_time()
            for tl, src in zip(tailers, sources, strict=True):
                t0 = pc()
                recs = tl.poll()[0]
                t1 = pc()
                for rec in recs:
                    catalog.to_short(rec["data"], src)
                s_wall += pc() - t1
                p_wall += t1 - t0
            total_cpu.append(time.process_time() - c)
            poll_wall.append(p_wall)
            short_wall.append(s_wall)
        idle: list[float] = []
        for _ in range(repeats):
            a = pc()
            for tl in tailers:
                tl.poll()
            idle.append(pc() - a)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"poll_ms": _ms(poll_wall), "to_short_ms": _ms(short_wall), "read_cpu_ms": _ms(total_cpu),
            "idle_poll_us_a_run": round(statistics.median(idle) * 1e6 / runs, 2)}


def floor(argv: list[str]) -> int:
    ap = _parser("floor", "What one process's tick cannot go below: the read path and the rules alone.")
    ap.add_argument("--runs", type=int, default=1000, help="runs the whole daemon watches")
    ap.add_argument("--steps", type=int, default=4, help="new steps a run a tick (daemon_scale: 60 s / 15 s)")
    ap.add_argument("--processes", default="1,2,3,4", help="daemon processes the runs are split over")
    ap.add_argument("--target-ms", type=float, default=300.0, help="the tick p50 to compare with")
    ap.add_argument("--repeats", type=int, default=15, help="repeats of the read path")
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {**provenance("what a tick cannot go below: the read path and the rules alone",
                                        "daemon_scale.py --part floor", argv),
                           "pinned": pin_one_core(), "runs": args.runs, "steps_per_tick": args.steps,
                           "target_ms": args.target_ms, "results": []}
    rules = load_rules([ROOT / "rules" / "default.yaml"])
    base = base_trajectory()
    for k in (int(x) for x in args.processes.split(",")):
        n = math.ceil(args.runs / k)
        read = read_path(n, args.steps, args.repeats)
        judged = bench_size(rules, n, max(5, min(200, 20_000 // n)), base, profile=False, per_rule=False)
        step_ms = judged["eval_cpu_ms_median"] + judged["append_ms_median"]
        row = {"processes": k, "runs_a_process": n, **read, "rules_ms_a_step": round(step_ms, 2),
               "rules_ms": round(args.steps * step_ms, 1)}
        row["floor_ms"] = round(row["read_cpu_ms"] + row["rules_ms"] - row["to_short_ms"], 1)
        row["left_for_the_rest_ms"] = round(args.target_ms - row["floor_ms"], 1)
        doc["results"].append(row)
        print(json.dumps(row), flush=True)
    t = f"{args.target_ms:g}"
    md = [
        "# What a tick cannot go below", "",
        f"{args.runs:,} runs split over each number of processes, {args.steps} new steps a run a tick, one core "
        f"({doc['pinned']}). {provenance_line(doc)}", "",
        "The read path (every run polled, its new records mapped onto short names) once, plus the rules (every "
        "run's window append, then the screened pack) once a step, less the mapping, which both do and the daemon "
        "does once: medians, CPU ms (the poll's, the mapping's and the append's wall ms). A floor: the store, the "
        f"fsynced control.json writes, the events and the lockstep come on top (`daemon_scale.md`). The last "
        f"column is what a tick p50 of {t} ms leaves them. An idle poll (nothing new) of a run: the µs column.", "",
        f"| processes | runs a process | poll ms | mapping ms | read ms (CPU) | rules ms a step | rules ms a tick "
        f"| floor ms | left of {t} ms | idle poll µs a run |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[f"| {r['processes']} | {r['runs_a_process']:,} | {r['poll_ms']} | {r['to_short_ms']} | {r['read_cpu_ms']} "
          f"| {r['rules_ms_a_step']} | {r['rules_ms']} | {r['floor_ms']} | {r['left_for_the_rest_ms']} "
          f"| {r['idle_poll_us_a_run']} |" for r in doc["results"]],
    ]
    _write(args.out, "floor", doc, md)
    return 0


# -- idle: a tick with nothing new --------------------------------------------------------------------------

def idle(argv: list[str]) -> int:
    ap = _parser("idle", "What a daemon tick costs when no run has anything new.")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--ticks", type=int, default=10, help="idle ticks measured")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="daemon_idle_"))
    try:
        dirs = []
        for r in range(args.runs):
            d = tmp / f"run{r:05d}"
            d.mkdir()
            (d / rundir.RUN_JSON).write_text(json.dumps({"id": d.name, "pid": None}))
            rundir.append_event(d, "started", 0)
            with open(d / rundir.METRICS, "w") as f:
                for s in range(1, 21):
                    f.write(json.dumps({"step": s, "data": {"actor/reward_kl_penalty": 0.01, "critic/score/mean": 0.5,
                                                            "actor/entropy": 1.0}}) + "\n")
            dirs.append(d)
        wd = served_daemon(DaemonConfig(runs=[RunSpec(str(d)) for d in dirs], state_dir=str(tmp / "state"),
                                        tick_s=60))
        now = 1_700_000_000.0
        wd.tick(now)  # reads the 20 steps of every run
        cpu: list[float] = []
        wall: list[float] = []
        for _ in range(args.ticks):
            now += 60
            a, c = time.perf_counter(), time.process_time()
            wd.tick(now)
            wall.append(time.perf_counter() - a)
            cpu.append(time.process_time() - c)
        wd.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc: dict[str, Any] = {
        **provenance("daemon ticks with nothing new in any run", "daemon_scale.py --part idle", argv),
        "runs": args.runs, "idle_ticks": args.ticks,
        "cpu_ms_p50": round(statistics.median(cpu) * 1e3, 1), "cpu_ms_max": round(max(cpu) * 1e3, 1),
        "wall_ms_p50": round(statistics.median(wall) * 1e3, 1), "wall_ms_max": round(max(wall) * 1e3, 1),
        "cpu_us_per_run": round(statistics.median(cpu) * 1e6 / args.runs, 1),
    }
    md = ["# Daemon ticks with nothing new", "",
          f"{doc['runs']:,} runs, each with 20 steps already read; {doc['idle_ticks']} ticks with nothing new. "
          f"{provenance_line(doc)}", "",
          "| CPU ms a tick p50 | CPU max | CPU µs a run | wall ms p50 | wall max |", "|---:|---:|---:|---:|---:|",
          f"| {doc['cpu_ms_p50']} | {doc['cpu_ms_max']} | {doc['cpu_us_per_run']} | {doc['wall_ms_p50']} | "
          f"{doc['wall_ms_max']} |"]
    _write(args.out, "idle", doc, md)
    return 0


# -- journal: settling a decision as the journal grows ------------------------------------------------------

def _settle_ms(store: Store, ids: list[int]) -> float:
    """Median milliseconds of one ``settle_decision`` over ``ids``."""
    times = []
    for i in ids:
        a = time.perf_counter()
        store.settle_decision(i)
        times.append(time.perf_counter() - a)
    return statistics.median(times) * 1e3


def _settle_at(size: int, settle: int, tmp: Path) -> dict[str, Any]:
    store = Store(tmp / f"state{size}")
    store.upsert_run(RunRecord("run", str(tmp / "run")))
    ids = []
    with store.transaction():
        for k in range(size):
            d = store.add_decision("run", k, "reward_stall", "fire", [{"kind": "set"}], {"reward": 0.5})
            store.add_action("run", "live_set", {"set": {"lr": 1e-6}}, decision_id=d, status="done")
            ids.append(d)
    last = ids[-settle:]
    _settle_ms(store, ids[:50])  # (warm: the connection's first statements and the file's pages)
    indexed = _settle_ms(store, last)
    with store.transaction() as db:
        db.execute("DROP INDEX journal_decision")
    scanned = _settle_ms(store, last)
    store.close()
    return {"journal_entries": size, "settle_ms_p50_indexed": round(indexed, 4),
            "settle_ms_p50_without_index": round(scanned, 4)}


def journal(argv: list[str]) -> int:
    ap = _parser("journal", "Store.settle_decision by journal size, with and without the journal_decision index "
                            "(a real state of N decisions with one finished entry each; the hour's bench ends with "
                            "about 11,000).")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--settle", type=int, default=500, help="decisions settled at each size (the newest)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="store_settle_"))
    try:
        rows = [_settle_at(n, min(args.settle, n), tmp) for n in args.sizes]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {**provenance("Store.settle_decision by journal size, with and without the journal_decision index",
                        "daemon_scale.py --part journal", argv), "rows": rows}
    md = ["# Settling a decision as the journal grows", "",
          f"`Store.settle_decision` on a real state database of N decisions with one finished journal entry each, "
          f"the median of settling the newest {args.settle}, with the `journal_decision` index and without it. "
          f"{provenance_line(doc)}", "",
          "| journal entries | ms a settle, indexed | ms a settle, without the index |", "|---:|---:|---:|",
          *[f"| {r['journal_entries']:,} | {r['settle_ms_p50_indexed']} | {r['settle_ms_p50_without_index']} |"
            for r in rows]]
    _write(args.out, "journal", doc, md)
    return 0


# -- live-set: the file write against the store's writes ----------------------------------------------------

def _per_call_ms(fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds a call of ``fn(i)`` for i < n."""
    def calls() -> None:
        for i in range(n):
            fn(i)

    wall, cpu = timed(calls)
    return wall / n * 1e3, cpu / n * 1e3


def _live_set_round(tmp: Path, n: int, dirs: int) -> dict[str, tuple[float, float]]:
    paths = []
    for d in range(dirs):
        (tmp / f"run{d:03d}").mkdir()
        paths.append(tmp / f"run{d:03d}" / rundir.CONTROL)
    control = Control(7, {"actor_rollout_ref.actor.optim.lr": 9.0e-7, "actor_rollout_ref.actor.ppo_epochs": 2}, ())
    data = json.dumps(control.to_json(), sort_keys=True).encode()
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

    out = {"file write, fsynced (atomic_write_bytes)": _per_call_ms(write, n)}
    with mock.patch.object(os, "fsync", lambda fd: None):  # the same function, its fsync a no-op
        out["file write, no fsync"] = _per_call_ms(write, n)
    out["store write, a transaction each"] = _per_call_ms(
        lambda i: store.update_action(entry, status="sent", deadline=float(i)), n)
    out["store write, ten to a transaction"] = _per_call_ms(batched, n)  # (divided by n: a write's share)
    store.close()
    return out


def live_set(argv: list[str]) -> int:
    ap = _parser("live-set", "What one live set's file write (and its fsync) and store writes cost.")
    ap.add_argument("--n", type=int, default=2000, help="calls of each part a round")
    ap.add_argument("--dirs", type=int, default=50, help="run directories the files are written into")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.n < 10 or args.dirs < 1 or args.rounds < 1:
        ap.error("--n must be at least 10, --dirs and --rounds at least 1")
    rounds = []
    for _ in range(args.rounds):
        tmp = Path(tempfile.mkdtemp(prefix="live_set_parts_"))
        try:
            rounds.append(_live_set_round(tmp, args.n, args.dirs))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    parts: dict[str, Any] = {}
    for name in rounds[0]:
        walls = [r[name][0] for r in rounds]
        parts[name] = {"wall_ms_median": round(statistics.median(walls), 4),
                       "wall_ms_rounds": [round(w, 4) for w in walls],
                       "cpu_ms_median": round(statistics.median(r[name][1] for r in rounds), 4)}
    doc = {**provenance("what one live set's file write and store writes cost", "daemon_scale.py --part live-set",
                        argv), "n": args.n, "dirs": args.dirs, "rounds": args.rounds, "parts": parts}
    md = ["# What one live set's parts cost", "",
          f"{args.n} calls of each part a round, {args.rounds} rounds, files spread over {args.dirs} run directories "
          f"in a temporary directory on this machine's disk, a real SQLite state. {provenance_line(doc)}", "",
          "| part | wall ms a call, median of rounds | each round | CPU ms a call |", "|---|---:|---|---:|",
          *[f"| {name} | {p['wall_ms_median']:.3f} | {', '.join(f'{w:.3f}' for w in p['wall_ms_rounds'])} "
            f"| {p['cpu_ms_median']:.3f} |" for name, p in parts.items()]]
    _write(args.out, "live-set", doc, md)
    return 0


# -- instructions: the ticks under callgrind ----------------------------------------------------------------

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
    """End a child still running: SIGINT first (so that daemon_scale.py removes its run directories), then
    SIGKILL."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def _instructions(callgrind_out: Path) -> int:
    """The instructions a callgrind output file counts (its ``totals:`` line, or ``summary:``)."""
    for line in callgrind_out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError(f"{callgrind_out}: no totals: line")


def instructions(argv: list[str]) -> int:
    ap = _parser("instructions", "The instructions a daemon's ticks execute, counted by callgrind.")
    ap.add_argument("--runs", type=int, default=50, help="runs the daemon watches")
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("daemon_scale.py --part instructions: valgrind is not installed (Debian: apt-get install valgrind)",
              file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    print(f"daemon_scale.py at {args.runs} runs over {args.hours:g} h, twice under callgrind at once (minutes)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tick_instructions_") as tmp, ExitStack() as stack:
        procs = {}
        for kind in ("with_ticks", "without_ticks"):
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/{kind}.callgrind",
                   sys.executable, "-c", RUNNER, kind, str(args.runs), str(args.hours), f"{tmp}/{kind}",
                   str(BENCH / "daemon_scale.py")]
            log = stack.enter_context(open(f"{tmp}/{kind}.log", "w"))
            procs[kind] = stack.enter_context(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                                               stderr=log))
            stack.callback(_stop, procs[kind])  # (an interrupted bench leaves no callgrind running)
        for kind, p in procs.items():
            # Exit 1: late ticks (a tick under callgrind outlasts the simulated interval), results written all the same.
            if p.wait() not in (0, 1) or not Path(f"{tmp}/{kind}/daemon_scale.json").exists():
                tail = Path(f"{tmp}/{kind}.log").read_text().splitlines()[-15:]
                print(f"the run {kind} failed (exit {p.returncode}):", *tail, sep="\n", file=sys.stderr)
                return 1
        counts = {kind: _instructions(Path(f"{tmp}/{kind}.callgrind")) for kind in procs}
        scale = json.loads(Path(f"{tmp}/with_ticks/daemon_scale.json").read_text())
    ticks = counts["with_ticks"] - counts["without_ticks"]
    doc: dict[str, Any] = {**provenance("instructions a daemon's ticks execute (callgrind)",
                                        "daemon_scale.py --part instructions", argv),
                           "runs": args.runs, "simulated_hours": args.hours, "instructions": counts,
                           "tick_instructions": ticks, "ticks": scale["ticks"], "steps_per_run": scale["steps_per_run"],
                           "decisions": scale["decisions"], "tick_instructions_per_tick": round(ticks / scale["ticks"]),
                           "tick_instructions_per_run_step": round(ticks / (scale["runs"] * scale["steps_per_run"]))}
    md = ["# Instructions a daemon's ticks execute", "",
          f"`daemon_scale.py` at {args.runs} runs over {args.hours:g} simulated hour(s), one process, under "
          f"`valgrind --tool=callgrind`, with its ticks and with `Watchdog.tick` made a no-op; `PYTHONHASHSEED=0`. "
          f"{provenance_line(doc)}", "",
          "| run | instructions |", "|---|---:|",
          f"| with the ticks | {counts['with_ticks']:,} |", f"| without them | {counts['without_ticks']:,} |",
          f"| **the ticks** | **{ticks:,}** |", "",
          f"{doc['ticks']} ticks, {doc['steps_per_run']} steps a run, {doc['decisions']:,} decisions (two codes "
          f"compared must make as many): **{doc['tick_instructions_per_run_step']:,} instructions a run-step**, "
          f"{doc['tick_instructions_per_tick']:,} a tick."]
    _write(args.out, "instructions", doc, md)
    return 0


PARTS: dict[str, Callable[[list[str]], int]] = {
    "floor": floor, "idle": idle, "journal": journal, "live-set": live_set, "instructions": instructions}


# -- the picture ---------------------------------------------------------------------------------------------

#: (label, result file): the bars, left to right: the whole hour at 1,000 runs over 1 to 4 processes.
BARS = [("1 process", "daemon_scale_shards1.json"), ("2 shards", "daemon_scale_shards2.json"),
        ("3 shards", "daemon_scale.json"), ("4 shards", "daemon_scale_shards4.json")]


def plot(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="daemon_scale.py --plot",
                                 description="daemon_ticks.png: the busy tick's p50 and p99 at 1 to 4 processes "
                                             "against the target, from the committed results.")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the daemon_scale results are")
    ap.add_argument("--out", type=Path, default=RESULTS / "daemon_ticks.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads((args.results / name).read_text()) for _, name in BARS]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = range(len(BARS))
    ax.bar([x - 0.2 for x in xs], [d["tick_ms_p50"] for d in docs], 0.4, label="tick p50", color="#4c72b0")
    ax.bar([x + 0.2 for x in xs], [d["tick_ms_p99"] for d in docs], 0.4, label="tick p99", color="#dd8452")
    ax.axhline(300, color="#4c72b0", ls="--", lw=1, label="target p50 (300 ms)")
    ax.axhline(1000, color="#dd8452", ls="--", lw=1, label="target p99 (1 s)")
    ax.set_xticks(list(xs), [label for label, _ in BARS])
    ax.set_ylabel("tick wall time (ms)")
    ax.set_title(f"Daemon tick, {docs[0]['runs']:,} runs, the whole hour ({docs[0]['cpus']} cores, {docs[0]['date'][:10]})")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0
