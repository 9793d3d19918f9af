"""``python -m ppo_watchdog.trainer`` against the run-directory protocol, as real subprocesses on the tiny model.

Each test launches the trainer (a few seconds each, most of it imports) and checks only
what the watchdog can see: exit codes, metrics.jsonl, events.jsonl, checkpoints/, /metrics.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ppo_watchdog.protocol import catalog, rundir
from ppo_watchdog.protocol import checkpoint as ck
from ppo_watchdog.protocol.control import Command, Control, write_control
from ppo_watchdog.protocol.runinfo import RunInfo

pytestmark = pytest.mark.slow

KL_COEF = "algorithm.kl_ctrl.kl_coef"
TIMEOUT = 180
# The session's tiny SFT model is rarely right, so scores (and advantages) are mostly zero;
# an entropy bonus gives the actor a real gradient every step, so runs move and compare non-trivially.
MOVE = "actor_rollout_ref.actor.entropy_coeff=0.01"
KL_START = 0.05  # pinned, so a change of the default cannot make a live change invisible


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Step -> data; the newest line for a step wins (a resumed run rewrites steps)."""
    out: dict[int, dict[str, float]] = {}
    for rec in rundir.read_jsonl(run_dir / rundir.METRICS).records:
        out[int(rec["step"])] = rec["data"]
    return out


def _events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return rundir.iter_events(run_dir, None if kind is None else [kind])


def _wait_for(pred: Callable[[], Any], proc: subprocess.Popen[str], what: str, timeout: float = 90) -> Any:
    end = time.time() + timeout
    while time.time() < end:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"trainer exited ({proc.returncode}) while waiting for {what}\n{err[-3000:]}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def _training_values(data: dict[str, float]) -> dict[str, float]:
    # wall-clock metrics differ between any two runs; everything else must not
    return {k: v for k, v in data.items() if not k.startswith("perf/")}


# -- resume continuity ------------------------------------------------------------------------------


def test_n_steps_straight_equal_half_then_resume_then_half_at_a_fixed_seed(
    tmp_path: Path, tiny_trainer_args: Callable[..., list[str]], trainer_env: dict[str, str]
) -> None:
    """6 steps in one go (checkpoint at 3) vs a second process resuming from that step-3 checkpoint.

    The first half of the split run is the straight run's own first half, which saves one
    launch; the second half runs in a fresh run directory through resume_mode=resume_path.
    """
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    a = _run(tiny_trainer_args(straight, MOVE, "trainer.save_freq=3", steps=6), trainer_env)
    assert a.returncode == 0, a.stderr[-3000:]
    half = ck.step_dir(straight / rundir.CHECKPOINTS, 3)
    assert ck.verify_checkpoint(half).step == 3
    b = _run(tiny_trainer_args(resumed, MOVE, "trainer.save_freq=3", "trainer.resume_mode=resume_path",
                               f"trainer.resume_from_path={half}", steps=6), trainer_env)
    assert b.returncode == 0, b.stderr[-3000:]

    assert [e["resumed_from"] for e in _events(resumed, "started")] == [3]
    ma, mb = _metrics(straight), _metrics(resumed)
    assert sorted(ma) == [1, 2, 3, 4, 5, 6] and sorted(mb) == [4, 5, 6]
    # the run actually learned something, so equality is not the trivial all-zero case
    assert all(ma[s]["actor/grad_norm"] > 0 for s in ma) and any(ma[s]["actor/reward_kl_penalty"] > 0 for s in ma)
    for step in (4, 5, 6):
        assert _training_values(mb[step]) == _training_values(ma[step]), f"step {step} differs after resume"
    # and the final weights are bit-identical
    wa, _ = ck.load_checkpoint(ck.step_dir(straight / rundir.CHECKPOINTS, 6))
    wb, _ = ck.load_checkpoint(ck.step_dir(resumed / rundir.CHECKPOINTS, 6))
    for name, w in wa["actor"]["model"].items():
        assert torch.equal(w, wb["actor"]["model"][name]), name
    assert ck.read_marker(resumed / rundir.CHECKPOINTS) == 6


