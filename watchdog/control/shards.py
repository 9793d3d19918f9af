"""A sharded daemon (``shards: N``): which process watches a run, and the supervisor of the other processes.

``watchdog daemon`` with ``shards: N > 1`` runs N processes over one state database. The process that was
started is shard 0 and the supervisor: it holds the state lock as a daemon of one process does, and starts
shards 1..N-1 as its children (``python -m ppo_watchdog daemon --config F --shard K``). Each process watches
only the runs :func:`shard_of` gives it, so every run has exactly one watcher, and each child holds a lock
of its own in the state directory (:func:`~ppo_watchdog.protocol.lock.shard_lock`). A child dies with its
supervisor (``PR_SET_PDEATHSIG`` on Linux; everywhere, it stops when its parent is no longer the
supervisor); a child that exits while the supervisor runs is said and started again after a backoff.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_SHARDS = 256
"""The most processes one daemon may be cut into (a host with more cores than that has other limits first)."""
SUPERVISOR_ENV = "WATCHDOG_SHARD_SUPERVISOR"
"""Set in a child's environment to its supervisor's pid (argv carries only the config path and the shard)."""
STOP_GRACE_S = 45.0
"""How long the supervisor waits for its children after SIGTERM before SIGKILL. Each child finishes its
tick in flight (a restart in it waits up to the actuator's 15 s stop grace); the children stop side by side
with the supervisor's own last tick, all inside the 60 s systemd gives the daemon (deploy/systemd)."""
BACKOFF_MIN_S = 1.0
"""A child that exits is started again after this long at first, doubling at each exit ..."""
BACKOFF_MAX_S = 60.0
"""... up to this ..."""
BACKOFF_RESET_S = 60.0
"""... and back to the first once a child has run this long (a crash an hour is not a crash loop)."""
ALERT_AFTER_EXITS = 3
"""A child that exits this many times in a row, each before it ran :data:`BACKOFF_RESET_S`, is alerted on
(the webhook), once until it runs that long: its runs are unsupervised meanwhile."""
PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal this process gets when the thread that started it dies."""


def shard_of(run_id: str, shards: int) -> int:
    """The shard (0 .. ``shards``-1) that watches run ``run_id``: the same in every process, at every restart
    and on every machine (CRC-32 of the id's UTF-8; Python's ``hash`` of a str is salted per interpreter)."""
    return zlib.crc32(run_id.encode("utf-8")) % shards


def tick_phase(shard: int, shards: int, tick_s: float) -> float:
    """Seconds past each multiple of ``tick_s`` (since the epoch) at which shard ``shard`` of ``shards`` ticks:
    ``shard``/``shards`` of the interval. The shards take turns, as Prometheus spreads its targets' scrapes
    over the interval, instead of all writing to the one state database at the same instant: a tick shorter
    than its share of the interval waits for no other shard's writes (``bench/daemon_scale.py --shards N --together``), but
    for each process's tick at its start. The turns are instants of the wall clock
    (:func:`~ppo_watchdog.control.daemon.tick_trigger`), so a child started again keeps its turn."""
    return tick_s * shard / shards


@dataclass
class _Child:
    """One child shard as the supervisor knows it."""

    shard: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    """When ``proc`` was started (the supervisor's monotonic clock)."""
    start_at: float = 0.0
    """When to start it (again) while it has no process."""
    backoff_s: float = BACKOFF_MIN_S
    """The wait before the next start after an exit."""
    terminated: bool = False
    """SIGTERM sent to ``proc`` (once: a second stop signal tells a daemon to stop without finishing)."""
    quick_exits: int = 0
    """Exits in a row, each before the child ran :data:`BACKOFF_RESET_S`."""


class ShardSupervisor:
    """Shard 0's children: started, started again when one exits, stopped with the supervisor."""

    def __init__(self, config: Path | str, shards: int, say: Callable[[str], None] = log.warning,
                 python: str = sys.executable, clock: Callable[[], float] = time.monotonic,
                 alert: Callable[[int, str], None] | None = None) -> None:
        """``config``: the daemon's config file, read by each child itself; ``say``: where what happens to a
        child is told (the daemon's console); ``python``: the interpreter the children run under; ``alert``:
        called with a shard and why when it keeps exiting (:data:`ALERT_AFTER_EXITS`: the daemon's webhook)."""
        self.config = Path(config).resolve()  # a child reads the same file whatever directory it is in
        self.python = python
        self.say = say
        self.alert = alert
        self.clock = clock
        self.children = [_Child(k) for k in range(1, shards)]
        self._stopping_since: float | None = None
        """When SIGTERM went to the children: the grace of :meth:`stop` counts from there."""

    def command(self, shard: int) -> list[str]:
        """A child's command line: nothing but the config path and its shard (secrets stay in files and the
        environment, out of the argv every user of the machine can read)."""
        return [self.python, "-m", "ppo_watchdog", "daemon", "--config", str(self.config), "--shard", str(shard)]

    def pids(self) -> dict[int, int]:
        """The pid of each child that has a process now, by shard."""
        return {c.shard: c.proc.pid for c in self.children if c.proc is not None}

    def start(self) -> None:
        """Start every child (once the supervisor holds the state and the database exists)."""
        for child in self.children:
            self._start(child)

    def poll(self) -> bool:
        """Say each child that exited and start it again once its backoff has passed; True (serving goes on).
        Called from the thread that started the children: on Linux a child's death signal follows the
        thread that started it, not the process."""
        now = self.clock()
        for child in self.children:
            if child.proc is not None:
                code = child.proc.poll()
                if code is None:
                    continue
                ran = now - child.started
                if ran >= BACKOFF_RESET_S:
                    child.backoff_s, child.quick_exits = BACKOFF_MIN_S, 0
                child.quick_exits += 1
                why = (f"shard {child.shard} (pid {child.proc.pid}) exited with {exit_text(code)} after {ran:.0f} s; "
                       f"starting it again in {child.backoff_s:g} s")
                self.say(why)
                if child.quick_exits == ALERT_AFTER_EXITS and self.alert is not None:
                    self.alert(child.shard, f"{why} ({child.quick_exits} exits in a row, each within "
                                            f"{BACKOFF_RESET_S:g} s of its start: its runs are unsupervised "
                                            f"meanwhile; its console output is the daemon's)")
                child.proc = None
                child.start_at = now + child.backoff_s
                child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
            if now >= child.start_at:
                self._start(child)
        return True

    def _start(self, child: _Child) -> None:
        env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})  # the daemon's own (webhook included)
        try:
            # Its own session: a Ctrl-C at the terminal reaches the supervisor alone, which stops the children
            # in order (SIGTERM, bounded wait) instead of every process racing to stop on its own.
            child.proc = subprocess.Popen(self.command(child.shard), env=env, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        except OSError as exc:  # out of processes or memory: tried again after the backoff, as an exit is
            self.say(f"shard {child.shard}: cannot start ({exc.strerror or exc}); trying again in "
                     f"{child.backoff_s:g} s")
            child.start_at = self.clock() + child.backoff_s
            child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
            return
        child.started = self.clock()
        child.terminated = False
        log.info("shard %d started: pid %d", child.shard, child.proc.pid)

    def terminate(self) -> None:
        """Send SIGTERM, once, to every child still running (each finishes its tick in flight and exits)."""
        if self._stopping_since is None:
            self._stopping_since = self.clock()
        for child in self.children:
            if child.proc is not None and not child.terminated and child.proc.poll() is None:
                child.terminated = True
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every child: SIGTERM, a wait of at most ``grace_s`` for all of them from when they were first
        sent it (:meth:`terminate`, while the supervisor's own last tick finished), then SIGKILL (said). A
        second Ctrl-C during the wait kills them at once."""
        self.terminate()
        deadline = (self._stopping_since if self._stopping_since is not None else self.clock()) + grace_s
        try:
            for child in self.children:
                if child.proc is None:
                    continue
                try:
                    code = child.proc.wait(timeout=max(0.0, deadline - self.clock()))
                except subprocess.TimeoutExpired:
                    self.say(f"shard {child.shard} (pid {child.proc.pid}) still running {grace_s:g} s after "
                             "SIGTERM: SIGKILL")
                    child.proc.kill()
                    code = child.proc.wait()
                if code != 0:
                    self.say(f"shard {child.shard} (pid {child.proc.pid}) stopped with {exit_text(code)}")
                child.proc = None
        except KeyboardInterrupt:
            for child in self.children:
                if child.proc is not None and child.proc.poll() is None:
                    self.say(f"stopping again: SIGKILL to shard {child.shard} (pid {child.proc.pid})")
                    child.proc.kill()
                    child.proc.wait()
            raise


def exit_text(code: int) -> str:
    """``exit code 2`` or ``signal SIGKILL`` for a Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def die_with_supervisor() -> int:
    """In a child shard: have Linux send this process SIGTERM when its supervisor dies; returns the
    supervisor's pid, for :func:`supervisor_alive`. A child is started by its supervisor alone, which says
    so in :data:`SUPERVISOR_ENV`: a ``--shard K`` started by hand (beside a daemon, or with none) would
    watch runs its supervisor does not know of, and is refused (:class:`NotStartedBySupervisor`)."""
    raw = os.environ.pop(SUPERVISOR_ENV, "")  # the trainers this child starts have no use for it
    supervisor = os.getppid()
    if raw != str(supervisor):
        raise NotStartedBySupervisor(
            "a sharded daemon's processes 1 .. shards-1 are started by its shard 0 (`watchdog daemon --config`), "
            "not by hand" + (f" (this one's parent, pid {supervisor}, is not the supervisor it names, pid {raw})"
                             if raw else ""))
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        except (OSError, AttributeError) as exc:
            log.warning("cannot ask the kernel for a signal when the supervisor dies (%s): checked every "
                        "half second instead", exc)
    return supervisor


class NotStartedBySupervisor(RuntimeError):
    """``--shard K`` in a process its daemon's supervisor did not start."""


def supervisor_alive(supervisor: int) -> bool:
    """Whether this child's parent is still its supervisor (a child whose supervisor died is reparented; one
    that died before :func:`die_with_supervisor` asked for the signal is caught here)."""
    return os.getppid() == supervisor
