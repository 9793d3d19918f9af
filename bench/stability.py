"""Stability of hostile runs with and without the watchdog (the embedded trainer, the default pack).

    .venv/bin/python bench/stability.py --quick      # 8 families x 1 seed, ~10 min on 2 cores
    .venv/bin/python bench/stability.py              # 8 families x 5 seeds, ~60-80 min on 2 cores

Every (family, seed) is run twice with the same seed and the same number of steps (80): once
alone (``python -m ppo_watchdog.trainer``) and once under ``watchdog run --on-escalate stop`` (no human at
the keyboard: a run the watchdog can do nothing more for ends with a verdict instead of waiting).

Outcome of a run:

- stable: it reached its last step, its final validation accuracy is at or above its SFT start
  (the step-0 validation), and it did not collapse in its last 10 steps (mean task score at
  least half of its first 3 steps', no NaN);
- escalated: the watchdog stopped it for a human (nothing left to try, or the restart budget);
- unstable: anything else (below the SFT start, collapsed, crashed, hung past the time limit).

Rates come with Wilson 95% intervals; compute is the steps trained (re-runs included) and the
wall time. Results: ``bench/results/stability.json``, ``stability.md`` and ``stability.png``
(``stability_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
from bench_rules import provenance, provenance_line  # noqa: E402

#: family -> (trainer overrides, fault schedule, what it is). The embedded trainer's defaults: lr
#: 2e-4, kl_coef 0.1, entropy_coeff 0.05, 128 prompts a step.
FAMILIES: dict[str, tuple[list[str], str, str]] = {
    "kl_collapse": (["algorithm.kl_ctrl.kl_coef=0.00001", "actor_rollout_ref.actor.optim.lr=0.0006"], "",
                    "kl_coef 1e-5 (no KL anchor) and lr 3x"),
    "lr_drift": (["algorithm.kl_ctrl.kl_coef=0.0001", "actor_rollout_ref.actor.optim.lr=0.0008"], "",
                 "kl_coef 1e-4 and lr 4x: a slow drift"),
    "lr_collapse": (["actor_rollout_ref.actor.optim.lr=0.004"], "", "lr 20x from the start"),
    "lr_spike": ([], "lr_spike@30:x30", "lr x30 from step 30 (injected), after two checkpoints"),
    "entropy_no_anchor": (["actor_rollout_ref.actor.entropy_coeff=0.3", "algorithm.kl_ctrl.kl_coef=0.0"], "",
                          "entropy bonus 0.3 with no KL penalty at all"),
    "nan_weights": ([], "nan_weights@25", "NaN written into the actor's weights at step 25 (injected)"),
    "oom_budget": (["trainer.memory_budget_tokens=700"], "", "a memory budget the default micro batch exceeds"),
    "hang": ([], "hang@30:100000", "the trainer hangs at step 30 (injected) and never comes back"),
}
STEPS = 80


@dataclass
class RunResult:
    family: str
    seed: int
    watched: bool
    outcome: str = "unstable"
    """stable | unstable | escalated."""
    reason: str = ""
    sft_val: float | None = None
    final_val: float | None = None
    last_step: int | None = None
    steps_trained: int = 0
    """Metric lines written, re-runs after rollbacks and restarts included."""
    wall_s: float = 0.0
    rollbacks: int = 0
    restarts: int = 0
    phase: str = ""
    """The watchdog's last phase of the run (watched runs)."""
    decisions: list[str] = field(default_factory=list)


def _records(run_dir: Path) -> list[dict]:
    from ppo_watchdog.sources.ingest import read_records

    try:
        return read_records(run_dir)
    except Exception:  # noqa: BLE001 - no metrics at all is an outcome, not a bench failure
        return []


