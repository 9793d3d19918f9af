"""``python -m ppo_watchdog.trainer.verl_glue [OPTIONS] KEY=VALUE ...``: verl's main with our TaskRunner.

This is ``verl.trainer.main_ppo.main`` with three differences: the config gets
``trainer.v1.trainer_mode=watchdog_sync`` (:mod:`ppo_watchdog.trainer.verl_glue.trainer`), a
``watchdog`` node (run directory, metrics port, run id) and, unless the command sets
one, ``trainer.default_local_dir=RUN_DIR/checkpoints``; and ``run_ppo`` gets
:class:`ppo_watchdog.trainer.verl_glue.taskrunner.WatchdogTaskRunner`, verl's ``TaskRunnerV1`` that
imports the glue (so the trainer is registered inside the Ray actor) and ends the run
with the protocol's last event.

This process is the one the watchdog starts, signals and stops: it writes run.json
(its own pid, the command, the live keys) before Ray starts, makes SIGUSR1 harmless
(its default action would kill the run; the trainer reads control.json at every step
boundary anyway) and leaves SIGTERM to Ray's driver handler. Exit codes: 0 finished or
stopped by command, 2 a config verl rejects (relaunching cannot help), 75
(``rundir.EXIT_OOM``) an out-of-memory error, 1 anything else.

verl is imported only inside functions: ``import ppo_watchdog.trainer`` never needs it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer

from ppo_watchdog.protocol import oom, rundir
from ppo_watchdog.protocol.control import COMMAND_KINDS
from ppo_watchdog.protocol.runinfo import MODE_VERL_INPROCESS, RunInfo

log = logging.getLogger(__name__)

TRAINER_MODE = "watchdog_sync"  # ppo_watchdog.trainer.verl_glue.trainer.TRAINER_MODE, without importing verl here
MODE_KEY = "trainer.v1.trainer_mode"
LOCAL_DIR_KEY = "trainer.default_local_dir"
USE_V1_KEY = "trainer.use_v1"


class LaunchError(ValueError):
    """An override the in-process glue cannot run with; names the key."""


def _overridden(overrides: list[str], key: str) -> str | None:
    """The value a Hydra override list gives ``key`` (the last one wins; ``+``/``++`` prefixes allowed)."""
    value = None
    for arg in overrides:
        k, sep, v = arg.partition("=")
        if sep and k.lstrip("+") == key:
            value = v
    return value


def glue_overrides(overrides: list[str], run_dir: Path) -> list[str]:
    """The user's overrides plus what the glue needs; :class:`LaunchError` for a conflicting one."""
    mode = _overridden(overrides, MODE_KEY)
    if mode is not None and mode != TRAINER_MODE:
        raise LaunchError(f"{MODE_KEY}={mode}: the in-process glue runs {MODE_KEY}={TRAINER_MODE} "
                          "(verl's sync trainer plus the run-directory protocol)")
    use_v1 = _overridden(overrides, USE_V1_KEY)
    if use_v1 is not None and use_v1.strip().lower() not in ("true", "1"):
        raise LaunchError(f"{USE_V1_KEY}={use_v1}: the glue is a v1 trainer")
    out = list(overrides) + [f"{MODE_KEY}={TRAINER_MODE}"]
    if _overridden(overrides, LOCAL_DIR_KEY) is None:
        out.append(f"{LOCAL_DIR_KEY}={run_dir / rundir.CHECKPOINTS}")
    return out


def verl_config_dir() -> Path:
    """verl's Hydra config directory (``verl/trainer/config``)."""
    import verl

    return Path(verl.__file__).resolve().parent / "trainer" / "config"


#: How the glue carries out a watchdog rollback: in the running trainer where it can, or always by restart.
ROLLBACK_MODES = ("in-process", "restart")
#: The key a relaunch names for skipping batches after its resume (run.json's ``skip_batches_key``): the
#: glue's own, not verl's (verl has none), taken out of the overrides before verl's config is composed.
SKIP_KEY = "watchdog.resume_skip_batches"


def build_config(overrides: list[str], run_dir: Path | str, metrics_port: int = 0,
                 config_name: str = "ppo_trainer", run_id: str | None = None, rollback: str = "in-process") -> Any:
    """Compose verl's config with the glue's overrides and ``watchdog`` node (no Ray, no GPU)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    run_dir = Path(run_dir).resolve()
    skip = _overridden(overrides, SKIP_KEY)
    overrides = [o for o in overrides if not o.lstrip("+").startswith(f"{SKIP_KEY}=")]
    try:
        skip_batches = int(skip or 0)
    except ValueError as exc:
        raise LaunchError(f"{SKIP_KEY}={skip}: a whole number of batches") from exc
    with initialize_config_dir(version_base=None, config_dir=str(verl_config_dir())):
        cfg = compose(config_name=config_name, overrides=glue_overrides(overrides, run_dir))
    rid = run_id or RunInfo.read(run_dir).id or f"{run_dir.name}-{int(time.time())}"
    with open_dict(cfg):
        cfg.watchdog = {"run_dir": str(run_dir), "metrics_port": int(metrics_port), "run_id": rid, "rollback": rollback,
                        "resume_skip_batches": skip_batches}
    return cfg


def validate(cfg: Any) -> None:
    """verl's own checks, as its main runs them (raise on a config verl would reject)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def oom_of(exc: BaseException) -> tuple[str, str | None, str] | None:
    """``(memory, site, evidence)`` when ``exc`` is an out-of-memory error as it reaches the driver
    or the TaskRunner, else None. Read from the whole formatted chain with the watchdog's own rules
    (:mod:`ppo_watchdog.protocol.oom`): a CUDA OOM wrapped in Ray's ``RayTaskError`` twice, and a host
    OOM, which Ray reports as an ``ActorDiedError`` (exit type ``NODE_OUT_OF_MEMORY``) that names no
    ``OutOfMemoryError`` at all."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return oom.read_oom(f"{type(exc).__name__}: {exc}\n{text}")


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA or host out-of-memory error (:func:`oom_of`)."""
    return oom_of(exc) is not None


