"""Where and how a trainer runs: a local process (:mod:`~watchdog.backends.local`), a Ray Job
(:mod:`~watchdog.backends.ray_jobs`), and the dialect of an unmodified verl run, which speaks
no run-directory protocol (:mod:`~watchdog.backends.zero_patch`, with its exit classifier and
its lr patch for verl's resume)."""
