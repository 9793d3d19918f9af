"""The watchdog over real verl, end to end: every check a row (``python bench/verl_e2e.py``).

``--device cpu`` (default): verl 0.9.1's own ``python -m verl.trainer.main_ppo`` on this machine's
CPU through :mod:`ppo_watchdog.trainer.verl_cpu` (no file of verl edited), tiny local assets:

1. **zero-patch** (:func:`run_zero_patch`): ``watchdog run --mode verl`` over PPO with GAE, a critic
   and the KL in the reward, 12 steps, a checkpoint every 2 (``make run-verl`` plus
   tests/data/verl_e2e_rules.yaml), with verl pruning its checkpoints to one
   (``trainer.max_actor_ckpt_to_keep=1``). Injected: a NaN actor loss at step 5, a memory budget from step 8;
   one tuning relaunch carries lr x0.5, kl_coef x2 and clip_ratio x0.5; the rollback's ``skip_batches: 1``
   is checked in verl's own dataloader state (:func:`check_skip`). :func:`zero_patch_checks`;
2. **in-process** (:func:`run_in_process`): ``watchdog run -- python -m ppo_watchdog.trainer.verl_glue`` with
   bench/verl_gpu_smoke.yaml (kl_coef x2 live from step 2, lr x0.5 live from step 3), checked by
   bench/verl_gpu_smoke.py's :func:`check_run` against what verl logs;
3. ``--world-size-2``: two gloo ranks (:func:`run_world_size_2`);
4. ``--ray-job`` (:func:`run_ray_job`): the same verl run as Ray Jobs on a local head started with token
   authentication on (``ray start --head --num-cpus 12 --num-gpus 1``, a token file of its own), an
   injected OOM at step 3: two jobs, the second with the smaller micro batch; the token in no argv,
   output, state or run file; the head and everything it started stopped afterwards;
5. ``--kl-adaptive`` (:func:`run_kl_adaptive`): ``algorithm.kl_ctrl.type=adaptive``, a kl_coef x2 relaunch
   and an OOM relaunch: the coefficient verl logs after each resume is the one the watchdog passed;
6. ``--async-save`` (:func:`run_async_save`): ``actor.checkpoint.async_save=true`` (verl writes no
   ``latest_checkpointed_iteration.txt``) and an injected NaN at step 5: the checkpoints count by their
   files and the divergence is rolled back to step 2.

``--keep-rows`` merges the rows produced into ``--out`` (the rows it does not produce stay);
``--recheck`` re-evaluates the runs kept under ``--root``.

Rows: ``name``, ``pass``, ``detail`` and figures (relaunch cost stop -> first new step, steps
lost, the watchdog's share of verl's step time, the watchdog's peak RSS, processes left) ->
``bench/results/verl_e2e.json`` (``checks``) and ``.md``. ``--device cuda`` runs the GPU smoke
test (bench/verl_gpu_smoke.py: vLLM rollout, the same zero-patch and in-process checks) and writes
its checks as rows in the same files. tests/test_verl_e2e.py asserts the zero-patch rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_rules import commit  # noqa: E402

from ppo_watchdog.protocol import rundir  # noqa: E402
from ppo_watchdog.protocol.runinfo import RunInfo  # noqa: E402
from ppo_watchdog.trainer.verl_glue.runner import ROLLBACK_MODES  # noqa: E402  (the pair's two runs)

TEST_RULES = REPO / "tests" / "data" / "verl_e2e_rules.yaml"
SMOKE_RULES = REPO / "bench" / "verl_gpu_smoke.yaml"
LR = "actor_rollout_ref.actor.optim.lr"
KL = "algorithm.kl_ctrl.kl_coef"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
RESULTS = REPO / "bench" / "results"


@dataclass
class Row:
    """One check: its verdict, what it rests on, and what it measured."""

    name: str
    ok: bool
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pass": self.ok, "detail": self.detail, **({"figures": self.figures} if self.figures else {})}


def run_processes(marker: str) -> list[int]:
    """Live processes started for one run (verl's driver, Ray's raylet and workers): their environment
    carries the run's own VERL_CPU_INJECT_DIR, whatever else runs on the machine."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("VERL_CPU_INJECT_DIR") == marker and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


@dataclass
class VerlRun:
    """A finished supervised verl run and what was measured around it."""

    run_dir: Path
    state_dir: Path
    exit_code: int
    output: str
    wall_s: float
    peak_processes: int
    left_processes: list[int]
    watchdog_peak_rss_kb: int | None = None
    watchdog_cpu_s: float | None = None
    """CPU seconds (user + system) the watchdog process itself used, last sample before it exited."""
    left_at_exit: int = 0
    """Processes of the run still there 1 s after the watchdog exited (Ray's may still be shutting down)."""
    drain_s: float = 0.0
    """Seconds after the watchdog's exit until none was left (capped at 60: then ``left_processes``)."""

    def save(self) -> None:
        """Keep what was measured beside the run (``--recheck`` reads it back)."""
        doc = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}
        (self.run_dir.parent / "verlrun.json").write_text(json.dumps(doc, indent=1))

    @classmethod
    def load(cls, root: Path) -> VerlRun:
        doc = json.loads((root / "verlrun.json").read_text())
        doc["run_dir"], doc["state_dir"] = Path(doc["run_dir"]), Path(doc["state_dir"])
        return cls(**doc)

    def metrics(self) -> list[dict[str, Any]]:
        return rundir.read_jsonl(self.run_dir / rundir.METRICS).records

    def last_step(self) -> int:
        """The newest step of the run's timeline (0: none)."""
        return max((r["step"] for r in self.metrics()), default=0)

    def events(self) -> list[dict[str, Any]]:
        return rundir.iter_events(self.run_dir)

    def journal(self) -> list[Any]:
        from ppo_watchdog.control.store import Store

        if not self.state_dir.exists():
            return []
        store = Store(self.state_dir)
        return [e for rid in store.run_ids() for e in store.journal(rid)]

    def attempt_records(self, attempt: int) -> list[dict[str, Any]]:
        return rundir.read_jsonl(self.run_dir / "verl" / f"metrics.{attempt}.jsonl").records

    def restarts(self) -> list[Any]:
        return [e for e in self.journal() if e.kind == "restart" and e.status == "done"]

    def after(self, step: int, key: str) -> list[float]:
        """``key`` as verl logged it on the steps after ``step`` (the last record of each step)."""
        last: dict[int, float] = {}
        for r in self.metrics():
            if r["step"] > step and key in r["data"]:
                last[int(r["step"])] = float(r["data"][key])
        return [last[s] for s in sorted(last)]


def supervise(argv: list[str], env: dict[str, str], run_dir: Path, state: Path, cwd: Path,
              timeout: float = 1500) -> VerlRun:
    """Run ``watchdog run ...`` to its end, counting the run's processes during and after it."""
    import psutil

    marker = env["VERL_CPU_INJECT_DIR"]
    peak, rss, cpu, done = [0], [0], [0.0], threading.Event()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def sample() -> None:
        while not done.wait(2.0):
            peak[0] = max(peak[0], len(run_processes(marker)))
            try:  # the watchdog process itself (not its trainer)
                me = psutil.Process(proc.pid)
                rss[0] = max(rss[0], me.memory_info().rss // 1024)
                t = me.cpu_times()
                cpu[0] = t.user + t.system
            except psutil.Error:
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=120)
    wall = time.monotonic() - t0
    done.set()
    sampler.join()
    time.sleep(1.0)
    at_exit = len(run_processes(marker))
    t1, left = time.monotonic(), run_processes(marker)
    while left and time.monotonic() - t1 < 60:  # Ray's processes exit on their own once the driver is gone
        time.sleep(1.0)
        left = run_processes(marker)
    run = VerlRun(run_dir, state, proc.returncode, out, wall, peak[0], left, rss[0] or None, cpu[0] or None,
                  at_exit, round(time.monotonic() - t1 + 1.0, 1))
    run.save()
    return run


