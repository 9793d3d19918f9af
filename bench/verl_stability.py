"""Stability of hostile runs of real verl, with and without the watchdog (the default pack).

    .venv/bin/python bench/verl_stability.py               # 6 families x 3 seeds, alone and watched: ~1.5-2 h on 2 cores
    .venv/bin/python bench/verl_stability.py --seeds 1     # one seed per family, ~30-40 min
    .venv/bin/python bench/verl_stability.py --resume      # keep the runs already judged under --work, run the rest
    .venv/bin/python bench/verl_stability.py --watched-only  # after a pack change: only the watched runs, ~1 h

Each run is verl 0.9.1's own ``python -m verl.trainer.main_ppo`` on CPU through :mod:`ppo_watchdog.trainer.verl_cpu`
(the plugin, its tiny Qwen2 warm-started on ``a+b=?`` for 300 supervised steps so that about 60% of its greedy
answers are right), GRPO with 4 prompts x 4 answers a step, the layout of bench/make_verl_corpus.py's runs at
:data:`STEPS` steps with a checkpoint every :data:`SAVE_FREQ`, rewarded by verl's own gsm8k scorer (1 when the
number after the answer's last ``#### `` is the sum, else 0: the task itself, not the plugin's dense reward, which
pays for digits and so for a policy collapsed into printing them). Every (family, seed) runs twice with the same
seed: once alone, once under
``watchdog run --mode verl --on-escalate stop -- python -m verl.trainer.main_ppo ...`` (no human at the keyboard).
One verl run at a time (a verl run is ~20 processes and ~5.7 GB here).

Outcome of a run, as bench/stability.py and bench/trl_stability.py judge:

- stable: it trained to its last step, and the greedy accuracy of its final weights on all 100 ``a+b=?`` prompts
  (verl's own validation at the last step, scored by the same gsm8k scorer, read from the answers verl dumps to
  ``trainer.validation_data_dir``) is at least the start's less :data:`TOLERANCE`;
- escalated: the watchdog stopped it for a human;
- unstable: anything else (below the start, crashed, past the time limit).

Results: ``bench/results/verl_stability.{json,md,png}``, in bench/results/trl_stability.json's shape
(``summary.families.<name>.alone|watched`` with ``n``, ``stable``, ``rollbacks``). Each run's verdict is also kept
beside it (``--work``/FAMILY/seedS/alone|watched/result.json), so ``--resume`` continues an interrupted bench.
A run alone involves no watchdog, so ``--watched-only`` takes the alone runs from the committed results (the page
says from which commit and date) and runs only the watched ones: what a change to the pack or the controller moves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_rules import provenance, provenance_line  # noqa: E402
from make_verl_corpus import SFT_STEPS, Run, merge, run_overrides  # noqa: E402
from stability import plot  # noqa: E402
from trl_stability import RunResult, explained, per_run, read_watched, run_to_end, summarize, table  # noqa: E402

from ppo_watchdog.trainer.verl_cpu import assets, overrides  # noqa: E402

STEPS, SAVE_FREQ = 20, 4
#: How far below the start's greedy accuracy (100 prompts) a final one may land and still count as stable: a tenth.
#: The control's own noise sets it: identical healthy runs of seed 1 (same config, same seed) ended at 0.70, 0.64 and
#: 0.57 from a start of 0.63 (verl's CPU reductions are not deterministic across its processes), while a collapsed
#: policy loses most of its answers (0.63 -> 0.00 under the lr spike alone). bench/trl_stability.py's 0.05 would call
#: one healthy run in three unstable here.
TOLERANCE = 0.1
#: The step the mid-run faults strike: after the good checkpoints of steps 4 and 8.
FAULT_STEP = 10
#: The control's lr. At 3e-4 (bench/corpus_verl's healthy runs) this 27k-parameter model's greedy accuracy drifts
#: down (0.63 -> 0.46 and 0.42 in two runs of seed 1: with 16 samples a step the sampled score stays flat at ~0.3,
#: so the steps are noise, not learning); at 1e-4 it rises (0.63 -> 0.70).
HEALTHY_LR = 1e-4


@dataclass(frozen=True)
class Family:
    """A way to run verl: its lr, its extra overrides, its injected fault, and what it is in words."""

    what: str
    lr: float = HEALTHY_LR
    settings: tuple[str, ...] = ()
    inject: dict[str, str] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "healthy": Family("GRPO, lr 1e-4, KL loss 0.01 to the reference (the control)"),
    "lr_high": Family("lr 1e-1 from the start (1000x)", lr=1e-1),
    "no_kl_lr_high": Family("no KL anchor (use_kl_loss false) and lr 1e-2 (100x)", lr=1e-2,
                            settings=("actor_rollout_ref.actor.use_kl_loss=False",)),
    "lr_spike": Family(f"injected: the lr x100 from step {FAULT_STEP} (1e-2), after good checkpoints",
                       inject={"VERL_CPU_INJECT_LR_SPIKE": f"{FAULT_STEP}:100"}),
    "entropy_bonus": Family("an entropy bonus (entropy_coeff 1.0) with no KL anchor, lr 1e-3 (10x)", lr=1e-3,
                            settings=("actor_rollout_ref.actor.entropy_coeff=1.0",
                                      "actor_rollout_ref.actor.use_kl_loss=False")),
    "nan": Family(f"injected: the actor's loss is NaN once, at step {FAULT_STEP}",
                  inject={"VERL_CPU_INJECT_NAN": str(FAULT_STEP)}),
}


#: Why a family ends below all-stable with the watchdog, from its runs' decisions and numbers (the results page says it).
EXPLAINED: dict[str, str] = {
    "lr_high": (
        "every rewind goes to the initial weights (the trouble comes at steps 3-4, before the first checkpoint), and "
        "the last relaunch lives at 6x the control's lr with its sampled score at the control's level, while the "
        "greedy accuracy falls. Seeds 2 and 3: kl_explosion at step 3, then kl_leap, then dead_after_learning at step "
        "10 of the relaunch, the lr 0.1 -> 0.05 -> 5e-3 -> 6.25e-4; the last 20 steps scored 0.17 and 0.27 a batch "
        "(the healthy control 0.27) and ended at 0.25 from 0.47 and 0.37 from 0.48. Seed 1 took a fourth rewind to "
        "7.8e-5 and ended at 0.65 from 0.63. No rule sees greedy accuracy: the runs validate only at their end."),
    "no_kl_lr_high": (
        "no KL anchor: the relaunches from the initial weights drift with nothing to pull them back. Seed 3's "
        "relaunch at 5e-3 died at once (every batch but a few scored 0 for 20 steps): dead_run told a person at step "
        "11 and nothing rolled it back, since the pack rolls a dead run back only after it has seen it learn on that "
        "timeline; it ended at 0.00. Seeds 1 and 2 ended their last relaunch (1.6e-4 and 1.25e-3) with the sampled "
        "score at the control's level (0.25 and 0.19 a batch) and the greedy accuracy at 0.47 from 0.63 and 0.21 "
        "from 0.47. Seed 2's second rewind went to the start, not to the relaunch's checkpoint of step 8, by the "
        "doubling backoff (a recurrence within the rule's progress). The committed runs of the code before the "
        "backoff (22602cb) were 3/3 here, their rewinds to checkpoints inside the relaunches."),
    "lr_spike": (
        "seed 3 took the same decision as in every earlier run of this bench (kl_explosion at step 12, back to the "
        "checkpoint of step 8, lr halved) and ended at 0.35 from 0.48, where earlier runs with that decision ended at "
        "0.47; this seed's healthy run ended at 0.42 here (0.54 and 0.45 before): verl on CPU is not reproducible "
        "run to run, and this seed sits at the tolerance's edge with or without the fault."),
}


def accuracy(dump: Path) -> float | None:
    """Mean score of verl's validation answers in ``dump`` (one JSON line per prompt, scored by verl's gsm8k scorer:
    1 right, 0 not), or None when there is no such dump."""
    if not dump.is_file():
        return None
    scores = [float(json.loads(line)["score"]) for line in dump.read_text().splitlines() if line.strip()]
    return sum(scores) / len(scores) if scores else None


def last_step(path: Path) -> int | None:
    """The newest step of a FileLogger or timeline file (``{"step": N, ...}`` lines), or None."""
    from ppo_watchdog.protocol import rundir

    if not path.is_file():
        return None
    return max((int(r["step"]) for r in rundir.read_jsonl(path).records), default=None)


def classify(r: RunResult, run_dir: Path, timeline: Path) -> RunResult:
    """Judge a finished (or killed) run by its timeline and verl's validation dumps at step 0 and the last step."""
    from ppo_watchdog.protocol import rundir

    r.steps_trained = len(rundir.read_jsonl(timeline).records) if timeline.is_file() else 0
    r.last_step = last_step(timeline)
    r.start_acc = accuracy(run_dir / "val" / "0.jsonl")
    if r.watched and r.phase in ("stopped", "failed"):
        r.outcome, r.reason = "escalated", f"watchdog {r.phase}"
        return r
    r.final_acc = accuracy(run_dir / "val" / f"{STEPS}.jsonl")
    if r.last_step != STEPS or r.final_acc is None or r.start_acc is None:
        r.outcome, r.reason = "unstable", f"did not finish (last step {r.last_step}, {r.phase})"
        return r
    return judge(r)


