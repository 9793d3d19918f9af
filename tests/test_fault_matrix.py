"""The fault-injection matrix (issue 14; counts in RELIABILITY.md from ``bench/faults.py``).

Each cell is one fault made on purpose, through the code path of the real fault:

- **kill -9 of the watchdog** at each phase of each action kind (``WATCHDOG_TEST_CRASH_AT``: the
  watchdog SIGKILLs itself right after that phase), then a second watchdog on the same state:
  the action happens exactly once (one ``applied`` per control version, one rollback, one
  relaunch) and the run ends normally;
- **disk full** (a real tmpfs filled to the last byte) during a checkpoint save and during a
  state write: the save fails without a visible checkpoint, the tick keeps nothing and the next
  one, with space again, decides.

The other cells of the matrix are tests elsewhere, named in RELIABILITY.md (trainer killed during
a checkpoint write, Prometheus down and back, the state locked and corrupt, a trainer that ignores
SIGTERM). ``make test`` runs one kill -9 cell per action kind; ``WATCHDOG_FAULT_MATRIX=1`` (the
bench) runs all of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_watchdog_run import KL_RULE, NAN_RULE, OOM_RULE, _events, _history, _rules, _watchdog

from ppo_watchdog.control.actuator import CRASH_POINTS
from ppo_watchdog.control.daemon import build_watchdog
from ppo_watchdog.control.store import Store, StoreError
from ppo_watchdog.protocol import checkpoint as ck
from ppo_watchdog.protocol import rundir

FULL_MATRIX = os.environ.get("WATCHDOG_FAULT_MATRIX") == "1"

#: action kind -> (rules, faults, trainer steps, the phases it passes through)
KINDS = {
    "live_set": (KL_RULE, "", 150, ("decided", "control_written", "signalled")),
    "rollback": (NAN_RULE, "nan@12", 150, ("decided", "control_written", "signalled")),
    "restart": (OOM_RULE, "oom@6", 40, ("decided", "stopped", "launched")),
}
#: The cell of each kind ``make test`` runs (the phase with the most left to redo).
IN_SUITE = {("live_set", "signalled"), ("rollback", "control_written"), ("restart", "launched")}
CELLS = [pytest.param(kind, phase, marks=[] if FULL_MATRIX or (kind, phase) in IN_SUITE else
                      pytest.mark.skip(reason="the full matrix runs in bench/faults.py (WATCHDOG_FAULT_MATRIX=1)"),
                      id=f"{kind}@{phase}")
         for kind, (_, _, _, phases) in KINDS.items() for phase in phases]


def test_every_crash_point_is_a_cell() -> None:
    assert {p for *_, phases in KINDS.values() for p in phases} == set(CRASH_POINTS)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "phase"), CELLS)
def test_a_watchdog_killed_mid_action_then_rerun_acts_exactly_once(tmp_path: Path, kind: str, phase: str) -> None:
    rules_text, faults, steps, _ = KINDS[kind]
    rules = _rules(tmp_path, rules_text)
    first = _watchdog(tmp_path, rules, steps=steps, faults=faults, extra=["--verbose"],
                      env={"WATCHDOG_TEST_CRASH_AT": phase})
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    second = _watchdog(tmp_path, rules, steps=steps, faults=faults, extra=["--verbose"])
    assert second.returncode == 0, second.stdout + second.stderr
    assert _events(tmp_path, "finished"), "the run did not end"
    versions = [e["version"] for e in _events(tmp_path, "applied") if e.get("version")]
    assert len(versions) == len(set(versions)), f"a control version applied twice: {versions}"
    decisions = [h for h in _history(tmp_path) if h["rule"] == {"live_set": "kl_high", "rollback": "nan_rollback",
                                                                 "restart": "oom"}[kind]]
    assert len(decisions) == 1 and decisions[0]["status"] == "applied", decisions
    # Every process the watchdogs launched (their console says so with --verbose), not only those that got as far as
    # a `started` event: a second launch killed while importing torch would leave no event.
    launches = (first.stdout + first.stderr + second.stdout + second.stderr).count("started pid ")
    assert launches == (2 if kind == "restart" else 1), f"{launches} trainers launched"
    starts = _events(tmp_path, "started")
    if kind == "live_set":
        assert len(starts) == 1 and len(versions) == 1
    elif kind == "rollback":
        assert len(_events(tmp_path, "rollback")) == 1 and len(starts) == 1
    else:
        # One relaunch: the first start, then the one after the OOM (the fault fires once per run dir).
        assert len(starts) == 2, [(s.get("attempt"), s.get("resumed_from")) for s in starts]
    journal = decisions[0]["journal"]
    assert all(j["status"] == "done" for j in journal), journal


# -- SIGTERM mid-action (issue 20) -----------------------------------------------------------------

#: The SIGTERM cell of each kind ``make test`` runs.
TERM_IN_SUITE = {("restart", "stopped")}
TERM_CELLS = [pytest.param(kind, phase, marks=[] if FULL_MATRIX or (kind, phase) in TERM_IN_SUITE else
                           pytest.mark.skip(reason="the full matrix runs in bench/faults.py (WATCHDOG_FAULT_MATRIX=1)"),
                           id=f"{kind}@{phase}")
              for kind, (_, _, _, phases) in KINDS.items() for phase in phases]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "phase"), TERM_CELLS)
def test_a_watchdog_sigtermed_mid_action_stops_cleanly_then_a_rerun_acts_exactly_once(
        tmp_path: Path, kind: str, phase: str) -> None:
    rules_text, faults, steps, _ = KINDS[kind]
    rules = _rules(tmp_path, rules_text)
    first = _watchdog(tmp_path, rules, steps=steps, faults=faults, extra=["--verbose"],
                      env={"WATCHDOG_TEST_CRASH_AT": phase, "WATCHDOG_TEST_CRASH_SIGNAL": "TERM"})
    out = first.stdout + first.stderr
    # A clean stop (SIGTERM is not desertion): the action in flight finished, the trainer stopped, the run recorded.
    assert first.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out and "Traceback" not in out, out
    state = Store(tmp_path / "state")
    run = state.require_run("run")
    assert run.phase == "stopped"
    pid = run.pid
    state.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # never left training unsupervised
    second = _watchdog(tmp_path, rules, steps=steps, faults=faults, extra=["--verbose"])
    assert second.returncode == 0, second.stdout + second.stderr
    assert _events(tmp_path, "finished"), "the run did not end"
    versions = [e["version"] for e in _events(tmp_path, "applied") if e.get("version")]
    assert len(versions) == len(set(versions)), f"a control version applied twice: {versions}"
    rule = {"live_set": "kl_high", "rollback": "nan_rollback", "restart": "oom"}[kind]
    decisions = [h for h in _history(tmp_path) if h["rule"] == rule]
    assert len(decisions) == 1 and decisions[0]["status"] == "applied", decisions
    journal = decisions[0]["journal"]
    assert all(j["status"] == "done" for j in journal), journal
    history = _history(tmp_path)
    if kind == "restart":  # the OOM's one relaunch (the controller's own decision), not one per watchdog
        relaunches = [j for h in history if h["rule"] == "watchdog:oom" for j in h["journal"] if j["kind"] == "restart"]
        assert len(relaunches) == 1 and relaunches[0]["status"] == "done", relaunches
    if kind == "rollback":  # rolled back once: in process, or by a restart from the known-good checkpoint
        by_restart = [j for j in journal if j["kind"] == "restart"]
        assert len(_events(tmp_path, "rollback")) + len(by_restart) == 1, (journal, _events(tmp_path, "rollback"))


# -- disk full ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (needs CAP_SYS_ADMIN, as root in a container has; else skipped)."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): the disk-full cells need one")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(disk: Path) -> Path:
    """Write a file until the disk has not one byte left."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return filler


