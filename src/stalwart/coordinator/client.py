"""``StoreClient``: the :class:`~stalwart.coordinator.store.Store` interface over TCP.

Requests go over a small pool of authenticated connections (a watch long-poll
holds one for its duration, other calls use others). A dropped connection or a
server that stops answering is retried with backoff until ``reconnect_timeout``;
mutating requests carry a request id that the server remembers, so a retried
put, transaction or grant takes effect exactly once even when the first attempt
did reach the server.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from stalwart.coordinator import wire
from stalwart.coordinator.errors import (
    AuthenticationError,
    ProtocolError,
    StoreClosedError,
    StoreError,
    StoreUnavailableError,
)
from stalwart.coordinator.store import Compare, Event, KeyValue, Op, RangeResult, TxnResult
from stalwart.coordinator.token import read_token_file
from stalwart.errors import ConfigError

__all__ = ["StoreClient", "StoreClientConfig"]

_MUTATING = frozenset({"put", "delete", "txn", "grant", "revoke", "keepalive"})
_MAX_POLL = 10.0  # longest single watch long-poll; the server caps it too


@dataclass(frozen=True)
class StoreClientConfig:
    """Timeouts and limits of a :class:`StoreClient`."""

    connect_timeout: float = 5.0
    request_timeout: float = 30.0  # a reply must arrive within this (plus any watch wait)
    reconnect_timeout: float = 30.0  # keep retrying a lost server this long, then give up
    max_frame_bytes: int = 16 << 20
    max_idle_connections: int = 4
    source_address: str = ""
    """Local address the connections leave from ("": the system's choice): a
    multi-homed host's interface; bench/scale.py gives each emulated node its own
    loopback address, as each real node has its own host."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "request_timeout", "reconnect_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"StoreClientConfig.{name} must be > 0 seconds")
        if self.max_frame_bytes < 1024 or self.max_idle_connections < 1:
            raise ConfigError("StoreClientConfig limits must be positive (frames >= 1 KiB)")


class _Retry(Exception):
    """The server asked us to come back later (shutting down, connection limit)."""


