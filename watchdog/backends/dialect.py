"""How a trainer speaks to the watchdog: one small interface, two dialects.

- :class:`ProtocolDialect`: a trainer that speaks the run-directory protocol itself (the
  embedded trainer, verl with ``trainer.verl_glue``): it writes its own events and
  manifests, reads control.json at every step boundary (live changes, pause and rollback in
  process), and exits with the protocol's codes.
- :class:`watchdog.backends.zero_patch.VerlGlue`: an unmodified ``verl.trainer.main_ppo``
  that reads no control.json; the watchdog relays its file logger, announces its checkpoints,
  classifies its exits from its log, and turns every change into a relaunch.

The controller and the actuator call these methods and never ask which dialect it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from watchdog.protocol import checkpoint as ckpt
from watchdog.protocol import rundir


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

    def classify_exit(self, code: int | None, saw_finished: bool, saw_oom: bool) -> str:
        """How the trainer ended: finished | oom | usage | crash."""
        ...

    def close(self) -> None:
        """Release what the dialect holds (a /metrics server)."""
        ...


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


class ProtocolDialect:
    """A trainer that speaks the run-directory protocol: nothing to translate."""

    live = True

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / rundir.CHECKPOINTS

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        return ckpt.list_checkpoints(self.checkpoint_root) if self.checkpoint_root.exists() else []

    def poll(self, proc: Any, watch_exit: bool) -> None:
        return None

    def prepare_launch(self, command: Sequence[str], overrides: Mapping[str, Any],
                       resume_path: str | None) -> tuple[list[str], dict[str, str] | None]:
        return list(command), None

    def launched(self, pid: int | None, command: Sequence[str], resume_path: str | None) -> None:
        return None  # the trainer writes run.json and its own ``started`` event

    def plan_resume(self, payload: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        return dict(payload)  # the trainer applies control.json's overrides before its first step

    def classify_exit(self, code: int | None, saw_finished: bool, saw_oom: bool) -> str:
        return classify_exit(code, saw_finished, saw_oom)

    def close(self) -> None:
        return None
