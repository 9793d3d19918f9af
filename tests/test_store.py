"""The watchdog's SQLite state: runs, decisions, the actions journal, divergence spans."""

from __future__ import annotations

import fcntl
import gc
import math
import os
import sqlite3
import threading

import pytest

from ppo_watchdog.control import store as store_module
from ppo_watchdog.control.store import SCHEMA_VERSION, WRITER_GATE, RunRecord, Store, StoreError


def test_store_uses_wal_and_records_its_schema_version(tmp_path):
    store = Store(tmp_path / "state")
    db = sqlite3.connect(store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)


def test_a_decisions_journal_entries_are_read_by_index_also_in_a_state_made_without_it(tmp_path):
    # settle_decision runs each time an entry ends; a scan of the journal grew with every hour of a daemon
    # (bench/results/daemon_scale_journal.md: a settle at 100,000 entries, by the index and without it).
    store = Store(tmp_path)
    store._db.execute("DROP INDEX journal_decision")  # a state of this schema version made before the index
    store.close()
    store = Store(tmp_path)
    store.upsert_run(RunRecord("r1", str(tmp_path / "r1")))
    d = store.add_decision("r1", 3, "kl_high", "fire", [{"kind": "set"}], {"kl": 0.2})
    store.add_action("r1", "live_set", {"set": {"lr": 1e-6}}, decision_id=d, status="done")
    plan = store._db.execute("EXPLAIN QUERY PLAN SELECT status, result FROM journal WHERE decision_id=?", (d,))
    assert "USING INDEX journal_decision" in " ".join(str(tuple(r)) for r in plan)
    assert store.settle_decision(d) == "applied"


def test_store_refuses_a_database_of_another_schema_version(tmp_path):
    store = Store(tmp_path)
    store._db.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    store.close()
    with pytest.raises(StoreError, match="schema version 999"):
        Store(tmp_path)


def test_run_survives_reopening_with_its_overrides_and_measured_startup(tmp_path):
    store = Store(tmp_path)
    store.upsert_run(RunRecord("r1", str(tmp_path / "r1"), ["python", "-m", "ppo_watchdog.trainer"]))
    store.update_run("r1", overrides={"algorithm.kl_ctrl.kl_coef": 0.0012}, control_version=3, startup_s=12.5)
    store.close()
    run = Store(tmp_path).require_run("r1")
    assert run.overrides == {"algorithm.kl_ctrl.kl_coef": 0.0012}
    assert (run.control_version, run.startup_s, run.command[-1]) == (3, 12.5, "ppo_watchdog.trainer")


def test_unknown_run_error_names_the_database_and_the_known_runs(tmp_path):
    store = Store(tmp_path)
    store.upsert_run(RunRecord("a", "/x"))
    with pytest.raises(StoreError, match=r"no run 'b' \(known: a\)"):
        store.require_run("b")


