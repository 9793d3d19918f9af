"""Zero-patch mode: the watchdog supervising an unmodified ``python -m verl.trainer.main_ppo``.

verl speaks none of the run-directory protocol: it writes no run.json, no events.jsonl and
never reads control.json. This glue, on the watchdog's side, makes such a run look like
one that does, using only what verl already offers:

- **metrics**: every launch gets ``trainer.logger`` with ``file`` added (the user's list
  kept) and ``VERL_FILE_LOGGER_PATH=run_dir/verl/metrics.<attempt>.jsonl``. verl's
  FileLogger lines are the run directory's own format, but it opens the file with ``"wb"``
  (truncating it) at every start, so each attempt gets its own file and the glue relays
  complete lines into ``run_dir/metrics.jsonl``: the history survives restarts and the
  ordinary tailer reads it. The same records feed an optional ``/metrics`` exporter
  (catalog names, older keys such as ``critic/kl`` mapped on the way).
- **checkpoints**: ``trainer.default_local_dir=run_dir/checkpoints`` unless the user set
  one; a ``global_step_N`` counts when verl's marker and its files say it is complete
  (:func:`ppo_watchdog.protocol.checkpoint.list_verl_checkpoints`; under ``async_save``, where
  verl writes no marker, by its files alone).
- **events**: the glue appends what it can observe: ``started`` at each launch,
  ``checkpoint`` when a complete ``global_step_N`` appears, and at the end of an attempt
  ``finished`` / ``oom`` / ``nan`` / ``error`` from the log (:mod:`ppo_watchdog.backends.verl_exits`).
- **changes**: nothing is live (run.json lists no live keys), so every ``set`` is a
  restart with the overrides and ``trainer.resume_mode=resume_path``. Two resume traps
  are handled on the way: the lr comes back from the checkpoint (resume from a patched
  copy, :mod:`ppo_watchdog.backends.verl_lr_patch`, or refuse the change), and the KL controller's
  value is not checkpointed (``algorithm.kl_ctrl.kl_coef`` is passed on every restart).

State the glue needs across watchdog restarts lives in ``run_dir/verl/glue.json``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ppo_watchdog.backends.dialect import (
    Dialect,
    IsBad,
    ProtocolDialect,
    checkpoint_root,
    merge_kept,
    protect_known_good,
    pruning_notice,
    verl_pruning,
)
from ppo_watchdog.backends.local import read_tail
from ppo_watchdog.backends.verl_data_patch import SkipRefused, epoch_batches, patch_skip_copy
from ppo_watchdog.backends.verl_exits import ExitClass, classify
from ppo_watchdog.backends.verl_lr_patch import (
    LR_COMPONENTS,
    LrPatchRefused,
    patch_lr_copy,
    patch_memory_bound,
    wanted_changes,
)
from ppo_watchdog.core.planner import run_has_critic
from ppo_watchdog.protocol import catalog, hydra, inputs, rundir, runinfo
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol.catalog import RESUME_MODE_KEY, RESUME_PATH_KEY
from ppo_watchdog.protocol.events import RESUME_FAILED
from ppo_watchdog.protocol.runinfo import MODE_VERL, RunInfo

log = logging.getLogger(__name__)

MODE_EMBEDDED = "embedded"
MODES = ("auto", MODE_EMBEDDED, MODE_VERL)
VERL_ENTRY = "verl.trainer.main_ppo"
FILE_LOGGER_ENV = "VERL_FILE_LOGGER_PATH"
LOGGER_KEY = "trainer.logger"
LOCAL_DIR_KEY = "trainer.default_local_dir"
KL_COEF_KEY = "algorithm.kl_ctrl.kl_coef"
KL_COEF_METRIC = "actor/reward_kl_penalty_coeff"
KL_METRIC = "actor/reward_kl_penalty"
#: verl's defaults (trainer/config/ppo_trainer.yaml: algorithm.kl_ctrl, data.train_batch_size, rollout.n).
KL_CTRL_DEFAULTS: dict[str, Any] = {"algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.target_kl": 0.1,
                    "algorithm.kl_ctrl.horizon": 10000, "data.train_batch_size": 1024,
                    "actor_rollout_ref.rollout.n": 1}
#: Steps of KL history kept (a rollback further back than this falls back to the last logged coefficient).
KL_HISTORY = 2048
MICRO_KEY = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
BATCH_KEY = "data.train_batch_size"
#: The dataloader's batch when set (verl: ``gen_batch_size or train_batch_size``, trainer_base.py:742).
GEN_BATCH_KEY = "data.gen_batch_size"
ASYNC_SAVE_KEY = "actor_rollout_ref.actor.checkpoint.async_save"
#: Loggers the glue needs: ``file`` for the metrics, ``console`` for a readable trainer.log.
NEEDED_LOGGERS = ("console", "file")
GLUE_DIR = "verl"
STATE_FILE = "glue.json"
#: Metric lines of stopped attempts past their successor's resume step (``verl/abandoned.jsonl``).
ABANDONED_FILE = "abandoned.jsonl"
RESUME_DIR = "resume"
LOG_NAME = "trainer.log"
#: verl's defaults for the world size (ppo_trainer.yaml: trainer.n_gpus_per_node, trainer.nnodes).
VERL_GPUS_PER_NODE, VERL_NNODES = 8, 1


class VerlModeError(ValueError):
    """A verl command the glue cannot supervise; names the argument."""


# -- pure: the command line ----------------------------------------------------------------


def is_verl_command(command: Sequence[str]) -> bool:
    """True for ``python -m verl.trainer.main_ppo ...`` (or its script path)."""
    return any(a == VERL_ENTRY or a.replace(os.sep, "/").endswith("verl/trainer/main_ppo.py") for a in command)


def resolve_mode(mode: str, command: Sequence[str]) -> str:
    """``auto`` -> ``verl`` for a verl command, else ``embedded``; other values are checked."""
    if mode not in MODES:
        raise VerlModeError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return MODE_VERL if is_verl_command(command) else MODE_EMBEDDED
    return mode


def config_snapshot(command: Sequence[str]) -> dict[str, Any]:
    """The command's overrides as a flat ``{dotted.key: value}`` config (what run.json carries)."""
    return hydra.values(command)


