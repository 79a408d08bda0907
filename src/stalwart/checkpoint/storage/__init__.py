"""Storage backends behind one small interface.

``Storage`` is the only extension point the checkpoint engine needs from a filesystem
or object store. Paths are ``/``-separated strings relative to the checkpoint root
(strings, not ``pathlib.Path``, because remote URLs are not local paths).

Atomicity differs by backend and is what the engine relies on:

- :class:`LocalStorage` (POSIX): ``write_atomic`` is temp file + fsync + rename + fsync of
  the directory; a stream is published by rename when committed.
- :class:`S3Storage` (``s3://bucket/prefix``, boto3): a stream is a multipart upload,
  visible only once completed; small files are one put; the manifest is put last, with
  ``If-None-Match: *`` where the store supports it.
- :class:`FsspecStorage` (other object stores, fsspec's memory and local filesystems): a single
  object put is the atomic unit. The manifest, written last with its own checksum, is the
  commit marker: a step without a verifying manifest is invisible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalwart.checkpoint.storage._base import Storage, StreamWriter
from stalwart.checkpoint.storage.local import LocalStorage

if TYPE_CHECKING:
    from stalwart.checkpoint.storage.s3 import S3Config, S3Storage

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "S3Config",
    "S3Storage",
    "Storage",
    "StreamWriter",
    "open_storage",
    "storage_options",
]


def open_storage(url: str, *, s3: S3Config | None = None) -> Storage:
    """A backend for ``url``: a plain path gives :class:`LocalStorage`; ``s3://`` gives
    :class:`S3Storage` (``s3``: its endpoint, part size, parallelism; boto3 is imported
    only then); another ``proto://...`` gives :class:`FsspecStorage` (fsspec likewise)."""
    if url.startswith("s3://"):
        from stalwart.checkpoint.storage.s3 import S3Storage

        return S3Storage(url, s3)
    if "://" in url and not url.startswith("file://"):
        from stalwart.checkpoint.storage.remote import FsspecStorage

        return FsspecStorage(url)
    return LocalStorage(url.removeprefix("file://"))


def storage_options(storage: Storage) -> dict[str, object] | None:
    """What, beside its URL, opens ``storage`` again in another process (the persister):
    an :class:`S3Storage`'s :class:`S3Config` as a dict (``open_storage(url,
    s3=S3Config(**options))``); ``None`` for the others."""
    config = getattr(storage, "config", None)
    if config is None or type(config).__name__ != "S3Config":
        return None
    import dataclasses

    return dataclasses.asdict(config)


def __getattr__(name: str) -> object:
    if name == "FsspecStorage":
        from stalwart.checkpoint.storage.remote import FsspecStorage

        return FsspecStorage
    if name in ("S3Storage", "S3Config"):
        from stalwart.checkpoint.storage import s3 as _s3

        return getattr(_s3, name)
    raise AttributeError(name)
