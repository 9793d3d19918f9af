"""The default pack judged on the labelled corpora: `watchdog eval`, tables committed.

    .venv/bin/python bench/eval_corpus.py                      # every corpus, ~1 min
    .venv/bin/python bench/eval_corpus.py --rules OLD.yaml --tag before

Writes ``bench/results/eval_<corpus>[_<tag>].json`` (the whole ``watchdog eval --json``) and
``.md`` (the headline figures, each rule's fires on healthy steps, then one row per log) for the real verl logs of
``../shared/testdata/verl-logs`` (priced as zero-patch verl), the embedded trainer's own runs of
``bench/corpus``, the synthetic fault injection of ``bench/corpus_injected``, the TRL glue's runs
of ``bench/corpus_trl`` (priced as embedded: live sets are free) and the real verl trainer's plain
runs of ``bench/corpus_verl`` (console and FileLogger formats, priced as zero-patch verl), and
``eval_by_corpus[_<tag>].md``: every corpus's headline figures side by side, and each rule's fires
on healthy steps per 1,000, split by corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from verl_logs import LOGS  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CORPORA = {"verl_logs": (LOGS / "labels.yaml", "verl"),
           "embedded_corpus": (ROOT / "bench" / "corpus" / "labels.yaml", "embedded"),
           # Synthetic fault injection (bench/make_injected.py): the classes the recorded corpora lack.
           "injected_corpus": (ROOT / "bench" / "corpus_injected" / "labels.yaml", "embedded"),
           # TRL GRPO runs (bench/trl_stability.py): live sets are free there, as in the embedded trainer.
           "trl_corpus": (ROOT / "bench" / "corpus_trl" / "labels.yaml", "embedded"),
           "trl_regimes": (ROOT / "bench" / "corpus_trl_regimes" / "labels.yaml", "embedded"),
           # Plain runs of the real verl trainer on CPU (bench/make_verl_corpus.py), each in verl's
           # console and FileLogger formats; priced as zero-patch verl.
           "verl_corpus": (ROOT / "bench" / "corpus_verl" / "labels.yaml", "verl")}


def table(doc: dict) -> str:
    rows = ["| log | verdict | result | first false action | detected (delay) | first warning (lead) | "
            "rollbacks / restarts / pauses / alerts | sets per 100 steps | sets that changed nothing | "
            "zero-patch relaunches (allowed) | deferred / merged / dropped | KL read |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in doc["logs"]:
        ff = f"{x['first_false']['kind']} {x['first_false']['rule']} @{x['first_false']['step']}" if x["first_false"] else "-"
        det = (f"{x['detected']['kind']} {x['detected']['rule']} @{x['detected']['step']} ({x['delay']:+d})"
               if x["detected"] else "-")
        res = "fragment" if x["verdict"] == "fragment" else ("PASS" if x["passed"] else "**FAIL**")
        zp = x["zero_patch"]
        warned = x.get("warned")
        warn = f"{warned['kind']} {warned['rule']} @{warned['step']} ({x['lead']:+d})" if warned else "-"
        noop = x.get("noop_sets", _noop(x))
        rows.append(f"| {Path(x['file']).stem} | {x['verdict']} | {res} | {ff} | {det} | {warn} | "
                    f"{x['rollbacks']} / {x.get('restarts', 0)} / {x['pauses']} / {x['alerts']} | "
                    f"{x['sets_per_100_steps']:.1f} | {noop} | "
                    f"{zp['relaunches']} ({x['relaunch_allowance']}) | {zp['deferred']} / {zp['merged']} / "
                    f"{zp['dropped']} | {x['kl_source'] or '-'} |")
    return "\n".join(rows)


def _noop(x: dict) -> int:
    """Sets whose ``from`` equals their ``to`` in a log's actions (for JSON of a watchdog without the count)."""
    return sum(1 for a in x.get("actions", []) if a.get("kind") == "set" and a.get("from") == a.get("to"))


def headline(doc: dict) -> str:
    """The corpus's headline figures as a small table."""
    h = doc.get("headline")
    if not h:
        return ""
    lead = "-" if h["lead_median"] is None else f"{h['lead_median']:g} / {h['lead_worst']:+d}"
    return ("| failures detected | lead time, median / worst (steps before onset) | false rollbacks+pauses "
            "per 1000 healthy steps | zero-patch relaunches per 100 healthy-run steps | sets that changed nothing |\n"
            "|---|---|---|---|---|\n"
            f"| {h['detected']}/{h['failures']} | {lead} | {h['false_per_1000_healthy_steps']} "
            f"({h['false_actions']} in {h['healthy_steps']}) | {h['relaunches_per_100_healthy_steps']} | "
            f"{h['noop_sets']} |\n\n")


