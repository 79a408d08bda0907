"""Nobody without the token locks members out: unauthenticated connections are held in a
pool of their own (oldest evicted), handshakes and frames have whole deadlines, and no
error ends the accept loop."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from stalwart.coordinator import StoreClient, StoreServer, StoreServerConfig, wire
from stalwart.coordinator.admission import Admission, accept_loop
from stalwart.errors import ConfigError

from .conftest import TOKEN, client_config, wait_until
from .test_server import RawConn


class Dribbler:
    """Holds ``count`` unauthenticated connections, each sending one byte every
    ``every`` seconds, and reopens every one the server drops (an attacker)."""

    def __init__(self, port: int, count: int, every: float = 0.2) -> None:
        self.port, self.count, self.every = port, count, every
        self.socks: list[socket.socket] = []
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Dribbler:
        for _ in range(self.count):
            self.socks.append(self._open())
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()

    def _open(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setblocking(False)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for i, s in enumerate(self.socks):
                try:
                    s.send(b"\x00")  # a length byte of a frame that never completes
                    with_data = s.recv(4096)  # drain the hello; b"" once the server closed
                    if with_data == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    self.dropped += 1
                    s.close()
                    try:
                        self.socks[i] = self._open()
                    except OSError:
                        self.socks[i] = socket.socket()  # retried at the next round


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(TOKEN, StoreServerConfig(handshake_timeout=2.0)) as srv:
        yield srv


def test_a_member_gets_in_while_many_dribbling_sockets_are_held(server: StoreServer) -> None:
    cfg = server.config
    with Dribbler(server.port, 150) as attack:
        assert wait_until(lambda: server.stats["evicted"] + server.stats["refused"] > 0, timeout=30)
        with StoreClient(
            "127.0.0.1", server.port, TOKEN, client_config(reconnect_timeout=20.0)
        ) as client:
            assert client.ping() >= 0
            # a lease longer than the test: the key must outlive the second client's way
            # in through the flood (a 5 s lease expired first on a loaded machine)
            lease = client.grant(120.0)
            assert client.keepalive(lease) == 120.0
            client.put("k", b"v", lease)
        # and new connections keep getting in while the flood goes on
        with StoreClient("127.0.0.1", server.port, TOKEN, client_config()) as again:
            assert again.get("k") is not None
        stats = server.stats
        assert stats["unauthenticated"] <= cfg.max_unauthenticated
        assert stats["authenticated"] <= 2
        # the dribbled handshakes end at their deadline, or are evicted: none lives on
        assert wait_until(lambda: attack.dropped >= attack.count, timeout=30)


def test_a_dribbled_handshake_is_cut_at_its_deadline(server: StoreServer) -> None:
    """One byte every 0.2 s, forever: a per-recv timeout would never fire."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    stop = threading.Event()

    def dribble() -> None:
        try:
            sock.sendall((4000).to_bytes(4, "big"))
            while not stop.wait(0.2):
                sock.send(b"x")
        except OSError:
            pass

    t = threading.Thread(target=dribble)
    try:
        wire.recv_frame(sock, 4096)  # the hello
        t.start()
        sock.settimeout(30)
        ended = "open"
        try:
            while sock.recv(4096):
                pass
            ended = "closed"
        except TimeoutError:
            ended = "still open after 30 s"
        except OSError:
            ended = "closed"
        assert ended == "closed"
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        sock.close()
    assert wait_until(lambda: server.stats["unauthenticated"] == 0, timeout=10)


def test_an_authenticated_frame_must_arrive_whole() -> None:
    with StoreServer(TOKEN, StoreServerConfig(frame_timeout=0.5)) as server:
        raw = RawConn(server.port)
        try:
            assert raw.handshake()["type"] == "auth_ok"
            stop = threading.Event()

            def dribble() -> None:  # a 4-byte length, then one byte of body per 0.1 s
                try:
                    raw.sock.sendall((1000).to_bytes(4, "big"))
                    while not stop.wait(0.1):
                        raw.sock.send(b"x")
                except OSError:
                    pass

            t = threading.Thread(target=dribble)
            t.start()
            try:
                assert raw.closed_by_peer(timeout=30)
            finally:
                stop.set()
                t.join()
        finally:
            raw.close()


