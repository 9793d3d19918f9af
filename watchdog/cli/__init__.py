"""The ``watchdog`` command line (Typer): one group per module, joined here with plain imports.

- :mod:`~ppo_watchdog.cli.rules`: ``rules list|check|test|explain|calibrate``, ``replay``, ``check``, ``eval``;
- :mod:`~ppo_watchdog.cli.run`: ``run``, ``daemon``, ``status``, ``history``, ``resume``, ``report``;
- :mod:`~ppo_watchdog.cli.dashboards`: ``dashboards export|push``.

Exit codes, one convention for every command (README, "Exit codes"): 0 ok; 1 the thing judged
failed (a rule test, a labelled run of ``eval``, a supervised run that did not finish); 2 bad input
or usage (a missing or invalid file, a rule file with errors, an unknown run, a trainer that
rejected its configuration, a run that cannot be resumed, a daemon config with no runs, a URL that
cannot be used); 130 ``watchdog run`` stopped by Ctrl-C. Messages for a person go to stderr;
``--json`` output alone goes to stdout.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from ppo_watchdog.cli import dashboards, rules, run

app = typer.Typer(
    name="watchdog",
    help="Stability watchdog with automatic rollback for PPO/RLHF training (verl dialect).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(rules.rules_app, name="rules")
app.add_typer(rules.commands)
app.add_typer(run.run_app)
app.add_typer(dashboards.dashboards_app, name="dashboards")


@app.callback()
def _root(
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="More log output (-v info, -vv debug).")] = 0,
) -> None:
    """Stability watchdog for PPO/RLHF training: rules, replay, eval, run, daemon, dashboards."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)


def main() -> None:
    """Entry point for ``python -m ppo_watchdog``."""
    app(prog_name="watchdog")
