"""``watchdog rules calibrate``: a family's thresholds proposed from its own healthy runs.

A pack's baseline-relative rules compare a statistic of the run with a parameter
(``kl / median(kl, 5, 1) > $kl_jump``). The default numbers are principles (a doubling, three
standard deviations); a family of runs (one model, task and algorithm) may be noisier or
calmer than they assume. Calibration replays healthy runs of the family, evaluates each
calibrated parameter's ``stat`` expression at every step, and proposes

    value = margin x (the largest stat any healthy run reached)

kept within the parameter's ``min``/``max`` (a principle the data may not overrule: a KL
"jump" below 1.5x is not a jump). The proposal comes as an overlay pack (``params:`` only),
with the margin it leaves on each given run, and ``watchdog eval`` of those runs with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.core.rulefile import Param, RuleSet
from ppo_watchdog.core.series import MissingDataError, Window
from ppo_watchdog.sources import ingest


@dataclass
class Proposal:
    """One parameter's proposed value and the evidence."""

    param: Param
    peaks: dict[str, float] = field(default_factory=dict)
    """Largest stat per run (file name -> value); runs where it never had data are left out."""
    value: float | None = None
    """Proposed value; None when no run had data for the stat."""
    bound: str = ""
    """``min`` or ``max`` when the parameter's bound, not the data, set the value."""

    def margins(self) -> dict[str, float]:
        """Proposed value over each run's peak (above 1: the run stays clear of the threshold)."""
        if self.value is None:
            return {}
        return {f: (self.value / p if p > 0 else math.inf) for f, p in self.peaks.items()}


def _round_up(x: float) -> float:
    """Two significant digits, rounded away from the data (a threshold must not undercut its evidence)."""
    if x <= 0 or not math.isfinite(x):
        return x
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / scale) * scale


def stat_peaks(records: Sequence[dict[str, Any]], params: Sequence[Param]) -> dict[str, float]:
    """Largest finite value of each calibrated parameter's stat over one run (name -> peak)."""
    size = max((max(p.calibrate.stat.max_window, p.calibrate.when.max_window if p.calibrate.when else 1)
                for p in params if p.calibrate), default=1) + 1
    w = Window(size)
    peaks: dict[str, float] = {}
    for rec in records:
        w.append_record(rec)
        step = w.step
        assert step is not None
        for p in params:
            if p.calibrate is None:
                continue
            try:
                if p.calibrate.when is not None and not p.calibrate.when.fn(w, step, 0):
                    continue
                v = float(p.calibrate.stat.fn(w, step, 0))
            except (MissingDataError, ValueError, ZeroDivisionError):
                continue
            if math.isfinite(v) and v > peaks.get(p.name, -math.inf):
                peaks[p.name] = v
    return peaks


def calibrate(rules: RuleSet, logs: Sequence[Path]) -> list[Proposal]:
    """Proposals for every calibrated parameter of ``rules`` from the healthy runs ``logs``."""
    return calibrate_runs(rules, {Path(path).name: ingest.read_run(path).records for path in logs})


def calibrate_runs(rules: RuleSet, runs: Mapping[str, Sequence[dict[str, Any]]]) -> list[Proposal]:
    """Proposals from runs already read (name -> deduplicated metric records)."""
    params = [p for p in rules.params if p.calibrate is not None]
    out = {p.name: Proposal(p) for p in params}
    for name_of_run, records in runs.items():
        peaks = stat_peaks(records, params)
        for name, v in peaks.items():
            out[name].peaks[name_of_run] = v
    for prop in out.values():
        cal = prop.param.calibrate
        assert cal is not None
        if not prop.peaks:
            continue
        value = _round_up(cal.margin * max(prop.peaks.values()))
        if cal.min is not None and value < cal.min:
            value, prop.bound = cal.min, "min"
        if cal.max is not None and value > cal.max:
            value, prop.bound = cal.max, "max"
        prop.value = value
    return list(out.values())


def overlay_yaml(proposals: Sequence[Proposal], logs: Sequence[Path], base: Sequence[str]) -> str:
    """The proposals as an overlay pack, each value with its evidence in comments."""
    lines = [
        "# Overlay pack written by `watchdog rules calibrate` from healthy runs of one family:",
        *(f"#   {Path(p).name}" for p in logs),
        f"# Load it after the pack it tunes: --rules {' --rules '.join(base)} --rules THIS_FILE",
        "version: 1",
        "params:",
    ]
    for prop in proposals:
        if prop.value is None:
            lines.append(f"  # {prop.param.name}: no given run has data for its stat; left at {prop.param.value:g}")
            continue
        peak = max(prop.peaks.values())
        why = f"the parameter's {prop.bound} bound" if prop.bound else f"{prop.param.calibrate.margin:g} x the peak"  # type: ignore[union-attr]
        lines.append(f"  # {prop.param.name}: peak {peak:.4g} on healthy runs; {why}; was {prop.param.value:g}")
        lines.append(f"  {prop.param.name}: {prop.value:g}")
    return "\n".join(lines) + "\n"
