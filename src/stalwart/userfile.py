"""Files a user names on the command line (a calibration, a trace, an event log, a DCP
checkpoint's metadata): read only when they are regular files.

Why: ``open()`` of a FIFO blocks until someone writes to it, and a device (``/dev/zero``,
``/dev/urandom``) never ends: ``stalwart plan --calibration FIFO`` hung with no word. The
file is opened ``O_NONBLOCK`` (the open of a FIFO then returns at once), checked with
``fstat`` (what was opened, not a name that may change after a check) and refused in one
line when it is anything but a regular file; a regular file is then read as usual.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from stalwart.errors import StalwartError

__all__ = ["NotRegularFileError", "open_regular"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFileError(StalwartError):
    """A path given as a file to read is a FIFO, a device, a directory or a socket."""


def _shown(path: str) -> str:
    return path if len(path) <= 120 else f"{path[:120]}... ({len(path)} characters)"


def open_regular(path: str | os.PathLike[str], *, what: str, fix: str) -> BinaryIO:
    """``path`` opened for reading (binary), refused with :class:`NotRegularFileError`
    (``PATH: WHAT is a FIFO, not a regular file; FIX``) unless it is a regular file.
    OSError (no such file, no permission) is the caller's to word."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((k for test, k in _KINDS if test(mode)), "not a file")
            raise NotRegularFileError(
                f"{_shown(os.fspath(path))}: {what} is {kind}, not a regular file; {fix}"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")