def oom_fields(exc: BaseException) -> dict[str, Any] | None:
    """The ``oom`` event's fields for ``exc`` (memory, site, message), or None when it is no OOM."""
    found = oom_of(exc)
    if found is None:
        return None
    memory, site, evidence = found
    return {"memory": memory, **({"site": site} if site else {}), "message": evidence[:2000], "source": "verl"}


def _oom_recorded_since(run_dir: Path, since: float) -> bool:
    """Whether this launch's TaskRunner already wrote the ``oom`` event (one OOM, one event)."""
    return any((e.ts or 0.0) >= since for e in rundir.iter_events(run_dir, ["oom"]))


def _write_launch_json(run_dir: Path, cfg: Any, command: list[str]) -> None:
    from ppo_watchdog.trainer.verl_glue.apply import live_keys_for

    info = RunInfo.read(run_dir).replace(
        id=str(cfg.watchdog.run_id), command=command, pid=os.getpid(), cwd=os.getcwd(),
        mode=MODE_VERL_INPROCESS, live_keys=list(live_keys_for(cfg)), started=time.time(),
        # One-shot commands done in process; rollback too once the trainer says it can (its run.json).
        commands=sorted(COMMAND_KINDS - {"rollback"}), skip_batches_key=SKIP_KEY,
        checkpoint_dir=str(Path(str(cfg.trainer.default_local_dir)).resolve()),
    )
    info.without("trainer_pid", "trainer_host", "metrics_port").write(run_dir)  # the trainer actor writes its own


def launch(cfg: Any, command: list[str]) -> int:
    """Run verl's PPO with the glue; returns the exit code."""
    from verl.trainer.main_ppo import run_ppo

    from ppo_watchdog.trainer.verl_glue.taskrunner import WatchdogTaskRunner

    run_dir = Path(str(cfg.watchdog.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    # Before run.json lists live keys: from then on the watchdog may send SIGUSR1.
    signal.signal(signal.SIGUSR1, lambda signum, frame: log.debug("SIGUSR1: control.json is read at the next "
                                                                  "step boundary"))
    _write_launch_json(run_dir, cfg, command)
    started = time.time()
    try:
        run_ppo(cfg, task_runner_class=WatchdogTaskRunner)
    except Exception as exc:
        fields = oom_fields(exc)
        if fields is not None:
            # The TaskRunner writes the event when it sees the OOM; when the OOM killed the TaskRunner
            # itself (a host OOM), only the driver is left to say it.
            if not _oom_recorded_since(run_dir, started):
                rundir.append_event(run_dir, "oom", None, **fields)
            log.error("out of memory (%s): %s", fields["memory"], fields["message"])
            return rundir.EXIT_OOM
        log.error("verl run failed: %s", exc)
        return 1
    return 0


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0] if __doc__ else None)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Option("--run-dir", envvar="WATCHDOG_RUN_DIR", show_envvar=True,
                                          help="Run directory (run.json, metrics.jsonl, events.jsonl, "
                                               "control.json, checkpoints/).")] = Path("runs/verl"),
    metrics_port: Annotated[int, typer.Option("--metrics-port", help="Serve /metrics on 127.0.0.1:PORT "
                                              "from the trainer (0: off, -1: any free port, in run.json).")] = 0,
    config_name: Annotated[str, typer.Option("--config-name", help="verl config: ppo_trainer, "
                                             "ppo_megatron_trainer, ...")] = "ppo_trainer",
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the composed config "
                                               "(YAML) and exit: no Ray, no GPU.")] = False,
    rollback: Annotated[str, typer.Option("--rollback", help="How a watchdog rollback is done: in-process "
                                          "(restore the checkpoint in the running trainer where the run allows "
                                          "it, else restart) or restart.")] = "in-process",
) -> None:
    """Train with verl in process, obeying the run-directory protocol; KEY=VALUE are verl's Hydra overrides."""
    logging.basicConfig(level=os.environ.get("TRAINER_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    overrides = list(ctx.args)
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        typer.echo(f"unknown option(s): {' '.join(bad)} (verl overrides are KEY=VALUE)", err=True)
        raise typer.Exit(rundir.EXIT_USAGE)
    if rollback not in ROLLBACK_MODES:
        typer.echo(f"--rollback must be one of {', '.join(ROLLBACK_MODES)}, got {rollback!r}", err=True)
        raise typer.Exit(rundir.EXIT_USAGE)
    try:
        cfg = build_config(overrides, run_dir, metrics_port, config_name, rollback=rollback)
        if print_config:
            from omegaconf import OmegaConf

            typer.echo(OmegaConf.to_yaml(cfg))
            raise typer.Exit(0)
        validate(cfg)
    except typer.Exit:
        raise
    except Exception as exc:  # Hydra override/compose errors, verl's validation (assertions included)
        typer.echo(f"config error: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(rundir.EXIT_USAGE) from exc
    raise typer.Exit(launch(cfg, [sys.executable, "-m", "ppo_watchdog.trainer.verl_glue", *sys.argv[1:]]))
