"""A TCP forwarder that delays what it passes on: ``python _delay_proxy.py LISTEN_HOST
LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_MS BOTH MARK``. Standalone (no project import):
it runs inside a lab host. Its own connections carry the socket mark ``MARK`` so the
redirect rule that sends the host's traffic here does not send them back to it.

Each direction is a reader that stamps every chunk with its due time and a writer that
sends it when due, in order: the bytes arrive ``DELAY_MS`` late, and the stream's rate is
not capped (a delayed link, not a slow one). Prints ``ready`` once it listens.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
import time

_SO_MARK = 36


def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    due: queue.Queue[tuple[float, bytes]] = queue.Queue()

    def write() -> None:
        while True:
            t, data = due.get()
            wait = t - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    threading.Thread(target=write, daemon=True).start()
    while True:
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        due.put((time.monotonic() + delay_s, data))
        if not data:
            return


def _serve(
    conn: socket.socket, target: tuple[str, int], delay_s: float, both: bool, mark: int
) -> None:
    out = socket.socket()
    out.setsockopt(socket.SOL_SOCKET, _SO_MARK, mark)
    try:
        out.connect(target)
    except OSError:
        conn.close()
        return
    threading.Thread(target=_pipe, args=(conn, out, delay_s), daemon=True).start()
    threading.Thread(target=_pipe, args=(out, conn, delay_s if both else 0.0), daemon=True).start()


def main(argv: list[str]) -> None:
    host, port, thost, tport, ms, both, mark = argv
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((host, int(port)))
    lsock.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = lsock.accept()
        _serve(conn, (thost, int(tport)), int(ms) / 1000, both == "1", int(mark))


if __name__ == "__main__":
    main(sys.argv[1:])
