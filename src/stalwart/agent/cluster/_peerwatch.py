"""Node loss in milliseconds when the agent's process dies: a watched connection.

A node's lease is the general failure signal, but it is slow by design: it has to
outlast a loaded machine's pauses (2-5 s here). Most node losses are not silent,
though: when the agent process dies (OOM kill, crash, SIGKILL, the host rebooting),
the kernel closes its sockets and the peer sees the connection end at once.

So every agent holds one TCP connection to its ring successor (the node that would
adopt its ranks, and its snapshot buddy). When that connection ends and the peer has
not said goodbye (``agents-done/node<k>``), the successor revokes the peer's lease:
the lease expiry is brought forward to the moment the process died, and everything
after it (adoption, fencing, recovery) runs exactly as on a lease expiry.

Why this is safe: revoking a lease is what its expiry does anyway. A peer that is
alive but whose connection broke (a network blip) loses its lease and is fenced, the
same outcome as a partition longer than the lease; it cannot commit with its old
generation. Why it is not enough alone: a machine that loses power or its network sends
no FIN or RST, so its loss is still detected at lease expiry.

Wire: the listener sends a 16-byte nonce; the client answers with one JSON line
``{"v": 1, "node": k, "mac": hex(HMAC-SHA256(token, "stalwart-watch-v1" + nonce + k))}``,
then the connection stays open and silent until the client closes it on purpose, which it
announces with one byte ``B`` (docs/wire-protocol.md). A connection that fails the
handshake is dropped and ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from stalwart.coordinator.admission import LISTEN_BACKLOG, Admission, accept_loop

__all__ = ["PeerWatch", "parse_hello"]

_VERSION = 1
_TAG = b"stalwart-watch-v1"
_HANDSHAKE_S = 5.0  # the whole hello must arrive within this
_MAX_HELLO = 512
_MAX_WATCHED = 16  # authenticated (watched) connections: one per predecessor, a few in flux
_MAX_UNAUTHENTICATED = 32
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_log = logging.getLogger("stalwart.agent.peerwatch")
_WARN_AFTER = 3  # failed connects in a row (one a second) before the warning
_BYE = b"B"  # sent before a deliberate close


def parse_hello(line: bytes) -> tuple[int, str] | None:
    """``(node, mac)`` of a watch hello line, or None for anything malformed: not one
    JSON object, another version, a node id that is not an integer in 0..2^31, a MAC
    that is not 64 hex characters. Never raises."""
    try:
        hello = json.loads(line, parse_constant=_reject)
    except (ValueError, RecursionError):  # JSONDecodeError and our _reject are ValueErrors
        return None
    if not isinstance(hello, dict):
        return None
    node, mac, version = hello.get("node"), hello.get("mac"), hello.get("v")
    if type(version) is not int or version != _VERSION:
        return None
    if type(node) is not int or not 0 <= node < 2**31:
        return None
    if not isinstance(mac, str) or not _HEX64.match(mac):
        return None
    return node, mac


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _mac(token: bytes, nonce: bytes, node: int) -> str:
    return hmac.new(token, _TAG + nonce + str(node).encode(), hashlib.sha256).hexdigest()


class PeerWatch:
    """Watch our ring predecessor's agent; keep our own connection to our successor.

    ``store``/``root`` are the job's store and key root, ``live`` returns the live node
    ids (from the membership), ``successor`` picks the ring successor among them."""

    def __init__(
        self,
        store: Any,
        root: str,
        node: int,
        token: bytes,
        host: str,
        live: Callable[[], set[int]],
        successor: Callable[[int, set[int]], int | None],
    ) -> None:
        self.store = store
        self.root = root
        self.node = node
        self.token = token
        self.live = live
        self.successor = successor
        self.closed_at: dict[int, float] = {}  # node -> when its connection ended
        self.gone = threading.Event()  # set when a lease was revoked: the agent polls now
        # ... and is woken for it: its loop waits on this pipe too (agent.py)
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._listener = socket.create_server((host, 0), backlog=LISTEN_BACKLOG)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._out: socket.socket | None = None
        self._out_node: int | None = None
        self._next_tick = 0.0
        self._dialing: str | None = None  # the watch being connected to, for the warning
        self._warned: set[str] = set()  # what the warning named (once each until it works)
        self._fails: dict[str, int] = {}  # failed ticks in a row, per watch address
        # one authenticated connection per watched predecessor (a few while the ring
        # changes); unauthenticated ones apart, the oldest evicted (coordinator/admission.py)
        self.admission = Admission(_MAX_WATCHED, _MAX_UNAUTHENTICATED, _MAX_UNAUTHENTICATED)
        threading.Thread(
            target=accept_loop,
            args=(self._listener, self.admission, self._serve, self._stop.is_set, "watch", _log),
            name="stalwart-peerwatch",
            daemon=True,
        ).start()

    def publish(self) -> None:
        self.store.put(f"{self.root}/launch/watch-node{self.node}", self.address.encode())

    # ------------------------------------------------------------ the watched side
    def _serve(self, conn: socket.socket, _peer: Any) -> None:
        node = self._handshake(conn)
        if node is None or not self.admission.promote(conn):
            return
        conn.settimeout(None)
        farewell = False
        with contextlib.suppress(OSError):
            while data := conn.recv(64):
                farewell |= _BYE in data  # a deliberate close, not a death
        if not farewell and not self._stop.is_set():
            self._peer_gone(node)

    def _handshake(self, conn: socket.socket) -> int | None:
        """The peer's node id once it proved the token, else None (dropped, ignored)."""
        deadline = time.monotonic() + _HANDSHAKE_S  # for the whole hello, not per recv
        nonce = os.urandom(16)
        try:
            conn.settimeout(_HANDSHAKE_S)
            conn.sendall(nonce)
            line = b""
            while not line.endswith(b"\n") and len(line) < _MAX_HELLO:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                conn.settimeout(left)
                piece = conn.recv(_MAX_HELLO - len(line))
                if not piece:
                    return None
                line += piece
        except OSError:
            return None
        hello = parse_hello(line)
        if hello is None:
            return None
        node, mac = hello
        return node if hmac.compare_digest(mac, _mac(self.token, nonce, node)) else None

    def _peer_gone(self, node: int) -> None:
        """The peer's process is gone unless it said goodbye: revoke its lease now.
        Only a live member acts: a node that was itself fenced (stopped past its lease)
        sees stale connection ends when it resumes and must not revoke anyone."""
        with contextlib.suppress(Exception):
            if self.store.get(f"{self.root}/members/node{self.node}") is None:
                return
            if self.store.get(f"{self.root}/agents-done/node{node}") is not None:
                return
            kv = self.store.get(f"{self.root}/members/node{node}")
            if kv is None or not kv.lease:
                return
            self.closed_at[node] = time.time()
            self.store.revoke(kv.lease)
            self.gone.set()  # the agent adopts now; the record is for the other agents
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"!")
            record = json.dumps({"by": self.node, "t": self.closed_at[node]}).encode()
            self.store.put(f"{self.root}/watch-closed/node{node}", record)

    # ------------------------------------------------------------ the watching side
    def take_gone(self) -> bool:
        """True once after this watch revoked a dead peer's lease; drains the wake pipe
        so the agent's wait blocks again."""
        if not self.gone.is_set():
            return False
        self.gone.clear()
        with contextlib.suppress(OSError):
            os.read(self.wake_fd, 64)
        return True

    def tick(self, now: float) -> None:
        """Keep one connection to our current ring successor (called from the agent's
        poll; looks at the membership at most once a second)."""
        if now < self._next_tick:
            return
        self._next_tick = now + 1.0
        try:
            self._connect()
        except Exception as err:  # the store or the peer; tried again at the next tick
            self._unreachable(err)

    def _connect(self) -> None:
        target = self.successor(self.node, self.live())
        if target == self._out_node and self._out is not None:
            return
        self._drop()
        self._dialing = None
        if target is None:
            return
        kv = self.store.get(f"{self.root}/launch/watch-node{target}")
        if kv is None:
            return  # not published yet: next tick
        self._dialing = f"node {target}'s watch at {kv.value.decode()}"
        host, port = kv.value.decode().rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=_HANDSHAKE_S)
        try:
            nonce = b""
            while len(nonce) < 16:
                piece = sock.recv(16 - len(nonce))
                if not piece:
                    raise OSError("watch listener closed during the handshake")
                nonce += piece
            hello = {"v": _VERSION, "node": self.node, "mac": _mac(self.token, nonce, self.node)}
            sock.sendall(json.dumps(hello).encode() + b"\n")
        except OSError:
            sock.close()
            raise
        self._out, self._out_node = sock, target
        self._warned.discard(self._dialing)
        self._fails.pop(self._dialing, None)

    def _unreachable(self, err: Exception) -> None:
        """Say once per peer (until it connects) that it cannot be watched: across hosts a
        watch address that does not route (a loopback ``--replica-host``, a firewall)
        would otherwise leave the node's death to its lease expiry, in silence."""
        what = self._dialing or "the job's store (the peer watch's ring)"
        self._fails[what] = self._fails.get(what, 0) + 1
        # a peer that is leaving refuses once or twice; one that never answers is a fault
        if what in self._warned or self._fails[what] < _WARN_AFTER:
            return
        self._warned.add(what)
        _log.warning(
            "peer watch: cannot connect to %s (%s); a death there is seen only when its "
            "lease expires: check that this host reaches it (--replica-host, the ports in "
            "docs/launch.md)",
            what,
            err,
        )

    def _drop(self) -> None:
        """Close our connection deliberately (successor changed, or we leave)."""
        if self._out is not None:
            with contextlib.suppress(OSError):
                self._out.sendall(_BYE)
            with contextlib.suppress(OSError):
                self._out.close()
        self._out, self._out_node = None, None

    def close(self) -> None:
        """After the goodbye (``agents-done``) is written: our successor ignores the end."""
        self._stop.set()
        self._drop()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        with contextlib.suppress(OSError):
            self._listener.close()
        self.admission.close_all(1.0)
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
