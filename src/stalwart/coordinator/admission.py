"""Admission control for the job's TCP listeners: nobody without the token locks anyone out.

Every listener of a job (the coordinator store, the replica receiver, the peer watch)
accepts a connection, greets it and waits for a handshake that proves the job token.
Until that proof arrives the connection is *unauthenticated*, and anyone who reaches
the port can open one. So unauthenticated connections live in a small pool of their
own, apart from authenticated ones:

* at most ``max_unauthenticated`` in all and ``max_unauthenticated_per_peer`` from one
  address. A new connection over the global cap **evicts the oldest** unauthenticated
  connection of the address holding the most: an address other than the flooder's
  always gets in (refusing new ones instead would let anyone who holds the pool keep
  every member out). Over the per-peer cap it evicts that address's own oldest once
  that one had ``min_age`` for its handshake, else it is closed at once: one address
  cannot churn the server's connections faster than ``per_peer / min_age`` a second.
  An honest client finishes its handshake within one round trip; if it loses its
  place anyway it sees the connection end and reconnects.
* the handshake has a deadline for the whole exchange (the servers' own setting), so
  a byte dribbled now and then keeps nothing alive;
* authenticated connections have their own cap (``max_authenticated``), which only
  token holders can fill.

:func:`accept_loop` is the accept loop of the replica receiver and the peer watch: one
thread per connection, and no error (a failed ``accept``, a ``Thread.start`` that cannot
get a thread) ends it while the server runs. The store server admits through the same
:class:`Admission` from its event loop (_loop.py), with no thread per connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["LISTEN_BACKLOG", "Admission", "accept_loop"]

_QUIET_S = 10.0  # warnings about unauthenticated peers: at most one per this
_RETRY_ACCEPT_S = 0.05  # after a failed accept (out of descriptors): let some close
# listen() backlog of every job listener: under a flood the kernel's queue of completed
# connections fills between two accepts, and a member's SYN that finds it full is
# retransmitted only after 1 s (then 3 s): a deep queue keeps its place
LISTEN_BACKLOG = 1024


class Admission:
    """Which connections a listener holds: authenticated ones up to a cap, and a small
    separate pool of unauthenticated ones, capped in all and per peer address, the
    oldest evicted for a new one. Thread-safe."""

    def __init__(
        self,
        max_authenticated: int,
        max_unauthenticated: int,
        max_unauthenticated_per_peer: int,
        min_age: float = 0.5,
    ) -> None:
        for name, value in (
            ("max_authenticated", max_authenticated),
            ("max_unauthenticated", max_unauthenticated),
            ("max_unauthenticated_per_peer", max_unauthenticated_per_peer),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_authenticated = max_authenticated
        self.max_unauthenticated = max_unauthenticated
        self.max_per_peer = max_unauthenticated_per_peer
        self._lock = threading.Lock()
        self.min_age = min_age
        # connection -> (peer address, when admitted), oldest first
        self._pending: OrderedDict[socket.socket, tuple[str, float]] = OrderedDict()
        self._unlogged = 0
        self._quiet_until = 0.0
        self._per_peer: Counter[str] = Counter()
        self._authenticated: set[socket.socket] = set()
        self._threads: dict[socket.socket, threading.Thread] = {}
        self._stats = {"accepted": 0, "evicted": 0, "refused": 0, "authenticated": 0}

    def admit(self, conn: socket.socket, peer_host: str) -> bool:
        """Hold ``conn`` as unauthenticated, evicting the oldest one over a cap; False:
        refused (the caller closes it at once, without a thread).

        Over the per-peer cap the peer's own oldest connection is evicted only once it
        has had ``min_age`` seconds for its handshake, else the new one is refused: so
        one address churns at most ``per_peer / min_age`` connections a second, and a
        connection from a flooding address still keeps its place for a handshake. Over
        the global cap the busiest peer's oldest goes, whatever its age: another
        address always gets in."""
        now = time.monotonic()
        with self._lock:
            victim: socket.socket | None = None
            if self._per_peer[peer_host] >= self.max_per_peer:
                victim = self._oldest(peer_host)
                if victim is not None and now - self._pending[victim][1] < self.min_age:
                    self._stats["refused"] += 1
                    return False
            elif len(self._pending) >= self.max_unauthenticated:
                busiest = max(self._per_peer.items(), key=lambda kv: kv[1])[0]
                victim = self._oldest(busiest)
            if victim is not None:
                self._drop_pending(victim)
                self._stats["evicted"] += 1
                # shut down under the lock: its owner closes it only after release()
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)
            self._pending[conn] = (peer_host, now)
            self._per_peer[peer_host] += 1
            self._stats["accepted"] += 1
            return True

    def quiet_warning(self, log: logging.Logger, message: str, *args: Any) -> None:
        """Log a warning about an unauthenticated peer at most once per ``_QUIET_S``
        (anyone can cause one: a flood must not flood the log), with the count."""
        now = time.monotonic()
        with self._lock:
            self._unlogged += 1
            if now < self._quiet_until:
                return
            self._quiet_until = now + _QUIET_S
            count, self._unlogged = self._unlogged, 0
        more = f" ({count} such in the last {_QUIET_S:g}s)" if count > 1 else ""
        log.warning(message + more, *args)

    def track(self, conn: socket.socket, thread: threading.Thread) -> None:
        """``thread`` serves ``conn``: :meth:`close_all` joins it."""
        with self._lock:
            if conn in self._pending or conn in self._authenticated:
                self._threads[conn] = thread

    def authenticated_full(self) -> bool:
        """True when no further connection could be authenticated now."""
        with self._lock:
            return len(self._authenticated) >= self.max_authenticated

    def promote(self, conn: socket.socket) -> bool:
        """``conn`` proved the token: move it to the authenticated set. False when that
        set is full (the caller says so and closes) or ``conn`` was evicted meanwhile."""
        with self._lock:
            if conn not in self._pending:
                return False
            if len(self._authenticated) >= self.max_authenticated:
                self._stats["refused"] += 1
                return False
            self._drop_pending(conn)
            self._authenticated.add(conn)
            self._stats["authenticated"] += 1
            return True

    def release(self, conn: socket.socket) -> None:
        """``conn`` is done (its owner closes it right after)."""
        with self._lock:
            if conn in self._pending:
                self._drop_pending(conn)
            self._authenticated.discard(conn)
            self._threads.pop(conn, None)

    def counts(self) -> tuple[int, int]:
        """``(unauthenticated, authenticated)`` connections held now."""
        with self._lock:
            return len(self._pending), len(self._authenticated)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: accepted, evicted (unauthenticated, over a cap), refused (closed at
        once: a flooding address's, or over the authenticated cap), authenticated."""
        with self._lock:
            return dict(self._stats)

    def close_all(self, timeout: float) -> None:
        """Shut every held connection down and join their threads (server stop). A thread
        tracked but not started yet (the accept loop tracks before it starts one, so that
        a fast connection's release cannot come first) has nothing to join: its
        connection is shut down already, and it ends as soon as it runs."""
        with self._lock:
            held = list(self._threads.items())
            for conn in (*self._pending, *self._authenticated):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for _, thread in held:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _oldest(self, peer_host: str) -> socket.socket | None:
        for conn, (host, _) in self._pending.items():
            if host == peer_host:
                return conn
        return None

    def _drop_pending(self, conn: socket.socket) -> None:
        host, _ = self._pending.pop(conn)
        self._per_peer[host] -= 1
        if self._per_peer[host] <= 0:
            del self._per_peer[host]


