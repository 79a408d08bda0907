"""A streamed S3 multipart upload with bounded memory.

Bytes written are copied into part buffers of ``part_bytes``; a full part is handed to a
small pool that uploads up to ``parallel_parts`` parts at once, and ``write`` blocks while
they are all busy. So a stream holds at most ``parallel_parts + 1`` buffers, whatever the
object's size (the caller may reuse its own buffer as soon as ``write`` returns). An object
smaller than one part is one ``PutObject`` at commit. Nothing is visible before
``CompleteMultipartUpload``; an upload that fails or is aborted is aborted on the store
(``AbortMultipartUpload``), so no orphan upload keeps its parts (and their cost) in the
bucket.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["MultipartStream"]


class MultipartStream:
    def __init__(
        self,
        client: Any,
        bucket: str,
        key: str,
        part_bytes: int,
        parallel_parts: int,
        translate: Callable[[BaseException, str], BaseException],
    ) -> None:
        self._client = client
        self._bucket = bucket
        self._key = key
        self._part_bytes = part_bytes
        self._translate = translate
        self._slots = threading.BoundedSemaphore(parallel_parts)
        self._free: list[bytearray] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._parallel = parallel_parts
        self._upload_id: str | None = None
        self._futures: list[Future[dict[str, Any]]] = []
        self._error: BaseException | None = None
        self._buf: bytearray | None = bytearray(part_bytes)
        self._used = 0
        self._closed = False
        self.buffers_allocated = 1
        """Part buffers this stream ever allocated (its memory is this x part_bytes)."""

    # -- writing -------------------------------------------------------------------------

    def write(self, data: memoryview | bytes) -> None:
        assert not self._closed and self._buf is not None, "stream already closed"
        view = memoryview(data).cast("B")
        while view:
            k = min(self._part_bytes - self._used, len(view))
            self._buf[self._used : self._used + k] = view[:k]
            self._used += k
            view = view[k:]
            if self._used == self._part_bytes:
                self._submit()

    def _take_buffer(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        self.buffers_allocated += 1
        return bytearray(self._part_bytes)

    def _submit(self) -> None:
        """Hand the full current buffer to the pool (blocking while every slot is busy)."""
        self._raise_failed()
        assert self._buf is not None
        if self._upload_id is None:
            self._upload_id = self._call(
                "starting a multipart upload",
                self._client.create_multipart_upload,
                Bucket=self._bucket,
                Key=self._key,
            )["UploadId"]
            self._pool = ThreadPoolExecutor(self._parallel, thread_name_prefix="stalwart-s3-part")
        self._slots.acquire()
        self._raise_failed()
        buf, used = self._buf, self._used
        number = len(self._futures) + 1
        assert self._pool is not None
        fut = self._pool.submit(self._upload_part, number, buf, used)
        self._futures.append(fut)
        self._buf = self._take_buffer()
        self._used = 0

    def _upload_part(self, number: int, buf: bytearray, used: int) -> dict[str, Any]:
        try:
            body = buf if used == len(buf) else bytes(memoryview(buf)[:used])
            reply = self._call(
                f"uploading part {number}",
                self._client.upload_part,
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
            )
            return {"PartNumber": number, "ETag": reply["ETag"]}
        except BaseException as err:
            if self._error is None:
                self._error = err
            raise
        finally:
            with self._lock:
                self._free.append(buf)
            self._slots.release()

    def _raise_failed(self) -> None:
        if self._error is not None:
            err = self._error
            self.abort()
            raise err

    def _call(self, what: str, fn: Callable[..., Any], **kw: Any) -> Any:
        try:
            return fn(**kw)
        except Exception as err:
            raise self._translate(err, what) from err

    # -- ending ----------------------------------------------------------------------------

    def commit(self) -> None:
        assert not self._closed and self._buf is not None, "stream already closed"
        try:
            if self._upload_id is None:  # smaller than one part: one put
                self._call(
                    "writing an object",
                    self._client.put_object,
                    Bucket=self._bucket,
                    Key=self._key,
                    Body=bytes(memoryview(self._buf)[: self._used]),
                )
            else:
                if self._used:
                    self._submit()
                parts = [f.result() for f in self._futures]
                self._call(
                    "completing a multipart upload",
                    self._client.complete_multipart_upload,
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
                self._upload_id = None
        except BaseException:
            self.abort()
            raise
        self._close()

    def abort(self) -> None:
        """Stop, wait for the parts in flight, and abort the upload on the store; never
        raises (an unreachable store keeps the upload until its lifecycle rule ends it)."""
        if self._closed:
            return
        self._closed = True
        for fut in self._futures:
            fut.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
                )
            self._upload_id = None
        self._close()

    def _close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buf = None
        self._free.clear()
