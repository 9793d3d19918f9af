"""The run-directory protocol: the one coupling between a trainer and the watchdog.

Torch-free and self-contained: it imports nothing else of the project, so a trainer (the
embedded one, or verl through ``ppo_watchdog.trainer.verl_glue``) imports it without the watchdog's
controller, and the watchdog reads runs without any trainer installed.

- :mod:`~ppo_watchdog.protocol.rundir`: the directory layout, JSONL and atomic writes, exit codes;
- :mod:`~ppo_watchdog.protocol.runinfo`: run.json as a typed, validated :class:`RunInfo`;
- :mod:`~ppo_watchdog.protocol.events`: events.jsonl lines as validated :class:`Event` objects;
- :mod:`~ppo_watchdog.protocol.control`: control.json (desired overrides and one-shot commands)
  and the one step-boundary dispatcher every trainer calls;
- :mod:`~ppo_watchdog.protocol.catalog`: every metric under its verl key, Prometheus and short
  name, with the exporter's and the watchdog's own series names;
- :mod:`~ppo_watchdog.protocol.checkpoint`: checkpoint manifests, verification and listing (torch
  only inside the functions that save and load tensors);
- :mod:`~ppo_watchdog.protocol.exporter`: the trainer-side ``/metrics`` under the catalog's names;
- :mod:`~ppo_watchdog.protocol.hydra`: ``key=value`` overrides read and written with Hydra's own
  override grammar.
"""
