"""``python -m ppo_watchdog.trainer``: the embedded PPO trainer (see trainer/loop.py).

The config is parsed before torch and verl are imported, so a bad key fails in a
fraction of a second with exit code 2.
"""

from __future__ import annotations

import signal
import sys

from ppo_watchdog.trainer.config import USAGE, ConfigError, load_config, split_cli


def main(argv: list[str] | None = None) -> int:
    """Parse the config before torch loads (a bad key fails fast), then train; returns the exit code."""
    # A watchdog signals SIGUSR1 ("read control.json now") as soon as it has written a change,
    # possibly while this process is still importing torch: until the trainer installs its own
    # handler, the signal must not kill it (its default action). control.json is read before the
    # first step anyway.
    if argv is None:
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    try:
        config_file, overrides = split_cli(args)
        cfg = load_config(overrides, config_file)
    except (ConfigError, OSError) as exc:
        sys.stderr.write(f"config error: {exc}\n")
        return 2
    try:
        from ppo_watchdog.trainer.loop import run_cli
    except ImportError as exc:  # a core install (pip install ppo-watchdog) has no torch or verl
        sys.stderr.write(f"the embedded trainer needs torch and verl ({exc}): pip install 'ppo-watchdog[trainer]'\n")
        return 2
    return run_cli(cfg, args)


if __name__ == "__main__":
    sys.exit(main())
