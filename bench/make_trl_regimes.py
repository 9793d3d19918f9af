"""Unsupervised TRL GRPO runs of the regimes a default pack must judge, for ``bench/corpus_trl_regimes/``.

    .venv/bin/python bench/make_trl_regimes.py                 # every regime, ~60 min on 2 cores
    .venv/bin/python bench/make_trl_regimes.py --only log10_beta0_seed3

Each regime is a run of the glue (``python -m ppo_watchdog.trainer.trl_glue``) on its tiny local Qwen2
and the ``a+b=`` task, alone (no watchdog), whose metrics and events are copied to
``bench/corpus_trl_regimes/<name>/``. The regimes are the ones healthy runs of other people have and
the repo's first corpora lacked: GRPO with no KL term (TRL's default ``beta`` 0) and groups of 4 on a
verifiable 0/1 reward (a group all right or all wrong has zero advantage: zero loss and gradient on
many steps), TRL's sparse logging (``logging_steps`` 5 and 10: a record is the mean of the steps
since the last one, ``grad_norm`` included), one prompt a step (the score of a step is the mean of 4
answers), a LoRA adapter, runs of 300 steps, and the same failure (lr 100x) at each cadence. Labels in
``bench/corpus_trl_regimes/labels.yaml`` are written by hand from the numbers, never from a pack.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "bench" / "corpus_trl_regimes"
sys.path.insert(0, str(ROOT / "bench"))
from trl_stability import run_to_end  # noqa: E402

#: name -> overrides of the glue (beyond the model, the seed and the run length). lr 1e-4 is the
#: glue's healthy rate on this model (bench/trl_stability.py), 1e-2 its 100x failure.
EXACT_BETA0 = ["trainer.reward=exact", "actor_rollout_ref.actor.kl_loss_coef=0", "actor_rollout_ref.actor.optim.lr=0.0001"]
REGIMES: dict[str, tuple[int, int, list[str]]] = {
    # name: (seed, steps, overrides)
    "beta0_exact_seed1": (1, 300, [*EXACT_BETA0, "trainer.save_freq=50"]),
    "log5_beta0_seed2": (2, 300, [*EXACT_BETA0, "trl.logging_steps=5", "trainer.save_freq=50"]),
    "log10_beta0_seed3": (3, 300, [*EXACT_BETA0, "trl.logging_steps=10", "trainer.save_freq=50"]),
    "one_prompt_seed4": (4, 300, ["data.train_batch_size=1", "actor_rollout_ref.actor.optim.lr=0.0001",
                                  "trainer.save_freq=50"]),
    "log10_kl_seed5": (5, 400, ["actor_rollout_ref.actor.optim.lr=0.0001", "trl.logging_steps=10",
                                "trainer.save_freq=50"]),
    "rloo_seed6": (6, 300, ["trainer.algorithm=rloo", "actor_rollout_ref.actor.optim.lr=0.0001",
                            "trainer.save_freq=50"]),
    "lr_3x_seed7": (7, 200, ["actor_rollout_ref.actor.optim.lr=0.0003", "trainer.save_freq=25"]),
    "lr_10x_seed8": (8, 200, ["actor_rollout_ref.actor.optim.lr=0.001", "trainer.save_freq=25"]),
    "lr_10x_log5_seed9": (9, 200, ["actor_rollout_ref.actor.optim.lr=0.001", "trl.logging_steps=5",
                                   "trainer.save_freq=25"]),
    # LoRA (peft, rank 8, alpha 16, every linear layer) at 10x the full model's lr, the usual LoRA ratio.
    "lora_seed10": (10, 300, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                              "actor_rollout_ref.actor.optim.lr=0.001", "trainer.save_freq=50"]),
    "lora_lr_high_seed11": (11, 100, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                                      "actor_rollout_ref.actor.optim.lr=0.1", "trainer.save_freq=10"]),
    "log5_lr_high_seed1": (1, 60, [*EXACT_BETA0, "actor_rollout_ref.actor.optim.lr=0.01", "trl.logging_steps=5",
                                   "trainer.save_freq=10"]),
    "log10_lr_high_seed2": (2, 80, [*EXACT_BETA0, "actor_rollout_ref.actor.optim.lr=0.01", "trl.logging_steps=10",
                                    "trainer.save_freq=10"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "trl_regimes")
    ap.add_argument("--timeout", type=float, default=3600.0, help="wall limit of one run")
    args = ap.parse_args()
    from ppo_watchdog.trainer.trl_glue import assets

    model = assets.build(args.work / "model")
    for name in args.only:
        seed, steps, overrides = REGIMES[name]
        run_dir = args.work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cmd = [sys.executable, "-m", "ppo_watchdog.trainer.trl_glue", "--run-dir", str(run_dir),
               f"actor_rollout_ref.model.path={model}", f"trainer.total_training_steps={steps}",
               f"trainer.seed={seed}", *overrides]
        code, wall = run_to_end(cmd, args.timeout, args.work / f"{name}.log")
        print(f"{name}: exit {code} in {wall / 60:.1f} min", flush=True)
        dst = CORPUS / name
        dst.mkdir(parents=True, exist_ok=True)
        for part in ("metrics.jsonl", "events.jsonl"):
            if (run_dir / part).exists():
                shutil.copyfile(run_dir / part, dst / part)
        subprocess.run(["du", "-sh", str(dst)], check=False)


if __name__ == "__main__":
    main()
