"""The watchdog's durable state: one SQLite file (WAL) per state directory.

What lives here is what a restarted watchdog needs to carry on without losing or
doubling an action:

- ``runs``: each supervised or watched run, its command, desired overrides, the newest
  control.json version, restart and OOM-retry counters, tail offsets and the last step
  evaluated (so a restart never re-decides a step).
- ``rule_states``: the rules engine's serialised state (cooldowns, budgets, pending
  counters) with its version.
- ``decisions``: every decision with its inputs, its status (pending / applied / failed /
  skipped / advised / waiting / denied) and its outcome, the audit log ``watchdog history`` prints.
- ``journal``: the actions journal. An action's intent is written (in the same
  transaction as the decision and the engine state) before it is carried out and marked
  done only after confirmation; a restarted watchdog re-drives open entries, which are
  idempotent by construction (control.json versions, pids).
- ``control_versions``: every control.json version written and the step it was applied at.
- ``bad_spans``: steps during which a divergence rule fired, for "last known-good".

All writes go through one connection guarded by a lock: the scheduler's worker thread
and the CLI thread may share a :class:`Store`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.core.vocabulary import (
    ACTION_STATUSES,
    DECISION_STATUSES,
    OPEN_ACTION_STATUSES,
    ActionStatus,
    Word,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 6
_JOURNAL_TABLE = """
CREATE TABLE IF NOT EXISTS journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    decision_id INTEGER,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL CHECK (status IN ('intent', 'sent', 'waiting', 'done', 'failed', 'dropped', 'advised',
                                           'awaiting', 'denied')),
    control_version INTEGER,
    deadline REAL,
    result TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
)"""
_DECISIONS_TABLE = """
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
    status TEXT NOT NULL CHECK (status IN ('pending', 'applied', 'failed', 'skipped', 'advised', 'waiting',
                                           'denied')),
    outcome TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    signals TEXT NOT NULL DEFAULT '{}'
)"""
_JOURNAL_COLUMNS = ("id, run_id, decision_id, kind, payload, status, control_version, deadline, result, created,"
                    " updated")
_DECISION_COLUMNS = ("id, run_id, step, rule, kind, severity, message, actions, inputs, status, outcome, created,"
                     " updated, signals")


def _rebuild_statuses(old: int) -> tuple[str, ...]:
    """Journal and decisions rebuilt with the statuses of this version: SQLite changes a CHECK only by
    rebuilding its table."""
    return (
        f"ALTER TABLE journal RENAME TO journal_v{old}",
        _JOURNAL_TABLE,
        f"INSERT INTO journal ({_JOURNAL_COLUMNS}) SELECT {_JOURNAL_COLUMNS} FROM journal_v{old}",
        f"DROP TABLE journal_v{old}",
        "CREATE INDEX IF NOT EXISTS journal_open ON journal (run_id, status)",
        f"ALTER TABLE decisions RENAME TO decisions_v{old}",
        _DECISIONS_TABLE,
        f"INSERT INTO decisions ({_DECISION_COLUMNS}) SELECT {_DECISION_COLUMNS} FROM decisions_v{old}",
        f"DROP TABLE decisions_v{old}",
        "CREATE INDEX IF NOT EXISTS decisions_run ON decisions (run_id, step)",
    )


#: What brings a database of version N-1 to version N, applied in the opening transaction.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE runs ADD COLUMN job_id TEXT",),  # the Ray Job a run's trainer runs as
    3: (
        # Read positions live with the engine state (one transaction per tick); these were never read.
        "ALTER TABLE runs DROP COLUMN metrics_offset",
        "ALTER TABLE runs DROP COLUMN events_offset",
        "ALTER TABLE runs DROP COLUMN events_line",
        "ALTER TABLE runs ADD COLUMN startup_s REAL",  # measured relaunch cost: stop to first new step
        "ALTER TABLE decisions ADD COLUMN signals TEXT NOT NULL DEFAULT '{}'",
        # The journal gains 'dropped' (a deferred set whose condition cleared) and loses depends_on.
        "ALTER TABLE journal RENAME TO journal_v2",
        _JOURNAL_TABLE,
        "INSERT INTO journal (id, run_id, decision_id, kind, payload, status, control_version, deadline, result,"
        " created, updated) SELECT id, run_id, decision_id, kind, payload, status, control_version, deadline,"
        " result, created, updated FROM journal_v2",
        "DROP TABLE journal_v2",
        "CREATE INDEX IF NOT EXISTS journal_open ON journal (run_id, status)",
    ),
    # A run is its resolved directory: two directories of one name are two runs (v3 let the second
    # take the first's record and tail the first's files). Fails, naming both, if a v3 state has one
    # directory under two run ids.
    4: ("CREATE UNIQUE INDEX IF NOT EXISTS runs_dir ON runs (run_dir)",),
    # Advise mode: decisions and journal entries gain 'advised' (said as what would be done, never done).
    5: _rebuild_statuses(4),
    # Approval (--approve): journal entries gain 'awaiting' (held for a person) and 'denied', decisions
    # 'waiting' and 'denied'.
    6: _rebuild_statuses(5),
}
_INDEXES = (
    # A decision's journal entries, read each time one of them ends (settle_decision): without it each read
    # scanned the whole journal, which grows all the while a daemon runs.
    "CREATE INDEX IF NOT EXISTS journal_decision ON journal (decision_id)",
)
"""Indexes every database of this schema version gets when a watchdog opens it to write, after any migration:
only reads are faster, so a watchdog of the same version without them reads the same data."""
DB_NAME = "watchdog.db"
_OPEN_SQL = "(" + ", ".join(f"'{s}'" for s in OPEN_ACTION_STATUSES) + ")"
"""The open statuses as an SQL list (constants of the vocabulary, never input)."""
WRITER_GATE = "-writer"
"""The suffix of the file next to the database that writers of this code take a ``flock`` on around each
write transaction (:class:`_WriterGate`)."""
GATE_POLL_S = (0.0002, 0.002)
"""A writer waiting on the gate tries again after the first, doubling up to the second: it tries again within
2 ms of the other writer's commit (SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ... ms)."""