def merge_logger(value: Any) -> list[str]:
    """``trainer.logger`` with console and file added to what the user gave (order kept)."""
    items = value if isinstance(value, list) else [value] if value not in (None, "") else []
    given = [str(x).strip() for x in items]
    return given + [x for x in NEEDED_LOGGERS if x not in given]


def world_size(command: Sequence[str]) -> int | None:
    """GPUs per node x nodes when the command sets either (verl's defaults for the other), else None."""
    ov = hydra.values(command)
    gpn, nn = ov.get("trainer.n_gpus_per_node"), ov.get("trainer.nnodes")
    if gpn is None and nn is None:
        return None
    try:
        return int(gpn if gpn is not None else VERL_GPUS_PER_NODE) * int(nn if nn is not None else VERL_NNODES)
    except (TypeError, ValueError) as exc:
        raise VerlModeError(f"trainer.n_gpus_per_node={gpn!r} trainer.nnodes={nn!r}: not integers") from exc


def run_world_size(command: Sequence[str]) -> int | None:
    """The world size a restart must find in a checkpoint: the command's, else verl's default (8 x 1)
    for verl itself; None for a stand-in that is not verl (then each checkpoint's own files decide)."""
    given = world_size(command)
    if given is None and is_verl_command(command):
        return VERL_GPUS_PER_NODE * VERL_NNODES
    return given


def checkpoint_dir(command: Sequence[str], run_dir: Path | str, cwd: Path | str | None = None) -> Path:
    """Where verl will save: the user's ``trainer.default_local_dir`` (relative to ``cwd``), else run_dir/checkpoints."""
    given = hydra.values(command).get(LOCAL_DIR_KEY)
    if given:
        p = Path(str(given))
        return p if p.is_absolute() else Path(cwd or os.getcwd()) / p
    return Path(run_dir) / rundir.CHECKPOINTS


def kl_coef_after(coef: float, kl: float, config: Mapping[str, Any]) -> float:
    """verl's KL coefficient after one step's update, from the step's logged coefficient and KL.

    The arithmetic of verl's ``AdaptiveKLController.update`` (trainer/ppo/core_algos.py), which
    apply_kl_penalty calls with ``n_steps`` = the batch's size (train_batch_size x rollout.n);
    a ``fixed`` controller does not move.
    """
    if str(config.get("algorithm.kl_ctrl.type", "fixed")) != "adaptive":
        return float(coef)
    target, horizon = float(config["algorithm.kl_ctrl.target_kl"]), float(config["algorithm.kl_ctrl.horizon"])
    n_steps = int(config["data.train_batch_size"]) * int(config["actor_rollout_ref.rollout.n"])
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return float(coef) * (1.0 + error * n_steps / horizon)


def zero_patch_command(command: Sequence[str], ckpt_dir: Path | str, kl_coef: float | None) -> list[str]:
    """The command as launched: logger with ``file``, verl's checkpoint dir pinned, KL coefficient carried."""
    ov = hydra.overrides(command)
    extra: dict[str, Any] = {LOGGER_KEY: merge_logger(ov[LOGGER_KEY].value if LOGGER_KEY in ov else None),
                             LOCAL_DIR_KEY: str(ckpt_dir)}
    if kl_coef is not None:
        extra[KL_COEF_KEY] = float(kl_coef)
    # The resume arguments stay last, where people look for them.
    resume = [ov[k].text for k in (RESUME_MODE_KEY, RESUME_PATH_KEY) if k in ov]
    return hydra.with_overrides(command, extra, resume)


# -- state ------------------------------------------------------------------------------------