ADAPTIVE = ("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.000001", "algorithm.kl_ctrl.horizon=100")


def test_an_adaptive_kl_controller_resumes_its_learned_value_unless_a_remedy_set_a_new_starting_point(
    tmp_path: Path, tiny_trainer_args: Callable[..., list[str]], trainer_env: dict[str, str]
) -> None:
    """Issue 21, item 7: a kl_coef change sets the adaptive controller's value as the run resumes; the
    same configured value resumes what the controller learned (the watchdog never fights it)."""
    first = tmp_path / "first"
    a = _run(tiny_trainer_args(first, MOVE, *ADAPTIVE, f"{KL_COEF}={KL_START}", "trainer.save_freq=2", steps=2),
             trainer_env)
    assert a.returncode == 0, a.stderr[-3000:]
    half = ck.step_dir(first / rundir.CHECKPOINTS, 2)
    learned = float(ck.load_checkpoint(half)[1]["kl_coef"])
    assert learned != pytest.approx(KL_START)  # the controller moved (KL far above its tiny target)
    coef = catalog.BY_SHORT["kl_coef"].key
    for name, start, expect in (("same", KL_START, learned), ("raised", 0.2, 0.2)):
        run = tmp_path / name
        b = _run(tiny_trainer_args(run, MOVE, *ADAPTIVE, f"{KL_COEF}={start}", "trainer.resume_mode=resume_path",
                                   f"trainer.resume_from_path={half}", steps=3), trainer_env)
        assert b.returncode == 0, b.stderr[-3000:]
        assert _metrics(run)[3][coef] == pytest.approx(expect), name


def test_resume_skip_batches_moves_the_data_past_the_batches_after_the_checkpoint(
    tmp_path: Path, tiny_trainer_args: Callable[..., list[str]], trainer_env: dict[str, str]
) -> None:
    """A rollback by restart that skips the batches which led to a spike (trainer.resume_skip_batches)."""
    from ppo_watchdog.trainer.data import BatchSampler

    first, skipped = tmp_path / "first", tmp_path / "skipped"
    a = _run(tiny_trainer_args(first, "trainer.save_freq=2", steps=2), trainer_env)
    assert a.returncode == 0, a.stderr[-3000:]
    half = ck.step_dir(first / rundir.CHECKPOINTS, 2)
    b = _run(tiny_trainer_args(skipped, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={half}",
                               "trainer.resume_skip_batches=3", "trainer.save_freq=1", steps=3), trainer_env)
    assert b.returncode == 0, b.stderr[-3000:]
    assert [e["skipped_batches"] for e in _events(skipped, "started")] == [3]
    assert RunInfo.read(skipped).skip_batches_key == "trainer.resume_skip_batches"
    # The data state after step 3 is the checkpoint's, moved past 3 batches, then one batch used.
    saved = ck.load_checkpoint(half)[0]["data"]["sampler"]
    expect = BatchSampler(saved["n"], saved["batch_size"], saved["seed"])
    expect.load_state_dict(saved)
    expect.skip(3)
    expect.next()
    got = ck.load_checkpoint(ck.step_dir(skipped / rundir.CHECKPOINTS, 3))[0]["data"]["sampler"]
    assert got == expect.state_dict() and got != saved


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(mask >> (sig - 1) & 1)


