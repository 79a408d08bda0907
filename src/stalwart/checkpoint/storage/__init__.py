"""Storage backends behind one small interface.

``Storage`` is the only extension point the checkpoint engine needs from a filesystem
or object store. Paths are ``/``-separated strings relative to the checkpoint root
(strings, not ``pathlib.Path``, because remote URLs are not local paths).

Atomicity differs by backend and is what the engine relies on:

- :class:`LocalStorage` (POSIX): ``write_atomic`` is temp file + fsync + rename + fsync of
  the directory; a stream is published by rename when committed.
- :class:`FsspecStorage` (object stores, fsspec's memory and local filesystems): a single
  object put is the atomic unit. The manifest, written last with its own checksum, is the
  commit marker: a step without a verifying manifest is invisible.
"""

from __future__ import annotations

from stalwart.checkpoint.storage._base import Storage, StreamWriter
from stalwart.checkpoint.storage.local import LocalStorage

__all__ = ["FsspecStorage", "LocalStorage", "Storage", "StreamWriter", "open_storage"]


def open_storage(url: str) -> Storage:
    """A backend for ``url``: a plain path gives :class:`LocalStorage`; ``proto://...``
    gives :class:`FsspecStorage` (fsspec is imported only then)."""
    if "://" in url and not url.startswith("file://"):
        from stalwart.checkpoint.storage.remote import FsspecStorage

        return FsspecStorage(url)
    return LocalStorage(url.removeprefix("file://"))


def __getattr__(name: str) -> object:
    if name == "FsspecStorage":
        from stalwart.checkpoint.storage.remote import FsspecStorage

        return FsspecStorage
    raise AttributeError(name)