def run_zero_patch(root: Path, extra_watchdog: list[str] | None = None, extra_verl: list[str] | None = None,
                   inject: dict[str, str] | None = None, ray_memory_monitor: bool = True) -> VerlRun:
    """``make run-verl``'s supervised run plus the test overlay, under ``root``.

    ``ray_memory_monitor=False`` turns Ray's memory monitor off (``RAY_memory_monitor_refresh_ms=0``):
    on a machine shared with other jobs their memory spikes made it kill this run's workers (a real
    host OOM, handled by the watchdog, but not the run the checks describe).
    """
    if not ray_memory_monitor:
        inject = {**(inject or {}), "RAY_memory_monitor_refresh_ms": "0"}
    from ppo_watchdog.trainer.verl_cpu import assets, demo, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={**demo.demo_inject(run_dir), **(inject or {})})
    argv = demo.watchdog_argv(run_dir, a, ["--state-dir", str(state), "--rules", str(TEST_RULES),
                                           *(extra_watchdog or [])])
    # verl prunes its own checkpoints to the newest one: the rollback must still find step 2.
    argv = [*argv, *PRUNE, *(extra_verl or [])]
    return supervise(argv, env, run_dir, state, root)


# -- the zero-patch checks ----------------------------------------------------------------------


def _guard(name: str, fn: Callable[[VerlRun], Row], run: VerlRun) -> Row:
    try:
        return fn(run)
    except Exception as exc:  # noqa: BLE001 - a check that cannot find what it needs fails, with why
        return Row(name, False, f"{type(exc).__name__}: {exc}")


def check_finished(run: VerlRun) -> Row:
    kinds = [e["kind"] for e in run.events()]
    last = run.last_step()
    # The end-of-run summary's header says the outcome: "run ID: finished; N steps in T s".
    said = re.search(r"^run \S+: finished\b", run.output, re.M) is not None
    ok = run.exit_code == 0 and kinds[-1:] == ["finished"] and last == 12 and said
    return Row("the supervised verl run ends on its own, every step trained", ok,
               f"exit {run.exit_code}, last event {kinds[-1:]}, last step {last}",
               {"wall_s": round(run.wall_s, 1), "launches": kinds.count("started")})


def check_rollback(run: VerlRun) -> Row:
    # verl's FileLogger writes NaN as null (orjson).
    nan_steps = [r["step"] for r in run.metrics() if "actor/grad_norm" in r["data"]
                 and not math.isfinite(float(r["data"]["actor/grad_norm"] if r["data"]["actor/grad_norm"] is not None
                                             else "nan"))]
    rollback = next(e for e in run.restarts() if e.payload.get("rule") == "nan_or_inf")
    rerun = next(e for e in run.events() if e["kind"] == "started" and e.get("resumed_from") == rollback.result["resume_step"])
    reruns = [r for r in run.attempt_records(rerun["attempt"]) if r["step"] == 5]
    timeline = [r for r in run.metrics() if r["step"] == 5]
    ok = (nan_steps == [5] and rollback.result["resume_step"] == 2 and bool(reruns)
          and reruns[0]["data"]["actor/grad_norm"] is not None and timeline[-1] == reruns[0])
    return Row("a NaN loss in verl's actor is rolled back; the steps after are the re-run's", ok,
               f"NaN at steps {nan_steps}; rollback to step {rollback.result['resume_step']} "
               f"({rollback.result.get('outcome')}); step 5 re-run by attempt {rerun['attempt']}",
               {"relaunch_s": rollback.result.get("relaunch_s"), "steps_lost": rollback.result.get("steps_lost")})


def _drawn(path: Path) -> int | None:
    """Batches verl's train dataloader had drawn when it saved ``path`` (its data.pt, weights-only), or None."""
    from ppo_watchdog.protocol import checkpoint as ckpt

    data = path / ckpt.VERL_DATA_FILE
    if not data.is_file():
        return None
    state = ckpt.load_verl_file(data)
    return int(state["_num_yielded"]) if isinstance(state, dict) and "_num_yielded" in state else None


def check_skip(run: VerlRun) -> Row:
    """The rollback's ``skip_batches=1`` for real: each checkpoint verl saved after the rollback has its
    dataloader one batch further on than its step (step 3 drew batch 4, not batch 3 again), while the
    stopped attempt's own checkpoints past step 2 (set aside) have drawn exactly their step's batches."""
    rollback = next(e for e in run.restarts() if e.payload.get("rule") == "nan_or_inf")
    start, asked = int(rollback.result["resume_step"]), int(rollback.payload.get("skip_batches") or 0)
    done = int(rollback.payload.get("skip_done") or 0)
    ck = run.run_dir / "checkpoints"
    after = sorted((int(p.name.rsplit("_", 1)[1]), _drawn(p)) for p in ck.glob("global_step_*")
                   if int(p.name.rsplit("_", 1)[1]) > start)
    before = sorted((int(p.name.rsplit("_", 1)[1]), _drawn(p)) for p in ck.glob("abandoned-attempt-1/global_step_*"))
    resumed = _drawn(Path(rollback.payload["resume_path"])) if Path(rollback.payload["resume_path"]).is_dir() else None
    ok = (asked == 1 and done == 1 and "skipped 1 batch" in str(rollback.result.get("outcome"))
          and bool(after) and all(d == s_ + done for s_, d in after)
          and bool(before) and all(d == s_ for s_, d in before))
    return Row("a zero-patch rollback with skip_batches=1: verl resumes on the batch after the one it would have "
               "re-run", ok,
               f"rollback to step {start}, skip_batches={asked}, done {done} ({rollback.result.get('outcome')}); "
               f"batches drawn per checkpoint (step, drawn) after the rollback {after}, by the stopped attempt "
               f"{before}, in the resume copy {resumed}",
               {"skipped": done, "drawn_after_rollback": after, "drawn_by_stopped_attempt": before})


def _tuning(run: VerlRun) -> Any:
    return next(e for e in run.restarts() if KL in e.payload.get("set", {}))


def check_lr(run: VerlRun) -> Row:
    t = _tuning(run)
    step, lr = int(t.result["resume_step"]), float(t.payload["set"][LR])
    logged = run.after(step, "actor/lr")
    ok = bool(logged) and math.isclose(logged[0], lr, rel_tol=1e-9) and "resumed from a copy" in str(t.payload.get("lr_patch"))
    return Row("an lr change by relaunch is the actor/lr verl logs after the resume", ok,
               f"resume from step {step}: set {lr:g}, verl logged {logged[:2]}; {t.payload.get('lr_patch')}",
               {"relaunch_s": t.result.get("relaunch_s"), "steps_lost": t.result.get("steps_lost")})


def check_kl(run: VerlRun) -> Row:
    t = _tuning(run)
    step, kl = int(t.result["resume_step"]), float(t.payload["set"][KL])
    logged = run.after(step, "actor/reward_kl_penalty_coeff")
    ok = math.isclose(kl, 0.002) and bool(logged) and math.isclose(logged[0], kl, rel_tol=1e-9)
    return Row("a kl_coef change by relaunch is the coefficient verl logs after the resume", ok,
               f"resume from step {step}: computed {kl:g}, verl logged {logged[:2]}")


def check_clip(run: VerlRun) -> Row:
    launches = RunInfo.read(run.run_dir).launches
    with_clip = [a for a in launches if any(str(x).startswith("actor_rollout_ref.actor.clip_ratio_low=") for x in a["command"])]
    args = dict(str(x).split("=", 1) for x in (with_clip[0]["command"] if with_clip else []) if "clip_ratio" in str(x))
    text = (run.run_dir / "trainer.log").read_text(errors="replace")
    ok = (bool(with_clip) and math.isclose(float(args.get("actor_rollout_ref.actor.clip_ratio_low", 0)), 0.1)
          and math.isclose(float(args.get("actor_rollout_ref.actor.clip_ratio_high", 0)), 0.1)
          and "'clip_ratio_low': 0.1" in text and "'clip_ratio_high': 0.1" in text)
    return Row("a clip_ratio relaunch moves the bounds verl reads (clip_ratio_low/high)", ok,
               f"relaunch args {args}; verl's printed config has clip_ratio_low/high 0.1: "
               f"{'yes' if chr(39) + 'clip_ratio_low' + chr(39) + ': 0.1' in text else 'no'}")


