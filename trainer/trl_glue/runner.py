"""``python -m ppo_watchdog.trainer.trl_glue --run-dir DIR KEY=VALUE ...``: a TRL GRPO or RLOO run that obeys the protocol.

This process is the one the watchdog starts, signals and stops. It writes run.json (its pid,
the command, the config under verl's keys, the live keys, the one-shot commands it does in
process: all but ``rollback``), builds the TRL trainer with :class:`~ppo_watchdog.trainer.trl_glue.callback.WatchdogCallback`
and trains. CPU defaults a careless TRL run gets wrong are set here: ``bf16=False``,
``gradient_checkpointing=False`` (35x slower on CPU), ``logging_steps=1``,
``logging_nan_inf_filter=False`` (TRL would log a NaN loss as the running mean), no
``save_total_limit`` (see the callback), no hub, no report_to.

Resume is always from an explicit path: ``trainer.resume_mode=resume_path`` names it (a
relaunch by the watchdog; checkpoints newer than it on the abandoned timeline are discarded);
``auto`` picks the newest complete, checksummed ``global_step_N`` here, never transformers'
``resume_from_checkpoint=True`` (the highest ``checkpoint-N``: possibly the abandoned branch).
``trainer.resume_skip_batches=N`` skips N steps' worth of prompts after it (a rollback's skip).

Exit codes, those the watchdog already reads (:mod:`ppo_watchdog.protocol.rundir`): 0 finished or
stopped by command/SIGTERM after saving; 2 a configuration it cannot run; 75 out of memory (an
``oom`` event first); 1 anything else, after a ``nan`` event (non-finite weights: TRL's sampler
raises "probability tensor contains either inf, nan or element < 0" before any metric is
logged) or an ``error`` event naming the exception.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import oom, rundir
from ppo_watchdog.protocol.control import COMMAND_KINDS
from ppo_watchdog.protocol.runinfo import RunInfo
from ppo_watchdog.trainer.trl_glue.config import GRPO, SKIP_KEY, TRLConfigError, TRLRun, parse_args

log = logging.getLogger(__name__)

#: Where transformers writes ``checkpoint-N`` before the glue moves it to ``global_step_N`` (hidden:
#: no reader of the checkpoint root lists it).
HF_DIR = ".hf"
#: Words of an exception (or its chain) that mean non-finite numbers reached the trainer.
_NAN_MARKERS = ("probability tensor contains either", "returned nan values", "nan or inf", "non-finite")


def nan_like(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) says NaN/inf reached the computation."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).lower()
    return any(m in text for m in _NAN_MARKERS)


#: What a host out-of-memory error says on CPU (torch's allocator raises a plain RuntimeError).
_HOST_OOM = ("DefaultCPUAllocator: can't allocate memory", "CPU out of memory")


def oom_fields(exc: BaseException, micro: int) -> dict[str, Any] | None:
    """The ``oom`` event's fields for an out-of-memory ``exc`` (torch's OutOfMemoryError, Python's
    MemoryError, the CPU allocator's error, or the protocol's OOM text rules over its chain), else None."""
    import torch

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    found = oom.read_oom(f"{type(exc).__name__}: {exc}\n{text}")
    host = isinstance(exc, MemoryError) or any(m in text for m in _HOST_OOM)
    if found is None and not host and not isinstance(exc, torch.OutOfMemoryError):
        return None
    memory, site, evidence = found if found is not None else ("host", None, str(exc))
    if host or not torch.cuda.is_available():
        memory = "host"  # torch names its CPU OOMs OutOfMemoryError too; the CUDA pattern would say cuda
    return {"memory": memory, **({"site": site} if site else {}), "message": str(evidence)[:2000],
            "micro_batch_size": micro, "source": "trl"}


class SkipFirst:
    """A sampler that drops its first ``n`` indices once (a rollback's batch skip), then is the sampler."""

    def __init__(self, sampler: Any, n: int) -> None:
        self.sampler = sampler
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.sampler)
        n, self.n = self.n, 0  # only the epoch the run resumes in
        for _ in range(n):
            if next(it, None) is None:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.sampler)


