"""The per-job token file: created once with mode 0600, read by every agent and worker.

The token authenticates every control message. It is passed around as a *path*
(never in argv, where ``ps`` shows it to every user) and is refused when other
users could read or write the file, or when it is not this user's own (on a shared
host another user could have planted a file of their choosing at that path).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat

from stalwart.coordinator.errors import TokenFileError
from stalwart.coordinator.store import Compare, Put, Store

__all__ = [
    "TOKEN_CHECK_VERSION",
    "check_token",
    "create_token_file",
    "read_token_file",
    "token_check",
]

TOKEN_CHECK_VERSION = 1
_CHECK_LABEL = b"stalwart-job-token-check-v1\0"

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


def token_check(token: bytes) -> bytes:
    """The verifier etcd holds for a job token given as a file (docs/security.md):
    ``{"v": 1, "sha256": hex(SHA-256(label || token))}``. The token is 256 random
    bits, so its hash reveals nothing usable."""
    digest = hashlib.sha256(_CHECK_LABEL + token).hexdigest()
    return json.dumps({"v": TOKEN_CHECK_VERSION, "sha256": digest}).encode()


def check_token(store: Store, job: str, token: bytes, path: str, *, create: bool) -> None:
    """TokenFileError unless ``token`` matches the job's verifier in etcd (which the
    first agent creates); a mismatch means two nodes were given different files."""
    key = f"/stalwart/{job}/launch/token-check"
    mine = token_check(token)
    if create:
        store.txn([Compare(key, "mod_revision", "==", 0)], [Put(key, mine)])
    kv = store.get(key)
    if kv is None or bytes(kv.value) != mine:
        raise TokenFileError(
            f"token file {path} is not the one job {job} started with (etcd's launch/token-"
            "check differs or is missing): give every node and worker the same --token-file"
        )
