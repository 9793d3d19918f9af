"""Benchmark: one daemon watching 1,000 run directories for an hour of simulated training.

The daemon is built as ``watchdog daemon --config`` builds it (:func:`ppo_watchdog.control.daemon.prepare_daemon`
on a :class:`~ppo_watchdog.control.daemon.DaemonConfig` listing every run directory, no restart command:
the runs are watched, not launched). A simulated trainer per run writes the run-directory protocol
(``run.json``, ``metrics.jsonl`` lines of ~100 verl keys from the real verl log of ../shared/testdata
with a per-run random walk and a KL drift in a tenth of the runs, ``events.jsonl``: ``started``, a
``checkpoint`` every ``--ckpt-every`` steps) and applies each newer ``control.json`` version at its next
step boundary with the protocol's own :class:`~ppo_watchdog.protocol.control.ControlApplier` (an ``applied``
event), as a trainer speaking the protocol does. The simulated clock advances one tick interval at a
time: the trainers append the steps of that interval, then ``Watchdog.tick(now)`` runs, timed with
``perf_counter``; no sleeps, so an hour takes what the ticks cost. A tick is on time when it takes
less than the tick interval (the scheduler runs ticks with ``max_instances=1, coalesce=True``: a
longer tick delays the next one).

``--shards N`` runs the daemon as its config's ``shards: N`` does: N processes, each over the runs the
product's partition gives it, on one state database, ticking in turns (:func:`sharded`); a tick is then
one shard's over its runs, what each of them waits for. One process (the default) is also measured
from inside:

Memory: RSS after every tick (``/proc/self/statm``) and peak (``ru_maxrss``, taken before the bench counts the
decisions: that query decodes the whole state, which the daemon never does; each process imports the command
line a daemon runs in and runs the APScheduler the daemon's does, with no job, so that they count too). With
shards, whose RSS summed counts once a shard the pages they share (the same libraries), also each shard's PSS
after every tick (``/proc/self/smaps_rollup``: a shared page counted as its share), and at the end of the hour
what the shards hold together: the distinct physical frames behind their pages (``/proc/self/pagemap``; the
kernel shows frames only to a process with CAP_SYS_ADMIN, root outside a container's user namespace, so elsewhere
that figure is left out, said); the daemon's windows
measured object by object (as bench/bench_rules.py) at each quarter of the hour; Python heap by
``tracemalloc`` over the last ``--traced-ticks`` ticks (it slows the process, so not over all).

Usage: ``python bench/daemon_scale.py [--runs 1000] [--hours 1] [--step-s 15] [--tick-s 60]
[--profile PATH] [--shards N [--together] [--state-per-shard]] [--label NAME]``. Writes
bench/results/daemon_scale.json and .md (``--label NAME``: daemon_scale_NAME.*; ``--out DIR``: there);
``--profile`` also runs the ticks after the first two under cProfile and writes the top entries (cumulative,
then own time) to PATH, the raw stats beside it as .pstats.

``--part NAME`` measures one part of a tick alone instead (``floor``, ``idle``, ``journal``, ``live-set``,
``instructions``: bench/tick_parts.py says what each is; ``--part NAME --help``: its options), and ``--plot``
draws bench/results/daemon_ticks.png from the committed results.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import math
import multiprocessing as mp
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_rules import (  # noqa: E402
    KEYS_PER_RECORD,
    base_trajectory,
    deep_size,
    peak_rss_mib,
    provenance,
    provenance_line,
)

from ppo_watchdog.control.daemon import DaemonConfig, RunSpec, Watchdog, prepare_daemon  # noqa: E402
from ppo_watchdog.control.shards import MAX_SHARDS  # noqa: E402
from ppo_watchdog.observe.telemetry import TICK_PHASE, TICK_PHASES  # noqa: E402
from ppo_watchdog.protocol import rundir  # noqa: E402
from ppo_watchdog.protocol.control import ControlApplier  # noqa: E402


class Trainer:
    """A run's simulated trainer: appends whole protocol lines to its run directory."""

    def __init__(self, run_dir: Path, run: int, base: list[dict[str, float]], ckpt_every: int) -> None:
        self.dir = run_dir
        self.rnd = random.Random(run)
        self.base = base
        self.offset = self.rnd.randrange(len(base))
        self.drift = 1.003 if run % 10 == 3 else 1.0  # a tenth of the runs drift: KL rules fire
        self.walk = 1.0
        self.step = 0
        self.ckpt_every = ckpt_every
        self.keys = list(base[0])
        self.pad = [f"timing_s/extra_{i}" for i in range(max(0, KEYS_PER_RECORD - len(self.keys)))]
        self.pad_json = json.dumps({k: 1.0 + self.rnd.random() for k in self.pad})[1:-1]
        run_dir.mkdir(parents=True)
        (run_dir / rundir.RUN_JSON).write_text(json.dumps({"id": run_dir.name, "pid": None}))
        rundir.append_event(run_dir, "started", 0)
        # The protocol's own reader of control.json: at the end of each tick's steps (a step boundary) the
        # trainer applies a newer version and writes its ``applied`` event, as a protocol trainer does.
        self.control = ControlApplier(run_dir)

    def advance(self, steps: int, now: float) -> None:
        lines, events = [], []
        for _ in range(steps):
            self.step += 1
            # The log played forwards then backwards (no jump back to step 1 when it wraps).
            j = (self.offset + self.step) % (2 * len(self.base) - 2)
            b = self.base[j if j < len(self.base) else 2 * len(self.base) - 2 - j]
            self.walk = min(self.walk * math.exp(self.rnd.gauss(0.0, 0.02)) * self.drift, 50.0)
            r = self.rnd.random
            data = {k: v * (self.walk if "kl" in k and "coeff" not in k else 1.0) * (0.99 + 0.02 * r())
                    for k, v in b.items()}
            # The padding keys' values are the run's own constants, serialised once (writing is not
            # what is measured; the daemon still parses every key of every line).
            lines.append(f'{{"step": {self.step}, "data": {{{json.dumps(data)[1:-1]}, {self.pad_json}}}}}')
            if self.step % self.ckpt_every == 0:
                events.append(json.dumps({"ts": now, "step": self.step, "kind": "checkpoint",
                                          "path": str(self.dir / "checkpoints" / f"global_step_{self.step}")}))
        with open(self.dir / rundir.METRICS, "a") as f:
            f.write("\n".join(lines) + "\n")
        if events:
            with open(self.dir / rundir.EVENTS, "a") as f:
                f.write("\n".join(events) + "\n")
        changes = self.control.poll(self.step)
        if changes is not None:
            self.control.mark_applied(changes, self.step, changes.changed)


