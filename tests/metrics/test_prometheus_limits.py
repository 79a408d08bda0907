"""The metrics endpoint cannot be held shut by idle or dribbling connections."""

from __future__ import annotations

import select
import socket
import socketserver
import threading
import tracemalloc
import urllib.request

from _load import Deadline, scaled

from stalwart.metrics.prometheus import MetricsExporter
from stalwart.metrics.serve import (
    LISTEN_BACKLOG,
    MAX_HEAD_BYTES,
    REQUEST_DEADLINE_S,
    _BoundedHTTPServer,
)


def test_a_scrape_gets_through_while_idle_connections_are_held() -> None:
    with MetricsExporter() as exporter:
        address = ("127.0.0.1", exporter.port)
        idle = [socket.create_connection(address, timeout=5) for _ in range(40)]
        try:
            for s in idle:
                s.sendall(b"GET /metr")  # a request line that never ends
            with urllib.request.urlopen(exporter.url, timeout=30) as reply:
                assert reply.status == 200
            # the oldest of them were evicted: the server holds 16 connections at most
            closed = 0
            for s in idle[:20]:
                s.settimeout(10)
                try:
                    closed += s.recv(1) == b""
                except OSError:
                    closed += 1
            assert closed == 20
        finally:
            for s in idle:
                s.close()


def _status_then_close(s: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection."""
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return out
            out += data
    except (ConnectionResetError, BrokenPipeError):
        return out


def test_oversized_headers_are_refused_431() -> None:
    with MetricsExporter() as exporter:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (MAX_HEAD_BYTES + 10))
            reply = _status_then_close(s, scaled(30))
        assert reply.startswith(b"HTTP/1.1 431"), reply[:80]
        with urllib.request.urlopen(exporter.url, timeout=scaled(30)) as ok:
            assert ok.status == 200  # the server goes on


def test_a_dribbled_request_is_cut_at_the_total_deadline() -> None:
    """One header byte every 50 ms never finishes a request: a per-read timeout would
    hold it for ever, the total deadline closes it (408)."""
    with MetricsExporter() as exporter:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            deadline = Deadline(REQUEST_DEADLINE_S * 20)
            closed = False
            while not closed:
                assert not deadline.expired(), "the dribbling client was never cut off"
                try:
                    s.sendall(b"a")
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                readable, _, _ = select.select([s], [], [], 0.05)
                closed = bool(readable)
            reply = _status_then_close(s, scaled(10))
        assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:80]


def test_a_header_flood_stays_bounded_and_probes_answer() -> None:
    """40 clients each pushing 1 MiB of headers at once: the server buffers at most
    MAX_ACTIVE x MAX_HEAD_BYTES of them (measured: the Python heap's peak growth), and a
    probe made during the flood is answered."""
    per_client = 1 << 20
    chunk = b"X-Pad: " + b"a" * 61431 + b"\r\n"  # 60 KiB header lines, never a blank line
    with MetricsExporter() as exporter:
        address = ("127.0.0.1", exporter.port)

        def flood() -> None:
            try:
                with socket.create_connection(address, timeout=10) as s:
                    s.sendall(b"GET /metrics HTTP/1.1\r\n")
                    for _ in range(per_client // len(chunk)):
                        s.sendall(chunk)
            except OSError:
                pass  # refused with 431 and closed: what should happen

        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            threads = [threading.Thread(target=flood) for _ in range(40)]
            for t in threads:
                t.start()
            with urllib.request.urlopen(exporter.url, timeout=scaled(60)) as probe:
                assert probe.status == 200
            for t in threads:
                t.join(scaled(120))
                assert not t.is_alive()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    # the 40 MiB sent never sit in the server: a few MiB of buffers, threads and the
    # flooding clients' own chunks at most (the old server took ~6.5 MB per connection)
    assert peak < 8 << 20, f"heap grew by {peak / 2**20:.1f} MiB during the flood"


def test_a_burst_of_connections_is_queued_not_dropped() -> None:
    """While the serving thread waits (for the GIL, or the CPU under a flood), the kernel
    queues up to LISTEN_BACKLOG handshaken connections; socketserver's default of 5 let a
    burst fill the queue and a probe's SYN be dropped (retried after 1 s: the whole of a
    kubelet probe's default timeout; 8 of 15 probes failed in a flood, 0 of 14 after)."""
    server = _BoundedHTTPServer(("127.0.0.1", 0), socketserver.BaseRequestHandler)
    listener = server.socket
    clients: list[socket.socket] = []
    try:
        for _ in range(40):  # nobody accepts yet: the server is not serving
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(listener.getsockname())
            clients.append(c)
        deadline = Deadline(30)
        while True:
            _, writable, _ = select.select([], clients, [], 0.1)
            if len(writable) == len(clients) or deadline.expired():
                break
        listener.setblocking(False)
        accepted = 0
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                break
            conn.close()
            accepted += 1
        assert accepted == 40 <= LISTEN_BACKLOG
    finally:
        for c in clients:
            c.close()
        server.server_close()
