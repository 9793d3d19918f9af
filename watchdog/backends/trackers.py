"""Experiment trackers across relaunches: one W&B run and one TensorBoard log for all of a verl run's attempts.

Every relaunch (a rollback, a ``set`` verl cannot take live, an OOM remedy) is a new verl process, and verl's
``Tracking`` (verl/utils/tracking.py) calls ``wandb.init(project=, name=, entity=, config=, settings=)`` afresh
with no run id and no resume: left alone, each attempt is a new W&B run. wandb reads its settings from
``WANDB_*`` variables too (``wandb.Settings.update_from_env_vars``: ``WANDB_RUN_ID`` -> ``run_id``,
``WANDB_RESUME`` -> ``resume``, ``WANDB_RESUME_FROM`` -> ``resume_from``), so the watchdog passes those to the
trainer it launches:

- the first launch: a run id made here and kept in ``run_dir/trackers.json`` (or the user's own
  ``WANDB_RUN_ID``), with ``WANDB_RESUME=allow``;
- a relaunch that resumes from step N's checkpoint: ``WANDB_RESUME_FROM=<id>?_step=N`` (W&B's rewind: the run
  keeps its id, its history is cut after step N and the relaunch logs from N+1; wandb >= 0.17.1, and on the
  W&B server a preview feature), or where the run cannot be rewound ``WANDB_RESUME=allow`` (the same run; W&B
  drops the relaunch's steps up to the last one it already has, so those keep the stopped attempt's values).
  ``WATCHDOG_WANDB_RESUME`` in the watchdog's environment picks: ``allow`` (the default: it works on every W&B
  server, where a rewind the server does not offer would fail the relaunch's ``wandb.init`` and with it the
  trainer), ``rewind``, ``auto`` (rewind where the installed wandb can) or ``off``.

TensorBoard: verl's ``_TensorboardAdapter`` writes to ``$TENSORBOARD_DIR``, else
``tensorboard_log/<project>/<experiment>`` under its working directory, and passes no ``purge_step``. The
watchdog pins the directory (an absolute ``TENSORBOARD_DIR`` on every launch) and, before a relaunch from step
N, writes into it what ``SummaryWriter(purge_step=N+1)`` writes: an event file whose ``SessionLog.START`` at
step N+1 makes TensorBoard drop the earlier files' points from step N+1 on.

Only a run whose ``trainer.logger`` names ``wandb`` (or ``tensorboard``) gets these variables. Nothing here
logs or records the environment itself (``WANDB_API_KEY`` passes to the trainer as the rest of the watchdog's
environment does: :func:`ppo_watchdog.backends.local.child_env`).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import secrets
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import hydra, inputs, rundir

log = logging.getLogger(__name__)

RESUME_ENV = "WATCHDOG_WANDB_RESUME"
RESUME_MODES = ("allow", "rewind", "auto", "off")
#: The wandb release that reads ``resume_from`` (W&B's "Rewind a run" page: SDK >= 0.17.1).
REWIND_SINCE = (0, 17, 1)
#: A user's own resume choice: the watchdog then leaves W&B's resume alone (wandb refuses two of these at once).
USER_RESUME_ENV = ("WANDB_RESUME", "WANDB_RESUME_FROM", "WANDB_FORK_FROM")
LOGGER_KEY = "trainer.logger"
#: verl's defaults (trainer/config/ppo_trainer.yaml) for the names in its TensorBoard directory.
VERL_PROJECT, VERL_EXPERIMENT = "verl_examples", "gsm8k"
TB_DIR_ENV = "TENSORBOARD_DIR"
#: The purge file's suffix: ``events.out.tfevents.<time>.<host>.<pid>.watchdog-purge``.
PURGE_SUFFIX = ".watchdog-purge"
LAUNCHES_KEPT = 50
_ID_CHARS = string.ascii_lowercase + string.digits


class TrackerConfigError(ValueError):
    """A tracker setting the watchdog cannot use; names the variable and its value."""


@dataclass
class TrackerState:
    """What the watchdog keeps about a run's trackers in ``run_dir/trackers.json``."""

    wandb_run_id: str | None = None
    """The W&B run every attempt logs to."""
    tensorboard_dir: str | None = None
    """The TensorBoard directory every attempt writes (absolute)."""
    launches: list[dict[str, Any]] = field(default_factory=list)
    """The last launches: time, resume step, the variables set (no secrets: only ids, steps and paths), what was said."""

    @classmethod
    def load(cls, run_dir: Path | str) -> TrackerState:
        path = Path(run_dir) / rundir.TRACKERS
        try:
            doc = json.loads(inputs.read_text(path))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise TrackerConfigError(f"{path}: unreadable ({inputs.reason(exc)})") from exc
        if not isinstance(doc, dict):
            raise TrackerConfigError(f"{path}: not a JSON object")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def save(self, run_dir: Path | str) -> None:
        rundir.atomic_write_json(Path(run_dir) / rundir.TRACKERS, asdict(self))


