"""Where a run's metrics and events are read from: its files (:mod:`~ppo_watchdog.sources.ingest`:
metrics.jsonl, verl's FileLogger output and console logs, events.jsonl) or Prometheus
(:mod:`~ppo_watchdog.sources.prometheus`). Imports the protocol and the core, never control."""
