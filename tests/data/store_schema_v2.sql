-- The state database schema of version 2 (watchdog/store.py before the v3 migration), for migration tests.

CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    run_dir TEXT NOT NULL,
    command TEXT NOT NULL DEFAULT '[]',
    managed INTEGER NOT NULL DEFAULT 1,
    phase TEXT NOT NULL DEFAULT 'new',
    pid INTEGER,
    job_id TEXT,
    overrides TEXT NOT NULL DEFAULT '{}',
    control_version INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    oom_retries INTEGER NOT NULL DEFAULT 0,
    last_step INTEGER,
    last_evaluated_step INTEGER,
    metrics_offset INTEGER NOT NULL DEFAULT 0,
    events_offset INTEGER NOT NULL DEFAULT 0,
    events_line INTEGER NOT NULL DEFAULT 1,
    last_progress_ts REAL,
    launched_ts REAL,
    exit_code INTEGER,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rule_states (
    run_id TEXT PRIMARY KEY,
    version INTEGER,
    state TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS control_versions (
    run_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    overrides TEXT NOT NULL,
    commands TEXT NOT NULL,
    written_ts REAL,
    applied_step INTEGER,
    applied_ts REAL,
    PRIMARY KEY (run_id, version)
);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    rule TEXT NOT NULL,
    kind TEXT NOT NULL,
    severity TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    actions TEXT NOT NULL DEFAULT '[]',
    inputs TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL CHECK (status IN ('pending', 'applied', 'failed', 'skipped')),
    outcome TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_run ON decisions (run_id, step);
CREATE TABLE IF NOT EXISTS journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    decision_id INTEGER,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL CHECK (status IN ('intent', 'sent', 'waiting', 'done', 'failed')),
    control_version INTEGER,
    depends_on INTEGER,
    deadline REAL,
    result TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS journal_open ON journal (run_id, status);
CREATE TABLE IF NOT EXISTS bad_spans (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    rule TEXT NOT NULL,
    start_step INTEGER NOT NULL,
    end_step INTEGER,
    decision_id INTEGER,
    opened_ts REAL NOT NULL,
    closed_ts REAL
);
