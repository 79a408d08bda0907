"""The network server and client: auth, malformed input, limits, reconnects, retries."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest

from stalwart.coordinator import (
    AuthenticationError,
    FrameTooLargeError,
    MemoryStore,
    ProtocolError,
    StoreClient,
    StoreClosedError,
    StoreServer,
    StoreServerConfig,
    StoreUnavailableError,
    wire,
)
from stalwart.errors import ConfigError

from .conftest import TOKEN, client_config, wait_until


class RawConn:
    """A hand-driven protocol peer, to send what a well-behaved client never would."""

    def __init__(self, port: int, token: bytes = TOKEN, version: Any = wire.PROTOCOL_VERSION):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.token = token
        self.version = version
        self.key = b""
        self.wseq = self.rseq = 0

    def handshake(self) -> dict[str, Any]:
        _, body = wire.recv_frame(self.sock, 4096)
        hello = wire.decode(body)
        sn = wire.b64d(hello["nonce"])
        cn = os.urandom(wire.NONCE_SIZE)
        auth = wire.encode({"type": "auth", "v": self.version, "nonce": wire.b64e(cn)})
        wire.send_frame(self.sock, wire.auth_mac(self.token, b"c", sn, cn, auth), auth)
        _, body = wire.recv_frame(self.sock, 4096)
        self.key = wire.session_key(self.token, sn, cn)
        return wire.decode(body)

    def send_body(self, body: bytes, mac: bytes | None = None) -> None:
        if mac is None:
            mac = wire.frame_mac(self.key, b"C", self.wseq, body)
        wire.send_frame(self.sock, mac, body)
        self.wseq += 1

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.send_body(wire.encode(obj))
        return self.reply()

    def reply(self) -> dict[str, Any]:
        mac, body = wire.recv_frame(self.sock, 1 << 24)
        if self.key:  # replies after the handshake are MAC'd by the server too
            assert wire.mac_ok(wire.frame_mac(self.key, b"S", self.rseq, body), mac)
        self.rseq += 1
        return wire.decode(body)

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(4096):
                pass
        except TimeoutError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        self.sock.close()


def _error_code(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False, reply
    return str(reply["error"]["code"])


def test_wrong_token_is_rejected_and_server_keeps_serving(server: StoreServer) -> None:
    bad = StoreClient("127.0.0.1", server.port, b"f" * 32, client_config())
    with bad, pytest.raises(AuthenticationError, match="wrong job token"):
        bad.ping()
    assert server.stats["auth_failures"] == 1
    with StoreClient("127.0.0.1", server.port, TOKEN, client_config()) as good:
        assert good.put("k", b"v") == 1


def test_client_rejects_a_server_without_the_token() -> None:
    with (
        StoreServer(b"s" * 32) as impostor,
        StoreClient("127.0.0.1", impostor.port, TOKEN, client_config()) as c,
        pytest.raises(AuthenticationError),
    ):
        c.ping()


def test_token_never_crosses_the_wire(server: StoreServer) -> None:
    raw = RawConn(server.port)
    try:
        assert raw.handshake()["type"] == "auth_ok"
        reply = raw.request({"op": "ping", "args": {}})
        assert reply["ok"] is True
    finally:
        raw.close()
    # the handshake frames hold nonces and MACs only; the token itself is never sent
    assert TOKEN.hex() not in repr(reply)


def test_garbage_bytes_get_an_error_reply_not_a_crash(server: StoreServer) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        wire.recv_frame(sock, 4096)  # hello
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _, body = wire.recv_frame(sock, 4096)
        assert _error_code(wire.decode(body)) == "too_large"
    finally:
        sock.close()
    assert wait_until(lambda: server.stats["rejected"] == 1, 5)
    with StoreClient("127.0.0.1", server.port, TOKEN, client_config()) as c:
        assert c.ping() == 0


def test_unsupported_protocol_version_is_named(server: StoreServer) -> None:
    raw = RawConn(server.port, version=99)
    try:
        reply = raw.handshake()
        assert _error_code(reply) == "unsupported_version"
        assert "99" in reply["error"]["message"]
    finally:
        raw.close()


def test_frame_with_a_bad_mac_closes_only_that_connection(server: StoreServer) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        raw.send_body(wire.encode({"op": "put", "args": {"key": "x", "value": ""}}), bytes(32))
        assert _error_code(raw.reply()) == "auth_failed"
        assert raw.closed_by_peer()
    finally:
        raw.close()
    assert server.store.get("x") is None
    assert server.stats["auth_failures"] == 1


def test_replayed_frame_is_rejected(server: StoreServer) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        body = wire.encode({"op": "put", "args": {"key": "x", "value": wire.b64e(b"1")}})
        mac = wire.frame_mac(raw.key, b"C", raw.wseq, body)
        raw.send_body(body, mac)
        assert raw.reply()["ok"] is True
        raw.send_body(body, mac)  # same bytes again: the sequence number no longer matches
        assert _error_code(raw.reply()) == "auth_failed"
    finally:
        raw.close()
    other = RawConn(server.port)  # and on another connection: another session key
    try:
        other.handshake()
        other.send_body(body, mac)
        assert _error_code(other.reply()) == "auth_failed"
    finally:
        other.close()
    kv = server.store.get("x")
    assert kv is not None and kv.version == 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\xff\xfe not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"args": {}}', "'op'"),
        (b'{"op": "explode", "args": {}}', "unknown op"),
        (b'{"op": "put", "args": {"key": 7, "value": ""}}', "'key'"),
        (b'{"op": "put", "args": {"key": "k", "value": "%%%"}}', "base64"),
        (b'{"op": "grant", "args": {"ttl": true}}', "'ttl'"),
        (b'{"op": "grant", "args": {"ttl": -1}}', "ttl"),
        (
            b'{"op": "txn", "args": {"compare": [{"key": "k", "target": "x", "op": "=="}]}}',
            "target",
        ),
        (b'{"op": "watch", "args": {"start_revision": 0}}', "start_revision"),
    ],
)
def test_malformed_requests_get_bad_request_and_connection_survives(
    server: StoreServer, body: bytes, needle: str
) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        raw.send_body(body)
        reply = raw.reply()
        assert _error_code(reply) == "bad_request"
        assert needle in reply["error"]["message"]
        assert raw.request({"op": "ping", "args": {}})["ok"] is True
    finally:
        raw.close()


def test_oversized_values_and_keys_are_refused(client: StoreClient) -> None:
    with pytest.raises(FrameTooLargeError, match="exceeds"):
        client.put("big", b"x" * (2 << 20))
    with pytest.raises(FrameTooLargeError):
        client.put("k" * 5000, b"")
    assert client.put("small", b"x") == 1  # the client reconnected if it had to


def test_frame_over_the_limit_closes_the_connection(server: StoreServer) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        raw.sock.sendall((server.config.max_frame_bytes + 1).to_bytes(4, "big"))
        assert _error_code(raw.reply()) == "too_large"
        assert raw.closed_by_peer()
    finally:
        raw.close()


def test_stalled_half_frame_is_dropped() -> None:
    with StoreServer(TOKEN, StoreServerConfig(frame_timeout=0.3)) as server:
        raw = RawConn(server.port)
        try:
            raw.handshake()
            raw.sock.sendall(b"\x00\x00")  # half a length prefix, then nothing
            assert raw.closed_by_peer(timeout=5.0)
        finally:
            raw.close()


def test_connection_limit_answers_with_an_error() -> None:
    with StoreServer(TOKEN, StoreServerConfig(max_connections=2)) as server:
        held = [RawConn(server.port) for _ in range(2)]
        try:
            for r in held:
                r.handshake()
            # the client's handshake ends before the server moves the connection into its
            # authenticated pool: an extra one before that is a pending one (a challenge)
            deadline = time.monotonic() + 10
            while server.stats["authenticated"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.stats["authenticated"] == 2
            extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            try:
                _, body = wire.recv_frame(extra, 4096)
                assert _error_code(wire.decode(body)) == "too_many_connections"
            finally:
                extra.close()
        finally:
            for r in held:
                r.close()


def test_retried_mutation_with_same_request_id_applies_once(server: StoreServer) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        req = {"op": "put", "rid": "r1", "args": {"key": "k", "value": wire.b64e(b"v")}}
        first = raw.request(req)
        again = raw.request(req)
    finally:
        raw.close()
    assert first == again == {"ok": True, "result": {"revision": 1}}
    kv = server.store.get("k")
    assert kv is not None and kv.version == 1


def test_client_reconnects_to_a_restarted_server() -> None:
    store = MemoryStore()
    server = StoreServer(TOKEN, store=store).start()
    port = server.port
    with StoreClient("127.0.0.1", port, TOKEN, client_config()) as c:
        c.put("a", b"1")
        server.stop()
        restarted: list[StoreServer] = []
        timer = threading.Timer(
            0.3,
            lambda: restarted.append(
                StoreServer(TOKEN, StoreServerConfig(port=port), store=store).start()
            ),
        )
        timer.start()
        try:
            assert c.put("b", b"2") == 2  # retried across the outage, applied once
            assert [kv.key for kv in c.range("").kvs] == ["a", "b"]
        finally:
            timer.join()
            for s in restarted:
                s.stop()
    store.close()


def test_client_gives_up_after_its_reconnect_deadline() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once the socket closes
    c = StoreClient("127.0.0.1", port, TOKEN, client_config(reconnect_timeout=0.5))
    started = time.monotonic()
    with c, pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port} unreachable"):
        c.get("x")
    assert time.monotonic() - started < 3.0


def test_closed_client_raises(client: StoreClient) -> None:
    client.ping()
    client.close()
    with pytest.raises(StoreClosedError):
        client.get("x")


def test_watch_long_poll_survives_server_stop_promptly() -> None:
    server = StoreServer(TOKEN).start()
    c = StoreClient("127.0.0.1", server.port, TOKEN, client_config(reconnect_timeout=0.3))
    errors: list[BaseException] = []

    def watcher() -> None:
        try:
            with c.watch("w/") as w:
                w.get(timeout=30)
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=watcher)
    t.start()
    assert wait_until(lambda: server.stats["requests"] >= 2, 5)
    started = time.monotonic()
    server.stop()
    t.join(10)
    c.close()
    assert not t.is_alive() and time.monotonic() - started < 5
    assert errors and isinstance(errors[0], StoreUnavailableError | StoreClosedError)


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="port"):
        StoreServerConfig(port=70000)
    with pytest.raises(ConfigError, match="max_frame_bytes"):
        StoreServerConfig(max_frame_bytes=1000)
    with pytest.raises(ConfigError, match="token"):
        StoreServer(b"short")


def test_bind_conflict_is_a_clear_error(server: StoreServer) -> None:
    with pytest.raises(ConfigError, match="cannot bind"):
        StoreServer(TOKEN, StoreServerConfig(port=server.port)).start()


def test_protocol_error_classes_map_from_codes() -> None:
    assert isinstance(wire.error_from_reply({"code": "bad_request", "message": "m"}), ProtocolError)
    assert isinstance(wire.error_from_reply("nonsense"), ProtocolError)


def test_frame_shorter_than_its_mac_is_bad_frame(server: StoreServer) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        raw.sock.sendall((10).to_bytes(4, "big") + b"x" * 10)
        reply = raw.reply()
        assert _error_code(reply) == "bad_frame" and "MAC" in reply["error"]["message"]
        assert raw.closed_by_peer()
    finally:
        raw.close()