@dataclass
class GlueState:
    """What the glue remembers about a run between ticks and across watchdog restarts."""

    attempt: int = 0
    """Launches so far (the current attempt's number)."""
    log_offset: int = 0
    """Size of trainer.log when the current attempt was launched: its own output starts there."""
    relay_attempt: int = 1
    """Attempt whose FileLogger file the relay is reading."""
    relay_offset: int = 0
    """Byte offset in that file after the last relayed line."""
    last_step: int | None = None
    """Newest step relayed."""
    last_kl: float | None = None
    """Last logged KL coefficient (``actor/reward_kl_penalty_coeff`` or ``critic/kl_coeff``)."""
    last_kl_attempt: int = 0
    """Attempt that logged ``last_kl``."""
    kl_override: float | None = None
    """``algorithm.kl_ctrl.kl_coef`` override at the last launch."""
    kl_override_attempt: int = 0
    """Attempt at which that override last changed."""
    kl_history: dict[str, list[float]] = field(default_factory=dict)
    """Per step (as a string): ``[coefficient, KL, attempt]`` as logged, for the coefficient a resume
    from that step's checkpoint must pass (:func:`kl_coef_after`); the newest :data:`KL_HISTORY` steps."""
    announced: list[int] = field(default_factory=list)
    """Checkpoint steps already recorded as ``checkpoint`` events."""
    exit: dict[str, Any] | None = None
    """Classification of the current attempt's end (``attempt``, ``kind``, ...), once known."""
    resumed_from: dict[str, int] = field(default_factory=dict)
    """Per attempt (as a string): the step it resumed from (0: a fresh start). A stopped attempt's lines
    past the step its successor resumed from are a timeline the watchdog left (:meth:`VerlGlue._relay`)."""
    resume_path: str | None = None
    """The checkpoint the current attempt resumed from (None: a fresh start); named in the ``error`` event
    when the attempt dies loading it."""

    @classmethod
    def load(cls, path: Path) -> GlueState:
        try:
            doc = json.loads(inputs.read_text(path))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise VerlModeError(f"{path}: unreadable glue state ({exc})") from exc
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def save(self, path: Path) -> None:
        rundir.atomic_write_json(path, asdict(self))


def init_run(run_dir: Path | str, command: Sequence[str], metrics_port: int | None = None,
             cwd: Path | str | None = None) -> RunInfo:
    """Write run.json for a zero-patch run (before the watchdog registers it); returns it.

    ``live_keys`` is empty: verl changes nothing in process, so every ``set`` is a restart.
    ``metrics_port``: serve the run's metrics on 127.0.0.1:PORT from the watchdog (-1: any free port).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not any("=" in a for a in command) and not is_verl_command(command):
        log.warning("zero-patch mode for a command without key=value overrides: %s", " ".join(command))
    prev = RunInfo.read(run_dir)
    info = prev.replace(
        id=prev.id or run_dir.name, mode=MODE_VERL, command=list(command), base_command=list(command),
        live_keys=[], config=config_snapshot(command), checkpoint_dir=str(checkpoint_dir(command, run_dir, cwd)),
        world_size=run_world_size(command), run_metrics_port=metrics_port,
    )
    if is_same_run(prev, command):
        # A watchdog restarted over its own run (the trainer may still be live): the command as last
        # launched (overrides, logger, resume) is what an OOM event reads its micro batch from, and the
        # checkpoint dir stays where verl saves, whatever the new watchdog's working directory.
        info = info.replace(command=prev.command or info.command, checkpoint_dir=prev.checkpoint_dir or info.checkpoint_dir)
    info.write(run_dir)
    return info


def is_same_run(info: RunInfo, command: Sequence[str]) -> bool:
    """True when run.json is the glue's for this very base command (a watchdog re-attaching)."""
    return info.zero_patch and info.base_command == list(command)


#: ``ray_kwargs.ray_init`` keys a verl driver must not pass when it runs as a Ray Job: its ``ray.init()``
#: then connects to the head (the job supervisor sets RAY_ADDRESS), and Ray refuses them when connecting
#: to an existing cluster (ray/_private/worker.py, init: "num_cpus and num_gpus must not be provided").
RAY_JOB_REFUSED = ("ray_kwargs.ray_init.num_cpus", "ray_kwargs.ray_init.num_gpus", "ray_kwargs.ray_init.resources")


def check_ray_job_command(command: Sequence[str]) -> None:
    """Refuse a verl command that would fail at its first ``ray.init()`` inside a Ray Job, naming the key."""
    try:
        given = hydra.values(command)
    except hydra.OverrideError as exc:
        raise VerlModeError(f"the verl command: {exc}") from None
    bad = [k for k in RAY_JOB_REFUSED if given.get(k) is not None]
    if bad:
        raise VerlModeError(
            f"{', '.join(f'{k}={given[k]}' for k in bad)}: as a Ray Job, verl's ray.init() connects to the head, "
            "and Ray refuses num_cpus, num_gpus and resources when connecting to an existing cluster; drop "
            f"{'them' if len(bad) > 1 else 'it'} and give the head the resources (ray start --num-cpus N --num-gpus G)")


