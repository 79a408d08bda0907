"""An etcd watch whose stream etcd answers late (issue 31: a loaded etcd at 512 nodes):
the open is waited for across ``get`` calls, not abandoned at each caller's timeout for
a new one (every abandoned open was more of the loaded etcd's work)."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import pytest

from stalwart.coordinator._etcd_http import Endpoint, GatewayClient
from stalwart.coordinator._etcd_watch import EtcdWatch


class _LateEtcd:
    """A socket that answers each watch request ``late_s`` after it came (a fault of the
    fake etcd, injected in its own thread), then streams one event."""

    def __init__(self, late_s: float) -> None:
        self.late_s = late_s
        self.accepted = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)  # the request
            time.sleep(self.late_s)  # the injected lateness
            kv = {"key": base64.b64encode(b"/j/gen").decode(), "value": "Mw==", "mod_revision": "7"}
            line = json.dumps({"result": {"events": [{"kv": kv}]}}).encode() + b"\n"
            head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            conn.sendall(head + f"{len(line):x}\r\n".encode() + line + b"\r\n")
        except OSError:
            pass

    def close(self) -> None:
        import contextlib

        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.sock.close()
        self._thread.join(5)
        for conn in self._conns:
            conn.close()


def _watch(etcd: _LateEtcd) -> EtcdWatch:
    """A watch of ``/j/gen`` (from revision 1) over the fake etcd."""
    http = GatewayClient(
        [Endpoint("127.0.0.1", etcd.port)],
        connect_timeout=5.0,
        request_timeout=30.0,
        reconnect_timeout=30.0,
    )
    return EtcdWatch(http, b"/j/gen", 2, 1)


def test_a_late_answer_is_waited_for_across_short_gets_not_reopened() -> None:
    etcd = _LateEtcd(late_s=0.4)
    watch = _watch(etcd)
    try:
        deadline = time.monotonic() + 20
        events = []
        while not events:  # a caller polling with 10 ms waits (rank 0 gathering, say)
            assert time.monotonic() < deadline, "the late answer never arrived"
            events = watch.get(timeout=0.01)
        assert [e.kv.value for e in events] == [b"3"]
        assert etcd.accepted == 1  # one open, answered late; it was a new one per get
    finally:
        watch.close()
        etcd.close()


def test_a_watch_whose_socket_is_past_descriptor_1024_still_delivers() -> None:
    """select() refuses descriptors from 1,024 up: an emulator process of 128 nodes (5
    watches each, and their connections) passed it, and every watch past it failed to
    open, again and again, until the nodes lived on rereads (1,024 nodes on etcd: loss
    to agreement 32 s, the request timeout). The watch waits with poll()."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} descriptors; the test needs 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler: list[int] = []
    etcd = _LateEtcd(late_s=0.0)
    watch = _watch(etcd)
    try:
        while not filler or filler[-1] < 1100:  # every descriptor below 1,100 taken:
            filler.append(os.open(os.devnull, os.O_RDONLY))  # the watch's socket is above
        deadline = time.monotonic() + 20
        events = []
        while not events:
            assert time.monotonic() < deadline, "a watch past descriptor 1,024 never opened"
            events = watch.get(timeout=0.05)
        assert watch._sock is not None and watch._sock.fileno() >= 1024
        assert [e.kv.value for e in events] == [b"3"]
        assert etcd.accepted == 1
    finally:
        watch.close()
        etcd.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