def accept_loop(
    listener: socket.socket,
    admission: Admission,
    serve: Callable[[socket.socket, Any], None],
    stopping: Callable[[], bool],
    name: str,
    log: logging.Logger,
) -> None:
    """Accept until ``stopping()``; serve each connection on its own daemon thread.

    ``serve(conn, peer)`` runs with ``conn`` admitted as unauthenticated; it calls
    ``admission.promote(conn)`` once the peer proved the token. Afterwards the
    connection is released and closed here, whatever ``serve`` raised."""
    while not stopping():
        try:
            conn, peer = listener.accept()
        except TimeoutError:
            continue
        except OSError as exc:
            if stopping():
                return
            # out of descriptors or memory, or a connection aborted before accept: the
            # listener is fine; wait a moment for connections to close, then go on
            log.warning("%s: accept failed (%s); retrying", name, exc.strerror or exc)
            time.sleep(_RETRY_ACCEPT_S)
            continue
        if stopping():
            conn.close()
            return
        if not admission.admit(conn, str(peer[0])):
            conn.close()
            continue
        thread = threading.Thread(
            target=_run, args=(admission, serve, conn, peer, log, name), daemon=True
        )
        thread.name = f"{name}-{peer[0]}:{peer[1]}"
        admission.track(conn, thread)
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": drop this one, keep serving
            log.warning("%s: no thread for %s (%s); connection dropped", name, peer, exc)
            admission.release(conn)
            conn.close()


def _run(
    admission: Admission,
    serve: Callable[[socket.socket, Any], None],
    conn: socket.socket,
    peer: Any,
    log: logging.Logger,
    name: str,
) -> None:
    try:
        serve(conn, peer)
    except Exception:  # one connection never takes the server down
        log.exception("%s: unexpected error serving %s", name, peer)
    finally:
        admission.release(conn)
        conn.close()