def trainer_class(algorithm: str) -> type:
    """GRPOTrainer or RLOOTrainer with a sampler that can skip a rollback's batches."""
    from trl import GRPOTrainer, RLOOTrainer

    base: Any = GRPOTrainer if algorithm == GRPO else RLOOTrainer

    class WatchdogTRLTrainer(base):  # type: ignore[misc, valid-type]
        watchdog_skip_items = 0

        def _get_train_sampler(self, dataset: Any = None) -> Any:
            sampler = super()._get_train_sampler(dataset)
            return SkipFirst(sampler, self.watchdog_skip_items) if self.watchdog_skip_items else sampler

    WatchdogTRLTrainer.__name__ = f"Watchdog{base.__name__}"
    return WatchdogTRLTrainer


def trl_args(run: TRLRun, output_dir: Path) -> Any:
    """GRPOConfig / RLOOConfig for the run, CPU defaults overridden; ``trl.*`` fields last."""
    from trl import GRPOConfig, RLOOConfig

    cls: Any = GRPOConfig if run.algorithm == GRPO else RLOOConfig
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir), per_device_train_batch_size=run.micro,
        gradient_accumulation_steps=run.completions_per_step // run.micro, num_generations=run.n,
        max_completion_length=run.max_response_length, temperature=run.temperature, learning_rate=run.lr,
        lr_scheduler_type=run.lr_scheduler, max_grad_norm=run.clip_grad, beta=run.beta, epsilon=run.epsilon,
        epsilon_high=run.epsilon_high, num_iterations=run.ppo_epochs, max_steps=run.total_training_steps,
        save_strategy="steps" if run.save_freq > 0 else "no", save_steps=max(1, run.save_freq),
        save_total_limit=None, seed=run.seed, logging_steps=1, logging_nan_inf_filter=False, bf16=False,
        fp16=False, gradient_checkpointing=False, report_to=[], disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, push_to_hub=False,
    )
    if run.algorithm == GRPO:
        kwargs["entropy_coef"] = run.entropy_coeff
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    for key, value in run.trl.items():
        if key not in fields:
            raise TRLConfigError(f"trl.{key}: {cls.__name__} has no field {key!r}")
        if key in ("save_total_limit", "resume_from_checkpoint"):
            raise TRLConfigError(f"trl.{key}: the glue manages checkpoints itself (trainer.max_actor_ckpt_to_keep, "
                                 "trainer.resume_mode)")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise TRLConfigError(f"{cls.__name__}: {exc}") from exc


