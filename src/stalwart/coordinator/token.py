"""The per-job token file: created once with mode 0600, read by every agent and worker.

The token authenticates every control message. It is passed around as a *path*
(never in argv, where ``ps`` shows it to every user) and is refused when other
users could read or write the file, or when it is not this user's own (on a shared
host another user could have planted a file of their choosing at that path).
"""

from __future__ import annotations

import os
import secrets
import stat

from stalwart.coordinator.errors import TokenFileError

__all__ = ["create_token_file", "read_token_file"]

_TOKEN_BYTES = 32
_MIN_TOKEN_CHARS = 16


def create_token_file(path: str | os.PathLike[str]) -> bytes:
    """Write a fresh random token to ``path`` (mode 0600, must not exist); return it.

    ``O_EXCL`` makes two launchers racing for the same run dir fail loudly instead
    of silently overwriting each other's token.
    """
    token = secrets.token_hex(_TOKEN_BYTES).encode("ascii")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise TokenFileError(
            f"token file {path} already exists; read it with read_token_file() "
            "or remove it to start a new job"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # the umask may have narrowed it; never widen beyond 0600
        os.write(fd, token + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return token


def read_token_file(path: str | os.PathLike[str]) -> bytes:
    """Return the token stored at ``path``: a regular file of this user's that no other
    user can read or write (checked on the opened file, so a swap between the check
    and the read is impossible; a FIFO does not block the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise TokenFileError(
            f"token file {path} not found; pass the job's token file (created by the launcher)"
        ) from None
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"token file {path} is not a regular file; pass the token file")
        if st.st_uid != os.geteuid():
            raise TokenFileError(
                f"token file {path} belongs to uid {st.st_uid}, not to this user "
                f"(uid {os.geteuid()}): another user could have planted it; run the job "
                "as the user who created the token file"
            )
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TokenFileError(
                f"token file {path} is accessible by other users "
                f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}"
            )
        data = os.read(fd, 4096)
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    token = data.strip()
    if len(token) < _MIN_TOKEN_CHARS:
        raise TokenFileError(
            f"token file {path} holds {len(token)} characters, fewer than {_MIN_TOKEN_CHARS}; "
            "recreate it with create_token_file()"
        )
    return token
