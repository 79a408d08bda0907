"""``StoreServer``: the embedded coordinator store, served over TCP.

Hosted by the node-rank-0 agent (as torchrun hosts its c10d store), it serves a
:class:`MemoryStore` to :class:`StoreClient` instances from one event-loop thread
(_loop.py): that thread owns every socket and runs every request, and a long-poll watch
waits parked, without a thread, until a write under its prefix answers it; so a
thousand nodes' connections cost no thread each and never queue on the store's lock.
Every frame is size-bounded and authenticated (see docs/wire-protocol.md); a bad frame
gets an error reply and costs at most its own connection, never the server.
Connections that have not yet proved the token are held apart, in a small pool with a
deadline for the whole handshake (:mod:`stalwart.coordinator.admission`), so nobody
without the token can keep a member out.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from stalwart.coordinator._loop import EventLoop
from stalwart.coordinator._ops import OpContext
from stalwart.coordinator._requests import Requests
from stalwart.coordinator.admission import LISTEN_BACKLOG, Admission
from stalwart.coordinator.memory import MemoryStore
from stalwart.errors import ConfigError
from stalwart.logs import get_logger

__all__ = ["StoreServer", "StoreServerConfig"]

_log = get_logger(__name__)


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
        self._admission = Admission(
            self.config.max_connections,
            self.config.max_unauthenticated,
            self.config.max_unauthenticated_per_peer,
        )
        cfg = self.config
        ctx = OpContext(
            self.store,
            cfg.max_frame_bytes,
            cfg.max_key_bytes,
            cfg.max_value_bytes,
            cfg.max_watch_wait,
        )
        self._requests = Requests(ctx, cfg.dedup_entries, _log)
        self._loop: EventLoop | None = None

    # -- lifecycle ------------------------------------------------------

    def start(self) -> StoreServer:
        """Bind and start serving (returns self)."""
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
        self._listener = listener
        self._loop = EventLoop(
            listener, self._token, cfg, self._admission, self._requests, self._warn, _log
        )
        self._loop.start()
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
        return {
            "connections": admission["accepted"],
            "evicted": admission["evicted"],
            "refused": admission["refused"],
            **self._requests.stats,
            "unauthenticated": pending,
            "authenticated": authed,
        }

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and end the server's thread."""
        if self._loop is not None:
            self._loop.stop(timeout)
        if self._listener is not None:
            self._listener.close()
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

    def _handle(self, body: bytes, peer: Any) -> dict[str, Any]:
        """One request body's reply, run on the calling thread (a watch only looks, never
        parks): the wire fuzz test's entry. Not for a running server's traffic, which
        its event loop runs."""
        req = self._requests.parse(body, peer)
        return req if isinstance(req, dict) else self._requests.run(req)

    def _warn(self, authenticated: bool, message: str, *args: Any) -> None:
        """Warn about a peer; about an unauthenticated one at most once per 10 s (anyone
        can cause those, and a flood must not flood the agent's log)."""
        if authenticated:
            _log.warning(message, *args)
        else:
            self._admission.quiet_warning(_log, message, *args)
