"""A small GET-only HTTP server for stalwart's endpoints: the job's Prometheus metrics
(metrics/prometheus.py) and each node's /healthz and /readyz (agent/healthz.py).

Why one server for both: each must hold up against clients that open connections and
dribble or send nothing (a port scanner, a stuck scraper), and must never flood the
launcher's output with access logs; written once, both get it. It binds loopback unless
told otherwise (the design's rule: servers bind 127.0.0.1 by default).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["Answer", "PathServer"]

Answer = Callable[[str], tuple[int, str, bytes]]
"""``answer(path) -> (status, content type, body)`` for a GET of ``path`` (query kept)."""

_MAX_ACTIVE = 16  # connections served at once; a new one evicts the oldest
_REQUEST_TIMEOUT_S = 10.0  # a client silent this long loses its connection


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that holds at most ``_MAX_ACTIVE`` connections: a new one
    evicts the oldest, so clients that open connections and dribble (or send nothing)
    cannot keep a scraper or a probe out, nor pile up threads."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._active: OrderedDict[Any, None] = OrderedDict()
        self._active_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._active_lock:
            if len(self._active) >= _MAX_ACTIVE:
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
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> PathServer:
        answer = self.answer

        class Handler(BaseHTTPRequestHandler):
            timeout = _REQUEST_TIMEOUT_S  # StreamRequestHandler sets it on the socket

            def do_GET(self) -> None:
                code, content_type, body = answer(self.path)
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a request every few seconds would flood the launcher's output

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
