"""Stability of hostile TRL GRPO runs with and without the watchdog (the default pack).

    .venv/bin/python bench/trl_stability.py              # 4 families x 3 seeds, ~10-15 min on 2 cores
    .venv/bin/python bench/trl_stability.py --seeds 1    # one seed per family, ~4 min

The model is the glue's tiny local Qwen2 (``ppo_watchdog.trainer.trl_glue.assets``: 2 layers, hidden 64,
warm-started on ``a+b=`` so its greedy answers start about half right), the task the glue's
built-in arithmetic prompts with its dense reward (share of digits + 1 for the right sum).
Every (family, seed) is run twice with the same seed and the same number of steps (40, a
checkpoint every 5): once alone (``python -m ppo_watchdog.trainer.trl_glue``) and once under
``watchdog run --on-escalate stop -- python -m ppo_watchdog.trainer.trl_glue`` (no human at the keyboard).

Outcome of a run:

- stable: it reached its last step, and the greedy accuracy of its final weights on all 100
  ``a+b=`` prompts is at least the warm start's less :data:`TOLERANCE` (the objective the reward
  stands for: a collapsed policy that prints digits gets reward 1 and accuracy near 0; a tiny
  model's greedy answer flips on a few prompts by chance, hence the 5-prompt tolerance);
- escalated: the watchdog stopped it for a human;
- unstable: anything else (below the start, crashed, hung past the time limit).

Rates come with Wilson 95% intervals. Results: ``bench/results/trl_stability.json`` and ``.md``.
With ``--keep-corpus``, some unsupervised runs (:data:`CORPUS_RUNS`) are copied to ``bench/corpus_trl/`` (metrics,
events) for ``watchdog eval bench/corpus_trl/labels.yaml``; their labels are written by hand from their numbers, so a
plain re-run leaves the labelled corpus as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CORPUS = ROOT / "bench" / "corpus_trl"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_rules import provenance, provenance_line  # noqa: E402
from stability import wilson  # noqa: E402

#: family -> (entry-point overrides, what it is). The healthy baseline: lr 1e-4, beta 0.04, no entropy bonus,
#: 2 prompts x 4 completions of at most 16 tokens a step.
FAMILIES: dict[str, tuple[list[str], str]] = {
    "healthy": ([], "lr 1e-4, beta 0.04 (the control)"),
    "lr_high": (["actor_rollout_ref.actor.optim.lr=0.01"], "lr 1e-2: 100x"),
    "beta_tiny": (["actor_rollout_ref.actor.optim.lr=0.001", "actor_rollout_ref.actor.kl_loss_coef=0.0001"],
                  "beta 1e-4 (no KL anchor) and lr 10x"),
    "entropy_bonus": (["actor_rollout_ref.actor.entropy_coeff=0.5", "actor_rollout_ref.actor.optim.lr=0.0003"],
                      "entropy bonus 0.5 and lr 3x"),
}
STEPS = 40
#: How far below the warm start's greedy accuracy a final one may land and still count as stable.
TOLERANCE = 0.05
BASE = ["actor_rollout_ref.actor.optim.lr=0.0001", "trainer.save_freq=5"]


@dataclass
class RunResult:
    family: str
    seed: int
    watched: bool
    outcome: str = "unstable"
    reason: str = ""
    start_acc: float | None = None
    final_acc: float | None = None
    last_step: int | None = None
    steps_trained: int = 0
    """Metric lines written, re-runs after rollbacks and restarts included."""
    wall_s: float = 0.0
    rollbacks: int = 0
    live_sets: int = 0
    restarts: int = 0
    phase: str = ""
    decisions: list[str] = field(default_factory=list)


def greedy_accuracy(model_dir: Path) -> float:
    """Share of the 100 prompts ``a+b=`` whose greedy completion starts with the sum."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ok = 0
    with torch.no_grad():
        for a in range(10):
            for b in range(10):
                ids = tok(f"{a}+{b}=", return_tensors="pt")
                out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
                text = str(tok.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True))
                ok += text.startswith(str(a + b))
    return ok / 100


