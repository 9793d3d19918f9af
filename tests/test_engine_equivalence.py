"""The engine, its expressions and windows give, bit for bit, what main gave when the golden file was written.

bench/engine_equivalence.py digests every decision (all fields), every EngineState and every window
read of: the corpus logs and the real verl logs replayed through ``run_series``, the cases of
rules/tests/, 600 random expressions of the whole language at every step of windows with NaN, inf,
gaps, a rewind, events and trimming, and 30 random rule packs. Any change in a result changes a
digest; the failure names the part (a log, a rule-test file, a window). Regenerate the golden file
only from a commit whose results are known right: ``python bench/engine_equivalence.py --write``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from verl_logs import needs_logs

ROOT = Path(__file__).resolve().parents[1]


def load_bench() -> object:
    spec = importlib.util.spec_from_file_location("engine_equivalence", ROOT / "bench" / "engine_equivalence.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@needs_logs
def test_every_decision_state_and_window_read_equals_the_golden_digests_of_main() -> None:
    eq = load_bench()
    want = json.loads(eq.GOLDEN.read_text())  # type: ignore[attr-defined]
    got = eq.compute()  # type: ignore[attr-defined]
    assert eq.diff(want, got) == []  # type: ignore[attr-defined]


def test_the_digest_changes_when_one_decision_field_changes() -> None:
    eq = load_bench()
    a, b = eq.Digest(), eq.Digest()  # type: ignore[attr-defined]
    a.add([3, [{"rule": "kl_high", "repeat": 1}]])
    b.add([3, [{"rule": "kl_high", "repeat": 2}]])
    assert a.out() != b.out()
    assert eq.diff({"x": a.out()}, {"x": b.out()}) == [  # type: ignore[attr-defined]
        f"x: golden {a.out()}, now {b.out()}"]