@pytest.mark.skipif(not FULL_MATRIX, reason="the full matrix runs in bench/faults.py (WATCHDOG_FAULT_MATRIX=1)")
def test_disk_full_during_a_checkpoint_save_leaves_the_previous_one_the_newest(small_disk: Path) -> None:
    torch = pytest.importorskip("torch")
    root = small_disk / "ckpt"
    ck.save_checkpoint(root, 5, 1, {"actor": {"w": torch.ones(1000)}, "critic": {"w": torch.zeros(1000)}})
    filler = _fill(small_disk)
    with pytest.raises(OSError):
        ck.save_checkpoint(root, 10, 2, {"actor": {"w": torch.ones(100_000)}, "critic": {"w": torch.zeros(100_000)}})
    assert [c.step for c in ck.list_checkpoints(root) if c.complete] == [5]
    assert ck.latest_complete(root).step == 5  # type: ignore[union-attr]
    ck.load_checkpoint(ck.latest_complete(root).path)  # type: ignore[union-attr]  # the old one loads whole
    filler.unlink()
    ck.save_checkpoint(root, 15, 3, {"actor": {"w": torch.ones(10)}, "critic": {"w": torch.zeros(10)}})
    assert ck.latest_complete(root).step == 15  # type: ignore[union-attr]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # the torn save was swept


@pytest.mark.skipif(not FULL_MATRIX, reason="the full matrix runs in bench/faults.py (WATCHDOG_FAULT_MATRIX=1)")
def test_disk_full_during_a_state_write_keeps_nothing_then_decides(tmp_path: Path, small_disk: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n  - name: nan\n    description: a NaN\n    expr: nonfinite()\n"
                     "    actions: [notify]\n")
    wd = build_watchdog(small_disk / "state", [rules])
    ctl = wd.add_run(run, managed=False)
    for i, v in enumerate([0.01, float("nan"), float("nan")], start=1):
        rundir.append_metrics(run, i, {"actor/reward_kl_penalty": v, "critic/score/mean": 0.5})
    filler = _fill(small_disk)
    wd.tick()  # the commit fails on a full disk: no decision, no position kept
    assert wd.store.decisions(ctl.run.run_id) == []
    filler.unlink()
    wd.tick()
    decisions = wd.store.decisions(ctl.run.run_id)
    assert [d["step"] for d in decisions] == [2], decisions
    wd.store.close()
    again = Store(small_disk / "state")  # the database is whole after the failed write
    assert [d["step"] for d in again.decisions(ctl.run.run_id)] == [2]
    again.close()
    shutil.rmtree(small_disk / "state")
    with pytest.raises(StoreError):
        _fill(small_disk)
        Store(small_disk / "state")  # a new state on a full disk is an error naming it, not a traceback