class _Connection:
    """One authenticated connection: a socket, its session key and frame counters."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self.key = key
        self.wseq = 0
        self.rseq = 0

    def call(self, request: dict[str, Any], timeout: float, max_bytes: int) -> dict[str, Any]:
        body = wire.encode(request)
        self.sock.settimeout(timeout)
        wire.send_frame(self.sock, wire.frame_mac(self.key, b"C", self.wseq, body), body)
        self.wseq += 1
        mac, reply_body = wire.recv_frame(self.sock, max_bytes)
        if not wire.mac_ok(wire.frame_mac(self.key, b"S", self.rseq, reply_body), mac):
            raise AuthenticationError("reply MAC mismatch: the connection was tampered with")
        self.rseq += 1
        return wire.decode(reply_body)


class StoreClient:
    """A :class:`Store` served by a :class:`StoreServer` at ``host:port``.

    No connection is made until the first call (use :meth:`ping` to check the
    address and token early). Thread-safe; :meth:`close` it when done.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        config: StoreClientConfig | None = None,
    ) -> None:
        self._addr = (host, port)
        self._token = bytes(token)
        self.config = config or StoreClientConfig()
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._closed = threading.Event()

    @classmethod
    def from_token_file(
        cls,
        host: str,
        port: int,
        token_file: str | os.PathLike[str],
        config: StoreClientConfig | None = None,
    ) -> StoreClient:
        """Build a client whose token is read from the job's 0600 token file."""
        return cls(host, port, read_token_file(token_file), config)

    # -- Store interface ------------------------------------------------

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        res = self._call("put", {"key": key, "value": wire.b64e(bytes(value)), "lease": lease})
        return int(res["revision"])

    def get(self, key: str) -> KeyValue | None:
        kv = self._call("get", {"key": key}).get("kv")
        return None if kv is None else wire.kv_from_json(kv)

    def range(self, prefix: str) -> RangeResult:
        res = self._call("range", {"prefix": prefix})
        kvs = [wire.kv_from_json(kv) for kv in wire.field(res, "kvs", list)]
        return RangeResult(kvs, wire.field(res, "revision", int))

    def delete(self, key: str, *, prefix: bool = False) -> int:
        return int(self._call("delete", {"key": key, "prefix": prefix})["deleted"])

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        res = self._call(
            "txn",
            {
                "compare": [wire.compare_to_json(c) for c in compare],
                "success": [wire.op_to_json(o) for o in success],
                "failure": [wire.op_to_json(o) for o in failure],
            },
        )
        return TxnResult(wire.field(res, "succeeded", bool), wire.field(res, "revision", int))

    def grant(self, ttl: float) -> int:
        return int(self._call("grant", {"ttl": ttl})["lease"])

    def keepalive(self, lease: int) -> float:
        return float(self._call("keepalive", {"lease": lease})["ttl"])

    def time_to_live(self, lease: int) -> float | None:
        ttl = self._call("time_to_live", {"lease": lease}).get("ttl")
        return None if ttl is None else float(ttl)

    def revoke(self, lease: int) -> bool:
        return bool(self._call("revoke", {"lease": lease})["revoked"])

    def watch(self, prefix: str, start_revision: int | None = None) -> _ClientWatch:
        if start_revision is None:
            start_revision = self.ping() + 1
        elif start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        return _ClientWatch(self, prefix, start_revision)

    def ping(self) -> int:
        """Round-trip to the server (connecting and authenticating if needed); its revision."""
        return int(self._call("ping", {})["revision"])

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            conns, self._all, self._idle = list(self._all), set(), []
        for conn in conns:
            _close(conn.sock)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- requests with reconnects ---------------------------------------

    def _call(self, op: str, args: dict[str, Any], wait: float = 0.0) -> dict[str, Any]:
        request: dict[str, Any] = {"op": op, "args": args}
        if op in _MUTATING:
            request["rid"] = secrets.token_hex(12)
        deadline: float | None = None
        backoff = 0.02
        while True:
            if self._closed.is_set():
                raise StoreClosedError("the store client is closed; create a new one")
            conn: _Connection | None = None
            try:
                conn = self._acquire()
                reply = conn.call(
                    request, self.config.request_timeout + wait, self.config.max_frame_bytes
                )
                if reply.get("ok") is True:
                    self._release(conn)
                    result = reply.get("result")
                    if not isinstance(result, dict):
                        raise ProtocolError("store server reply has no result object")
                    return result
                error = reply.get("error")
                code = error.get("code") if isinstance(error, dict) else None
                if code in wire.RETRYABLE_CODES:
                    raise _Retry(str(error))
                if code in ("bad_frame", "too_large", "auth_failed"):
                    self._discard(conn)  # the server closes the connection after these
                else:
                    self._release(conn)
                raise wire.error_from_reply(error)
            except (OSError, _Retry) as exc:  # includes timeouts and StoreUnavailableError
                if conn is not None:
                    self._discard(conn)
                now = time.monotonic()
                deadline = now + self.config.reconnect_timeout if deadline is None else deadline
                if now >= deadline or self._closed.is_set():
                    if self._closed.is_set():
                        raise StoreClosedError(
                            "the store client is closed; create a new one"
                        ) from None
                    host, port = self._addr
                    raise StoreUnavailableError(
                        f"store server {host}:{port} unreachable for "
                        f"{self.config.reconnect_timeout:.1f}s ({exc}); is the coordinator "
                        "(node-rank-0 agent) running and the address right?"
                    ) from None
                self._closed.wait(min(backoff, deadline - now))
                backoff = min(backoff * 2, 1.0)
            except StoreError:
                if conn is not None and conn in self._all and conn not in self._idle:
                    self._discard(conn)
                raise

    def _acquire(self) -> _Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        conn = self._connect()
        with self._lock:
            if self._closed.is_set():
                _close(conn.sock)
                raise StoreClosedError("the store client is closed; create a new one")
            self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            if conn in self._all and len(self._idle) < self.config.max_idle_connections:
                self._idle.append(conn)
                return
            self._all.discard(conn)
        _close(conn.sock)

    def _discard(self, conn: _Connection) -> None:
        with self._lock:
            self._all.discard(conn)
            if conn in self._idle:
                self._idle.remove(conn)
        _close(conn.sock)

    def _connect(self) -> _Connection:
        source = (self.config.source_address, 0) if self.config.source_address else None
        sock = socket.create_connection(
            self._addr, timeout=self.config.connect_timeout, source_address=source
        )
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return self._handshake(sock)
        except BaseException:
            _close(sock)
            raise

    def _handshake(self, sock: socket.socket) -> _Connection:
        _, body = wire.recv_frame(sock, 4096)
        hello = wire.decode(body)
        if hello.get("ok") is False:  # refused before the handshake (e.g. connection limit)
            error = hello.get("error")
            if isinstance(error, dict) and error.get("code") in wire.RETRYABLE_CODES:
                raise _Retry(str(error))
            raise wire.error_from_reply(error)
        versions = hello.get("versions")
        if hello.get("type") != "hello" or not isinstance(versions, list):
            raise ProtocolError("the server did not greet with a stalwart 'hello'; wrong port?")
        if wire.PROTOCOL_VERSION not in versions:
            raise ProtocolError(
                f"server speaks protocol versions {versions}, this client "
                f"{wire.PROTOCOL_VERSION}; run the same stalwart version everywhere"
            )
        server_nonce = wire.b64d(hello.get("nonce"), "nonce")
        client_nonce = os.urandom(wire.NONCE_SIZE)
        auth = wire.encode(
            {"type": "auth", "v": wire.PROTOCOL_VERSION, "nonce": wire.b64e(client_nonce)}
        )
        wire.send_frame(
            sock, wire.auth_mac(self._token, b"c", server_nonce, client_nonce, auth), auth
        )
        mac, body = wire.recv_frame(sock, 4096)
        reply = wire.decode(body)
        if reply.get("ok") is False:
            raise wire.error_from_reply(reply.get("error"))
        if not wire.mac_ok(wire.auth_mac(self._token, b"s", server_nonce, client_nonce, body), mac):
            raise AuthenticationError(
                "the store server could not prove it holds the job token; "
                "check the address and the token file"
            )
        return _Connection(sock, wire.session_key(self._token, server_nonce, client_nonce))


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class _ClientWatch:
    """A :class:`~stalwart.coordinator.store.Watch` made of long-polls on a client."""

    def __init__(self, client: StoreClient, prefix: str, start: int) -> None:
        self._client = client
        self._prefix = prefix
        self._next = start
        self._closed = False

    @property
    def next_revision(self) -> int:
        return self._next

    def get(self, timeout: float | None = None) -> list[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise StoreClosedError("this watch is closed; open a new one")
            wait = _MAX_POLL if deadline is None else min(_MAX_POLL, deadline - time.monotonic())
            wait = max(0.0, wait)
            args = {"prefix": self._prefix, "start_revision": self._next, "timeout": wait}
            res = self._client._call("watch", args, wait)
            events = [wire.event_from_json(e) for e in wire.field(res, "events", list)]
            if events:
                self._next = events[-1].kv.mod_revision + 1
                return events
            looked_to = res.get("revision")  # none under the prefix up to it (protocol 1+)
            if type(looked_to) is int and looked_to >= self._next:
                self._next = looked_to + 1
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> _ClientWatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