class GcInTicks:
    """The cyclic collector's passes inside the daemon's ticks, by generation (``gc.callbacks``): what a tick
    pays for the objects the daemon keeps (the runs' windows and states), besides its own work."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = [0.0, 0.0, 0.0]
        self.passes = [0, 0, 0]
        self.full_in_tick = False
        self.ticks_with_full_pass = 0
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = info["generation"]
        self.seconds[g] += time.perf_counter() - self._t0
        self.passes[g] += 1
        self.full_in_tick |= g == 2

    def tick(self, on: bool) -> None:
        """Count the collections from now (True) or stop (False) at a tick's end."""
        if not on and self.full_in_tick:
            self.ticks_with_full_pass += 1
        self.on, self.full_in_tick = on, False

    def close(self) -> dict[str, Any]:
        gc.callbacks.remove(self._callback)
        return {"seconds_by_generation": [round(x, 3) for x in self.seconds], "passes_by_generation": self.passes,
                "ticks_with_a_full_pass": self.ticks_with_full_pass}


def served_daemon(cfg: DaemonConfig, exclusive: bool = True) -> Watchdog:
    """The daemon as ``watchdog daemon`` builds and ticks it (``serve_forever``: the collector's freeze), in a
    process that has imported the command line (``python -m ppo_watchdog daemon``, each shard's too), and beside it
    the APScheduler ``serve_forever`` starts, with no job (this process ticks it): their imports and thread
    count in the memory measured, as in the daemon's. (It is left to end with the process.)"""
    from apscheduler.schedulers.background import BackgroundScheduler

    import ppo_watchdog.cli  # noqa: F401

    wd = prepare_daemon(cfg, exclusive=exclusive)
    wd.freeze_survivors = True
    BackgroundScheduler(daemon=True).start()
    return wd


