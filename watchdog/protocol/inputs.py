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


def read_file(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The whole of a regular file. It is opened without blocking and checked before it is read: a FIFO put
    where a run's file belongs (or given as a config) raises :class:`NotRegularFileError` instead of waiting
    for a writer that may never come, and a device is not read for ever. Past ``max_bytes``: an OSError
    (EFBIG) that says the limit."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        check_regular(path, st.st_mode)
        if max_bytes is not None and st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes:,} bytes ({st.st_size:,})", os.fspath(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def read_text(path: str | Path, max_bytes: int | None = None, errors: str = "strict") -> str:
    """:func:`read_file` as UTF-8 text."""
    return read_file(path, max_bytes).decode("utf-8", errors)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 3, 6, 6, 6, 6
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 80


def short_repr(value: Any, width: int = 80) -> str:
    """``repr(value)`` cut to ``width`` characters, without building the whole of it first: a config's value
    can be a YAML alias bomb (billions of items in a few lines) or a 50 MB JSON list."""
    text = _SHORT.repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
