"""``python -m ppo_watchdog``: the same CLI as the ``watchdog`` console script."""

from __future__ import annotations

from ppo_watchdog.cli import main

if __name__ == "__main__":
    main()
