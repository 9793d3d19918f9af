"""Our TaskRunner: verl's ``TaskRunnerV1`` that runs the glue's trainer and ends the run's record.

``run_ppo(config, task_runner_class=WatchdogTaskRunner)`` creates it as a Ray actor. Its
module imports :mod:`ppo_watchdog.trainer.verl_glue.trainer`, so ``watchdog_sync`` is registered in the
actor's process before verl's ``get_trainer_cls`` looks it up. A ``stop`` command ends
``fit`` with :class:`StopRequested` (state saved, ``stopped`` recorded): the runner turns
that into a normal return, so the launcher exits 0 as the embedded trainer does.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.trainer.main_ppo import TaskRunnerV1

from ppo_watchdog.trainer.verl_glue.boundary import StopRequested
from ppo_watchdog.trainer.verl_glue.runner import oom_fields
from ppo_watchdog.trainer.verl_glue.trainer import WatchdogPPOTrainer

#: verl's TaskRunnerV1 class, under its ``@ray.remote``.
TaskRunnerV1Class: type = TaskRunnerV1.__ray_actor_class__  # type: ignore[attr-defined]


@ray.remote
class WatchdogTaskRunner(TaskRunnerV1Class):  # type: ignore[misc, valid-type]
    """TaskRunnerV1 plus the protocol's last event (``finished`` or ``error``)."""

    def run(self, config: Any) -> None:
        """verl's run; a ``stop`` command is a normal end."""
        try:
            super().run(config)
        except StopRequested:
            t = getattr(self, "trainer", None)
            if t is not None:
                t._shutdown_dump_executor()  # fit's own last-step path does this; a stop skips it
            self._finish("")  # `stopped` is already recorded: just close up
            return
        except BaseException as exc:
            # One event per failure: an OOM is an ``oom`` (with the memory and the pass that ran out, for
            # the remedy), not also an ``error``; the driver writes none of its own then.
            fields = oom_fields(exc)
            if fields is not None:
                self._finish("oom", **fields)
            else:
                self._finish("error", message=f"{type(exc).__name__}: {exc}"[:2000], source="verl")
            raise
        self._finish("finished")

    def _finish(self, kind: str, **fields: Any) -> None:
        t = getattr(self, "trainer", None)
        if isinstance(t, WatchdogPPOTrainer):
            if kind == "finished":
                fields["steps"] = int(t.global_steps) - 1
            t.watchdog_finish(kind, **fields)
