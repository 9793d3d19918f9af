"""Benchmark: one daemon watching 1,000 run directories for an hour of simulated training.

The daemon is built as ``watchdog daemon --config`` builds it (:func:`watchdog.control.daemon.prepare_daemon`
on a :class:`~watchdog.control.daemon.DaemonConfig` listing every run directory, no restart command:
the runs are watched, not launched). A simulated trainer per run writes the run-directory protocol
(``run.json``, ``metrics.jsonl`` lines of ~100 verl keys from the real verl log of ../shared/testdata
with a per-run random walk and a KL drift in a tenth of the runs, ``events.jsonl``: ``started``, a
``checkpoint`` every ``--ckpt-every`` steps) and applies each newer ``control.json`` version at its next
step boundary with the protocol's own :class:`~watchdog.protocol.control.ControlApplier` (an ``applied``
event), as a trainer speaking the protocol does. The simulated clock advances one tick interval at a
time: the trainers append the steps of that interval, then ``Watchdog.tick(now)`` runs, timed with
``perf_counter``; no sleeps, so an hour takes what the ticks cost. A tick is on time when it takes
less than the tick interval (the scheduler runs ticks with ``max_instances=1, coalesce=True``: a
longer tick delays the next one).

Memory: RSS after every tick (``/proc/self/statm``) and peak (``ru_maxrss``); the daemon's windows
measured object by object (as bench/bench_rules.py) at each quarter of the hour; Python heap by
``tracemalloc`` over the last ``--traced-ticks`` ticks (it slows the process, so not over all).

Usage: ``python bench/daemon_scale.py [--runs 1000] [--hours 1] [--step-s 10] [--tick-s 30]
[--profile PATH]``. Writes bench/results/daemon_scale.json and .md; ``--profile`` also runs the ticks
after the first two under cProfile and writes the top entries (cumulative, then own time) to PATH.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import math
import os
import platform
import pstats
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_rules import KEYS_PER_RECORD, base_trajectory, deep_size  # noqa: E402

from watchdog.control.daemon import DaemonConfig, RunSpec, Watchdog, prepare_daemon  # noqa: E402
from watchdog.observe.telemetry import TICK_PHASE, TICK_PHASES  # noqa: E402
from watchdog.protocol import rundir  # noqa: E402
from watchdog.protocol.control import ControlApplier  # noqa: E402


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
    """The daemon as ``watchdog daemon`` builds and ticks it (``serve_forever``: the collector's freeze)."""
    wd = prepare_daemon(cfg, exclusive=exclusive)
    wd.freeze_survivors = True
    return wd


def phase_sums(wd: Any) -> dict[str, float]:
    """Seconds the daemon has spent in each tick phase so far, from its own /metrics histogram."""
    reg = wd.telemetry.registry
    return {p: reg.get_sample_value(f"{TICK_PHASE.name}_sum", {"phase": p}) or 0.0 for p in TICK_PHASES}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours")
    ap.add_argument("--step-s", type=float, default=15.0, help="simulated seconds per training step")
    ap.add_argument("--tick-s", type=float, default=60.0, help="the daemon's tick interval (tick_s)")
    ap.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoint events")
    ap.add_argument("--traced-ticks", type=int, default=3, help="last ticks run under tracemalloc")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--profile", type=Path, default=None,
                    help="write a cProfile of the ticks (all but the first two) here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    tmp = Path(tempfile.mkdtemp(prefix="daemon_scale_"))
    try:
        base = base_trajectory()
        t0 = time.perf_counter()
        trainers = [Trainer(tmp / "runs" / f"run{r:04d}", r, base, args.ckpt_every) for r in range(args.runs)]
        cfg = DaemonConfig(runs=[RunSpec(str(t.dir)) for t in trainers], state_dir=str(tmp / "state"),
                           tick_s=args.tick_s)
        wd = served_daemon(cfg)
        setup_s = time.perf_counter() - t0
        rss_start = rss_mib()
        n_ticks = int(round(args.hours * 3600 / args.tick_s))
        steps_per_tick = args.tick_s / args.step_s
        owed = 0.0
        now = 1_700_000_000.0
        tick_s: list[float] = []
        cpu_s: list[float] = []  # the process's CPU time a tick: what a shared machine's load does not inflate
        phase_ms: dict[str, list[float]] = {p: [] for p in TICK_PHASES}  # the daemon's own per-phase histogram sums
        rss: list[float] = []
        windows_kb: list[dict[str, float]] = []
        traced_peak = traced_now = 0
        write_s = 0.0
        prof = cProfile.Profile() if args.profile else None
        gc_ticks = GcInTicks()
        for i in range(n_ticks):
            now += args.tick_s
            owed += steps_per_tick
            k = int(owed)
            owed -= k
            w0 = time.perf_counter()
            for t in trainers:
                t.advance(k, now)
            write_s += time.perf_counter() - w0
            if i == n_ticks - args.traced_ticks:
                gc.collect()
                tracemalloc.start()
            profiled = prof is not None and i >= 2 and not tracemalloc.is_tracing()
            before = phase_sums(wd)
            if profiled:  # the tick alone: phase_sums collects the whole registry
                prof.enable()
            gc_ticks.tick(True)
            a, c = time.perf_counter(), time.process_time()
            wd.tick(now)
            tick_s.append(time.perf_counter() - a)
            cpu_s.append(time.process_time() - c)
            gc_ticks.tick(False)
            if profiled:
                prof.disable()
            for p, total in phase_sums(wd).items():
                phase_ms[p].append((total - before[p]) * 1e3)
            if tracemalloc.is_tracing():
                traced_now, peak = tracemalloc.get_traced_memory()
                traced_peak = max(traced_peak, peak)
            rss.append(rss_mib())
            if (i + 1) % max(1, n_ticks // 4) == 0 or i == n_ticks - 1:
                ws = [c.window for c in wd.controllers.values()]
                windows_kb.append({"tick": i + 1, "sim_minutes": round((i + 1) * args.tick_s / 60, 1),
                                   "steps_per_run": trainers[0].step,
                                   "window_kb_per_run": round(deep_size(ws) / len(ws) / 1024, 2),
                                   "rss_mib": round(rss[-1], 1)})
                print(f"tick {i + 1}/{n_ticks}: step {trainers[0].step}, tick {tick_s[-1] * 1e3:.0f} ms, "
                      f"RSS {rss[-1]:.0f} MiB, windows {windows_kb[-1]['window_kb_per_run']} KB/run", flush=True)
        tracemalloc.stop()
        wall = time.perf_counter() - t0
        decisions = len(wd.store.decisions())
        wd.close()
        gc_in_ticks = gc_ticks.close()
        late = sum(1 for x in tick_s if x >= args.tick_s)
        # The last --traced-ticks ran under tracemalloc, which slows every allocation: they count in the
        # p50/p99 above (as they always did) and are left out of these.
        untraced = tick_s[:len(tick_s) - args.traced_ticks] or tick_s
        untraced_cpu = cpu_s[:len(cpu_s) - args.traced_ticks] or cpu_s
        steady = rss[len(rss) // 4:]
        doc: dict[str, Any] = {
            "benchmark": "one daemon, many run directories, an hour of simulated steps",
            "command": " ".join(["python bench/daemon_scale.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "runs": args.runs,
            "simulated_hours": args.hours,
            "step_s": args.step_s,
            "tick_s": args.tick_s,
            "ticks": n_ticks,
            "steps_per_run": trainers[0].step,
            "records_total": trainers[0].step * args.runs,
            "keys_per_record": max(KEYS_PER_RECORD, len(base[0])),
            "checkpoint_every": args.ckpt_every,
            "window_steps": next(iter(wd.controllers.values())).window.size,
            "tick_ms_p50": round(statistics.median(tick_s) * 1e3, 1),
            "tick_ms_p99": round(pct(tick_s, 0.99) * 1e3, 1),
            "tick_ms_max": round(max(tick_s) * 1e3, 1),
            "tick_ms_per_run_p50": round(statistics.median(tick_s) * 1e3 / args.runs, 3),
            "untraced_tick_ms_p50_p99_max": [round(statistics.median(untraced) * 1e3, 1),
                                             round(pct(untraced, 0.99) * 1e3, 1), round(max(untraced) * 1e3, 1)],
            "untraced_tick_cpu_ms_p50_p99_max": [round(statistics.median(untraced_cpu) * 1e3, 1),
                                                 round(pct(untraced_cpu, 0.99) * 1e3, 1),
                                                 round(max(untraced_cpu) * 1e3, 1)],
            "phase_ms_p50_p99": {p: [round(statistics.median(v), 1), round(pct(v, 0.99), 1)]
                                 for p, v in phase_ms.items()},
            "gc_in_ticks": gc_in_ticks,
            "ticks_late": late,
            "on_time": late == 0,
            "rss_mib_start": round(rss_start, 1),
            "rss_mib_end": round(rss[-1], 1),
            "rss_mib_steady_min_max": [round(min(steady), 1), round(max(steady), 1)],
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "windows": windows_kb,
            "tracemalloc_last_ticks_mib": {"ticks": args.traced_ticks, "current": round(traced_now / 2**20, 1),
                                           "peak": round(traced_peak / 2**20, 1)},
            "decisions": decisions,
            "setup_s": round(setup_s, 1),
            "trainer_write_s": round(write_s, 1),
            "wall_s": round(wall, 1),
        }
        if prof is not None:
            write_profile(prof, args.profile, doc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "daemon_scale.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_md(doc, args.out / "daemon_scale.md")
    print(json.dumps({k: v for k, v in doc.items() if k != "windows"}))
    return 0 if doc["on_time"] else 1


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
    lines = [
        "# Daemon at scale",
        "",
        f"One daemon (`prepare_daemon`, files source, default pack) watching **{d['runs']:,} run directories** for "
        f"{d['simulated_hours']:g} simulated hour(s): a step every {d['step_s']:g} s per run "
        f"({d['steps_per_run']:,} steps a run, {d['records_total']:,} metric lines of {d['keys_per_record']} keys, "
        f"a checkpoint event every {d['checkpoint_every']} steps), tick every {d['tick_s']:g} s ({d['ticks']} ticks). "
        f"Ticks driven in a loop on a simulated clock, no sleeps. Python {d['python']}, {d['cpus']} cores shared "
        f"(load average {d['loadavg']}), {d['date']}. Command: `{d['command']}`.",
        "",
        f"The step rate is scaled down (3,600 steps a run, a step a second, would take the simulation over an hour "
        f"on two shared cores; a real PPO step of a large model takes tens of seconds to minutes): a step every "
        f"{d['step_s']:g} s, still past the window's first trims ({d['window_steps']} steps kept, up to twice that). "
        f"The run count is not scaled. The tick interval is the daemon's `tick_s`; a tick is on time when it ends "
        f"before the next is due.",
        "",
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
        "Where a tick's time goes, by the daemon's own `watchdog_tick_phase_seconds` histogram (summed over the "
        "runs; read: the new bytes parsed, decide: the rules, commit: the store, act: the journal driven):",
        "",
        "| phase | p50 ms | p99 ms |",
        "|---|---:|---:|",
        *[f"| {p} | {v[0]} | {v[1]} |" for p, v in d["phase_ms_p50_p99"].items()],
        "",
        f"The cyclic garbage collector inside the ticks (all {d['ticks']}): "
        f"{d['gc_in_ticks']['seconds_by_generation']} s in generations 0, 1 and 2, in "
        f"{d['gc_in_ticks']['passes_by_generation']} passes; {d['gc_in_ticks']['ticks_with_a_full_pass']} tick(s) "
        f"held a generation-2 pass (over every object not frozen: left to CPython, everything the daemon keeps; "
        f"once a daemon freezes what each tick leaves alive, what the tick made).",
        "",
        f"Memory: RSS {d['rss_mib_start']} MiB after adding the runs, {d['rss_mib_end']} MiB at the end, "
        f"{d['rss_mib_steady_min_max'][0]}-{d['rss_mib_steady_min_max'][1]} MiB over the last three quarters; "
        f"peak {d['peak_rss_mib']} MiB. Python heap (tracemalloc, last {d['tracemalloc_last_ticks_mib']['ticks']} ticks): "
        f"{d['tracemalloc_last_ticks_mib']['current']} MiB, peak {d['tracemalloc_last_ticks_mib']['peak']} MiB. "
        f"Windows of {d['window_steps']} steps:",
        "",
        "| simulated minutes | steps a run | window KB per run | RSS MiB |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {w['sim_minutes']} | {w['steps_per_run']} | {w['window_kb_per_run']} | {w['rss_mib']} |"
              for w in d["windows"]]
    lines += ["", f"Setup {d['setup_s']} s, trainers' writes {d['trainer_write_s']} s, wall {d['wall_s']} s.", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
