"""The watched connection: a peer whose process is gone loses its lease at once."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from stalwart.agent._cluster import ring_successor
from stalwart.agent._peerwatch import PeerWatch
from stalwart.coordinator import MemoryStore

ROOT = "/stalwart/job"
TOKEN = b"t" * 32


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