def check_oom(run: VerlRun) -> Row:
    """The injected OOM (micro batch 2) is answered by a relaunch with micro batch 1 that trains past it,
    and every launch after it keeps 1. That the OOM relaunch is the last launch is not this row's claim:
    in one CI run it trained steps 7-8 and one more relaunch finished the run (a tuning set's, say,
    carried out at the next checkpoint), which a check of "the OOM relaunch trains to step 12" failed.
    The detail names every relaunch's rule, so such a run says which."""
    events = run.events()
    ooms = [e for e in events if e["kind"] == "oom"]
    oom = ooms[0]
    later = [e["attempt"] for e in events if e["kind"] == "started" and e["ts"] > oom["ts"]]
    launches = RunInfo.read(run.run_dir).launches
    micro = {a: [str(x) for x in launches[a - 1]["command"] if str(x).startswith(MICRO)] for a in later}
    trained = {a: [r["step"] for r in run.attempt_records(a)] for a in later}
    restart = next((e for e in run.restarts() if MICRO in e.payload.get("set", {})), None)
    last = run.last_step()
    ok = (oom["memory"] == "cuda" and oom["site"] == "actor_update" and oom.get("micro_batch_size") == 2
          and len(ooms) == 1 and bool(later) and all(f"{MICRO}=1" in micro[a] for a in later)
          and bool(trained[later[0]]) and last == 12)
    return Row("an OOM in verl's actor update gets a micro batch verl accepts; the run finishes", ok,
               f"oom {oom.get('memory')}/{oom.get('site')} at micro {oom.get('micro_batch_size')} ({len(ooms)} OOM "
               f"event(s)); launches after it (attempt, micro batch, steps trained): "
               f"{[(a, micro[a], trained[a][:1] + trained[a][-1:]) for a in later]}; last step {last}; relaunches "
               f"(rule, resumed from step): {[(e.payload.get('rule'), e.result['resume_step']) for e in run.restarts() if 'resume_step' in e.result]}",
               {"relaunch_s": restart.result.get("relaunch_s") if restart else None,
                "steps_lost": restart.result.get("steps_lost") if restart else None})


PRUNE = ["trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1"]


def check_pruning(run: VerlRun) -> Row:
    """With verl pruning to one checkpoint, the rollback to step 2 resumed from the watchdog's kept link."""
    rollback = next(e for e in run.restarts() if e.payload.get("rule") == "nan_or_inf")
    src = str(rollback.payload.get("checkpoint_path") or rollback.payload.get("resume_path"))
    own = sorted(p.name for p in (run.run_dir / "checkpoints").glob("global_step_*"))
    # verl's pruning deletes a step's actor/ and critic/ and leaves its data.pt: complete ones hold actor/.
    complete = sorted(p.name for p in (run.run_dir / "checkpoints").glob("global_step_*") if (p / "actor").is_dir())
    # verl pruned step 2 (its actor/ is gone) and the rollback resumed from the watchdog's hard link. (verl
    # prunes only what its own process saved: a relaunch leaves the stopped attempt's last one, see `complete`.)
    pruned = not (run.run_dir / "checkpoints" / "global_step_2" / "actor").exists()
    ok = "/.watchdog_kept/" in src and rollback.result.get("resume_step") == 2 and pruned
    return Row("trainer.max_actor_ckpt_to_keep=1: verl's pruning cannot remove the known-good checkpoint "
               "the rollback needs", ok, f"rollback resumed from {src}; verl's own folders left {own}, "
               f"of which complete (verl pruned the rest to data.pt) {complete}")


def check_processes(run: VerlRun) -> Row:
    ok = run.peak_processes >= 5 and run.left_processes == []
    return Row("stopping and finishing leave no Ray or verl process behind", ok,
               f"peak {run.peak_processes} processes of the run; {run.left_at_exit} there 1 s after the watchdog "
               f"exited, none after {run.drain_s} s; left for good: {run.left_processes}",
               {"processes_peak": run.peak_processes, "processes_at_exit": run.left_at_exit,
                "processes_left": len(run.left_processes), "drain_s": run.drain_s})


def check_timeline(run: VerlRun) -> Row:
    records = run.metrics()
    started = [e for e in run.events() if e["kind"] == "started"]
    # Which attempt wrote each line of metrics.jsonl (its own FileLogger file holds the same line).
    owner = []
    for r in records:
        owner.append(next((e["attempt"] for e in reversed(started) if r in run.attempt_records(e["attempt"])), None))
    interleaved = [(i, a) for i, a in enumerate(owner) if a is not None and any(b is not None and b > a for b in owner[:i])]
    kept_path = run.run_dir / "verl" / "abandoned.jsonl"
    kept = rundir.read_jsonl(kept_path).records if kept_path.exists() else []
    leaked = [r["step"] for r in kept if {"step": r["step"], "data": r["data"]} in records]
    aside = sorted(p.relative_to(run.run_dir).as_posix() for p in (run.run_dir / "checkpoints").glob("abandoned-*/global_step_*"))
    ok = not interleaved and not leaked
    return Row("a stopped attempt's steps past its relaunch checkpoint stay out of the run's timeline", ok,
               f"{len(started)} launches; lines of an earlier attempt after a later one's: {interleaved}; "
               f"{len(kept)} line(s) of stopped attempts set aside (attempt, step) "
               f"{[(r['attempt'], r['step']) for r in kept]}, leaked {leaked}; checkpoints set aside {aside}")


def check_replay(run: VerlRun) -> Row:
    def replay(source: Path) -> list[tuple[int, str, str]]:
        out = subprocess.run([sys.executable, "-m", "ppo_watchdog", "replay", str(source), "--json",
                              "--rules", str(REPO / "rules" / "default.yaml"),
                              "--rules", str(REPO / "rules" / "demo" / "verl_cpu.yaml")],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-500:])
        return [(d["step"], d["rule"], d["kind"]) for d in json.loads(out.stdout)]

    # The run directory: verl's FileLogger lines (relayed into metrics.jsonl) with the events the glue
    # wrote (the OOM); the console log carries both in verl's own text.
    console, files = replay(run.run_dir / "trainer.log"), replay(run.run_dir)
    ok = console == files and any(k == "fire" for _, _, k in files)
    return Row("watchdog replay reads verl's console log and its FileLogger output to the same decisions", ok,
               f"console log {console}; FileLogger lines + events {files}")


def check_watchdog_share(run: VerlRun) -> Row:
    steps = [float(r["data"]["perf/time_per_step"]) for r in run.metrics() if "perf/time_per_step" in r["data"]]
    trained = sum(steps)
    share = (run.watchdog_cpu_s / trained) if run.watchdog_cpu_s and trained else None
    return Row("the watchdog's CPU against verl's step time, and its peak RSS", share is not None,
               f"watchdog process CPU {run.watchdog_cpu_s or 0:.1f} s over the whole run (start-ups included); "
               f"verl's {len(steps)} logged steps took {trained:.1f} s",
               {"watchdog_cpu_per_verl_step_s": round(run.watchdog_cpu_s / len(steps), 3) if share else None,
                "watchdog_share_of_step_time": round(share, 3) if share is not None else None,
                "watchdog_peak_rss_mb": round((run.watchdog_peak_rss_kb or 0) / 1024, 1)})


ZERO_PATCH_CHECKS: list[tuple[str, Callable[[VerlRun], Row]]] = [
    ("finished", check_finished), ("rollback", check_rollback), ("lr", check_lr), ("kl_coef", check_kl),
    ("clip_ratio", check_clip), ("oom", check_oom), ("processes", check_processes), ("timeline", check_timeline),
    ("replay", check_replay), ("watchdog_share", check_watchdog_share), ("pruning", check_pruning),
    ("skip_batches", check_skip),
]


def zero_patch_checks(run: VerlRun) -> list[Row]:
    """Every zero-patch row for a finished :func:`run_zero_patch`."""
    return [_guard(name, fn, run) for name, fn in ZERO_PATCH_CHECKS]


# -- in process -------------------------------------------------------------------------------------


def run_in_process(root: Path, steps: int = 6) -> VerlRun:
    """``watchdog run -- python -m ppo_watchdog.trainer.verl_glue`` on CPU with the smoke pack's two live changes."""
    from ppo_watchdog.trainer.verl_cpu import assets, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected")})
    ov = [o for o in overrides.ppo_overrides(a, steps=steps, save_freq=3) if not o.startswith("trainer.logger=")]
    argv = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--state-dir", str(state),
            "--rules", str(SMOKE_RULES), "--startup-timeout", "400", "--on-escalate", "stop", "--no-report",
            "--", sys.executable, "-m", "ppo_watchdog.trainer.verl_glue", "--run-dir", str(run_dir), *ov]
    return supervise(argv, env, run_dir, state, root)