def prepare_run(run_dir: Path | str, command: Sequence[str] | None, mode: str = "auto",
                metrics_port: int | None = None, cwd: Path | str | None = None, ray_job: bool = False) -> str:
    """Set a run directory up for its mode before the watchdog registers it; returns the mode resolved.

    The one place ``watchdog run`` and the daemon share: ``verl`` writes the glue's run.json
    (:func:`init_run`; the controller then builds the :class:`VerlGlue` from it), ``embedded``
    drops a ``mode`` an earlier zero-patch run left in the same directory. Without a command
    (a run the watchdog only watches) ``auto`` changes nothing: run.json's own mode stands.
    ``ray_job``: the run goes to a Ray cluster as Ray Jobs (:func:`check_ray_job_command`).
    """
    return setup_run(run_dir, command, mode, metrics_port, cwd, ray_job).mode


@dataclass(frozen=True)
class RunSetup:
    """A run directory as the watchdog attaches to it: run.json read ONCE (or as just written), and what
    follows from it: the mode, the dialect, the checkpoint directory. Handed down the attach path
    (``add_run`` -> the controller -> its dialect -> the adoption of a running trainer), so no step of
    it reads run.json again and a run.json rewritten meanwhile is never read two ways in one attach."""

    run_dir: Path
    info: RunInfo
    """run.json as the attach read (or wrote) it."""

    @classmethod
    def read(cls, run_dir: Path | str) -> RunSetup:
        """The run directory taken as it is (no mode asked for): run.json's own mode stands."""
        return cls(Path(run_dir), RunInfo.read(run_dir))

    @property
    def mode(self) -> str:
        """verl (the zero-patch glue speaks for an unmodified verl) or embedded (the trainer speaks the protocol)."""
        return MODE_VERL if self.info.zero_patch else MODE_EMBEDDED

    @property
    def checkpoint_dir(self) -> Path:
        """Where the run's checkpoints are (:func:`~ppo_watchdog.backends.dialect.checkpoint_root`)."""
        return checkpoint_root(self.run_dir, self.info)

    def dialect(self, run_id: str) -> Dialect:
        """How the run's trainer speaks: the zero-patch glue for mode verl, else the protocol."""
        if not self.info.zero_patch:
            return ProtocolDialect(self.run_dir)
        return VerlGlue(self.run_dir, run_id, self.info)


def setup_run(run_dir: Path | str, command: Sequence[str] | None, mode: str = "auto",
              metrics_port: int | None = None, cwd: Path | str | None = None, ray_job: bool = False) -> RunSetup:
    """:func:`prepare_run`, returning the :class:`RunSetup` (run.json read once, as it now stands)."""
    cmd = list(command or [])
    resolved = resolve_mode(mode, cmd)
    if ray_job and resolved == MODE_VERL:
        check_ray_job_command(cmd)
    if not cmd and mode == "auto":
        if metrics_port is not None:
            raise VerlModeError("the run metrics port (--run-metrics-port, run_metrics_port) is for mode verl, "
                                "which needs the trainer command")
        return RunSetup.read(run_dir)
    if not cmd and resolved == MODE_VERL:
        raise VerlModeError("mode verl needs the trainer command: the glue launches every attempt itself")
    if resolved == MODE_VERL:
        try:
            return RunSetup(Path(run_dir), init_run(run_dir, cmd, metrics_port=metrics_port, cwd=cwd))
        except hydra.OverrideError as exc:
            raise VerlModeError(f"the verl command: {exc}") from None
    if metrics_port is not None:
        raise VerlModeError("the run metrics port (--run-metrics-port, run_metrics_port) is for mode verl "
                            "(the embedded trainer serves its own: trainer.metrics_port)")
    info = RunInfo.read(run_dir)
    if info.zero_patch:  # the same run dir, now for the embedded trainer
        info = info.without("mode")
        info.write(run_dir)
    return RunSetup(Path(run_dir), info)


def dialect_for(run_dir: Path | str, run_id: str) -> Dialect:
    """How the run's trainer speaks: the zero-patch glue when run.json says mode verl, else the protocol."""
    return RunSetup.read(run_dir).dialect(run_id)


# -- the glue ---------------------------------------------------------------------------------


