"""A real etcd server for tests: free loopback ports, a private data dir, reaped after.

``require_etcd()`` skips a test when the ``etcd`` binary is absent locally, and
fails it instead when ``CI`` is set (CI installs Debian's ``etcd-server``), so
the etcd backend can never silently go untested in CI.

Timing flags: a 25 ms heartbeat and 250 ms election timeout make etcd's minimum
lease TTL 1 s (it is ``ceil(1.5 * election timeout)`` seconds) and its first
election quick; they are for one loopback member, not for a real cluster.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "EtcdServer",
    "ServerTls",
    "etcd_binary",
    "free_port",
    "require_etcd",
    "running_etcd",
    "running_etcd_cluster",
]

_INSTALL_HINT = (
    "install Debian's etcd-server (apt-get install -y --no-install-recommends etcd-server) "
    "or put an etcd >= 3.4 binary on PATH"
)


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def require_etcd() -> str:
    """The etcd binary's path; skip (locally) or fail (CI) when it is missing."""
    path = etcd_binary()
    if path is None:
        reason = f"etcd server binary not found on PATH; {_INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the etcd tests: {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports. The probe sockets are held open together:
    probing one at a time can hand the same port out twice (a 3-member cluster once got
    two members on one client port; one of them died on bind and the cluster had no
    spare member)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


@dataclass(frozen=True)
class ServerTls:
    """etcd's TLS files (server cert/key, the CA that signs its clients) and a client
    certificate of that CA (no CommonName: docs/etcd.md) for health checks and setup."""

    cert: str
    key: str
    ca: str
    client_cert: str
    client_key: str
    token_ttl: int = 300  # --auth-token-ttl: etcd's simple auth tokens expire after it

    def client_context(self) -> ssl.SSLContext:
        """One context per set of files, reused: loading them costs milliseconds of CPU,
        and the health check asks for one every 20 ms while etcd starts (issue 26)."""
        return _client_context(self)


@functools.lru_cache(maxsize=64)
def _client_context(tls: ServerTls) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=tls.ca)
    ctx.load_cert_chain(tls.client_cert, tls.client_key)
    return ctx


class EtcdServer:
    """One etcd process on 127.0.0.1; :meth:`kill` and :meth:`start` again reuse the
    same ports and data dir, as a restarted etcd member would."""

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        name: str = "default",
        ports: tuple[int, int] | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.tls = tls
        self.binary = binary
        self.data_dir = data_dir
        self.name = name
        self.client_port, self.peer_port = ports if ports is not None else free_ports(2)
        self.initial_cluster = f"{name}={self.peer_url}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"etcd-{name}.log"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0, *, wait: bool = True) -> None:
        assert self.proc is None, "etcd already running"
        peer = self.peer_url
        args = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.initial_cluster}",
            "--heartbeat-interval=25",
            "--election-timeout=250",
            "--log-level=warn",
        ]
        if self.tls is not None:
            args += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
                f"--auth-token-ttl={self.tls.token_ttl}",
                # the least bcrypt work per password (10 by default): a test server's
                # users are made per test and log in per client (issue 26)
                "--bcrypt-cost=4",
            ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        if wait:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 20.0) -> None:
        assert self.proc is not None, "etcd not started"
        deadline = time.monotonic() + timeout
        # Its own process must be alive too: a member that died on bind would otherwise
        # pass on the answer of whatever else listens on its port.
        while not (self._healthy() and self.proc.poll() is None):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"etcd exited with {code} at start; log: {self._log_tail()}")
            if time.monotonic() >= deadline:
                self.stop()
                raise RuntimeError(f"etcd not healthy within {timeout}s; log: {self._log_tail()}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server (by the PID this object started) and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def _healthy(self) -> bool:
        conn = (
            http.client.HTTPSConnection(
                "127.0.0.1", self.client_port, timeout=1.0, context=self.tls.client_context()
            )
            if self.tls is not None
            else http.client.HTTPConnection("127.0.0.1", self.client_port, timeout=1.0)
        )
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            return resp.status == 200 and b'"true"' in resp.read()
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def running_etcd(tls: ServerTls | None = None) -> Iterator[EtcdServer]:
    """Start a fresh etcd in a unique temporary directory; stop, reap and remove it after."""
    binary = require_etcd()
    with tempfile.TemporaryDirectory(prefix="stalwart-etcd-") as tmp:
        for attempt in range(3):  # a free port can be taken between probe and bind
            server = EtcdServer(binary, Path(tmp) / f"data{attempt}", tls=tls)
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def running_etcd_cluster(size: int = 3) -> Iterator[list[EtcdServer]]:
    """A ``size``-member etcd cluster on loopback (members start together: a member
    is healthy only once a quorum has elected a leader)."""
    binary = require_etcd()
    with tempfile.TemporaryDirectory(prefix="stalwart-etcd-") as tmp:
        ports = free_ports(2 * size)
        members = [
            EtcdServer(binary, Path(tmp) / f"m{i}", f"m{i}", (ports[2 * i], ports[2 * i + 1]))
            for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        try:
            for member in members:
                member.initial_cluster = initial
                member.start(wait=False)
            for member in members:
                member.wait_healthy()
            dead = [m.name for m in members if m.proc is None or m.proc.poll() is not None]
            assert not dead, f"etcd members {dead} exited during start-up"
            yield members
        finally:
            for member in members:
                member.stop()
