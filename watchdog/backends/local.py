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
from typing import Protocol

log = logging.getLogger(__name__)


class SupervisorError(OSError):
    """A process could not be started or signalled; names the command or pid."""


class LaunchRefused(SupervisorError):
    """The command cannot run at all (no such program, not executable): trying again cannot help."""


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

    def signal(self, sig: int) -> bool:
        """Send a signal to the process group; False when it has already gone."""
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
        return _pid_alive(self._pid)

    def signal(self, sig: int) -> bool:
        if not self.alive():
            return False
        try:
            # The child leads its own session, so its pgid is its pid; an attached pid may not
            # lead a group, so fall back to the pid itself.
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
            if not _pid_alive(self._pid):
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
        cwd: Path | str | None = None, log_path: Path | str | None = None,
    ) -> LocalProcess:
        """Start ``command`` in its own session; stdout and stderr appended to ``log_path``."""
        if not command:
            raise SupervisorError("empty command")
        full_env = child_env(env)
        out = None
        try:
            if log_path is not None:
                Path(log_path).parent.mkdir(parents=True, exist_ok=True)
                out = open(log_path, "ab")
            popen = subprocess.Popen(
                list(command), env=full_env, cwd=str(cwd) if cwd else None,
                stdin=subprocess.DEVNULL, stdout=out if out else subprocess.DEVNULL,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            raise LaunchRefused(f"cannot start {' '.join(command)!r}: {exc.strerror or exc}") from exc
        except OSError as exc:
            raise SupervisorError(f"cannot start {' '.join(command)!r}: {exc}") from exc
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor
        log.info("started pid %d: %s", popen.pid, " ".join(command))
        return LocalProcess(popen.pid, popen)

    def attach(self, pid: int) -> LocalProcess:
        """A handle on a process this watchdog did not start (exit code unknowable)."""
        return LocalProcess(pid)


TAIL_BYTES = 256 * 1024
"""How much of a log's end is read to tell how a trainer ended (a driver traceback with Ray's nested
ones is a few KiB)."""


def read_tail(path: Path | str, start: int = 0, size: int = TAIL_BYTES) -> str:
    """The last ``size`` bytes of a log from byte ``start`` on (one attempt's part of an appended log)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            end = f.tell()
            f.seek(max(start, end - size) if start <= end else max(0, end - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:  # no log yet, or unreadable: nothing to show
        return ""
