"""A TCP forwarder a test can cut: a silent partition of one path on loopback."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

__all__ = ["Forwarder", "forwarder"]


class Forwarder:
    """127.0.0.1:``port`` -> ``target``, both ways, until :meth:`cut`: from then on the
    bytes are read and dropped (a blackhole: no RST, no FIN), new connections are
    accepted and never answered."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut_at: float | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._socks: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def cut(self) -> None:
        self.cut_at = time.time()

    def heal(self) -> None:
        """Forward again (connections opened during the cut stay unanswered: a client
        times them out and opens new ones, as after a real partition)."""
        self.cut_at = None

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._socks.append(conn)
            if self.cut_at is not None:
                continue  # held open, never answered (not even after a heal)
            try:
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self._socks.append(up)
            t = threading.Thread(target=self._pump, args=(conn, up), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([a, b], [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return  # one side closed (before the cut)
                    if self.cut_at is None:
                        peer[s].sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()
        for t in self._threads:
            t.join(5)


@contextlib.contextmanager
def forwarder(target: tuple[str, int]) -> Iterator[Forwarder]:
    fwd = Forwarder(target)
    try:
        yield fwd
    finally:
        fwd.close()
