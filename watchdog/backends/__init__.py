"""Where and how a trainer runs: a local process (:mod:`~ppo_watchdog.backends.local`), a Ray Job
(:mod:`~ppo_watchdog.backends.ray_jobs`), and the dialect of an unmodified verl run, which speaks
no run-directory protocol (:mod:`~ppo_watchdog.backends.zero_patch`, with its exit classifier and
its lr patch for verl's resume)."""
