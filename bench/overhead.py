"""What watching costs the trainer, and how fast a decision reaches it.

    .venv/bin/python bench/overhead.py           # ~10 min on 2 cores

**Overhead**: the embedded trainer's default config, 40 steps, run alone and under
``watchdog run`` (default pack, 1 s tick) with the same seed, in pairs (alone then watched, the
order alternating), at least 5 pairs. Per run the median of ``perf/time_per_step``; the overhead
is the median over pairs of (watched / alone - 1). Goal: at most 1%.

**Reaction**: one watched run with a rule that asks for a live change every 5 steps
(kl_coef x1.001: a real control.json version and a new value, too small to change training); per change the steps and
seconds from the decision (its step, when it was stored) to the trainer's ``applied`` event.
Goal: at most one step boundary after the decision.

Results: ``bench/results/overhead.json`` and ``overhead.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
from bench_rules import provenance, provenance_line  # noqa: E402

STEPS = 40
PING_RULES = """\
version: 1
rules:
  - name: ping
    description: a live change every 5 steps (kl_coef x1.001, a real new value too small to matter) to time decision -> applied
    expr: step >= 2
    actions:
      - set: {key: algorithm.kl_ctrl.kl_coef, scale: 1.001}
    cooldown: 5
    repeat: true
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _args(seed: int) -> list[str]:
    return [f"trainer.total_training_steps={STEPS}", "trainer.test_freq=0", f"trainer.seed={seed}",
            "trainer.progress=false"]


def step_time(run_dir: Path) -> float:
    from ppo_watchdog.sources.ingest import read_records

    times = [r["data"]["perf/time_per_step"] for r in read_records(run_dir) if "perf/time_per_step" in r["data"]]
    return statistics.median(times)


def alone(work: Path, seed: int) -> float:
    run = work / f"alone-{seed}"
    subprocess.run([sys.executable, "-m", "ppo_watchdog.trainer", f"trainer.run_dir={run}", *_args(seed)], check=True,
                   cwd=ROOT, env=_env(), capture_output=True, timeout=900)
    return step_time(run)


def watched(work: Path, seed: int, rules: Path | None = None, tag: str = "watched") -> Path:
    run = work / f"{tag}-{seed}"
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run), "--state-dir", str(work / f"state-{tag}-{seed}"),
           "--no-report", "--tick", "1.0", *(x for a in _args(seed) for x in ("--set", a))]
    if rules is not None:
        cmd[4:4] = ["--rules", str(rules)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), capture_output=True, timeout=900)
    return run


def reaction(work: Path, seed: int) -> list[dict]:
    from ppo_watchdog.control.store import Store

    rules = work / "ping.yaml"
    rules.write_text(PING_RULES)
    run = watched(work, seed, rules, tag="ping")
    store = Store(work / f"state-ping-{seed}")
    applied = {c["version"]: c for c in store.control_versions(run.name)}  # the run id: its directory's name
    out = []
    for d in store.decisions(run.name):
        for j in d["journal"]:
            c = applied.get(j["control_version"])
            if j["kind"] == "live_set" and c and c["applied_ts"] is not None:
                out.append({"decision_step": d["step"], "applied_step": c["applied_step"],
                            "steps": c["applied_step"] - d["step"], "seconds": round(c["applied_ts"] - d["created"], 3)})
    store.close()
    assert run.exists()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "overhead")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    pairs = []
    for i in range(args.pairs):
        seed = 1 + i
        if i % 2 == 0:
            a = alone(args.work, seed)
            w = step_time(watched(args.work, seed))
        else:
            w = step_time(watched(args.work, seed))
            a = alone(args.work, seed)
        pairs.append({"seed": seed, "alone_s": round(a, 4), "watched_s": round(w, 4), "overhead": round(w / a - 1, 4)})
        print(pairs[-1], flush=True)
    overhead = statistics.median(p["overhead"] for p in pairs)
    react = reaction(args.work, 1)
    doc = {**provenance("step time alone and watched; decision to applied", "overhead.py", None),
           "command": "python bench/overhead.py", "steps": STEPS, "pairs": pairs, "median_overhead": overhead,
           "reaction": react,
           "reaction_median_steps": statistics.median(r["steps"] for r in react) if react else None,
           "reaction_max_steps": max((r["steps"] for r in react), default=None),
           "reaction_median_s": statistics.median(r["seconds"] for r in react) if react else None}
    (RESULTS / "overhead.json").write_text(json.dumps(doc, indent=2) + "\n")
    rows = ["| seed | median step alone (s) | median step watched (s) | overhead |", "|---|---|---|---|"]
    rows += [f"| {p['seed']} | {p['alone_s']} | {p['watched_s']} | {100 * p['overhead']:+.1f}% |" for p in pairs]
    text = (f"# `python bench/overhead.py`\n\n{provenance_line(doc, with_command=False)}\n\nEmbedded default config, {STEPS} steps, 1 s tick, default pack. "
            f"Median overhead over {len(pairs)} pairs: **{100 * overhead:+.1f}%**. The pairs spread from "
            f"{100 * min(p['overhead'] for p in pairs):+.1f}% to {100 * max(p['overhead'] for p in pairs):+.1f}%: "
            "that is how much the same seed's step time moves from run to run on this machine, so an "
            "effect smaller than the spread is not measured here.\n\n" + "\n".join(rows) +
            f"\n\nDecision to applied (a live kl_coef change every 5 steps, {len(react)} changes): median "
            f"{doc['reaction_median_steps']} step(s), at most {doc['reaction_max_steps']}; median "
            f"{doc['reaction_median_s']} s.\n")
    (RESULTS / "overhead.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
