"""How a client proves itself to etcd and checks etcd's identity: TLS and etcd auth.

:class:`EtcdSecurity` is the client side of etcd's security model: ``etcds://``
(``https`` on the client URL) with a CA bundle that signed etcd's certificate, an
optional client certificate and key (etcd's ``--client-cert-auth``), and an
optional etcd user whose password is read from a file or an environment variable
*named* in the URL (never the password itself: argv is visible to every user of
the host). It travels inside the rendezvous URL as query parameters
(docs/etcd.md, "TLS and authentication"), so every agent and every worker that
is handed the URL connects the same way.

:class:`AuthSession` owns the etcd auth token of one client: fetched with
``/v3/auth/authenticate`` on first use, sent as the ``Authorization`` header,
and fetched again when etcd says it expired.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import stat
import threading
from dataclasses import dataclass
from typing import Any

from stalwart.coordinator.errors import AuthenticationError
from stalwart.errors import ConfigError

__all__ = [
    "AuthSession",
    "EtcdSecurity",
    "fatal_tls_error",
    "open_socket",
    "speaks_tls",
    "tls_problem",
]

_MAX_PASSWORD_BYTES = 4096
_FLAGS = "--rdzv-user with --rdzv-password-file (or --rdzv-password-env)"


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS and credentials of an etcd client. Every field is a path or a name; no secret."""

    tls: bool = False
    """Speak HTTPS to etcd (``etcds://``); implied by any of the three files below."""
    ca_file: str = ""
    """PEM bundle of the CA that signed etcd's server certificate (default: the system's)."""
    cert_file: str = ""
    """PEM client certificate, for an etcd started with ``--client-cert-auth``."""
    key_file: str = ""
    """PEM private key of ``cert_file``."""
    user: str = ""
    """etcd user (``etcdctl user add``) whose role grants the job's key prefix."""
    password_file: str = ""
    """File holding ``user``'s password (one line; mode 0600 or 0400)."""
    password_env: str = ""
    """Name of an environment variable holding ``user``'s password."""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("an etcd client certificate needs both cert= and key= (PEM files)")
        if (self.password_file or self.password_env) and not self.user:
            raise ConfigError(f"an etcd password needs a user: pass {_FLAGS}")
        if self.user and not (self.password_file or self.password_env):
            raise ConfigError(
                f"etcd user {self.user!r} has no password source: pass --rdzv-password-file "
                "FILE or --rdzv-password-env NAME (never the password itself)"
            )
        if self.password_file and self.password_env:
            raise ConfigError("pass one of --rdzv-password-file and --rdzv-password-env")
        if self.ca_file or self.cert_file:
            object.__setattr__(self, "tls", True)

    @property
    def authenticated(self) -> bool:
        """Whether this client presents credentials (an etcd user or a client certificate)."""
        return bool(self.user or self.cert_file)

    def anonymous(self) -> EtcdSecurity:
        """The same transport without credentials (to check what strangers can read)."""
        return EtcdSecurity(tls=self.tls, ca_file=self.ca_file)

    def query(self) -> dict[str, str]:
        """The URL query parameters that carry this configuration (docs/etcd.md)."""
        pairs = {
            "ca": self.ca_file,
            "cert": self.cert_file,
            "key": self.key_file,
            "user": self.user,
            "password-file": self.password_file,
            "password-env": self.password_env,
        }
        return {k: v for k, v in pairs.items() if v}

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context (None for plain HTTP); ConfigError on unreadable files."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file or None)
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            what = f"{self.ca_file or 'system CAs'}, {self.cert_file}, {self.key_file}"
            raise ConfigError(
                f"etcd TLS files ({what}) unusable: {exc}; pass PEM files to "
                "--rdzv-tls-ca/--rdzv-tls-cert/--rdzv-tls-key"
            ) from None
        return ctx

    def password(self) -> str:
        """``user``'s password from its file or environment variable."""
        if self.password_env:
            value = os.environ.get(self.password_env)
            if not value:
                raise ConfigError(
                    f"etcd password variable {self.password_env} is unset or empty; export it "
                    "or pass --rdzv-password-file"
                )
            return value
        return _read_password_file(self.password_file)


