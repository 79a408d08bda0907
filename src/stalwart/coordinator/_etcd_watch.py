"""A :class:`~stalwart.coordinator.store.Watch` over etcd's streaming ``/v3/watch``.

The stream is read on the caller's thread inside :meth:`EtcdWatch.get` (``select``
with the caller's timeout), so a watch owns a socket but no thread. When the
stream breaks (etcd restarted, leader changed, network blip) it is reopened from
the revision after the last event delivered, so no event is lost or repeated;
if etcd stays away longer than ``reconnect_timeout`` the next ``get`` raises
:class:`StoreUnavailableError`, and if the history was compacted meanwhile it
raises :class:`CompactedError`, exactly as for a fresh watch.
"""

from __future__ import annotations

import json
import math
import select
import socket
import ssl
import threading
import time
from types import TracebackType

from stalwart.coordinator._etcd_http import (
    ChunkedLines,
    GatewayClient,
    StreamHead,
    close_socket,
    send_stream_request,
)
from stalwart.coordinator._etcd_security import fatal_tls_error, tls_problem
from stalwart.coordinator._etcd_wire import b64, event_from_json, int_field, prefix_end
from stalwart.coordinator.errors import (
    AuthenticationError,
    CompactedError,
    ProtocolError,
    StoreClosedError,
    StoreUnavailableError,
)
from stalwart.coordinator.store import Event

__all__ = ["EtcdWatch"]

_MAX_WAIT = 5.0  # longest single select; a closed watch is noticed at least this often