def judge(r: RunResult) -> RunResult:
    """A finished run's outcome by its accuracies and :data:`TOLERANCE` (escalated and unfinished runs keep theirs):
    runs judged earlier, by ``--resume`` or ``--render``, are judged again by today's rule."""
    if r.outcome == "escalated" or r.last_step != STEPS or r.final_acc is None or r.start_acc is None:
        return r
    r.outcome = "stable" if r.final_acc >= r.start_acc - TOLERANCE else "unstable"
    r.reason = f"greedy accuracy {r.start_acc:.2f} -> {r.final_acc:.2f}"
    return r


def run_one(name: str, seed: int, watched: bool, work: Path, timeout: float, resume: bool) -> RunResult:
    """One verl run of ``name`` at ``seed``, alone or watched, judged; its verdict kept beside it."""
    base = work / name / f"seed{seed}" / ("watched" if watched else "alone")
    verdict = base / "result.json"
    if resume and verdict.is_file():
        return judge(RunResult(**json.loads(verdict.read_text())))
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    family, run_dir, state = FAMILIES[name], base / "run", base / "state"
    a = assets.build(work / "assets" / f"seed{seed}_sft{SFT_STEPS}", seed=seed, sft_steps=SFT_STEPS)
    grid = assets.build_grid(work / "assets" / "val_grid.parquet")
    run = Run(f"{name}_seed{seed}", "grpo", seed, family.what, family.settings, family.inject, family.lr)
    ovr = merge(run_overrides(run, a, run_dir, steps=STEPS, save_freq=SAVE_FREQ, test_freq=STEPS),
                [f"data.val_files={grid}", "data.val_batch_size=100", f"trainer.validation_data_dir={run_dir / 'val'}",
                 "reward.custom_reward_function.path=null"])  # verl's own gsm8k scorer
    inject = {**family.inject, "VERL_CPU_INJECT_DIR": str(base / "injected")}
    verl = overrides.verl_command(sys.executable, ovr)
    r = RunResult(name, seed, watched)
    if watched:
        cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--run-dir", str(run_dir),
               "--state-dir", str(state), "--no-report", "--on-escalate", "stop", "--startup-timeout", "300", "--", *verl]
        _, r.wall_s = run_to_end(cmd, timeout, base / "watchdog.log", overrides.verl_env(inject=inject))
        read_watched(r, state)
        timeline = run_dir / "metrics.jsonl"
    else:
        timeline = run_dir / "verl.jsonl"
        run_dir.mkdir(parents=True)
        code, r.wall_s = run_to_end(verl, timeout, base / "trainer.log",
                              overrides.verl_env(inject={**inject, "VERL_FILE_LOGGER_PATH": str(timeline)}))
        r.phase = "exit " + ("killed at the time limit" if code is None else str(code))
    classify(r, run_dir, timeline)
    verdict.write_text(json.dumps(asdict(r), indent=1) + "\n")
    return r


