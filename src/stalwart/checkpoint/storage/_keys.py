"""Object keys of checkpoint paths under an object store's root: the one place the S3 and
fsspec backends turn a checkpoint-relative path into a key (and refuse one that leaves the
root: absolute, ``..``, empty parts)."""

from __future__ import annotations

from stalwart.checkpoint.storage.local import split_relpath

__all__ = ["KeyRoot"]


class KeyRoot:
    """``root``: the key prefix (a bucket prefix, an fsspec path), without a trailing
    slash; empty for a bucket's top."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")

    def key(self, path: str) -> str:
        """The key of ``path`` (the root itself for ``""``); UnsafePathError for a path
        that would leave the root."""
        rel = "/".join(split_relpath(path))
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root else rel

    def dir_prefix(self, path: str) -> str:
        """The prefix every key under the "directory" ``path`` starts with."""
        key = self.key(path)
        return f"{key}/" if key else ""
