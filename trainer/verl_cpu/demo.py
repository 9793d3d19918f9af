"""``make run-verl``: ``watchdog run`` over an unmodified ``python -m verl.trainer.main_ppo`` on CPU.

``python -m ppo_watchdog.trainer.verl_cpu.demo [--run-dir DIR] [--assets DIR] [-- WATCHDOG_OPTIONS]`` builds the
tiny assets, puts the plugin and the fault injection in the environment and replaces itself with
``python -m ppo_watchdog run --mode verl ... -- python -m verl.trainer.main_ppo <overrides>``: PPO
with GAE, a critic and the KL in the reward, 12 steps, a checkpoint every 2. Injected faults (see
:mod:`ppo_watchdog.trainer.verl_cpu.plugin`) give the default pack its work:

- a NaN actor loss at step 5: ``nan_or_inf`` rolls back to the last known-good checkpoint (step 2:
  the step-4 one is within the rule's margin) with the lr halved;
- a memory budget from step 8 (an OOM while ``ppo_micro_batch_size_per_gpu`` > 1, raised in
  verl's actor update): ``oom`` relaunches with a smaller micro batch;
- the demo's overlay pack (``rules/demo/verl_cpu.yaml``) adds a tuning set applied by relaunch at
  the next checkpoint: the actor's gradient is clipped on every step (``optim.clip_grad=0.5``, below
  this model's grad norm of about 1), so its lr is halved.

The watchdog's own exit code is the demo's. No network, no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ppo_watchdog.trainer.verl_cpu import assets, overrides

REPO = Path(__file__).resolve().parents[2]
DEMO_RULES = REPO / "rules" / "demo" / "verl_cpu.yaml"
STEPS, SAVE_FREQ, MICRO = 12, 2, 2
NAN_STEP, OOM_STEP, OOM_MAX_MICRO = 5, 8, 1
CLIP_GRAD = 0.5


def demo_inject(run_dir: Path) -> dict[str, str]:
    """The fault-injection environment of the demo (markers under the run directory)."""
    return {
        "VERL_CPU_INJECT_DIR": str(run_dir / "injected"),
        "VERL_CPU_INJECT_NAN": str(NAN_STEP),
        "VERL_CPU_INJECT_OOM": f"{OOM_STEP}:{OOM_MAX_MICRO}",
    }


def watchdog_argv(run_dir: Path, a: assets.Assets, extra: list[str]) -> list[str]:
    """``python -m ppo_watchdog run ... -- python -m verl.trainer.main_ppo ...`` for the demo."""
    verl = overrides.verl_command(sys.executable, [*overrides.ppo_overrides(a, steps=STEPS, save_freq=SAVE_FREQ,
                                                                            micro_batch=MICRO),
                                                   f"actor_rollout_ref.actor.optim.clip_grad={CLIP_GRAD}",
                                                   # Hydra's outputs/ under the run, not in the caller's directory.
                                                   f"hydra.run.dir={run_dir / 'verl' / 'hydra'}"])
    return [sys.executable, "-m", "ppo_watchdog", "run", "--mode", "verl", "--run-dir", str(run_dir),
            "--rules", str(REPO / "rules" / "default.yaml"), "--rules", str(DEMO_RULES),
            "--on-escalate", "stop", "--tuning-relaunch-every", "2", "--startup-s", "60",
            "--startup-timeout", "300", *extra, "--", *verl]


def main(argv: list[str] | None = None) -> int:
    """Build the assets, then exec the watchdog over verl."""
    args = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args:
        at = args.index("--")
        args, extra = args[:at], args[at + 1:]
    p = argparse.ArgumentParser(prog="python -m ppo_watchdog.trainer.verl_cpu.demo", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default=f"runs/verl-cpu-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--assets", default=os.environ.get("VERL_CPU_ASSETS", ".verl_cpu_assets"))
    ns = p.parse_args(args)
    run_dir = Path(ns.run_dir).resolve()
    a = assets.build(Path(ns.assets).resolve())
    env = overrides.verl_env(inject=demo_inject(run_dir))
    argv_ = watchdog_argv(run_dir, a, extra)
    os.execvpe(argv_[0], argv_, env)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
