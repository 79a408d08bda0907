"""The metrics endpoint cannot be held shut by idle or dribbling connections."""

from __future__ import annotations

import socket
import urllib.request

from stalwart.metrics.prometheus import MetricsExporter


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
