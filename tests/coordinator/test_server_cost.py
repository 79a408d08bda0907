"""What a steady request costs the store server at N nodes (issue 31): a long-poll sleeps
once, not in slices; the server's stop still ends it at once on a store it shares."""

from __future__ import annotations

import threading
import time
from typing import Any

from stalwart.coordinator import MemoryStore, StoreClient, StoreServer

from .conftest import TOKEN, client_config, wait_until


class _CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def poll_events(self, *args: Any, **kwargs: Any) -> Any:
        self.waits += 1
        return super().poll_events(*args, **kwargs)


def test_a_quiet_long_poll_is_one_sleep_not_a_wake_per_slice() -> None:
    store = _CountingStore()
    with StoreServer(TOKEN, store=store) as server:
        c = StoreClient("127.0.0.1", server.port, TOKEN, client_config())
        with c, c.watch("quiet/") as w:
            assert w.get(timeout=1.5) == []
    # a look when it came and one when its wait ended, for the whole 1.5 s (it was one
    # per 0.25 s slice: 6 or more)
    assert store.waits == 2
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


def _noise_then_quiet(store: Any, watch: Any) -> None:
    for i in range(3000):  # the rest of the job writes; nothing under the watched prefix
        store.put(f"noise/{i % 50}", b"x")
    assert watch.get(timeout=0.05) == []


def test_an_empty_long_poll_moves_the_watch_past_what_it_looked_at() -> None:
    """Issue 31: a watch with no events polled again from its old start, so each look
    scanned every event written since (the store's largest CPU share at 1,024 nodes).
    An empty answer now says how far the store looked and the watch continues from
    there, in-process and over the wire; a later write under the prefix still arrives."""
    store = MemoryStore()
    with store.watch("quiet/") as w:
        _noise_then_quiet(store, w)
        assert w.next_revision == store.revision + 1
        store.put("quiet/a", b"1")
        assert [e.kv.key for e in w.get(timeout=5)] == ["quiet/a"]
    with StoreServer(TOKEN, store=store) as server:
        c = StoreClient("127.0.0.1", server.port, TOKEN, client_config())
        with c, c.watch("quiet/") as w:
            _noise_then_quiet(c, w)
            assert w.next_revision == store.revision + 1
            store.put("quiet/b", b"2")
            assert [e.kv.key for e in w.get(timeout=5)] == ["quiet/b"]
    store.close()


def test_short_long_polls_beside_writes_lose_no_event() -> None:
    """The answer to a long-poll whose wait ended carries the revision its own look
    reached, so a write under the prefix landing just before it is in that answer or
    the next, never skipped: every write of a busy writer arrives once, in order."""
    store = MemoryStore()
    with StoreServer(TOKEN, store=store) as server:
        c = StoreClient("127.0.0.1", server.port, TOKEN, client_config())
        seen: list[str] = []
        with c, c.watch("k/") as w:
            writer = threading.Thread(
                target=lambda: [store.put(f"k/{i:04d}", b"v") for i in range(400)]
            )
            writer.start()
            deadline = time.monotonic() + 60
            while len(seen) < 400 and time.monotonic() < deadline:
                seen += [e.kv.key for e in w.get(timeout=0.001)]
            writer.join()
        assert seen == [f"k/{i:04d}" for i in range(400)]
    store.close()


class _CountedKey(str):
    """A key that counts the prefix checks made on it (each one a history event looked at)."""

    checks = 0

    def startswith(self, *args: Any) -> bool:  # type: ignore[override]
        _CountedKey.checks += 1
        return super().startswith(*args)


def test_watchers_of_a_quiet_prefix_scan_the_history_once_between_them() -> None:
    """Issue 31: at 1,024 nodes ~1,000 watchers of one prefix (the verdict, the
    generation) each scanned the whole history written since their start at every look:
    O(N x history). What one look found empty is remembered per prefix, so 100 watchers
    from 100 revisions look at each of 2,000 events about once, and a write under the
    prefix is still found by every one of them."""
    store = MemoryStore()
    for i in range(2000):
        store.put(_CountedKey(f"noise/{i % 40}"), b"x")
    _CountedKey.checks = 0
    for start in range(1, 101):
        events, looked_to = store.poll_events("verdict", start)
        assert events == [] and looked_to == store.revision
    assert _CountedKey.checks < 2 * 2000  # it was 100 x ~2,000
    store.put("verdict", b"go")
    for start in range(1, 101):
        assert [e.kv.key for e in store.poll_events("verdict", start)[0]] == ["verdict"]
    # the sorted keys: noise/1, noise/10 .. noise/19
    assert [kv.key for kv in store.range("noise/1").kvs] == sorted(
        f"noise/{i}" for i in range(40) if f"noise/{i}".startswith("noise/1")
    )
    store.close()
