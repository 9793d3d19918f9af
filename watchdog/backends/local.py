"""Process backends: start, signal, stop and watch a trainer.

A backend hands out :class:`TrainerProcess` handles. The local backend runs the command
in its own session (so its process group can be signalled as a whole: a trainer's data
loader or Ray workers go down with it) with a given environment and working directory,
output appended to a log file. A handle can also be *attached* to a pid the watchdog did
not start (a run found after the watchdog itself was restarted): then the exit code is
unknown and the caller infers it from the run's events.

A Ray Job backend (issue 6) implements the same protocol.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ppo_watchdog.protocol import inputs
from ppo_watchdog.protocol import lock as locks
from ppo_watchdog.protocol.runinfo import RunInfo

log = logging.getLogger(__name__)


class SupervisorError(OSError):
    """A process could not be started or signalled; names the command or pid."""


class LaunchRefused(SupervisorError):
    """The command cannot run at all (no such program, not executable): trying again cannot help."""


class TrainerAlive(SupervisorError):
    """A trainer of the run is still alive (it holds the run's trainer lock): no second one is launched."""

    def __init__(self, message: str, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


class BackendUnavailable(SupervisorError):
    """The backend's control plane (a Ray job server) cannot be reached; names its address.

    Nothing was started or stopped: the caller may try the same step again later."""


class TrainerProcess(Protocol):
    """What the controller needs from a running trainer."""

    @property
    def pid(self) -> int | None:
        """Process id; None where there is no local one (a Ray Job runs on the cluster's head)."""
        ...

    def poll(self) -> int | None:
        """Exit code once it has ended (None while running or when unknown for an attached pid)."""
        ...

    def alive(self) -> bool:
        """True while the process runs."""
        ...

    def signal(self, sig: int, group: bool = True) -> bool:
        """Send a signal to the process group (``group=False``: to the process alone); False when it has gone."""
        ...

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; the exit code when known."""
        ...


class Backend(Protocol):
    """Starts trainer processes or attaches to running ones."""

    def start(
        self, command: Sequence[str], env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None, log_path: Path | str | None = None,
    ) -> TrainerProcess: ...

    def attach(self, pid: int) -> TrainerProcess: ...


def _pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # /proc/PID/stat: "pid (comm) S ..."; comm may hold spaces, so split after the last ')'.
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def start_ticks(pid: int, proc: Path | str = "/proc") -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22); None when there is
    no such process (or no ``/proc``). With the pid, an identity no later process can have: a pid is
    reused, a (pid, start) pair is not."""
    try:
        fields = (Path(proc) / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])  # field 22 of the line; fields[0] is field 3 (state)
    except (OSError, IndexError, ValueError):
        return None


def start_wall_time(ticks: int, proc: Path | str = "/proc") -> float | None:
    """Unix time of a process start given in clock ticks since boot (None without ``/proc/stat``)."""
    try:
        btime = next(int(ln.split()[1]) for ln in (Path(proc) / "stat").read_text().splitlines()
                     if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def cmdline(pid: int, proc: Path | str = "/proc") -> list[str] | None:
    """``pid``'s argv (None when it cannot be read: gone, or a kernel thread)."""
    try:
        raw = (Path(proc) / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]] or None


#: Seconds a process may seem to have started after it wrote run.json's ``started`` (the kernel's start
#: time is in clock ticks, run.json's in float seconds, and the two clocks are read differently).
START_SLACK_S = 2.0


def not_the_trainer(pid: int, run_dir: Path | str, proc: Path | str = "/proc",
                    info: RunInfo | None = None) -> str | None:
    """Why ``pid`` is not (or cannot be told to be) the trainer of ``run_dir``; None when it is.

    A pid is an identity only with its start time: the trainer lock a watchdog's launch holds
    (:data:`~ppo_watchdog.protocol.lock.TRAINER_LOCK`) names the trainer's pid and start; a trainer
    started by hand is told by run.json: the process runs run.json's command (argv past the
    interpreter) and started before run.json says it did. A pid run.json names that fits
    neither was reused, or was never the trainer (a stale or hand-edited run.json). ``info``: run.json
    as the caller already read it (an attach reads it once)."""
    ticks = start_ticks(pid, proc)
    if ticks is None:
        return f"pid {pid} is not running"
    note = locks.read_holder(Path(run_dir) / locks.TRAINER_LOCK)
    if note.get("pid") == pid and isinstance(note.get("start_ticks"), int):
        if note["start_ticks"] == ticks:
            return None
        return (f"pid {pid} is not the run's trainer: the trainer of that pid started at tick {note['start_ticks']}, "
                f"this process at tick {ticks} (the pid was reused by another process)")
    try:
        info = info if info is not None else RunInfo.read(run_dir)
    except OSError as exc:
        return f"pid {pid}: cannot tell it is the trainer ({exc})"
    argv = cmdline(pid, proc)
    checked = False
    if info.command and argv is not None:
        checked = True
        if argv[1:] != info.command[1:]:
            return (f"pid {pid} is not the run's trainer: it runs {' '.join(argv)[:120]!r}, run.json's trainer "
                    f"{' '.join(info.command)[:120]!r}")
    if info.started is not None:
        began = start_wall_time(ticks, proc)
        if began is not None:
            checked = True
            if began > info.started + START_SLACK_S:
                return (f"pid {pid} is not the run's trainer: it started at {began:.0f}, after the trainer wrote "
                        f"run.json at {info.started:.0f} (the pid was reused by another process)")
    if not checked:
        return (f"pid {pid}: cannot tell it is the run's trainer (run.json says neither its command nor when it "
                "started, and no trainer lock names it)")
    return None


def _own_group(pid: int) -> int | None:
    """``pid``'s process group when ``pid`` leads it, else None."""
    try:
        return pid if os.getpgid(pid) == pid else None
    except (ProcessLookupError, PermissionError):
        return None


def group_members(pgid: int, proc: Path | str = "/proc") -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from ``/proc``; where there is no
    ``/proc``, ``[pgid]`` while the kernel still knows the group."""
    root = Path(proc)
    if not root.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    out = []
    for d in root.iterdir():
        if not d.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and ')', so split after the last ')'.
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            out.append(int(d.name))
    return sorted(out)


class LocalProcess:
    """A trainer running as a local process group (its own session)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self._pid = pid
        self._popen = popen
        self._exit: int | None = None
        self.start_ticks = start_ticks(pid)
        """When the process started (clock ticks since boot): an attached pid is this process only while
        the start time under that pid is the same (a pid the OS gave to a later process is not ours)."""
        self._pgid: int | None = pid if popen is not None else _own_group(pid)
        """The trainer's process group, drained on stop: the child leads its own session; an attached
        pid only when it leads a group (never someone else's group)."""

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def is_child(self) -> bool:
        """True when this watchdog started it (so its exit code is known)."""
        return self._popen is not None

    def poll(self) -> int | None:
        if self._popen is not None:
            self._exit = self._popen.poll()
            return self._exit
        return None

    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return _pid_alive(self._pid) and self._same()

    def _same(self) -> bool:
        """True while the pid is still the process attached to (not a later one the OS gave it to)."""
        now = start_ticks(self._pid)
        if now is not None and self.start_ticks is not None and now != self.start_ticks:
            if self._pgid is not None:
                log.warning("pid %d is now another process (started at tick %d, the trainer at %d): it is "
                            "never signalled as the trainer", self._pid, now, self.start_ticks)
            self._pgid = None  # its group is not the trainer's either
            return False
        return True

    def signal(self, sig: int, group: bool = True) -> bool:
        if not self.alive():
            return False
        try:
            # The child leads its own session, so its pgid is its pid; an attached pid may not
            # lead a group, so fall back to the pid itself.
            if not group:
                os.kill(self._pid, sig)
                return True
            try:
                os.killpg(self._pid, sig)
            except ProcessLookupError:
                os.kill(self._pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError as exc:
            raise SupervisorError(f"pid {self._pid}: cannot send signal {sig}: {exc}") from exc
        return True

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the end; exit code (None if unknown or still running)."""
        deadline = time.monotonic() + timeout
        if self._popen is not None:
            try:
                return self._popen.wait(timeout=max(0.0, timeout))
            except subprocess.TimeoutExpired:
                return None
        while time.monotonic() < deadline:
            if not self.alive():
                return None
            time.sleep(0.05)
        return None

    def group_members(self) -> list[int]:
        """Live processes of the trainer's process group, the leader included (Ray's raylet and
        workers, vLLM's engine: what holds GPU memory after the leader is gone)."""
        return group_members(self._pgid) if self._pgid is not None else ([self._pid] if self.alive() else [])

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to ``grace`` for the leader *and every other member* to end,
        then SIGKILL what is left: a relaunch must not start while the old attempt's Ray workers
        still hold the GPUs. A leader that already ended (a crash) has its group drained too."""
        if not self.alive() and not self.group_members():
            return self.poll()
        deadline = time.monotonic() + grace
        log.info("stopping pid %d and its process group (SIGTERM, %.1fs grace)", self._pid, grace)
        self._signal_group(signal.SIGTERM)
        code = self.wait(grace)
        left = self._drain(deadline)
        if left:
            log.warning("pid %d: %d process(es) of its group did not stop within %.1fs (%s): SIGKILL",
                        self._pid, len(left), grace, ", ".join(map(str, left[:8])))
            self._signal_group(signal.SIGKILL)
            if code is None:
                code = self.wait(5.0)
            left = self._drain(time.monotonic() + 5.0)
            if left:
                log.warning("pid %d: process(es) %s of its group still there after SIGKILL (uninterruptible?)",
                            self._pid, ", ".join(map(str, left[:8])))
        return code if code is not None else self.poll()

    def _signal_group(self, sig: int) -> None:
        if self._popen is None and not self._same():
            return  # the pid (and its group) now belong to another process: never signalled
        if self._pgid is None:
            self.signal(sig)
            return
        try:
            os.killpg(self._pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            raise SupervisorError(f"process group {self._pgid}: cannot send signal {sig}: {exc}") from exc

    def _drain(self, deadline: float) -> list[int]:
        """Wait until the group is empty or ``deadline``; the members left."""
        while True:
            self.poll()  # reap the leader, so it does not linger as a zombie
            left = self.group_members()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)


#: The watchdog's own secrets: never passed on to a trainer it starts (the trainer's own, such as
#: HF_TOKEN or WANDB_API_KEY, are its business and pass).
SECRET_ENV = frozenset({"WATCHDOG_WEBHOOK_URL", "WATCHDOG_WEBHOOK_URL_FILE", "GRAFANA_TOKEN", "GRAFANA_TOKEN_FILE"})


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without :data:`SECRET_ENV`, plus ``extra`` (a launch's own variables)."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env.update(extra or {})
    return env


class LocalBackend:
    """Runs trainers as local subprocesses."""

    def start(
        self, command: Sequence[str], env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None, log_path: Path | str | None = None, lock_path: Path | str | None = None,
    ) -> LocalProcess:
        """Start ``command`` in its own session; stdout and stderr appended to ``log_path``.

        ``lock_path``: the run's trainer lock (:data:`~ppo_watchdog.protocol.lock.TRAINER_LOCK`), taken
        before the launch and handed to the child (an inherited descriptor), so it is held for as
        long as anything of this trainer lives; refused with :class:`TrainerAlive` while another
        trainer holds it."""
        if not command:
            raise SupervisorError("empty command")
        full_env = child_env(env)
        held: locks.HolderLock | None = None
        if lock_path is not None:
            held = locks.HolderLock(lock_path, "the run's trainer", role="a trainer")
            try:
                Path(lock_path).parent.mkdir(parents=True, exist_ok=True)
                held.acquire(wait_s=0.5)
            except locks.LockHeld as exc:
                raise TrainerAlive(f"{exc}: not launching a second trainer into the same run directory",
                                   exc.holder) from exc
            except OSError as exc:
                raise SupervisorError(f"{lock_path}: cannot take the run's trainer lock "
                                      f"({exc.strerror or exc})") from exc
        out = None
        try:
            if log_path is not None:
                Path(log_path).parent.mkdir(parents=True, exist_ok=True)
                # Appended to, never through a symlink put in its place (:func:`inputs.open_nofollow`).
                out = os.fdopen(inputs.open_nofollow(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
            popen = subprocess.Popen(
                list(command), env=full_env, cwd=str(cwd) if cwd else None,
                stdin=subprocess.DEVNULL, stdout=out if out else subprocess.DEVNULL,
                stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(held.fd,) if held is not None and held.fd is not None else (),
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            raise LaunchRefused(f"cannot start {' '.join(command)!r}: {exc.strerror or exc}") from exc
        except OSError as exc:
            raise SupervisorError(f"cannot start {' '.join(command)!r}: {exc}") from exc
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor
            if held is not None and "popen" not in locals():
                held.release()
        proc = LocalProcess(popen.pid, popen)
        if held is not None:
            # Who holds it, for a refused second launch and for re-attaching: the trainer's pid and start.
            held.describe(pid=popen.pid, start_ticks=proc.start_ticks, command=list(command)[:64])
            held.release()  # ours only: the child's inherited descriptor keeps the lock held
        log.info("started pid %d: %s", popen.pid, " ".join(command))
        return proc

    def attach(self, pid: int) -> LocalProcess:
        """A handle on a process this watchdog did not start (exit code unknowable)."""
        return LocalProcess(pid)


TAIL_BYTES = 256 * 1024
"""How much of a log's end is read to tell how a trainer ended (a driver traceback with Ray's nested
ones is a few KiB)."""


def read_tail(path: Path | str, start: int = 0, size: int = TAIL_BYTES) -> str:
    """The last ``size`` bytes of a log from byte ``start`` on (one attempt's part of an appended log)."""
    try:
        with os.fdopen(inputs.open_regular(path), "rb") as f:  # (a FIFO named trainer.log: refused, never waited on)
            f.seek(0, 2)
            end = f.tell()
            f.seek(max(start, end - size) if start <= end else max(0, end - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:  # no log yet, or unreadable: nothing to show
        return ""
