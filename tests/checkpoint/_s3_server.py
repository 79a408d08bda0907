"""A real S3 server for tests: moto's standalone server (``moto[server]``, as s3fs's own
tests use) on a free loopback port, reaped after; and :class:`FaultProxy`, a loopback HTTP
proxy in front of it that answers chosen requests with 503 ``SlowDown`` / 500 or delays
them (moto cannot inject faults itself).

``require_moto()`` skips a test when moto's server is not installed locally, and fails it
when ``CI`` is set (``make setup`` installs it: the ``test`` extra), so the S3 backend can
never silently go untested in CI.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _load import scaled

__all__ = [
    "FaultProxy",
    "MotoServer",
    "client",
    "new_bucket",
    "require_moto",
    "running_moto",
    "s3_env",
    "server_of",
]

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Any key works against moto; set so that boto3's chain never looks beyond the test."""


def require_moto() -> None:
    missing = [m for m in ("moto", "boto3", "flask") if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"moto's S3 server needs {missing}: pip install 'moto[server]' boto3"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the S3 tests: {reason}", pytrace=False)
        pytest.skip(reason)


@contextlib.contextmanager
def s3_env(endpoint: str) -> Iterator[None]:
    """Credentials and endpoint in the environment (boto3's chain; inherited by a job)."""
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    os.environ.update(CREDENTIALS)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """One ``moto.server`` process on 127.0.0.1; killed (SIGKILL, by its PID) and reaped."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        assert self.proc is None, "moto already running"
        env = {**os.environ, **CREDENTIALS}
        args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + scaled(timeout)
        while not self._up():
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise RuntimeError(f"moto exited with {code} at start: {self._log_tail()}")
            if time.monotonic() >= deadline:
                self.kill()
                raise RuntimeError(f"moto not up within {timeout}s: {self._log_tail()}")
            time.sleep(0.05)

    def _up(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2.0)
        try:
            conn.request("GET", "/moto-api/")
            return conn.getresponse().status < 500
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


def client(endpoint: str) -> Any:
    """A plain boto3 client of ``endpoint`` with the test credentials."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    ).client("s3", endpoint_url=endpoint)


def new_bucket(endpoint: str) -> str:
    """A fresh, empty bucket's name."""
    name = f"ck-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name


def server_of(request: pytest.FixtureRequest) -> MotoServer:
    """The session's moto server (the ``moto`` fixture, started on first use)."""
    server = request.getfixturevalue("moto")
    assert isinstance(server, MotoServer)
    return server


@contextlib.contextmanager
def running_moto() -> Iterator[MotoServer]:
    require_moto()
    with tempfile.TemporaryDirectory(prefix="stalwart-moto-") as tmp:
        server = None
        for attempt in range(3):  # a free port can be taken between probe and bind
            server = MotoServer(Path(tmp) / f"moto{attempt}.log")
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        assert server is not None
        try:
            yield server
        finally:
            server.kill()


def _error(code: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{code} (injected by the test proxy)</Message></Error>"
    ).encode()


class FaultProxy:
    """Forwards HTTP requests to ``upstream`` (a loopback port), except that:
    the next ``slowdown`` requests get 503 SlowDown; a request for which ``fail(method,
    path)`` returns ``(status, code)`` gets that S3 error (500 InternalError, 403
    InvalidAccessKeyId); every request waits ``delay_s`` first (a slow
    server). ``seen`` counts requests by ``METHOD query-kind`` (``PUT part``)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.slowdown = 0
        self.fail: Callable[[str, str], tuple[int, str] | None] | None = None
        self.delay_s = 0.0
        self.lock = threading.Lock()
        self.seen: dict[str, int] = {}
        self.answered: dict[int, int] = {}
        self.changed = threading.Condition(self.lock)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                status, payload, headers = proxy._answer(self.command, self.path, body, self)
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answer(
        self, method: str, path: str, body: bytes, req: http.server.BaseHTTPRequestHandler
    ) -> tuple[int, bytes, list[tuple[str, str]]]:
        kind = "part" if "partNumber=" in path else "uploads" if "uploads" in path else "obj"
        with self.lock:
            key = f"{method} {kind}"
            self.seen[key] = self.seen.get(key, 0) + 1
            throttle = self.slowdown > 0
            if throttle:
                self.slowdown -= 1
            self.changed.notify_all()
        if self.delay_s:
            time.sleep(self.delay_s)
        fault = (503, "SlowDown") if throttle else None
        if fault is None and self.fail is not None:
            fault = self.fail(method, path)
        if fault is not None:
            status, payload = fault[0], _error(fault[1])
            headers = [("Content-Type", "application/xml")]
        else:
            status, payload, headers = self._forward(method, path, body, req)
        with self.lock:
            self.answered[status] = self.answered.get(status, 0) + 1
        return status, payload, headers

    def _forward(
        self, method: str, path: str, body: bytes, req: http.server.BaseHTTPRequestHandler
    ) -> tuple[int, bytes, list[tuple[str, str]]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() != "expect"}
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read(), list(resp.getheaders())
        except OSError:
            return 502, b"", []
        finally:
            conn.close()

    def wait_for(self, key: str, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + scaled(timeout)
        with self.changed:
            while self.seen.get(key, 0) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{count} x {key} not seen within {timeout}s: {self.seen}")
                self.changed.wait(left)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)
