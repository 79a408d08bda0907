"""HTTP/1.1 transport to etcd's JSON gateway: pooled unary calls and streaming reads.

Unary calls (``/v3/kv/*``, ``/v3/lease/*``) go through :class:`GatewayClient`,
which keeps a few keep-alive connections and retries *every* failure that may
be transient (refused connection, reset, timeout, etcd's "no leader"/"leader
changed") until ``reconnect_timeout``, rotating over the endpoints. Retrying
blindly is only safe because every body sent through it is idempotent: reads,
keep-alives, grants with a client-chosen lease id, and writes wrapped in a
transaction guarded by a request marker (see :mod:`stalwart.coordinator.etcd`).

Watches are streamed responses (chunked JSON lines) that must be read with a
timeout and no helper thread, so :func:`send_stream_request` speaks HTTP on a raw
socket, :class:`StreamHead` reads the answer's head and :class:`ChunkedLines` decodes
the chunked body, each incrementally (a watch reads them across its ``get`` calls).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from stalwart.coordinator._etcd_security import (
    AuthSession,
    EtcdSecurity,
    fatal_tls_error,
    open_socket,
    speaks_tls,
    tls_problem,
)
from stalwart.coordinator._etcd_wire import EtcdApiError, error_from_body
from stalwart.coordinator.errors import (
    AuthenticationError,
    ProtocolError,
    StoreClosedError,
    StoreError,
    StoreUnavailableError,
)

__all__ = [
    "ChunkedLines",
    "Endpoint",
    "GatewayClient",
    "Reply",
    "StreamHead",
    "send_stream_request",
]

_MAX_HEADER = 64 << 10


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Reply:
    """A gateway answer: the JSON body, or the error it maps to. ``resent`` tells
    whether an earlier attempt of the same request may have reached etcd."""

    doc: dict[str, Any]
    error: StoreError | None
    resent: bool


class _Unavailable(Exception):
    """One attempt failed in a way worth retrying."""


class GatewayClient:
    """Pooled, retrying POSTs of JSON bodies to the gateway. Thread-safe."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        *,
        connect_timeout: float,
        request_timeout: float,
        reconnect_timeout: float,
        max_idle: int = 4,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.security = security or EtcdSecurity()
        self.ssl = self.security.ssl_context()
        self.auth = AuthSession(self.security)
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.reconnect_timeout = reconnect_timeout
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._current = 0
        self.closed = threading.Event()

    def post(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST and return the body; raise the mapped error on an etcd error."""
        reply = self.call(path, body, what)
        if reply.error is not None:
            raise reply.error
        return reply.doc

    def call(self, path: str, body: dict[str, Any], what: str) -> Reply:
        payload = json.dumps(body).encode()
        deadline: float | None = None
        backoff = 0.02
        resent = False
        while True:
            self.check_open()
            try:
                doc, error = self._attempt(path, payload, what)
                if error is not None and isinstance(error, EtcdApiError) and error.retryable:
                    raise _Unavailable(str(error))
                return Reply(doc, error, resent)
            except (OSError, http.client.HTTPException, _Unavailable) as exc:
                if fatal_tls_error(exc):
                    raise tls_problem(exc, self.describe()) from None
                self._plain_against_tls(exc)
                resent = True
                now = time.monotonic()
                deadline = now + self.reconnect_timeout if deadline is None else deadline
                if now >= deadline:
                    self.check_open()
                    raise StoreUnavailableError(
                        f"etcd at {self.describe()} unreachable for "
                        f"{self.reconnect_timeout:.1f}s during {what} ({_brief(exc)}); is etcd "
                        f"running and the address in --rdzv right?{self.tls_hint()}"
                    ) from None
                self.closed.wait(min(backoff, deadline - now))
                backoff = min(backoff * 2, 0.5)

    def _plain_against_tls(self, exc: BaseException) -> None:
        """A plain client hung up on at once: if the port speaks TLS, say so now rather
        than retrying until the deadline."""
        hung_up = isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError))
        if self.ssl is not None or not hung_up:
            return
        ep = self.endpoints[(self._current - 1) % len(self.endpoints)]  # rotated past it
        if speaks_tls(ep.host, ep.port, self.connect_timeout):
            raise AuthenticationError(
                f"etcd at {ep} serves TLS; use etcds://... with --rdzv-tls-ca (and the client "
                "certificate flags if etcd asks for one)"
            )

    def tls_hint(self) -> str:
        """What to check when a TLS connection keeps failing without a clear cause."""
        if not self.security.tls or self.security.cert_file:
            return ""
        return " (TLS: if etcd runs with --client-cert-auth, pass --rdzv-tls-cert/--rdzv-tls-key)"

    def stream_headers(self) -> dict[str, str]:
        """Headers for a streamed request (a watch): the auth token, if any."""
        return self.auth.headers(self._connection)

    def check_open(self) -> None:
        if self.closed.is_set():
            raise StoreClosedError("the etcd store is closed; create a new one")

    def describe(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def endpoint(self) -> Endpoint:
        with self._lock:
            return self.endpoints[self._current % len(self.endpoints)]

    def rotate(self) -> None:
        """Move to the next endpoint (after a connection failure)."""
        with self._lock:
            self._current += 1

    def close(self) -> None:
        self.closed.set()
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _attempt(
        self, path: str, payload: bytes, what: str
    ) -> tuple[dict[str, Any], StoreError | None]:
        headers = {"Content-Type": "application/json", **self.auth.headers(self._connection)}
        conn = self._acquire()
        try:
            conn.timeout = self.request_timeout
            if conn.sock is not None:
                conn.sock.settimeout(self.request_timeout)
            conn.request("POST", path, payload, headers)
            resp = conn.getresponse()
            data = resp.read()
        except BaseException:
            conn.close()
            self.rotate()
            raise
        try:
            doc = json.loads(data) if data else {}
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            conn.close()
            if resp.status >= 500:
                raise _Unavailable(f"HTTP {resp.status} from the gateway")
            _refused_outright(data, what)
            raise ProtocolError(
                f"{what}: etcd gateway sent HTTP {resp.status} with a non-JSON body; "
                "is this an etcd >= 3.4 client URL?"
            )
        self._release(conn)
        if resp.status == 200 and "error" not in doc:
            return doc, None
        if _grpc_code(doc) == 16 and "Authorization" in headers:  # expired auth token
            self.auth.expired(headers["Authorization"])
            raise _Unavailable("etcd auth token expired")
        return doc, error_from_body(doc, what)

    def _acquire(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connection()

    def _connection(self) -> http.client.HTTPConnection:
        """A new connected HTTP(S) connection to the current endpoint."""
        ep = self.endpoint()
        conn = http.client.HTTPConnection(ep.host, ep.port, timeout=self.connect_timeout)
        conn.sock = open_socket(ep.host, ep.port, self.connect_timeout, self.ssl)
        return conn

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self.closed.is_set() and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()


def _grpc_code(doc: dict[str, Any]) -> object:
    inner = doc.get("error")
    return inner.get("grpc_code") if isinstance(inner, dict) else doc.get("code")


def _refused_outright(data: bytes, what: str) -> None:
    """A plain-text refusal by etcd's gateway that no retry can change."""
    if b"HTTP request to an HTTPS server" in data:
        raise AuthenticationError(
            f"{what}: etcd serves TLS on this port; use etcds://... (and --rdzv-tls-ca)"
        )
    if b"CommonName of client" in data:
        raise AuthenticationError(
            f"{what}: with auth enabled, etcd 3.4's gateway refuses client certificates that "
            "carry a CommonName; issue stalwart's client certificate without a CN "
            "(docs/etcd.md) and authenticate with --rdzv-user"
        )


def _brief(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ChunkedLines:
    """Incremental decoder: HTTP/1.1 chunked body in, complete ``\\n``-ended lines out."""

    def __init__(self, max_line: int = 64 << 20) -> None:
        self._raw = b""
        self._body = b""
        self._data_left = 0  # bytes of the current chunk's data still to come
        self._crlf_left = 0  # bytes of the CRLF after a chunk's data still to skip
        self._max_line = max_line
        self.finished = False

    def feed(self, data: bytes) -> list[bytes]:
        self._raw += data
        while self._raw and not self.finished:
            if self._data_left:
                take = self._raw[: self._data_left]
                self._body += take
                self._raw = self._raw[len(take) :]
                self._data_left -= len(take)
            elif self._crlf_left:
                skip = min(self._crlf_left, len(self._raw))
                self._raw = self._raw[skip:]
                self._crlf_left -= skip
            else:
                head, sep, rest = self._raw.partition(b"\r\n")
                if not sep:
                    break
                try:
                    size = int(head.split(b";")[0], 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk header from etcd: {head[:40]!r}") from None
                self._raw = rest
                self.finished = size == 0
                self._data_left, self._crlf_left = size, 2
        *lines, self._body = self._body.split(b"\n")
        if len(self._body) > self._max_line:
            raise ProtocolError("etcd watch message exceeds the size limit")
        return [line for line in lines if line.strip()]


def send_stream_request(
    endpoint: Endpoint,
    path: str,
    body: dict[str, Any],
    timeout: float,
    ctx: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
) -> socket.socket:
    """Connect and POST ``body`` (the answer's head is read with :class:`StreamHead`):
    the socket, its timeout ``timeout``. Raises OSError."""
    payload = json.dumps(body).encode()
    sock = open_socket(endpoint.host, endpoint.port, timeout, ctx)
    try:
        sock.settimeout(timeout)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\n"
            f"{extra}Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        sock.sendall(head + payload)
        return sock
    except BaseException:
        close_socket(sock)
        raise


class StreamHead:
    """The head of a streamed answer, read incrementally: a watch whose stream etcd has
    not answered yet keeps waiting for it at its next read instead of opening another
    (a loaded etcd answered late; every abandoned open was more of its load)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> tuple[list[bytes], ChunkedLines] | None:
        """None until the head is complete; then the lines after it and their decoder.
        Raises ProtocolError for an answer that is not a chunked 200."""
        self._buf += data
        if b"\r\n\r\n" not in self._buf:
            if len(self._buf) > _MAX_HEADER:
                raise ProtocolError("etcd watch response head is too large")
            return None
        header, _, rest = self._buf.partition(b"\r\n\r\n")
        status_line, *fields = header.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or parts[1] != "200":
            raise ProtocolError(f"etcd watch request failed: {status_line!r}")
        chunked = any(
            f.lower().startswith("transfer-encoding:") and "chunked" in f.lower() for f in fields
        )
        if not chunked:
            raise ProtocolError("etcd watch response is not a chunked stream; etcd >= 3.4?")
        decoder = ChunkedLines()
        return decoder.feed(rest), decoder


def close_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
