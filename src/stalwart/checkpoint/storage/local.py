"""POSIX filesystem backend: temp + fsync + rename + directory fsync."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid

from stalwart.errors import DiskFullError

__all__ = ["LocalStorage"]

_WRITE_PIECE = 8 << 20  # os.write of a larger buffer is split by the kernel anyway


def _raise_full(err: OSError, path: str) -> None:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(
            errno.ENOSPC,
            f"no space left on the checkpoint storage while writing {path}; "
            "free space, lower retention (keep_last) or point the checkpoint dir elsewhere",
        ) from err


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalStream:
    def __init__(self, final: str) -> None:
        self._final = final
        self._tmp = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
        os.makedirs(os.path.dirname(final), exist_ok=True)
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, data: memoryview | bytes) -> None:
        assert self._fd is not None, "stream already closed"
        view = memoryview(data).cast("B")
        try:
            while view:
                n = os.write(self._fd, view[:_WRITE_PIECE])
                view = view[n:]
        except OSError as err:
            self.abort()
            _raise_full(err, self._final)
            raise

    def commit(self) -> None:
        assert self._fd is not None, "stream already closed"
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.rename(self._tmp, self._final)
            _fsync_dir(os.path.dirname(self._final))
        except OSError as err:
            self.abort()
            _raise_full(err, self._final)
            raise

    def abort(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


class LocalStorage:
    """Checkpoints in a local (or mounted) directory. ``root`` is created on first write."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def write_atomic(self, path: str, data: bytes) -> None:
        stream = self.open_stream(path)
        stream.write(data)
        stream.commit()

    def open_stream(self, path: str) -> _LocalStream:
        try:
            return _LocalStream(self._p(path))
        except OSError as err:
            _raise_full(err, path)
            raise

    def read(self, path: str) -> bytes:
        with open(self._p(path), "rb") as f:
            return f.read()

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        fd = os.open(self._p(path), os.O_RDONLY)
        try:
            view = buf.cast("B")
            pos = offset
            while view:
                n = os.preadv(fd, [view], pos)
                if n == 0:
                    raise EOFError(f"{path}: file is shorter than expected (truncated)")
                view = view[n:]
                pos += n
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._p(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, path: str) -> int:
        return os.stat(self._p(path)).st_size

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._p(path))

    def delete_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(self._p(path))