def write_results(doc: dict) -> None:
    """bench/results/verl_stability.json, .md and .png."""
    stem = RESULTS / "verl_stability"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    planned = f" ({doc['planned']} planned)" if doc["planned"] != len(doc["runs"]) else ""
    stem.with_suffix(".md").write_text(
        f"# `{doc['command']}`\n\n{provenance_line(doc, with_command=False)}\n\n{len(doc['runs'])} verl runs"
        f"{planned} of {doc['steps']} steps (verl {doc['verl']} on CPU, GRPO, 4 prompts x 4 answers, tiny Qwen2 "
        f"warm-started), seeds {sorted({r['seed'] for r in doc['runs']})}, {doc['wall_s'] / 60:.0f} min on 2 cores (shared)"
        f"{alone_note(doc)}. Stable: "
        f"finished, final greedy accuracy on the 100 `a+b=?` prompts at least the start's - {TOLERANCE}.\n\n"
        f"{table(doc['summary'])}\n\nPer run (decisions: step:rule:kind, resolves left out):\n\n"
        f"{per_run(doc, whats(FAMILIES))}\n\n{explained(doc, EXPLAINED)}![stable runs by family](verl_stability.png)\n")
    plot(doc["summary"], stem.with_suffix(".png"), title="Hostile verl runs on CPU", alone="alone")


