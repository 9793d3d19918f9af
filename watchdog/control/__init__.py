"""The control loop: the per-run controller (tail, evaluate, plan, act), the actuator that
carries journal entries out idempotently, the SQLite store, and the APScheduler daemon that
ticks every run. The shell around the pure core: it may import every other package."""