class Phase(Word):
    """Where a run is, as the store knows it."""

    NEW = "new"
    """Registered, not launched yet."""
    RUNNING = "running"
    PAUSED = "paused"
    """Paused by a rule's ``pause`` (waiting for ``watchdog resume``)."""
    ESCALATED = "escalated"
    """Paused by an escalation (a budget exhausted)."""
    RESTARTING = "restarting"
    FINISHED = "finished"
    FAILED = "failed"
    """Given up (restart or OOM budget spent, a rejected config)."""
    STOPPED = "stopped"
    """Ended by the watchdog with a verdict (``--on-escalate stop``, the pause timeout)."""
    DETACHED = "detached"
    """Watched only: the watchdog launches nothing."""


_SCHEMA = """
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
    last_progress_ts REAL,
    launched_ts REAL,
    exit_code INTEGER,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    startup_s REAL
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
""" + _DECISIONS_TABLE + """;
CREATE INDEX IF NOT EXISTS decisions_run ON decisions (run_id, step);
""" + _JOURNAL_TABLE + """;
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
"""



class _WriterGate:
    """Who writes next among this watchdog's processes on one state (a sharded daemon's shards, a command).

    SQLite lets one connection write at a time; one that finds the lock taken sleeps in its busy handler 1,
    2, 5, 10, 15, 20, 25 ms ... between tries, so a shard waiting on another shard's 20 ms commit wakes at 33
    ms, and two shards' ticks lost tens of milliseconds a tick that way (bench/daemon_scale.py --shards 2 --together).
    Writers of this code take this ``flock`` first and poll it every :data:`GATE_POLL_S`, so a waiting writer
    tries again within 2 ms of the other's commit (polled, not queued: a writer that commits and begins again
    at once may keep it); SQLite's lock stays what decides (a writer without the gate, an older version, waits
    in the busy handler as before). The wait for the gate is bounded by the store's busy timeout, and so is
    the wait for SQLite's lock after it. A gate that cannot be opened or locked (a state directory others
    own, a file system without ``flock``) is said once and left out: SQLite alone orders the writers."""

    __slots__ = ("db", "fd", "path", "timeout_s", "_closer", "__weakref__")

    def __init__(self, db: Path, timeout_s: float, writes: bool) -> None:
        self.db = db
        self.path = db.with_name(db.name + WRITER_GATE)
        self.timeout_s = timeout_s
        self.fd: int | None = None
        self._closer: Callable[[], Any] | None = None
        if writes:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                self._give_up(exc)
            else:
                # (A store nobody closes, a CLI command's, closes its gate when it is collected, as sqlite3 does.)
                self._closer = weakref.finalize(self, os.close, self.fd)

    def _give_up(self, exc: OSError) -> None:
        log.warning("%s: no writer gate (%s); SQLite's lock alone orders the writers", self.path, exc)
        self.close()

    def acquire(self) -> None:
        fd = self.fd
        if fd is None:
            return
        deadline: float | None = None
        delay, most = GATE_POLL_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                self._give_up(exc)
                return
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now >= deadline:
                raise StoreError(_locked_error(self.db, self.timeout_s, f"its writer gate {self.path.name} held"))
            time.sleep(delay)
            delay = min(2 * delay, most)

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            except OSError as exc:  # (it cannot be held any more once closed)
                self._give_up(exc)

    def close(self) -> None:
        self.fd = None
        if self._closer is not None:
            self._closer()


class _Transaction:
    """:meth:`Store.transaction`'s context: a class, not a generator, since a daemon's tick enters thousands."""

    __slots__ = ("store", "outer")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.outer = False

    def __enter__(self) -> sqlite3.Connection:
        st = self.store
        st._lock.acquire()
        try:
            self.outer = st._depth == 0
            if self.outer:
                st._gate.acquire()
                try:
                    st._db.execute("BEGIN IMMEDIATE")
                except BaseException as exc:
                    st._gate.release()
                    if isinstance(exc, sqlite3.OperationalError):
                        raise StoreError(_db_error(st.path, exc, st.busy_timeout_s)) from exc
                    raise
            st._depth += 1
        except BaseException:
            st._lock.release()
            raise
        return st._db

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        st = self.store
        hooks: list[Callable[[], None]] = []
        try:
            st._depth -= 1
            if kind is not None:
                st._no_open.clear()  # a rollback can reopen an entry this transaction closed
                if self.outer:
                    st._after_commit.clear()
                    if st._db.in_transaction:  # (SQLite may have rolled it back itself: a full disk)
                        st._db.execute("ROLLBACK")
            elif self.outer:
                try:
                    st._db.execute("COMMIT")
                except BaseException:  # (whatever SQLite kept of it, nothing is known of it any more)
                    st._no_open.clear()
                    st._after_commit.clear()
                    raise
                hooks, st._after_commit = st._after_commit, []
        finally:
            if self.outer:
                st._no_open_synced = False  # (the write lock is let go: others may commit from now on)
                st._gate.release()
            st._lock.release()
        for hook in hooks:  # (outside the lock: a Grafana annotation is an HTTP request)
            st._run_hook(hook)