def dataset(run: TRLRun) -> Any:
    """The prompts: data.train_files (JSONL) or the built-in arithmetic task."""
    from datasets import Dataset

    from ppo_watchdog.trainer.trl_glue import task

    try:
        rows = task.load_prompts(run.train_files) if run.train_files else task.prompts(256, run.seed)
    except OSError as exc:
        raise TRLConfigError(f"data.train_files={run.train_files}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise TRLConfigError(f"data.train_files: {exc}") from exc
    return Dataset.from_list(rows)


def resume_point(run: TRLRun, root: Path) -> Path | None:
    """The checkpoint to resume from, verified.

    resume_path: that checkpoint; the abandoned timeline after it (under the same root) is
    discarded so nothing later resumes it. One of the run's own (what a watchdog relaunch names)
    that fails verification falls back to the newest usable one before it, else the initial
    weights, said in an ``error`` event: a torn checkpoint is no configuration error, and exit 2
    would give the whole run up. One a person named elsewhere stays their error (CheckpointError).
    auto: the newest complete checkpoint under ``root``.
    """
    if run.resume_mode == "disable":
        return None
    if run.resume_mode == "resume_path":
        named = Path(run.resume_from_path)
        try:
            info = ckpt.verify_checkpoint(named)
            if not (info.path / "trainer_state.json").is_file():
                raise ckpt.CheckpointError(info.path, "not a TRL checkpoint (no trainer_state.json)")
        except ckpt.CheckpointError as exc:
            if named.parent.resolve() != root.resolve():
                raise
            step = next((c.step for c in ckpt.list_checkpoints(root, verify=False)
                         if c.path.resolve() == named.resolve()), None)
            back = _newest_usable(root, below=step)
            where = f"step {back.step} ({back.path})" if back is not None else "the initial weights"
            message = (f"trainer.resume_from_path: {exc}; resuming from {where}, the newest usable checkpoint "
                       "before it, instead")
            log.error("%s", message)
            rundir.append_event(root.parent, "error", step, message=message, source="resume")
            ckpt.discard_newer(root, back.step if back is not None else -1)
            return back.path if back is not None else None
        if info.path.parent.resolve() == root.resolve():
            ckpt.discard_newer(root, info.step)
        return info.path
    back = _newest_usable(root)
    return back.path if back is not None else None


def _newest_usable(root: Path, below: int | None = None) -> ckpt.CheckpointInfo | None:
    """The newest complete TRL checkpoint under ``root`` (before step ``below``, when given)."""
    for info in reversed([c for c in ckpt.list_checkpoints(root) if c.complete]):
        if (below is None or info.step < below) and (info.path / "trainer_state.json").is_file():
            return info
    return None


def skip_items(args: Any, steps: int) -> tuple[int, int]:
    """(sampler indices, steps) a skip of ``steps`` steps drops: whole generation blocks
    (``num_iterations`` steps reuse one generation), each step ``per_device x steps_per_generation x
    gradient_accumulation`` indices (TRL's RepeatSampler feeding transformers' loop)."""
    if steps <= 0:
        return 0, 0
    block = max(1, int(args.num_iterations))
    steps = math.ceil(steps / block) * block
    per_step = int(args.per_device_train_batch_size) * int(args.steps_per_generation or 1) * \
        int(args.gradient_accumulation_steps)
    return steps * per_step, steps


def write_run_json(run_dir: Path, run: TRLRun, command: list[str], keys: Sequence[str], metrics_port: int) -> None:
    """run.json: what the watchdog reads about this launch."""
    RunInfo.read(run_dir).replace(
        id=RunInfo.read(run_dir).id or run_dir.name, command=command, pid=os.getpid(), cwd=os.getcwd(),
        mode="trl", trainer_mode=run.algorithm, started=time.time(), config=run.verl_config(), live_keys=list(keys),
        commands=sorted(COMMAND_KINDS - {"rollback"}), metrics_port=metrics_port or None,
        checkpoint_dir=str((run_dir / rundir.CHECKPOINTS).resolve()), total_steps=run.total_training_steps,
        exit_codes={"oom": rundir.EXIT_OOM, "stopped": rundir.EXIT_STOPPED}, skip_batches_key=SKIP_KEY,
    ).write(run_dir)


def launch(run: TRLRun, run_dir: Path, command: list[str], callbacks: Sequence[Any] = ()) -> int:
    """Train; returns the exit code (see the module docstring). ``callbacks``: more TrainerCallbacks,
    after the glue's (a test writes control.json from one, at a step it chooses)."""
    import torch
    from transformers import AutoTokenizer

    from ppo_watchdog.protocol.exporter import MetricsExporter
    from ppo_watchdog.trainer.faults import FaultSchedule
    from ppo_watchdog.trainer.trl_glue.callback import FAULT_KINDS, StopRequested, WatchdogCallback, live_keys
    from ppo_watchdog.trainer.trl_glue.task import digits_reward
    from ppo_watchdog.trainer.verl_glue.boundary import RunRecorder

    torch.set_num_threads(max(1, run.num_threads))
    run_dir.mkdir(parents=True, exist_ok=True)
    root = run_dir / rundir.CHECKPOINTS
    try:
        faults = FaultSchedule.parse(run.faults or None, run_dir)
        bad = [str(f) for f in faults.faults if f.kind not in FAULT_KINDS]
        if bad:
            raise TRLConfigError(f"trainer.faults: {', '.join(bad)} not injectable in a TRL run "
                                 f"(kinds: {', '.join(FAULT_KINDS)})")
        if not Path(run.model_path).is_dir():
            raise TRLConfigError(f"actor_rollout_ref.model.path={run.model_path}: not a directory (a local model "
                                 "with its tokenizer; the glue downloads nothing)")
        resume = resume_point(run, root)
        args = trl_args(run, root / HF_DIR)
        data = dataset(run)
        tokenizer = AutoTokenizer.from_pretrained(run.model_path)
    except (ValueError, OSError) as exc:  # TRLConfigError, CheckpointError (an OSError), a bad model dir
        sys.stderr.write(f"config error: {exc}\n")
        return rundir.EXIT_USAGE
    for stale in sorted((root / HF_DIR).glob("checkpoint-*")):
        # transformers' save of a launch that died before the glue moved it: never vouched for, never resumed.
        log.warning("removing %s: an unpublished save of an earlier launch", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    run_id = RunInfo.read(run_dir).id or run_dir.name
    exporter = MetricsExporter(run_id, port=run.metrics_port)
    recorder = RunRecorder(run_dir, exporter)
    items, steps = skip_items(args, run.resume_skip_batches if resume is not None and
                              run.resume_mode == "resume_path" else 0)
    callback = WatchdogCallback(run_dir, run, recorder, faults, resumed_from=resume, skip_steps=steps)
    # Before run.json lists live keys: from then on the watchdog may send SIGUSR1.
    callback.install_signals()
    write_run_json(run_dir, run, command, live_keys(run), exporter.port)
    try:
        try:
            cls = trainer_class(run.algorithm)
            trainer = cls(model=run.model_path, reward_funcs=[digits_reward], args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[callback, *callbacks])
        except (ValueError, TypeError, OSError) as exc:
            sys.stderr.write(f"config error: {type(exc).__name__}: {exc}\n")
            recorder.event("error", 0, message=f"config error: {exc}", source="trl")
            return rundir.EXIT_USAGE
        trainer.watchdog_skip_items = items
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # every step's dict on stdout: metrics.jsonl has them
        callback.bind(trainer)
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
        except StopRequested as stop:
            log.warning("stopped at step %d: %s", callback._step, stop.reason)
            return rundir.EXIT_STOPPED
        except Exception as exc:
            step = int(trainer.state.global_step) + 1  # the step that failed
            fields = oom_fields(exc, run.micro)
            if fields is not None:
                recorder.event("oom", step, **fields)
                log.error("out of memory at step %d: %s", step, fields["message"])
                return rundir.EXIT_OOM
            if nan_like(exc):
                recorder.event("nan", step, what="generate", message=f"{type(exc).__name__}: {exc}"[:2000])
                log.error("non-finite values at step %d: %s", step, exc)
                return 1
            recorder.event("error", step, message=f"{type(exc).__name__}: {exc}"[:2000], source="trl")
            log.error("TRL run failed at step %d: %s", step, "".join(traceback.format_exception(exc))[-4000:])
            return 1
        recorder.event("finished", int(trainer.state.global_step), steps=int(trainer.state.global_step))
        return 0
    finally:
        exporter.close()
        if hasattr(signal, "SIGUSR1"):  # a late nudge from the watchdog must not kill an exiting trainer
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0] if __doc__ else None)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Option("--run-dir", envvar="WATCHDOG_RUN_DIR", show_envvar=True,
                                          help="Run directory (run.json, metrics.jsonl, events.jsonl, "
                                               "control.json, checkpoints/).")] = Path("runs/trl"),
) -> None:
    """Train with TRL (GRPO or RLOO), obeying the run-directory protocol; KEY=VALUE in verl's names."""
    logging.basicConfig(level=os.environ.get("TRAINER_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        typer.echo("TRL is not installed: pip install 'ppo-watchdog[trl]' (TRL >= 1.16 needs Python >= 3.11)", err=True)
        raise typer.Exit(rundir.EXIT_USAGE)
    overrides = list(ctx.args)
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        typer.echo(f"unknown option(s): {' '.join(bad)} (settings are KEY=VALUE)", err=True)
        raise typer.Exit(rundir.EXIT_USAGE)
    try:
        run = parse_args(overrides)
        run_dir.mkdir(parents=True, exist_ok=True)
    except TRLConfigError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(rundir.EXIT_USAGE) from None
    except OSError as exc:
        typer.echo(f"config error: --run-dir {run_dir}: {exc.strerror or exc}", err=True)
        raise typer.Exit(rundir.EXIT_USAGE) from None
    raise typer.Exit(launch(run, run_dir.resolve(), [sys.executable, "-m", "ppo_watchdog.trainer.trl_glue", *sys.argv[1:]]))
