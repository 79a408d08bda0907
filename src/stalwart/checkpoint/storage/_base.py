"""The storage interface (see the package docstring for the atomicity contract)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["Storage", "StreamWriter"]


class StreamWriter(Protocol):
    """A file written front to back; invisible under its final name until ``commit``."""

    def write(self, data: memoryview | bytes) -> None: ...

    def commit(self) -> None:
        """Make the bytes durable and visible under the final name."""

    def abort(self) -> None:
        """Drop what was written; never raises."""


class Storage(Protocol):
    """Paths are relative to the root; a backend refuses (:class:`UnsafePathError`) any
    path that would leave it: absolute, ``..``, or through a symbolic link."""

    url: str

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write a small file so that readers see all of it or none of it."""

    def open_stream(self, path: str) -> StreamWriter: ...

    def read(self, path: str) -> bytes: ...

    def read_into(
        self,
        path: str,
        offset: int,
        buf: memoryview,
        on_piece: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Fill ``buf`` from ``offset``; raises FileNotFoundError or EOFError when short.
        ``on_piece`` sees the filled bytes in order, in pieces as the backend reads them
        (so a checksum can run on bytes still in the CPU cache), and covers all of buf."""

    def exists(self, path: str) -> bool: ...

    def kind(self, path: str) -> str:
        """``file``, ``dir``, ``link``, ``other`` or ``missing``; never follows a link."""

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` so that ``dst`` appears whole or not at all."""

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` (empty if it does not exist)."""

    def size(self, path: str) -> int: ...

    def delete(self, path: str) -> None:
        """Remove a file; missing is fine."""

    def delete_dir(self, path: str) -> None:
        """Remove an (emptied) directory or prefix; missing is fine."""
