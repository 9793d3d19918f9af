"""deploy/slurm: the sbatch example parses and names only real options, and SIGUSR1 (Slurm's warning before
the time limit) makes `watchdog run` checkpoint the run, stop it resumable, and the same command resume it."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import typer

from ppo_watchdog.cli import app
from ppo_watchdog.control.store import Phase, Store
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "deploy" / "slurm" / "verl_multinode.sbatch"


def _commands(script: Path) -> list[list[str]]:
    """Every command line of the script (continuations joined, comments dropped), split as the shell would."""
    text = script.read_text().replace("\\\n", " ")
    lines = [line.split(" #")[0].strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [shlex.split(line.rstrip("&").replace("||", " ").strip()) for line in lines if line]


def _options(command: object) -> set[str]:
    return {opt for p in getattr(command, "params", []) for opt in (*p.opts, *p.secondary_opts)}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_sbatch_example_parses_and_every_watchdog_option_in_it_exists() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    group = typer.main.get_command(app)
    used = []
    for words in _commands(SBATCH):
        if not words or words[0] != "watchdog":
            continue
        sub = group.commands[words[1]]  # type: ignore[attr-defined]  # (a click Group)
        own = words[2:words.index("--")] if "--" in words else words[2:]
        for word in own:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in _options(sub), f"watchdog {words[1]} has no option {word}"
                used.append(word)
        if "--" in words:  # the trainer's own options: the in-process verl glue's
            from ppo_watchdog.trainer.verl_glue.runner import app as glue

            trainer = words[words.index("--") + 1:]
            assert trainer[:3] == ["python3", "-m", "ppo_watchdog.trainer.verl_glue"]
            glue_opts = _options(typer.main.get_command(glue))
            assert all(w in glue_opts for w in trainer[3:] if w.startswith("--"))
    assert {"--run-dir", "--state-dir", "--checkpoint-wait"} <= set(used)
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text and "kill -USR1" in text
    assert f"-eq {128 + signal.SIGUSR1}" in text  # the exit code the script requeues on is the watchdog's


TINY = ["data.train_batch_size=16", "data.train_size=64", "data.val_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
        "trainer.test_freq=0", "trainer.progress=false", "trainer.save_freq=-1", "trainer.save_epoch_freq=0",
        "trainer.total_training_steps=20"]


def _wait(cond: Callable[[], bool], what: str, proc: subprocess.Popen[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"{what}: the watchdog exited {proc.returncode}: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _last_step(run: Path) -> int:
    records = rundir.read_jsonl(run / rundir.METRICS).records if (run / rundir.METRICS).exists() else []
    return max((r["step"] for r in records), default=0)


@pytest.mark.slow
def test_sigusr1_checkpoints_the_run_stops_it_resumable_and_the_same_command_resumes_it(tmp_path: Path) -> None:
    run, state = tmp_path / "run", tmp_path / "state"
    # Steps slowed to ~0.4 s each (the tiny trainer steps in hundredths), so the signal lands mid-run.
    slow = ",".join(f"hang@{s}:0.4" for s in range(1, 21))
    cmd = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run), "--state-dir", str(state), "--tick", "0.2",
           "--no-report", "--checkpoint-wait", "60", "--faults", slow, *[a for s in TINY for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: _last_step(run) >= 3, "step 3", proc)
        proc.send_signal(signal.SIGUSR1)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, out
    assert "Traceback" not in out
    (saved,) = rundir.iter_events(run, ["checkpoint"])
    assert str(saved["reason"]).startswith("stop") and 3 <= saved.step < 20
    assert [c.step for c in ckpt.list_checkpoints(run / rundir.CHECKPOINTS) if c.complete] == [saved.step]
    assert not rundir.iter_events(run, ["finished"])
    store = Store(state)
    assert store.require_run("run").phase == Phase.STOPPED
    (decision,) = [d for d in store.decisions("run") if d["rule"] == "watchdog:shutdown"]
    assert f"SIGUSR1: checkpoint at step {saved.step} saved" in decision["outcome"]
    status = subprocess.run([sys.executable, "-m", "ppo_watchdog", "status", "--json", "--state-dir", str(state)],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    (row,) = json.loads(status)
    assert row["phase"] == "stopped" and f"SIGUSR1: checkpoint at step {saved.step} saved" in row["why"], row
    # A requeued job runs the same command: it resumes from that checkpoint and finishes.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    starts = rundir.iter_events(run, ["started"])
    assert len(starts) == 2 and starts[1]["resumed_from"] == saved.step
    assert rundir.iter_events(run, ["finished"]) and _last_step(run) == 20