def in_process_checks(run: VerlRun) -> list[Row]:
    """bench/verl_gpu_smoke.py's in-process checks (live kl_coef and lr confirmed by verl's logged values)."""
    from verl_gpu_smoke import check_run

    try:
        checks = check_run(run.run_dir, kl0=0.001, lr0=1e-3)
    except Exception as exc:  # noqa: BLE001
        return [Row("in-process glue: the run directory can be checked", False, f"{type(exc).__name__}: {exc}")]
    rows = [Row(f"in-process glue: {c.name}", c.ok, c.detail) for c in checks]
    rows.append(Row("in-process glue: no Ray or verl process left", run.left_processes == [] and run.peak_processes > 0,
                    f"peak {run.peak_processes}; {run.left_at_exit} there 1 s after the watchdog exited, none after "
                    f"{run.drain_s} s; left for good: {run.left_processes}",
                    {"processes_at_exit": run.left_at_exit, "processes_left": len(run.left_processes),
                     "drain_s": run.drain_s, "wall_s": round(run.wall_s, 1)}))
    return rows


# -- world size 2 -----------------------------------------------------------------------------------


def run_world_size_2(root: Path) -> VerlRun:
    """Two FSDP ranks on gloo (two logical GPUs, two rollout replicas), 8 steps, the demo's lr rule:
    one relaunch from a two-rank checkpoint through the per-rank lr patch."""
    from ppo_watchdog.trainer.verl_cpu import assets, demo, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected")})
    verl = overrides.verl_command(sys.executable, [
        *overrides.ppo_overrides(a, steps=8, save_freq=2, gpus=2, micro_batch=2),
        f"actor_rollout_ref.actor.optim.clip_grad={demo.CLIP_GRAD}", f"hydra.run.dir={run_dir / 'verl' / 'hydra'}"])
    argv = [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--run-dir", str(run_dir), "--state-dir",
            str(state), "--rules", str(REPO / "rules" / "default.yaml"), "--rules", str(demo.DEMO_RULES),
            "--on-escalate", "stop", "--tuning-relaunch-every", "2", "--startup-s", "60", "--startup-timeout", "400",
            "--no-report", "--", *verl]
    return supervise(argv, env, run_dir, state, root)


def world_size_2_checks(run: VerlRun) -> list[Row]:
    """The completeness check and the per-rank lr patch on a real two-rank verl checkpoint."""
    ckpts = [e for e in run.events() if e["kind"] == "checkpoint"]
    files = sorted(p.name for p in (run.run_dir / "checkpoints").glob("global_step_*/actor/*_world_size_2_rank_*.pt"))
    rows = [Row("world size 2: verl's two-rank checkpoints counted complete", bool(ckpts) and bool(files)
                and run.exit_code == 0, f"{len(ckpts)} checkpoint event(s); files {files[:6]}; exit {run.exit_code}",
                {"wall_s": round(run.wall_s, 1), "processes_peak": run.peak_processes})]
    try:
        t = next(e for e in run.restarts() if LR in e.payload.get("set", {}))
        step, lr = int(t.result["resume_step"]), float(t.payload["set"][LR])
        logged = run.after(step, "actor/lr")
        mem = t.payload.get("lr_patch_memory") or {}
        rows.append(Row("world size 2: the lr patch, one rank at a time, is the actor/lr verl logs after the resume",
                        bool(logged) and math.isclose(logged[0], lr, rel_tol=1e-9), f"resume from {step}: set {lr:g}, "
                        f"verl logged {logged[:2]}; {t.payload.get('lr_patch')}; memory bound {mem.get('bound_bytes')} B",
                        {"relaunch_s": t.result.get("relaunch_s")}))
    except StopIteration:
        rows.append(Row("world size 2: the lr patch, one rank at a time, is the actor/lr verl logs after the resume",
                        False, "no lr relaunch happened"))
    rows.append(Row("world size 2: no Ray or verl process left", run.left_processes == [],
                    f"{run.left_at_exit} at exit, none after {run.drain_s} s; left {run.left_processes}"))
    return rows


# -- a rollback in process beside the same rollback by relaunch -----------------------------------

#: The step whose actor loss is NaN in the rollback pair (of 8; a checkpoint every 2: nan_or_inf goes back to 2).
ROLLBACK_NAN_STEP = 5
#: What the first step after the rollback logs, said in the row (every metric is compared: first_step_agreement).
FIRST_STEP_KEYS = ("actor/lr", "actor/reward_kl_penalty_coeff", "critic/score/mean", "response_length/mean",
                   "actor/entropy", "actor/pg_loss", "critic/vf_loss")
#: Parts of a metric's name that say it is not the step's number but the machine's: timings, throughput, memory.
NOT_COMPARED = ("timing", "perf/", "time")
#: The least difference counted as noise, as a share of the metric's largest value: verl computes in bf16, which
#: keeps 8 bits of mantissa (0.4% a rounding), and a logged mean or max adds a few of those.
BF16_SHARE = 0.01
#: Two runs of one computation that differ in a metric by more than this share of it: the metric is noise.
NOISE_SHARE = 0.1


def run_rollback(root: Path, mode: str, gpus: int = 1) -> VerlRun:
    """The glue under ``watchdog run`` with the default pack, ``--rollback MODE`` (in-process or restart) and a NaN
    actor loss injected once at step 5 of 8: nan_or_inf rolls back to the checkpoint of step 2, skipping a batch."""
    from ppo_watchdog.trainer.verl_cpu import assets, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected"),
                                     "VERL_CPU_INJECT_NAN": str(ROLLBACK_NAN_STEP)})
    ov = [o for o in overrides.ppo_overrides(a, steps=8, save_freq=2, gpus=gpus) if not o.startswith("trainer.logger=")]
    # verl's own switches for a reproducible run, so the two paths can be compared on every metric, not only on the
    # set ones: each rollout sample drawn from its own seed (rollout.sampling_seed), the actor's and the critic's
    # engines seeded before they build their models (the critic's value head is a fresh random layer).
    ov += [f"{key}.full_determinism=true" for key in ("actor_rollout_ref.rollout", "actor_rollout_ref.actor.fsdp_config",
                                                     "critic.fsdp")]
    argv = [sys.executable, "-m", "ppo_watchdog", "run", "--run-dir", str(run_dir), "--state-dir", str(state),
            "--rules", str(REPO / "rules" / "default.yaml"), "--startup-timeout", "400", "--on-escalate", "stop",
            "--no-report", "--", sys.executable, "-m", "ppo_watchdog.trainer.verl_glue", "--run-dir", str(run_dir),
            "--rollback", mode, *ov]
    return supervise(argv, env, run_dir, state, root)


def _rollback_timing(run: VerlRun) -> tuple[Any, float, int, int]:
    """(the nan_or_inf rollback's journal entry, seconds from its decision to the first new step, steps lost,
    the step it went back to)."""
    journal = run.journal()
    entry = next(e for e in journal if e.kind == "rollback" and e.payload.get("rule") == "nan_or_inf")
    if "first_step_s" in entry.result:  # restored in process
        moved = next(e for e in run.events() if e["kind"] == "rollback")
        to = int(moved["to_step"])
        return entry, float(entry.result["first_step_s"]), int(moved["from_step"]) - to, to
    restart = next(e for e in journal if e.id == entry.result["handed_to"])
    first = float(restart.result["stopped_ts"]) + float(restart.result["relaunch_s"])
    return entry, first - entry.created, int(restart.result.get("steps_lost") or 0), int(restart.result["resume_step"])