def _read_password_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"etcd password file {path}: {exc.strerror}; check the path") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"etcd password file {path} is not a regular file")
        if st.st_mode & stat.S_IRWXO:
            raise ConfigError(
                f"etcd password file {path} is readable by every user "
                f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}"
            )
        raw = os.read(fd, _MAX_PASSWORD_BYTES + 1)
    finally:
        os.close(fd)
    text = raw.decode("utf-8", "replace").strip("\r\n")
    if not text or len(raw) > _MAX_PASSWORD_BYTES:
        raise ConfigError(f"etcd password file {path} must hold one line of 1-4096 bytes")
    return text


def fatal_tls_error(exc: BaseException) -> bool:
    """A TLS failure that retrying cannot fix (a wrong CA, a refused certificate,
    TLS against a plain port); an EOF mid-handshake may be a restart and is retried."""
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return False
    return isinstance(exc, ssl.SSLError)


def tls_problem(exc: BaseException, where: str) -> AuthenticationError:
    """One line naming what went wrong in the TLS handshake and the flag that fixes it."""
    text = str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        fix = (
            "etcd's certificate is not signed by the CA given (or names another host); pass "
            "the CA that signed it with --rdzv-tls-ca and use a host name or IP in its SAN"
        )
    elif "WRONG_VERSION_NUMBER" in text or "wrong version" in text:
        fix = "etcd does not speak TLS on this port; use etcd:// (or enable TLS on etcd)"
    elif "CERTIFICATE" in text.upper():
        fix = (
            "etcd refused this client's certificate (or its absence); pass a certificate "
            "signed by etcd's --trusted-ca-file with --rdzv-tls-cert/--rdzv-tls-key"
        )
    else:
        fix = "check --rdzv-tls-ca/--rdzv-tls-cert/--rdzv-tls-key against etcd's TLS flags"
    return AuthenticationError(f"TLS to etcd at {where} failed ({text}): {fix}")


def open_socket(host: str, port: int, timeout: float, ctx: ssl.SSLContext | None) -> socket.socket:
    """A connected socket to etcd, TLS-wrapped (handshake done) when ``ctx`` is set."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx is None:
            return sock
        return ctx.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake (certificate not checked): tells
    a plain-HTTP client why an etcd that serves TLS hangs up on it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        open_socket(host, port, timeout, ctx).close()
    except (OSError, ValueError):
        return False
    return True


class AuthSession:
    """One client's etcd auth token (none without a user). Thread-safe."""

    def __init__(self, security: EtcdSecurity) -> None:
        self.security = security
        self._lock = threading.Lock()
        self._token = ""

    def headers(self, conn_factory: Any) -> dict[str, str]:
        """``Authorization`` for the next request (authenticating first if needed);
        ``conn_factory()`` opens an ``http.client`` connection to an endpoint."""
        if not self.security.user:
            return {}
        with self._lock:
            if not self._token:
                self._token = self._authenticate(conn_factory)
            return {"Authorization": self._token}

    def expired(self, token: str) -> None:
        """etcd said ``token`` is invalid (expired): the next request fetches a new one."""
        with self._lock:
            if self._token == token:
                self._token = ""

    def current(self) -> str:
        with self._lock:
            return self._token

    def _authenticate(self, conn_factory: Any) -> str:
        body = json.dumps({"name": self.security.user, "password": self.security.password()})
        conn: http.client.HTTPConnection = conn_factory()
        try:
            conn.request(
                "POST", "/v3/auth/authenticate", body, {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        token = doc.get("token") if isinstance(doc, dict) else None
        if resp.status == 200 and isinstance(token, str) and token:
            return token
        message = doc.get("message") if isinstance(doc, dict) else raw[:200].decode("latin-1")
        if "authentication is not enabled" in str(message):
            raise AuthenticationError(
                "etcd has authentication disabled, so any client reads the job's keys: enable "
                "it (etcdctl auth enable, docs/etcd.md) or drop --rdzv-user"
            )
        raise AuthenticationError(
            f"etcd refused user {self.security.user!r} ({message}); check the user and the "
            "password in --rdzv-password-file/--rdzv-password-env"
        )