@dataclass(frozen=True)
class TrackerLaunch:
    """A launch's tracker variables and what the watchdog decided, in words."""

    env: dict[str, str] = field(default_factory=dict)
    said: tuple[str, ...] = ()

    @property
    def sentence(self) -> str:
        return " ".join(self.said)


# -- pure: what a launch gets --------------------------------------------------------------------


def loggers(command: Sequence[str]) -> list[str]:
    """The command's ``trainer.logger`` as a list of names (empty when it sets none)."""
    value = hydra.values(command).get(LOGGER_KEY)
    items = value if isinstance(value, list) else [value] if value not in (None, "") else []
    return [str(x).strip() for x in items]


def resume_mode(environ: Mapping[str, str]) -> str:
    """``$WATCHDOG_WANDB_RESUME`` checked (``allow`` when unset)."""
    mode = environ.get(RESUME_ENV, "allow").strip().lower() or "allow"
    if mode not in RESUME_MODES:
        raise TrackerConfigError(f"{RESUME_ENV}={environ.get(RESUME_ENV)!r}: must be one of {', '.join(RESUME_MODES)}")
    return mode


def parse_version(text: str) -> tuple[int, ...]:
    """``0.31.0`` -> (0, 31, 0); the leading numbers of each part (``0.17.1rc2`` -> (0, 17, 1))."""
    out = []
    for part in text.split(".")[:3]:
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
    return tuple(out)


def installed_wandb() -> str | None:
    """The version of wandb installed beside the watchdog, None when there is none."""
    try:
        return importlib.metadata.version("wandb")
    except importlib.metadata.PackageNotFoundError:
        return None


def new_run_id() -> str:
    """A W&B-style run id: 8 characters of [a-z0-9]."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(8))


def wandb_env(run_id: str, first: bool, resume_step: int | None, mode: str,
              wandb_version: str | None) -> tuple[dict[str, str], str]:
    """The W&B variables of one launch and the sentence saying them.

    ``first``: the run's first launch under this id; ``resume_step``: the checkpoint step the launch resumes
    from (0: from the start), None when unknown; ``mode``: :data:`RESUME_MODES`; ``wandb_version``: the
    installed wandb's, for ``auto``.
    """
    env = {"WANDB_RUN_ID": run_id}
    if first:
        env["WANDB_RESUME"] = "allow"
        return env, f"W&B: run {run_id} (WANDB_RUN_ID), kept for every relaunch."
    can_rewind = wandb_version is not None and parse_version(wandb_version) >= REWIND_SINCE
    if resume_step is not None and (mode == "rewind" or (mode == "auto" and can_rewind)):
        env["WANDB_RESUME_FROM"] = f"{run_id}?_step={resume_step}"
        return env, (f"W&B: run {run_id} rewound to step {resume_step} (WANDB_RESUME_FROM): its history after step "
                     f"{resume_step} is cut and this attempt logs from step {resume_step + 1}.")
    env["WANDB_RESUME"] = "allow"
    if resume_step is None:
        why = "the step this launch resumes from is unknown"
    elif mode == "allow":
        why = f"{RESUME_ENV}=allow"
    elif wandb_version is None:
        why = "no wandb is installed beside the watchdog to tell whether it can rewind"
    else:
        why = f"wandb {wandb_version} cannot rewind (resume_from needs {'.'.join(map(str, REWIND_SINCE))})"
    after = f" after step {resume_step}" if resume_step is not None else ""
    return env, (f"W&B: run {run_id} resumed (WANDB_RESUME=allow; {why}): W&B drops this attempt's steps{after} "
                 "up to the last one it already has, so those keep the stopped attempt's values.")


def tensorboard_dir(command: Sequence[str], environ: Mapping[str, str], cwd: Path | str) -> Path:
    """Where verl's TensorBoard logger writes: ``$TENSORBOARD_DIR``, else its default under ``cwd`` (absolute)."""
    given = environ.get(TB_DIR_ENV)
    if given:
        p = Path(given)
    else:
        ov = hydra.values(command)
        p = Path("tensorboard_log") / str(ov.get("trainer.project_name", VERL_PROJECT)) / str(
            ov.get("trainer.experiment_name", VERL_EXPERIMENT))
    return p if p.is_absolute() else Path(cwd) / p