def check_in_process_rollback(run: VerlRun, where: str = "") -> Row:
    """The NaN rolled back in the running trainer: to the known-good checkpoint, the steps after it re-run, the
    rollback's lr on the first of them, the rollout's log-probs matching the restored actor's, the abandoned
    checkpoints set aside, the run finished."""
    entry, seconds, lost, to = _rollback_timing(run)
    done = str(entry.result.get("outcome", ""))
    records = run.metrics()
    moved = next(e for e in run.events() if e["kind"] == "rollback")
    steps = [r["step"] for r in records]
    # The timeline rewinds once: from the step the rollback left to the one after its checkpoint.
    rewinds = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    rerun = steps[rewinds[0]:] if rewinds else []
    nan_at = steps.index(ROLLBACK_NAN_STEP) if ROLLBACK_NAN_STEP in steps else len(steps)
    wanted = float(entry.payload.get("set", {}).get(LR, math.nan))
    lr = run.after(to, "actor/lr")[:1]
    diff_key = "training/rollout_probs_diff_max"
    before = [float(r["data"][diff_key]) for r in records[:nan_at] if diff_key in r["data"]]
    after = run.after(to, diff_key)[:1]
    aside = sorted(p.parent.name + "/" + p.name for p in (run.run_dir / rundir.CHECKPOINTS).glob("abandoned-*/global_step_*"))
    ok = (done.startswith(f"rolled back in process to step {to}") and run.exit_code == 0
          and len(rewinds) == 1 and steps[rewinds[0] - 1] == int(moved["from_step"])
          and rerun == list(range(to + 1, steps[-1] + 1))
          and bool(lr) and math.isclose(lr[0], wanted, rel_tol=1e-9)
          and bool(before) and bool(after) and after[0] <= 10 * max(before) and bool(aside))
    return Row(f"in-process rollback restores the known-good state{where}", ok,
               f"{done}; {seconds:.1f} s from the decision to the first new step, {lost} steps lost; steps {steps}; "
               f"actor/lr {lr} after it (set {wanted:g}); {diff_key} {after} after it, at most "
               f"{max(before, default=math.nan):.3g} before; set aside {aside}",
               {"first_step_s": round(seconds, 1), "steps_lost": lost})


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record["data"].items() if isinstance(v, (int, float)) and math.isfinite(v)
            and not any(part in k for part in NOT_COMPARED)}


def _timelines(run: VerlRun) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's records before its rollback's rewind, and after it."""
    records = run.metrics()
    cut = next((i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"]), len(records))
    return records[:cut], records[cut:]


def first_step_agreement(inproc: VerlRun, relaunch: VerlRun) -> dict[str, tuple[float, float, float]]:
    """Every metric of the first step after the rollback, in process and by relaunch, beside the two runs' own
    floating-point noise: {key: (in process, relaunch, noise)}.

    Under full determinism the two runs are one computation until the rollback (same seeds, same samples, same
    batches); what separates them at a step before it is the order of floating-point sums, and grows a little
    step by step. A metric's noise is the most the two runs differed in it at any step before the rollback, and
    never less than :data:`BF16_SHARE` of the largest value it took in either run. A metric in which the two runs
    already differed by more than :data:`NOISE_SHARE` of its value measures noise itself (the rollout's log-probs
    against the actor's, a mean that is zero by construction): its noise is the largest value it took before."""
    (before_a, after_a), (before_b, after_b) = _timelines(inproc), _timelines(relaunch)
    if not after_a or not after_b:
        raise ValueError("a run has no step after its rollback")
    first_a, first_b = _numbers(after_a[0]), _numbers(after_b[0])
    same_steps = [(_numbers(a), _numbers(b)) for a, b in zip(before_a, before_b, strict=False) if a["step"] == b["step"]]
    every = [_numbers(r) for r in (*before_a, *after_a, *before_b, *after_b)]
    out: dict[str, tuple[float, float, float]] = {}
    for key in sorted(set(first_a) & set(first_b)):
        both = [(a[key], b[key]) for a, b in same_steps if key in a and key in b]
        gaps = [abs(x - y) for x, y in both]
        scale = max(abs(r[key]) for r in every if key in r)
        noise_itself = any(abs(x - y) > NOISE_SHARE * max(abs(x), abs(y)) for x, y in both)
        level = max((max(abs(x), abs(y)) for x, y in both), default=0.0) if noise_itself else 0.0
        out[key] = (first_a[key], first_b[key], max([BF16_SHARE * scale, level, *gaps]))
    return out


def rollback_pair_checks(inproc: VerlRun, relaunch: VerlRun, label: str = "") -> list[Row]:
    """The in-process rollback's rows beside the same rollback by relaunch (same checkpoint, sets, skip and seed):
    verl logs the same lr and kl_coef and the same first-step metrics after each, and what each cost."""
    where = " (world size 2)" if label else ""
    _, ip_s, _, ip_to = _rollback_timing(inproc)
    rs, rs_s, rs_lost, to = _rollback_timing(relaunch)
    ip_first = {k: (inproc.after(to, k) or [math.nan])[0] for k in FIRST_STEP_KEYS}
    rs_first = {k: (relaunch.after(to, k) or [math.nan])[0] for k in FIRST_STEP_KEYS}
    shared = [k for k in FIRST_STEP_KEYS if math.isfinite(ip_first[k]) and math.isfinite(rs_first[k])]
    relative = {k: abs(ip_first[k] - rs_first[k]) / max(1e-12, abs(rs_first[k])) for k in shared}
    exact = [k for k in ("actor/lr", "actor/reward_kl_penalty_coeff") if k in shared]
    agree = first_step_agreement(inproc, relaunch)
    beyond = {k: v for k, v in agree.items() if abs(v[0] - v[1]) > v[2]}
    # The metric that came closest to its noise (differences as a share of it; an exact match is 0).
    worst = max(agree.items(), key=lambda kv: abs(kv[1][0] - kv[1][1]) / kv[1][2] if kv[1][2] else 0.0,
                default=("none", (math.nan, math.nan, math.nan)))
    # Where verl's dataloader stood at each checkpoint saved after the rollback: the same batches, skip included.
    drawn = [(s, _drawn(inproc.run_dir / rundir.CHECKPOINTS / f"global_step_{s}"),
              _drawn(relaunch.run_dir / rundir.CHECKPOINTS / f"global_step_{s}"))
             for s in range(to + 1, inproc.last_step() + 1)
             if (inproc.run_dir / rundir.CHECKPOINTS / f"global_step_{s}").is_dir()]
    return [
        check_in_process_rollback(inproc, where),
        Row(f"the same rollback by relaunch{where}", rs.status == "done" and relaunch.exit_code == 0,
            f"{rs.result.get('outcome', '')}; {rs_s:.1f} s from the decision to the first new step, {rs_lost} steps "
            "lost", {"first_step_s": round(rs_s, 1), "steps_lost": rs_lost}),
        Row(f"in process and by relaunch, the same rollback: lr, kl_coef, the batches and every metric of the first "
            f"step after it{where}",
            ip_to == to and len(exact) == 2 and all(relative[k] <= 1e-9 for k in exact) and bool(drawn)
            and all(a == b and a is not None for _, a, b in drawn) and bool(agree) and not beyond,
            f"back to step {ip_to} in process, {to} by relaunch; batches drawn at each later checkpoint (step, in "
            f"process, relaunch) {drawn}; the first step after it: "
            + "; ".join(f"{k} {ip_first[k]:.6g} in process, {rs_first[k]:.6g} by relaunch" for k in shared)
            + f"; of its {len(agree)} metrics, {len(agree) - len(beyond)} differ by no more than the two runs did at "
              f"any step before the rollback (full determinism: one computation until then), {BF16_SHARE:.0%} of "
              "their largest value, or (a metric that is float noise itself) its level before, "
            + (f"beyond it: {beyond}" if beyond else
               f"the closest to it {worst[0]} {worst[1][0]:.6g} and {worst[1][1]:.6g} (noise {worst[1][2]:.3g})"),
            {"in_process": ip_first, "relaunch": rs_first, "relative_difference": relative, "batches_drawn": drawn,
             "metrics_compared": len(agree), "beyond_noise": beyond}),
        Row(f"in-process rollback against relaunch: seconds from the decision to the first new step{where}",
            ip_s < rs_s, f"{ip_s:.1f} s in process, {rs_s:.1f} s by relaunch ({rs_s / max(ip_s, 1e-9):.1f}x)",
            {"in_process_s": round(ip_s, 1), "relaunch_s": round(rs_s, 1), "ratio": round(rs_s / max(ip_s, 1e-9), 2)}),
    ]


# -- the Ray Job backend on a real head with token auth -------------------------------------------


RAY_HEAD_CPUS = 12  # logical, as ray_kwargs.ray_init.num_cpus=12 in overrides.py (TransferQueue takes whole CPUs)


def ray_job_overrides(base: list[str]) -> list[str]:
    """The CPU overrides for a verl driver that runs as a Ray Job: its ``ray.init()`` connects to the
    head (the job supervisor sets RAY_ADDRESS), and Ray refuses ``num_cpus``/``num_gpus`` when connecting
    to an existing cluster, so the head offers them instead (``ray start --num-cpus 12 --num-gpus 1``)."""
    return [o for o in base if not o.startswith(("+ray_kwargs.ray_init.num_gpus=", "ray_kwargs.ray_init.num_cpus="))]


class RayHeadProc:
    """``ray start --head --block`` on 127.0.0.1 with token authentication on (``RAY_AUTH_MODE`` unset, a
    token in ``$RAY_AUTH_TOKEN_PATH``), the verl plugin in its environment (jobs and workers inherit it)."""

    def __init__(self, env: dict[str, str]) -> None:
        import secrets
        import socket
        import tempfile

        def free() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return int(s.getsockname()[1])

        # Short: Ray's unix sockets live under it (107 bytes at most).
        self.temp = Path(tempfile.mkdtemp(prefix="wdvr-"))
        self.token_file = self.temp / "auth_token"
        self.token = secrets.token_hex(32)
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.port = free()
        self.address = f"http://127.0.0.1:{self.port}"
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(free()),
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.port),
               "--ray-client-server-port", str(free()), "--dashboard-agent-listen-port", str(free()),
               "--num-cpus", str(RAY_HEAD_CPUS), "--num-gpus", "1", "--include-dashboard", "true",
               "--disable-usage-stats", "--temp-dir", str(self.temp)]
        head_env = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE",
                                                               "RAY_AUTH_TOKEN")}
        head_env.update({"RAY_AUTH_TOKEN_PATH": str(self.token_file), "RAY_USAGE_STATS_ENABLED": "0"})
        self.log = self.temp / "ray-start.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=self.temp, env=head_env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self._wait()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def _wait(self, timeout: float = 180.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        req = urllib.request.Request(f"{self.address}/api/version", headers=self.headers())
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(req, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"Ray job server at {self.address} not up within {timeout:.0f} s")

    def jobs(self) -> list[dict[str, Any]]:
        """The head's jobs: submission id, status, entrypoint (oldest first)."""
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(self.address, headers=self.headers())
        jobs = [{"id": j.submission_id, "status": str(getattr(j.status, "value", j.status)), "entrypoint": j.entrypoint,
                 "start": j.start_time or 0} for j in client.list_jobs() if j.submission_id]
        return sorted(jobs, key=lambda j: j["start"])

    def stop(self) -> int:
        """Stop the head and kill every process it started; returns how many were still there to kill."""
        import shutil

        import psutil

        def tree() -> list[psutil.Process]:
            try:
                return psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return []

        started = tree()
        self.proc.send_signal(15)  # `ray start --block` stops what it started
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        left = [p for p in started + tree() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)
        return len(left)


