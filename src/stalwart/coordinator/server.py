"""``StoreServer``: the embedded coordinator store, served over TCP.

Hosted by the node-rank-0 agent (as torchrun hosts its c10d store), it serves a
:class:`MemoryStore` to :class:`StoreClient` instances with one thread per
connection for its socket (a long-poll watch simply blocks its thread); the short
requests themselves run in order on one executor thread (_executor.py), so hundreds
of connection threads never queue on the store's lock. Every frame is size-bounded and authenticated
(see docs/wire-protocol.md); a bad frame gets an error reply and costs at most its
own connection, never the server. Connections that have not yet proved the token
are held apart, in a small pool with a deadline for the whole handshake
(:mod:`stalwart.coordinator.admission`), so nobody without the token can keep a
member out.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from stalwart.coordinator import wire
from stalwart.coordinator._executor import StoreExecutor
from stalwart.coordinator._ops import HANDLERS, WAIT_SLICE, Handler, OpContext
from stalwart.coordinator.admission import LISTEN_BACKLOG, Admission, accept_loop
from stalwart.coordinator.errors import (
    FrameTooLargeError,
    ProtocolError,
    StoreClosedError,
)
from stalwart.coordinator.memory import MemoryStore
from stalwart.errors import ConfigError
from stalwart.logs import get_logger

__all__ = ["StoreServer", "StoreServerConfig"]

_log = get_logger(__name__)
# Ops a retried request must not apply twice (their request id remembered). Not a
# keepalive: renewing twice is renewing once, and at N nodes keepalives are most of the
# steady requests (no remembered reply, no event per renewal).
_MUTATING = frozenset({"put", "delete", "txn", "grant", "revoke"})
_WATCH = HANDLERS["watch"]


@dataclass(frozen=True)
class StoreServerConfig:
    """Limits and address of a :class:`StoreServer`. Loopback unless told otherwise."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port; read it back from StoreServer.port
    max_frame_bytes: int = 4 << 20
    max_key_bytes: int = 4096
    max_value_bytes: int = 1536 << 10  # etcd's default request limit
    max_connections: int = 512
    """Authenticated connections held at once (every agent's and worker's pool)."""
    max_unauthenticated: int = 64
    """Connections not yet authenticated, held apart from ``max_connections``: a new one
    over the cap evicts the oldest, so a flood of them cannot keep a member out."""
    max_unauthenticated_per_peer: int = 32
    """Unauthenticated connections from one address: one host's flood evicts its own
    oldest connections, never another host's handshakes."""
    handshake_timeout: float = 5.0
    """The whole handshake (hello sent to auth frame received) must end within this."""
    frame_timeout: float = 10.0
    """A started frame must arrive in full within this (a deadline, not per ``recv``)."""
    idle_timeout: float = 600.0  # an idle connection is closed; clients reconnect
    max_watch_wait: float = 30.0  # longest a single watch long-poll blocks
    dedup_entries: int = 10_000  # remembered request ids (exactly-once retries)
    history: int = 10_000  # watch history kept by the store

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"store server port must be 0-65535, got {self.port}")
        for name in (
            "max_frame_bytes",
            "max_key_bytes",
            "max_value_bytes",
            "max_connections",
            "max_unauthenticated",
            "max_unauthenticated_per_peer",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"StoreServerConfig.{name} must be >= 1")
        for name in ("handshake_timeout", "frame_timeout", "idle_timeout", "max_watch_wait"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"StoreServerConfig.{name} must be > 0 seconds")
        if self.max_value_bytes + self.max_key_bytes > self.max_frame_bytes // 2:
            raise ConfigError(
                "StoreServerConfig.max_frame_bytes must be at least twice "
                "max_value_bytes + max_key_bytes (base64 and JSON overhead)"
            )