def committed() -> tuple[dict, list[RunResult]]:
    """The committed results (bench/results/verl_stability.json) and their runs, judged again by today's rule."""
    doc = json.loads((RESULTS / "verl_stability.json").read_text())
    return doc, [judge(RunResult(**x)) for x in doc["runs"]]


def alone_note(doc: dict) -> str:
    """Where the alone runs come from when they were not run with the watched ones (``--watched-only``)."""
    return f"; the runs alone (no watchdog in them) are those of {doc['alone_from'].rstrip('.')}" if doc.get("alone_from") else ""


def whats(names: Iterable[str]) -> dict[str, tuple[list[str], str]]:
    """The named families as trl_stability's summary and tables take them: name -> (settings, what it is)."""
    return {name: ([], FAMILIES[name].what) for name in names}


def main() -> None:
    from importlib.metadata import version

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--timeout", type=float, default=1200.0, help="wall limit of one run, alone or watched (s)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "verl_stability")
    ap.add_argument("--resume", action="store_true", help="keep the runs already judged under --work")
    ap.add_argument("--watched-only", action="store_true",
                    help="run only the watched runs; the alone runs are the committed results' (no watchdog in them)")
    ap.add_argument("--render", action="store_true",
                    help="judge the committed .json's runs again, rewrite the .json, .md and .png, and exit")
    args = ap.parse_args()
    if args.render:
        doc, runs = committed()
        doc.update(runs=[asdict(r) for r in runs],
                   summary=summarize(runs, whats(n for n in FAMILIES if any(r.family == n for r in runs))))
        write_results(doc)
        return
    seeds = list(range(1, args.seeds + 1))
    # Seed by seed, so an interrupted bench has every family at the seeds it finished.
    jobs = [(f, s, w) for s in seeds for f in args.families for w in (False, True)]
    command = "python bench/verl_stability.py" + (f" --seeds {args.seeds}" if args.seeds != 3 else "")
    kept: dict[tuple[str, int], RunResult] = {}
    alone_from = None
    if args.watched_only:
        before, runs = committed()
        kept = {(r.family, r.seed): r for r in runs if not r.watched}
        missing = sorted({(f, s) for f, s, _ in jobs} - set(kept))
        if missing:
            sys.exit(f"--watched-only: bench/results/verl_stability.json has no alone run of {missing}; run them first")
        alone_from = before.get("alone_from") or provenance_line(before, with_command=False)
        command += " --watched-only"
    t0, results, doc = time.time(), [], {}
    for f, s, w in jobs:
        r = kept[(f, s)] if not w and args.watched_only else run_one(f, s, w, args.work, args.timeout, args.resume)
        results.append(r)
        print(f"{r.family:14s} seed {r.seed} {'watched' if r.watched else 'alone  '}: {r.outcome:9s} {r.reason} "
              f"({r.wall_s:.0f} s, {r.steps_trained} steps, {r.rollbacks} rollbacks) {' '.join(r.decisions)}", flush=True)
        doc = {**provenance("recovery of hostile verl runs, alone and watched", "verl_stability.py", None),
               "command": command, "verl": version("verl"), "steps": STEPS, "seeds": seeds, "planned": len(jobs),
               "wall_s": round(sum(x.wall_s for x in results if x.watched or not args.watched_only), 1),
               "summary": summarize(results, whats(args.families)),
               "runs": [asdict(x) for x in results]}
        if alone_from:
            doc["alone_from"] = alone_from
        if w:  # after every pair: an interrupted bench leaves what it measured
            write_results(doc)
    print(table(doc["summary"]))
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