def _cmdlines_with(secret: str) -> list[int]:
    """Pids whose /proc/PID/cmdline holds ``secret``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if secret.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _files_with(secret: str, *roots: Path) -> list[str]:
    hits = []
    for root in roots:
        for p in root.rglob("*") if root.exists() else []:
            try:
                if p.is_file() and not p.is_symlink() and p.stat().st_size < 200_000_000 and secret.encode() in p.read_bytes():
                    hits.append(str(p))
            except OSError:
                continue
    return hits


RAY_OOM_STEP, RAY_STEPS = 3, 6


def run_ray_job(root: Path) -> VerlRun:
    """``watchdog run --ray-address ... --ray-token-file ...`` over verl's main_ppo on a local token-auth head:
    an injected OOM at step 3 (micro batch 2 > 1) makes the watchdog resubmit the job with micro batch 1."""
    from ppo_watchdog.trainer.verl_cpu import assets, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected"),
                                     "VERL_CPU_INJECT_OOM": f"{RAY_OOM_STEP}:1", "RAY_memory_monitor_refresh_ms": "0"})
    head = RayHeadProc(env)
    scan: dict[str, Any] = {"pids": set(), "scans": 0}
    stop = threading.Event()

    def scanner() -> None:
        while not stop.wait(1.0):
            scan["pids"].update(_cmdlines_with(head.token))
            scan["scans"] += 1

    verl = overrides.verl_command(sys.executable, [
        *ray_job_overrides(overrides.ppo_overrides(a, steps=RAY_STEPS, save_freq=2, micro_batch=2)),
        f"hydra.run.dir={run_dir / 'verl' / 'hydra'}"])
    argv = [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--run-dir", str(run_dir), "--state-dir",
            str(state), "--ray-address", head.address, "--ray-token-file", str(head.token_file),
            "--rules", str(REPO / "rules" / "default.yaml"), "--on-escalate", "stop", "--startup-s", "60",
            "--startup-timeout", "400", "--no-report", "--", *verl]
    t = threading.Thread(target=scanner, daemon=True)
    t.start()
    try:
        run = supervise(argv, {k: v for k, v in env.items() if k != "RAY_memory_monitor_refresh_ms"}, run_dir, state, root)
        jobs = head.jobs()
    finally:
        stop.set()
        t.join()
        killed = head.stop()
    time.sleep(2.0)
    extra = {"jobs": jobs, "token_in_cmdline_pids": sorted(scan["pids"]), "cmdline_scans": scan["scans"],
             "token_in_files": _files_with(head.token, run_dir, state),
             "token_in_output": head.token in run.output, "head_processes_killed": killed,
             "left_after_head_stop": run_processes(str(run_dir / "injected"))}
    (root / "ray.json").write_text(json.dumps(extra, indent=1))
    return run


def ray_job_checks(run: VerlRun) -> list[Row]:
    """Two jobs on the token-auth head, the second with the smaller micro batch; the run finishes; no token leaks."""
    extra = json.loads((run.run_dir.parent / "ray.json").read_text())
    jobs = extra["jobs"]
    micro = [next((x.split("=", 1)[1] for x in j["entrypoint"].split() if x.startswith(MICRO + "=")), None) for j in jobs]
    last = run.last_step()
    oom = next((e for e in run.events() if e["kind"] == "oom"), None)
    ok = (len(jobs) == 2 and micro == ["2", "1"] and jobs[-1]["status"] == "SUCCEEDED" and run.exit_code == 0
          and last == RAY_STEPS)
    restart = next((e for e in run.restarts() if MICRO in e.payload.get("set", {})), None)
    rows = [Row("the Ray Job backend submits verl to a token-auth head and resubmits it after an OOM with a "
                "smaller micro batch; the run finishes", ok,
                f"jobs {[(j['id'], j['status'], m) for j, m in zip(jobs, micro, strict=False)]} (micro batch per job); oom event "
                f"{oom and (oom.get('memory'), oom.get('site'))}; exit {run.exit_code}, last step {last}",
                {"wall_s": round(run.wall_s, 1), "jobs": len(jobs),
                 "relaunch_s": restart.result.get("relaunch_s") if restart else None,
                 "steps_lost": restart.result.get("steps_lost") if restart else None})]
    leaks = extra["token_in_cmdline_pids"] or extra["token_in_files"] or extra["token_in_output"]
    rows.append(Row("the Ray token appears in no process's argv and in none of the watchdog's output, state or run "
                    "files", not leaks and extra["cmdline_scans"] > 10,
                    f"{extra['cmdline_scans']} scans of every /proc/*/cmdline during the run: pids with it "
                    f"{extra['token_in_cmdline_pids']}; files with it {extra['token_in_files']}; in the output: "
                    f"{extra['token_in_output']}"))
    # The head's own processes (raylet, GCS, dashboard, idle workers) carry the run's marker too (the head was
    # started with the run's environment): they stay until the head is stopped, by design of a cluster.
    rows.append(Row("the Ray Job run and its head leave no Ray or verl process behind",
                    not extra["left_after_head_stop"],
                    f"{len(run.left_processes)} process(es) of the head up 60 s after the watchdog exited (the head "
                    f"outlives its jobs); {extra['head_processes_killed']} still there after the head's SIGTERM "
                    f"(killed); left after: {extra['left_after_head_stop']}",
                    {"processes_peak": run.peak_processes, "processes_left": len(extra["left_after_head_stop"])}))
    return rows


# -- kl_coef relaunch with an adaptive controller ------------------------------------------------------

KL_ADAPTIVE_RULES = REPO / "bench" / "verl_kl_adaptive.yaml"
ADAPTIVE = ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1", "algorithm.kl_ctrl.horizon=40"]


def run_kl_adaptive(root: Path) -> VerlRun:
    """PPO with the KL in the reward under verl's adaptive controller (horizon 40: it visibly moves each
    step); a tuning set doubles kl_coef from step 2, applied by relaunch at the next checkpoint; an
    injected OOM at step 5 makes one more relaunch, which carries the controller's value on."""
    from ppo_watchdog.trainer.verl_cpu import assets, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected"), "VERL_CPU_INJECT_OOM": "5:1",
                                     "RAY_memory_monitor_refresh_ms": "0"})
    base = [o for o in overrides.ppo_overrides(a, steps=6, save_freq=2) if not o.startswith("algorithm.kl_ctrl.type=")]
    verl = overrides.verl_command(sys.executable, [*base, *ADAPTIVE, f"hydra.run.dir={run_dir / 'verl' / 'hydra'}"])
    argv = [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--run-dir", str(run_dir), "--state-dir",
            str(state), "--rules", str(REPO / "rules" / "default.yaml"), "--rules", str(KL_ADAPTIVE_RULES),
            "--on-escalate", "stop", "--tuning-relaunch-every", "2", "--startup-s", "60", "--startup-timeout", "400",
            "--no-report", "--", *verl]
    return supervise(argv, env, run_dir, state, root)