def _readable(sock: socket.socket, wait: float) -> bool:
    """Whether ``sock`` has bytes (or EOF) within ``wait`` seconds. ``poll``, not
    ``select``: select() refuses descriptors from 1,024 up, which a process holding many
    watches (or many files) reaches, and every watch past it failed to open."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(wait * 1000))))


class EtcdWatch:
    """Events under one namespaced key prefix, from ``start`` on, in revision order."""

    def __init__(self, http: GatewayClient, key: bytes, strip: int, start: int) -> None:
        self._http = http
        self._key = key
        self._strip = strip
        self._next = start
        self._sock: socket.socket | None = None
        self._decoder = ChunkedLines()
        self._head: StreamHead | None = None  # an open sent, its answer's head not read yet
        self._head_by = 0.0  # when that answer is late enough to count as a failed open
        self._pending: list[Event] = []
        self._down_since: float | None = None
        self._backoff = 0.02
        self._lock = threading.Lock()  # one reader at a time
        self._closed = False

    @property
    def next_revision(self) -> int:
        """The revision the next delivered event will have at least."""
        return self._next

    def get(self, timeout: float | None = None) -> list[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._closed:
                    raise StoreClosedError("this watch is closed; open a new one")
                if self._pending:
                    out, self._pending = self._pending, []
                    return out
                remaining = _MAX_WAIT if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return []
                if self._sock is None:
                    self._reconnect(min(remaining, _MAX_WAIT))
                else:
                    self._read(min(remaining, _MAX_WAIT))

    def close(self) -> None:
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            close_socket(sock)  # wakes a reader blocked in select

    def __enter__(self) -> EtcdWatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- stream handling --------------------------------------------------

    def _reconnect(self, budget: float) -> None:
        self._http.check_open()
        endpoint = self._http.endpoint()
        request = {
            "create_request": {
                "key": b64(self._key),
                "range_end": b64(prefix_end(self._key)),
                "start_revision": str(self._next),
            }
        }
        try:
            timeout = min(self._http.connect_timeout, max(budget, 0.05))
            headers = self._http.stream_headers()
            sock = send_stream_request(
                endpoint, "/v3/watch", request, timeout, self._http.ssl, headers
            )
        except (OSError, ProtocolError) as exc:
            self._open_failed(exc, budget)
            return
        if self._closed:
            close_socket(sock)
            return
        # the answer is read by _read, at this call or the next ones: an open etcd answers
        # late (loaded) is waited for, not abandoned at the caller's timeout for another
        self._sock, self._head = sock, StreamHead()
        self._head_by = time.monotonic() + self._http.request_timeout

    def _open_failed(self, exc: Exception, budget: float) -> None:
        if fatal_tls_error(exc):
            raise tls_problem(exc, self._http.describe()) from None
        self._http.rotate()
        now = time.monotonic()
        self._down_since = now if self._down_since is None else self._down_since
        if now - self._down_since >= self._http.reconnect_timeout:
            raise StoreUnavailableError(
                f"etcd at {self._http.describe()} unreachable for "
                f"{self._http.reconnect_timeout:.1f}s while watching ({exc}); is etcd "
                "running and the address right?"
            ) from None
        self._http.closed.wait(min(self._backoff, budget))
        self._backoff = min(self._backoff * 2, 0.5)

    def _read(self, wait: float) -> None:
        sock = self._sock
        assert sock is not None
        if self._head is not None and time.monotonic() >= self._head_by:
            self._sock, self._head = None, None
            close_socket(sock)
            self._open_failed(TimeoutError("etcd did not answer the watch request"), wait)
            return
        try:
            # TLS may hold decrypted bytes that select() cannot see
            buffered = isinstance(sock, ssl.SSLSocket) and sock.pending() > 0
            if not buffered and not _readable(sock, wait):
                return
            data = sock.recv(1 << 16)
        except (OSError, ValueError):  # ValueError: closed by another thread
            data = b""
        if self._head is not None:  # the open's answer: its head first
            self._answered(sock, data, wait)
            return
        if not data:
            self._drop()
            return
        self._handle(self._decoder.feed(data))
        if self._decoder.finished:
            self._drop()

    def _answered(self, sock: socket.socket, data: bytes, wait: float) -> None:
        assert self._head is not None
        try:
            if not data:
                raise ConnectionResetError("etcd closed the watch stream before answering")
            got = self._head.feed(data)
        except (OSError, ProtocolError) as exc:
            self._sock, self._head = None, None
            close_socket(sock)
            self._open_failed(exc, wait)
            return
        if got is None:
            return
        lines, self._decoder = got
        self._head = None
        self._down_since, self._backoff = None, 0.02
        self._handle(lines)

    def _drop(self) -> None:
        sock, self._sock, self._head = self._sock, None, None
        if sock is not None:
            close_socket(sock)
        if self._down_since is None:
            self._down_since = time.monotonic()

    def _handle(self, lines: list[bytes]) -> None:
        for line in lines:
            try:
                doc = json.loads(line)
            except ValueError:
                raise ProtocolError(f"etcd sent a bad watch message: {line[:80]!r}") from None
            result = doc.get("result") if isinstance(doc, dict) else None
            if not isinstance(result, dict):
                self._drop()  # a stream error (e.g. etcd shutting down): reopen
                return
            if result.get("canceled"):
                compacted = int_field(result, "compact_revision")
                if compacted:
                    self.close()
                    raise CompactedError(
                        f"watch from revision {self._next}: etcd compacted its history up to "
                        f"revision {compacted}; re-read the keys and watch from the current "
                        "revision"
                    )
                reason = str(result.get("cancel_reason") or "")
                if "PermissionDenied" in reason:
                    self.close()
                    raise AuthenticationError(
                        f"etcd denied a watch on the job's keys ({reason[:200]}); grant the "
                        "etcd user's role readwrite on the job's prefix (docs/etcd.md)"
                    )
                if "Unauthenticated" in reason:  # the auth token expired: fetch a new one
                    self._http.auth.expired(self._http.auth.current())
                self._drop()
                return
            for raw in result.get("events") or []:
                event = event_from_json(raw, self._strip)
                if event.kv.mod_revision >= self._next:
                    self._pending.append(event)
            if self._pending:
                self._next = self._pending[-1].kv.mod_revision + 1
