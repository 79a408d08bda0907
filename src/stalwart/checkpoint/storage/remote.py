"""fsspec backend for remote URLs (s3://, gs://, memory://, ...).

fsspec is imported only here, so a local-only user never needs it. On an object store a
single put is atomic and there is no rename: streams are buffered and put once at commit,
and the manifest (written last, self-checksummed) is the commit marker.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

from stalwart.checkpoint.storage._keys import KeyRoot
from stalwart.errors import ConfigError

__all__ = ["FsspecStorage"]


def _put(fs: Any, path: str, data: bytes) -> None:
    """One put of the whole object; parents made first where the filesystem has
    directories (object stores have none and ignore it)."""
    parent = path.rsplit("/", 1)[0]
    if parent and parent != path:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, data)


class _BufferedStream:
    def __init__(self, fs: Any, path: str) -> None:
        self._fs = fs
        self._path = path
        self._buf: io.BytesIO | None = io.BytesIO()

    def write(self, data: memoryview | bytes) -> None:
        assert self._buf is not None, "stream already closed"
        self._buf.write(data)

    def commit(self) -> None:
        assert self._buf is not None, "stream already closed"
        _put(self._fs, self._path, self._buf.getvalue())
        self._buf = None

    def abort(self) -> None:
        self._buf = None


class FsspecStorage:
    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError as err:
            raise ConfigError(
                f"checkpoint URL {url!r} needs fsspec: pip install 'stalwart[remote]'"
            ) from err
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self._keys = KeyRoot(str(root))
        self.root = self._keys.root

    def _p(self, path: str) -> str:
        return self._keys.key(path)  # nothing outside the root: no absolute paths, no '..'

    def write_atomic(self, path: str, data: bytes) -> None:
        _put(self.fs, self._p(path), data)

    def open_stream(self, path: str) -> _BufferedStream:
        return _BufferedStream(self.fs, self._p(path))

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(self._p(path)))

    def read_into(
        self,
        path: str,
        offset: int,
        buf: memoryview,
        on_piece: Callable[[memoryview], None] | None = None,
    ) -> None:
        view = buf.cast("B")
        data = self.fs.cat_file(self._p(path), start=offset, end=offset + len(view))
        if len(data) != len(view):
            raise EOFError(f"{path}: file is shorter than expected (truncated)")
        view[:] = data
        if on_piece is not None:
            on_piece(view)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._p(path)))

    def kind(self, path: str) -> str:
        """``file``, ``dir`` or ``missing`` (object stores have no links)."""
        try:
            info = self.fs.info(self._p(path))
        except FileNotFoundError:
            return "missing"
        return "dir" if info.get("type") == "directory" else "file"

    def rename(self, src: str, dst: str) -> None:
        """Copy then delete: the copy is one put, so ``dst`` appears whole or not at all."""
        _put(self.fs, self._p(dst), bytes(self.fs.cat_file(self._p(src))))
        self.delete(src)

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def size(self, path: str) -> int:
        return int(self.fs.size(self._p(path)))

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(path))

    def delete_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.rmdir(self._p(path))
