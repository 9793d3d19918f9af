"""Reading what users and trainers hand the watchdog, which may not be what it should be.

A run directory is written by a trainer the watchdog does not control, a config or a rule pack by a person:
a FIFO where a file belongs must not stop a daemon that watches a thousand other runs (opening it for
reading waits for a writer), and a value quoted in an error must not be built whole first (a YAML alias
bomb is billions of items in a few lines). Standard library only: the trainer, the rules core and the
daemon all read through it.
"""

from __future__ import annotations

import errno
import os
import reprlib
import stat
from pathlib import Path
from typing import Any


class NotRegularFileError(OSError):
    """A path that holds something other than a regular file (a FIFO, a device, a socket, a directory) where
    a run's file, or a config, belongs. ``str()`` names the path and what is there."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_regular(path: str | Path, mode: int) -> None:
    """Raise :class:`NotRegularFileError` unless ``mode`` (a ``stat`` of ``path``) is a regular file's."""
    if not stat.S_ISREG(mode):
        what = next((name for test, name in _KINDS if test(mode)), "something else")
        raise NotRegularFileError(errno.EINVAL, f"{what}, not a regular file", os.fspath(path))


def open_regular(path: str | Path, stream_ok: bool = False) -> int:
    """A descriptor of ``path`` opened for reading, once it is known to be a regular file. It is opened without
    blocking first: a FIFO put where a run's file belongs raises :class:`NotRegularFileError` instead of waiting
    for a writer that may never come (and that Ctrl-C does not interrupt). ``stream_ok``: a pipe or a character
    device is let through too (a file a person names: ``--config <(...)``). The caller closes it."""
    return _open(path, stream_ok)[0]


def _open(path: str | Path, stream_ok: bool) -> tuple[int, os.stat_result]:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not (stream_ok and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode))):
            check_regular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_nofollow(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of a file the watchdog or a trainer writes in a run directory (a lock, trainer.log,
    events.jsonl), opened with ``flags`` (``os.O_WRONLY | os.O_APPEND | os.O_CREAT``, say) without following a
    symlink and refused unless a regular file: a symlink put where the file belongs would have the target
    truncated or written to, out of the run directory (by a watchdog running as root over run directories
    others can write). Both are :class:`NotRegularFileError` naming the path. Not opened blocking (a FIFO is
    refused, never waited on); close-on-exec (a child the file is handed to names it in ``pass_fds``)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(errno.ELOOP, "a symbolic link (not followed), not a regular file",
                                      os.fspath(path)) from None
        if exc.errno == errno.ENXIO:  # opened for writing only, a FIFO with no reader
            raise NotRegularFileError(errno.ENXIO, "a FIFO, not a regular file", os.fspath(path)) from None
        raise
    try:
        check_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str | Path, max_bytes: int | None = None, offset: int = 0, stream_ok: bool = False) -> bytes:
    """The bytes of a regular file from ``offset`` on (:func:`open_regular`). Past ``max_bytes``: an OSError
    (EFBIG) that says the limit. ``stream_ok``: a file a person named may also be a pipe, read as it comes
    (what they piped in is what they asked to be read), up to ``max_bytes``."""
    fd, st = _open(path, stream_ok)
    try:
        if not stat.S_ISREG(st.st_mode):  # (a pipe: its size is not known before it is read)
            os.set_blocking(fd, True)
            limit = max_bytes if max_bytes is not None else 2**62
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(limit + 1)
            if len(data) > limit:
                raise OSError(errno.EFBIG, f"larger than {limit:,} bytes", os.fspath(path))
            return data
        if max_bytes is not None and st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes:,} bytes ({st.st_size:,})", os.fspath(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            f.seek(offset)
            return f.read()
    finally:
        os.close(fd)


def read_text(path: str | Path, max_bytes: int | None = None, errors: str = "strict", stream_ok: bool = False) -> str:
    """:func:`read_file` as UTF-8 text."""
    return read_file(path, max_bytes, stream_ok=stream_ok).decode("utf-8", errors)


def reason(exc: Exception) -> str:
    """What went wrong reading a file, without the errno and path the OSError's ``str()`` repeats (a decoding
    error has no ``strerror``: its own text)."""
    return getattr(exc, "strerror", None) or str(exc)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 3, 6, 6, 6, 6
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 80


def short_repr(value: Any, width: int = 80) -> str:
    """``repr(value)`` cut to ``width`` characters, without building the whole of it first: a config's value
    can be a YAML alias bomb (billions of items in a few lines) or a 50 MB JSON list."""
    text = _SHORT.repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
