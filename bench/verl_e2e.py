"""The watchdog over real verl, end to end: every check a row (``python bench/verl_e2e.py``).

``--device cpu`` (default): verl 0.9.1's own ``python -m verl.trainer.main_ppo`` on this machine's
CPU through :mod:`trainer.verl_cpu` (no file of verl edited), tiny local assets:

1. **zero-patch** (:func:`run_zero_patch`): ``watchdog run --mode verl`` over PPO with GAE, a critic
   and the KL in the reward, 12 steps, a checkpoint every 2 (``make run-verl`` plus
   tests/data/verl_e2e_rules.yaml), with verl pruning its checkpoints to one
   (``trainer.max_actor_ckpt_to_keep=1``). Injected: a NaN actor loss at step 5, a memory budget from step 8;
   one tuning relaunch carries lr x0.5, kl_coef x2 and clip_ratio x0.5. :func:`zero_patch_checks`;
2. **in-process** (:func:`run_in_process`): ``watchdog run -- python -m trainer.verl_glue`` with
   bench/verl_gpu_smoke.yaml (kl_coef x2 live from step 2, lr x0.5 live from step 3), checked by
   bench/verl_gpu_smoke.py's :func:`check_run` against what verl logs;

Rows: ``name``, ``pass``, ``detail`` and figures (relaunch cost stop -> first new step, steps
lost, the watchdog's share of verl's step time, the watchdog's peak RSS, processes left) ->
``bench/results/verl_e2e.json`` (``checks``) and ``.md``. ``--device cuda`` runs the GPU smoke
test (bench/verl_gpu_smoke.py: vLLM rollout, the same zero-patch and in-process checks) and writes
its checks as rows in the same files. tests/test_verl_e2e.py asserts the zero-patch rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
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

from watchdog.protocol import rundir  # noqa: E402
from watchdog.protocol.runinfo import RunInfo  # noqa: E402

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

    def events(self) -> list[dict[str, Any]]:
        return rundir.iter_events(self.run_dir)

    def journal(self) -> list[Any]:
        from watchdog.control.store import Store

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
    from trainer.verl_cpu import assets, demo, overrides

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
    last = max((r["step"] for r in run.metrics()), default=0)
    ok = run.exit_code == 0 and kinds[-1:] == ["finished"] and last == 12 and "phase finished" in run.output
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
    oom = next(e for e in run.events() if e["kind"] == "oom")
    later = [e for e in run.events() if e["kind"] == "started" and e["ts"] > oom["ts"]]
    launch = RunInfo.read(run.run_dir).launches[later[0]["attempt"] - 1] if later else {"command": []}
    trained = [r["step"] for r in run.attempt_records(later[0]["attempt"])] if later else []
    restart = next((e for e in run.restarts() if MICRO in e.payload.get("set", {})), None)
    ok = (oom["memory"] == "cuda" and oom["site"] == "actor_update" and oom.get("micro_batch_size") == 2
          and f"{MICRO}=1" in launch["command"] and bool(trained) and max(trained) == 12)
    return Row("an OOM in verl's actor update gets a micro batch verl accepts; the run finishes", ok,
               f"oom {oom.get('memory')}/{oom.get('site')} at micro {oom.get('micro_batch_size')}; relaunch with "
               f"{[x for x in launch['command'] if str(x).startswith(MICRO)]}; trained steps {trained[:1]}..{trained[-1:]}",
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
        out = subprocess.run([sys.executable, "-m", "watchdog", "replay", str(source), "--json",
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
]


def zero_patch_checks(run: VerlRun) -> list[Row]:
    """Every zero-patch row for a finished :func:`run_zero_patch`."""
    return [_guard(name, fn, run) for name, fn in ZERO_PATCH_CHECKS]


# -- in process -------------------------------------------------------------------------------------


def run_in_process(root: Path, steps: int = 6) -> VerlRun:
    """``watchdog run -- python -m trainer.verl_glue`` on CPU with the smoke pack's two live changes."""
    from trainer.verl_cpu import assets, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected")})
    ov = [o for o in overrides.ppo_overrides(a, steps=steps, save_freq=3) if not o.startswith("trainer.logger=")]
    argv = [sys.executable, "-m", "watchdog", "run", "--run-dir", str(run_dir), "--state-dir", str(state),
            "--rules", str(SMOKE_RULES), "--startup-timeout", "400", "--on-escalate", "stop", "--no-report",
            "--", sys.executable, "-m", "trainer.verl_glue", "--run-dir", str(run_dir), *ov]
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
    from trainer.verl_cpu import assets, demo, overrides

    a = assets.build(root / "assets")
    run_dir, state = root / "run", root / "state"
    env = overrides.verl_env(inject={"VERL_CPU_INJECT_DIR": str(run_dir / "injected")})
    verl = overrides.verl_command(sys.executable, [
        *overrides.ppo_overrides(a, steps=8, save_freq=2, gpus=2, micro_batch=2),
        f"actor_rollout_ref.actor.optim.clip_grad={demo.CLIP_GRAD}", f"hydra.run.dir={run_dir / 'verl' / 'hydra'}"])
    argv = [sys.executable, "-m", "watchdog", "run", "--mode", "verl", "--run-dir", str(run_dir), "--state-dir",
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


# -- report -----------------------------------------------------------------------------------------


def write_results(rows: list[Row], command: str, device: str, out: Path, notes: list[str]) -> None:
    """bench/results/verl_e2e.json (``checks``) and .md."""
    doc = {"command": command, "device": device, "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "verl": _verl_version(),
           "checks": [r.to_json() for r in rows], "notes": notes}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    lines = [f"# The watchdog over real verl, end to end ({device})", "", f"Command: `{command}`  ",
             f"Measured {doc['when']} on {doc['host']}, verl {doc['verl']}.", "",
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--root", default="runs/verl-e2e", help="Working directory (replaced).")
    p.add_argument("--out", default=str(RESULTS / "verl_e2e.json"))
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--skip-zero-patch", action="store_true")
    p.add_argument("--world-size-2", action="store_true", help="Also two gloo ranks (about 5 more minutes).")
    p.add_argument("--recheck", action="store_true", help="Only the checks, on the runs kept under --root.")
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
        for name, checks in (("zero-patch", zero_patch_checks), ("in-process", in_process_checks),
                             ("world-size-2", world_size_2_checks)):
            if (root / name / "verlrun.json").exists():
                rows += checks(VerlRun.load(root / name))
        write_results(rows, command, "cpu", Path(ns.out), [f"rechecked the runs kept under {ns.root}"])
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
    write_results(rows, command, "cpu", Path(ns.out), notes)
    for r in rows:
        sys.stdout.write(f"{'PASS' if r.ok else 'FAIL'}  {r.name}: {r.detail[:200]}\n")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
