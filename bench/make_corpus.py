"""Write the embedded trainer's own labelled corpus (bench/corpus/): healthy and hostile runs.

    .venv/bin/python bench/make_corpus.py            # ~4 min on 2 cores (two runs at a time)
    .venv/bin/watchdog eval bench/corpus/labels.yaml --mode embedded

Each run is ``python -m ppo_watchdog.trainer`` (80 steps, unsupervised) with one config or injected fault;
its run directory keeps ``metrics.jsonl`` (catalog keys only, to stay small) and
``events.jsonl``. The labels follow the verl corpus's schema; onsets are where the numbers
show the damage (an injected fault's step, or, for a config hostile from the start, the first
step whose KL, score or entropy leaves the default runs' range), each written next to the
run with its reason, so the labels are judged from the run, not from the rules.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "corpus"
STEPS = 80

#: name -> (overrides, label fields). Onsets are where the injected fault or hostile config shows in
#: the numbers (read off the written runs: see NOTES).
RUNS: dict[str, tuple[list[str], dict[str, object]]] = {
    "default_seed1": ([], {"verdict": "healthy"}),
    "default_seed2": (["trainer.seed=2"], {"verdict": "healthy"}),
    "default_seed3": (["trainer.seed=3"], {"verdict": "healthy"}),
    "small_batch_seed4": (["trainer.seed=4", "data.train_batch_size=32",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=32", "critic.ppo_mini_batch_size=32",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
                           "critic.ppo_micro_batch_size_per_gpu=32"], {"verdict": "healthy"}),
    "lr_spike_x30_at_40": (["trainer.faults=lr_spike@40:x30"],
                           {"verdict": "failure", "onset": 40, "deadline": 45, "expect": "rollback"}),
    "nan_at_25": (["trainer.faults=nan@25"],
                  {"verdict": "failure", "onset": 25, "deadline": 26, "expect": "rollback"}),
    "lr_20x_collapse": (["actor_rollout_ref.actor.optim.lr=0.004"],
                        {"verdict": "failure", "onset": 2, "deadline": 6, "expect": "rollback"}),
    "kl_collapse_lr_3x": (["algorithm.kl_ctrl.kl_coef=0.00001", "actor_rollout_ref.actor.optim.lr=0.0006"],
                          {"verdict": "failure", "onset": 3, "deadline": 10, "expect": "rollback"}),
    # Issue 21: dead after living. Onset 2: the score is 0 for every response and KL 6.9 from step 2;
    # deadline 8: a human watching would have stopped it within a few steps of that (the old pack
    # only alerted, at step 11).
    "lr_50x_dead_seed5": (["actor_rollout_ref.actor.optim.lr=0.01", "trainer.seed=5"],
                          {"verdict": "failure", "onset": 2, "deadline": 8, "expect": "rollback"}),
}
NOTES = {
    "default_seed1": ("the embedded trainer's default config (lr 2e-4, kl_coef 0.1, entropy_coeff 0.05): "
                      "validation 0.18 -> 0.30"),
    "default_seed2": "default config, another seed: validation 0.21 -> 0.44",
    "default_seed3": "default config, another seed: validation 0.35 -> 0.59",
    "small_batch_seed4": "default config with 32 prompts a step (a noisy score): validation 0.23 -> 0.41",
    "lr_spike_x30_at_40": "lr x30 from step 40 (injected): KL 0.03 -> 4.2 at step 41, score 0, validation 0",
    "nan_at_25": "a non-finite loss at step 25 (injected): the trainer skips the update and writes a nan event",
    "lr_20x_collapse": "lr 4e-3 (20x) from the start: KL 2.9 at step 2, the score 0 from step 2, validation 0",
    "kl_collapse_lr_3x": ("kl_coef 1e-5 and lr 3x: no KL anchor, KL ~1 by step 3, entropy 0.36 -> 3.3 by step 30 "
                          "(near uniform), train score 0.11 -> 0.04; greedy validation stays near its SFT start"),
    "lr_50x_dead_seed5": ("lr 1e-2 (50x) from the start: learning at step 1 (score 0.17, validation 0.26 at step 0), "
                          "then one score 0 for every response, KL ~7-10, answers of 1 token from step 8, validation 0"),
}


def run(name: str, overrides: list[str], work: Path) -> Path:
    rd = work / name
    cmd = [sys.executable, "-m", "ppo_watchdog.trainer", f"trainer.run_dir={rd}", f"trainer.total_training_steps={STEPS}",
           "trainer.progress=false", "trainer.test_freq=10", *overrides]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900, cwd=ROOT)
    return rd


def keep(rd: Path, dest: Path) -> None:
    """Copy a run's metrics (catalog keys only) and events into the corpus."""
    sys.path.insert(0, str(ROOT))
    from ppo_watchdog.protocol import catalog

    dest.mkdir(parents=True, exist_ok=True)
    with (rd / "metrics.jsonl").open() as src, (dest / "metrics.jsonl").open("w") as out:
        for line in src:
            rec = json.loads(line)
            rec["data"] = {k: v for k, v in rec["data"].items() if catalog.canonical_key(k)}
            out.write(json.dumps(rec) + "\n")
    events = rd / "events.jsonl"
    (dest / "events.jsonl").write_text(events.read_text() if events.exists() else "")


def write_labels() -> None:
    lines = ["# The embedded trainer's own labelled runs (bench/make_corpus.py), in the schema of",
             "# ../shared/testdata/verl-logs/labels.yaml. 80 steps each, unsupervised.", "version: 1", "logs:"]
    for name, (overrides, label) in RUNS.items():
        lines.append(f"  - file: {name}")
        for k, v in label.items():
            lines.append(f"    {k}: {v}")
        lines.append(f"    notes: \"{NOTES[name]}; overrides: {' '.join(overrides) or 'none'}\"")
    (OUT / "labels.yaml").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "corpus")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    with ThreadPoolExecutor(args.jobs) as pool:
        done = {name: pool.submit(run, name, ov, args.work) for name, (ov, _) in RUNS.items()}
        for name, fut in done.items():
            keep(fut.result(), OUT / name)
            print(f"{name}: written", flush=True)
    write_labels()
    print(f"labels: {OUT / 'labels.yaml'}")


if __name__ == "__main__":
    main()
