"""The job's generation, told by the agent to its own workers over a local socket
(worker contract ``gen_relay``; the format: docs/worker-contract.md).

Every worker used to follow the generation with a store watch of its own: a long-poll
per worker per wait in steady state, and one answer per worker per failure. The agent
already follows it (agent/cluster/_genfeed.py), so a node of 8 workers asked the store
9 times for one number: at 1,024 nodes of 8, ~8,000 of a failure's ~10,000 generation
answers, on the coordinator that every node waits on then (docs/scale.md). The relay
passes what the agent's watch delivers to its workers over a Unix socket of the
abstract namespace: no file to clean up after a killed agent, and a random name.

The relay holds no thread. A worker connects, then reads the generation from the store
once; a connection waits in the listen queue until the next :meth:`GenerationRelay.tend`
(the agent's store poll, ten a second) or :meth:`GenerationRelay.publish` accepts it,
and every generation published after the connect reaches it: nothing falls between the
worker's read and its first line. A worker that does not read, or is gone, is dropped
at the next send (a send never blocks the agent); it then watches the store itself, as
does a worker whose relay ended or never opened.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import threading

__all__ = ["GenerationRelay", "listen_local", "own_user"]

_BACKLOG = 128  # workers connecting between two tends (a node's restart: 8, or 72 and spares)


def listen_local(kind: str, backlog: int) -> tuple[socket.socket, str]:
    """A non-blocking listening Unix socket of the abstract namespace named
    ``stalwart-<kind>-`` and 24 random hex digits, and its address in the contract's
    notation (``@name``); OSError where none can be made."""
    name = f"stalwart-{kind}-{secrets.token_hex(12)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock, "@" + name


def own_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of ``sock`` runs as this agent's user
    (``SO_PEERCRED``): an abstract socket's name is listed in /proc/net/unix for anyone
    on the host, so its random part keeps no one out."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    return bool(struct.unpack("3i", creds)[1] == os.getuid())


class GenerationRelay:
    """A listening Unix socket at :attr:`address` that sends each new generation, one
    ASCII line, to every worker connected."""

    def __init__(self) -> None:
        sock, self.address = listen_local("gen", _BACKLOG)
        self._sock: socket.socket | None = sock
        self._workers: list[socket.socket] = []
        self._sent = 0
        self._lock = threading.Lock()

    def tend(self) -> None:
        """Accept the workers waiting to connect (they hear from the next publish on)."""
        with self._lock:
            self._accept()

    def publish(self, generation: int) -> None:
        """Tell every connected worker ``generation`` (once per new number)."""
        with self._lock:
            if self._sock is None or generation <= self._sent:
                return
            self._accept()
            self._sent = generation
            line = f"{generation}\n".encode()
            kept = []
            for conn in self._workers:
                try:
                    if conn.send(line) == len(line):
                        kept.append(conn)
                        continue
                except OSError:  # gone, or its buffer full: it watches the store instead
                    pass
                conn.close()
            self._workers = kept

    def _accept(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # none waiting (BlockingIOError), or the socket closed
                return
            if not own_user(conn):  # another user's process hears nothing of ours
                conn.close()
                continue
            conn.setblocking(False)
            self._workers.append(conn)

    def close(self) -> None:
        """Stop listening; every connected worker sees its relay end."""
        with self._lock:
            sock, self._sock = self._sock, None
            workers, self._workers = self._workers, []
        if sock is not None:
            sock.close()
        for conn in workers:
            with contextlib.suppress(OSError):
                conn.close()
