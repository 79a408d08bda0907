"""S3 backend (``s3://bucket/prefix``) on boto3: streamed multipart uploads, ranged reads.

An object store has no rename and no directories. A pack is a multipart upload, invisible
until completed; small files are one put (atomic). The manifest, written last, is the commit
marker, and it is written with a conditional put (``If-None-Match: *``) where the store
supports it, so two writers can never both publish a step (the second gets
:class:`StepCommittedError`). A "directory" is a key prefix: it exists while an object
under it does. Errors of the store become :class:`StorageUnavailableError` (one line naming
the fix); a missing key is ``FileNotFoundError`` as for the other backends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stalwart.checkpoint.format import MANIFEST_NAME
from stalwart.checkpoint.storage._keys import KeyRoot
from stalwart.checkpoint.storage._s3_client import (
    S3Config,
    error_code,
    make_client,
    not_found,
    translate,
)
from stalwart.checkpoint.storage._s3_upload import MultipartStream
from stalwart.errors import ConfigError, StepCommittedError

__all__ = ["S3Config", "S3Storage", "parse_s3_url"]

_READ_PIECE = 512 << 10  # pieces handed to on_piece: hashed while still in the CPU's cache


def parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket[/prefix]`` (prefix without slashes at its ends)."""
    if not url.startswith("s3://"):
        raise ConfigError(f"{url!r} is not an s3:// URL (s3://bucket/prefix)")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not bucket or "?" in url or "#" in url:
        raise ConfigError(f"{url!r}: an S3 checkpoint URL is s3://bucket/prefix (no query)")
    if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
        raise ConfigError(f"{url!r}: the prefix has an empty, '.' or '..' part")
    return bucket, prefix


def _copying_readinto(body: Any) -> Callable[[memoryview], int]:
    """``readinto`` for a botocore body without one (older botocore): read, then copy."""

    def readinto(view: memoryview) -> int:
        data = body.read(len(view))
        view[: len(data)] = data
        return len(data)

    return readinto


