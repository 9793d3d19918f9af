"""``python -m ppo_watchdog.trainer.trl_glue --run-dir DIR KEY=VALUE ...``: the demo, a TRL GRPO or RLOO run on a toy task.

The settings come as ``key=value`` in verl's names (or TRL's: :mod:`.config`); the trainer is built
with the toy reward (:mod:`.task`) and the public :class:`~ppo_watchdog.trainer.trl_glue.callback.WatchdogCallback`,
which does the rest as for a user's own script (run.json, resume, the protocol, exit codes), with
one difference: a relaunch's arguments are appended to this command, as to the embedded trainer's.
CPU defaults a careless TRL run gets wrong are set here: ``bf16=False``,
``gradient_checkpointing=False`` (35x slower on CPU), ``logging_steps=1``,
``logging_nan_inf_filter=False`` (TRL would log a NaN loss as the running mean), no
``save_total_limit`` (the callback prunes), no hub, no report_to.

Resume (:mod:`.resume`): ``trainer.resume_mode=resume_path`` names the checkpoint (a relaunch by the
watchdog; checkpoints newer than it on the abandoned timeline are discarded); ``auto`` picks the
newest complete, checksummed ``global_step_N``. ``trainer.resume_skip_batches=N`` skips N steps'
worth of prompts after it (a rollback's skip). Exit codes: the callback's (:meth:`WatchdogCallback.fit`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from ppo_watchdog.protocol import rundir
from ppo_watchdog.trainer.trl_glue.config import GRPO, TRLConfigError, TRLRun, parse_args

log = logging.getLogger(__name__)

#: Where transformers writes ``checkpoint-N`` before the glue moves it to ``global_step_N`` (hidden:
#: no reader of the checkpoint root lists it).
HF_DIR = ".hf"


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


def lora_config(run: TRLRun) -> Any:
    """peft's LoraConfig for ``actor_rollout_ref.model.lora_rank`` > 0 (verl's keys), else None (every weight trains)."""
    if not run.lora_rank:
        return None
    from peft import LoraConfig

    modules = run.target_modules if run.target_modules == "all-linear" else [m.strip() for m in run.target_modules.split(",")]
    return LoraConfig(r=run.lora_rank, lora_alpha=run.lora_alpha, target_modules=modules, task_type="CAUSAL_LM")


def launch(run: TRLRun, run_dir: Path, command: list[str], callbacks: Sequence[Any] = ()) -> int:
    """Train; returns the exit code (see the module docstring). ``callbacks``: more TrainerCallbacks,
    after the glue's (a test writes control.json from one, at a step it chooses)."""
    import torch
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer, RLOOTrainer

    from ppo_watchdog.trainer.trl_glue.callback import WatchdogCallback
    from ppo_watchdog.trainer.trl_glue.task import REWARDS

    torch.set_num_threads(max(1, run.num_threads))
    run_dir.mkdir(parents=True, exist_ok=True)
    root = run_dir / rundir.CHECKPOINTS
    try:
        if not Path(run.model_path).is_dir():
            raise TRLConfigError(f"actor_rollout_ref.model.path={run.model_path}: not a directory (a local model "
                                 "with its tokenizer; the glue downloads nothing)")
        args = trl_args(run, root / HF_DIR)
        data = dataset(run)
        tokenizer = AutoTokenizer.from_pretrained(run.model_path)
    except (ValueError, OSError) as exc:  # TRLConfigError, a bad model dir
        sys.stderr.write(f"config error: {exc}\n")
        return rundir.EXIT_USAGE
    for stale in sorted((root / HF_DIR).glob("checkpoint-*")):
        # transformers' save of a launch that died before the glue moved it: never vouched for, never resumed.
        log.warning("removing %s: an unpublished save of an earlier launch", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The public callback, as a user's script has it; given this launch's settings (verl's keys, from argv).
    callback = WatchdogCallback(run_dir, run=run, command=command)
    cls: Any = GRPOTrainer if run.algorithm == GRPO else RLOOTrainer
    try:
        trainer = cls(model=run.model_path, reward_funcs=[REWARDS[run.reward]], args=args, train_dataset=data,
                      processing_class=tokenizer, callbacks=[callback, *callbacks], peft_config=lora_config(run))
    except (ValueError, TypeError, OSError) as exc:
        sys.stderr.write(f"config error: {type(exc).__name__}: {exc}\n")
        rundir.append_event(run_dir, "error", 0, message=f"config error: {exc}", source="trl")
        return rundir.EXIT_USAGE
    trainer.remove_callback(PrinterCallback)  # every step's dict on stdout: metrics.jsonl has them
    return callback.fit(trainer)[0]


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
