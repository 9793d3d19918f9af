"""A rollback restored inside the running trainer: the step boundary's protocol and the verl glue's pieces
that need no running verl (the end-to-end proof on CPU verl is in tests/test_verl_e2e.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import pytest

from ppo_watchdog.core.pricing import CostModel, cost_text
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import Command, Control, ControlApplier, StepBoundary, write_control
from ppo_watchdog.trainer.verl_glue import apply


class Restorer:
    """A trainer that restores in process; ``fail`` makes the restore die halfway."""

    can_rollback = True

    def __init__(self, run_dir: Path, fail: bool = False) -> None:
        self.run_dir, self.fail = run_dir, fail
        self.restored: list[Mapping[str, Any]] = []

    def apply(self, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        return dict(overrides), []

    def checkpoint(self, reason: str) -> None:
        raise AssertionError("not asked")

    def stop(self, reason: str) -> NoReturn:
        raise AssertionError("not asked")

    def rollback(self, args: Mapping[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("a worker died loading the checkpoint")
        self.restored.append(dict(args))
        rundir.append_event(self.run_dir, "rollback", int(args["to_step"]), to_step=args["to_step"])

    def check_rollback(self, args: Mapping[str, Any]) -> str | None:
        return None

    def event(self, kind: str, **fields: Any) -> None:
        rundir.append_event(self.run_dir, kind, None, **fields)

    def should_stop(self) -> str | None:
        return None


def _boundary(tmp_path: Path, fail: bool = False) -> tuple[StepBoundary, Restorer]:
    target = Restorer(tmp_path, fail)
    write_control(tmp_path, Control(1, {}, (Command("rb1", "rollback", {"path": "p", "to_step": 4}),)))
    return StepBoundary(ControlApplier(tmp_path), target), target


def test_a_rollback_in_process_is_confirmed_after_the_restore_at_the_step_it_went_back_to(tmp_path: Path) -> None:
    steps, target = _boundary(tmp_path)
    steps.at_boundary(9)
    assert target.restored == [{"path": "p", "to_step": 4}]
    kinds = [(e["kind"], e["step"]) for e in rundir.iter_events(tmp_path, ["rollback", "applied"])]
    assert kinds == [("rollback", 4), ("applied", 4)]  # confirmed only once it happened
    assert steps.at_boundary(5) is None  # the version is applied: nothing again


def test_a_rollback_that_dies_halfway_stays_unconfirmed_and_is_never_done_again(tmp_path: Path) -> None:
    """The watchdog rolls back by restart when the version is not applied in time; the relaunched trainer reads
    the same control.json and must not restore the same checkpoint a second time (it resumes from it)."""
    steps, _ = _boundary(tmp_path, fail=True)
    with pytest.raises(RuntimeError):
        steps.at_boundary(9)
    assert not list(rundir.iter_events(tmp_path, ["applied"]))
    relaunched = Restorer(tmp_path)
    StepBoundary(ControlApplier(tmp_path), relaunched).at_boundary(4)  # the relaunch's first boundary
    assert relaunched.restored == []


def test_forgetting_the_abandoned_saves_keeps_verls_pruning_off_the_new_ones() -> None:
    manager = SimpleNamespace(previous_saved_paths=[f"/c/global_step_{s}/actor" for s in (2, 4, 6, 8)])
    assert apply.forget_saves_after(manager, 4) == 2
    assert manager.previous_saved_paths == ["/c/global_step_2/actor", "/c/global_step_4/actor"]
    assert apply.forget_saves_after(SimpleNamespace(), 4) == 0  # a manager without the list: nothing to do


def test_a_restore_in_process_is_priced_as_the_steps_trained_again_with_no_start_up() -> None:
    cost = CostModel(startup_s=240.0, step_time_s=3.0).restore(4)
    assert (cost.seconds, cost.steps_lost, cost.relaunch) == (12.0, 4, False)
    assert cost.describe() == "in process: 12 s (4 steps trained again)"
    assert CostModel(startup_s=240.0, step_time_s=3.0).relaunch(4).describe().startswith("relaunch: 252 s")
    assert CostModel().restore(0).describe() == "in process: 0 s (no step lost)"  # not "live": it restores
    entry = {"payload": {"cost": cost.to_json()}, "result": {"first_step_s": 6.2}, "status": "done"}
    assert cost_text([entry]) == "in process 6 s measured, 4 steps again"


def test_the_first_step_after_a_rollback_is_judged_against_the_two_runs_own_noise_before_it() -> None:
    """bench/verl_e2e's comparison of a rollback in process with the same rollback by relaunch: under full
    determinism the two runs differ before the rollback only by float order; the first step after it agrees
    when it differs by no more than that (or 1% of the metric's scale, or, for a metric that is noise itself,
    its level before), and a step from another state does not."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import verl_e2e

    def run(vf: list[float], noise: list[float], first_vf: float) -> Any:
        steps = [1, 2, 3, 4, 3]  # a rollback from 4 to the checkpoint of 2
        values = [*vf, first_vf]
        records = [{"step": s, "data": {"critic/vf_loss": v, "rollout_corr/kl": n, "timing_s/step": 9.0 * s}}
                   for s, v, n in zip(steps, values, noise, strict=True)]
        return SimpleNamespace(metrics=lambda: records)

    vf = [0.50, 0.40, 0.30, 0.20]
    inproc = run(vf, [1e-4, -2e-4, 3e-4, 1e-4, -2e-4], 0.30)
    relaunch = run([v + 1e-3 for v in vf], [2e-4, -1e-4, 1e-4, 2e-4, 0.5e-4], 0.3008)
    agree = verl_e2e.first_step_agreement(inproc, relaunch)
    assert set(agree) == {"critic/vf_loss", "rollout_corr/kl"}  # timings are the machine's, not the step's
    assert agree["critic/vf_loss"] == pytest.approx((0.30, 0.3008, 0.00501))  # 1% of 0.501 over the 0.001 gaps
    assert agree["rollout_corr/kl"][2] == pytest.approx(3e-4)  # noise itself: its level before, over the 2e-4 gaps
    assert all(abs(a - b) <= noise for a, b, noise in agree.values())
    elsewhere = run([v + 1e-3 for v in vf], [2e-4, -1e-4, 1e-4, 2e-4, 0.5e-4], 0.2)  # the state of step 4
    a, b, noise = verl_e2e.first_step_agreement(inproc, elsewhere)["critic/vf_loss"]
    assert abs(a - b) > noise
