"""Ray Job backend: the trainer runs as a Ray Job, submitted and resubmitted through the job server.

On a cluster the trainer (verl's driver, or the embedded trainer) is not a child of the
watchdog: it is a Ray Job's entrypoint, started by the head's job supervisor. This backend
speaks to the head's job server (:class:`ray.job_submission.JobSubmissionClient`, the
dashboard address, ``http://HEAD:8265``) and hands out handles with the same protocol as
:class:`~ppo_watchdog.backends.local.LocalProcess`, so the controller and the actuator work unchanged:

- ``start`` submits the command as the entrypoint (shell-quoted), with the environment as
  ``runtime_env.env_vars`` and no ``working_dir``: the job runs on the head's filesystem,
  and the run directory is a path every node shares (NFS, a PVC), as on any cluster.
  Submission ids are ``<run id>-<attempt>``: a restart is a new job, and the ids say
  which launch of which run each job was.
- ``poll`` / ``alive`` map the job status to an exit code (:func:`exit_code_for`): Ray
  reports the entrypoint's own exit code, so the embedded trainer's OOM exit (75) reads
  the same as from a local process; a failure whose log shows an out-of-memory error is
  an OOM too (a verl driver dies of an exception, not with code 75).
- ``stop`` asks the job server to stop the job (SIGTERM, ``RAY_JOB_STOP_WAIT_TIME_S``,
  SIGKILL, done by the head) and waits for a terminal status.
- ``signal``: a Ray Job cannot be signalled from outside, so it returns False; the trainer
  still reads control.json at its next step boundary and confirms with ``applied``.
- The job's log is copied into the run directory's trainer.log (one header line a job), so
  humans and log readers find it where a local run puts it. The copy follows the job as it
  writes (:meth:`JobSubmissionClient.tail_job_logs`, a websocket, read by one thread a live
  job): a poll costs a status request, not a download of the whole log, which matters for a
  run that lasts days. The stream always starts at the log's first byte, so a re-attached
  watchdog skips what trainer.log already holds; the job's end waits for the stream to reach
  the log's end (or fetches the rest once) before the exit is classified.

A job server that cannot be reached raises :class:`~ppo_watchdog.backends.local.BackendUnavailable`
naming the address: the actuator keeps the action open and tries again at the next tick.

Token authentication (on by default since Ray 2.5x whenever the head finds a token): the job
server answers 401 without ``Authorization: Bearer <token>`` and 403 with a wrong one. Ray's own
client sends the header only when *its* process runs with ``RAY_AUTH_MODE=token``, so the
watchdog finds the token itself (:func:`find_token`: a file the user names, else where Ray looks:
``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``) and hands it to the client
as that header. The token is a secret: it is held in memory only, never logged, never written to
the journal or run.json, never put in an argv or an environment, and never given to a submitted
job (the head's own nodes hold the cluster's token; a job's ``ray.init()`` gets it from them). A
401 or 403 is a :class:`RayAuthError` naming the address and every place the watchdog looked; it
is re-read at the next connection, so a token file put right is picked up without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import shlex
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_watchdog.backends.local import BackendUnavailable, SupervisorError
from ppo_watchdog.protocol import inputs, rundir

log = logging.getLogger(__name__)

#: Ray's terminal job statuses.
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
#: A stopped job reads as the trainer's own exit after SIGTERM (the head sends it one): stopped on
#: purpose, state saved; the watchdog does not resubmit a job an operator stopped.
EXIT_STOPPED = rundir.EXIT_STOPPED
#: A failed job without an exit code (its supervisor died, its runtime env failed to build).
EXIT_UNKNOWN_FAILURE = 1
#: Text in a failed job's log that means it died of running out of memory.
OOM_MARKERS = (
    "OutOfMemoryError",  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError, ray.exceptions.OutOfMemoryError
    "CUDA out of memory",
    "CUDA error: out of memory",
    "node running low on memory",  # Ray's memory monitor killed a worker
)
#: Environment variables that make Ray's client ignore the address it is given.
_ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
_UNSAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")
LOG_HEADER = "==> ray job {job_id} <=="
#: Where Ray itself looks for the cluster's token, in its order (ray._raylet.AuthenticationTokenLoader).
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_PATH = "~/.ray/auth_token"


class RayAuthError(BackendUnavailable):
    """The job server refused the watchdog's request (401: no token; 403: a wrong one).

    A :class:`BackendUnavailable`: the daemon keeps the action and tries again at the next tick
    (the token file may be fixed meanwhile); ``watchdog run`` exits 2 with the message."""


# -- pure helpers ---------------------------------------------------------------------


def exit_code_for(status: str, driver_exit_code: int | None, message: str = "") -> int | None:
    """The exit code a job status stands for (None while it runs).

    SUCCEEDED is 0; FAILED is the entrypoint's exit code when Ray reports one (else 1), or
    :data:`~ppo_watchdog.protocol.rundir.EXIT_OOM` when the failure's log tail shows an out-of-memory error;
    STOPPED is :data:`~ppo_watchdog.protocol.rundir.EXIT_STOPPED`, what the trainer exits with after SIGTERM.
    """
    if status == "SUCCEEDED":
        return 0
    if status == "STOPPED":
        return EXIT_STOPPED
    if status == "FAILED":
        code = driver_exit_code if driver_exit_code else EXIT_UNKNOWN_FAILURE
        if code != rundir.EXIT_OOM and any(m in message for m in OOM_MARKERS):
            return rundir.EXIT_OOM
        return code
    return None


def job_prefix(run_id: str) -> str:
    """A submission-id-safe form of a run id (Ray uses the id in file names and URLs)."""
    safe = _UNSAFE_ID.sub("_", run_id).strip("._-")
    return safe or "run"


def submission_id(run_id: str, attempt: int) -> str:
    """``<run id>-<attempt>``: attempt 1 is the first launch, each restart adds one."""
    return f"{job_prefix(run_id)}-{attempt}"


def next_attempt(run_id: str, existing: Iterable[str]) -> int:
    """One more than the highest attempt among ``existing`` submission ids of this run."""
    prefix = job_prefix(run_id) + "-"
    attempts = [int(s[len(prefix):]) for s in existing if s.startswith(prefix) and s[len(prefix):].isdigit()]
    return max(attempts, default=0) + 1


def entrypoint(command: Sequence[str], cwd: Path | str | None = None) -> str:
    """The shell command line of the job: every argument quoted, after a ``cd`` when a cwd is given."""
    if not command:
        raise SupervisorError("empty command")
    line = shlex.join(list(command))
    return f"cd {shlex.quote(str(cwd))} && {line}" if cwd else line


def check_address_env(address: str, environ: Mapping[str, str] | None = None) -> None:
    """Ray's client silently prefers $RAY_API_SERVER_ADDRESS / $RAY_ADDRESS over the address it is
    given; refuse instead of submitting to a different cluster than the one asked for."""
    env = os.environ if environ is None else environ
    for name in _ADDRESS_ENV:
        value = env.get(name)
        if value and value.rstrip("/") != address.rstrip("/"):
            raise SupervisorError(
                f"Ray address {address!r} given, but ${name}={value!r} would override it in Ray's client; "
                f"unset {name} or pass the same address"
            )
        if value:
            return  # the first one set is the one Ray uses


@dataclass(frozen=True)
class RayToken:
    """The cluster token the watchdog found (or not), and where it looked."""

    value: str | None = field(repr=False)
    """The token itself: never logged, never repr'd."""
    looked: tuple[str, ...]
    """Each place looked, in order, with what was there (``$RAY_AUTH_TOKEN: unset``, ...)."""
    source: str | None = None
    """The place the token came from."""

    def headers(self) -> dict[str, str]:
        """The HTTP header Ray's job server reads the token from (none without a token)."""
        return {"Authorization": f"Bearer {self.value}"} if self.value else {}

    def where(self) -> str:
        """The places looked, for an error message."""
        return "; ".join(self.looked)