def test_a_restart_from_an_earlier_checkpoint_drops_the_abandoned_timeline_and_survives_an_early_sigusr1(
    tmp_path: Path, tiny_trainer_args: Callable[..., list[str]], trainer_env: dict[str, str]
) -> None:
    """Rollback by restart: resume_path to an older checkpoint of the same run, signalled while starting."""
    import signal

    run = tmp_path / "run"
    a = _run(tiny_trainer_args(run, "trainer.save_freq=2", steps=4), trainer_env)
    assert a.returncode == 0, a.stderr[-3000:]
    root = run / rundir.CHECKPOINTS
    assert [c.step for c in ck.list_checkpoints(root)] == [2, 4]
    proc = subprocess.Popen(tiny_trainer_args(run, "trainer.save_freq=100", "trainer.resume_mode=resume_path",
                                              f"trainer.resume_from_path={ck.step_dir(root, 2)}", steps=3),
                            env=trainer_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # The watchdog writes control.json and signals at once, while this process still imports torch
    # (from the moment its main() catches SIGUSR1: before that the interpreter itself is starting,
    # and the watchdog signals only a trainer whose run.json carries its pid).
    deadline = time.monotonic() + TIMEOUT
    while proc.poll() is None and not _catches(proc.pid, signal.SIGUSR1) and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(8):
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
        time.sleep(0.15)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    # Step 4 of the abandoned timeline is gone, so no later resume can pick it.
    assert [c.step for c in ck.list_checkpoints(root)] == [2] and ck.read_marker(root) == 2
    assert [e["resumed_from"] for e in _events(run, "started")] == [0, 2]


# -- live control, garbled control.json, pause/resume, SIGUSR1, /metrics ------------------------------


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory, tiny_trainer_args: Callable[..., list[str]],
             trainer_env: dict[str, str]) -> dict[str, Any]:
    """One trainer driven through a scripted session; the tests below check what it recorded.

    garbled control.json at launch -> a hang fault at step 3 holds the trainer while a valid
    version 1 (kl_coef + pause) is written -> paused: scrape /metrics -> version 2 (resume)
    with SIGUSR1 -> the run finishes.
    """
    run_dir = tmp_path_factory.mktemp("live")
    control = run_dir / rundir.CONTROL
    control.write_text('{"version": 1,\n  "overrides": {"algorithm.kl_ctrl.kl_coef": 0.0')
    argv = tiny_trainer_args(run_dir, f"{KL_COEF}={KL_START}", "trainer.metrics_port=-1", "trainer.faults=hang@3:4",
                             steps=12)
    proc = subprocess.Popen(argv, env=trainer_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    obs: dict[str, Any] = {"run_dir": run_dir}
    try:
        _wait_for(lambda: _events(run_dir, "fault"), proc, "the hang fault at step 3")
        write_control(run_dir, Control(1, {KL_COEF: 0.0123}, (Command("p1", "pause"),)))
        obs["steps_done_at_write"] = max(_metrics(run_dir), default=0)
        _wait_for(lambda: _events(run_dir, "paused"), proc, "the pause")
        port = RunInfo.read(run_dir).metrics_port
        obs["port"] = port
        obs["exposition"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        obs["metrics_while_paused"] = _metrics(run_dir)
        time.sleep(0.5)
        obs["steps_after_pausing"] = max(_metrics(run_dir), default=0)
        write_control(
            run_dir,
            Control(2, {KL_COEF: 0.0123}, (Command("p1", "pause"), Command("r1", "resume"))),
        )
        t_signal = time.time()
        os.kill(proc.pid, signal.SIGUSR1)
        applied2 = _wait_for(lambda: [e for e in _events(run_dir, "applied") if e["version"] == 2], proc, "version 2")
        obs["sigusr1_latency_s"] = applied2[0]["ts"] - t_signal
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    obs["returncode"], obs["stderr"] = proc.returncode, err
    return obs


def test_a_garbled_control_json_gives_an_error_event_and_training_goes_on(live_run: dict[str, Any]) -> None:
    run_dir = live_run["run_dir"]
    errors = [e for e in _events(run_dir, "error") if e.get("source") == "control"]
    assert len(errors) == 1, errors  # once per bad content, not once per step
    assert str(run_dir / "control.json") in errors[0]["message"] and "line 2, column" in errors[0]["message"]
    assert live_run["returncode"] == 0, live_run["stderr"][-3000:]
    assert sorted(_metrics(run_dir)) == list(range(1, 13))


def test_a_control_write_is_applied_at_the_next_step_boundary_with_version_and_step(live_run: dict[str, Any]) -> None:
    run_dir = live_run["run_dir"]
    [v1] = [e for e in _events(run_dir, "applied") if e["version"] == 1]
    assert v1["applied"] == {KL_COEF: 0.0123} and v1["commands"] == ["p1"]
    step = v1["step"]
    # written while step 3 hung: applied at the boundary right after the step in flight
    assert step <= live_run["steps_done_at_write"] + 1
    metrics = _metrics(run_dir)
    assert all(metrics[s]["actor/reward_kl_penalty_coeff"] == KL_START for s in metrics if s <= step)
    assert all(metrics[s]["actor/reward_kl_penalty_coeff"] == 0.0123 for s in metrics if s > step)


def test_pause_holds_training_until_resume_and_sigusr1_makes_it_read_at_once(live_run: dict[str, Any]) -> None:
    run_dir = live_run["run_dir"]
    assert live_run["steps_after_pausing"] == max(live_run["metrics_while_paused"])  # no step while paused
    kinds = [e["kind"] for e in _events(run_dir) if e["kind"] in ("paused", "resumed", "applied")]
    assert kinds == ["applied", "paused", "resumed", "applied"]
    [v2] = [e for e in _events(run_dir, "applied") if e["version"] == 2]
    assert v2["commands"] == ["r1"]  # p1 already ran: a one-shot command runs once
    assert live_run["sigusr1_latency_s"] < 2.0, live_run["sigusr1_latency_s"]


def test_metrics_endpoint_exposes_every_catalog_metric_for_the_run(live_run: dict[str, Any]) -> None:
    run_dir = live_run["run_dir"]
    run_id = RunInfo.read(run_dir).id
    families = {f.name: f for f in text_string_to_metric_families(live_run["exposition"])}
    last_step = max(live_run["metrics_while_paused"])
    last = live_run["metrics_while_paused"][last_step]
    for m in catalog.METRICS:
        assert m.prom in families, m.prom
        assert families[m.prom].documentation == m.help
        [sample] = [s for s in families[m.prom].samples if s.labels.get(catalog.RUN_LABEL) == run_id]
        if m.key in last:
            assert sample.value == pytest.approx(last[m.key], rel=1e-9, nan_ok=True), m.key
    events = _event_counts(live_run["exposition"])
    assert events["fault"] == 1 and events["paused"] == 1 and events["started"] == 1


def _event_counts(exposition: str) -> dict[str, float]:
    return {
        s.labels["kind"]: s.value
        for f in text_string_to_metric_families(exposition) if f.name == "ppo_events"
        for s in f.samples if s.name == "ppo_events_total"
    }


def test_control_events_are_counted_on_metrics_too(live_run: dict[str, Any]) -> None:
    events = _event_counts(live_run["exposition"])
    assert events.get("error") == 1 and events.get("applied") == 1


def test_the_metric_keys_written_are_all_in_the_catalog(live_run: dict[str, Any]) -> None:
    written = {k for data in _metrics(live_run["run_dir"]).values() for k in data}
    assert written, "no metrics written"
    assert sorted(k for k in written if catalog.canonical_key(k) is None) == []
    # and the list is all there
    must = {m.key for m in catalog.METRICS} - {"actor/kl_loss", "actor/kl_coef", "val-core/reward/mean@1"} \
        - catalog.VERL_ONLY_KEYS
    assert must <= written


# -- OOM ----------------------------------------------------------------------------------------------


def test_an_injected_oom_saves_state_exits_75_and_the_restart_continues_from_the_checkpoint(
    tmp_path: Path, tiny_trainer_args: Callable[..., list[str]], trainer_env: dict[str, str]
) -> None:
    # a live override and a one-shot checkpoint command are waiting before the first step
    write_control(tmp_path, Control(1, {KL_COEF: 0.04}, (Command("c1", "checkpoint"),)))
    first = _run(tiny_trainer_args(tmp_path, "trainer.faults=oom@3", steps=5), trainer_env)
    assert first.returncode == rundir.EXIT_OOM == 75, first.stderr[-3000:]
    [oom] = _events(tmp_path, "oom")
    assert oom["micro_batch_size"] == 8 and oom["step"] == 3
    ckpts = _events(tmp_path, "checkpoint")
    assert [(e["step"], e["reason"]) for e in ckpts] == [(0, "command c1"), (2, "oom")]  # last completed step
    info = ck.latest_complete(tmp_path / rundir.CHECKPOINTS)
    assert info is not None and info.step == 2
    assert sorted(_metrics(tmp_path)) == [1, 2]

    # what the watchdog does: relaunch with a smaller micro batch; the fault does not fire again
    second = _run(tiny_trainer_args(tmp_path, "trainer.faults=oom@3",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                    "critic.ppo_micro_batch_size_per_gpu=4", steps=5), trainer_env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [e["resumed_from"] for e in _events(tmp_path, "started")] == [0, 2]
    assert len(_events(tmp_path, "oom")) == 1
    assert sorted(_metrics(tmp_path)) == [1, 2, 3, 4, 5]
    # the restart re-applied the override before its first step but did not re-run the command
    assert _events(tmp_path, "started")[-1]["applied"] == {KL_COEF: 0.04}
    assert [e["reason"] for e in _events(tmp_path, "checkpoint")].count("command c1") == 1
    assert all(d["actor/reward_kl_penalty_coeff"] == 0.04 for d in _metrics(tmp_path).values())


def test_oom_retry_live_shrinks_the_micro_batch_and_goes_on_and_a_nan_skips_the_optimizer_step(
    tmp_path: Path, tiny_trainer_args: Callable[..., list[str]], trainer_env: dict[str, str]
) -> None:
    # 8 prompts of >= 12 tokens never fit in 96 tokens; 4 prompts of <= 16 + 8 tokens always do
    proc = _run(tiny_trainer_args(tmp_path, MOVE, "trainer.oom_retry_live=true", "trainer.memory_budget_tokens=96",
                                  "data.max_prompt_length=16", "data.max_response_length=8",
                                  "trainer.faults=nan@2", "trainer.save_freq=1", steps=3), trainer_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ooms = _events(tmp_path, "oom")
    assert ooms and all(e["micro_batch_size"] == 8 and e["action"] == "retry" for e in ooms)
    assert {e["new_micro_batch_size"] for e in ooms} == {4}
    assert {e["what"] for e in ooms} == {"critic", "actor"}
    assert sorted(_metrics(tmp_path)) == [1, 2, 3]

    nans = _events(tmp_path, "nan")
    assert nans and all(e["step"] == 2 and e["what"].startswith("actor") for e in nans)
    metrics = _metrics(tmp_path)
    assert not math.isfinite(metrics[2]["actor/pg_loss"]) or not math.isfinite(metrics[2]["actor/grad_norm"])
    root = tmp_path / rundir.CHECKPOINTS
    (c1, _), (c2, _), (c3, _) = (ck.load_checkpoint(ck.step_dir(root, s)) for s in (1, 2, 3))
    # the poisoned step left the actor untouched (weights and optimizer step count) ...
    for name, w in c1["actor"]["model"].items():
        assert torch.equal(w, c2["actor"]["model"][name]), name
    assert _adam_steps(c1) == _adam_steps(c2) < _adam_steps(c3)
    # ... while the critic trained as usual
    assert any(not torch.equal(w, c2["critic"]["model"][n]) for n, w in c1["critic"]["model"].items())


def _adam_steps(components: dict[str, dict[str, Any]]) -> float:
    state = components["actor"]["optimizer"]["state"]
    return float(next(iter(state.values()))["step"])
