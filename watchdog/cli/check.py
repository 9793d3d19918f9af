"""``watchdog check LOG_OR_RUN_DIR``: a pre-flight on a log a person already has, before the watchdog watches a run.

What the log gives the rules (each catalog metric found and the key it was read under), what it does not (the
rules blind for lack of a key, and the setting that logs it), how often it logs and over which steps, and what
the pack would have done on it, in words. The decisions are ``watchdog replay``'s (one path from a file to
decisions: ``ppo_watchdog.cli.rules._replayed``); this module only words them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from ppo_watchdog.core.engine import describe_blind, evidence_text
from ppo_watchdog.core.rulefile import packs_text, shipped_default_pack
from ppo_watchdog.core.vocabulary import DecisionKind
from ppo_watchdog.protocol import catalog
from ppo_watchdog.sources import ingest

#: The TRL name a verl key was read from, for a TRL log (``catalog.trl_metrics`` backwards).
_TRL_NAME = {**{v: k for k, v in catalog.TRL_KEYS.items()}, "actor/kl_loss": "kl", "actor/reward_kl_penalty": "kl",
             "actor/pg_loss": "loss"}
#: Action kinds as a count says them.
_ACTED = {"rollback": "rollback", "restart": "restart", "set": "set", "pause": "pause", "stop": "stop",
          "notify": "alert", "checkpoint": "checkpoint"}


@dataclass
class Found:
    """One catalog metric the log has."""

    short: str
    """Its short name (what rules read)."""
    keys: list[str]
    """The log's keys it was read under (TRL: ``actor/kl_loss (TRL: kl)``)."""
    help: str
    """What it is."""
    rules: list[str] = field(default_factory=list)
    """The rules of the pack that read it."""


@dataclass
class CheckReport:
    """What ``watchdog check`` says of one log."""

    path: Path
    """The file read (a run directory's metrics.jsonl, a TRL output directory's newest trainer_state.json)."""
    format: str
    """``ingest``'s format name."""
    records: int
    """Steps read (after a rewritten or rolled-back step replaced its earlier lines)."""
    first_step: int | None
    last_step: int | None
    steps_counted: bool
    """The log names no steps: its records were numbered 1, 2, ... (TRL's printed logs)."""
    gaps: Counter[int]
    """Steps between consecutive records, and how often each gap occurs."""
    found: list[Found]
    other_keys: list[str]
    """The log's keys no catalog metric reads."""
    blind: dict[str, list[str]]
    """Metric -> the rules blind for lack of it."""
    packs: str
    """The packs loaded, in one line (``rulefile.packs_text``)."""
    pack_name: str
    """``the default pack`` or ``the pack``."""
    decisions: list[Any]
    """The replay's decisions that act (fires and escalations), in step order."""
    skipped: list[str] = field(default_factory=list)
    """Lines skipped, as file:line: reason."""

    def cadence_text(self) -> str:
        """How often the log has a record, in words."""
        if self.steps_counted:
            return (f"TRL's printed logs name no steps: the {self.records} records are counted as steps 1..{self.records} "
                    "(every logging step one; trainer_state.json has the steps)")
        if not self.gaps:
            return "one record: no cadence"
        if len(self.gaps) == 1:
            (gap,) = self.gaps
            return "a record every step" if gap == 1 else f"a record every {gap} steps"
        mode = self.gaps.most_common(1)[0][0]
        return f"records {min(self.gaps)} to {max(self.gaps)} steps apart, mostly {mode}"

    def summary_text(self) -> str:
        """What the pack would have done, in one sentence with its counts."""
        if not self.decisions:
            return f"{self.pack_name} would have done nothing: no rule fired on its {self.records} steps"
        kinds: Counter[str] = Counter()
        for d in self.decisions:
            kinds.update({_ACTED.get(a.get("kind", ""), a.get("kind", "?")) for a in d.actions})
        order = list(_ACTED.values())  # ties in the pack's order of gravity: a rollback before a set
        acts = ", ".join(f"{n} {k}{'s' * (n != 1)}" for k, n in
                         sorted(kinds.items(), key=lambda kv: (-kv[1], order.index(kv[0]) if kv[0] in order else 99)))
        rules = ", ".join(sorted({d.rule for d in self.decisions}))
        first = self.decisions[0]
        return (f"{self.pack_name} would have acted {len(self.decisions)} time(s) on its {self.records} steps "
                f"({acts}; rules {rules}), first at step {first.step} ({first.rule})")

    def head(self) -> list[str]:
        """The report's first lines for a person: what was read, its cadence, how many metrics (the table follows)."""
        return [f"read {self.path}: {ingest.FORMAT_NAMES.get(self.format, self.format)}, {self.records} steps "
               f"({self.first_step}..{self.last_step})",
               f"cadence: {self.cadence_text()}",
               f"metrics: {len(self.found)} the rules know (table below)"
               + (f"; {len(self.other_keys)} other key(s) no rule reads: {_some(self.other_keys)}" if self.other_keys
                  else "")]

    def tail(self, actions_text: Callable[[Any], str]) -> list[str]:
        """The rest: the rules blind, the packs, what they would have done (``actions_text`` words a decision's
        actions), lines skipped."""
        blind = describe_blind(self.blind)
        out = [f"blind: {line}" for line in blind] or ["blind: none (every rule has every metric it reads)"]
        out.append(self.packs)
        for d in self.decisions:
            verb = "escalated" if d.kind == DecisionKind.ESCALATE else "fired"
            measured = {k: v for k, v in d.inputs.items() if not str(k).startswith("$")}
            out.append(f"  step {d.step}: {d.rule} {verb} ({evidence_text(measured, limit=4)}); would do: "
                       f"{actions_text(d)}")
        out.append(self.summary_text())
        out += [f"skipped {s}" for s in self.skipped[:10]]
        if len(self.skipped) > 10:
            out.append(f"... and {len(self.skipped) - 10} more lines skipped")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "format": self.format, "format_text": ingest.FORMAT_NAMES.get(self.format, ""),
            "records": self.records, "first_step": self.first_step, "last_step": self.last_step,
            "steps_counted": self.steps_counted, "cadence": self.cadence_text(),
            "gaps": {str(g): n for g, n in sorted(self.gaps.items())},
            "metrics": [{"short": f.short, "keys": f.keys, "rules": f.rules, "help": f.help} for f in self.found],
            "other_keys": self.other_keys,
            "blind": [{"metric": m, "rules": rules, "needs": getattr(catalog.BY_SHORT.get(m), "needs", "")}
                      for m, rules in sorted(self.blind.items())],
            "blind_text": describe_blind(self.blind), "packs": self.packs,
            "decisions": [d.to_json() for d in self.decisions], "summary": self.summary_text(),
            "skipped": self.skipped,
        }