MODEL = Path()


def run_to_end(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` in its own session to its end or ``timeout`` (then its whole group is killed): (exit code or
    None when killed, wall seconds)."""
    t0 = time.time()
    env = env or {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRAINER_LOG_LEVEL": "WARNING"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.time() - t0


def classify(r: RunResult, run_dir: Path, start_acc: float) -> RunResult:
    """Judge a finished (or killed) run from its run directory and its final weights."""
    from ppo_watchdog.protocol import checkpoint as ckpt
    from ppo_watchdog.protocol import rundir

    metrics = run_dir / rundir.METRICS
    recs = rundir.read_jsonl(metrics).records if metrics.exists() else []
    r.steps_trained = len(recs)
    r.last_step = max((int(x["step"]) for x in recs), default=None)
    r.start_acc = start_acc
    final = [c for c in ckpt.list_checkpoints(run_dir / rundir.CHECKPOINTS) if c.complete and c.step == STEPS]
    if r.watched and r.phase in ("stopped", "failed"):
        r.outcome, r.reason = "escalated", f"watchdog {r.phase}"
        return r
    if r.last_step != STEPS or not final:
        r.outcome, r.reason = "unstable", f"did not finish (last step {r.last_step})"
        return r
    r.final_acc = greedy_accuracy(final[0].path)
    if math.isnan(r.final_acc) or r.final_acc < start_acc - TOLERANCE:
        r.outcome, r.reason = "unstable", f"greedy accuracy {start_acc:.2f} -> {r.final_acc:.2f}"
        return r
    r.outcome, r.reason = "stable", f"greedy accuracy {start_acc:.2f} -> {r.final_acc:.2f}"
    return r


def run_one(family: str, seed: int, watched: bool, work: Path, start_acc: float, timeout: float) -> RunResult:
    base = work / family / f"seed{seed}" / ("watched" if watched else "alone")
    run_dir, state = base / "run", base / "state"
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    r = RunResult(family, seed, watched)
    trainer = [sys.executable, "-m", "ppo_watchdog.trainer.trl_glue", "--run-dir", str(run_dir), f"actor_rollout_ref.model.path={MODEL}",
               f"trainer.total_training_steps={STEPS}", f"trainer.seed={seed}", *BASE, *FAMILIES[family][0]]
    if watched:
        cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--state-dir", str(state),
               "--no-report", "--on-escalate", "stop", "--tick", "0.5", "--startup-timeout", "120", "--", *trainer]
        code, r.wall_s = run_to_end(cmd, timeout, base / "watchdog.log")
        read_watched(r, state)
    else:
        code, r.wall_s = run_to_end(trainer, timeout, base / "trainer.log")
        r.phase = "exit " + ("killed at the time limit" if code is None else str(code))
    return classify(r, run_dir, start_acc)


def read_watched(r: RunResult, state: Path) -> None:
    """What the watchdog did to a watched run (its state database under ``state``): phase, restarts, rollbacks,
    live sets and each decision as ``step:rule:kind`` (resolves left out)."""
    from ppo_watchdog.control.store import Store

    store = Store(state)
    try:
        run = store.get_run("run")
        r.phase = run.phase if run else "none"
        r.restarts = run.restarts if run else 0
        decisions = store.decisions("run")
    finally:
        store.close()
    r.rollbacks = sum(1 for d in decisions for j in d["journal"] if j["kind"] == "rollback")
    r.live_sets = sum(1 for d in decisions for j in d["journal"] if j["kind"] == "live_set")
    r.decisions = [f"{d['step']}:{d['rule']}:{d['kind']}" for d in decisions if d["kind"] != "resolve"]


def summarize(results: list[RunResult], families: dict[str, tuple[list[str], str]] = FAMILIES) -> dict:
    """Per family (and overall), alone and watched: runs, stable (with its Wilson 95% interval), escalated,
    rollbacks, live sets, steps trained and wall time. ``families``: name -> (settings, what it is)."""
    out: dict = {"families": {}, "overall": {}}
    for name in [*families, "overall"]:
        rows = results if name == "overall" else [r for r in results if r.family == name]
        if not rows:
            continue
        entry = {}
        for watched in (False, True):
            rs = [r for r in rows if r.watched == watched]
            k = sum(r.outcome == "stable" for r in rs)
            entry["watched" if watched else "alone"] = {
                "n": len(rs), "stable": k, "escalated": sum(r.outcome == "escalated" for r in rs),
                "rate": k / len(rs) if rs else None, "wilson95": wilson(k, len(rs)),
                "rollbacks": sum(r.rollbacks for r in rs), "live_sets": sum(r.live_sets for r in rs),
                "steps_trained": sum(r.steps_trained for r in rs), "wall_s": round(sum(r.wall_s for r in rs), 1),
            }
        if name == "overall":
            out["overall"] = entry
        else:
            out["families"][name] = {"what": families[name][1], **entry}
    return out


def table(summary: dict) -> str:
    rows = ["| family | what | stable alone | stable with the watchdog | escalated | rollbacks / live sets | "
            "steps trained alone / with | wall alone / with |", "|---|---|---|---|---|---|---|---|"]

    def rate(e: dict) -> str:
        lo, hi = e["wilson95"]
        return f"{e['stable']}/{e['n']} ({100 * e['rate']:.0f}%, 95% CI {100 * lo:.0f}-{100 * hi:.0f}%)"

    for name, e in [*summary["families"].items(), ("**overall**", {"what": "", **summary["overall"]})]:
        a, w = e["alone"], e["watched"]
        rows.append(f"| {name} | {e['what']} | {rate(a)} | {rate(w)} | {w['escalated']} | {w['rollbacks']} / "
                    f"{w['live_sets']} | {a['steps_trained']} / {w['steps_trained']} | "
                    f"{a['wall_s'] / 60:.1f} / {w['wall_s'] / 60:.1f} min |")
    return "\n".join(rows)


#: The unsupervised runs kept for ``watchdog eval`` (bench/corpus_trl/labels.yaml labels them).
CORPUS_RUNS = (("healthy", 1), ("healthy", 2), ("healthy", 3), ("lr_high", 1), ("lr_high", 2), ("lr_high", 3),
               ("beta_tiny", 1), ("entropy_bonus", 1))


def keep_corpus(work: Path) -> None:
    """Copy the unsupervised runs of :data:`CORPUS_RUNS` (metrics, events) into bench/corpus_trl/<family>_seed<seed>/."""
    for family, seed in CORPUS_RUNS:
        src = work / family / f"seed{seed}" / "alone" / "run"
        dst = CORPUS / f"{family}_seed{seed}"
        if not (src / "metrics.jsonl").exists():
            continue
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "events.jsonl"):
            if (src / name).exists():
                shutil.copyfile(src / name, dst / name)


def main() -> None:
    global MODEL
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=400.0, help="wall limit of one run (alone or watched)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "trl_stability")
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the committed .json and exit")
    ap.add_argument("--keep-corpus", action="store_true",
                    help="copy CORPUS_RUNS into bench/corpus_trl/ (their labels are written from those runs' numbers: "
                         "relabel after)")
    args = ap.parse_args()
    if args.render:
        write_results(json.loads((RESULTS / "trl_stability.json").read_text()))
        return
    from ppo_watchdog.trainer.trl_glue import assets

    t0 = time.time()
    MODEL = assets.build(args.work / "model")
    start_acc = greedy_accuracy(MODEL)
    print(f"warm start: greedy accuracy {start_acc:.2f} ({time.time() - t0:.0f} s to build)", flush=True)
    seeds = list(range(1, args.seeds + 1))
    jobs = [(f, s, w) for s in seeds for f in args.families for w in (False, True)]
    results: list[RunResult] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futs = [pool.submit(run_one, f, s, w, args.work, start_acc, args.timeout) for f, s, w in jobs]
        for fut in futs:
            r = fut.result()
            results.append(r)
            print(f"{r.family:14s} seed {r.seed} {'watched' if r.watched else 'alone  '}: {r.outcome:9s} {r.reason} "
                  f"({r.wall_s:.0f} s, {r.steps_trained} steps, {r.rollbacks} rollbacks) {' '.join(r.decisions)}",
                  flush=True)
    if args.keep_corpus:
        keep_corpus(args.work)
    summary = summarize(results)
    command = "python bench/trl_stability.py" + (f" --seeds {args.seeds}" if args.seeds != 3 else "")
    doc = {**provenance("recovery of hostile TRL runs, alone and watched", "trl_stability.py", None),
           "command": command, "steps": STEPS, "seeds": seeds, "start_accuracy": start_acc,
           "wall_s": round(time.time() - t0, 1), "summary": summary, "runs": [asdict(r) for r in results]}
    write_results(doc)
    print(table(summary))


def per_run(doc: dict, families: dict[str, tuple[list[str], str]] = FAMILIES) -> str:
    """One row per (family, seed): final greedy accuracy alone and watched, and what the watchdog did."""
    rows = ["| family | seed | alone: final accuracy | with the watchdog: final accuracy | what the watchdog did |",
            "|---|---|---|---|---|"]
    runs = {(r["family"], r["seed"], r["watched"]): r for r in doc["runs"]}
    for (family, seed, watched), r in sorted(runs.items(), key=lambda kv: (list(families).index(kv[0][0]), kv[0][1])):
        if watched:
            continue
        w = runs.get((family, seed, True), {})

        def acc(x: dict) -> str:
            return "-" if x.get("final_acc") is None else f"{x['final_acc']:.2f} ({x['outcome']})"
        rows.append(f"| {family} | {seed} | {acc(r)} | {acc(w)} | {' '.join(w.get('decisions', [])) or '-'} |")
    return "\n".join(rows)


#: Why a family ends below all-stable with the watchdog, from its runs' decisions and numbers (the results page says it).
EXPLAINED: dict[str, str] = {
    "entropy_bonus": (
        "the family drifts slowly (an entropy bonus of 0.5 at lr 3x; seed 3 loses accuracy alone too, 0.31). Seed "
        "3's KL passed 4x its baseline at step 20 with the score holding: kl_runaway told a person and "
        "kl_above_target cut the lr to 2.4e-4; the score never fell beyond its own noise, so no rule had a second "
        "sign to roll back on (a drift with no sign of damage is told, not rolled back: issue 43, item 7), and it "
        "ended at 0.32. The damage was in greedy accuracy, which the run does not log."),
}


def explained(doc: dict, why: dict[str, str]) -> str:
    """The results page's section on each family whose watched runs are not all stable, from ``why``."""
    short = [name for name, e in doc["summary"]["families"].items() if e["watched"]["stable"] < e["watched"]["n"]]
    if not short:
        return ""
    lines = [f"- **{name}**: {why.get(name, 'not yet explained')}" for name in short]
    return "Families not all stable with the watchdog, and why:\n\n" + "\n".join(lines) + "\n\n"


def write_results(doc: dict) -> None:
    """bench/results/trl_stability.json and .md."""
    stem = RESULTS / "trl_stability"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(
        f"# `{doc['command']}`\n\n{provenance_line(doc, with_command=False)}\n\n{len(doc['runs'])} TRL GRPO runs of {doc['steps']} steps (tiny local Qwen2 "
        f"warm-started to greedy accuracy {doc['start_accuracy']:.2f}), seeds {doc['seeds']}, "
        f"{doc['wall_s'] / 60:.0f} min on 2 cores (shared). Stable: finished, final greedy accuracy at least the "
        f"warm start's - {TOLERANCE}.\n\n{table(doc['summary'])}\n\nPer run (decisions: step:rule:kind, "
        f"resolves left out):\n\n{per_run(doc)}\n\n{explained(doc, EXPLAINED)}".rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
