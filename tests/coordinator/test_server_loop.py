"""The store server's event loop (issue 31): connections and parked long-polls cost no
thread each, one write answers every long-poll parked under it, and lease expiry is
judged on the loop: a keepalive the loop could not read in time (its process did not
run) keeps its lease, a lease nobody renews still expires while requests keep coming."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _load import scaled

from stalwart.coordinator import MemoryStore, StoreClient, StoreServer
from stalwart.coordinator._stall import STALL_S

from .conftest import TOKEN, client_config, wait_until
from .test_server import RawConn

_MANY = 60


def _held(server: StoreServer, count: int) -> list[RawConn]:
    conns = []
    for _ in range(count):  # one by one: 32 pending from one address evict each other
        conns.append(RawConn(server.port))
        assert conns[-1].handshake()["type"] == "auth_ok"
    assert wait_until(lambda: server.stats["authenticated"] == count, scaled(10))
    return conns


def test_idle_connections_cost_no_thread_each() -> None:
    before = threading.active_count()
    with StoreServer(TOKEN) as server:
        conns = _held(server, _MANY)
        try:
            for raw in conns[:5]:
                assert raw.request({"op": "ping", "args": {}})["ok"] is True
            # one thread for the server, whatever the connections (one each before)
            assert threading.active_count() - before <= 2
        finally:
            for raw in conns:
                raw.close()


def test_one_write_answers_every_long_poll_parked_under_it_without_a_thread_each() -> None:
    store = MemoryStore()
    before = threading.active_count()
    with StoreServer(TOKEN, store=store) as server:
        conns = _held(server, _MANY)
        try:
            start = store.revision + 1
            for raw in conns:
                args: dict[str, Any] = {"prefix": "gen/", "start_revision": start, "timeout": 30}
                raw.send_body(raw_body({"op": "watch", "args": args}))
            assert wait_until(lambda: server.stats["requests"] >= _MANY, scaled(10))
            assert threading.active_count() - before <= 2  # parked: no thread waits
            store.put("other/x", b"-")  # not under the prefix: nobody answered
            store.put("gen/1", b"g1")
            for raw in conns:
                reply = raw.reply()
                events = reply["result"]["events"]
                assert [e["kv"]["key"] for e in events] == ["gen/1"], reply
            # the connections still serve requests after their long-poll
            assert conns[0].request({"op": "ping", "args": {}})["ok"] is True
        finally:
            for raw in conns:
                raw.close()
    store.close()


def raw_body(obj: dict[str, Any]) -> bytes:
    from stalwart.coordinator import wire

    return wire.encode(obj)


@pytest.mark.timeout(120)
def test_a_keepalive_the_loop_could_not_read_in_time_keeps_its_lease() -> None:
    """The server's process did not run past the lease's deadline (held here by the
    store's lock) while the keepalive waited: the loop sees its pass came late, renews
    every lease, then reads the keepalive (a thread per connection expired the lease)."""
    store = MemoryStore()
    with StoreServer(TOKEN, store=store) as server:
        client = StoreClient("127.0.0.1", server.port, TOKEN, client_config())
        with client:
            lease = client.grant(0.3)
            client.put("k", b"v", lease=lease)
            result: list[Any] = []
            with store._lock:  # the store's process does not run
                t = threading.Thread(target=lambda: result.append(_renew(client, lease)))
                t.start()
                threading.Event().wait(0.3 + STALL_S + 0.5)
            t.join(scaled(30))
            assert result == [0.3]
            assert store.stalls >= 1 and client.get("k") is not None
    store.close()


def _renew(client: StoreClient, lease: int) -> Any:
    try:
        return client.keepalive(lease)
    except Exception as exc:
        return exc


@pytest.mark.timeout(120)
def test_a_lease_nobody_renews_expires_while_requests_keep_coming() -> None:
    store = MemoryStore()
    with StoreServer(TOKEN, store=store) as server:
        clients = [StoreClient("127.0.0.1", server.port, TOKEN, client_config()) for _ in range(4)]
        stop = threading.Event()

        def burst(c: StoreClient) -> None:
            while not stop.is_set():
                c.get("busy")

        threads = [threading.Thread(target=burst, args=(c,)) for c in clients[1:]]
        try:
            lease = clients[0].grant(0.5)
            rev = clients[0].put("w/k", b"v", lease=lease)
            for t in threads:
                t.start()
            with clients[0].watch("w/", rev + 1) as watch:
                events = watch.get(timeout=scaled(30))
            assert [e.type for e in events] == ["delete"]  # the loop expired it
        finally:
            stop.set()
            for t in threads:
                t.join(scaled(30))
            for c in clients:
                c.close()
    store.close()
