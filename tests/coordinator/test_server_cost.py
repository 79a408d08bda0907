"""What a steady request costs the store server at N nodes (issue 31): a long-poll sleeps
once, not in slices; the server's stop still ends it at once on a store it shares."""

from __future__ import annotations

import threading
from typing import Any

from stalwart.coordinator import MemoryStore, StoreClient, StoreServer

from .conftest import TOKEN, client_config, wait_until


class _CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait_events(self, *args: Any, **kwargs: Any) -> Any:
        self.waits += 1
        return super().wait_events(*args, **kwargs)


def test_a_quiet_long_poll_is_one_sleep_not_a_wake_per_slice() -> None:
    store = _CountingStore()
    with StoreServer(TOKEN, store=store) as server:
        c = StoreClient("127.0.0.1", server.port, TOKEN, client_config())
        with c, c.watch("quiet/") as w:
            assert w.get(timeout=1.5) == []
    # one wait for the whole 1.5 s (it was one per 0.25 s slice: 6 or more)
    assert store.waits == 1
    store.close()


def test_stop_ends_a_long_poll_on_a_store_the_server_does_not_own() -> None:
    store = MemoryStore()
    server = StoreServer(TOKEN, store=store).start()
    c = StoreClient("127.0.0.1", server.port, TOKEN, client_config(reconnect_timeout=0.3))
    ended = threading.Event()

    def watcher() -> None:
        try:
            with c.watch("w/") as w:
                w.get(timeout=30)
        except Exception:
            pass
        ended.set()

    t = threading.Thread(target=watcher)
    t.start()
    assert wait_until(lambda: server.stats["requests"] >= 2, 5)
    server.stop()
    assert ended.wait(10)  # not the long-poll's 30 s: stop woke it
    t.join()
    c.close()
    store.put("still", b"usable")  # the shared store is not closed by the server
    store.close()


def test_a_client_connects_from_its_source_address() -> None:
    """bench/scale.py's emulated nodes each leave from their own loopback address (the
    store admits handshakes per peer address, as a real node has a host of its own)."""
    import contextlib
    import socket

    from stalwart.coordinator import StoreClientConfig, StoreError

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        peers: list[str] = []

        def accept() -> None:
            conn, peer = listener.accept()
            peers.append(peer[0])
            conn.close()

        t = threading.Thread(target=accept)
        t.start()
        conf = StoreClientConfig(
            connect_timeout=2, request_timeout=2, reconnect_timeout=0.2, source_address="127.0.0.7"
        )
        c = StoreClient("127.0.0.1", listener.getsockname()[1], TOKEN, conf)
        # nobody speaks the protocol here: the address is what is checked
        with c, contextlib.suppress(StoreError):
            c.ping()
        t.join(10)
    assert peers == ["127.0.0.7"]


class _ThreadRecordingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def keepalive(self, lease: int) -> float:
        self.threads.add(threading.get_ident())
        return super().keepalive(lease)


def test_short_requests_run_on_one_thread_not_on_each_connections() -> None:
    """No convoy on the store's lock: the requests of many connections run on the
    server's one event-loop thread (they ran on each connection's own thread)."""
    store = _ThreadRecordingStore()
    with StoreServer(TOKEN, store=store) as server:
        clients = [StoreClient("127.0.0.1", server.port, TOKEN, client_config()) for _ in range(6)]
        lease = clients[0].grant(30)
        barrier = threading.Barrier(len(clients))

        def renew(c: StoreClient) -> None:
            barrier.wait()
            for _ in range(20):
                c.keepalive(lease)

        threads = [threading.Thread(target=renew, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for c in clients:
            c.close()
    assert len(store.threads) == 1
    store.close()