def test_a_failed_transaction_leaves_no_decision_and_no_intent(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(RuntimeError):
        with store.transaction():
            did = store.add_decision("r", 5, "kl_high", "fire", [], {"kl": 0.2})
            store.add_action("r", "live_set", {"key": "k"}, decision_id=did)
            raise RuntimeError("crash between decision and action")
    assert store.decisions("r") == [] and store.journal("r") == []


def test_decision_settles_applied_only_when_every_journal_entry_is_done(tmp_path):
    store = Store(tmp_path)
    did = store.add_decision("r", 7, "kl_high", "fire", [{"kind": "set"}], {"kl": 0.15, "bad": math.nan})
    a1 = store.add_action("r", "live_set", {}, decision_id=did)
    a2 = store.add_action("r", "command", {}, decision_id=did)
    store.update_action(a1, status="done", result={"outcome": "applied v1 at step 8"})
    assert store.settle_decision(did) == "pending"
    assert [a.id for a in store.open_actions("r")] == [a2]
    store.update_action(a2, status="done", result={"outcome": "checkpoint"})
    assert store.settle_decision(did) == "applied"
    (d,) = store.decisions("r")
    assert d["status"] == "applied" and d["outcome"] == "applied v1 at step 8; checkpoint"
    assert d["inputs"] == {"kl": 0.15, "bad": "nan"}  # strict JSON keeps the NaN that fired the rule
    assert [j["id"] for j in d["journal"]] == [a1, a2]


def test_a_failed_action_fails_its_decision_with_the_error(tmp_path):
    store = Store(tmp_path)
    did = store.add_decision("r", 7, "oom", "fire", [], {})
    a = store.add_action("r", "restart", {}, decision_id=did)
    store.update_action(a, status="failed", result={"error": "restart budget exhausted"})
    assert store.settle_decision(did) == "failed"
    assert store.decisions("r")[0]["outcome"] == "restart budget exhausted"


def test_control_version_applied_step_is_the_first_applied_event(tmp_path):
    store = Store(tmp_path)
    store.record_control("r", 1, {"k": 1.0}, [])
    store.mark_control_applied("r", 1, 12)
    store.mark_control_applied("r", 1, 30)  # a restarted trainer re-applies: not a second application
    assert store.control_versions("r")[0]["applied_step"] == 12


def test_bad_step_predicate_covers_open_and_closed_divergence_spans(tmp_path):
    store = Store(tmp_path)
    store.open_bad_span("r", "nan", 14)
    store.close_bad_spans("r", 17)
    store.open_bad_span("r", "kl_far", 30)
    bad = store.bad_step_predicate("r")
    assert [s for s in range(10, 40) if bad(s)] == [14, 15, 16, 17, *range(30, 40)]


def test_a_checkpoint_of_a_diverged_step_retrained_after_the_rollback_is_not_bad(tmp_path):
    store = Store(tmp_path)
    store.open_bad_span("r", "nan", 14)
    store.close_bad_spans("r", 17)
    (span,) = store.bad_spans("r")
    assert span.covers(15, ts=span.closed_ts - 1)
    assert not span.covers(15, ts=span.closed_ts + 1)


def test_a_version_2_database_is_migrated_keeping_its_journal_and_dropping_dead_columns(tmp_path):
    import sqlite3
    from pathlib import Path

    db = sqlite3.connect(tmp_path / "watchdog.db")
    db.executescript((Path(__file__).parent / "data" / "store_schema_v2.sql").read_text())
    db.execute("INSERT INTO meta VALUES ('schema_version', '2')")
    db.execute("INSERT INTO runs (run_id, run_dir, pid, metrics_offset, created, updated) VALUES ('old', '/r', 7, 99, 1, 1)")
    db.execute("INSERT INTO journal (run_id, kind, payload, status, depends_on, created, updated)"
               " VALUES ('old', 'restart', '{\"set\": {}}', 'intent', NULL, 1, 1)")
    db.commit()
    db.close()
    store = Store(tmp_path)
    assert store.require_run("old").pid == 7
    (entry,) = store.open_actions("old")
    assert (entry.kind, entry.payload, entry.status) == ("restart", {"set": {}}, "intent")
    store.update_action(entry.id, status="dropped")  # a status version 2 did not allow
    assert store.open_actions("old") == []
    cols = {r[1] for r in store._db.execute("PRAGMA table_info(runs)")}
    assert "metrics_offset" not in cols and "startup_s" in cols
    assert "depends_on" not in {r[1] for r in store._db.execute("PRAGMA table_info(journal)")}


def test_open_actions_sees_an_entry_another_connection_added_after_it_found_none(tmp_path):
    # A daemon remembers which runs have nothing open (one query a tick for all); a `watchdog` command
    # writing through its own connection must still be seen at the next ask.
    daemon = Store(tmp_path)
    daemon.note_open_actions(["r1", "r2"])
    assert daemon.open_actions("r1") == [] and daemon.open_actions("r2") == []
    cli = Store(tmp_path)
    aid = cli.add_action("r1", "notify", {"rule": "x"})
    assert [e.id for e in daemon.open_actions("r1")] == [aid]
    assert daemon.open_actions("r2") == []



def test_inside_a_write_transaction_the_data_version_is_asked_once_and_a_later_commit_elsewhere_is_still_seen(tmp_path):
    # No other connection can commit while this one holds the write lock (BEGIN IMMEDIATE): one look at
    # SQLite's data_version serves the whole transaction (a daemon's chunk asks a thousand times), and the
    # next transaction looks again.
    daemon = Store(tmp_path)
    asked: list[str] = []
    daemon._db.set_trace_callback(lambda sql: asked.append(sql) if "data_version" in sql else None)
    with daemon.transaction():
        daemon.note_open_actions(["r1", "r2"])
        assert daemon.open_actions("r1") == [] and daemon.open_actions("r2") == []
        assert daemon.open_actions("r1") == []
    assert len(asked) == 1
    aid = Store(tmp_path).add_action("r1", "notify", {"rule": "x"})
    with daemon.transaction():
        assert [e.id for e in daemon.open_actions("r1")] == [aid]
    assert len(asked) == 2

def test_open_actions_sees_its_own_new_entries_and_an_entry_a_rollback_reopened(tmp_path):
    store = Store(tmp_path)
    aid = store.add_action("r", "live_set", {})
    store.update_action(aid, status="sent")
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.update_action(aid, status="done")
            assert store.open_actions("r") == []  # (remembered: nothing open for r)
            raise RuntimeError("the tick's commit failed")
    # The rollback undid the close: the entry is open again and must be driven.
    assert [(e.id, e.status) for e in store.open_actions("r")] == [(aid, "sent")]
    store.update_action(aid, status="done")
    assert store.open_actions("r") == []
    second = store.add_action("r", "notify", {})
    assert [e.id for e in store.open_actions("r")] == [second]


def test_nested_units_undo_only_their_own_writes_one_after_another_at_each_depth(tmp_path):
    """A daemon's tick: a unit a run inside the chunk's transaction, units inside those, all of one savepoint
    name in SQLite; a unit undone leaves its siblings' and its parent's writes, however many came before it."""
    store = Store(tmp_path)
    for name in "abcde":
        store.upsert_run(RunRecord(name, f"/{name}"))
    with store.transaction():
        with store.savepoint():
            store.update_run("a", last_step=1)
            with store.savepoint():
                store.update_run("b", last_step=1)
            with pytest.raises(RuntimeError):
                with store.savepoint():
                    store.update_run("c", last_step=1)
                    raise RuntimeError("an inner unit fails")
            store.update_run("d", last_step=1)
        with pytest.raises(RuntimeError):
            with store.savepoint():
                store.update_run("e", last_step=1)
                with store.savepoint():
                    store.update_run("a", last_step=2)
                raise RuntimeError("a run's unit fails after its inner one was kept")
    assert {n: store.get_run(n).last_step for n in "abcde"} == {"a": 1, "b": 1, "c": None, "d": 1, "e": None}


def test_after_commit_hooks_run_once_the_outer_transaction_commits_and_never_for_an_undone_unit(tmp_path):
    store = Store(tmp_path)
    said: list[str] = []
    store.after_commit(lambda: said.append("outside"))  # no transaction: at once
    assert said == ["outside"]
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.after_commit(lambda: said.append("rolled back"))
            raise RuntimeError("the commit failed")
    with store.transaction():
        with store.savepoint():
            store.after_commit(lambda: said.append("kept run"))
        with pytest.raises(RuntimeError):
            with store.savepoint():
                store.after_commit(lambda: said.append("undone run"))
                raise RuntimeError("one run's read failed")
        assert said == ["outside"]  # nothing before the commit
    assert said == ["outside", "kept run"]


def _gate_is_free(store: Store) -> bool:
    """Whether another writer could take the store's writer gate now (a descriptor of its own, as a process)."""
    fd = os.open(store._gate.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # (drops the flock if it was taken)
    return True


def test_a_writer_holds_the_gate_for_its_whole_transaction(tmp_path):
    a = Store(tmp_path)
    assert a._gate.path == tmp_path / f"watchdog.db{WRITER_GATE}"
    with a.transaction():
        a.upsert_run(RunRecord("a", "/a"))
        assert not _gate_is_free(a)
        with a.savepoint():  # nested units keep the one gate
            a.update_run("a", control_version=1)
        assert not _gate_is_free(a)
    assert _gate_is_free(a)


def test_a_writer_waits_on_the_gate_while_another_process_holds_it_and_writes_once_it_is_let_go(
        tmp_path, monkeypatch):
    # The other writer holds the gate alone (SQLite's lock free): b must wait on the gate, polling it.
    b = Store(tmp_path)
    other = os.open(b._gate.path, os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    polling, wrote = threading.Event(), threading.Event()
    sleep = store_module.time.sleep

    def polled(seconds: float) -> None:
        polling.set()
        sleep(seconds)

    monkeypatch.setattr(store_module.time, "sleep", polled)

    def b_writes() -> None:
        with b.transaction():
            b.upsert_run(RunRecord("b", "/b"))
        wrote.set()

    waiting = threading.Thread(target=b_writes)
    waiting.start()
    assert polling.wait(10)  # b found the gate held and polls it ...
    assert not wrote.is_set() and Store(tmp_path, read_only=True).get_run("b") is None  # ... and has not written
    os.close(other)  # the other writer lets go
    assert wrote.wait(10)
    waiting.join()
    assert b.get_run("b") is not None


def test_the_gate_is_let_go_when_a_transaction_fails_or_cannot_begin(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(RuntimeError), store.transaction():
        raise RuntimeError("undone")
    assert _gate_is_free(store)
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # a writer without the gate (an older watchdog) holds SQLite's lock
    store._db.execute("PRAGMA busy_timeout=0")
    with pytest.raises(StoreError, match="locked"), store.transaction():
        pass
    assert _gate_is_free(store)
    other.execute("ROLLBACK")
    with store.transaction():
        store.upsert_run(RunRecord("r", "/r"))


def test_a_writer_waits_on_the_gate_no_longer_than_the_busy_timeout_and_says_so(tmp_path):
    held = Store(tmp_path)
    short = Store(tmp_path, busy_timeout_s=0.05)
    with held.transaction(), pytest.raises(StoreError, match=r"watchdog\.db: locked by another process for more than "
                                                              r"0\.05 s \(its writer gate watchdog\.db-writer held\)"):
        with short.transaction():
            pass
    with short.transaction():  # the gate free again: it writes
        short.upsert_run(RunRecord("r", "/r"))


def test_a_read_only_store_takes_no_gate_and_creates_no_file(tmp_path):
    Store(tmp_path).close()
    (tmp_path / f"watchdog.db{WRITER_GATE}").unlink()
    Store(tmp_path, read_only=True).list_runs()
    assert not (tmp_path / f"watchdog.db{WRITER_GATE}").exists()


def test_a_gate_that_cannot_be_locked_is_left_out_and_the_writes_go_on(tmp_path, monkeypatch, caplog):
    store = Store(tmp_path)

    def no_locks(fd: int, op: int) -> None:
        raise OSError(37, "No locks available")  # (ENOLCK: an NFS mount without lockd)

    monkeypatch.setattr(store_module.fcntl, "flock", no_locks)
    with store.transaction():
        store.upsert_run(RunRecord("r", "/r"))
    with store.transaction():
        store.update_run("r", control_version=2)
    assert store.require_run("r").control_version == 2
    said = [r.getMessage() for r in caplog.records if "no writer gate" in r.getMessage()]
    assert len(said) == 1 and "No locks available" in said[0]


def test_a_store_nobody_closes_lets_its_gate_go_when_collected(tmp_path):
    store = Store(tmp_path)
    fd = store._gate.fd
    assert fd is not None and os.fstat(fd)
    del store
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
