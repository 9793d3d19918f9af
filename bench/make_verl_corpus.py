"""A labelled corpus from the REAL verl trainer: plain ``python -m verl.trainer.main_ppo`` runs on CPU.

    .venv/bin/python bench/make_verl_corpus.py --lock /work/verl.lock          # all runs, ~35 min
    .venv/bin/python bench/make_verl_corpus.py --lock /work/verl.lock --only lr_100x_grpo_seed3

Each run is unmodified verl 0.9.1 on CPU (:mod:`ppo_watchdog.trainer.verl_cpu`: the plugin, its overrides, the
tiny local assets), NOT under the watchdog: what a user's run looks like. Every run is kept in
both of verl's own formats, written by verl itself:

- ``<name>.console.log``: its stdout (``trainer.logger=[console,file]``: verl's console logger
  prints one ``step:N - key:value ...`` line a step among everything else verl prints);
- ``<name>.filelogger.jsonl``: its FileLogger output (``VERL_FILE_LOGGER_PATH``), one
  ``{"step": N, "data": {...}}`` line a step.

``manifest.json`` records each run's overrides, fault injection, exit code and wall time. The
labels (``labels.yaml``) are written by hand from the numbers of the logs, never from a pack.

Seeds: run ``seed`` S builds its own assets with seed S (the model's initial weights, its
supervised warm start and the data), shuffles the data with ``data.seed=S`` and samples with ``rollout.seed=S`` (the ``hf``
rollout seeds torch with it, one request at a time), so a re-run draws the same prompts and, up to
float non-associativity across processes, the same answers.

Failures come from settings a user could get wrong, and from the plugin's named fault injection
(``VERL_CPU_INJECT_*``: a NaN actor loss; aborted rollouts, which verl logs as
``response/aborted_ratio``). ``--lock FILE`` wraps every verl start in ``flock FILE`` (one verl run
on the machine at a time).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ppo_watchdog.trainer.verl_cpu import assets, overrides  # noqa: E402

OUT = ROOT / "bench" / "corpus_verl"
STEPS, SAVE_FREQ, TEST_FREQ = 30, 10, 5
#: The model starts warm (as an RL run starts from an SFT model): 300 supervised steps on the task's
#: chat-formatted answers give answers of ~7 tokens that end, right about a third of the time
#: (sampled), so the score has room to rise and to fall, and entropy and truncation mean something.
SFT_STEPS = 300


@dataclass(frozen=True)
class Run:
    """One verl run of the corpus."""

    name: str
    algo: str  # "grpo" (group baseline, KL loss to the reference) or "ppo" (GAE, critic, KL in the reward)
    seed: int
    why: str
    settings: tuple[str, ...] = ()
    inject: dict[str, str] = field(default_factory=dict)
    lr: float = 3e-4
    response_length: int = 16


RUNS: tuple[Run, ...] = (
    Run("kl_runaway_lr_1e-3_grpo_seed1", "grpo", 1,
        "GRPO at lr 1e-3 (3.3x the healthy runs'), KL loss 0.01: too weak an anchor at this lr", lr=1e-3),
    Run("healthy_grpo_seed2", "grpo", 2, "GRPO, lr 3e-4, KL loss 0.01 to the reference"),
    Run("healthy_grpo_seed8", "grpo", 8, "GRPO, lr 3e-4, another seed"),
    Run("healthy_grpo_no_kl_seed9", "grpo", 9, "GRPO with no KL term at all (use_kl_loss False: no reference, "
        "as DAPO-style runs have), lr 3e-4", settings=("actor_rollout_ref.actor.use_kl_loss=False",)),
    Run("healthy_ppo_seed1", "ppo", 1, "PPO with GAE and a critic, KL in the reward (fixed 0.01), lr 1e-3", lr=1e-3),
    Run("healthy_ppo_seed2", "ppo", 2, "PPO with a critic, lr 3e-4, another seed"),
    Run("lr_1e-1_grpo_seed3", "grpo", 3, "lr far too high: 1e-1 (the healthy runs': 3e-4 to 1e-3)", lr=1e-1),
    Run("no_kl_lr_10x_ppo_seed3", "ppo", 3,
        "KL anchor removed (no KL in the reward, no reference) on a run that needs it: lr 1e-2",
        settings=("algorithm.use_kl_in_reward=False",), lr=1e-2),
    Run("entropy_bonus_no_kl_grpo_seed4", "grpo", 4,
        "an entropy bonus (entropy_coeff 1.0) with no KL anchor (use_kl_loss False), lr 1e-3",
        settings=("actor_rollout_ref.actor.entropy_coeff=1.0", "actor_rollout_ref.actor.use_kl_loss=False"), lr=1e-3),
    Run("nan_at_15_grpo_seed5", "grpo", 5, "injected: the actor's loss is NaN once, at step 15",
        inject={"VERL_CPU_INJECT_NAN": "15"}),
    Run("aborted_rollouts_from_15_grpo_seed6", "grpo", 6,
        "injected: from step 15 on, 60% of rollout requests come back aborted (no tokens)",
        inject={"VERL_CPU_INJECT_ROLLOUT_ABORT": "15:0.6"}),
    Run("truncated_resp4_grpo_seed7", "grpo", 7,
        "answers truncated: data.max_response_length=4, under the ~7 tokens of an answer (the healthy runs' is 16)",
        response_length=4),
)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with every key that ``extra`` sets replaced by ``extra``'s value (Hydra wants one)."""
    keys = {_key(o) for o in extra}
    return [o for o in base if _key(o) not in keys] + extra


