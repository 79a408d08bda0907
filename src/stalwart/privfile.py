"""Single files in a directory other users share (``/dev/shm``: the progress board, a
worker's step journal): created by this user alone, or refused.

Why: their names are this job's, but ``/dev/shm`` is writable by everyone, so another
local user could create the name first (mode 0666) and then read or write what the job
puts there. The file is created with ``O_EXCL`` (mode 0600, never through a link); a file
already at the name is used only when it is a regular file of this user that no one else
may read or write (this job's own, e.g. after a restart), otherwise it is refused with
:class:`ForeignFileError`. docs/security.md states the model.
"""

from __future__ import annotations

import os
import stat

from stalwart.errors import StalwartError

__all__ = ["ForeignFileError", "open_own"]

_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


class ForeignFileError(StalwartError, PermissionError):
    """A file at one of the job's names is not the job user's own (or is readable or
    writable by others): someone else made it, and it is not used."""


def open_own(path: str, *, create: bool) -> int:
    """A read-write descriptor on ``path``: with ``create``, made 0600 with ``O_EXCL``;
    an existing file (or, without ``create``, the one the creator made) only when it is
    a regular file owned by this user with no permission for group or others."""
    if create:
        try:
            return os.open(path, _FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
    fd = os.open(path, _FLAGS | os.O_NONBLOCK)  # a planted FIFO must not block the open
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    what = (
        "not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"owned by uid {st.st_uid}"
        if st.st_uid != os.getuid()
        else f"mode {stat.S_IMODE(st.st_mode):04o} (group or others may use it)"
    )
    raise ForeignFileError(
        f"{path} already exists and is {what}: refusing to use it; remove it (another "
        "user may have planted it), or run the job under another job id"
    )