class _Savepoint:
    """:meth:`Store.savepoint`'s context (a class, as :class:`_Transaction`: a daemon's tick enters one a run)."""

    __slots__ = ("store", "tx", "hooks")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.tx: _Transaction | None = None
        self.hooks = 0

    def __enter__(self) -> sqlite3.Connection:
        st = self.store
        st._lock.acquire()
        if st._depth == 0:  # no transaction running: this unit is one (it takes the lock itself)
            st._lock.release()
            self.tx = _Transaction(st)
            return self.tx.__enter__()
        try:
            if not st._db.in_transaction:
                # SQLite ended the enclosing transaction itself (a full disk, an I/O error): what the units
                # before this one wrote is gone, so nothing more is written in it; the caller's commit fails.
                raise StoreError(f"{st.path}: the transaction was rolled back by SQLite; nothing of it is kept")
            # One name for every unit: they nest, and SQLite's RELEASE and ROLLBACK TO take the newest of a
            # name. The same text each time stays compiled in sqlite3's statement cache (a name a unit: 5 us more).
            st._db.execute("SAVEPOINT unit")
            st._depth += 1
            self.hooks = len(st._after_commit)
        except BaseException:
            st._lock.release()
            raise
        return st._db

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self.tx is not None:
            self.tx.__exit__(kind, exc, tb)
            return
        st = self.store
        try:
            st._depth -= 1
            if kind is None:
                st._db.execute("RELEASE unit")
                return
            st._no_open.clear()
            del st._after_commit[self.hooks:]  # what the undone unit wanted done after the commit
            if st._db.in_transaction:
                try:
                    st._db.execute("ROLLBACK TO unit")
                    st._db.execute("RELEASE unit")
                except sqlite3.Error:
                    pass  # the whole transaction is gone; the next unit and the commit say so
        finally:
            st._lock.release()


class StoreError(RuntimeError):
    """The state database cannot be used (wrong schema version, unknown run); names the file."""