def _kinds(actions: dict[str, int]) -> str:
    """What a rule's healthy-step fires became: ``notify`` alone, or ``relaunch 2, notify 1``."""
    if len(actions) == 1:
        return next(iter(actions)).replace("_", " ")
    return ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in actions.items())


def rule_rates(doc: dict) -> str:
    """Each rule that fired on a healthy step of a corpus: fires, per 1,000 healthy steps, what they became."""
    rr = doc.get("rule_rates")
    if not rr:
        return ""
    fired = [r for r in rr["rules"] if r["fires"]]
    if not fired:
        return f"No rule fired on any of the {rr['healthy_steps']} healthy steps.\n\n"
    rows = [f"Rules on the {rr['healthy_steps']} healthy steps (healthy runs, and failures before onset - 2); "
            f"{len(rr['rules']) - len(fired)} other rules never fired there.\n",
            "| rule | fires on healthy steps | per 1,000 healthy steps | action |", "|---|---|---|---|"]
    rows += [f"| {r['rule']} | {r['fires']} | {r['per_1000_healthy_steps']:g} | {_kinds(r['actions'])} |" for r in fired]
    return "\n".join(rows) + "\n\n"


def by_corpus(docs: dict[str, dict], shown: dict[str, str]) -> str:
    """Every corpus's headline figures, then each rule's fires on healthy steps per 1,000, one column a corpus."""
    names = list(docs)
    out = ["# The default pack on every labelled corpus\n", "| corpus | command | logs passed | failures detected | "
           "healthy steps | false rollbacks+pauses per 1,000 healthy steps | zero-patch relaunches per 100 "
           "healthy-run steps |", "|---|---|---|---|---|---|---|"]
    for name in names:
        h = docs[name]["headline"]
        out.append(f"| {name} | `{shown[name]}` | {docs[name]['summary'].split(':')[0]} | {h['detected']}/{h['failures']} | "
                   f"{h['healthy_steps']} | {h['false_per_1000_healthy_steps']} ({h['false_actions']}) | "
                   f"{h['relaunches_per_100_healthy_steps']} |")
    rates = {n: {r["rule"]: r for r in docs[n].get("rule_rates", {}).get("rules", [])} for n in names}
    fired = sorted({rule for n in names for rule, r in rates[n].items() if r["fires"]},
                   key=lambda rule: (-sum(rates[n][rule]["fires"] for n in names if rule in rates[n]), rule))
    out += ["", "Each rule's fires on healthy steps (healthy runs, and failures before onset - 2), per 1,000 healthy "
            "steps of the corpus, with the count and what the fires became in the corpus's mode (rollback, restart, "
            "stop, pause: they interrupt the run; relaunch set: a tuning set that waits for the next checkpoint's "
            "relaunch, merged or dropped; live set; notify). Rules that never fired on a healthy step of any corpus "
            "are left out.",
            "", "| rule | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for rule in fired:
        cells = []
        for n in names:
            r = rates[n].get(rule)
            cells.append("-" if not r or not r["fires"] else
                         f"{r['per_1000_healthy_steps']:g} ({r['fires']}: {_kinds(r['actions'])})")
        out.append(f"| {rule} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", action="append", default=None, help="pack (repeatable; default: the default pack)")
    ap.add_argument("--tag", default="", help="suffix for the result files")
    args = ap.parse_args()
    docs: dict[str, dict] = {}
    commands: dict[str, str] = {}
    for name, (labels, mode) in CORPORA.items():
        cmd = [sys.executable, "-m", "ppo_watchdog", "eval", str(labels), "--mode", mode, "--json"]
        for r in args.rules or []:
            cmd += ["--rules", r]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr}")
        doc = json.loads(proc.stdout)
        stem = RESULTS / (f"eval_{name}_{args.tag}" if args.tag else f"eval_{name}")
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
        shown = " ".join(["watchdog", "eval", os.path.relpath(labels, ROOT), "--mode", mode,
                          *(f"--rules {r}" for r in args.rules or [])])
        stem.with_suffix(".md").write_text(
            f"# `{shown}`\n\n{doc['summary']}\n\nPacks: {', '.join(Path(r).name for r in doc['rules'])}; "
            f"checkpoint every {doc['config']['save_freq']} steps, relaunch start-up {doc['config']['startup_s']:.0f} s, "
            f"tuning relaunches at most one per {doc['config']['relaunch_every']} steps.\n\n{headline(doc)}"
            f"{rule_rates(doc)}{table(doc)}\n")
        docs[name], commands[name] = doc, shown
        print(f"{name}: {doc['summary']} -> {stem}.md")
    summary = RESULTS / (f"eval_by_corpus_{args.tag}.md" if args.tag else "eval_by_corpus.md")
    summary.write_text(by_corpus(docs, commands))
    print(f"every corpus -> {summary}")


if __name__ == "__main__":
    main()
