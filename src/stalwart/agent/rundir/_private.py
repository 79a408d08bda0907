"""The run directory is the job user's: created 0700, refused when someone else could
write into it (docs/security.md, "Files on a shared host").

What lives there (events, rank logs, checkpoints, the token, chaos requests) lets whoever
reads it take the model and whoever writes it steer the job (a chaos request kills a
rank). So a run directory is created 0700 whatever the umask, an existing one of this
user's is narrowed to 0700, and one that another user owns or that group or others can
write is refused with one line: something may already have been planted in it. Files
the agent creates there are 0600 (:data:`FILE_MODE`).
"""

from __future__ import annotations

import os
import stat

from stalwart.errors import ConfigError

__all__ = ["DIR_MODE", "FILE_MODE", "make_private_dir", "owned_file", "write_private"]

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dir(path: str, what: str = "--run-dir") -> None:
    """Create ``path`` (and missing parents) 0700, or check an existing one is this
    user's and writable by no one else, narrowing it to 0700. ConfigError otherwise."""
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        st = os.stat(path)
    except OSError as err:
        raise ConfigError(
            f"{what} {path}: {err.strerror}; pass a directory you can create"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory; pass a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            "its contents could be theirs; pass a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
            "one could have planted files or chaos requests in it; check its contents, then "
            f"run: chmod 700 {path}"
        )
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)  # ours and unwritable by others: only narrow it


def owned_file(path: str) -> str | None:
    """Why a file in the run directory is not to be trusted (None: it is this user's,
    a regular file, writable by no one else)."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return err.strerror or "unreadable"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this job's user"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` as a 0600 file whatever the umask (replacing its
    contents; a symbolic link there is not followed: OSError)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(path, flags, FILE_MODE), "w") as f:
        f.write(text)