def _some(names: Sequence[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" ... ({len(names) - n} more)" if len(names) > n else "")


def _pack_name(sources: Sequence[str]) -> str:
    try:
        shipped = shipped_default_pack().resolve()
    except FileNotFoundError:
        return "the pack"
    return "the default pack" if [Path(s).resolve() for s in sources] == [shipped] else "the pack"


def build(res: ingest.ReadResult, out: Any, ruleset: Any) -> CheckReport:
    """The report of a log read (``res``) and replayed (``out``) through ``ruleset``."""
    reads: dict[str, list[str]] = {}
    for rule in ruleset.rules:
        if rule.enabled:
            for m in sorted(rule.expr.required | (rule.clear.required if rule.clear is not None else frozenset())):
                reads.setdefault(m, []).append(rule.name)
    trl = res.format in (ingest.FORMAT_TRL_STATE, ingest.FORMAT_TRL_PRINTED)
    keys: dict[str, list[str]] = {}
    seen: set[str] = set()
    for rec in res.records:
        where: dict[str, str] = {}
        catalog.to_short(rec["data"], where)
        for short, key in where.items():
            if key not in keys.setdefault(short, []):
                keys[short].append(key)
        seen.update(rec["data"])
    found = [Found(m.short, [f"{k} (TRL: {_TRL_NAME[k]})" if trl and k in _TRL_NAME else k for k in keys[m.short]],
                   m.help, reads.get(m.short, [])) for m in catalog.METRICS if m.short in keys]
    found.sort(key=lambda f: not f.rules)  # what the pack reads first
    if trl:
        mapped = {*catalog.TRL_KEYS, "kl", "loss", "policy_loss"}
        other = sorted(k[len(catalog.TRL_PREFIX):] for k in seen
                       if k.startswith(catalog.TRL_PREFIX) and k[len(catalog.TRL_PREFIX):] not in mapped)
    else:
        other = sorted(k for k in seen if not catalog.sources_of(k))
    steps = [int(r["step"]) for r in res.records]
    gaps = Counter(b - a for a, b in zip(steps, steps[1:], strict=False))
    acting = [d for d in out.decisions if d.kind in (DecisionKind.FIRE, DecisionKind.ESCALATE)]
    return CheckReport(res.path, res.format, len(steps), steps[0] if steps else None, steps[-1] if steps else None,
                       res.steps_counted, gaps, found, other, dict(out.blind), packs_text(ruleset),
                       _pack_name(ruleset.sources), acting,
                       [str(i) for i in res.issues])


def metrics_table(report: CheckReport) -> Table:
    """The metrics found: short name, the log's key, what it is."""
    t = Table(title=f"metrics in {report.path.name} the rules know")
    for col in ("metric", "read from", "rules reading it", "what it is"):
        t.add_column(col, overflow="fold")
    for f in report.found:
        t.add_row(f.short, ", ".join(f.keys), str(len(f.rules)) if f.rules else "-", f.help)
    return t