class _Pending:
    """A mutating request being (or already) executed, keyed by its request id."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: dict[str, Any] = {}


class StoreServer:
    """Serve a :class:`MemoryStore` over authenticated TCP. Use as a context manager.

    ``token`` is the job token (see :func:`read_token_file`); pass ``store`` to
    serve an existing store, else the server owns a fresh one.
    """

    def __init__(
        self,
        token: bytes,
        config: StoreServerConfig | None = None,
        *,
        store: MemoryStore | None = None,
    ) -> None:
        if len(token) < 16:
            raise ConfigError("the job token must be at least 16 bytes; use create_token_file()")
        self._token = bytes(token)
        self.config = config or StoreServerConfig()
        self._owns_store = store is None
        self.store = store if store is not None else MemoryStore(history=self.config.history)
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._admission = Admission(
            self.config.max_connections,
            self.config.max_unauthenticated,
            self.config.max_unauthenticated_per_peer,
        )
        self._accept_thread: threading.Thread | None = None
        cfg = self.config
        self._ctx = OpContext(
            self.store,
            cfg.max_frame_bytes,
            cfg.max_key_bytes,
            cfg.max_value_bytes,
            cfg.max_watch_wait,
            self._stopping,
        )
        self._dedup: OrderedDict[str, _Pending] = OrderedDict()
        self._exec: StoreExecutor | None = None  # short requests' one thread (start())
        self._stats = {"requests": 0, "rejected": 0, "auth_failures": 0}

    # -- lifecycle ------------------------------------------------------

    def start(self) -> StoreServer:
        """Bind and start accepting connections (returns self)."""
        if self._listener is not None:
            raise RuntimeError("StoreServer already started")
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((cfg.host, cfg.port))
        except OSError as exc:
            listener.close()
            raise ConfigError(
                f"store server cannot bind {cfg.host}:{cfg.port}: {exc.strerror}; "
                "pick another port (0 = any free one)"
            ) from None
        listener.listen(LISTEN_BACKLOG)
        listener.settimeout(WAIT_SLICE)
        self._listener = listener
        self._exec = StoreExecutor()
        self._accept_thread = threading.Thread(
            target=accept_loop,
            args=(listener, self._admission, self._serve, self._stopping.is_set, "store", _log),
            name="stalwart-store-accept",
            daemon=True,
        )
        self._accept_thread.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on."""
        if self._listener is None:
            raise RuntimeError("StoreServer not started")
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def stats(self) -> dict[str, int]:
        """Counters: connections accepted, unauthenticated ones evicted, authenticated ones
        refused (over ``max_connections``), requests served, frames rejected, auth
        failures; and the connections held now (``unauthenticated``, ``authenticated``)."""
        admission = self._admission.stats
        pending, authed = self._admission.counts()
        with self._lock:
            return {
                "connections": admission["accepted"],
                "evicted": admission["evicted"],
                "refused": admission["refused"],
                **self._stats,
                "unauthenticated": pending,
                "authenticated": authed,
            }

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and join every thread the server started."""
        self._stopping.set()
        self.store.wake_waiters()  # every long-poll sees the stop now (_ops.py _op_watch)
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes a blocked accept() at once on Linux
                self._listener.shutdown(socket.SHUT_RDWR)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        if self._listener is not None:
            self._listener.close()
        self._admission.close_all(timeout)
        if self._exec is not None:
            self._exec.close(timeout)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> StoreServer:
        return self.start() if self._listener is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- connections ----------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def _reject(
        self, conn: socket.socket, code: str, message: str, key: bytes = b"", seq: int = 0
    ) -> None:
        body = wire.encode({"ok": False, "error": {"code": code, "message": message}})
        mac = wire.frame_mac(key, b"S", seq, body) if key else wire.ZERO_MAC
        try:
            conn.settimeout(1.0)
            wire.send_frame(conn, mac, body)
        except OSError:
            pass

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        cfg = self.config
        key = b""
        wseq = 0
        try:
            if self._admission.authenticated_full():
                _log.warning("store: refusing %s: %d connections open", peer, cfg.max_connections)
                self._reject(conn, "too_many_connections", "server connection limit reached")
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = self._handshake(conn, peer)
            if not self._admission.promote(conn):
                _log.warning("store: refusing %s: %d connections open", peer, cfg.max_connections)
                self._reject(conn, "too_many_connections", "server connection limit reached")
                return
            rseq = 0
            while not self._stopping.is_set():
                conn.settimeout(cfg.idle_timeout)
                mac, body = wire.recv_frame(conn, cfg.max_frame_bytes, cfg.frame_timeout)
                if not wire.mac_ok(wire.frame_mac(key, b"C", rseq, body), mac):
                    self._count("auth_failures")
                    _log.warning("store: bad frame MAC from %s; closing the connection", peer)
                    self._reject(conn, "auth_failed", "frame MAC mismatch", key, wseq)
                    return
                rseq += 1
                reply = wire.encode(self._handle(body, peer))
                wire.send_frame(conn, wire.frame_mac(key, b"S", wseq, reply), reply)
                wseq += 1
        except _HandshakeFailed:
            return
        except FrameTooLargeError as exc:
            self._count("rejected")
            self._warn(bool(key), "store: %s from %s; closing the connection", exc, peer)
            self._reject(conn, "too_large", str(exc), key, wseq)
        except ProtocolError as exc:
            self._count("rejected")
            self._warn(bool(key), "store: %s from %s; closing the connection", exc, peer)
            self._reject(conn, "bad_frame", str(exc), key, wseq)
        except (OSError, TimeoutError):
            pass  # peer went away, idled out, evicted, or the server is stopping

    def _handshake(self, conn: socket.socket, peer: Any) -> bytes:
        deadline = time.monotonic() + self.config.handshake_timeout
        conn.settimeout(self.config.handshake_timeout)
        server_nonce = os.urandom(wire.NONCE_SIZE)
        hello = {
            "type": "hello",
            "versions": list(wire.SUPPORTED_VERSIONS),
            "nonce": wire.b64e(server_nonce),
        }
        wire.send_frame(conn, wire.ZERO_MAC, wire.encode(hello))
        mac, body = wire.recv_frame(conn, 4096, deadline=deadline)
        msg = wire.decode(body)
        if msg.get("type") != "auth":
            raise ProtocolError(f"expected an 'auth' frame, got {msg.get('type')!r}")
        version = msg.get("v")
        if isinstance(version, bool) or version not in wire.SUPPORTED_VERSIONS:
            self._count("rejected")
            self._warn(False, "store: %s speaks unsupported protocol version %r", peer, version)
            self._reject(
                conn,
                "unsupported_version",
                f"protocol version {version!r} not supported; this server speaks "
                f"{list(wire.SUPPORTED_VERSIONS)}; upgrade stalwart on both sides",
            )
            raise _HandshakeFailed
        client_nonce = wire.b64d(msg.get("nonce"), "nonce")
        if len(client_nonce) != wire.NONCE_SIZE or not wire.mac_ok(
            wire.auth_mac(self._token, b"c", server_nonce, client_nonce, body), mac
        ):
            self._count("auth_failures")
            self._warn(False, "store: authentication failed for %s (wrong job token?)", peer)
            self._reject(conn, "auth_failed", "authentication failed: wrong job token")
            raise _HandshakeFailed
        ok = wire.encode({"type": "auth_ok", "v": version})
        wire.send_frame(conn, wire.auth_mac(self._token, b"s", server_nonce, client_nonce, ok), ok)
        return wire.session_key(self._token, server_nonce, client_nonce)

    def _warn(self, authenticated: bool, message: str, *args: Any) -> None:
        """Warn about a peer; about an unauthenticated one at most once per 10 s (anyone
        can cause those, and a flood must not flood the agent's log)."""
        if authenticated:
            _log.warning(message, *args)
        else:
            self._admission.quiet_warning(_log, message, *args)

    # -- requests -------------------------------------------------------

    def _handle(self, body: bytes, peer: Any) -> dict[str, Any]:
        try:
            req = wire.decode(body)
            op = wire.field(req, "op", str)
            args = wire.field(req, "args", dict, {})
            rid = wire.field(req, "rid", str, None)
            handler = HANDLERS.get(op)
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}")
        except ProtocolError as exc:
            self._count("rejected")
            _log.warning("store: rejected request from %s: %s", peer, exc)
            return {"ok": False, "error": {"code": "bad_request", "message": str(exc)}}
        self._count("requests")
        if rid is None or op not in _MUTATING:
            return self._run(handler, args)
        with self._lock:
            pending = self._dedup.get(rid)
            fresh = pending is None
            if pending is None:
                pending = self._dedup[rid] = _Pending()
                while len(self._dedup) > self.config.dedup_entries:
                    self._dedup.popitem(last=False)
        if fresh:
            pending.reply = self._run(handler, args)
            pending.done.set()
        elif not pending.done.wait(self.config.frame_timeout):
            return {
                "ok": False,
                "error": {"code": "internal", "message": "retried request still running"},
            }
        return pending.reply

    def _run(self, handler: Handler, args: dict[str, Any]) -> dict[str, Any]:
        if handler is not _WATCH and self._exec is not None:  # a long-poll blocks: not there
            reply: dict[str, Any] = self._exec.call(self._execute, handler, args)
            return reply
        return self._execute(handler, args)

    def _execute(self, handler: Handler, args: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"ok": True, "result": handler(self._ctx, args)}
        except StoreClosedError as exc:
            return {"ok": False, "error": {"code": "shutting_down", "message": str(exc)}}
        except Exception as exc:
            code = wire.code_for(exc)
            if code == "internal":
                _log.exception("store: internal error")
            return {"ok": False, "error": {"code": code, "message": str(exc) or type(exc).__name__}}


class _HandshakeFailed(Exception):
    """The handshake was refused and the peer told why; just close."""