def test_deeply_nested_json_before_auth_is_a_protocol_error(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        wire.recv_frame(sock, 4096)
        body = b"[" * 4000 + b"]" * 4000
        wire.send_frame(sock, wire.ZERO_MAC, body[: 4096 - 40])
        _, reply = wire.recv_frame(sock, 4096)
    finally:
        sock.close()
    assert wire.decode(reply)["error"]["code"] == "bad_frame"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    with StoreClient("127.0.0.1", server.port, TOKEN, client_config()) as client:
        assert client.ping() >= 0


@pytest.mark.parametrize(
    "ttl", [b"Infinity", b"NaN", b"-Infinity", b"1e400", b"-1", b"0", b"1e12", b'"5"', b"true"]
)
def test_a_lease_ttl_out_of_bounds_is_refused(server: StoreServer, ttl: bytes) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        raw.send_body(b'{"op":"grant","args":{"ttl":' + ttl + b"}}")
        reply = raw.reply()
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        assert len(reply["error"]["message"]) < 300
        assert raw.request({"op": "ping", "args": {}})["ok"] is True  # connection kept
    finally:
        raw.close()


class _TwoConnections:
    """accept() hands out two real connections, then stops the loop."""

    def __init__(self, stop: threading.Event) -> None:
        self.pairs = [socket.socketpair() for _ in range(2)]
        self.stop = stop

    def accept(self) -> tuple[socket.socket, Any]:
        if self.pairs:
            conn, _ = self.pairs.pop(0)
            return conn, (f"10.0.0.{2 - len(self.pairs)}", 1)
        self.stop.set()
        raise OSError(errno.EBADF, "closed")


def test_thread_start_failure_does_not_end_the_accept_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica receiver's and the peer watch's accept loop (a thread per connection;
    the store server has its event loop, no thread per connection)."""
    real_start = threading.Thread.start
    failed = threading.Event()

    def start_once_failing(self: threading.Thread) -> None:
        if self.name.startswith("test-") and not failed.is_set():
            failed.set()
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    stop = threading.Event()
    served: list[Any] = []
    listener = _TwoConnections(stop)
    accept_loop(
        listener,  # type: ignore[arg-type]
        Admission(4, 4, 4),
        lambda conn, peer: served.append(peer),
        stop.is_set,
        "test",
        logging.getLogger("test"),
    )
    assert failed.is_set()  # the first connection got no thread and was dropped
    assert wait_until(lambda: served == [("10.0.0.2", 1)], timeout=10)


class _FlakyListener:
    """accept() fails with EMFILE once, then hands out one real connection."""

    def __init__(self, conn: socket.socket, stop: threading.Event) -> None:
        self.calls = 0
        self.conn, self.stop = conn, stop

    def accept(self) -> tuple[socket.socket, Any]:
        self.calls += 1
        if self.calls == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        if self.calls == 2:
            return self.conn, ("10.0.0.1", 1)
        self.stop.set()
        raise OSError(errno.EBADF, "closed")


def test_a_failed_accept_does_not_end_the_accept_loop() -> None:
    a, b = socket.socketpair()
    stop = threading.Event()
    served: list[Any] = []
    listener = _FlakyListener(a, stop)
    admission = Admission(4, 4, 4)
    accept_loop(
        listener,  # type: ignore[arg-type]
        admission,
        lambda conn, peer: served.append(peer),
        stop.is_set,
        "test",
        logging.getLogger("test"),
    )
    assert wait_until(lambda: served == [("10.0.0.1", 1)], timeout=10)
    assert listener.calls == 3
    b.close()


def test_admission_evicts_the_oldest_of_the_busiest_peer() -> None:
    adm = Admission(
        max_authenticated=1, max_unauthenticated=4, max_unauthenticated_per_peer=3, min_age=0.0
    )
    pairs = [socket.socketpair() for _ in range(6)]
    try:
        mine, theirs = [p[0] for p in pairs], [p[1] for p in pairs]
        adm.admit(mine[0], "honest")
        for s in mine[1:4]:
            adm.admit(s, "flood")
        adm.admit(mine[4], "flood")  # over the per-peer cap: the flood's oldest goes
        assert theirs[1].recv(1) == b""  # shut down by the eviction
        adm.admit(mine[5], "other")  # over the global cap: the busiest peer's oldest goes
        assert theirs[2].recv(1) == b""
        assert adm.counts() == (4, 0)
        assert adm.promote(mine[0]) and not adm.promote(mine[5])  # authenticated cap: 1
        assert not adm.promote(mine[1])  # evicted: never authenticated
        assert adm.stats == {"accepted": 6, "evicted": 2, "refused": 1, "authenticated": 1}
        for s in mine:
            adm.release(s)
        assert adm.counts() == (0, 0)
    finally:
        for p in pairs:
            p[0].close()
            p[1].close()
    with pytest.raises(ConfigError):
        Admission(0, 1, 1)


def test_a_flooding_address_cannot_churn_faster_than_its_connections_age() -> None:
    adm = Admission(max_authenticated=1, max_unauthenticated=8, max_unauthenticated_per_peer=2)
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        assert adm.admit(pairs[0][0], "flood") and adm.admit(pairs[1][0], "flood")
        assert not adm.admit(pairs[2][0], "flood")  # its oldest is younger than min_age
        assert adm.admit(pairs[3][0], "other")  # another address is not affected
        assert adm.stats["refused"] == 1 and adm.counts() == (3, 0)
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_closing_while_the_accept_loop_starts_a_thread_joins_only_started_ones() -> None:
    """The accept loop tracks a connection's thread before it starts it: a close in
    between (a peer watch closed while a probe's extra connections were being accepted)
    used to join a thread not yet started, a RuntimeError out of the agent's teardown."""
    admission = Admission(4, 4, 4)
    a, b = socket.socketpair()
    try:
        assert admission.admit(a, "127.0.0.1")
        admission.track(a, threading.Thread(target=lambda: None, daemon=True))  # not started
        admission.close_all(1.0)
    finally:
        a.close()
        b.close()
