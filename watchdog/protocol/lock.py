"""Holder locks: one watchdog per run directory and per state directory, one trainer per run.

A lock is an ``fcntl.flock`` on a small file; the kernel drops it when the last descriptor of
its holder closes, so a holder killed with SIGKILL (or a machine that reboots) never leaves a
stale lock behind, and nobody has to judge whether a pid in a file is still alive. The file
also says who holds it (pid, host, since, what), for the message a refused second holder
prints; that text is advice for a human, never what decides.

- ``RUN_LOCK`` in a run directory: held by the watchdog (``watchdog run`` or the daemon) that
  watches the run.
- ``TRAINER_LOCK`` in a run directory: held by the trainer's process (group) itself: the
  watchdog takes it just before it launches a trainer and hands the descriptor to the child,
  so it lives exactly as long as something of that trainer does. A second trainer is never
  launched while it is held.
- ``STATE_LOCK`` in a state directory: held by the one watchdog that writes that state (with
  ``shards: N``, the daemon's supervisor, shard 0).
- :func:`shard_lock` in a state directory: held by shard K (1..N-1) of a sharded daemon, a child
  process of the supervisor writing the same state for its share of the runs.

``flock`` is advisory and local to one machine's kernel (on NFS it is emulated by ``fcntl``
locks on Linux >= 2.6.12, which keeps this behaviour across clients of one server).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ppo_watchdog.protocol import inputs

RUN_LOCK = ".watchdog.lock"
"""A run directory's watchdog lock."""
TRAINER_LOCK = ".trainer.lock"
"""A run directory's trainer lock (held through the trainer's inherited descriptor)."""
STATE_LOCK = "watchdog.lock"
"""A state directory's lock."""


def shard_lock(shard: int) -> str:
    """The lock file of a sharded daemon's shard ``shard`` (1..N-1) in its state directory."""
    return f"watchdog.shard-{shard}.lock"


class LockHeld(OSError):
    """Another live process holds the lock; the message names it (pid and host) and the file."""

    def __init__(self, path: Path, what: str, holder: dict[str, Any]) -> None:
        self.path = path
        self.holder = holder
        who = describe_holder(holder)
        super().__init__(errno.EWOULDBLOCK, f"{path.parent}: {what} is held by {who} (lock {path.name})")


def describe_holder(holder: dict[str, Any]) -> str:
    """``another watchdog (pid 123 on host h, since 12:00:01 UTC)`` from a lock file's content."""
    if not holder:
        return "another process (it has not said which yet)"
    since = holder.get("since")
    when = (f", since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(since))}"
            if isinstance(since, (int, float)) else "")
    return (f"{holder.get('role') or 'another process'} (pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')}{when})")


def read_holder(path: Path | str) -> dict[str, Any]:
    """What a lock file says about its holder ({} when it says nothing readable)."""
    try:
        doc = json.loads(inputs.read_text(path) or "{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


class HolderLock:
    """An exclusive ``flock`` on ``path``, taken at once or refused with :class:`LockHeld`."""

    def __init__(self, path: Path | str, what: str, role: str = "a watchdog") -> None:
        """``what``: the thing held, for messages ("the run", "the state"); ``role``: who holds it."""
        self.path = Path(path)
        self.what = what
        self.role = role
        self.fd: int | None = None

    def acquire(self, wait_s: float = 1.0, **about: Any) -> HolderLock:
        """Take the lock (trying for ``wait_s``: someone merely looking at it, as ``watchdog status``
        does, holds it for an instant); raise :class:`LockHeld` naming the holder otherwise.
        ``about``: extra fields written for the refused (e.g. the holder's own pid when it is a child)."""
        fd = inputs.open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # (a symlink there: refused)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise LockHeld(self.path, self.what, read_holder(self.path)) from None
                time.sleep(0.05)
            except OSError:
                os.close(fd)
                raise
        self.fd = fd
        self.describe(**about)
        return self

    def describe(self, **about: Any) -> None:
        """(Re)write who holds the lock: this process, unless ``pid`` is given (a trainer it launched)."""
        if self.fd is None:
            return
        doc = {"role": self.role, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), **about}
        data = json.dumps(doc).encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only the note for a refused second is missing

    def release(self) -> None:
        """Drop the lock (closing the descriptor; a child that inherited it keeps holding it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> HolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_if_held(path: Path | str) -> dict[str, Any] | None:
    """Who holds the lock at ``path`` (its file's note, maybe {}), or None when nobody does.

    Looks without taking it for more than an instant (a shared lock, dropped at once); a file
    that cannot be opened counts as not held."""
    try:
        fd = inputs.open_regular(path)  # (a FIFO there is no lock file: not held, and never waited on)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(path)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None
