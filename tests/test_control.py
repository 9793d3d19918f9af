"""control.json: versions, garbled files, unknown keys, one-shot commands across restarts."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.control import Command, Control, ControlApplier, write_control

KL = "algorithm.kl_ctrl.kl_coef"
LR = "actor_rollout_ref.actor.optim.lr"


def _write(run_dir: Path, version: int, overrides: dict | None = None, commands: list | None = None) -> None:
    cmds = tuple(Command(c["id"], c["kind"], {k: v for k, v in c.items() if k not in ("id", "kind")}) for c in commands or [])
    write_control(run_dir, Control(version, overrides or {}, cmds))


def _events(run_dir: Path, kind: str) -> list[dict]:
    return rundir.iter_events(run_dir, [kind])


def test_no_control_file_means_no_changes(tmp_path: Path) -> None:
    ctl = ControlApplier(tmp_path)
    assert ctl.poll(1) is None
    assert ctl.current_overrides() == {}
    assert not (tmp_path / rundir.EVENTS).exists()


def test_a_new_version_is_returned_and_applied_records_version_and_step(tmp_path: Path) -> None:
    _write(tmp_path, 3, {KL: 0.0012})
    ctl = ControlApplier(tmp_path)
    changes = ctl.poll(7)
    assert changes is not None and changes.version == 3 and changes.overrides == {KL: 0.0012} and changes.commands == []
    ctl.mark_applied(changes, 7, {KL: 0.0012})
    [ev] = _events(tmp_path, "applied")
    assert (ev["version"], ev["step"], ev["applied"], ev["commands"]) == (3, 7, {KL: 0.0012}, [])
    assert ctl.applied_version == 3


def test_the_same_version_twice_is_a_no_op(tmp_path: Path) -> None:
    _write(tmp_path, 1, {KL: 0.002})
    ctl = ControlApplier(tmp_path)
    ctl.mark_applied(ctl.poll(1), 1, {KL: 0.002})  # type: ignore[arg-type]
    assert ctl.poll(2) is None
    _write(tmp_path, 1, {KL: 0.5})  # rewritten without a version bump: still version 1
    assert ctl.poll(3) is None
    _write(tmp_path, 0, {KL: 0.5})  # an older version is never applied
    assert ctl.poll(4) is None
    assert len(_events(tmp_path, "applied")) == 1


def test_changed_lists_only_what_differs_from_the_last_applied_version(tmp_path: Path) -> None:
    ctl = ControlApplier(tmp_path)
    _write(tmp_path, 1, {KL: 0.002, LR: 1e-4})
    ctl.mark_applied(ctl.poll(1), 1, {})  # type: ignore[arg-type]
    _write(tmp_path, 2, {KL: 0.003, LR: 1e-4})
    changes = ctl.poll(2)
    assert changes is not None and changes.changed == {KL: 0.003} and changes.overrides == {KL: 0.003, LR: 1e-4}


def test_garbled_json_gives_one_error_event_naming_file_and_position_then_recovers(tmp_path: Path) -> None:
    _write(tmp_path, 1, {KL: 0.002})
    ctl = ControlApplier(tmp_path)
    ctl.mark_applied(ctl.poll(1), 1, {KL: 0.002})  # type: ignore[arg-type]
    (tmp_path / "control.json").write_text('{"version": 2,\n "overrides": {"algorithm.kl_ctrl.kl_coef": 0.00')
    for step in (2, 3, 4):
        assert ctl.poll(step) is None
    [err] = _events(tmp_path, "error")
    assert str(tmp_path / "control.json") in err["message"]
    assert "line 2, column" in err["message"] and err["step"] == 2
    # training goes on with what it has; a fixed file is then applied
    assert ctl.current_overrides() == {KL: 0.002}
    _write(tmp_path, 2, {KL: 0.003})
    assert ctl.poll(5).overrides == {KL: 0.003}  # type: ignore[union-attr]
    # a different bad content is reported again
    (tmp_path / "control.json").write_text("[]")
    assert ctl.poll(6) is None
    assert len(_events(tmp_path, "error")) == 2


def test_an_unknown_key_is_an_error_naming_the_key_and_the_version_is_not_applied(tmp_path: Path) -> None:
    _write(tmp_path, 4, {KL: 0.002, "data.train_batch_size": 64})
    ctl = ControlApplier(tmp_path)
    assert ctl.poll(1) is None
    assert ctl.poll(2) is None
    [err] = _events(tmp_path, "error")
    assert "data.train_batch_size" in err["message"] and err["keys"] == ["data.train_batch_size"]
    assert err["version"] == 4
    assert ctl.applied_version == 0


def test_live_keys_can_be_narrowed(tmp_path: Path) -> None:
    _write(tmp_path, 1, {LR: 1e-5})
    ctl = ControlApplier(tmp_path, live_keys=[KL])
    assert ctl.poll(1) is None
    assert LR in _events(tmp_path, "error")[0]["message"]


def test_a_bad_command_kind_is_an_error_event(tmp_path: Path) -> None:
    (tmp_path / "control.json").write_text('{"version": 1, "commands": [{"id": "c1", "kind": "explode"}]}')
    assert ControlApplier(tmp_path).poll(1) is None
    assert "'explode'" in _events(tmp_path, "error")[0]["message"]


def test_one_shot_commands_run_once_even_across_a_restart(tmp_path: Path) -> None:
    _write(tmp_path, 1, {KL: 0.002}, [{"id": "c1", "kind": "checkpoint"}])
    ctl = ControlApplier(tmp_path)
    changes = ctl.poll(5)
    assert changes is not None and [c.id for c in changes.commands] == ["c1"]
    ctl.mark_applied(changes, 5, {KL: 0.002})
    assert _events(tmp_path, "applied")[0]["commands"] == ["c1"]

    # the watchdog adds a rollback in version 2, keeping c1 in the list (desired state)
    _write(tmp_path, 2, {KL: 0.004}, [{"id": "c1", "kind": "checkpoint"}, {"id": "c2", "kind": "rollback", "to_step": 5}])
    restarted = ControlApplier(tmp_path)  # a fresh process over the same run directory
    assert restarted.poll(6) is not None
    changes = restarted.poll(6)
    assert changes is not None and [(c.id, c.kind, c.args) for c in changes.commands] == [("c2", "rollback", {"to_step": 5})]
    restarted.mark_executed(["c2"])  # before acting on it
    again = ControlApplier(tmp_path)  # crashed while rolling back, restarted again
    changes = again.poll(3)
    assert changes is not None and changes.commands == []  # the rollback is not re-run...
    assert again.current_overrides() == {KL: 0.004}  # ...but the overrides are re-applied before step 1


def test_a_restarted_trainer_does_not_reapply_the_applied_version(tmp_path: Path) -> None:
    _write(tmp_path, 2, {KL: 0.002}, [{"id": "p", "kind": "pause"}])
    ctl = ControlApplier(tmp_path)
    ctl.mark_applied(ctl.poll(1), 1, {KL: 0.002})  # type: ignore[arg-type]
    restarted = ControlApplier(tmp_path)
    assert restarted.poll(2) is None and restarted.applied_version == 2
    assert restarted.current_overrides() == {KL: 0.002}


def test_current_overrides_falls_back_to_the_last_applied_when_control_json_is_garbled(tmp_path: Path) -> None:
    _write(tmp_path, 1, {LR: 3e-5})
    ControlApplier(tmp_path).mark_applied(ControlApplier(tmp_path).poll(1), 1, {})  # type: ignore[arg-type]
    (tmp_path / "control.json").write_text("{")
    assert ControlApplier(tmp_path).current_overrides() == {LR: 3e-5}


def test_a_damaged_state_file_is_refused_rather_than_rerunning_commands(tmp_path: Path) -> None:
    (tmp_path / ".control_state.json").write_text("{nope")
    with pytest.raises(ValueError, match=".control_state.json"):
        ControlApplier(tmp_path)


def test_sigusr1_wakes_the_applier(tmp_path: Path) -> None:
    ctl = ControlApplier(tmp_path)
    old = signal.getsignal(signal.SIGUSR1)
    try:
        ctl.install_signal_handler()
        assert not ctl.woken
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ctl.wait(2.0) and ctl.woken
        ctl.poll(1)
        assert not ctl.woken
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_every_event_the_applier_records_is_also_handed_to_on_event(tmp_path: Path) -> None:
    seen: list[dict] = []
    ctl = ControlApplier(tmp_path, on_event=seen.append)
    (tmp_path / "control.json").write_text("{")
    ctl.poll(1)
    _write(tmp_path, 1, {KL: 0.002})
    ctl.mark_applied(ctl.poll(2), 2, {KL: 0.002})  # type: ignore[arg-type]
    assert [e["kind"] for e in seen] == ["error", "applied"]
    assert seen == rundir.iter_events(tmp_path)
