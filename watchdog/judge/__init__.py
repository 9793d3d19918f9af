"""A rule pack judged on recorded runs: ``watchdog eval`` (labelled logs) and ``watchdog rules
calibrate`` (a family's thresholds from its healthy runs). The core's engine, planner and
pricing over logs read through :mod:`ppo_watchdog.sources`."""
