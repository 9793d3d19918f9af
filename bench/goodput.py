"""Goodput under faults: the watchdog against a supervisor that only restarts on exit.

    .venv/bin/python bench/goodput.py        # ~8 min on 2 cores

The embedded trainer's default config, 100 steps, one fault schedule: an OOM (the next
micro batch raises), a crash (exit 1, nothing saved), a hang (the trainer stops stepping and
never exits), NaN written into the weights, and a 30x lr spike. Run twice:

- **watchdog**: ``watchdog run --on-escalate stop`` with the default pack;
- **baseline**: what torchrun ``--max-restarts`` or Ray Train's ``FailureConfig`` do: relaunch
  from the latest checkpoint whenever the trainer exits non-zero, nothing else. It cannot see
  a hang (its attempt never exits), so it gets a wall limit of three times the watchdog's run
  and is judged on what it trained by then.

Measured from the run directory (a thread notes when each metrics line appears): productive
steps (the final timeline's), steps trained again, ETTR (productive steps x median step time
/ wall time), time to recover from each fault (its ``fault`` event to the first new step past
it that the final timeline keeps), final validation accuracy. Results:
``bench/results/goodput.json`` and ``goodput.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
from bench_rules import provenance, provenance_line  # noqa: E402

STEPS = 100
FAULTS = "oom@15,crash@30,hang@45:100000,nan_weights@60,lr_spike@75:x30"
VAL_KEY = "val-core/tiny_arith/reward/mean@1"


class LineClock:
    """Notes the wall time each metrics.jsonl line is first seen (polled every 0.1 s)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        offset, buf = 0, b""
        while not self._stop.is_set():
            try:
                with self.path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            now = time.time()
            offset += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    self.seen.append((int(json.loads(line)["step"]), now))
                except (ValueError, KeyError):
                    continue
            self._stop.wait(0.1)

    def stop(self) -> list[tuple[int, float]]:
        self._stop.set()
        self._thread.join()
        return self.seen


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _trainer(run_dir: Path, seed: int) -> list[str]:
    from ppo_watchdog.protocol import hydra

    return [sys.executable, "-m", "ppo_watchdog.trainer", f"trainer.run_dir={run_dir}", f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=10", "trainer.save_freq=5", f"trainer.seed={seed}", "trainer.progress=false",
            hydra.format_override("trainer.faults", FAULTS)]


def run_watchdog(work: Path, seed: int) -> tuple[Path, float, list[tuple[int, float]]]:
    run_dir = work / "watchdog" / "run"
    clock = LineClock(run_dir / "metrics.jsonl")
    t0 = time.time()
    args = _trainer(run_dir, seed)[3:]
    sets = [x for a in args if not a.startswith(("trainer.run_dir=", "trainer.faults=")) for x in ("--set", a)]
    subprocess.run([sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--state-dir",
                    str(work / "watchdog" / "state"), "--no-report", "--on-escalate", "stop", "--tick", "0.5",
                    "--heartbeat-min", "20", "--faults", FAULTS, *sets],
                   cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return run_dir, time.time() - t0, clock.stop()


def run_baseline(work: Path, seed: int, limit_s: float) -> tuple[Path, float, list[tuple[int, float]]]:
    """Restart from the latest checkpoint on any non-zero exit (the trainer resumes by itself), nothing else."""
    run_dir = work / "baseline" / "run"
    clock = LineClock(run_dir / "metrics.jsonl")
    t0 = time.time()
    while time.time() - t0 < limit_s:
        proc = subprocess.Popen(_trainer(run_dir, seed), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, limit_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        if code == 0:
            break
    return run_dir, time.time() - t0, clock.stop()


def measure(run_dir: Path, wall: float, seen: list[tuple[int, float]]) -> dict:
    from ppo_watchdog.protocol import rundir
    from ppo_watchdog.sources.ingest import read_records

    records = read_records(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    final = {r["step"]: r for r in records}
    productive = len([s for s in final if s > 0])
    times = [r["data"]["perf/time_per_step"] for r in records if "perf/time_per_step" in r["data"]]
    step_s = statistics.median(times) if times else 0.0
    last_seen: dict[int, float] = {}
    for step, ts in seen:
        last_seen[step] = ts  # the final timeline keeps the last line written for a step
    recover = {}
    for e in rundir.iter_events(run_dir, ["fault"]):
        after = [t for s, t in last_seen.items() if s > int(e["step"]) and t >= float(e["ts"])]
        recover[f"{e['fault']}@{e['step']}"] = round(min(after) - float(e["ts"]), 1) if after else None
    last = max(final, default=None)
    return {
        "wall_s": round(wall, 1), "productive_steps": productive, "steps_trained": len(seen),
        "steps_trained_again": max(0, len([s for s, _ in seen if s > 0]) - productive),
        "median_step_s": round(step_s, 3), "ettr": round(productive * step_s / wall, 3) if wall else 0.0,
        "steps_per_minute": round(60 * productive / wall, 1) if wall else 0.0, "last_step": last,
        # The last validation on the final timeline (the trainer validates every test_freq steps).
        "final_val": next((final[s]["data"][VAL_KEY] for s in sorted(final, reverse=True) if VAL_KEY in final[s]["data"]),
                          None),
        "sft_val": final.get(0, {}).get("data", {}).get(VAL_KEY), "recovery_s": recover,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "goodput")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    wd = measure(*run_watchdog(args.work, args.seed))
    base = measure(*run_baseline(args.work, args.seed, limit_s=3 * wd["wall_s"]))
    doc = {**provenance("goodput under faults: the watchdog against restart-on-exit", "goodput.py", None),
           "command": "python bench/goodput.py", "faults": FAULTS, "steps": STEPS, "seed": args.seed,
           "watchdog": wd, "baseline": base}
    (RESULTS / "goodput.json").write_text(json.dumps(doc, indent=2) + "\n")
    rows = ["| | watchdog | baseline (restart on exit) |", "|---|---|---|"]
    for key, label in (("wall_s", "wall time (s)"), ("productive_steps", f"productive steps (of {STEPS})"),
                       ("steps_trained_again", "steps trained again"), ("ettr", "ETTR"),
                       ("steps_per_minute", "productive steps per minute"), ("final_val", "final validation"),
                       ("sft_val", "SFT start validation")):
        rows.append(f"| {label} | {wd[key]} | {base[key]} |")
    for fault in wd["recovery_s"]:
        rows.append(f"| recovery from {fault} (s) | {wd['recovery_s'].get(fault)} | "
                    f"{base['recovery_s'].get(fault, 'never reached')} |")
    (RESULTS / "goodput.md").write_text(f"# `python bench/goodput.py`\n\n{provenance_line(doc, with_command=False)}\n\nEmbedded default config, {STEPS} steps, "
                                        f"seed {args.seed}, faults `{FAULTS}`.\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