class VerlGlue:
    """Watcher-side stand-in for the protocol an unmodified verl run does not speak (a :class:`Dialect`)."""

    live = False
    """verl reads no control.json: every change is a relaunch, a pause is a stop."""

    def __init__(self, run_dir: Path | str, run_id: str, info: RunInfo) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.dir = self.run_dir / GLUE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = checkpoint_root(self.run_dir, info)
        self.world_size = info.world_size
        # verl loads critic/ on resume whenever the run has a critic: without it a checkpoint is no use.
        self.components: tuple[str, ...] = ("actor", "critic") if run_has_critic(info.config) else ("actor",)
        self.config: dict[str, Any] = dict(info.config)
        """The command's verl settings (flat dotted keys)."""
        self.prunes = verl_pruning(info.config)
        """verl's own checkpoint pruning the command sets (empty: none)."""
        if self.prunes:
            log.warning("%s: %s", run_id, pruning_notice(self.prunes, self.ckpt_dir))
        self.async_save = str(self.config.get(ASYNC_SAVE_KEY, "")).strip().lower() in ("true", "1")
        """verl writes no marker (trainer/ppo/v1/trainer_base.py:1011-1019): checkpoints count by their files."""
        if self.async_save:
            log.info("%s: %s=true: verl writes no %s then; a checkpoint counts once all its files are there "
                     "(data.pt, which verl writes last, included)", run_id, ASYNC_SAVE_KEY, rundir.LATEST_MARKER)
        self.state = GlueState.load(self.dir / STATE_FILE)
        # Listed every tick: a checkpoint unchanged since the last tick is not walked again.
        self._listing = ckpt.VerlListingCache()
        self._kept_listing = ckpt.VerlListingCache()
        self.exporter: Any = None
        port = info.run_metrics_port
        if port is not None and port != 0:
            from ppo_watchdog.protocol.exporter import MetricsExporter

            self.exporter = MetricsExporter(run_id, port=port)
            info.replace(metrics_port=self.exporter.port).write(self.run_dir)  # the run.json of this attach
            log.info("%s: verl metrics at http://127.0.0.1:%d/metrics", run_id, self.exporter.port)

    # -- files ----------------------------------------------------------------------------
    def metrics_file(self, attempt: int) -> Path:
        """The FileLogger target of one attempt (verl truncates it when it starts)."""
        return self.dir / f"metrics.{attempt}.jsonl"

    def _save(self) -> None:
        self.state.save(self.dir / STATE_FILE)

    def _event(self, kind: str, step: int | None, **fields_: Any) -> dict[str, Any]:
        ev = rundir.append_event(self.run_dir, kind, step, source="watchdog:verl", **fields_)
        if self.exporter is not None:
            self.exporter.count_event(kind)
        return ev

    # -- launching ------------------------------------------------------------------------
    def kl_to_pass(self, overrides: Mapping[str, Any], resume_step: int | None = None) -> float | None:
        """The KL coefficient a restart must pass (verl does not checkpoint its KL controller).

        A new override wins. Otherwise, for a resume from step S's checkpoint, the coefficient
        verl's controller held *after* step S's update: verl logs ``actor/reward_kl_penalty_coeff``
        before it updates (trainer/ppo/ray_trainer.py, apply_kl_penalty), so the logged value of
        S is one update behind, and the newest logged value belongs to a later step than an older
        checkpoint (:func:`kl_coef_after`). Without S's record, the value logged last, if logged
        after the override last changed; else the override itself. None on the first launch (the
        command's own value stands).
        """
        s = self.state
        ov = overrides.get(KL_COEF_KEY)
        ov_f = float(ov) if ov is not None else None
        if ov_f is not None and ov_f != s.kl_override:
            return ov_f
        if s.attempt < 1:
            return ov_f
        rec = s.kl_history.get(str(resume_step)) if resume_step is not None else None
        if rec is not None and rec[2] >= s.kl_override_attempt:
            return kl_coef_after(rec[0], rec[1], {**KL_CTRL_DEFAULTS, **self.config, **overrides})
        if s.last_kl is not None and s.last_kl_attempt >= s.kl_override_attempt:
            return s.last_kl
        return ov_f

    def prepare_launch(self, command: Sequence[str], overrides: Mapping[str, Any],
                       resume_path: str | None) -> tuple[list[str], dict[str, str]]:
        """(command, environment) of the next attempt; records it as the current attempt."""
        s = self.state
        kl = self.kl_to_pass(overrides, _step_of(resume_path))
        ov = overrides.get(KL_COEF_KEY)
        ov_f = float(ov) if ov is not None else None
        if ov_f != s.kl_override:
            s.kl_override, s.kl_override_attempt = ov_f, s.attempt + 1
        cmd = zero_patch_command(command, self.ckpt_dir, kl)
        resume_step = _step_of(resume_path)
        if s.attempt >= 1 and resume_step is not None:
            # The stopped attempt kept training while Ray shut down: what it saved past the step this
            # launch resumes from is not this run's timeline any more (kept under abandoned-attempt-N/).
            moved = ckpt.set_aside_newer(self.ckpt_dir, resume_step, f"attempt-{s.attempt}")
            if moved:
                log.warning("%s: attempt %d saved %s past the step-%d checkpoint this launch resumes from; "
                            "set aside under %s", self.run_id, s.attempt, ", ".join(p.name for p in moved),
                            resume_step, moved[0].parent)
                gone = {_step_of(str(p)) for p in moved}
                s.announced = [x for x in s.announced if x not in gone]
        s.attempt += 1
        s.resumed_from[str(s.attempt)] = resume_step or 0
        s.exit = None
        log_path = self.run_dir / LOG_NAME
        s.log_offset = log_path.stat().st_size if log_path.exists() else 0
        target = self.metrics_file(s.attempt)
        target.unlink(missing_ok=True)
        self._save()
        self._prune_resume_copies(keep=resume_path)
        return cmd, {FILE_LOGGER_ENV: str(target)}

    def launched(self, pid: int | None, command: Sequence[str], resume_path: str | None) -> None:
        """Record the launch in run.json and as a ``started`` event."""
        resumed_from = _step_of(resume_path)
        self.state.resume_path = resume_path
        self._save()
        launches = RunInfo.read(self.run_dir).launches[-49:]
        launches.append({"attempt": self.state.attempt, "command": list(command), "resume_from": resume_path,
                         FILE_LOGGER_ENV: str(self.metrics_file(self.state.attempt))})
        runinfo.update(self.run_dir, command=list(command), pid=pid, launches=launches)
        self._event("started", resumed_from, resumed_from=resumed_from or 0, attempt=self.state.attempt,
                    resume_path=resume_path)

    def plan_resume(self, payload: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        """A restart's payload with verl's lr trap defused (resume from a patched copy when the checkpoint's
        lr differs from the wanted one, or the lr change refused, named and audited) and, for a rollback
        with ``skip_batches``, the resume checkpoint's dataloader state moved on (:meth:`_plan_skip`)."""
        p = self._plan_lr(payload, overrides)
        return self._plan_skip(p)

    def stopping(self, resume_step: int | None) -> None:
        """Recorded before verl is stopped (a watchdog killed mid-stop finds it): verl's driver trains on while
        Ray shuts down, and the lines of steps past ``resume_step`` it writes then are kept apart
        (:meth:`_relay`), as those of an attempt already relaunched are."""
        self.state.resumed_from[str(self.state.attempt + 1)] = resume_step or 0
        self._save()

    def verify(self, path: Path | str) -> None:
        """Every rank's files and ``data.pt`` there (its own step standing in for verl's marker, as for a kept
        copy), each a torch archive verl can open (:func:`~ppo_watchdog.protocol.checkpoint.check_verl_files`)."""
        path = Path(path)
        info = ckpt.verl_checkpoint_info(path, _step_of(str(path)), self.world_size, self.components)
        if not info.complete:
            raise ckpt.CheckpointError(path, info.reason)
        ckpt.check_verl_files(path)

    def _plan_lr(self, payload: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        p = dict(payload)
        src = p.get("resume_path")
        wanted = {k: float(v) for k, v in overrides.items() if k in LR_COMPONENTS}
        if not src or not wanted:
            p["lr_patch"] = "none needed"
            return p
        try:
            changes = wanted_changes(src, wanted)
            if not changes:
                p["lr_patch"] = "none needed (the checkpoint has the lr)"
                return p
            tag = "-".join(f"{LR_COMPONENTS[k]}{new:g}" for k, (_, new) in sorted(changes.items()))
            new_lrs = {k: new for k, (_, new) in changes.items()}
            rss_before = _peak_rss_kb()
            dst = patch_lr_copy(src, self.dir / RESUME_DIR / f"{Path(src).name}-{tag}", new_lrs)
            # What the patch cost the watchdog's memory: its bound (one rank's optimizer files) and the
            # process's peak resident set before and after (a growth only shows above an earlier peak).
            p["lr_patch_memory"] = {"bound_bytes": patch_memory_bound(src, new_lrs),
                                    "peak_rss_kb_before": rss_before, "peak_rss_kb_after": _peak_rss_kb()}
        except (LrPatchRefused, ckpt.CheckpointError) as exc:
            p["set"] = {k: v for k, v in p.get("set", {}).items() if k not in LR_COMPONENTS}
            p["refused_keys"] = sorted(wanted)
            p["refused"] = (f"lr change refused: {exc}; verl would resume with the checkpoint's lr, "
                            "so the lr stays as it was")
            log.error("%s: %s", self.run_id, p["refused"])
            return p
        p["checkpoint_path"] = src
        p["resume_path"] = str(dst)
        p["lr_patch"] = "resumed from a copy with " + ", ".join(
            f"{k} {old:g} -> {new:g}" for k, (old, new) in sorted(changes.items()))
        return p

    def _plan_skip(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A rollback's ``skip_batches``: resume from a copy whose ``data.pt`` has verl's dataloader N batches
        further on (:mod:`ppo_watchdog.backends.verl_data_patch`), or ``skip_note`` saying why it was not done."""
        p = payload
        n = int(p.get("skip_batches") or 0)
        src = p.get("resume_path")
        if n < 1 or not src or p.get("resume") not in ("known_good", "path"):
            return p
        batch = _positive_int(self.config.get(GEN_BATCH_KEY)) or _positive_int(self.config.get(BATCH_KEY)) \
            or int(KL_CTRL_DEFAULTS[BATCH_KEY])
        log_path = self.run_dir / LOG_NAME
        # verl prints its datasets' sizes as it starts: the attempt being stopped (from its offset), else the first.
        epoch = epoch_batches(_read_part(log_path, self.state.log_offset), batch) \
            or epoch_batches(_read_part(log_path, 0), batch)
        if epoch is None:
            p["skip_note"] = (f"skip_batches={n} not done: the epoch's length is unknown (no 'dataset len' line of "
                              f"verl's in {log_path}), and a skip past the epoch's end would stop verl")
            log.error("%s: %s", self.run_id, p["skip_note"])
            return p
        try:
            dst, skip = patch_skip_copy(src, self.dir / RESUME_DIR / f"{Path(src).name}-skip{n}", n, epoch)
        except (SkipRefused, ckpt.CheckpointError) as exc:
            p["skip_note"] = f"skip_batches={n} not done: {exc}"
            log.error("%s: %s", self.run_id, p["skip_note"])
            return p
        p.setdefault("checkpoint_path", src)
        p["resume_path"] = str(dst)
        p["skip_done"] = skip.done
        p["skip_patch"] = skip.text()
        return p

    def _prune_resume_copies(self, keep: str | None) -> None:
        # Patched copies hold full optimizer states; only the one this launch reads is worth keeping.
        root = self.dir / RESUME_DIR
        if not root.is_dir():
            return
        keep_dir = Path(keep).resolve().parent if keep else None
        for d in root.iterdir():
            if d.is_dir() and d.resolve() != keep_dir:
                shutil.rmtree(d, ignore_errors=True)

    # -- watching ---------------------------------------------------------------------------
    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        """verl's checkpoints of this run (complete or not, with the reason), and the known-good ones
        the watchdog kept where verl's own pruning deleted them (:meth:`protect`)."""
        own = ckpt.list_verl_checkpoints(self.ckpt_dir, self.world_size, self.components, by_files=self.async_save,
                                         cache=self._listing)
        return merge_kept(own, self._kept())

    def _kept(self) -> list[ckpt.CheckpointInfo]:
        where = ckpt.kept_root(self.ckpt_dir)
        if not where.is_dir():
            return []
        # A kept copy was complete when it was linked: its own step stands in for verl's marker.
        paths = [p for p in sorted(where.iterdir()) if p.is_dir() and _step_of(str(p)) is not None]
        self._kept_listing.forget_all_but(paths)
        return [self._kept_listing.info(p, int(p.name.rsplit("_", 1)[1]), self.world_size, self.components, False)
                for p in paths]

    def protect(self, is_bad: IsBad, hold: Collection[int] = ()) -> list[int]:
        """With ``trainer.max_*_ckpt_to_keep`` set, keep the last known-good checkpoints (and ``hold``'s steps)
        as hard links verl's pruning cannot reach (:func:`ppo_watchdog.backends.dialect.protect_known_good`)."""
        if not self.prunes:
            return []
        return protect_known_good(self.ckpt_dir, self.checkpoints(), is_bad, hold=hold)

    def poll(self, proc: Any, watch_exit: bool = True) -> None:
        """One tick: relay new metric lines, record new checkpoints, classify an ended attempt."""
        self._relay()
        self._announce_checkpoints()
        if watch_exit and proc is not None and not proc.alive() and self.state.attempt >= 1:
            self.exit_class(proc.poll())

    def _relay(self) -> None:
        s = self.state
        changed = False
        while s.relay_attempt <= s.attempt:
            path = self.metrics_file(s.relay_attempt)
            chunk = rundir.read_jsonl(path, s.relay_offset)
            for err in chunk.errors:
                log.warning("%s: skipped %s", self.run_id, err)
            # Lines a stopped attempt wrote past the step its successor resumed from (verl trains on while
            # Ray shuts down) belong to a timeline the watchdog left: kept apart, not in the run's history.
            # (Known from the moment the attempt is being stopped: :meth:`stopping`.)
            cutoff = s.resumed_from.get(str(s.relay_attempt + 1))
            for rec in chunk.records:
                step = rec.get("step") if isinstance(rec, dict) else None
                if cutoff is not None and isinstance(step, (int, float)) and step > cutoff:
                    rundir.append_jsonl(self.dir / ABANDONED_FILE, {"attempt": s.relay_attempt, **rec})
                    log.info("%s: step %s of stopped attempt %d is past the step-%d relaunch: kept in %s",
                             self.run_id, step, s.relay_attempt, cutoff, ABANDONED_FILE)
                    continue
                self._relay_record(rec)
            if chunk.offset != s.relay_offset:
                s.relay_offset, changed = chunk.offset, True
            if s.relay_attempt == s.attempt:
                break
            # An older attempt's process is gone (it was stopped before the next launch): move on.
            s.relay_attempt, s.relay_offset, changed = s.relay_attempt + 1, 0, True
        if changed:
            self._save()

    def _relay_record(self, rec: dict[str, Any]) -> None:
        from ppo_watchdog.sources.ingest import record_from_json

        good, reason = record_from_json(rec)
        if good is None:
            log.warning("%s: skipped a FileLogger record: %s", self.run_id, reason)
            return
        # verl's own line, byte for byte in meaning: the tailer and replay read metrics.jsonl.
        rundir.append_jsonl(self.run_dir / rundir.METRICS, {"step": good["step"], "data": rec.get("data", {})})
        data = good["data"]
        self.state.last_step = int(good["step"])
        step_kl: list[float | None] = [None, None]
        for key, value in data.items():
            name = catalog.canonical_key(key)
            if name in (KL_COEF_METRIC, KL_METRIC) and isinstance(value, (int, float)) \
                    and catalog.is_finite(float(value)):
                step_kl[name == KL_METRIC] = float(value)
        if step_kl[0] is not None:
            self.state.last_kl, self.state.last_kl_attempt = step_kl[0], self.state.attempt
            if step_kl[1] is not None:
                hist = self.state.kl_history
                hist[str(int(good["step"]))] = [step_kl[0], step_kl[1], float(self.state.attempt)]
                if len(hist) > KL_HISTORY:
                    for old in sorted(hist, key=int)[: len(hist) - KL_HISTORY]:
                        del hist[old]
        if self.exporter is not None:
            self.exporter.update(int(good["step"]), data)

    def _announce_checkpoints(self) -> None:
        new = [c for c in self.checkpoints() if c.complete and c.step not in self.state.announced]
        for c in new:
            self._event("checkpoint", c.step, path=str(c.path), layout="verl")
            self.state.announced.append(c.step)
        if new:
            self._save()

    @property
    def checkpoint_root(self) -> Path:
        return self.ckpt_dir

    def classify_exit(self, code: int | None, saw_finished: bool, saw_oom: bool) -> str:
        """verl exits 1 on any error: the attempt's log says which (finished | oom | usage | crash)."""
        return self.exit_class(code).action

    def exit_class(self, exit_code: int | None) -> ExitClass:
        """How the current attempt ended (classified once, recorded as an event)."""
        s = self.state
        if s.exit and s.exit.get("attempt") == s.attempt:
            return ExitClass(s.exit["kind"], s.exit.get("exit_code"), s.exit.get("memory"), s.exit.get("evidence", ""),
                             s.exit.get("site"))
        self._relay()  # its last lines first, so the exit event follows its last step
        text = read_tail(str(self.run_dir / LOG_NAME), s.log_offset)
        ec = classify(text, exit_code)
        step = s.last_step
        if ec.kind == "finished":
            self._event("finished", step, exit_code=exit_code)
        elif ec.kind == "oom":
            micro = config_snapshot(RunInfo.read(self.run_dir).command).get(MICRO_KEY)
            self._event("oom", step, memory=ec.memory, site=ec.site, exit_code=exit_code, message=ec.evidence,
                        micro_batch_size=micro if isinstance(micro, int) else None)
        elif ec.kind == "resume" and s.resume_path:
            self._event("error", step, what=RESUME_FAILED, path=s.resume_path, exit_code=exit_code,
                        message=f"verl could not load {s.resume_path}: {ec.evidence}")
        elif ec.kind == "nan":
            self._event("nan", step, what="exit", exit_code=exit_code, message=ec.evidence)
        else:
            self._event("error", step, what="crash", exit_code=exit_code, message=ec.evidence)
        s.exit = {"attempt": s.attempt, **asdict(ec)}
        self._save()
        log.warning("%s: attempt %d ended: %s (exit %s) %s", self.run_id, s.attempt, ec.kind, exit_code, ec.evidence)
        return ec

    def close(self) -> None:
        """Stop serving /metrics."""
        if self.exporter is not None:
            self.exporter.close()


def _peak_rss_kb() -> int | None:
    """This process's peak resident set so far, in KiB (None where the platform does not say)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (ImportError, OSError):
        return None


def _step_of(path: str | None) -> int | None:
    if not path:
        return None
    name = Path(path).name
    return int(name.rsplit("_", 1)[1]) if name.startswith("global_step_") and name.rsplit("_", 1)[1].isdigit() else None


def _positive_int(v: Any) -> int | None:
    """A config value as a positive int (Hydra may hand it over as text), else None."""
    try:
        n = int(str(v))
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


#: How much of a trainer log's attempt is searched for verl's start-up lines.
LOG_HEAD_BYTES = 8 << 20


def _read_part(path: Path, offset: int) -> str:
    """Up to :data:`LOG_HEAD_BYTES` of ``path`` from ``offset`` ("" when unreadable)."""
    try:
        with os.fdopen(inputs.open_regular(path), "rb") as f:
            f.seek(max(0, offset))
            return f.read(LOG_HEAD_BYTES).decode(errors="replace")
    except OSError:
        return ""
