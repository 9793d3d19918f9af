"""The default pack judged on the labelled corpora: `watchdog eval`, tables committed.

    .venv/bin/python bench/eval_corpus.py                      # both corpora, ~30 s
    .venv/bin/python bench/eval_corpus.py --rules OLD.yaml --tag before

Writes ``bench/results/eval_<corpus>[_<tag>].json`` (the whole ``watchdog eval --json``) and
``.md`` (one row per log) for the real verl logs of ``../shared/testdata/verl-logs`` (priced as
zero-patch verl), the embedded trainer's own runs of ``bench/corpus`` and the TRL glue's runs of
``bench/corpus_trl`` (both priced as embedded: live sets are free).
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
CORPORA = {"verl_logs": (LOGS / "labels.yaml", "verl"), "embedded_corpus": (ROOT / "bench" / "corpus" / "labels.yaml",
                                                                            "embedded"),
           # TRL GRPO runs (bench/trl_stability.py): live sets are free there, as in the embedded trainer.
           "trl_corpus": (ROOT / "bench" / "corpus_trl" / "labels.yaml", "embedded")}


def table(doc: dict) -> str:
    rows = ["| log | verdict | result | first false action | detected (delay) | rollbacks / pauses / alerts | "
            "sets per 100 steps | zero-patch relaunches (allowed) | deferred / merged / dropped | KL read |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for x in doc["logs"]:
        ff = f"{x['first_false']['kind']} {x['first_false']['rule']} @{x['first_false']['step']}" if x["first_false"] else "-"
        det = (f"{x['detected']['kind']} {x['detected']['rule']} @{x['detected']['step']} ({x['delay']:+d})"
               if x["detected"] else "-")
        res = "fragment" if x["verdict"] == "fragment" else ("PASS" if x["passed"] else "**FAIL**")
        zp = x["zero_patch"]
        rows.append(f"| {Path(x['file']).stem} | {x['verdict']} | {res} | {ff} | {det} | "
                    f"{x['rollbacks']} / {x['pauses']} / {x['alerts']} | {x['sets_per_100_steps']:.1f} | "
                    f"{zp['relaunches']} ({x['relaunch_allowance']}) | {zp['deferred']} / {zp['merged']} / "
                    f"{zp['dropped']} | {x['kl_source'] or '-'} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", action="append", default=None, help="pack (repeatable; default: the default pack)")
    ap.add_argument("--tag", default="", help="suffix for the result files")
    args = ap.parse_args()
    for name, (labels, mode) in CORPORA.items():
        cmd = [sys.executable, "-m", "watchdog", "eval", str(labels), "--mode", mode, "--json"]
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
            f"tuning relaunches at most one per {doc['config']['relaunch_every']} steps.\n\n{table(doc)}\n")
        print(f"{name}: {doc['summary']} -> {stem}.md")


if __name__ == "__main__":
    main()
