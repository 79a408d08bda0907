"""The store server's event loop: one thread owns every socket and runs every request.

A thread per connection cost the store its CPU at hundreds of nodes: each request woke
the connection's thread, handed over to the executor thread and back, and ~1,000
threads fought over the GIL (docs/scale.md, fourth round: the handlers themselves
were a few percent of the time). Here one thread waits in ``select`` on all of them: a
readable socket's frame is cut out of its buffer (_conn.py), checked (MAC, size, fields)
and run at once (_requests.py); a long-poll with nothing to return is *parked* (no
thread, no timer per poll) and answered when the store reports a write under its prefix
(``MemoryStore.listen``), at its own deadline, or at the server's stop. Lease expiry is
judged here too, each pass (``MemoryStore.tick``): a pass answers at most the frames that
arrived, so a keepalive read in time is not left behind a queue of other requests, and
a loop that did not run past a deadline (a descheduled process) renews every lease
before it expires any (_stall.py).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from stalwart.coordinator import wire
from stalwart.coordinator._conn import Closed, Conn, Refused, check_auth, hello
from stalwart.coordinator._ops import watch_args, watch_poll
from stalwart.coordinator._parked import Parked, Watch
from stalwart.coordinator._requests import Request, Requests
from stalwart.coordinator.admission import Admission
from stalwart.coordinator.errors import FrameTooLargeError, ProtocolError
from stalwart.coordinator.memory import MemoryStore

__all__: list[str] = []

_HANDSHAKE_BYTES = 4096
_ACCEPT_BATCH = 64  # connections accepted per pass (then the others' frames are read)
_RETRY_ACCEPT_S = 0.05  # after a failed accept (out of descriptors): let some close


class EventLoop:
    """Serve ``listener``'s connections on one thread until :meth:`stop`."""

    def __init__(
        self,
        listener: socket.socket,
        token: bytes,
        config: Any,
        admission: Admission,
        requests: Requests,
        warn: Callable[..., None],
        log: logging.Logger,
    ) -> None:
        self._listener = listener
        self._token = token
        self._cfg = config
        self._admission = admission
        self._requests = requests
        self._store: MemoryStore = requests.ctx.store
        self._warn, self._log = warn, log
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (listener, self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._conns: dict[int, Conn] = {}
        self._deadlines: list[tuple[float, int, Conn]] = []  # handshakes, begun frames
        self._parked = Parked()
        self._seq = itertools.count()
        self._written: deque[tuple[str, ...] | None] = deque()  # the store's listener
        self._stopping = False
        self._accept_at = 0.0  # accepts paused until (a failed accept)
        self._idle_every = min(max(config.idle_timeout / 10, 0.05), 10.0)
        self._idle_at = 0.0
        self._thread = threading.Thread(target=self._run, name="stalwart-store-loop", daemon=True)

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._store.listen(self._on_change)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """End the loop: every connection closed (a parked long-poll with it)."""
        self._stopping = True
        self._poke()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._store.unlisten(self._on_change)

    def _on_change(self, keys: tuple[str, ...] | None) -> None:
        """The store changed (its lock held, any thread): take note, wake the loop."""
        if keys == () and threading.current_thread() is self._thread:
            return  # a lease granted here: the next pass looks at its deadline anyway
        self._written.append(keys)
        if threading.current_thread() is not self._thread:
            self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake is pending already
            self._wake_w.send(b"\0")

    # -- the loop ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                until_lease = self._store.tick()  # expire (or renew all after a stall)
                self._wake_watches()
                now = time.monotonic()
                if self._accept_at and now >= self._accept_at:  # accepts paused: resume
                    self._accept_at = 0.0
                    self._sel.register(self._listener, selectors.EVENT_READ, None)
                for key, mask in self._sel.select(self._timeout(now, until_lease)):
                    self._ready(key, mask)
                self._wake_watches()
                now = time.monotonic()
                self._expire_watches(now)
                self._expire_deadlines(now)
                if now >= self._idle_at:
                    self._sweep_idle(now)
        except Exception:  # never seen; the server must not die silently
            self._log.exception("store: the server's event loop failed")
        finally:
            self._close_all()

    def _timeout(self, now: float, until_lease: float | None) -> float:
        timeout = self._idle_at - now
        if until_lease is not None:
            timeout = min(timeout, until_lease)
        if self._deadlines:
            timeout = min(timeout, self._deadlines[0][0] - now)
        watch_timeout = self._parked.next_timeout()
        if watch_timeout is not None:
            timeout = min(timeout, watch_timeout - now)
        if self._accept_at:
            timeout = min(timeout, self._accept_at - now)
        return max(0.0, timeout)

    def _ready(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.fileobj is self._listener:
            self._accept()
        elif key.fileobj is self._wake_r:
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        else:
            conn: Conn = key.data
            try:
                if mask & selectors.EVENT_WRITE:
                    self._flushed(conn, conn.flush())
                if mask & selectors.EVENT_READ and not conn.closing:
                    self._read(conn)
            except Closed:
                self._drop(conn)
            except Exception:  # one connection never takes the server down
                self._log.exception("store: unexpected error serving %s", conn.peer)
                self._drop(conn)

    # -- connections ------------------------------------------------------

    def _accept(self) -> None:
        now = time.monotonic()
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: let some close, keep serving
                self._log.warning("store: accept failed (%s); retrying", exc.strerror or exc)
                self._accept_at = now + _RETRY_ACCEPT_S
                self._sel.unregister(self._listener)
                return
            if not self._admission.admit(sock, str(peer[0])):
                sock.close()
                continue
            sock.setblocking(False)
            conn = Conn(sock, peer, now)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            try:
                if self._admission.authenticated_full():
                    self._refuse(conn, "too_many_connections", "server connection limit reached")
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._set_deadline(conn, now + self._cfg.handshake_timeout)
                self._flushed(conn, conn.queue(wire.ZERO_MAC, hello(conn)))
            except (Closed, OSError):
                self._drop(conn)

    def _read(self, conn: Conn) -> None:
        conn.receive()
        while conn.inbuf and conn.watch is None and not conn.closing and conn.sock.fileno() >= 0:
            try:
                frame = conn.frame(self._cfg.max_frame_bytes if conn.key else _HANDSHAKE_BYTES)
            except (FrameTooLargeError, ProtocolError) as exc:
                self._bad_frame(conn, exc)
                return
            if frame is None:
                break
            conn.active = time.monotonic()
            if conn.key:
                self._request(conn, *frame)
            else:
                self._handshake(conn, *frame)
        if conn.inbuf and conn.watch is not None:
            if len(conn.inbuf) > self._cfg.max_frame_bytes + 36:  # frames while it waits
                self._drop(conn)
        elif conn.key and not conn.closing:  # a frame begun and not whole: its deadline
            if not conn.inbuf:
                conn.deadline = None
            elif conn.deadline is None:
                self._set_deadline(conn, time.monotonic() + self._cfg.frame_timeout)

    def _handshake(self, conn: Conn, mac: bytes, body: bytes) -> None:
        try:
            check_auth(conn, self._token, mac, body)
        except (ProtocolError, FrameTooLargeError) as exc:
            self._bad_frame(conn, exc)
            return
        except Refused as exc:
            self._requests.stats["auth_failures" if exc.auth else "rejected"] += 1
            self._warn(False, exc.log, conn.peer)
            self._refuse(conn, exc.code, str(exc))
            return
        conn.deadline = None
        if not self._admission.promote(conn.sock):
            self._log.warning(
                "store: refusing %s: %d connections open", conn.peer, self._cfg.max_connections
            )
            conn.key = b""  # this reply before the session: a zero MAC
            self._refuse(conn, "too_many_connections", "server connection limit reached")
            return
        self._flushed(conn, conn.flush())

    def _request(self, conn: Conn, mac: bytes, body: bytes) -> None:
        if not wire.mac_ok(wire.frame_mac(conn.key, b"C", conn.rseq, body), mac):
            self._requests.stats["auth_failures"] += 1
            self._log.warning("store: bad frame MAC from %s; closing the connection", conn.peer)
            self._refuse(conn, "auth_failed", "frame MAC mismatch")
            return
        conn.rseq += 1
        req = self._requests.parse(body, conn.peer)
        if not isinstance(req, Request):
            self._send(conn, req)
        elif req.op == "watch":
            self._watch(conn, req)
        else:
            self._send(conn, self._requests.run(req))

    def _bad_frame(self, conn: Conn, exc: Exception) -> None:
        self._requests.stats["rejected"] += 1
        self._warn(bool(conn.key), "store: %s from %s; closing the connection", exc, conn.peer)
        code = "too_large" if isinstance(exc, FrameTooLargeError) else "bad_frame"
        self._refuse(conn, code, str(exc))

    def _refuse(self, conn: Conn, code: str, message: str) -> None:
        """Reply with an error, then close once it is sent."""
        conn.closing = True
        conn.inbuf.clear()
        body = wire.encode({"ok": False, "error": {"code": code, "message": message}})
        try:
            left = conn.reply(body)
        except Closed:
            left = False
        if left:
            self._flushed(conn, left)
        else:
            self._drop(conn)

    def _send(self, conn: Conn, reply: dict[str, Any]) -> None:
        self._send_body(conn, wire.encode(reply))

    def _send_body(self, conn: Conn, body: bytes) -> None:
        try:
            self._flushed(conn, conn.reply(body))
        except Closed:
            self._drop(conn)

    def _flushed(self, conn: Conn, left: bool) -> None:
        """Wait for the socket to take the rest, or close a closing connection."""
        if conn.sock.fileno() < 0:
            return
        if not left and conn.closing:
            self._drop(conn)
        elif left != conn.writing:
            conn.writing = left
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if left else 0)
            self._sel.modify(conn.sock, events, conn)

    def _set_deadline(self, conn: Conn, deadline: float) -> None:
        conn.deadline = deadline
        heapq.heappush(self._deadlines, (deadline, next(self._seq), conn))

    def _expire_deadlines(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, conn = heapq.heappop(heap)
            if conn.deadline == deadline and conn.sock.fileno() >= 0:
                self._drop(conn)  # a handshake or a frame that did not arrive in time

    def _sweep_idle(self, now: float) -> None:
        self._idle_at = now + self._idle_every
        limit = now - self._cfg.idle_timeout
        for conn in [c for c in self._conns.values() if c.active < limit and c.watch is None]:
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        fileno = conn.sock.fileno()
        if fileno < 0:
            return
        self._parked.unpark(conn.watch)
        self._conns.pop(fileno, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        self._admission.release(conn.sock)
        conn.close()

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        for sock in (self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()

    # -- long-polls -------------------------------------------------------

    def _watch(self, conn: Conn, req: Request) -> None:
        ctx = self._requests.ctx
        try:
            prefix, start, wait = watch_args(ctx, req.args)
        except Exception as exc:
            self._send(conn, self._requests.execute(_raise, exc))
            return
        reply = self._requests.execute(watch_poll, ctx, prefix, start)
        if not reply["ok"] or reply["result"]["events"] or wait <= 0:
            self._send(conn, reply)
            return
        self._parked.park(conn, prefix, start, time.monotonic() + wait)

    def _answer(self, watch: Watch, body: bytes) -> None:
        conn = watch.conn
        self._parked.unpark(watch)
        conn.active = time.monotonic()
        self._send_body(conn, body)
        if conn.inbuf and conn.sock.fileno() >= 0:  # a frame sent while it waited
            try:
                self._read(conn)
            except Closed:
                self._drop(conn)

    def _wake_watches(self) -> None:
        """Answer the parked long-polls under the keys written since the last look: each
        looks once per pass however many writes there were; one reply body per
        (prefix, start), MAC'd per connection."""
        notes = []
        while self._written:  # appended by other threads too: popleft, never swap
            notes.append(self._written.popleft())
        everything = None in notes
        keys = {k for note in notes if note for k in note}
        if not keys and not everything:
            return
        ctx = self._requests.ctx
        for prefix, watches in self._parked.under(keys, everything):
            bodies: dict[int, bytes | None] = {}
            for watch in watches:
                body = bodies.get(watch.start, b"")
                if body == b"":
                    reply = self._requests.execute(watch_poll, ctx, prefix, watch.start)
                    empty = reply["ok"] and not reply["result"]["events"]
                    body = bodies[watch.start] = None if empty else wire.encode(reply)
                if body is not None:
                    self._answer(watch, body)

    def _expire_watches(self, now: float) -> None:
        """Answer the long-polls whose wait ended: a look of their own, atomic with the
        revision it reports (a write under the prefix since the last wake is in it, not
        skipped by the revision); one look per (prefix, start)."""
        ctx = self._requests.ctx
        bodies: dict[tuple[str, int], bytes] = {}
        for watch in list(self._parked.timed_out(now)):
            body = bodies.get((watch.prefix, watch.start))
            if body is None:
                reply = self._requests.execute(watch_poll, ctx, watch.prefix, watch.start)
                body = bodies[(watch.prefix, watch.start)] = wire.encode(reply)
            self._answer(watch, body)


def _raise(exc: Exception) -> Any:
    raise exc
