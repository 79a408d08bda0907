"""A node's workers arrive at an agreement through their agent: one transaction and one
watch per node, not per worker (worker contract ``arrival_relay``; the wire format:
coordinator/arrivals.py, docs/worker-contract.md).

Why: each worker's arrival (runtime/rejoin/_rendezvous.py ``agree``) was a transaction
of its own, and each waited for rank 0's agreement on a watch of its own. At 8 workers a
node, a failure cost the coordinator 8 times what the node count says: 128 nodes of 8
agreed in 1.19 s where 128 nodes of 1 took 0.22 s (docs/scale.md). Here the arrivals go
out together in one transaction once the node's workers have all arrived (each says how
many the node runs), or after ``_LINGER_S``, so that a worker slow or gone delays the
others that long at most; each
guard kept apart (the same for a node's workers at one generation); and the workers
waiting for one agreement share one watch, whose answer each receives.

A thread of its own serves the socket, so a worker never waits on the agent's loop. Only
a process of the agent's own user is served (``SO_PEERCRED``): an abstract socket's name
can be listed by anyone on the host, and what comes in is written with this node's
lease.
What the relay cannot do it says so (an arrival's store error, a broken watch), and the
worker asks the store itself, as it does with no relay.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from stalwart.agent.cluster._relay import listen_local, own_user
from stalwart.coordinator import CompactedError, Compare, Put, Store, StoreError
from stalwart.coordinator.arrivals import MAX_LINE, Arrive, Await, encode, parse_request
from stalwart.logs import get_logger

__all__ = ["ArrivalRelay"]

_log = get_logger(__name__)
_BACKLOG = 128  # a node's workers, a restart's and its spares'
_SEND_S = 2.0  # a worker that does not read its reply for this long is dropped
_WAIT_S = 5.0  # a shared watch's long-poll, as a worker's own; then it looks for hang-ups
_LINGER_S = 0.02  # the longest an arrival waits for its node's other workers' to join it
_DONE = 64  # finished waits kept for a worker that asks after the answer came


@dataclass
class _Conn:
    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def send(self, line: bytes) -> None:
        """Send ``line``; a worker that does not take it is hung up on (the socket's
        thread then drops it: only that thread touches the selector)."""
        with self.lock:
            if self.closed:
                return
            try:
                self.sock.sendall(line)
                return
            except OSError:
                self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class _SharedWait:
    """One watch on ``req.prefix`` for every worker of this node awaiting ``req.key``.

    It starts at the first waiter's revision: rank 0 publishes the agreement only after
    every arrival, and a generation's end marker follows every arrival its transaction
    admitted, so either comes after any waiter's own arrival."""

    def __init__(self, relay: ArrivalRelay, req: Await) -> None:
        self.req = req
        self.waiters: list[_Conn] = []
        self._relay = relay
        self._thread = threading.Thread(
            target=self._run, name="stalwart-arrivals-wait", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        req, answer = self.req, encode({"broken": True})
        try:
            with self._relay.store.watch(req.prefix, req.start) as watch:
                while not self._relay.closed and self._relay.waiting(self):
                    for event in watch.get(_WAIT_S):
                        if event.type != "put":
                            continue
                        if event.kv.key == req.key:
                            answer = encode({"record": event.kv.value.decode()})
                            return
                        if event.kv.key == req.end:
                            answer = encode({"end": True})
                            return
        except (StoreError, CompactedError, UnicodeDecodeError) as err:
            _log.debug("arrival relay: the watch on %s broke: %s", req.prefix, err)
        except Exception as err:  # the store client closed under us at the agent's end
            _log.debug("arrival relay: the watch on %s ended: %s", req.prefix, err)
        finally:
            self._relay.answered(self, answer)


class ArrivalRelay:
    """A listening Unix socket at :attr:`address` that writes this node's workers'
    arrivals to ``store`` and relays the agreements they await (keys under
    ``job_root``, ``/stalwart/<job>/``, only)."""

    def __init__(self, store: Store, job_root: str, *, linger_s: float = _LINGER_S) -> None:
        self.store = store
        self._linger_s = linger_s
        self._root = job_root.rstrip("/") + "/"
        self._sock, self.address = listen_local("arr", _BACKLOG)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._lock = threading.Lock()
        self._waits: dict[str, _SharedWait] = {}  # awaited key -> its shared watch
        self._done: OrderedDict[str, bytes] = OrderedDict()  # awaited key -> its answer
        self.closed = False
        self.transactions = 0  # arrivals written, in transactions (tests, bench)
        self.arrivals = 0
        self.watches = 0
        self._thread = threading.Thread(target=self._run, name="stalwart-arrivals", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the socket's thread
    def _run(self) -> None:
        arrivals: list[tuple[_Conn, Arrive]] = []
        since = 0.0  # when the first of ``arrivals`` came
        while not self.closed:
            wait = 0.5 if not arrivals else max(0.0, since + self._linger_s - time.monotonic())
            try:
                ready = self._sel.select(wait)
            except (OSError, ValueError):  # closed under us
                return
            for key, _ in ready:
                if key.fileobj is self._sock:
                    self._accept()
                else:
                    if not arrivals:
                        since = time.monotonic()
                    self._read(key.data, arrivals)
            # every worker of the node has arrived (as many as they say the node runs), or
            # the linger is over (one is slow, or gone): one transaction for them
            every = arrivals and len(arrivals) >= max(a.peers for _, a in arrivals)
            if arrivals and (every or time.monotonic() >= since + self._linger_s):
                self._commit(arrivals)
                arrivals = []

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:  # none waiting, or closed
                return
            if not own_user(sock):  # abstract names are listable (/proc/net/unix): a
                sock.close()  # process of another user must not write through our lease
                continue
            sock.settimeout(_SEND_S)  # a reply that does not fit waits this long at most
            conn = _Conn(sock)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn, arrivals: list[tuple[_Conn, Arrive]]) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        while (cut := conn.buf.find(b"\n")) >= 0:
            line = bytes(conn.buf[:cut])
            del conn.buf[: cut + 1]
            req = parse_request(line, self._root)
            if req is None:  # out of format: the worker asks the store itself
                self._drop(conn)
                return
            if isinstance(req, Arrive):
                arrivals.append((conn, req))
            else:
                self._await(conn, req)
        if len(conn.buf) > MAX_LINE:
            self._drop(conn)

    def _commit(self, arrivals: list[tuple[_Conn, Arrive]]) -> None:
        """Every arrival read since the last transaction, one transaction per guard."""
        groups: dict[tuple[Compare, ...], list[tuple[_Conn, Put]]] = {}
        for conn, req in arrivals:
            groups.setdefault(req.guard, []).append((conn, req.put))
        for guard, items in groups.items():
            try:
                result = self.store.txn(list(guard), [put for _, put in items])
            except Exception as err:  # the store away: each worker asks it itself
                _log.debug("arrival relay: a transaction failed: %s", err)
                reply = encode({"broken": True})
            else:
                self.transactions += 1
                self.arrivals += len(items)
                _log.debug("arrival relay: %d arrival(s) in one transaction", len(items))
                reply = encode({"ok": result.succeeded, "rev": result.revision})
            for conn, _ in items:
                conn.send(reply)

    def _await(self, conn: _Conn, req: Await) -> None:
        with self._lock:
            answer = self._done.get(req.key)
            if answer is None:
                wait = self._waits.get(req.key)
                if wait is None:
                    self.watches += 1
                    wait = self._waits[req.key] = _SharedWait(self, req)
                wait.waiters.append(conn)
                return
        conn.send(answer)

    def _drop(self, conn: _Conn) -> None:
        with conn.lock:
            conn.closed = True
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    # ------------------------------------------------------------ a shared watch's
    def waiting(self, wait: _SharedWait) -> bool:
        """Whether any worker still waits on ``wait`` (one that hung up does not)."""
        with self._lock:
            wait.waiters = [c for c in wait.waiters if not c.closed]
            return bool(wait.waiters)

    def answered(self, wait: _SharedWait, answer: bytes) -> None:
        """``wait`` ended with ``answer``: to every worker waiting on it, and kept for one
        that asks later (a broken watch's is not: the next asks again)."""
        with self._lock:
            self._waits.pop(wait.req.key, None)
            if b'"broken"' not in answer:
                self._done[wait.req.key] = answer
                while len(self._done) > _DONE:
                    self._done.popitem(last=False)
            waiters, wait.waiters = wait.waiters, []
        for conn in waiters:
            conn.send(answer)

    def close(self) -> None:
        """Stop serving; every connected worker sees its relay end (and asks the store).
        Once: a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(2.0)
        for key in list((self._sel.get_map() or {}).values()):
            if isinstance(key.data, _Conn):
                self._drop(key.data)
        with contextlib.suppress(OSError):
            self._sel.close()