ADAPTIVE_CFG = {"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.target_kl": 0.1,
                "algorithm.kl_ctrl.horizon": 40, "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 1}


def kl_adaptive_checks(run: VerlRun) -> list[Row]:
    """The coefficient verl logs at the first step after each resume is the one the watchdog passed; the
    watchdog's arithmetic of verl's controller matches what verl logs from one step to the next."""
    from ppo_watchdog.backends.zero_patch import kl_coef_after

    coef, pen = "actor/reward_kl_penalty_coeff", "actor/reward_kl_penalty"
    t = next((e for e in run.restarts() if KL in e.payload.get("set", {})), None)
    launches = RunInfo.read(run.run_dir).launches
    per_launch = []  # (attempt, resumed from, kl_coef passed, first coefficient verl logged in that attempt)
    for launch in launches[1:]:
        passed = [float(str(x).split("=", 1)[1]) for x in launch["command"] if str(x).startswith(KL + "=")]
        recs = [r for r in run.attempt_records(int(launch["attempt"])) if coef in r["data"]]
        per_launch.append((launch["attempt"], launch.get("resume_from"), passed[-1] if passed else None,
                           float(recs[0]["data"][coef]) if recs else None))
    matched = [p is not None and v is not None and math.isclose(p, v, rel_tol=1e-9) for _, _, p, v in per_launch]
    # verl's own controller, step to step inside each attempt, against the watchdog's arithmetic of it.
    errors = []
    for launch in launches:
        recs = {int(r["step"]): r["data"] for r in run.attempt_records(int(launch["attempt"])) if coef in r["data"]}
        for s_ in sorted(recs):
            if s_ + 1 in recs:
                want = kl_coef_after(recs[s_][coef], recs[s_][pen], ADAPTIVE_CFG)
                errors.append(abs(want - float(recs[s_ + 1][coef])) / abs(float(recs[s_ + 1][coef])))
    first = run.attempt_records(1)
    moved = sorted({round(float(r["data"][coef]), 12) for r in first if coef in r["data"]})
    # The probe's tuning set: the planner leaves a tuning set of kl_coef out while verl's adaptive controller
    # owns it (core/planner.py, plan_sets); applied, it must be what the relaunch passed.
    from ppo_watchdog.control.store import Store

    probe = [(d["step"], d["status"], d["outcome"]) for d in Store(run.state_dir).decisions()
             if d["rule"] == "probe_kl_coef_adaptive"]
    set_ok = (any(p is not None and math.isclose(p, float(t.payload["set"][KL]), rel_tol=1e-9)
                  for _, _, p, _ in per_launch) if t is not None else bool(probe) and probe[0][1] == "skipped")
    ok = (len(per_launch) >= 1 and all(matched) and set_ok and len(moved) > 1 and bool(errors)
          and max(errors) < 1e-6)
    return [Row("a kl_coef relaunch under verl's adaptive controller: the coefficient verl logs after each resume is "
                "the one the watchdog computed", ok,
                f"the urgent set {t.payload['set'][KL] if t else None} applied from step "
                f"{t.result['resume_step'] if t else None} (the probe's decisions (step, status, outcome): {probe}: a "
                f"tuning set of kl_coef is left out under the adaptive controller); per relaunch (attempt, resumed from, "
                f"passed, verl's first logged): {per_launch}; the controller moved in attempt 1 ({moved[:4]}); the "
                f"watchdog's arithmetic vs verl's next logged coefficient over {len(errors)} step pairs: max relative "
                f"error {f'{max(errors):.2e}' if errors else None}",
                {"relaunch_s": t.result.get("relaunch_s") if t else None,
                 "steps_lost": t.result.get("steps_lost") if t else None,
                 "relaunches": len(per_launch), "wall_s": round(run.wall_s, 1)})]


# -- async checkpoint save -------------------------------------------------------------------------------


ASYNC_NAN_STEP = 5


def run_async_save(root: Path) -> VerlRun:
    """``actor_rollout_ref.actor.checkpoint.async_save=true``: 6 steps, a checkpoint every 2, a NaN actor loss
    injected at step 5: the rollback must find a checkpoint although verl writes no marker."""
    from ppo_watchdog.trainer.verl_cpu import assets, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected"),
                                     "VERL_CPU_INJECT_NAN": str(ASYNC_NAN_STEP),
                                     "RAY_memory_monitor_refresh_ms": "0"})
    verl = overrides.verl_command(sys.executable, [*overrides.ppo_overrides(a, steps=6, save_freq=2),
                                                   "actor_rollout_ref.actor.checkpoint.async_save=true",
                                                   f"hydra.run.dir={run_dir / 'verl' / 'hydra'}"])
    argv = [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--run-dir", str(run_dir), "--state-dir",
            str(state), "--rules", str(REPO / "rules" / "default.yaml"), "--on-escalate", "stop",
            "--startup-s", "60", "--startup-timeout", "400", "--no-report", "--", *verl]
    return supervise(argv, env, run_dir, state, root)


def async_save_checks(run: VerlRun) -> list[Row]:
    """What verl writes under async save, and the rollback the watchdog makes of it (checkpoints counted by
    their files: verl writes no marker)."""
    ck = run.run_dir / "checkpoints"
    written = sorted(p.relative_to(ck).as_posix() for p in ck.glob("global_step_*/actor/*")) if ck.exists() else []
    marker = (ck / rundir.LATEST_MARKER).read_text().strip() if (ck / rundir.LATEST_MARKER).exists() else None
    counted = [e.get("step") for e in run.events() if e["kind"] == "checkpoint"]
    rollback = next((e for e in run.restarts() if e.payload.get("rule") == "nan_or_inf"), None)
    rerun = [e for e in run.events() if e["kind"] == "started" and rollback is not None
             and e.get("resumed_from") == rollback.result.get("resume_step")]
    rerun_steps = [r["step"] for r in run.attempt_records(rerun[0]["attempt"])] if rerun else []
    last = run.last_step()
    # The marker here, if any, is the watchdog's (reset to the resume step when the stopped attempt's later
    # saves were set aside), never verl's: verl's own writes under async save leave none.
    ok = (run.exit_code == 0 and bool(counted) and rollback is not None and rollback.result.get("resume_step") == 2
          and bool(rerun_steps) and min(rerun_steps) == 3 and last == 6
          and "no checkpoint of this run will count" not in run.output)
    return [Row("actor.checkpoint.async_save=true: verl writes no marker, its checkpoints count by their files and "
                "a divergence is rolled back", ok,
                f"exit {run.exit_code}; verl wrote {written[:6]}...; {rundir.LATEST_MARKER} at the end: {marker} "
                f"(verl wrote none: the watchdog reset it to the resume step when it set the stopped attempt's later "
                f"saves aside); checkpoint events at steps {counted}; rollback "
                f"{rollback.result.get('outcome') if rollback else None}; the re-run trained steps {rerun_steps}; "
                f"last step {last}",
                {"wall_s": round(run.wall_s, 1), "checkpoints_counted": len(counted),
                 "relaunch_s": rollback.result.get("relaunch_s") if rollback else None,
                 "steps_lost": rollback.result.get("steps_lost") if rollback else None})]


