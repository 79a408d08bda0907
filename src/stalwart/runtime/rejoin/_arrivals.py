"""The worker's end of its agent's arrival relay (agent/cluster/_arrivals.py; the wire:
coordinator/arrivals.py): an arrival and the wait for the agreement, through the agent.

Every call says when the relay could not do it (None, or :data:`BROKEN`); the caller
then asks the store itself, as a worker with no relay does. A wait abandoned before its
answer came (the deadline, the generation moved) hangs up, so that no stale answer is
read as the next one's; the next call connects again.
"""

from __future__ import annotations

import contextlib
import socket
import time

from stalwart.coordinator import Compare, Put, TxnResult
from stalwart.coordinator.arrivals import (
    MAX_LINE,
    Arrive,
    Await,
    Outcome,
    encode_arrive,
    encode_await,
    parse_reply,
)
from stalwart.runtime.comm._coord import relay_connect

__all__ = ["BROKEN", "RelayedArrivals"]

BROKEN = Outcome(broken=True)
"""A wait the relay cannot finish: ask the store."""
_SEND_S = 2.0  # the agent reads every line at once: a send that waits is a gone agent


class RelayedArrivals:
    """One connection to the agent's relay at ``address`` (``@name``), opened at need;
    ``peers``: the workers of this node (the contract's ``local_world_size``)."""

    def __init__(self, address: str, peers: int = 1) -> None:
        self.address = address
        self.peers = peers
        self._sock: socket.socket | None = None
        self._buf = b""

    def _connect(self) -> socket.socket | None:
        if self._sock is None:
            self._sock, self._buf = relay_connect(self.address), b""
        return self._sock

    def hang_up(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _ask(self, line: bytes) -> bool:
        sock = self._connect()
        if sock is None:
            return False
        try:
            sock.settimeout(_SEND_S)
            sock.sendall(line)
            return True
        except OSError:
            self.hang_up()
            return False

    def reply(self, timeout: float) -> Outcome | None:
        """The next reply within ``timeout`` (None: none yet; :data:`BROKEN`: the relay
        is gone or spoke out of format)."""
        sock = self._sock
        if sock is None:
            return BROKEN
        deadline = time.monotonic() + max(0.0, timeout)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                sock.settimeout(left)
                data = sock.recv(1 << 16)
            except TimeoutError:
                return None
            except OSError:
                data = b""
            if not data or len(self._buf) + len(data) > MAX_LINE:
                self.hang_up()
                return BROKEN
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        got = parse_reply(line)
        if got is None:
            self.hang_up()
            return BROKEN
        return got

    def arrive(self, guard: list[Compare], put: Put, timeout: float) -> TxnResult | None:
        """``put`` under ``guard`` in the agent's next transaction (None: ask the store)."""
        line = encode_arrive(Arrive(tuple(guard), put, self.peers))
        if line is None or not self._ask(line):
            return None
        got = self.reply(timeout)
        if got is None or got.broken or got.record is not None or got.end:
            self.hang_up()  # a late answer must not be read as the next one
            return None
        return TxnResult(got.ok, got.rev)

    def ask_await(self, req: Await) -> bool:
        """Ask for the agreement at ``req.key``; its answer comes from :meth:`reply`."""
        return self._ask(encode_await(req))

    def close(self) -> None:
        self.hang_up()