def phase_sums(wd: Any) -> dict[str, float]:
    """Seconds the daemon has spent in each tick phase so far, from its own /metrics histogram."""
    reg = wd.telemetry.registry
    return {p: reg.get_sample_value(f"{TICK_PHASE.name}_sum", {"phase": p}) or 0.0 for p in TICK_PHASES}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pss_mib() -> float:
    """This process's proportional set size, MiB: each page it shares counted as its share."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024


def frames() -> np.ndarray | None:
    """The physical frames behind this process's pages now (sorted), from ``/proc/self/pagemap``: None where
    the kernel hides them (without CAP_SYS_ADMIN it shows every frame as 0; some kernels refuse the file). The
    mappings are listed first; the heap pages its own reading touches count (about 1 MiB)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps") as maps:
        ranges = [[int(x, 16) for x in line.split(None, 1)[0].split("-")] for line in maps]
    found = []
    try:
        pagemap = open("/proc/self/pagemap", "rb", buffering=0)  # noqa: SIM115
    except OSError:
        return None
    with pagemap:
        for lo, hi in ranges:
            try:
                pagemap.seek(lo // page * 8)
                entries = np.frombuffer(pagemap.read((hi - lo) // page * 8), dtype=np.uint64)
            except OSError:  # ([vsyscall]: no entries to read)
                continue
            present = entries[(entries >> np.uint64(63)) == 1]
            found.append(present & np.uint64((1 << 55) - 1))  # (bits 0-54: the frame number)
    held = np.unique(np.concatenate(found))
    return None if held.size == 0 or not held.any() else held


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--part")
    pre.add_argument("--plot", action="store_true")
    early, rest = pre.parse_known_args(argv)
    if early.part is not None or early.plot:
        import tick_parts  # (it imports this module's Trainer: not at the top)

        if early.plot:
            return tick_parts.plot(rest)
        if early.part not in tick_parts.PARTS:
            pre.error(f"--part must be one of {', '.join(tick_parts.PARTS)}, got {early.part!r}")
        return tick_parts.PARTS[early.part](rest)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", help="measure one part of a tick alone (floor, idle, journal, live-set, instructions)")
    ap.add_argument("--plot", action="store_true", help="draw results/daemon_ticks.png from the committed results")
    ap.add_argument("--label", default="", help="write daemon_scale_LABEL.json and .md (e.g. shards2)")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours")
    ap.add_argument("--step-s", type=float, default=15.0, help="simulated seconds per training step")
    ap.add_argument("--tick-s", type=float, default=60.0, help="the daemon's tick interval (tick_s)")
    ap.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoint events")
    ap.add_argument("--shards", type=int, default=1,
                    help="the daemon's processes (its config's shards: N); more than 1: each a process of its own")
    ap.add_argument("--together", action="store_true",
                    help="with --shards: every shard's tick at the same instant, not in the daemon's turns")
    ap.add_argument("--state-per-shard", action="store_true",
                    help="with --shards: a state database each (no shared writer)")
    ap.add_argument("--traced-ticks", type=int, default=None,
                    help="last ticks run under tracemalloc (one process only; default 3)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--profile", type=Path, default=None,
                    help="write a cProfile of the ticks (all but the first two) here (one process only)")
    args = ap.parse_args(argv)
    if not 1 <= args.shards <= MAX_SHARDS:
        ap.error(f"--shards must be from 1 to {MAX_SHARDS}")
    if args.shards > 1 and (args.profile is not None or args.traced_ticks):
        ap.error("--profile and --traced-ticks look inside one process: use them with --shards 1")
    if args.shards == 1 and (args.together or args.state_per_shard):
        ap.error("--together and --state-per-shard are for --shards 2 or more")
    if args.traced_ticks is None:
        args.traced_ticks = 3 if args.shards == 1 else 0
    logging.basicConfig(level=logging.ERROR)

    tmp = Path(tempfile.mkdtemp(prefix="daemon_scale_"))
    try:
        base = base_trajectory()
        t0 = time.perf_counter()
        trainers = [Trainer(tmp / "runs" / f"run{r:04d}", r, base, args.ckpt_every) for r in range(args.runs)]
        run = one_process if args.shards == 1 else sharded
        doc, m = run(args, trainers, tmp, t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ticks = m.tick_s
    late = sum(1 for x in ticks if x >= args.tick_s)
    doc = {
        **provenance("one daemon, many run directories, an hour of simulated steps", "daemon_scale.py", argv),
        "runs": args.runs,
        "shards": args.shards,
        "simulated_hours": args.hours,
        "step_s": args.step_s,
        "tick_s": args.tick_s,
        "ticks": m.n_ticks,
        "steps_per_run": trainers[0].step,
        "records_total": trainers[0].step * args.runs,
        "keys_per_record": max(KEYS_PER_RECORD, len(base[0])),
        "checkpoint_every": args.ckpt_every,
        "window_steps": m.window_steps,
        "tick_ms_p50": round(statistics.median(ticks) * 1e3, 1),
        "tick_ms_p99": round(pct(ticks, 0.99) * 1e3, 1),
        "tick_ms_max": round(max(ticks) * 1e3, 1),
        "phase_ms_p50_p99": {p: [round(statistics.median(v), 1), round(pct(v, 0.99), 1)]
                             for p, v in m.phase_ms.items()},
        "ticks_late": late,
        "on_time": late == 0,
        **doc,
        "decisions": m.decisions,
        "setup_s": round(m.setup_s, 1),
        "trainer_write_s": round(m.write_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.profile is not None:
        write_profile(m.profile, args.profile, doc)  # type: ignore[arg-type]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"daemon_scale_{args.label}" if args.label else "daemon_scale"
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_md(doc, args.out / f"{name}.md")
    print(json.dumps({k: v for k, v in doc.items() if k != "windows"}))
    return 0 if doc["on_time"] else 1


@dataclass
class Measured:
    """What both ways of running the daemon measure: a tick's wall time (one shard's, with shards) and the
    daemon's own per-phase times of each, the decisions made, and the bench's own costs."""

    n_ticks: int
    window_steps: int = 0
    tick_s: list[float] = field(default_factory=list)
    phase_ms: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in TICK_PHASES})
    decisions: int = 0
    setup_s: float = 0.0
    write_s: float = 0.0
    profile: cProfile.Profile | None = None


def intervals(args: argparse.Namespace, trainers: list[Trainer], m: Measured) -> Iterator[tuple[int, float]]:
    """The simulated clock: at each tick interval the trainers write that interval's steps (timed into
    ``m.write_s``), then (tick number, now) is yielded for the daemon's tick."""
    owed, now = 0.0, 1_700_000_000.0
    for i in range(m.n_ticks):
        now += args.tick_s
        owed += args.tick_s / args.step_s
        k = int(owed)
        owed -= k
        w0 = time.perf_counter()
        for t in trainers:
            t.advance(k, now)
        m.write_s += time.perf_counter() - w0
        yield i, now


def one_process(args: argparse.Namespace, trainers: list[Trainer], tmp: Path,
                t0: float) -> tuple[dict[str, Any], Measured]:
    """The daemon of one process (``shards: 1``), ticked here: also its memory, windows and collector."""
    cfg = DaemonConfig(runs=[RunSpec(str(t.dir)) for t in trainers], state_dir=str(tmp / "state"),
                       tick_s=args.tick_s)
    wd = served_daemon(cfg)
    m = Measured(int(round(args.hours * 3600 / args.tick_s)), next(iter(wd.controllers.values())).window.size)
    m.setup_s = time.perf_counter() - t0
    rss_start = rss_mib()
    cpu_s: list[float] = []  # the process's CPU time a tick: what a shared machine's load does not inflate
    rss: list[float] = []
    windows_kb: list[dict[str, float]] = []
    traced_peak = traced_now = 0
    prof = m.profile = cProfile.Profile() if args.profile else None
    gc_ticks = GcInTicks()
    for i, now in intervals(args, trainers, m):
        if i == m.n_ticks - args.traced_ticks:
            gc.collect()
            tracemalloc.start()
        profiled = prof is not None and i >= 2 and not tracemalloc.is_tracing()
        before = phase_sums(wd)
        if profiled:  # the tick alone: phase_sums collects the whole registry
            prof.enable()  # type: ignore[union-attr]
        gc_ticks.tick(True)
        a, c = time.perf_counter(), time.process_time()
        wd.tick(now)
        m.tick_s.append(time.perf_counter() - a)
        cpu_s.append(time.process_time() - c)
        gc_ticks.tick(False)
        if profiled:
            prof.disable()  # type: ignore[union-attr]
        for p, total in phase_sums(wd).items():
            m.phase_ms[p].append((total - before[p]) * 1e3)
        if tracemalloc.is_tracing():
            traced_now, peak = tracemalloc.get_traced_memory()
            traced_peak = max(traced_peak, peak)
        rss.append(rss_mib())
        if (i + 1) % max(1, m.n_ticks // 4) == 0 or i == m.n_ticks - 1:
            ws = [c.window for c in wd.controllers.values()]
            windows_kb.append({"tick": i + 1, "sim_minutes": round((i + 1) * args.tick_s / 60, 1),
                               "steps_per_run": trainers[0].step,
                               "window_kb_per_run": round(deep_size(ws) / len(ws) / 1024, 2),
                               "rss_mib": round(rss[-1], 1)})
            print(f"tick {i + 1}/{m.n_ticks}: step {trainers[0].step}, tick {m.tick_s[-1] * 1e3:.0f} ms, "
                  f"RSS {rss[-1]:.0f} MiB, windows {windows_kb[-1]['window_kb_per_run']} KB/run", flush=True)
    tracemalloc.stop()
    peak = peak_rss_mib()  # (before the count: as in shard())
    m.decisions = len(wd.store.decisions())
    wd.close()
    # The last --traced-ticks ran under tracemalloc, which slows every allocation: they count in the
    # p50/p99 (as they always did) and are left out of these.
    untraced = m.tick_s[:len(m.tick_s) - args.traced_ticks] or m.tick_s
    untraced_cpu = cpu_s[:len(cpu_s) - args.traced_ticks] or cpu_s
    steady = rss[len(rss) // 4:]
    return {
        "tick_ms_per_run_p50": round(statistics.median(m.tick_s) * 1e3 / args.runs, 3),
        "untraced_tick_ms_p50_p99_max": [round(statistics.median(untraced) * 1e3, 1),
                                         round(pct(untraced, 0.99) * 1e3, 1), round(max(untraced) * 1e3, 1)],
        "untraced_tick_cpu_ms_p50_p99_max": [round(statistics.median(untraced_cpu) * 1e3, 1),
                                             round(pct(untraced_cpu, 0.99) * 1e3, 1),
                                             round(max(untraced_cpu) * 1e3, 1)],
        "gc_in_ticks": gc_ticks.close(),
        "rss_mib_start": round(rss_start, 1),
        "rss_mib_end": round(rss[-1], 1),
        "rss_mib_steady_min_max": [round(min(steady), 1), round(max(steady), 1)],
        "peak_rss_mib": round(peak, 1),
        "windows": windows_kb,
        "tracemalloc_last_ticks_mib": {"ticks": args.traced_ticks, "current": round(traced_now / 2**20, 1),
                                       "peak": round(traced_peak / 2**20, 1)},
    }, m


def shard(conn: Connection, run_dirs: list[str], state_dir: str, tick_s: float) -> None:
    """One shard: the daemon over its runs, a tick per word from the parent; answers (wall s, CPU s, phase ms)."""
    wd = served_daemon(DaemonConfig(runs=[RunSpec(d) for d in run_dirs], state_dir=state_dir, tick_s=tick_s),
                       exclusive=False)
    conn.send(next(iter(wd.controllers.values())).window.size if wd.controllers else 0)
    pss = pss_mib()
    while True:
        now = conn.recv()
        if now is None:
            break
        before = phase_sums(wd)
        a, c = time.perf_counter(), time.process_time()
        wd.tick(now)
        wall, cpu = time.perf_counter() - a, time.process_time() - c
        conn.send((wall, cpu, {p: (total - before[p]) * 1e3 for p, total in phase_sums(wd).items()}))
        pss = max(pss, pss_mib())  # (after the answer: untimed)
    # The peak first: the count below decodes every decision of the state (50 MiB at 1,000 runs over the
    # hour), which the daemon never does.
    peak, held = peak_rss_mib(), frames()
    decisions = len([d for d in wd.store.decisions() if d["run_id"] in wd.controllers])
    wd.close()
    conn.send((decisions, peak, pss, held))


def answer(conn: Connection, timeout_s: float = 600.0) -> Any:
    """A shard's next answer; a shard that died or hangs stops the bench, said."""
    if not conn.poll(timeout_s):
        raise SystemExit(f"a shard gave no answer in {timeout_s:g} s")
    return conn.recv()


def sharded(args: argparse.Namespace, trainers: list[Trainer], tmp: Path,
            t0: float) -> tuple[dict[str, Any], Measured]:
    """The daemon of ``--shards`` processes, each over the runs the product's partition gives it
    (``DaemonConfig.for_shard``, as ``watchdog daemon`` with ``shards: N`` does; ``prepare_daemon`` not
    exclusive, on one state database unless ``--state-per-shard``), ticked on this process's word instead
    of its own scheduler: in turns (shard K at K/N of the interval, ``shards.tick_phase``, as the daemon's
    shards tick), or ``--together``. A tick is one shard's over its runs, what each of them waits for.

    Each shard is a fresh interpreter (``spawn``), as the daemon's own are (``shards.py`` starts each with
    ``Popen``): a forked one would count in its memory the pages it shares with this process, which holds
    the simulated trainers (8 MiB a shard over the whole hour at 1,000 runs)."""
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    conns: list[Connection] = []
    m = Measured(int(round(args.hours * 3600 / args.tick_s)))
    try:
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
                m.window_steps = answer(parent)  # (the first creates the shared database; the others open it)
        for c in conns[0 if args.state_per_shard else 1:]:
            m.window_steps = max(m.window_steps, answer(c))
        m.setup_s = time.perf_counter() - t0
        all_done: list[float] = []  # --together: from the word to the last answer
        shard_wall: list[list[float]] = []
        shard_cpu: list[list[float]] = []
        for i, now in intervals(args, trainers, m):
            if args.together:
                a = time.perf_counter()
                for c in conns:
                    c.send(now)
                answers = [answer(c) for c in conns]
                all_done.append(time.perf_counter() - a)
            else:  # each in its turn (the interval's share between turns is not slept: nothing else runs)
                answers = []
                for k, c in enumerate(conns):
                    c.send(now + k * args.tick_s / args.shards)
                    answers.append(answer(c))
            shard_wall.append([w for w, _, _ in answers])
            shard_cpu.append([cpu for _, cpu, _ in answers])
            for _, _, phases in answers:
                for p, ms in phases.items():
                    m.phase_ms[p].append(ms)
            if (i + 1) % max(1, m.n_ticks // 4) == 0 or i == m.n_ticks - 1:
                print(f"tick {i + 1}/{m.n_ticks}: step {trainers[0].step}, shards' ticks "
                      f"{' / '.join(f'{w * 1e3:.0f}' for w in shard_wall[-1])} ms", flush=True)
        for c in conns:
            c.send(None)
        ends = [answer(c) for c in conns]
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    m.tick_s = [w for each in shard_wall for w in each]
    decided, peak_rss, peak_pss, held = zip(*ends, strict=True)
    m.decisions = sum(decided)
    peaks = [round(x, 1) for x in peak_rss]
    pss = [round(x, 1) for x in peak_pss]
    seen = all(h is not None for h in held)
    frame_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
    return {
        "shared_state": not args.state_per_shard,
        "ticks_in_turns": not args.together,
        "shard_tick_ms_p50": [round(statistics.median([w[k] for w in shard_wall]) * 1e3, 1)
                              for k in range(args.shards)],
        "all_shards_done_ms_p50_p99": ([round(statistics.median(all_done) * 1e3, 1),
                                        round(pct(all_done, 0.99) * 1e3, 1)] if all_done else None),
        "tick_cpu_ms_p50": round(statistics.median([c for each in shard_cpu for c in each]) * 1e3, 1),
        "cpu_ms_all_shards_p50": round(statistics.median([sum(x) for x in shard_cpu]) * 1e3, 1),
        "peak_rss_mib_per_shard": peaks,
        "peak_rss_mib": max(peaks),
        "peak_rss_mib_all_shards": round(sum(peaks), 1),
        "peak_pss_mib_per_shard": pss,
        "peak_pss_mib_all_shards": round(sum(pss), 1),
        # At the end of the hour: each shard's resident pages, and the frames behind them counted once.
        "end_rss_mib_per_shard": [round(h.size * frame_mib, 1) for h in held] if seen else None,
        "end_held_mib_all_shards": round(np.unique(np.concatenate(held)).size * frame_mib, 1) if seen else None,
    }, m


def write_profile(prof: cProfile.Profile, path: Path, d: dict[str, Any]) -> None:
    """The profiled ticks' top entries, by cumulative and by own time, under the command that made them."""
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.strip_dirs()
    profiled = d["ticks"] - 2 - d["tracemalloc_last_ticks_mib"]["ticks"]
    buf.write(f"# {d['command']}\n# {d['date']}, load average {d['loadavg']}, {d['runs']} runs, "
              f"{profiled} ticks profiled (after the first two, before the tracemalloc ones); "
              f"tick p50 {d['tick_ms_p50']} ms (all ticks, unprofiled ones included)\n")
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())
    prof.dump_stats(path.with_suffix(".pstats"))  # for pstats / snakeviz: callers and callees


def write_md(d: dict[str, Any], path: Path) -> None:
    shards = d["shards"]
    if shards == 1:
        who = "One daemon of one process (`prepare_daemon`, files source, default pack)"
    else:
        who = (f"One daemon of **{shards} processes** (`shards: {shards}`: each `prepare_daemon` over the runs "
               f"`shard_of` gives it, files source, default pack, "
               f"{'one shared state database' if d['shared_state'] else 'a state database each'})")
    lines = [
        "# Daemon at scale",
        "",
        f"{who} watching **{d['runs']:,} run directories** for "
        f"{d['simulated_hours']:g} simulated hour(s): a step every {d['step_s']:g} s per run "
        f"({d['steps_per_run']:,} steps a run, {d['records_total']:,} metric lines of {d['keys_per_record']} keys, "
        f"a checkpoint event every {d['checkpoint_every']} steps), tick every {d['tick_s']:g} s ({d['ticks']} ticks). "
        f"Ticks driven in a loop on a simulated clock, no sleeps. {d['cpus']} cores shared. "
        f"{provenance_line(d)}",
        "",
        f"The step rate is scaled down (3,600 steps a run, a step a second, would take the simulation over an hour "
        f"on two shared cores; a real PPO step of a large model takes tens of seconds to minutes): a step every "
        f"{d['step_s']:g} s, still past the window's first trims ({d['window_steps']} steps kept, up to twice that). "
        f"The run count is not scaled. The tick interval is the daemon's `tick_s`; a tick is on time when it ends "
        f"before the next is due.",
        "",
    ]
    if shards == 1:
        lines += [
            "| tick p50 ms | tick p99 ms | max ms | per run p50 ms | tick interval ms | late ticks | on time |",
            "|---:|---:|---:|---:|---:|---:|---|",
            f"| {d['tick_ms_p50']} | {d['tick_ms_p99']} | {d['tick_ms_max']} | {d['tick_ms_per_run_p50']} | "
            f"{d['tick_s'] * 1e3:g} | {d['ticks_late']} | {'yes' if d['on_time'] else '**no**'} |",
            "",
            f"Without the last {d['tracemalloc_last_ticks_mib']['ticks']} ticks (run under tracemalloc, which slows "
            f"every allocation): tick p50 {d['untraced_tick_ms_p50_p99_max'][0]} ms, p99 "
            f"{d['untraced_tick_ms_p50_p99_max'][1]} ms, max {d['untraced_tick_ms_p50_p99_max'][2]} ms; the process's "
            f"CPU time a tick (what the other work on the shared cores does not inflate) p50 "
            f"{d['untraced_tick_cpu_ms_p50_p99_max'][0]} ms, p99 {d['untraced_tick_cpu_ms_p50_p99_max'][1]} ms, max "
            f"{d['untraced_tick_cpu_ms_p50_p99_max'][2]} ms.",
            "",
        ]
    else:
        turns = ("The shards tick in turns, shard K at K/N of the interval, as the daemon's do (`shards.tick_phase`)."
                 if d["ticks_in_turns"] else
                 "The shards tick at the same instant (`--together`); every shard done, from the word to the last "
                 f"answer: p50 {d['all_shards_done_ms_p50_p99'][0]} ms, p99 {d['all_shards_done_ms_p50_p99'][1]} ms.")
        lines += [
            "A tick is one shard's over its runs, timed by the shard around `Watchdog.tick`: what each of its runs "
            f"waits for. The percentiles are over every shard's ticks. {turns}",
            "",
            "| processes | tick p50 ms | tick p99 ms | max ms | each shard's tick p50 ms | a shard's tick CPU p50 ms "
            "| CPU of all shards an interval, p50 ms | late ticks | on time |",
            "|---:|---:|---:|---:|---|---:|---:|---:|---|",
            f"| {shards} | {d['tick_ms_p50']} | {d['tick_ms_p99']} | {d['tick_ms_max']} "
            f"| {' / '.join(map(str, d['shard_tick_ms_p50']))} | {d['tick_cpu_ms_p50']} | {d['cpu_ms_all_shards_p50']} "
            f"| {d['ticks_late']} | {'yes' if d['on_time'] else '**no**'} |",
            "",
        ]
    lines += [
        "Where a tick's time goes, by the daemon's own `watchdog_tick_phase_seconds` histogram (summed over the "
        "runs; read: the new bytes parsed, decide: the rules, commit: the store, act: the journal driven):",
        "",
        "| phase | p50 ms | p99 ms |",
        "|---|---:|---:|",
        *[f"| {p} | {v[0]} | {v[1]} |" for p, v in d["phase_ms_p50_p99"].items()],
        "",
    ]
    if shards == 1:
        lines += [
            f"The cyclic garbage collector inside the ticks (all {d['ticks']}): "
            f"{d['gc_in_ticks']['seconds_by_generation']} s in generations 0, 1 and 2, in "
            f"{d['gc_in_ticks']['passes_by_generation']} passes; {d['gc_in_ticks']['ticks_with_a_full_pass']} tick(s) "
            f"held a generation-2 pass (over every object not frozen: left to CPython, everything the daemon keeps; "
            f"once a daemon freezes what each tick leaves alive, what the tick made).",
            "",
            f"Memory: RSS {d['rss_mib_start']} MiB after adding the runs, {d['rss_mib_end']} MiB at the end, "
            f"{d['rss_mib_steady_min_max'][0]}-{d['rss_mib_steady_min_max'][1]} MiB over the last three quarters; "
            f"peak {d['peak_rss_mib']} MiB. Python heap (tracemalloc, last {d['tracemalloc_last_ticks_mib']['ticks']} "
            f"ticks): {d['tracemalloc_last_ticks_mib']['current']} MiB, peak {d['tracemalloc_last_ticks_mib']['peak']} "
            f"MiB. Windows of {d['window_steps']} steps:",
            "",
            "| simulated minutes | steps a run | window KB per run | RSS MiB |",
            "|---:|---:|---:|---:|",
            *[f"| {w['sim_minutes']} | {w['steps_per_run']} | {w['window_kb_per_run']} | {w['rss_mib']} |"
              for w in d["windows"]],
            "",
        ]
    else:
        per = lambda k: " / ".join(map(str, d[k]))  # noqa: E731
        held = (f"At the end of the hour the shards' resident pages were {per('end_rss_mib_per_shard')} MiB, "
                f"and the physical frames behind them, each counted once (`/proc/self/pagemap`), "
                f"**{d['end_held_mib_all_shards']} MiB held together**."
                if d["end_held_mib_all_shards"] is not None else
                "What the shards hold together is not measured: the kernel shows the frames behind a process's "
                "pages only to a process with CAP_SYS_ADMIN.")
        lines += [
            f"Memory: peak RSS {per('peak_rss_mib_per_shard')} MiB a shard, {d['peak_rss_mib_all_shards']} MiB "
            f"summed, which counts once a shard the pages they share (the same libraries); peak PSS (a shared "
            f"page counted as each process's share, after every tick) {per('peak_pss_mib_per_shard')} MiB, "
            f"{d['peak_pss_mib_all_shards']} MiB summed. {held}", ""]
    lines += [f"Setup {d['setup_s']} s, trainers' writes {d['trainer_write_s']} s, wall {d['wall_s']} s.", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