# -- TensorBoard's purge ---------------------------------------------------------------------------


def write_purge(logdir: Path | str, step: int) -> Path:
    """An event file in ``logdir`` that hides every point at ``step`` or later of the files before it: the two
    events ``SummaryWriter(purge_step=step)`` writes (torch/utils/tensorboard/writer.py). Needs tensorboard
    (:class:`ModuleNotFoundError` without it)."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(logdir), filename_suffix=PURGE_SUFFIX)
    try:
        writer.add_event(Event(step=step, wall_time=time.time(), file_version="brain.Event:2"))
        writer.add_event(Event(step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START)))
    finally:
        writer.close()
    return Path(writer.get_logdir())


def _has_events(logdir: Path) -> bool:
    return logdir.is_dir() and any(p.name.startswith("events.out.tfevents.") for p in logdir.iterdir())


# -- a launch ------------------------------------------------------------------------------------


def launch_env(run_dir: Path | str, command: Sequence[str], resume_step: int | None,
               environ: Mapping[str, str] | None = None, cwd: Path | str | None = None) -> TrackerLaunch:
    """The tracker variables of a launch of ``command`` (the command as launched), recorded in trackers.json.

    ``resume_step``: the checkpoint step the launch resumes from (0: from the initial weights), None for a
    run's first launch or when unknown. ``environ``: the watchdog's environment (the trainer inherits it);
    ``cwd``: the trainer's working directory. Raises :class:`TrackerConfigError` for a bad
    ``$WATCHDOG_WANDB_RESUME``.
    """
    environ = os.environ if environ is None else environ
    names = loggers(command)
    if "wandb" not in names and "tensorboard" not in names:
        return TrackerLaunch()
    state = TrackerState.load(run_dir)
    first = not state.launches
    env: dict[str, str] = {}
    said: list[str] = []
    if "wandb" in names:
        mode = resume_mode(environ)
        user_resume = [k for k in USER_RESUME_ENV if environ.get(k)]
        if mode == "off":
            said.append(f"W&B: left to verl and wandb ({RESUME_ENV}=off): each attempt is a new W&B run unless "
                        "your WANDB_* variables say otherwise.")
        elif user_resume:
            said.append(f"W&B: left as you set it ({', '.join(user_resume)} in the watchdog's environment): "
                        "the watchdog sets no W&B variable.")
        else:
            own = environ.get("WANDB_RUN_ID")
            run_id = own or state.wandb_run_id or new_run_id()
            new_id = run_id != state.wandb_run_id
            state.wandb_run_id = run_id
            more, sentence = wandb_env(run_id, first or new_id, resume_step, mode, installed_wandb())
            env.update(more)
            said.append(sentence)
    if "tensorboard" in names:
        tb = Path(state.tensorboard_dir) if state.tensorboard_dir and not environ.get(TB_DIR_ENV) else \
            tensorboard_dir(command, environ, cwd or os.getcwd())
        state.tensorboard_dir = str(tb)
        env[TB_DIR_ENV] = str(tb)
        if first or resume_step is None or not _has_events(tb):
            said.append(f"TensorBoard: {tb} (TENSORBOARD_DIR) for every attempt.")
        else:
            try:
                write_purge(tb, resume_step + 1)
                said.append(f"TensorBoard: points after step {resume_step} in {tb} hidden (a purge at step "
                            f"{resume_step + 1}, as SummaryWriter's purge_step writes it); this attempt logs from "
                            f"step {resume_step + 1}.")
            except ModuleNotFoundError:
                said.append(f"TensorBoard: {tb}; points after step {resume_step} not hidden: tensorboard is not "
                            "installed beside the watchdog, which writes the purge.")
    state.launches = [*state.launches, {"ts": time.time(), "resume_step": resume_step, "env": dict(env),
                                        "said": " ".join(said)}][-LAUNCHES_KEPT:]
    state.save(run_dir)
    return TrackerLaunch(env, tuple(said))
