"""Advise mode over real verl: verl 0.9.1's own ``main_ppo`` on CPU under ``watchdog run --advise``.

``make run-verl``'s zero-patch run (12 steps, a checkpoint every 2) with a NaN injected into the actor's loss at
step 5 (the plugin's ``VERL_CPU_INJECT_NAN``, through verl's own loss path) and no other fault: the default pack
decides the rollback it would make and journals it, and nothing touches the run: one verl attempt trains every
step, no control.json, no ``applied`` or ``rollback`` event, no relaunch. About 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import verl_e2e as e2e  # noqa: E402

from ppo_watchdog.protocol import rundir  # noqa: E402
from ppo_watchdog.trainer.verl_cpu import demo  # noqa: E402


def test_a_real_verl_run_under_advise_with_an_injected_nan_is_never_stopped(tmp_path: Path) -> None:
    run = e2e.run_zero_patch(tmp_path, extra_watchdog=["--advise"], inject={"VERL_CPU_INJECT_OOM": ""},
                             ray_memory_monitor=False)
    assert run.exit_code == 0, run.output[-3000:]
    assert run.last_step() == demo.STEPS, run.output[-3000:]
    # One attempt: verl was never stopped or relaunched, and the watchdog never spoke to it.
    attempts = sorted((run.run_dir / "verl").glob("metrics.*.jsonl"))
    assert len(attempts) == 1, attempts
    assert not (run.run_dir / rundir.CONTROL).exists()
    kinds = [e["kind"] for e in run.events()]
    assert "applied" not in kinds and "rollback" not in kinds, kinds
    # The NaN was seen and the rollback it would have answered it with is journaled, advised, never done.
    journal = run.journal()
    advised = [e for e in journal if e.status == "advised"]
    assert any(e.kind == "rollback" for e in advised), [(e.kind, e.status) for e in journal]
    assert not [e for e in journal if e.status == "done" and e.kind in ("rollback", "relaunch", "stop", "pause")]
    # verl's FileLogger writes a NaN as null (orjson): the poisoned step is the injected one.
    nan_steps = [r["step"] for r in run.metrics() if any(v is None or v != v for v in r["data"].values())]
    assert nan_steps and min(nan_steps) == demo.NAN_STEP, nan_steps
    assert "would" in run.output, run.output[-3000:]
