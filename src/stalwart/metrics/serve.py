"""A small GET-only HTTP server for stalwart's endpoints: the job's Prometheus metrics
(metrics/prometheus.py) and each node's /healthz and /readyz (agent/health/endpoint.py).

Why one server for both: each must hold up against clients that open connections and
dribble or send nothing (a port scanner, a stuck scraper), or send megabytes of headers,
and must never flood the launcher's output with access logs; written once, both get it.
It binds loopback unless told otherwise (the design's rule: servers bind 127.0.0.1 by
default).

Bounds (docs/observability.md, "Endpoint limits"): at most ``MAX_ACTIVE`` connections
(a new one evicts the oldest); a request's line and headers together at most
``MAX_HEAD_BYTES`` (else ``431``, connection closed); the whole request received within
``REQUEST_DEADLINE_S`` of the connection's accept, however the bytes are spaced (else
``408``, connection closed); one request per connection (``Connection: close``). So the
server holds at most ``MAX_ACTIVE x MAX_HEAD_BYTES`` of requests, and no sender keeps a
connection longer than the deadline. Headers are never parsed: the endpoints need only
the method and the path.
"""

from __future__ import annotations

import contextlib
import http
import socket
import socketserver
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from stalwart.errors import ConfigError

__all__ = [
    "LISTEN_BACKLOG",
    "MAX_ACTIVE",
    "MAX_HEAD_BYTES",
    "REQUEST_DEADLINE_S",
    "Answer",
    "PathServer",
]

Answer = Callable[[str], tuple[int, str, bytes]]
"""``answer(path) -> (status, content type, body)`` for a GET of ``path`` (query kept)."""

MAX_ACTIVE = 16
"""Connections served at once; a new one evicts the oldest."""
MAX_HEAD_BYTES = 8192
"""Request line plus headers, in bytes (a kubelet probe or a Prometheus scrape sends ~200)."""
REQUEST_DEADLINE_S = 5.0
"""Time from accept to the end of the request's headers, in total (not per read)."""
LISTEN_BACKLOG = 128
"""Connections the kernel queues for accept (completed handshakes), not yet served."""


class _BoundedHTTPServer(socketserver.ThreadingTCPServer):
    """A threading TCP server that holds at most ``MAX_ACTIVE`` connections: a new one
    evicts the oldest, so clients that open connections and dribble (or send nothing)
    cannot keep a scraper or a probe out, nor pile up threads."""

    daemon_threads = True
    allow_reuse_address = True
    # the listen backlog: socketserver's default of 5 lets a flood of connections fill the
    # kernel's accept queue while the serving thread waits for the GIL, and a probe's SYN
    # is then dropped (retried only after 1 s: a kubelet probe's whole default timeout);
    # the kernel caps it at net.core.somaxconn
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self, address: tuple[str, int], handler: type[socketserver.BaseRequestHandler]
    ) -> None:
        super().__init__(address, handler)
        self._active: OrderedDict[Any, None] = OrderedDict()
        self._active_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._active_lock:
            if len(self._active) >= MAX_ACTIVE:
                oldest, _ = self._active.popitem(last=False)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._active[request] = None
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._active_lock:
            self._active.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (or a thread that could not start): nothing to do


class PathServer:
    """Serves ``answer`` from a background thread until :meth:`close`.

    ``what`` names the endpoint and ``flag`` the option that sets its port, for the
    one-line error when the port is taken."""

    def __init__(self, answer: Answer, host: str, port: int, *, what: str, flag: str) -> None:
        self.answer, self.host, self.port = answer, host, port
        self.what, self.flag = what, flag
        self._server: _BoundedHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> PathServer:
        answer = self.answer

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                _serve_one(self.request, answer)

        try:
            self._server = _BoundedHTTPServer((self.host, self.port), Handler)
        except OSError as err:
            raise ConfigError(
                f"cannot serve {self.what} on {self.host}:{self.port}: {err.strerror}; "
                f"pass a free {self.flag} (0 picks one)"
            ) from err
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"stalwart-{self.what}",
            daemon=True,
        )
        self._thread.start()
        return self

    @property
    def serving(self) -> bool:
        """Whether the serving thread runs (False once :meth:`close` joined it)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _head_end(head: bytes | bytearray) -> int | None:
    """Where the headers end (after the blank line), or None while they go on."""
    for mark in (b"\r\n\r\n", b"\n\n"):
        at = head.find(mark)
        if at >= 0:
            return at + len(mark)
    return None


def _read_head(sock: socket.socket) -> tuple[bytes | None, int]:
    """The request line and headers, or (None, the status to refuse with; 0: none)."""
    deadline = time.monotonic() + REQUEST_DEADLINE_S
    head = bytearray()
    while True:
        end = _head_end(head)
        if end is not None:
            return (bytes(head[:end]), 200) if end <= MAX_HEAD_BYTES else (None, 431)
        if len(head) >= MAX_HEAD_BYTES:
            return None, 431
        left = deadline - time.monotonic()
        if left <= 0:
            return None, 408
        sock.settimeout(left)
        try:
            data = sock.recv(MAX_HEAD_BYTES + 4 - len(head))
        except TimeoutError:
            return None, 408
        if not data:
            return None, 0  # the client went away
        head += data


def _serve_one(sock: socket.socket, answer: Answer) -> None:
    """Read one bounded request from ``sock``, answer it, and let the server close it."""
    try:
        head, status = _read_head(sock)
        if head is None:
            if status:
                _send(sock, status, "text/plain; charset=utf-8", b"")
            return
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            _send(sock, 400, "text/plain; charset=utf-8", b"bad request line\n")
            return
        if parts[0] not in (b"GET", b"HEAD"):
            _send(sock, 405, "text/plain; charset=utf-8", b"GET only\n")
            return
        code, content_type, body = answer(parts[1].decode("latin-1"))
        _send(sock, code, content_type, b"" if parts[0] == b"HEAD" else body, len(body))
    except OSError:
        pass  # the client went away or was evicted


def _send(
    sock: socket.socket, code: int, content_type: str, body: bytes, length: int | None = None
) -> None:
    try:
        reason = http.HTTPStatus(code).phrase
    except ValueError:
        reason = "Status"
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    sock.settimeout(REQUEST_DEADLINE_S)
    sock.sendall(head + body)
