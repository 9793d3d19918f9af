"""Issue 48, finding 7: a relaunch's checkpoint that cannot be loaded falls back, for every trainer.

One policy (``Actuator._fall_back``): a relaunch or rollback target that fails verification before the
relaunch, or that the trainer says it could not load (an ``error`` event, ``what: resume``), is recorded
unloadable and the relaunch goes to the newest known-good checkpoint before it, else the start, said in an
alert; never to the same bad checkpoint twice. verl's layout is built by hand (no verl is run): its files
checked by the watchdog's own verification, and a verl attempt that died loading its checkpoint read from
its log as the glue reads it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_reliability_v3 import drive_restart, to_checkpoint

from ppo_watchdog.backends import verl_exits
from ppo_watchdog.backends.zero_patch import VerlGlue, init_run
from ppo_watchdog.control.controller import RULE_RESUME
from ppo_watchdog.control.daemon import build_watchdog
from ppo_watchdog.control.store import UNLOADABLE, Phase
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.events import RESUME_FAILED
from ppo_watchdog.protocol.runinfo import RunInfo

RULES = "version: 1\nrules: []\n"


def _rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return path


def _verl_checkpoint(root: Path, step: int, world_size: int = 1) -> Path:
    """verl's own layout, by hand: every rank's model/optim/extra_state, data.pt, then the marker."""
    torch = pytest.importorskip("torch")
    path = ckpt.step_dir(root, step)
    for rank in range(world_size):
        for kind in ckpt.VERL_KINDS:
            f = ckpt.verl_file(path / "actor", kind, world_size, rank)
            f.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"step": step, "w": torch.full((4,), float(step))}, f)
    torch.save({"batches": step}, path / ckpt.VERL_DATA_FILE)
    (root / rundir.LATEST_MARKER).write_text(str(step))
    return path


def _verl_run(tmp_path: Path, steps: tuple[int, ...]) -> tuple[Path, Path]:
    run = tmp_path / "run"
    run.mkdir()
    command = ["python3", "-m", "verl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path / 'ckpts'}",
               "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "algorithm.adv_estimator=grpo"]
    init_run(run, command)
    root = tmp_path / "ckpts"
    for step in steps:
        _verl_checkpoint(root, step)
    return run, root


@pytest.mark.parametrize("bad", ["data.pt", "actor/optim_world_size_1_rank_0.pt"])
def test_a_verl_file_verl_could_not_load_fails_verification_naming_it(tmp_path: Path, bad: str) -> None:
    run, root = _verl_run(tmp_path, (2,))
    glue = VerlGlue(run, "run", RunInfo.read(run))
    glue.verify(ckpt.step_dir(root, 2))  # intact: no error
    target = ckpt.step_dir(root, 2) / bad
    target.write_bytes(target.read_bytes()[:40])  # truncated, as a save cut short or a full disk leaves it
    with pytest.raises(ckpt.CheckpointError) as err:
        glue.verify(ckpt.step_dir(root, 2))
    assert bad.rsplit("/", 1)[-1] in str(err.value) and "cannot be loaded" in str(err.value)


def test_a_corrupt_verl_known_good_checkpoint_falls_back_to_the_one_before_then_the_start_never_twice(
        tmp_path: Path) -> None:
    run, root = _verl_run(tmp_path, (2, 4))
    (ckpt.step_dir(root, 4) / ckpt.VERL_DATA_FILE).write_bytes(b"garbage, not a torch archive")
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    ctl = wd.add_run(run, run_id="run", command=[sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        entry = drive_restart(wd, ctl, to_checkpoint(root, 4), rounds=3)
        assert entry.status == "done", entry
        assert entry.payload["resume_path"] == str(ckpt.step_dir(root, 2))
        assert "restarted from step 2" in entry.result["outcome"], entry.result
        assert "cannot be loaded" in entry.result["outcome"] and "data.pt" in entry.result["outcome"]
        alerts = [p["alerts"][0]["annotations"]["description"] for p in wd.actuator.notifier.sent]
        assert any("step 4" in a and "cannot be loaded" in a for a in alerts), alerts
        # Recorded: no later relaunch of any kind goes to step 4 again, though it is the newest complete one.
        assert [s.start_step for s in wd.store.bad_spans("run") if s.rule == UNLOADABLE] == [4]
        assert wd.actuator._resolve_checkpoint(ctl.h, "latest").step == 2
        # Step 2 turns out unloadable too: the next relaunch goes to the start, set aside, said.
        ctl.h.proc.stop(5)
        (ckpt.step_dir(root, 2) / "actor" / "optim_world_size_1_rank_0.pt").write_bytes(b"\0" * 64)
        entry = drive_restart(wd, ctl, {"rule": "watchdog:oom", "resume": "latest"}, rounds=3)
        assert entry.status == "done" and entry.payload["resume"] == "scratch", entry
        assert "restarted from the start" in entry.result["outcome"] and "step 2" in entry.result["outcome"]
        assert not ckpt.step_dir(root, 2).exists() and not ckpt.step_dir(root, 4).exists()  # set aside
        cmdline = Path(f"/proc/{ctl.h.proc.pid}/cmdline").read_text()
        assert "global_step_" not in cmdline and "resume_mode=disable" in cmdline
    finally:
        if ctl.h.proc is not None:
            ctl.h.proc.stop(5)
        wd.close()


VERL_LOAD_FAILURE = """\
(TaskRunner pid=4242) Resuming from /ckpts/global_step_4, setting global step to 4
Traceback (most recent call last):
  File "/site-packages/verl/trainer/main_ppo.py", line 300, in run
    trainer.fit()
  File "/site-packages/verl/trainer/ppo/v1/trainer_base.py", line 1040, in fit
    self._load_checkpoint()
  File "/site-packages/verl/trainer/ppo/v1/trainer_base.py", line 895, in _load_checkpoint
    dataloader_state_dict = torch.load(dataloader_local_path, weights_only=False)
RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory
"""


def test_a_verl_attempt_that_died_loading_its_checkpoint_is_a_resume_failure_naming_the_checkpoint(
        tmp_path: Path) -> None:
    ec = verl_exits.classify(VERL_LOAD_FAILURE, 1)
    assert (ec.kind, ec.action) == ("resume", "crash") and "PytorchStreamReader" in ec.evidence
    # Any other crash is not one: a traceback that never ran through verl's checkpoint loading.
    assert verl_exits.classify(VERL_LOAD_FAILURE.replace("_load_checkpoint", "_validate"), 1).kind == "crash"
    run, root = _verl_run(tmp_path, (4,))
    glue = VerlGlue(run, "run", RunInfo.read(run))
    glue.prepare_launch(["python3", "-m", "verl.trainer.main_ppo"], {}, str(ckpt.step_dir(root, 4)))
    glue.launched(None, ["python3"], str(ckpt.step_dir(root, 4)))
    with open(run / "trainer.log", "a") as f:
        f.write(VERL_LOAD_FAILURE)
    glue.exit_class(1)
    (event,) = [e for e in rundir.read_jsonl(run / rundir.EVENTS).records if e["kind"] == "error"]
    assert event["what"] == RESUME_FAILED and event["path"] == str(ckpt.step_dir(root, 4)), event


def _corrupt_but_hashed(path: Path) -> None:
    """A checkpoint saved corrupt: a file whose bytes are not a torch archive, its checksum in the manifest
    matching (it verifies; only loading it fails)."""
    target = path / "actor" / ckpt.STATE_FILE
    target.write_bytes(b"not a torch archive")
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"]["actor/" + ckpt.STATE_FILE] = ckpt._sha256(target.read_bytes())
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _tick_until(ctl: object, cond: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        ctl.tick()  # type: ignore[attr-defined]
        time.sleep(0.1)


def test_the_embedded_trainer_that_cannot_load_a_relaunchs_checkpoint_is_relaunched_from_the_one_before(
        tmp_path: Path, tiny_trainer_args: Callable[..., list[str]], trainer_env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in trainer_env.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    cmd = tiny_trainer_args(run, "trainer.save_freq=2", steps=4)
    import subprocess

    subprocess.run(cmd, check=True, env=dict(os.environ), capture_output=True, timeout=300)
    root = run / rundir.CHECKPOINTS
    assert [c.step for c in ckpt.list_checkpoints(root) if c.complete] == [2, 4]
    _corrupt_but_hashed(ckpt.step_dir(root, 4))
    wd = build_watchdog(tmp_path / "state", [_rules(tmp_path)])
    ctl = wd.add_run(run, run_id="run", command=tiny_trainer_args(run, "trainer.save_freq=2", steps=6))
    aid = wd.store.add_action("run", "restart", {"rule": "nan_rollback", "resume": "path",
                                                 "resume_path": str(ckpt.step_dir(root, 4)), "resume_step": 4})
    try:
        wd.actuator.drive(ctl.h, wd.store.get_action(aid), time.time())  # verifies (the hashes match): launched
        _tick_until(ctl, lambda: ctl.run.phase in (Phase.FINISHED, Phase.FAILED), "the run to end")
        assert ctl.run.phase == Phase.FINISHED, [(j.kind, j.result) for j in wd.store.journal("run")]
        events = rundir.read_jsonl(run / rundir.EVENTS).records
        (failed,) = [e for e in events if e.get("what") == RESUME_FAILED]
        assert failed["path"] == str(ckpt.step_dir(root, 4))
        starts = [e for e in events if e["kind"] == "started"]
        assert [s["resumed_from"] for s in starts][-1] == 2  # the checkpoint before, once; step 4 never again
        restarts = [j for j in wd.store.journal("run") if j.kind == "restart"]
        assert [j.payload.get("resume_path") for j in restarts] == [str(ckpt.step_dir(root, 4)),
                                                                  str(ckpt.step_dir(root, 2))]
        assert "cannot be loaded" in restarts[1].result["outcome"], restarts[1].result
        assert any(d["rule"] == RULE_RESUME for d in wd.store.decisions("run"))
        assert ctl.run.restarts == 0  # a fallback is not a crash: the restart budget is untouched
        alerts = [p["alerts"][0]["annotations"]["description"] for p in wd.actuator.notifier.sent]
        assert any("step 4" in a and "cannot be loaded" in a for a in alerts), alerts
    finally:
        if ctl.h.proc is not None:
            ctl.h.proc.stop(5)
        wd.close()