class NoState(StoreError):
    """No state database where one was to be read (nothing was created)."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def _locked_error(path: Path, busy_timeout_s: float, why: str) -> str:
    """The database stayed locked past the busy timeout (SQLite's lock, or the writer gate before it)."""
    return (f"{path}: locked by another process for more than {busy_timeout_s:g} s ({why}); "
            "is a watchdog daemon or run writing to it? It is tried again, nothing is lost")


def _db_error(path: Path, exc: sqlite3.DatabaseError, busy_timeout_s: float) -> str:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return _locked_error(path, busy_timeout_s, text)
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return (f"{path}: not a usable watchdog state database ({text}); move it aside to start afresh "
                "(the runs' own directories keep their metrics, events and checkpoints)")
    return f"{path}: {text}"


@dataclass
class RunRecord:
    """One run as the store knows it."""

    run_id: str
    """Stable name of the run (the run directory's name unless given)."""
    run_dir: str
    """Absolute path of the run directory."""
    command: list[str] = field(default_factory=list)
    """The command the watchdog launches (empty for a run it only watches)."""
    managed: bool = True
    """True when the watchdog started the trainer and may stop and relaunch it."""
    phase: str = Phase.NEW
    """A :class:`Phase`."""
    pid: int | None = None
    """Process id of the current trainer (process-group leader); None for a Ray Job."""
    job_id: str | None = None
    """Ray submission id of the current trainer when it runs as a Ray Job (then ``pid`` is None)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Desired config overrides (verl Hydra keys), also in control.json and restart args."""
    control_version: int = 0
    """Newest control.json version written."""
    restarts: int = 0
    """Restarts used for crash/hang/live-timeout (bounded by the restart budget)."""
    oom_retries: int = 0
    """OOM restarts used (bounded separately)."""
    last_step: int | None = None
    """Newest step seen in metrics.jsonl."""
    last_evaluated_step: int | None = None
    """Newest step the rules were evaluated at; never evaluated again unless rewound."""
    last_progress_ts: float | None = None
    """Wall time when the newest step (or the launch) was first seen: the heartbeat."""
    launched_ts: float | None = None
    """Wall time of the last launch."""
    exit_code: int | None = None
    """Exit code of the last trainer process, when known."""
    created: float = 0.0
    """When the run was first registered."""
    updated: float = 0.0
    """Last change."""
    startup_s: float | None = None
    """Measured cost of the last relaunch: the old trainer stopped to the new one's first step (seconds)."""


@dataclass
class ActionRecord:
    """One entry of the actions journal."""

    id: int
    """Journal id (monotonic)."""
    run_id: str
    """Run the action is for."""
    decision_id: int | None
    """Decision that asked for it (None for the watchdog's own: crash restart, resume)."""
    kind: str
    """live_set | command | restart | notify | resume ..."""
    payload: dict[str, Any]
    """Everything needed to carry it out again after a crash."""
    status: str
    """One of :data:`ACTION_STATUSES`."""
    control_version: int | None
    """control.json version carrying it (live actions), for confirmation."""
    deadline: float | None
    """Wall time after which an unconfirmed live action falls back to a restart."""
    result: dict[str, Any]
    """What happened (pid, applied step, error)."""
    created: float
    """When the intent was written."""
    updated: float
    """Last change."""


_RUN_JSON_FIELDS = ("command", "overrides")
_RUN_COLUMNS = tuple(RunRecord.__dataclass_fields__)


def _now() -> float:
    return time.time()


class Store:
    """SQLite (WAL) state of a watchdog; one file, shared by the daemon and the CLI."""

    def __init__(self, path: Path | str, create: bool = True, busy_timeout_s: float = 30.0,
                 read_only: bool = False) -> None:
        """``create=False``: only an existing state (``watchdog status`` on a new directory creates
        nothing). ``busy_timeout_s``: how long a write waits for another process's lock.
        ``read_only``: for the commands that only look (status, history, report): the file is opened
        read-only, so nothing is ever written into it (no schema into an empty file, no migration)."""
        path = Path(path)
        if path.is_dir() or path.suffix != ".db":
            if path.exists() and not path.is_dir():
                raise StoreError(f"{path}: not a directory (a state directory holds {DB_NAME})")
            path = path / DB_NAME
        if (read_only or not create) and not path.is_file():
            raise NoState(f"{path.parent}: no watchdog state here (no {DB_NAME}); "
                          "pass the --state-dir a watchdog run or daemon used", path)
        if read_only:
            self._open_read_only(path, busy_timeout_s)
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{path.parent}: cannot create the state directory ({exc.strerror or exc})") from exc
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._init_unit_state(writes=True)
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves so a decision, the engine
            # state and the journal intents land in one transaction.
            self._db = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None,
                                       check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            with self.transaction():
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self._db.execute(stmt)
                row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is None:
                    self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                    for stmt in _MIGRATIONS[4]:  # the index a new database needs; older ones migrate to it
                        self._db.execute(stmt)
                elif int(row["value"]) != SCHEMA_VERSION:
                    self._migrate(path, int(row["value"]))
                for stmt in _INDEXES:
                    self._db.execute(stmt)
        except sqlite3.DatabaseError as exc:
            self._gate.close()
            raise StoreError(_db_error(path, exc, busy_timeout_s)) from exc

    def _init_unit_state(self, writes: bool) -> None:
        """What the connection's units of work keep (both ways of opening a store)."""
        self._gate = _WriterGate(self.path, self.busy_timeout_s, writes)
        self._lock = threading.RLock()
        self._depth = 0
        self._no_open: set[str] = set()
        """Runs known to have no open journal entry (:meth:`open_actions` answers them without a query) as of
        :attr:`_no_open_version`; forgotten on any journal write that could open one and on any rollback."""
        self._no_open_version: int | None = None
        self._no_open_synced = False
        """:attr:`_no_open` checked against ``data_version`` in the running write transaction: no other
        connection can commit while it holds the write lock (BEGIN IMMEDIATE), so once is enough."""
        self._after_commit: list[Callable[[], None]] = []
        """What :meth:`after_commit` holds until the running transaction commits (dropped if it does not)."""

    def _open_read_only(self, path: Path, busy_timeout_s: float) -> None:
        """Open an existing state for reading only; NoState for an empty file, StoreError for anything else
        that is not this watchdog's state at this schema version."""
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._init_unit_state(writes=False)
        if path.stat().st_size == 0:
            # What a watchdog killed while creating its state leaves: no state yet (and none is written here).
            raise NoState(f"{path}: an empty file, no watchdog state in it yet (nothing was written to it)", path)
        try:
            self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=busy_timeout_s,
                                       isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not {"meta", "runs", "decisions", "journal"} <= tables:
                raise StoreError(f"{path}: not a watchdog state database (tables: "
                                 f"{', '.join(sorted(tables)) or 'none'})")
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            if hasattr(self, "_db"):
                self._db.close()
            raise StoreError(_db_error(path, exc, busy_timeout_s)) from exc
        except StoreError:
            self._db.close()
            raise
        version = int(row["value"]) if row is not None and str(row["value"]).isdigit() else None
        if version != SCHEMA_VERSION:
            self._db.close()
            raise StoreError(f"{path}: schema version {version}, this watchdog speaks {SCHEMA_VERSION} (a watchdog "
                             "run or daemon of this version migrates it; looking does not)")

    def _migrate(self, path: Path, version: int) -> None:
        """Bring an older database up to :data:`SCHEMA_VERSION` (inside the opening transaction)."""
        if not 1 <= version < SCHEMA_VERSION:
            raise StoreError(f"{path}: schema version {version}, this watchdog speaks {SCHEMA_VERSION}")
        for v in range(version + 1, SCHEMA_VERSION + 1):
            if v == 4:
                twice = self._db.execute("SELECT run_dir, group_concat(run_id, ', ') AS ids FROM runs "
                                         "GROUP BY run_dir HAVING count(*) > 1").fetchall()
                if twice:
                    raise StoreError(f"{path}: one run directory under several run ids, which this watchdog "
                                     f"cannot tell apart: " + "; ".join(f"{r['run_dir']}: {r['ids']}" for r in twice))
            for stmt in _MIGRATIONS[v]:
                self._db.execute(stmt)
        self._db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()
            self._gate.close()

    def transaction(self) -> _Transaction:
        """One atomic unit; nests (inner blocks join the outer transaction)."""
        return _Transaction(self)

    def savepoint(self) -> _Savepoint:
        """A unit that is undone alone when it fails, inside a running transaction (a daemon's tick: one
        run's failure does not undo the others'); outside one, a transaction of its own."""
        return _Savepoint(self)

    def after_commit(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` once what is being written is committed: at once outside a transaction, else after
        the outermost commit, and never when the transaction (or the savepoint it was asked in) is undone. For
        what leaves the process (a counter on /metrics, a Grafana annotation): an undone tick must not say
        twice what it will say again when its steps are read again."""
        with self._lock:
            if self._depth:
                self._after_commit.append(hook)
                return
        self._run_hook(hook)

    @staticmethod
    def _run_hook(hook: Callable[[], None]) -> None:
        try:
            hook()
        except Exception:  # what the commit kept stays kept; the hook's failure is said
            log.exception("after a commit: %r failed", hook)

    # -- runs ---------------------------------------------------------------------------

    def upsert_run(self, run: RunRecord) -> RunRecord:
        """Insert or replace a run record."""
        now = _now()
        run.created = run.created or now
        run.updated = now
        values = []
        for name in _RUN_COLUMNS:
            v = getattr(run, name)
            if name in _RUN_JSON_FIELDS:
                v = json.dumps(v, sort_keys=True)
            elif name == "managed":
                v = int(v)
            values.append(v)
        with self.transaction() as db:
            db.execute(
                f"INSERT OR REPLACE INTO runs ({', '.join(_RUN_COLUMNS)}) "
                f"VALUES ({', '.join('?' * len(_RUN_COLUMNS))})",
                values,
            )
        return run

    def get_run(self, run_id: str) -> RunRecord | None:
        """The run, or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return _run_from_row(row) if row else None

    def require_run(self, run_id: str) -> RunRecord:
        """The run; raises :class:`StoreError` naming the database when unknown."""
        run = self.get_run(run_id)
        if run is None:
            raise StoreError(f"{self.path}: no run {run_id!r} (known: {', '.join(self.run_ids()) or 'none'})")
        return run

    def run_for_dir(self, run_dir: Path | str) -> RunRecord | None:
        """The run of a directory (by its resolved path), or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM runs WHERE run_dir=?", (str(Path(run_dir).resolve()),)).fetchone()
        return _run_from_row(row) if row else None

    def new_run_id(self, run_dir: Path | str) -> str:
        """An id for a directory no run has yet: its name, or, when another directory has that name,
        the name and a short hash of the resolved path (``exp-3f2a9c1d``), so ids never collide."""
        path = Path(run_dir).resolve()
        if self.get_run(path.name) is None:
            return path.name
        return f"{path.name}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"

    def run_ids(self) -> list[str]:
        """All run ids, oldest first."""
        with self._lock:
            return [r["run_id"] for r in self._db.execute("SELECT run_id FROM runs ORDER BY created")]

    def list_runs(self) -> list[RunRecord]:
        """All runs, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM runs ORDER BY created").fetchall()
        return [_run_from_row(r) for r in rows]

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Change some fields of a run."""
        unknown = set(fields) - set(_RUN_COLUMNS)
        if unknown:
            raise KeyError(f"unknown run field(s): {', '.join(sorted(unknown))}")
        fields["updated"] = _now()
        sets, values = [], []
        for name, v in fields.items():
            if name in _RUN_JSON_FIELDS:
                v = json.dumps(v, sort_keys=True)
            elif name == "managed":
                v = int(v)
            sets.append(f"{name}=?")
            values.append(v)
        with self.transaction() as db:
            cur = db.execute(f"UPDATE runs SET {', '.join(sets)} WHERE run_id=?", (*values, run_id))
            if cur.rowcount != 1:
                raise StoreError(f"{self.path}: no run {run_id!r}")

    # -- engine state -------------------------------------------------------------------

    def load_engine_state(self, run_id: str) -> dict[str, Any] | None:
        """The rules engine's serialised state for a run, or None."""
        with self._lock:
            row = self._db.execute("SELECT state FROM rule_states WHERE run_id=?", (run_id,)).fetchone()
        return json.loads(row["state"]) if row else None

    def save_engine_state(self, run_id: str, version: int, text: str) -> None:
        """Persist a run's state: a JSON object as text (what :meth:`load_engine_state` reads back) of its
        ``version``."""
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO rule_states VALUES (?, ?, ?, ?)", (run_id, version, text, _now()))

    # -- decisions ----------------------------------------------------------------------

    def add_decision(
        self,
        run_id: str,
        step: int,
        rule: str,
        kind: str,
        actions: list[dict[str, Any]],
        inputs: dict[str, float],
        severity: str = "",
        message: str = "",
        status: str = "pending",
        outcome: str = "",
        signals: dict[str, str] | None = None,
    ) -> int:
        """Record a decision with its inputs (and the verl key each metric came from); returns its id."""
        if status not in DECISION_STATUSES:
            raise ValueError(f"decision status {status!r} not in {DECISION_STATUSES}")
        now = _now()
        with self.transaction() as db:
            cur = db.execute(
                "INSERT INTO decisions (run_id, step, rule, kind, severity, message, actions, inputs, status,"
                " outcome, created, updated, signals) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id, int(step), rule, kind, severity, message,
                    json.dumps(actions, sort_keys=True), json.dumps(_jsonable(inputs), sort_keys=True),
                    status, outcome, now, now, json.dumps(signals or {}, sort_keys=True),
                ),
            )
            return int(cur.lastrowid or 0)

    def set_decision(self, decision_id: int, status: str, outcome: str | None = None) -> None:
        """Change a decision's status (and outcome text)."""
        if status not in DECISION_STATUSES:
            raise ValueError(f"decision status {status!r} not in {DECISION_STATUSES}")
        with self.transaction() as db:
            if outcome is None:
                db.execute("UPDATE decisions SET status=?, updated=? WHERE id=?", (status, _now(), decision_id))
            else:
                db.execute(
                    "UPDATE decisions SET status=?, outcome=?, updated=? WHERE id=?",
                    (status, outcome, _now(), decision_id),
                )

    def decisions(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Decisions (oldest first) as plain dicts, each with its journal entries under ``journal``."""
        with self._lock:
            if run_id is None:
                rows = self._db.execute("SELECT * FROM decisions ORDER BY id").fetchall()
                jrows = self._db.execute("SELECT * FROM journal ORDER BY id").fetchall()
            else:
                rows = self._db.execute("SELECT * FROM decisions WHERE run_id=? ORDER BY id", (run_id,)).fetchall()
                jrows = self._db.execute("SELECT * FROM journal WHERE run_id=? ORDER BY id", (run_id,)).fetchall()
        by_decision: dict[int, list[dict[str, Any]]] = {}
        for j in jrows:
            if j["decision_id"] is not None:
                by_decision.setdefault(j["decision_id"], []).append(_action_dict(_action_from_row(j)))
        out = []
        for r in rows:
            d = _decision_from_row(r)
            d["journal"] = by_decision.get(d["id"], [])
            out.append(d)
        return out

    def journal(self, run_id: str | None = None) -> list[ActionRecord]:
        """All journal entries (oldest first)."""
        with self._lock:
            if run_id is None:
                rows = self._db.execute("SELECT * FROM journal ORDER BY id").fetchall()
            else:
                rows = self._db.execute("SELECT * FROM journal WHERE run_id=? ORDER BY id", (run_id,)).fetchall()
        return [_action_from_row(r) for r in rows]

    def journal_statuses(self, run_id: str, kinds: Sequence[str]) -> list[str]:
        """The statuses of a run's journal entries of these kinds, oldest first: what a commit asks of the
        journal before it plans (a relaunch in flight), without reading each entry's payload."""
        marks = ", ".join("?" * len(kinds))
        with self._lock:
            rows = self._db.execute(f"SELECT status FROM journal WHERE run_id=? AND kind IN ({marks}) ORDER BY id",
                                    (run_id, *kinds)).fetchall()
        return [r[0] for r in rows]

    # -- actions journal ----------------------------------------------------------------

    def add_action(
        self,
        run_id: str,
        kind: str,
        payload: dict[str, Any],
        decision_id: int | None = None,
        status: str = "intent",
    ) -> int:
        """Write an action's intent before carrying it out (or, ``waiting``, deferred); returns its journal id."""
        if status not in ACTION_STATUSES:
            raise ValueError(f"action status {status!r} not in {ACTION_STATUSES}")
        now = _now()
        self._no_open.discard(run_id)
        with self.transaction() as db:
            cur = db.execute(
                "INSERT INTO journal (run_id, decision_id, kind, payload, status, created, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (run_id, decision_id, kind, json.dumps(payload, sort_keys=True), status, now, now),
            )
            return int(cur.lastrowid or 0)

    def update_action(self, action_id: int, **fields: Any) -> None:
        """Change status / control_version / deadline / result / payload of a journal entry."""
        allowed = {"status", "control_version", "deadline", "result", "payload"}
        unknown = set(fields) - allowed
        if unknown:
            raise KeyError(f"unknown journal field(s): {', '.join(sorted(unknown))}")
        if "status" in fields and fields["status"] not in ACTION_STATUSES:
            raise ValueError(f"action status {fields['status']!r} not in {ACTION_STATUSES}")
        sets, values = ["updated=?"], [_now()]
        for name, v in fields.items():
            if name in ("result", "payload"):
                v = json.dumps(v, sort_keys=True)
            sets.append(f"{name}=?")
            values.append(v)
        with self.transaction() as db:
            db.execute(f"UPDATE journal SET {', '.join(sets)} WHERE id=?", (*values, action_id))
            if fields.get("status") in OPEN_ACTION_STATUSES and self._no_open:
                row = db.execute("SELECT run_id FROM journal WHERE id=?", (action_id,)).fetchone()
                if row is not None:
                    self._no_open.discard(row["run_id"])

    def get_action(self, action_id: int) -> ActionRecord | None:
        """One journal entry."""
        with self._lock:
            row = self._db.execute("SELECT * FROM journal WHERE id=?", (action_id,)).fetchone()
        return _action_from_row(row) if row else None

    def open_actions(self, run_id: str) -> list[ActionRecord]:
        """Journal entries not yet done or failed, oldest first: what a (re)started watchdog must drive."""
        with self._lock:
            self._sync_no_open()
            if run_id in self._no_open:
                return []  # (a daemon asks two or three times a tick, for every run; most have none)
            rows = self._db.execute(
                f"SELECT * FROM journal WHERE run_id=? AND status IN {_OPEN_SQL} ORDER BY id",
                (run_id,),
            ).fetchall()
            if not rows:
                self._no_open.add(run_id)
        return [_action_from_row(r) for r in rows]

    def note_open_actions(self, run_ids: Sequence[str]) -> None:
        """Find out in one query which of ``run_ids`` have no open journal entry, so that :meth:`open_actions`
        answers those without a query each (a daemon's tick over thousands of runs, most with nothing open)."""
        found: set[str] = set()
        with self._lock:
            self._sync_no_open()
            for i in range(0, len(run_ids), 500):  # (SQLite's bound on a statement's parameters)
                part = list(run_ids[i:i + 500])
                rows = self._db.execute(
                    f"SELECT DISTINCT run_id FROM journal WHERE run_id IN ({', '.join('?' * len(part))})"
                    f" AND status IN {_OPEN_SQL}", part).fetchall()
                found.update(r["run_id"] for r in rows)
            self._no_open.update(r for r in run_ids if r not in found)

    def _sync_no_open(self) -> None:
        """Forget :attr:`_no_open` when another connection (a ``watchdog`` command, another process) has
        committed to the database since it was learnt (SQLite's ``data_version``); our own writes forget what
        they change themselves."""
        if self._no_open_synced:
            return
        version = self._db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._no_open_version:
            self._no_open.clear()
            self._no_open_version = version
        self._no_open_synced = self._depth > 0  # (inside a write transaction: good until it ends)

    def settle_decision(self, decision_id: int) -> str:
        """Derive a decision's status from its journal entries; returns the status."""
        with self._lock:
            rows = self._db.execute("SELECT status, result, kind FROM journal WHERE decision_id=?",
                                    (decision_id,)).fetchall()
        statuses = [r["status"] for r in rows]
        if any(s == ActionStatus.AWAITING for s in statuses):
            # What waits says so (its outcome: "waits for approval: roll back to step 4 ..."), whatever else
            # of the decision is done.
            waits = [json.loads(r["result"]).get("outcome", "") for r in rows if r["status"] == ActionStatus.AWAITING]
            self.set_decision(decision_id, "waiting", "; ".join(o for o in waits if o) or "waits for approval")
            return "waiting"
        if any(s in OPEN_ACTION_STATUSES for s in statuses):
            return "pending"
        if any(s == ActionStatus.FAILED for s in statuses):
            errors = [json.loads(r["result"]).get("error", "") for r in rows if r["status"] == ActionStatus.FAILED]
            self.set_decision(decision_id, "failed", "; ".join(e for e in errors if e) or "failed")
            return "failed"
        outcomes = [json.loads(r["result"]).get("outcome", "") for r in rows]
        if statuses and all(s == ActionStatus.ADVISED for s in statuses):
            self.set_decision(decision_id, "advised", "; ".join(o for o in outcomes if o) or "advised")
            return "advised"
        if ActionStatus.DENIED in statuses and all(r["status"] == ActionStatus.DENIED or r["kind"] == "notify"
                                                   for r in rows):
            # Refused (or unanswered in time): nothing of it was carried out but its alert.
            denied = [json.loads(r["result"]).get("outcome", "") for r in rows if r["status"] == ActionStatus.DENIED]
            self.set_decision(decision_id, "denied", "; ".join(o for o in denied if o) or "denied")
            return "denied"
        if statuses and all(s == ActionStatus.DROPPED for s in statuses):
            self.set_decision(decision_id, "skipped", "; ".join(o for o in outcomes if o) or "dropped")
            return "skipped"
        self.set_decision(decision_id, "applied", "; ".join(o for o in outcomes if o) or "applied")
        return "applied"

    def answer_approval(self, action_id: int, answer: dict[str, Any]) -> bool:
        """Record a person's answer (or the deadline's) to an entry that waits for approval, once: the first
        answer written wins, whoever writes it (``watchdog approve``/``deny`` in one process, the watchdog's
        expiry in another); False when the entry waits no more or was answered already. The watchdog carries
        the answer out at its next tick."""
        with self.transaction() as db:
            cur = db.execute(
                "UPDATE journal SET payload=json_set(payload, '$.answer', json(?)), updated=? "
                "WHERE id=? AND status=? AND json_extract(payload, '$.answer') IS NULL",
                (json.dumps(answer, sort_keys=True), _now(), action_id, ActionStatus.AWAITING.value),
            )
            return cur.rowcount == 1

    def awaiting(self, run_id: str | None = None) -> list[ActionRecord]:
        """Journal entries that wait for a person's answer (unanswered yet), oldest first."""
        where = "status=? AND json_extract(payload, '$.answer') IS NULL"
        with self._lock:
            if run_id is None:
                rows = self._db.execute(f"SELECT * FROM journal WHERE {where} ORDER BY id",
                                        (ActionStatus.AWAITING.value,)).fetchall()
            else:
                rows = self._db.execute(f"SELECT * FROM journal WHERE run_id=? AND {where} ORDER BY id",
                                        (run_id, ActionStatus.AWAITING.value)).fetchall()
        return [_action_from_row(r) for r in rows]

    def get_decision(self, decision_id: int) -> dict[str, Any] | None:
        """One decision as :meth:`decisions` gives it (without its journal), or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM decisions WHERE id=?", (decision_id,)).fetchone()
        return _decision_from_row(row) if row is not None else None

    def decision_counts(self, run_id: str) -> dict[str, int]:
        """A run's decisions counted by status."""
        with self._lock:
            rows = self._db.execute("SELECT status, count(*) AS n FROM decisions WHERE run_id=? GROUP BY status",
                                    (run_id,)).fetchall()
        return {r["status"]: int(r["n"]) for r in rows}

    # -- control versions ---------------------------------------------------------------

    def record_control(self, run_id: str, version: int, overrides: dict[str, Any], commands: list[dict[str, Any]]) -> None:
        """Remember a control.json version as written."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO control_versions (run_id, version, overrides, commands, written_ts)"
                " VALUES (?, ?, ?, ?, ?)",
                (run_id, version, json.dumps(overrides, sort_keys=True), json.dumps(commands, sort_keys=True), _now()),
            )

    def mark_control_applied(self, run_id: str, version: int, step: int | None) -> None:
        """Record the trainer's ``applied`` event for a version (first one wins)."""
        with self.transaction() as db:
            db.execute(
                "UPDATE control_versions SET applied_step=?, applied_ts=? "
                "WHERE run_id=? AND version=? AND applied_ts IS NULL",
                (step, _now(), run_id, version),
            )

    def control_versions(self, run_id: str) -> list[dict[str, Any]]:
        """All control versions of a run, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM control_versions WHERE run_id=? ORDER BY version", (run_id,)
            ).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["overrides"] = json.loads(d["overrides"])
            d["commands"] = json.loads(d["commands"])
            out.append(d)
        return out

    # -- divergence spans (for last known-good) ----------------------------------------

    def open_bad_span(self, run_id: str, rule: str, start_step: int, decision_id: int | None = None) -> int:
        """Mark steps from ``start_step`` on as taken while a divergence rule fired."""
        with self.transaction() as db:
            cur = db.execute(
                "INSERT INTO bad_spans (run_id, rule, start_step, decision_id, opened_ts) VALUES (?, ?, ?, ?, ?)",
                (run_id, rule, int(start_step), decision_id, _now()),
            )
            return int(cur.lastrowid or 0)

    def close_bad_spans(self, run_id: str, end_step: int) -> None:
        """Close every open span of a run at ``end_step`` (the rollback happened)."""
        with self.transaction() as db:
            db.execute(
                "UPDATE bad_spans SET end_step=MAX(start_step, ?), closed_ts=? WHERE run_id=? AND end_step IS NULL",
                (int(end_step), _now(), run_id),
            )

    def mark_unwatched(self, run_id: str, first_step: int) -> None:
        """Steps before ``first_step``, the first the watchdog saw, were never judged: a closed span over them.

        A checkpoint of those steps (a run resumed from an earlier, unwatched one; a watchdog started
        on a run already under way) was saved in a state the watchdog never saw healthy, and a run
        already broken when it starts has no healthy baseline: no rollback may go there. Checkpoints
        of the same steps written later (a re-run the watchdog watched) are not covered."""
        if first_step <= 1:
            return
        now = _now()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO bad_spans (run_id, rule, start_step, end_step, decision_id, opened_ts, closed_ts) "
                "VALUES (?, ?, 0, ?, NULL, ?, ?)", (run_id, UNWATCHED, int(first_step) - 1, now, now),
            )

    def mark_unloadable(self, run_id: str, step: int) -> None:
        """The checkpoint of ``step`` saved so far cannot be loaded (it failed verification before a relaunch,
        or the trainer died loading it): a closed span over that step alone, so no relaunch picks it again. A
        checkpoint of the same step saved later (a re-run) is not covered (:meth:`BadSpan.covers`)."""
        now = _now()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO bad_spans (run_id, rule, start_step, end_step, decision_id, opened_ts, closed_ts) "
                "VALUES (?, ?, ?, ?, NULL, ?, ?)", (run_id, UNLOADABLE, int(step), int(step), now, now),
            )

    def bad_spans(self, run_id: str) -> list[BadSpan]:
        """Every divergence span of a run, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT rule, start_step, end_step, opened_ts, closed_ts FROM bad_spans WHERE run_id=? ORDER BY id",
                (run_id,),
            ).fetchall()
        return [BadSpan(r["rule"], r["start_step"], r["end_step"], r["opened_ts"], r["closed_ts"]) for r in rows]

    def bad_step_predicate(self, run_id: str) -> Callable[[int], bool]:
        """A step-only predicate for ``checkpoint.last_known_good`` (ignores re-runs of the same steps)."""
        spans = self.bad_spans(run_id)
        return lambda step: any(s.covers(step) for s in spans)


#: The ``rule`` of the span over the steps before the first one the watchdog saw (:meth:`Store.mark_unwatched`).
UNWATCHED = "(before the watchdog)"
#: The ``rule`` of the span over a checkpoint that could not be loaded (:meth:`Store.mark_unloadable`).
UNLOADABLE = "(cannot be loaded)"


@dataclass(frozen=True)
class BadSpan:
    """Steps during which a divergence rule fired (checkpoints written then are not known-good)."""

    rule: str
    """The divergence rule."""
    start_step: int
    """First step whose checkpoint may hold the diverging weights (before the rule's ``for``)."""
    end_step: int | None
    """Last diverged step (closed when the rollback happened); None while open."""
    opened_ts: float
    """Wall time the span was opened."""
    closed_ts: float | None
    """Wall time it was closed: a checkpoint of the same step written later is a re-run, not bad."""

    def covers(self, step: int, ts: float | None = None) -> bool:
        """Was a checkpoint of ``step`` written at ``ts`` taken while diverging?"""
        if step < self.start_step or (self.end_step is not None and step > self.end_step):
            return False
        # After a rollback the same step numbers are trained again: those later checkpoints are good.
        return ts is None or self.closed_ts is None or ts <= self.closed_ts


def _jsonable(obj: Any) -> Any:
    """Inputs may hold NaN/inf (that is often why a rule fired): keep them as strings for strict JSON."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _run_from_row(row: sqlite3.Row) -> RunRecord:
    d = dict(row)
    for name in _RUN_JSON_FIELDS:
        d[name] = json.loads(d[name])
    d["managed"] = bool(d["managed"])
    return RunRecord(**d)


def _decision_from_row(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    for name in ("actions", "inputs", "signals"):
        d[name] = json.loads(d[name])
    return d


def _action_from_row(row: sqlite3.Row) -> ActionRecord:
    d = dict(row)
    d["payload"] = json.loads(d["payload"])
    d["result"] = json.loads(d["result"])
    return ActionRecord(**d)


def _action_dict(a: ActionRecord) -> dict[str, Any]:
    return {k: getattr(a, k) for k in ActionRecord.__dataclass_fields__}
