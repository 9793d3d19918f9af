"""How a trainer speaks to the watchdog: one small interface, two dialects.

- :class:`ProtocolDialect`: a trainer that speaks the run-directory protocol itself (the
  embedded trainer, verl with ``ppo_watchdog.trainer.verl_glue``): it writes its own events and
  manifests, reads control.json at every step boundary (live changes, pause and rollback in
  process), and exits with the protocol's codes.
- :class:`ppo_watchdog.backends.zero_patch.VerlGlue`: an unmodified ``verl.trainer.main_ppo``
  that reads no control.json; the watchdog relays its file logger, announces its checkpoints,
  classifies its exits from its log, and turns every change into a relaunch.

The controller and the actuator call these methods and never ask which dialect it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ppo_watchdog.core.planner import config_value
from ppo_watchdog.protocol import checkpoint as ckpt
from ppo_watchdog.protocol import rundir
from ppo_watchdog.protocol.runinfo import RunInfo

log = logging.getLogger(__name__)

#: Known-good checkpoints kept out of the trainer's own pruning: the newest and the one before it
#: (a divergence found a few steps late can make the newest bad, and then the one before is needed).
KEEP_KNOWN_GOOD = 2
#: verl's settings under which it deletes old checkpoints itself (trainer/config/ppo_trainer.yaml).
PRUNE_KEYS = ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "trainer.remove_previous_ckpt_in_save")

IsBad = Callable[[int, float | None], bool]
"""Whether a checkpoint of (step, save time) was taken while a divergence rule fired."""


class Dialect(Protocol):
    """What the controller and the actuator need to know about how a run's trainer speaks."""

    live: bool
    """True when the trainer reads control.json: live sets, pause and rollback in process."""

    @property
    def checkpoint_root(self) -> Path:
        """Where the trainer saves its ``global_step_N`` checkpoints."""
        ...

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        """The run's checkpoints, each judged complete or not in this dialect's own terms."""
        ...

    def poll(self, proc: Any, watch_exit: bool) -> None:
        """Each tick: write what the trainer does not (relayed metrics, checkpoint and exit events)."""
        ...

    def prepare_launch(self, command: Sequence[str], overrides: Mapping[str, Any],
                       resume_path: str | None) -> tuple[list[str], dict[str, str] | None]:
        """The next attempt's command and extra environment."""
        ...

    def launched(self, pid: int | None, command: Sequence[str], resume_path: str | None) -> None:
        """Record a launch the trainer will not record itself."""
        ...

    def plan_resume(self, payload: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        """A restart's payload adjusted so the resumed trainer really runs with ``overrides``."""
        ...

    def stopping(self, resume_step: int | None) -> None:
        """The current attempt is about to be stopped for a relaunch from ``resume_step`` (None or 0: the start):
        what it writes from now on of steps past that belongs to the timeline the watchdog leaves."""
        ...

    def verify(self, path: Path | str) -> None:
        """Raise :class:`~ppo_watchdog.protocol.checkpoint.CheckpointError` when the trainer could not resume
        from the checkpoint at ``path`` (torn, corrupt, incomplete), checked before a relaunch goes there."""
        ...

    def classify_exit(self, code: int | None, saw_finished: bool, saw_oom: bool) -> str:
        """How the trainer ended: finished | oom | usage | crash."""
        ...

    def protect(self, is_bad: IsBad, hold: Collection[int] = ()) -> list[int]:
        """Keep the last known-good checkpoints, and those of the steps in ``hold`` (a rollback waiting for
        approval chose it), out of reach of the trainer's own pruning; their steps."""
        ...

    def close(self) -> None:
        """Release what the dialect holds (a /metrics server)."""
        ...


def verl_pruning(config: Mapping[str, Any]) -> str:
    """The verl settings in ``config`` under which verl deletes old checkpoints itself (empty: none)."""
    found = []
    for key in PRUNE_KEYS:
        v = config_value(config, key)
        if v not in (None, False, 0, "null", "None"):
            found.append(f"{key}={v}")
    return ", ".join(found)


def merge_kept(own: Iterable[ckpt.CheckpointInfo], kept: Iterable[ckpt.CheckpointInfo]) -> list[ckpt.CheckpointInfo]:
    """One entry per step: the trainer's own when complete, else the watchdog's kept copy when that is."""
    by_step = {c.step: c for c in own}
    for c in kept:
        have = by_step.get(c.step)
        if c.complete and (have is None or not have.complete):
            by_step[c.step] = c
    return [by_step[s] for s in sorted(by_step)]


def protect_known_good(root: Path, candidates: Iterable[ckpt.CheckpointInfo], is_bad: IsBad,
                       keep: int = KEEP_KNOWN_GOOD, hold: Collection[int] = ()) -> list[int]:
    """Hard-link the newest ``keep`` complete checkpoints ``is_bad`` clears, and the complete ones of the steps
    in ``hold``, into ``root/.watchdog_kept`` and drop older kept copies (they are no longer the last
    known-good); returns their steps."""
    ordered = sorted(candidates, key=lambda c: c.step, reverse=True)
    good = [c for c in ordered if c.complete and not is_bad(c.step, c.ts)][:keep]
    good += [c for c in ordered if c.complete and c.step in hold and c not in good]
    kept_dir = ckpt.kept_root(root).resolve()
    for c in good:
        if c.path.resolve().parent != kept_dir:
            ckpt.keep_checkpoint(c.path, root)
    ckpt.release_kept(root, {c.path.name for c in good})
    return [c.step for c in good]


def pruning_notice(setting: str, root: Path) -> str:
    """The start-up line for a run whose trainer prunes its own checkpoints."""
    return (f"{setting}: verl deletes older checkpoints itself; the watchdog keeps hard links of the last "
            f"{KEEP_KNOWN_GOOD} known-good ones in {ckpt.kept_root(root)} (no extra disk until verl deletes the "
            f"originals, then up to {KEEP_KNOWN_GOOD} checkpoints' worth) so a rollback can still reach them; "
            f"a rollback further back than those is impossible")


def classify_exit(code: int | None, saw_finished: bool, saw_oom: bool) -> str:
    """finished | oom | usage | crash, from the protocol's exit code (None when unknown) and the run's events."""
    if code == rundir.EXIT_USAGE:
        return "usage"
    if code == rundir.EXIT_OOM or (code is None and saw_oom):
        return "oom"
    if code == 0 and saw_oom and not saw_finished:
        return "oom"
    if code == 0 or (code is None and saw_finished):
        return "finished"
    return "crash"


def checkpoint_root(run_dir: Path | str, info: RunInfo) -> Path:
    """Where a run's checkpoints are: run.json's ``checkpoint_dir`` (verl's ``default_local_dir``, written by
    the glue), else ``run_dir/checkpoints``. The one rule for it, whichever dialect asks."""
    return Path(info.checkpoint_dir) if info.checkpoint_dir else Path(run_dir) / rundir.CHECKPOINTS


class ProtocolDialect:
    """A trainer that speaks the run-directory protocol: nothing to translate."""

    live = True

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)
        self._noticed = False
        self._pruning: tuple[Any, str] | None = None
        """(run.json's config, verl's pruning settings in it): a daemon asks every run at every tick."""

    @property
    def checkpoint_root(self) -> Path:
        """run.json's ``checkpoint_dir`` (the in-process verl glue writes verl's default_local_dir there),
        else run_dir/checkpoints."""
        return checkpoint_root(self.run_dir, RunInfo.read(self.run_dir))

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        root = self.checkpoint_root
        return merge_kept(ckpt.list_checkpoints(root), ckpt.list_checkpoints(ckpt.kept_root(root)))

    def protect(self, is_bad: IsBad, hold: Collection[int] = ()) -> list[int]:
        """The in-process verl glue's checkpoints (manifests over verl's layout) under verl's own pruning."""
        config = RunInfo.read(self.run_dir).config  # (the cached read's own object while run.json is unchanged)
        if self._pruning is None or self._pruning[0] is not config:
            self._pruning = (config, verl_pruning(config))
        setting = self._pruning[1]
        if not setting:
            return []
        root = self.checkpoint_root
        if not self._noticed:
            log.warning("%s", pruning_notice(setting, root))
            self._noticed = True
        # Cheap: manifests read and files stat'ed, nothing hashed (a pruned actor/ leaves its manifest).
        own = [c for c in ckpt.list_checkpoints(root, verify=False) if c.complete and ckpt.files_present(c.path)]
        return protect_known_good(root, merge_kept(own, ckpt.list_checkpoints(ckpt.kept_root(root), verify=False)),
                                  is_bad, hold=hold)

    def poll(self, proc: Any, watch_exit: bool) -> None:
        return None

    def prepare_launch(self, command: Sequence[str], overrides: Mapping[str, Any],
                       resume_path: str | None) -> tuple[list[str], dict[str, str] | None]:
        return list(command), None

    def launched(self, pid: int | None, command: Sequence[str], resume_path: str | None) -> None:
        return None  # the trainer writes run.json and its own ``started`` event

    def plan_resume(self, payload: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        return dict(payload)  # the trainer applies control.json's overrides before its first step

    def stopping(self, resume_step: int | None) -> None:
        return None  # the trainer's own steps: it writes none after its stop

    def verify(self, path: Path | str) -> None:
        """Its manifest complete and every file's checksum right."""
        ckpt.verify_checkpoint(path)

    def classify_exit(self, code: int | None, saw_finished: bool, saw_oom: bool) -> str:
        return classify_exit(code, saw_finished, saw_oom)

    def close(self) -> None:
        return None
