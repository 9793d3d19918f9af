"""Training curves of the embedded trainer: the default config and two bad ones.

    .venv/bin/python bench/ppo_curve.py [--steps 100] [--out bench/results]

Runs ``python -m ppo_watchdog.trainer`` three times (fresh run directories under a temp dir):

- ``default``: the shipped defaults; validation accuracy should rise clearly above the
  SFT start and the KL mean to the reference should stay under 0.1 most of the time;
- ``drift``: ``algorithm.kl_ctrl.kl_coef=0.0001`` with 4x the actor lr: KL passes 0.1 at
  once, then the entropy bonus (``entropy_coeff`` 0.05), no longer held by the KL penalty,
  drives token entropy toward uniform and reward falls over the next tens of steps (the
  watchdog's KL rules have something to fix first);
- ``collapse``: 20x the actor lr: the policy collapses within a step or two (only a
  rollback helps).

Each finished run is then replayed through the default rule pack (``watchdog replay``) and
the steps each rule fires at are recorded. Writes ``ppo_curve.json`` (per-step series, a
summary and the rule fires per config), ``ppo_curve.png`` (default run) and
``ppo_bad_configs.png`` (all three) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_rules import provenance  # noqa: E402

from ppo_watchdog.protocol import rundir  # noqa: E402
from ppo_watchdog.trainer.config import Config  # noqa: E402

BASE_LR = Config().actor_rollout_ref.actor.optim.lr
CONFIGS: dict[str, list[str]] = {
    "default": [],
    "drift": ["algorithm.kl_ctrl.kl_coef=0.0001", f"actor_rollout_ref.actor.optim.lr={BASE_LR * 4:g}"],
    "collapse": [f"actor_rollout_ref.actor.optim.lr={BASE_LR * 20:g}"],
}
SERIES = {
    "score": "critic/score/mean",
    "kl": "actor/reward_kl_penalty",
    "kl_std": "actor/reward_kl_penalty_std",
    "entropy": "actor/entropy",
    "vf_loss": "critic/vf_loss",
    "step_time": "perf/time_per_step",
}
KL_THRESHOLD = 0.1
SCORE_WINDOW = 10


def rule_fires(run_dir: Path) -> dict[str, list[int]]:
    """Steps at which each rule of the default pack fires when the run is replayed."""
    proc = subprocess.run([sys.executable, "-m", "ppo_watchdog", "replay", "--json", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"watchdog replay {run_dir} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    fires: dict[str, list[int]] = {}
    for d in json.loads(proc.stdout):
        if d["kind"] == "fire":
            fires.setdefault(d["rule"], []).append(int(d["step"]))
    return fires


def reward_fall(score: list[float], val: list[tuple[int, float]], sft: float | None) -> dict[str, Any]:
    """Where the reward peaks and falls: running-mean train score and validation accuracy."""
    means = [sum(score[max(0, i - SCORE_WINDOW + 1):i + 1]) / len(score[max(0, i - SCORE_WINDOW + 1):i + 1])
             for i in range(len(score))]
    out: dict[str, Any] = {}
    if means:
        peak = max(range(len(means)), key=lambda i: means[i])
        out.update(score_mean10_peak=means[peak], score_mean10_peak_step=peak + 1,
                   score_mean10_after_peak_min=min(means[peak:]), score_mean10_last=means[-1])
    if val:
        best = max(range(len(val)), key=lambda i: val[i][1])
        below = [s for s, v in val[best:] if sft is not None and v < sft]
        out.update(val_best_step=val[best][0], val_min_after_best=min(v for _, v in val[best:]),
                   first_val_step_below_sft_after_best=below[0] if below else None)
    return out


def run(name: str, overrides: list[str], steps: int, root: Path) -> dict[str, Any]:
    """One trainer run; returns its per-step series and summary."""
    run_dir = root / name
    cmd = [sys.executable, "-m", "ppo_watchdog.trainer", f"trainer.run_dir={run_dir}", "trainer.resume_mode=disable",
           f"trainer.total_training_steps={steps}", "trainer.test_freq=5", "trainer.save_epoch_freq=0",
           "trainer.progress=false", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TRAINER_LOG_LEVEL": "WARNING"})
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: trainer exited {proc.returncode}\n{proc.stderr[-3000:]}")
    records = {r["step"]: r["data"] for r in rundir.read_jsonl(run_dir / rundir.METRICS).records}
    series: dict[str, list[float | None]] = {k: [] for k in SERIES}
    val: list[tuple[int, float]] = []
    for step in sorted(records):
        data = records[step]
        vals = [v for k, v in data.items() if k.startswith("val-core/")]
        if vals:
            val.append((step, sum(vals) / len(vals)))
        if step == 0:
            continue
        for short, key in SERIES.items():
            series[short].append(data.get(key))
    kl = [x for x in series["kl"] if x is not None]
    over = [i + 1 for i, x in enumerate(kl) if x > KL_THRESHOLD]
    score = [x for x in series["score"] if x is not None]
    head = sum(score[:10]) / max(len(score[:10]), 1)
    tail = sum(score[-10:]) / max(len(score[-10:]), 1)
    started = [e for e in rundir.iter_events(run_dir, ["started"])]
    summary = {
        "overrides": overrides,
        "steps": len(kl),
        "wall_seconds": round(wall, 1),
        "sft_val_acc": (started[0].get("sft") or {}).get("val_acc") if started else None,
        "val_first": val[0][1] if val else None,
        "val_last": val[-1][1] if val else None,
        "val_best": max(v for _, v in val) if val else None,
        "kl_mean_median": sorted(kl)[len(kl) // 2] if kl else None,
        "kl_max": max(kl) if kl else None,
        "fraction_steps_kl_over_0.1": len(over) / max(len(kl), 1),
        "first_step_kl_over_0.1": over[0] if over else None,
        "score_first10_mean": head,
        "score_last10_mean": tail,
        "entropy_first": series["entropy"][0] if series["entropy"] else None,
        "entropy_last": series["entropy"][-1] if series["entropy"] else None,
        "median_step_seconds": sorted(x for x in series["step_time"] if x is not None)[len(kl) // 2] if kl else None,
    }
    summary.update(reward_fall(score, val, summary["sft_val_acc"]))
    summary["rule_fires"] = rule_fires(run_dir)
    return {"summary": summary, "series": series, "val": val}


def plot(results: dict[str, Any], out: Path) -> None:
    """ppo_curve.png (default) and ppo_bad_configs.png (all three)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = results["default"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = list(range(1, len(d["series"]["score"]) + 1))
    axes[0].plot(steps, d["series"]["score"], label="train score (sampled)")
    axes[0].plot([s for s, _ in d["val"]], [v for _, v in d["val"]], "o-", label="validation accuracy (greedy)")
    axes[0].set_title("default: reward")
    axes[0].legend()
    axes[1].plot(steps, d["series"]["kl"], label="KL mean")
    axes[1].plot(steps, d["series"]["kl_std"], label="KL std (of the mean, last 10 steps)", alpha=0.6)
    axes[1].axhline(0.02, color="orange", ls=":", label="0.02 (std target)")
    axes[1].axhline(KL_THRESHOLD, color="r", ls="--", label="0.1")
    axes[1].set_title("default: KL to reference")
    axes[1].legend()
    axes[2].plot(steps, d["series"]["vf_loss"])
    axes[2].set_title("default: value loss")
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "ppo_curve.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for name, r in results.items():
        steps = list(range(1, len(r["series"]["kl"]) + 1))
        axes[0].plot(steps, r["series"]["kl"], label=name)
        axes[1].plot(steps, r["series"]["score"], label=name)
        axes[2].plot([s for s, _ in r["val"]], [v for _, v in r["val"]], "o-", label=name)
        axes[3].plot(steps, r["series"]["entropy"], label=name)
    axes[0].axhline(KL_THRESHOLD, color="r", ls="--")
    axes[0].set_yscale("symlog", linthresh=0.01)
    axes[0].set_ylim(bottom=0)
    axes[0].set_title("KL mean to reference")
    axes[1].set_title("train score")
    axes[2].set_title("validation accuracy")
    axes[3].set_title("token entropy (nats)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ppo_bad_configs.png", dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--only", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="ppo-curve-") as tmp:
        for name in args.only:
            results[name] = run(name, CONFIGS[name], args.steps, Path(tmp))
            sys.stdout.write(f"{name}: {json.dumps(results[name]['summary'])}\n")
            sys.stdout.flush()
    doc = {**provenance("training curves of the embedded trainer, default and bad configs", "ppo_curve.py", None),
           "command": "python bench/ppo_curve.py " + " ".join(sys.argv[1:]), "kl_threshold": KL_THRESHOLD,
           "results": results}
    (args.out / "ppo_curve.json").write_text(json.dumps(doc, indent=1) + "\n")
    if "default" in results:
        plot(results, args.out)


if __name__ == "__main__":
    main()