def _read_token_file(path: Path) -> str:
    """The token in ``path`` (whitespace stripped); raises OSError or ValueError saying why not.

    A file other users can read is said (once a read, without the token): Ray's own
    ``ray.init()`` writes ``~/.ray/auth_token`` with the default umask, often 0644."""
    path = path.expanduser()
    text = inputs.read_text(path).strip()
    if not text:
        raise ValueError("empty")
    if any(c.isspace() for c in text):
        raise ValueError("more than one word")
    mode = path.stat().st_mode
    if mode & 0o077:
        log.warning("Ray token file %s can be read by other users (mode %o): chmod 600 it", path, mode & 0o777)
    return text


def find_token(token_file: Path | str | None = None, environ: Mapping[str, str] | None = None) -> RayToken:
    """The cluster's token: from ``token_file`` when one is named (``--ray-token-file``, the daemon's
    ``ray_token_file``), else from where Ray itself looks. A named file that cannot be read is an
    error (:class:`RayAuthError` naming it), never a silent fallback."""
    if token_file is not None:
        path = Path(token_file).expanduser()
        try:
            return RayToken(_read_token_file(path), (f"--ray-token-file {path}",), f"--ray-token-file {path}")
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise RayAuthError(f"Ray token file {path}: cannot be used ({why})") from exc
    env = os.environ if environ is None else environ
    looked: list[str] = []
    if env.get(TOKEN_ENV, "").strip():
        return RayToken(env[TOKEN_ENV].strip(), (f"${TOKEN_ENV}",), f"${TOKEN_ENV}")
    looked.append(f"${TOKEN_ENV}: unset")
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    default = str(home / DEFAULT_TOKEN_PATH.removeprefix("~/"))
    for name, raw in ((f"${TOKEN_PATH_ENV}", env.get(TOKEN_PATH_ENV)), (DEFAULT_TOKEN_PATH, default)):
        if not raw:
            looked.append(f"{name}: unset")
            continue
        path = Path(raw).expanduser()
        label = name if name == str(path) else f"{name} ({path})"
        try:
            return RayToken(_read_token_file(path), (*looked, label), label)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            looked.append(f"{label}: {why}")
    return RayToken(None, tuple(looked))