# -- report -----------------------------------------------------------------------------------------


def write_results(rows: list[Row], command: str, device: str, out: Path, notes: list[str]) -> None:
    """bench/results/verl_e2e.json (``checks``) and .md."""
    doc = {"command": command, "device": device, "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(), "verl": _verl_version(),
           "checks": [r.to_json() for r in rows], "notes": notes}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    lines = [f"# The watchdog over real verl, end to end ({device})", "", f"Command: `{command}`  ",
             f"Measured {doc['when']} at commit {doc['commit']} on {doc['host']}, verl {doc['verl']}.", "",
             "| check | pass | figures | detail |", "|---|---|---|---|"]
    for r in rows:
        figs = ", ".join(f"{k}={v}" for k, v in r.figures.items())
        lines.append(f"| {r.name} | {'yes' if r.ok else 'NO'} | {figs} | {r.detail.replace('|', '/')[:400]} |")
    lines += ["", *[f"- {n}" for n in notes], ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def _verl_version() -> str:
    try:
        import verl

        return str(verl.__version__)
    except Exception:  # noqa: BLE001
        return "not installed"


RUNS: list[tuple[str, Callable[[VerlRun], list[Row]]]] = [
    ("zero-patch", zero_patch_checks), ("in-process", in_process_checks), ("world-size-2", world_size_2_checks),
    ("ray-job", lambda r: _guard_rows("ray-job", ray_job_checks, r)),
    ("kl-adaptive", lambda r: _guard_rows("kl-adaptive", kl_adaptive_checks, r)),
    ("async-save", lambda r: _guard_rows("async-save", async_save_checks, r)),
]


def _rollback_pair_rows(inproc: VerlRun, relaunch: VerlRun, suffix: str) -> list[Row]:
    return _guard_rows("rollback pair", functools.partial(rollback_pair_checks, relaunch=relaunch, label=suffix), inproc)


def _guard_rows(name: str, fn: Callable[[VerlRun], list[Row]], run: VerlRun) -> list[Row]:
    try:
        return fn(run)
    except Exception as exc:  # noqa: BLE001 - a check that cannot find what it needs fails, with why
        return [Row(f"{name}: the run can be checked", False, f"{type(exc).__name__}: {exc}")]


def _merged(rows: list[Row], notes: list[str], ns: argparse.Namespace, command: str) -> tuple[list[Row], list[str], str]:
    """With ``--keep-rows``: --out's rows this invocation did not produce, then these; its notes, then these;
    its command, then this one."""
    out = Path(ns.out).with_suffix(".json")
    if not ns.keep_rows or not out.exists():
        return rows, notes, command
    old = json.loads(out.read_text())
    new = {r.name for r in rows}
    kept = [Row(c["name"], bool(c["pass"]), c.get("detail", ""), c.get("figures", {}))
            for c in old.get("checks", []) if c["name"] not in new]
    return kept + rows, [*old.get("notes", []), *notes], f"{old.get('command', '')}; then {command}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--root", default="runs/verl-e2e", help="Working directory (replaced).")
    p.add_argument("--out", default=str(RESULTS / "verl_e2e.json"))
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--skip-zero-patch", action="store_true")
    p.add_argument("--world-size-2", action="store_true", help="Also two gloo ranks (about 5 more minutes).")
    p.add_argument("--ray-job", action="store_true", help="Also the Ray Job backend on a local token-auth head.")
    p.add_argument("--kl-adaptive", action="store_true", help="Also a kl_coef relaunch under the adaptive controller.")
    p.add_argument("--async-save", action="store_true", help="Also a run with the actor's async checkpoint save.")
    p.add_argument("--rollback-in-process", action="store_true",
                   help="Also a rollback in process and the same rollback by relaunch (two runs; with --world-size-2, "
                        "two more at world size 2).")
    p.add_argument("--keep-rows", action="store_true",
                   help="Merge into --out: keep its rows (and notes) that this invocation does not produce.")
    p.add_argument("--recheck", action="store_true", help="Only the checks, on the runs kept under --root.")
    p.add_argument("--note", action="append", default=[], help="A note for the results (repeatable).")
    ns, rest = p.parse_known_args(argv)
    command = "python bench/verl_e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if ns.device == "cuda":
        import verl_gpu_smoke

        code = verl_gpu_smoke.main(["--run-dir", str(Path(ns.root) / "gpu"), *rest])
        run_dir = Path(ns.root) / "gpu"
        rows = [Row(c["name"], bool(c["ok"]), c.get("detail", "")) for c in
                json.loads((run_dir / "smoke.json").read_text()).get("checks", [])] if (run_dir / "smoke.json").exists() else []
        rows.append(Row("the GPU smoke run exited 0", code == 0, f"exit {code}"))
        write_results(rows, command, "cuda", Path(ns.out), ["bench/verl_gpu_smoke.py's checks, as rows"])
        return 0 if all(r.ok for r in rows) else 1
    import shutil

    root = Path(ns.root).resolve()
    if ns.recheck:
        rows = []
        for name, checks in RUNS:
            if (root / name / "verlrun.json").exists():
                rows += checks(VerlRun.load(root / name))
        for suffix in ("", "-ws2"):
            pair = [root / f"rollback-{mode}{suffix}" for mode in ROLLBACK_MODES]
            if all((p / "verlrun.json").exists() for p in pair):
                rows += _rollback_pair_rows(*(VerlRun.load(p) for p in pair), suffix)
        merged, notes, command = _merged(rows, [f"rechecked the runs kept under {ns.root}: `{command}`", *ns.note],
                                         ns, command)
        write_results(merged, command, "cpu", Path(ns.out), notes)
        return 0 if rows and all(r.ok for r in rows) else 1
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows: list[Row] = []
    notes: list[str] = []
    if not ns.skip_zero_patch:
        zp = run_zero_patch(root / "zero-patch")
        rows += zero_patch_checks(zp)
        notes.append(f"zero-patch run: {zp.wall_s:.0f} s wall, exit {zp.exit_code}")
    if not ns.skip_in_process:
        ip = run_in_process(root / "in-process")
        rows += in_process_checks(ip)
        notes.append(f"in-process run: {ip.wall_s:.0f} s wall, exit {ip.exit_code}")
    if ns.world_size_2:
        ws = run_world_size_2(root / "world-size-2")
        rows += world_size_2_checks(ws)
        notes.append(f"world size 2 run: {ws.wall_s:.0f} s wall, exit {ws.exit_code}")
    for flag, name, run_fn, checks in ((ns.ray_job, "ray-job", run_ray_job, ray_job_checks),
                                       (ns.kl_adaptive, "kl-adaptive", run_kl_adaptive, kl_adaptive_checks),
                                       (ns.async_save, "async-save", run_async_save, async_save_checks)):
        if flag:
            r = run_fn(root / name)
            rows += _guard_rows(name, checks, r)
            notes.append(f"{name} run: {r.wall_s:.0f} s wall, exit {r.exit_code} (`{command}`)")
    if ns.rollback_in_process:
        for gpus in (1, 2) if ns.world_size_2 else (1,):
            suffix = "" if gpus == 1 else f"-ws{gpus}"
            pair = [run_rollback(root / f"rollback-{mode}{suffix}", mode, gpus) for mode in ROLLBACK_MODES]
            rows += _rollback_pair_rows(*pair, suffix)
            notes.append(f"rollback pair{suffix}: {pair[0].wall_s:.0f} s and {pair[1].wall_s:.0f} s wall, exits "
                         f"{pair[0].exit_code} and {pair[1].exit_code}")
    merged, notes, command = _merged(rows, [*notes, *ns.note], ns, command)
    write_results(merged, command, "cpu", Path(ns.out), notes)
    for r in rows:
        sys.stdout.write(f"{'PASS' if r.ok else 'FAIL'}  {r.name}: {r.detail[:200]}\n")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