def classify(r: RunResult, run_dir: Path, steps: int) -> RunResult:
    """Judge a finished (or killed) run from its run directory."""
    recs = _records(run_dir)
    r.steps_trained = sum(1 for _ in open(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
    val = {rec["step"]: rec["data"].get("val-core/tiny_arith/reward/mean@1") for rec in recs}
    r.sft_val = val.get(0)
    r.last_step = max((rec["step"] for rec in recs), default=None)
    r.final_val = val.get(r.last_step) if r.last_step is not None else None
    scores = {rec["step"]: rec["data"].get("critic/score/mean") for rec in recs}
    start = [scores[s] for s in (1, 2, 3) if isinstance(scores.get(s), float)]
    tail = [scores.get(s) for s in range(steps - 9, steps + 1)]
    if r.watched and r.phase in ("stopped", "failed"):
        r.outcome, r.reason = "escalated", f"watchdog {r.phase}"
        return r
    if r.last_step != steps:
        r.outcome, r.reason = "unstable", f"did not finish (last step {r.last_step})"
        return r
    if r.final_val is None or r.sft_val is None or r.final_val < r.sft_val:
        r.outcome, r.reason = "unstable", f"final validation {r.final_val} below the SFT start {r.sft_val}"
        return r
    if any(not isinstance(x, float) or math.isnan(x) for x in tail) or \
            (start and sum(tail) / len(tail) < 0.5 * sum(start) / len(start)):  # type: ignore[arg-type]
        r.outcome, r.reason = "unstable", "collapsed in its last 10 steps"
        return r
    r.outcome, r.reason = "stable", f"validation {r.sft_val:.3f} -> {r.final_val:.3f}"
    return r


def _trainer_args(family: str, seed: int, run_dir: Path, steps: int) -> list[str]:
    from ppo_watchdog.protocol import hydra

    overrides, faults, _ = FAMILIES[family]
    args = [f"trainer.run_dir={run_dir}", f"trainer.total_training_steps={steps}", "trainer.test_freq=10",
            f"trainer.seed={seed}", "trainer.progress=false", *overrides]
    return args + ([hydra.format_override("trainer.faults", faults)] if faults else [])


def _run(cmd: list[str], timeout: float, log: Path, idle: float | None = None,
         watch: tuple[Path, ...] = ()) -> tuple[int | None, float]:
    """Run ``cmd`` to its end; kill it past ``timeout`` s, or once ``log`` and ``watch`` stayed
    unchanged for ``idle`` s (a hang is judged by silence, so a slow step on a loaded machine is not
    taken for one)."""
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def last_change() -> float:
        return max([t0, *(p.stat().st_mtime for p in (log, *watch) if p.exists())])

    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        code: int | None = None
        while True:
            try:
                code = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                now = time.time()
                if now - t0 > timeout or (idle is not None and now - last_change() > idle):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    code = None
                    break
    return code, time.time() - t0


def run_one(family: str, seed: int, watched: bool, work: Path, steps: int, plain_timeout: float) -> RunResult:
    base = work / family / f"seed{seed}" / ("watched" if watched else "plain")
    run_dir, state = base / "run", base / "state"
    if base.exists():
        import shutil

        shutil.rmtree(base)
    base.mkdir(parents=True)
    r = RunResult(family, seed, watched)
    if watched:
        sets = [x for a in _trainer_args(family, seed, run_dir, steps)
                if not a.startswith(("trainer.run_dir=", "trainer.faults=")) for x in ("--set", a)]
        faults = FAMILIES[family][1]
        cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--state-dir", str(state),
               "--no-report", "--on-escalate", "stop", "--tick", "0.5", "--heartbeat-min", "20", *sets,
               *(["--faults", faults] if faults else [])]
        code, r.wall_s = _run(cmd, timeout=1800, log=base / "watchdog.log")
        from ppo_watchdog.control.store import Store

        store = Store(state)
        run = store.get_run("run")
        r.phase = run.phase if run else "none"
        r.restarts = run.restarts if run else 0
        decisions = store.decisions("run")
        r.rollbacks = sum(1 for d in decisions for j in d["journal"] if j["kind"] == "rollback")
        r.decisions = [f"{d['step']}:{d['rule']}:{d['kind']}" for d in decisions if d["kind"] != "resolve"]
        store.close()
    else:
        cmd = [sys.executable, "-m", "ppo_watchdog.trainer", *_trainer_args(family, seed, run_dir, steps)]
        code, r.wall_s = _run(cmd, timeout=1800, log=base / "trainer.log", idle=plain_timeout,
                              watch=(run_dir / "metrics.jsonl",))
        r.phase = "exit " + ("killed: silent past the limit (hung)" if code is None else str(code))
    return classify(r, run_dir, steps)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def summarize(results: list[RunResult]) -> dict:
    out: dict = {"families": {}, "overall": {}}
    for name in [*FAMILIES, "overall"]:
        rows = results if name == "overall" else [r for r in results if r.family == name]
        if not rows:
            continue
        entry = {}
        for watched in (False, True):
            rs = [r for r in rows if r.watched == watched]
            k = sum(r.outcome == "stable" for r in rs)
            entry["watched" if watched else "plain"] = {
                "n": len(rs), "stable": k, "escalated": sum(r.outcome == "escalated" for r in rs),
                "rate": k / len(rs) if rs else None, "wilson95": wilson(k, len(rs)),
                "steps_trained": sum(r.steps_trained for r in rs), "wall_s": round(sum(r.wall_s for r in rs), 1),
            }
        if name == "overall":
            out["overall"] = entry
        else:
            out["families"][name] = {"what": FAMILIES[name][2], **entry}
    return out


def table(summary: dict) -> str:
    rows = ["| family | what | stable alone | stable with the watchdog | escalated | steps trained alone / with | "
            "wall alone / with |", "|---|---|---|---|---|---|---|"]

    def rate(e: dict) -> str:
        lo, hi = e["wilson95"]
        return f"{e['stable']}/{e['n']} ({100 * e['rate']:.0f}%, 95% CI {100 * lo:.0f}-{100 * hi:.0f}%)"

    for name, e in [*summary["families"].items(), ("**overall**", {"what": "", **summary["overall"]})]:
        p, w = e["plain"], e["watched"]
        rows.append(f"| {name} | {e['what']} | {rate(p)} | {rate(w)} | {w['escalated']} | "
                    f"{p['steps_trained']} / {w['steps_trained']} | {p['wall_s'] / 60:.1f} / {w['wall_s'] / 60:.1f} min |")
    return "\n".join(rows)


def plot(summary: dict, path: Path, title: str = "Hostile embedded-trainer runs", alone: str = "plain") -> None:
    """Stable rates per family, alone (the summary's ``alone`` key) and watched, with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*summary["families"], "overall"]
    entries = [*summary["families"].values(), summary["overall"]]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (key, colour, label) in enumerate(((alone, "#c44", "alone"), ("watched", "#2a7", "with the watchdog"))):
        xs = [j + (i - 0.5) * 0.38 for j in range(len(names))]
        rates = [100 * e[key]["rate"] for e in entries]
        lo = [100 * (e[key]["rate"] - e[key]["wilson95"][0]) for e in entries]
        hi = [100 * (e[key]["wilson95"][1] - e[key]["rate"]) for e in entries]
        ax.bar(xs, rates, width=0.38, color=colour, label=label, yerr=[lo, hi], capsize=3)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("stable runs (%) with Wilson 95% CI")
    ax.set_ylim(0, 105)
    ax.axhline(95, color="grey", lw=0.8, ls="--")
    ax.set_title(f"{title}: stable alone vs under `watchdog run` (default pack)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed per family")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--plain-timeout", type=float, default=90.0,
                    help="an unsupervised run silent this long (no log line, no metrics line) is hung and killed")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "stability")
    args = ap.parse_args()
    seeds = [1] if args.quick else list(range(1, args.seeds + 1))
    jobs = [(f, s, w) for f in args.families for s in seeds for w in (False, True)]
    t0 = time.time()
    results: list[RunResult] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futs = [pool.submit(run_one, f, s, w, args.work, args.steps, args.plain_timeout) for f, s, w in jobs]
        for fut in futs:
            r = fut.result()
            results.append(r)
            print(f"{r.family:18s} seed {r.seed} {'watched' if r.watched else 'alone  '}: {r.outcome:9s} "
                  f"{r.reason} ({r.wall_s:.0f} s, {r.steps_trained} steps)", flush=True)
    summary = summarize(results)
    stem = RESULTS / ("stability_quick" if args.quick else "stability")
    command = "python bench/stability.py" + (" --quick" if args.quick else "")
    doc = {**provenance("recovery of hostile runs, alone and watched", "stability.py", None),
           "command": command, "steps": args.steps, "seeds": seeds, "wall_s": round(time.time() - t0, 1),
           "summary": summary, "runs": [asdict(r) for r in results]}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"# `{command}`\n\n{provenance_line(doc, with_command=False)}\n\n{len(results)} runs of {args.steps} steps, seeds "
                                       f"{seeds}, {doc['wall_s'] / 60:.0f} min on 2 cores.\n\n{table(summary)}\n")
    plot(summary, stem.with_suffix(".png"))
    print(table(summary))


if __name__ == "__main__":
    main()