# -- the handle -----------------------------------------------------------------------


class RayJobProcess:
    """A trainer running as one Ray Job (the protocol of :class:`~ppo_watchdog.backends.local.TrainerProcess`)."""

    def __init__(
        self, backend: RayJobBackend, job_id: str, log_path: Path | str | None = None, fresh: bool = False,
    ) -> None:
        """``fresh``: a job just submitted, so none of its log is in ``log_path`` yet (no need to look)."""
        self._backend = backend
        self.job_id = job_id
        """Ray submission id (recorded in the store in place of a pid)."""
        self._sink = _LogSink(Path(log_path), job_id, fresh) if log_path is not None else None
        self._tail: _LogTail | None = None
        self._exit: int | None = None
        self._terminal = False
        self._status: str | None = None
        self._status_ts = -math.inf
        self._tail_ts = -math.inf
        self._unreachable = False

    @property
    def pid(self) -> int | None:
        """None: the entrypoint is a process on the head, not on this machine."""
        return None

    def status(self) -> str | None:
        """The job's status (cached for ``status_ttl_s``); None when the job server cannot be reached."""
        if self._terminal:
            return self._status
        now = time.monotonic()
        if now - self._status_ts < self._backend.status_ttl_s:
            return self._status
        try:
            info = self._backend.job_info(self.job_id)
        except BackendUnavailable as exc:
            if not self._unreachable:
                log.warning("job %s: status unknown (%s); counting it as running until the head answers",
                            self.job_id, exc)
            self._unreachable = True
            return None
        self._unreachable = False
        self._status_ts = now
        if info is None:  # deleted from the cluster (or a head restarted without its job table)
            log.warning("job %s: unknown to the job server; counting it as ended, exit code unknown", self.job_id)
            self._status, self._terminal = "MISSING", True
            self._finish_logs(fetch=False)
            return self._status
        self._status = str(getattr(info.status, "value", info.status))
        if self._status in TERMINAL:
            self._terminal = True
            self._exit = exit_code_for(self._status, info.driver_exit_code, info.message or "")
            log.info("job %s: %s (exit %s)", self.job_id, self._status, self._exit)
            self._finish_logs(fetch=True)  # before anyone reads the exit: the classifier reads trainer.log
        else:
            self._follow_logs(now)
        return self._status

    def poll(self) -> int | None:
        self.status()
        return self._exit

    def alive(self) -> bool:
        # Unknown (head unreachable) counts as running: the job most likely is, and a trainer
        # declared dead would be resubmitted next to itself once the head answers again.
        return not self._terminal if self.status() is not None else True

    def signal(self, sig: int, group: bool = True) -> bool:
        """A Ray Job cannot be signalled; False so callers rely on control.json at the next step."""
        return False

    def stop(self, grace: float = 10.0) -> int | None:
        """Ask the head to stop the job (SIGTERM, its stop wait, SIGKILL) and wait until it has ended."""
        if not self.alive():
            return self.poll()
        log.info("stopping ray job %s (%.1fs grace on the head)", self.job_id, self._backend.stop_wait_s)
        self._backend.stop_job(self.job_id)
        deadline = time.monotonic() + max(grace, self._backend.stop_wait_s) + 10.0
        while time.monotonic() < deadline:
            self._status_ts = -math.inf
            if self.status() is not None and self._terminal:
                return self._exit
            time.sleep(0.2)
        log.warning("ray job %s did not end within %.0fs of the stop request", self.job_id, grace)
        return None

    def close(self) -> None:
        """Stop following the job's log (the watchdog is shutting down; the job itself runs on)."""
        if self._tail is not None:
            self._tail.stop()
            self._tail = None
        if self._sink is not None:
            self._sink.close()

    # -- logs ------------------------------------------------------------------------

    def _follow_logs(self, now: float) -> None:
        """Keep one log stream open while the job runs; reopen one that broke (at most every
        ``log_interval_s``: each reopening reads the log from its start again)."""
        if self._sink is None or (self._tail is not None and self._tail.running()):
            return
        if self._tail is not None:
            if now - self._tail_ts < self._backend.log_interval_s:
                return
            log.warning("job %s: log stream ended while the job runs (%s); following it again",
                        self.job_id, self._tail.error or "closed by the server")
        self._tail_ts = now
        self._tail = _LogTail(self._backend.connect(), self.job_id, self._sink)

    def _finish_logs(self, fetch: bool) -> None:
        """Complete the job's log in trainer.log now that it has ended.

        The stream ends by itself once the job has ended and its log is read to the end (Ray's
        job manager checks both); waited for up to ``log_final_wait_s``. Without a stream that
        got there (none was open, it broke, it was slow), the whole log is fetched once and
        what trainer.log lacks appended."""
        if self._sink is None:
            return
        complete = False
        if self._tail is not None:
            complete = self._tail.join(self._backend.log_final_wait_s)
            self._tail.stop()
            self._tail = None
        if not complete and fetch:
            try:
                text = self._backend.job_logs(self.job_id)
            except SupervisorError as exc:
                log.warning("job %s: logs not fetched: %s", self.job_id, exc)
            else:
                self._sink.write_at(0, text.encode("utf-8", "replace"))
        self._sink.close()