class S3Storage:
    """Checkpoints under ``s3://bucket/prefix``. The client is made on first use: opening
    the storage does no network I/O."""

    def __init__(self, url: str, config: S3Config | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._keys = KeyRoot(self.prefix)
        self.config = config if config is not None else S3Config()
        self._client: Any = make_client(self.config, self.url)
        self.endpoint = str(self._client.meta.endpoint_url)
        self._conditional = True  # the store accepts If-None-Match on PutObject
        self.read_threads = self.config.read_threads  # restore's reads in flight
        self.read_range_bytes = self.config.read_range_bytes  # restore's bytes per GET

    # -- helpers ---------------------------------------------------------------------------

    def _key(self, path: str) -> str:
        return self._keys.key(path)

    def _dir_prefix(self, path: str) -> str:
        return self._keys.dir_prefix(path)

    def _err(self, err: BaseException, what: str) -> BaseException:
        return translate(err, self.url, self.endpoint, what)

    def _call(self, what: str, fn: Callable[..., Any], **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as err:
            if not_found(err):
                raise FileNotFoundError(f"{self.url}: {kw.get('Key', '')} does not exist") from err
            raise self._err(err, what) from err

    # -- the Storage protocol --------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes) -> None:
        key = self._key(path)
        if path.rsplit("/", 1)[-1] == MANIFEST_NAME and self._conditional:
            try:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
                return
            except Exception as err:
                code = error_code(err)
                if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise StepCommittedError(
                        f"{self.url}/{key} already exists: the step was committed by another "
                        "writer; a committed step is never rewritten"
                    ) from err
                if code not in ("NotImplemented", "InvalidArgument", "501"):
                    raise self._err(err, f"writing {path}") from err
                self._conditional = False  # the store has no conditional writes: plain put
        self._call(f"writing {path}", self._client.put_object, Key=key, Body=data)

    def open_stream(self, path: str) -> MultipartStream:
        return MultipartStream(
            self._client,
            self.bucket,
            self._key(path),
            self.config.part_bytes,
            self.config.parallel_parts,
            lambda err, what: self._err(err, f"{what} of {path}"),
        )

    def read(self, path: str) -> bytes:
        reply = self._call(f"reading {path}", self._client.get_object, Key=self._key(path))
        return bytes(reply["Body"].read())

    def read_into(
        self,
        path: str,
        offset: int,
        buf: memoryview,
        on_piece: Callable[[memoryview], None] | None = None,
    ) -> None:
        self.read_ranges(
            path, offset, [buf.cast("B")], None if on_piece is None else lambda _, p: on_piece(p)
        )

    def read_ranges(
        self,
        path: str,
        offset: int,
        views: Sequence[memoryview],
        on_piece: Callable[[int, memoryview], None] | None = None,
    ) -> None:
        """Fill ``views`` (byte views, in order) from the bytes at ``offset`` of ``path``
        with one ranged GET, read straight into them; ``on_piece(i, piece)`` sees the
        bytes of ``views[i]`` as they land. EOFError when the object is shorter."""
        total = sum(len(v) for v in views)
        if offset < 0:
            raise EOFError(f"{path}: negative offset {offset}")
        if not total:
            self.size(path)  # FileNotFoundError when missing
            return
        try:
            reply = self._call(
                f"reading {path}",
                self._client.get_object,
                Key=self._key(path),
                Range=f"bytes={offset}-{offset + total - 1}",
            )
        except Exception as err:
            if error_code(err.__cause__ or err) == "InvalidRange":
                raise EOFError(f"{path}: file is shorter than expected (truncated)") from err
            raise
        body = reply["Body"]
        readinto = getattr(body, "readinto", None) or _copying_readinto(body)
        try:
            for i, view in enumerate(views):
                pos = 0
                while pos < len(view):
                    piece = view[pos : pos + min(_READ_PIECE, len(view) - pos)]
                    n = readinto(piece)
                    if not n:
                        raise EOFError(f"{path}: file is shorter than expected (truncated)")
                    if on_piece is not None:
                        on_piece(i, piece[:n])
                    pos += n
        except EOFError:
            raise
        except Exception as err:
            raise self._err(err, f"reading {path}") from err
        finally:
            body.close()

    def exists(self, path: str) -> bool:
        return self.kind(path) in ("file", "dir")

    def kind(self, path: str) -> str:
        """``file``, ``dir`` (a prefix with objects under it) or ``missing``."""
        if path:
            try:
                self._call(f"looking up {path}", self._client.head_object, Key=self._key(path))
                return "file"
            except FileNotFoundError:
                pass
        reply = self._call(
            f"listing {path or '/'}",
            self._client.list_objects_v2,
            Prefix=self._dir_prefix(path),
            MaxKeys=1,
        )
        return "dir" if reply.get("KeyCount", 0) else "missing"

    def rename(self, src: str, dst: str) -> None:
        """A file only (an object store moves no directory: NotImplementedError): a
        manifest is re-put conditionally, anything else copied on the server; then the
        source is deleted."""
        if self.kind(src) != "file":
            raise NotImplementedError(f"{self.url}: an object store cannot move {src!r}")
        if dst.rsplit("/", 1)[-1] == MANIFEST_NAME:
            self.write_atomic(dst, self.read(src))
        else:
            source = {"Bucket": self.bucket, "Key": self._key(src)}
            self._call(f"copying {src}", self._client.copy, CopySource=source, Key=self._key(dst))
        self.delete(src)

    def listdir(self, path: str) -> list[str]:
        prefix = self._dir_prefix(path)
        names: set[str] = set()
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Prefix": prefix, "Delimiter": "/"}
            if token:
                kw["ContinuationToken"] = token
            reply = self._call(f"listing {path or '/'}", self._client.list_objects_v2, **kw)
            for p in reply.get("CommonPrefixes", []):
                names.add(str(p["Prefix"])[len(prefix) :].rstrip("/"))
            for o in reply.get("Contents", []):
                names.add(str(o["Key"])[len(prefix) :])
            if not reply.get("IsTruncated"):
                return sorted(n for n in names if n)
            token = reply.get("NextContinuationToken")

    def size(self, path: str) -> int:
        reply = self._call(f"looking up {path}", self._client.head_object, Key=self._key(path))
        return int(reply["ContentLength"])

    def delete(self, path: str) -> None:
        self._call(f"deleting {path}", self._client.delete_object, Key=self._key(path))

    def delete_dir(self, path: str) -> None:
        """Nothing to do: a prefix vanishes with its last object."""
        self._key(path)  # still refuse a path that leaves the root

    def multipart_uploads(self) -> list[str]:
        """Keys under the root with a multipart upload in progress (none after a failed
        or aborted stream; tests and ``stalwart ckpt verify`` look)."""
        reply = self._call(
            "listing multipart uploads",
            self._client.list_multipart_uploads,
            Prefix=self._dir_prefix(""),
        )
        return sorted(str(u["Key"]) for u in reply.get("Uploads", []))
