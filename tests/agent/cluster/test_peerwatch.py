"""The watched connection: a peer whose process is gone loses its lease at once."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.agent.cluster._cluster import ring_successor
from stalwart.agent.cluster._peerwatch import PeerWatch, parse_hello
from stalwart.coordinator import MemoryStore

ROOT = "/stalwart/job"
TOKEN = b"t" * 32
_anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),
    st.text(max_size=70),
    st.lists(st.integers(), max_size=3),
)
_hellos = st.fixed_dictionaries(
    {},
    optional={
        "v": st.one_of(st.just(1), _anything),
        "node": _anything,
        "mac": st.one_of(st.just("a" * 64), _anything),
    },
).map(lambda d: json.dumps(d).encode() + b"\n")


def _member(store: MemoryStore, node: int) -> int:
    lease = store.grant(30.0)
    store.put(f"{ROOT}/members/node{node}", b"{}", lease)
    return lease


def _pair(store: MemoryStore) -> tuple[PeerWatch, PeerWatch]:
    live = {0, 1}
    watches = tuple(
        PeerWatch(store, ROOT, n, TOKEN, "127.0.0.1", lambda: live, ring_successor) for n in (0, 1)
    )
    for w in watches:
        w.publish()
    return watches[0], watches[1]


def _wait(cond: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def pair() -> Iterator[tuple[MemoryStore, PeerWatch, PeerWatch]]:
    """Nodes 0 and 1, both members, each watching the other's ring position."""
    store = MemoryStore()
    _member(store, 0)
    _member(store, 1)
    w0, w1 = _pair(store)
    yield store, w0, w1
    w0.close()
    w1.close()


def test_a_dead_peer_loses_its_lease_at_once(
    pair: tuple[MemoryStore, PeerWatch, PeerWatch],
) -> None:
    store, _w0, w1 = pair
    w1.tick(time.monotonic())  # node 1 connects to its successor, node 0
    assert w1._out_node == 0
    assert w1._out is not None
    w1._out.close()  # what the kernel does when node 1's process dies (no farewell)
    assert _wait(lambda: store.get(f"{ROOT}/members/node1") is None)
    assert store.get(f"{ROOT}/members/node0") is not None
    record = store.get(f"{ROOT}/watch-closed/node1")
    assert record is not None and json.loads(record.value)["by"] == 0


def test_a_deliberate_close_or_a_fenced_watcher_revokes_nothing(
    pair: tuple[MemoryStore, PeerWatch, PeerWatch],
) -> None:
    store, _w0, w1 = pair
    w1.tick(time.monotonic())
    w1._drop()  # node 1's successor changed: it closes on purpose
    assert not _wait(lambda: store.get(f"{ROOT}/members/node1") is None, timeout=0.5)
    store.delete(f"{ROOT}/members/node0")  # node 0 itself lost its lease (fenced)
    w1._next_tick = 0.0
    w1.tick(time.monotonic())
    assert w1._out is not None
    w1._out.close()
    assert not _wait(lambda: store.get(f"{ROOT}/members/node1") is None, timeout=0.5)


def test_a_goodbye_is_not_a_loss(
    pair: tuple[MemoryStore, PeerWatch, PeerWatch],
) -> None:
    store, _w0, w1 = pair
    w1.tick(time.monotonic())
    store.put(f"{ROOT}/agents-done/node1", b"1")
    w1.close()
    assert not _wait(lambda: store.get(f"{ROOT}/members/node1") is None, timeout=0.5)
    assert store.get(f"{ROOT}/watch-closed/node1") is None


@pytest.mark.parametrize("hello", [b'{"v": 1, "node": 1, "mac": "00"}\n', b"garbage\n", b""])
def test_an_unauthenticated_connection_cannot_get_a_node_fenced(hello: bytes) -> None:
    store = MemoryStore()
    _member(store, 1)
    w0 = PeerWatch(store, ROOT, 0, TOKEN, "127.0.0.1", lambda: {0, 1}, ring_successor)
    try:
        host, port = w0.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.recv(16)
            s.sendall(hello)
        assert not _wait(lambda: store.get(f"{ROOT}/members/node1") is None, timeout=0.5)
    finally:
        w0.close()


@pytest.mark.parametrize(
    "line",
    [
        b'{"v": 1, "node": 1e400, "mac": "' + b"0" * 64 + b'"}\n',
        b'{"v": 1, "node": "1", "mac": "' + b"0" * 64 + b'"}\n',
        b'{"v": 1, "node": true, "mac": "' + b"0" * 64 + b'"}\n',
        b'{"v": 1, "node": -1, "mac": "' + b"0" * 64 + b'"}\n',
        b'{"v": 1, "node": NaN, "mac": "' + b"0" * 64 + b'"}\n',
        b'{"v": 1.0, "node": 1, "mac": "' + b"0" * 64 + b'"}\n',
        b'{"v": 1, "node": 1, "mac": 5}\n',
        b"[" * 500 + b"\n",
        b"1" * 5000,
    ],
)
def test_a_malformed_hello_is_dropped_without_an_error(line: bytes) -> None:
    assert parse_hello(line) is None


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=600), _hellos))
def test_parse_hello_never_raises(line: bytes) -> None:
    got = parse_hello(line)
    assert got is None or (type(got[0]) is int and len(got[1]) == 64)


def test_the_watch_survives_a_flood_and_fuzzed_hellos() -> None:
    """Dozens of silent or garbage-sending sockets, then a real predecessor's death is
    still seen at once; the unauthenticated pool stays capped."""
    store = MemoryStore()
    _member(store, 0)
    _member(store, 1)
    w0, w1 = _pair(store)
    host, port = w0.address.rsplit(":", 1)
    junk = [socket.create_connection((host, int(port)), timeout=5) for _ in range(80)]
    try:
        for i, s in enumerate(junk):
            if i % 2:
                s.sendall(b'{"v": 1, "node": 1e400, "mac": "x"}\n')
        stats = w0.admission
        assert _wait(lambda: stats.stats["accepted"] + stats.stats["refused"] >= 80)
        assert _wait(lambda: stats.stats["evicted"] + stats.stats["refused"] > 0)  # 40 > 32
        assert w0.admission.counts()[0] <= 32

        def watched() -> bool:  # from the flood's own address it may take a retry
            if w0.admission.counts()[1] == 1:
                return True
            w1._drop()
            w1._next_tick = 0.0
            w1.tick(time.monotonic())
            return _wait(lambda: w0.admission.counts()[1] == 1, timeout=0.5)

        assert _wait(watched)  # node 1 is watched
        assert w1._out is not None
        w1._out.close()  # node 1 dies
        assert _wait(lambda: store.get(f"{ROOT}/members/node1") is None)
    finally:
        for s in junk:
            s.close()
        w0.close()
        w1.close()


def test_a_watch_that_cannot_connect_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    """Across hosts a loopback or firewalled watch address leaves a death to the lease
    expiry: the watching side says so (issue 25: it used to swallow every error)."""
    store = MemoryStore()
    w0, w1 = _pair(store)
    try:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        store.put(f"{ROOT}/launch/watch-node1", dead.encode())
        with caplog.at_level("WARNING", logger="stalwart.agent.peerwatch"):
            for tick in range(6):
                w0.tick(float(tick) * 2)
        said = [r.getMessage() for r in caplog.records if "cannot connect" in r.getMessage()]
        assert len(said) == 1 and f"node 1's watch at {dead}" in said[0], said
    finally:
        w0.close()
        w1.close()