def run_overrides(run: Run, a: assets.Assets, work: Path, steps: int = STEPS, save_freq: int = SAVE_FREQ,
                  test_freq: int = TEST_FREQ) -> list[str]:
    """The Hydra overrides of one corpus run (``bench/verl_stability.py`` runs the same with its own lengths)."""
    grpo = run.algo == "grpo"
    batch = 4 if grpo else 8  # GRPO: 4 prompts x 4 answers; PPO: 8 prompts x 1 answer (16 / 8 sequences)
    base = overrides.ppo_overrides(a, steps=steps, save_freq=save_freq, batch=batch, mini_batch=batch,
                                   micro_batch=4, response_length=run.response_length, lr=run.lr,
                                   kl_coef=0.01, test_freq=test_freq)
    algo = ([
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.rollout.n=4",
    ] if grpo else [])
    common = [
        "data.shuffle=True",
        f"data.seed={run.seed}",
        f"actor_rollout_ref.rollout.seed={run.seed}",
        "data.val_batch_size=16",
        "trainer.val_before_train=True",
        "trainer.logger=[console,file]",
        f"trainer.experiment_name={run.name}",
        f"trainer.default_local_dir={work / 'checkpoints'}",
        f"hydra.run.dir={work / 'hydra'}",
    ]
    return merge(merge(base, algo), [*common, *run.settings])


def generate(run: Run, out: Path, scratch: Path, python: str, lock: str | None, timeout: float) -> dict:
    """Run verl once; write its console log and FileLogger JSONL under ``out``; return its manifest entry."""
    work = scratch / run.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    a = assets.build(scratch / "assets" / f"seed{run.seed}_sft{SFT_STEPS}", seed=run.seed, sft_steps=SFT_STEPS)
    ovr = run_overrides(run, a, work)
    jsonl = out / f"{run.name}.filelogger.jsonl"
    console = out / f"{run.name}.console.log"
    jsonl.unlink(missing_ok=True)
    inject = dict(run.inject)
    if inject:
        inject["VERL_CPU_INJECT_DIR"] = str(work / "injected")
    env = overrides.verl_env(inject={**inject, "VERL_FILE_LOGGER_PATH": str(jsonl)})
    cmd = overrides.verl_command(python, ovr)
    if lock:
        cmd = ["flock", lock, *cmd]
    t0 = time.time()
    with console.open("w") as so, (work / "stderr.log").open("w") as se:
        try:
            rc = subprocess.run(cmd, stdout=so, stderr=se, env=env, cwd=work, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    steps = sum(1 for line in jsonl.read_text().splitlines() if line.strip()) if jsonl.exists() else 0
    return {"name": run.name, "algorithm": run.algo, "seed": run.seed, "why": run.why, "inject": run.inject,
            "lr": run.lr, "max_response_length": run.response_length, "settings": list(run.settings),
            "exit": rc, "wall_s": round(time.time() - t0, 1), "filelogger_lines": steps,
            "command": "python -m verl.trainer.main_ppo " + " ".join(
                o for o in ovr if not o.startswith(("hydra.run.dir", "trainer.default_local_dir")))}


def main(argv: list[str] | None = None) -> int:
    """Generate the corpus (or the runs named by --only); exit 1 when a run did not finish cleanly."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--scratch", default="/tmp/verl_corpus", help="assets, checkpoints, verl's stderr")
    p.add_argument("--lock", default=None, help="flock this file around every verl run")
    p.add_argument("--only", action="append", default=None, help="a run's name (repeatable)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    ns = p.parse_args(argv)
    names = {r.name for r in RUNS}
    unknown = sorted(set(ns.only or []) - names)
    if unknown:
        sys.stderr.write(f"make_verl_corpus: unknown run(s) {unknown}; known: {sorted(names)}\n")
        return 2
    out, scratch = Path(ns.out), Path(ns.scratch)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    bad = 0
    for run in RUNS:
        if ns.only and run.name not in ns.only:
            continue
        entry = generate(run, out, scratch, sys.executable, ns.lock, ns.timeout)
        # Read again just before writing: another generator may have recorded its runs meanwhile.
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"runs": {}}
        manifest["runs"][run.name] = entry
        manifest["verl"] = _verl_version()
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        bad += entry["exit"] != 0
        print(f"{run.name}: exit {entry['exit']}, {entry['filelogger_lines']} steps, {entry['wall_s']} s", flush=True)
    return 1 if bad else 0


def _verl_version() -> str:
    from importlib.metadata import version

    return version("verl")


if __name__ == "__main__":
    raise SystemExit(main())
