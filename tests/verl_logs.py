"""Where the real verl logs of ``../shared/testdata`` are (shared by tests/ and rules/tests/).

The logs sit beside the checkout (``<checkout>/../shared/testdata/verl-logs``); a clone
elsewhere finds them through ``$WATCHDOG_TESTDATA`` (the ``testdata`` folder), and nowhere
else: no workspace's absolute path. Tests that need them skip when none is there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def _find() -> Path:
    candidates = [Path(os.environ["WATCHDOG_TESTDATA"])] if os.environ.get("WATCHDOG_TESTDATA") else []
    candidates += [_ROOT.parent / "shared" / "testdata"]
    for c in candidates:
        if (c / "verl-logs").is_dir():
            return c / "verl-logs"
    return candidates[0] / "verl-logs"


LOGS = _find()
HEALTHY = LOGS / "verl_ppo_gemma2b_gsm8k_healthy.txt"
"""A real, healthy verl PPO run (gemma-2-2b-it, GSM8K, 106 steps) as the console logger printed it."""
NAN = LOGS / "verl_issue_nan_single_step_excerpts.txt"
"""Single step lines with NaN values from verl issues."""

needs_logs = pytest.mark.skipif(not HEALTHY.exists(), reason=f"shared verl test logs not present under {LOGS}")