class _LogSink:
    """This job's part of the run's log file: its header once, then each byte of the job's log once.

    Writers give the offset of their bytes in the job's log; what the file already holds is
    skipped, so a stream that starts again from the log's beginning (a reconnect, a restarted
    watchdog) or a final whole-log fetch never duplicates a line."""

    def __init__(self, path: Path, job_id: str, fresh: bool) -> None:
        self.path = path
        self.job_id = job_id
        self._header = ("\n" + LOG_HEADER.format(job_id=job_id) + "\n").encode()
        self._copied: int | None = -1 if fresh else None
        """Bytes of the job's log in the file; -1: not even its header; None: not looked yet."""
        self._file: Any = None
        self._lock = threading.Lock()

    def write_at(self, offset: int, data: bytes) -> None:
        """Append the part of ``data`` (the job's log from byte ``offset``) the file does not hold yet."""
        with self._lock:
            try:
                if self._copied is None:
                    self._copied = _copied_so_far(self.path, self._header)
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    # Held open while the job's log flows; never through a symlink put in its place.
                    self._file = os.fdopen(inputs.open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
                if self._copied < 0:
                    self._file.write(self._header)
                    self._copied = 0
                skip = self._copied - offset
                if skip < 0:  # bytes between what was copied and this chunk are missing: never seen
                    log.warning("job %s: %d bytes of its log missing from %s", self.job_id, -skip, self.path)
                    skip = 0
                if skip < len(data):
                    self._file.write(data[skip:])
                    self._file.flush()  # readers (a human, the exit classifier) see it now
                    self._copied = offset + len(data)
            except OSError as exc:
                log.warning("job %s: cannot write %s: %s", self.job_id, self.path, exc)

    def close(self) -> None:
        """Close the file (reopened by the next write)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class _LogTail:
    """One daemon thread following a job's log through ``tail_job_logs`` into a :class:`_LogSink`.

    ``tail_job_logs`` is an async generator over a websocket, so the thread runs its own
    asyncio loop; :meth:`stop` cancels the stream from any thread."""

    def __init__(self, client: Any, job_id: str, sink: _LogSink) -> None:
        self.job_id = job_id
        self.ended = False
        """The stream ended by itself: Ray's job manager closes it once the job has ended and its
        log is read to the end."""
        self.error: BaseException | None = None
        """Why the stream broke (head unreachable, connection lost), if it did."""
        self._client = client
        self._sink = sink
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"ray-log-{job_id}", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        """True while the stream is open (or opening)."""
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the stream to end by itself; True when it did."""
        self._thread.join(timeout)
        return self.ended

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the stream and wait for the thread (what was read so far is written)."""
        self._stopping.set()
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop has already closed: the thread is ending
                pass
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._follow())
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - recorded; the process reopens a broken stream
            self.error = exc
            log.debug("job %s: log stream broke: %s", self.job_id, exc)

    async def _follow(self) -> None:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        if self._stopping.is_set():  # stop() came before the loop existed
            return
        offset = 0
        async for chunk in self._client.tail_job_logs(self.job_id):
            data = chunk.encode("utf-8", "replace")
            self._sink.write_at(offset, data)
            offset += len(data)
        self.ended = True


def _copied_so_far(path: Path, header: bytes, block: int = 1 << 20) -> int:
    """Bytes after the last ``header`` in ``path`` (this job's log copied so far); -1 without one.

    A watchdog restarted while the job runs re-attaches and carries on where the file ends.
    Read backwards a block at a time: the job's part is at the end of a log that may be large."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return -1
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            # Overlap the next block by a header's length so a header across the boundary is found.
            data = f.read(min(size, end + len(header)) - start)
            at = data.rfind(header)
            if at >= 0:
                return size - (start + at + len(header))
            end = start
    return -1


# -- the backend ----------------------------------------------------------------------


class RayJobBackend:
    """Starts one run's trainer as Ray Jobs on the cluster whose job server is at ``address``."""

    def __init__(
        self, address: str, run_id: str, stop_wait_s: float = 15.0, log_interval_s: float = 5.0,
        status_ttl_s: float = 0.5, client: Any = None, log_final_wait_s: float = 10.0,
        token_file: Path | str | None = None,
    ) -> None:
        """``address``: the job server (Ray dashboard), e.g. ``http://127.0.0.1:8265``.
        ``run_id``: the run whose jobs these are (submission ids derive from it).
        ``stop_wait_s``: the head's SIGTERM grace before SIGKILL (the trainer checkpoints on SIGTERM).
        ``log_interval_s``: least seconds between reopenings of a job's log stream that broke (each
        reads the log from its start again).
        ``status_ttl_s``: a job status is reused this long (one tick asks several times).
        ``client``: an already connected JobSubmissionClient (default: connect on first use).
        ``log_final_wait_s``: at a job's end, how long its log stream may take to reach the log's
        end (Ray's job manager needs a second or two) before the rest is fetched whole.
        ``token_file``: the cluster's token (default: where Ray looks, :func:`find_token`); read at
        each connection, never kept anywhere but the client's headers."""
        if not address:
            raise SupervisorError("empty Ray address")
        self.address = address
        self.run_id = run_id
        self.stop_wait_s = stop_wait_s
        self.log_interval_s = log_interval_s
        self.status_ttl_s = status_ttl_s
        self.log_final_wait_s = log_final_wait_s
        self.token_file = token_file
        self._client = client
        self._token: RayToken | None = None
        self._auth_errors: tuple[type[BaseException], ...] = ()
        self._attempt: int | None = None

    # -- the job server ---------------------------------------------------------------

    def connect(self) -> Any:
        """The JobSubmissionClient (connects, and checks the server's version, on first use)."""
        if self._client is None:
            check_address_env(self.address)
            try:
                from ray.exceptions import AuthenticationError
                from ray.job_submission import JobSubmissionClient
            except ImportError as exc:
                raise SupervisorError(f"the Ray backend needs ray[default]: {exc}") from exc
            self._auth_errors = (AuthenticationError,)
            self._token = find_token(self.token_file)  # each connection: a fixed token file is picked up
            self._client = self._call(
                "connection", JobSubmissionClient, self.address, headers=self._token.headers() or None,
                unreachable="is not reachable",
            )
        return self._client

    def _call(self, what: str, fn: Any, *args: Any, unreachable: str = "", **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._auth_errors as exc:
            self._client = None  # the next call reads the token again
            raise self._auth_error(str(exc)) from None  # Ray's message repeats no token, but keep it short
        except OSError as exc:  # requests.ConnectionError and friends are OSErrors
            raise BackendUnavailable(f"Ray job server at {self.address} {unreachable or what + ' failed'}: "
                                     f"{exc}") from exc
        except RuntimeError as exc:
            if unreachable:  # a server error while connecting
                raise BackendUnavailable(f"Ray job server at {self.address} {unreachable}: {exc}") from exc
            raise

    def _auth_error(self, message: str) -> RayAuthError:
        """A 401/403 as an error naming the address and every place the token was looked for."""
        token = self._token or RayToken(None, ())
        refused = "rejected the token" if "403" in message or "Forbidden" in message else "asks for a token"
        found = f"the token from {token.source} was sent" if token.value else "no token was found"
        return RayAuthError(
            f"Ray job server at {self.address} {refused} (token authentication is on; {found}). "
            f"Looked in: {token.where() or 'nowhere'}. Give the cluster's token with --ray-token-file FILE "
            f"(daemon: ray_token_file), ${TOKEN_PATH_ENV} or ${TOKEN_ENV}; `ray get-auth-token` on the head "
            "prints it."
        )

    def job_info(self, job_id: str) -> Any | None:
        """Ray's JobDetails of a job, or None when the server does not know it."""
        client = self.connect()
        try:
            return self._call(f"status of job {job_id}", client.get_job_info, job_id)
        except RuntimeError as exc:
            if "404" in str(exc) or "does not exist" in str(exc):
                return None
            raise BackendUnavailable(f"Ray job server at {self.address}: status of job {job_id}: {exc}") from exc

    def job_logs(self, job_id: str) -> str:
        """The whole log of a job."""
        client = self.connect()
        try:
            return str(self._call(f"logs of job {job_id}", client.get_job_logs, job_id))
        except RuntimeError as exc:
            raise SupervisorError(f"Ray job server at {self.address}: logs of job {job_id}: {exc}") from exc

    def stop_job(self, job_id: str) -> bool:
        """Ask the server to stop a job; False when it had already ended."""
        client = self.connect()
        try:
            return bool(self._call(f"stop of job {job_id}", client.stop_job, job_id))
        except RuntimeError as exc:
            raise BackendUnavailable(f"Ray job server at {self.address}: stop of job {job_id}: {exc}") from exc

    def run_jobs(self) -> list[Any]:
        """This run's jobs on the cluster (JobDetails), oldest attempt first."""
        client = self.connect()
        prefix = job_prefix(self.run_id) + "-"
        jobs = [j for j in self._call("list of jobs", client.list_jobs)
                if (j.submission_id or "").startswith(prefix) and j.submission_id[len(prefix):].isdigit()]
        return sorted(jobs, key=lambda j: int(j.submission_id[len(prefix):]))

    # -- the Backend protocol -----------------------------------------------------------

    def start(
        self, command: Sequence[str], env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None, log_path: Path | str | None = None,
    ) -> RayJobProcess:
        """Submit ``command`` as the next attempt's job; its log is copied to ``log_path``."""
        line = entrypoint(command, cwd)
        client = self.connect()
        if self._attempt is None:
            # Continue the numbering of jobs already on the cluster (a restarted watchdog).
            self._attempt = next_attempt(self.run_id, (j.submission_id or "" for j in self.run_jobs()))
        env_vars = {str(k): str(v) for k, v in (env or {}).items()}
        env_vars.setdefault("RAY_JOB_STOP_WAIT_TIME_S", str(max(1, math.ceil(self.stop_wait_s))))
        for _ in range(100):
            sid = submission_id(self.run_id, self._attempt)
            try:
                job_id = self._call(
                    f"submission of {sid}", client.submit_job, entrypoint=line, submission_id=sid,
                    runtime_env={"env_vars": env_vars}, metadata={"app": "ppo-watchdog", "run_id": self.run_id},
                )
            except RuntimeError as exc:
                if "already exists" in str(exc):
                    mine = self._same_submission(sid, line)
                    if mine is not None:  # an earlier try went through but its answer was lost
                        self._attempt += 1
                        return RayJobProcess(self, sid, log_path, fresh=True)
                    self._attempt += 1  # taken by another launch of this run: the next number
                    continue
                raise SupervisorError(f"Ray job server at {self.address}: submission of {sid} failed: {exc}") \
                    from exc
            self._attempt += 1
            log.info("submitted ray job %s to %s: %s", job_id, self.address, line)
            return RayJobProcess(self, str(job_id), log_path, fresh=True)
        raise SupervisorError(f"Ray job server at {self.address}: no free submission id for run {self.run_id}")

    def _same_submission(self, sid: str, line: str) -> Any | None:
        """The job ``sid`` when it is this very submission, still running (not an older attempt)."""
        info = self.job_info(sid)
        if info is None or info.entrypoint != line or str(getattr(info.status, "value", info.status)) in TERMINAL:
            return None
        return info

    def attach(self, pid: int) -> RayJobProcess:
        """Ray Jobs are found by submission id (:meth:`attach_job`); a pid names nothing on the cluster."""
        raise SupervisorError(f"run {self.run_id}: pid {pid} cannot be attached as a Ray job; "
                              "a Ray job is attached by its submission id")

    def attach_job(self, job_id: str, log_path: Path | str | None = None) -> RayJobProcess:
        """A handle on a job submitted earlier (a restarted watchdog); its log copy resumes where it ended."""
        return RayJobProcess(self, job_id, log_path)

    def adopt_job(self, job_id: str, log_path: Path | str | None = None) -> RayJobProcess | None:
        """A handle on ``job_id`` (named by run.json) while it has not ended on this cluster, else None.

        A head that cannot be reached counts as running: a second trainer submitted into the same
        run directory is the worse mistake, and the handle learns the job's state when the head answers."""
        try:
            info = self.job_info(job_id)
        except BackendUnavailable as exc:
            log.warning("run %s: adopting ray job %s unchecked: %s", self.run_id, job_id, exc)
            return RayJobProcess(self, job_id, log_path)
        status = None if info is None else str(getattr(info.status, "value", info.status))
        if status is None or status in TERMINAL:
            log.info("run %s: ray job %s from run.json is %s; not adopted", self.run_id, job_id,
                     (status or "unknown to the job server").lower())
            return None
        return RayJobProcess(self, job_id, log_path)


def check_job_server(address: str, token_file: Path | str | None = None) -> str:
    """Connect to the job server now (``watchdog run`` refuses to start without one); its Ray version.

    Raises :class:`RayAuthError` when the server refuses the token (or the lack of one)."""
    client = RayJobBackend(address, "check", token_file=token_file).connect()
    # The client checked the cluster's Ray version while connecting (its get_version() is the job API's).
    return str(getattr(client, "_server_ray_version", None) or "unknown")
