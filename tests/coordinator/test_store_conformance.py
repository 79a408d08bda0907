"""The Store contract. Every backend in ``STORE_BACKENDS`` must pass all of it."""

from __future__ import annotations

import threading
import time

import pytest

from stalwart.coordinator import (
    CompactedError,
    Compare,
    Delete,
    LeaseNotFoundError,
    MemoryStore,
    ProtocolError,
    Put,
    Store,
    StoreClosedError,
    iter_events,
    wait_for,
)

from .conftest import Backend


def test_put_get_revisions(store: Store) -> None:
    assert store.get("a") is None
    r1 = store.put("a", b"1")
    r2 = store.put("a", b"2")
    assert r2 == r1 + 1
    kv = store.get("a")
    assert kv is not None
    assert (kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.version, kv.lease) == (
        "a",
        b"2",
        r2,
        r1,
        2,
        0,
    )


def test_binary_values_and_unicode_keys(store: Store) -> None:
    blob = bytes(range(256)) * 4
    store.put("bin/ü/ключ", blob)
    store.put("bin/empty", b"")
    kv = store.get("bin/ü/ключ")
    assert kv is not None and kv.value == blob
    empty = store.get("bin/empty")
    assert empty is not None and empty.value == b""


def test_range_is_sorted_by_key_and_filtered_by_prefix(store: Store) -> None:
    for key in ("p/c", "p/a", "q/x", "p/b"):
        store.put(key, key.encode())
    res = store.range("p/")
    assert [kv.key for kv in res.kvs] == ["p/a", "p/b", "p/c"]
    assert res.revision == max(kv.mod_revision for kv in store.range("").kvs)
    assert [kv.key for kv in store.range("").kvs] == ["p/a", "p/b", "p/c", "q/x"]


def test_delete_single_and_prefix(store: Store) -> None:
    for key in ("d/1", "d/2", "d/3", "e/1"):
        store.put(key, b"x")
    rev = store.range("").revision
    assert store.delete("missing") == 0
    assert store.range("").revision == rev  # a no-op delete writes nothing
    assert store.delete("d/1") == 1
    assert store.get("d/1") is None
    assert store.delete("d/", prefix=True) == 2
    assert [kv.key for kv in store.range("").kvs] == ["e/1"]


def test_txn_create_if_absent_only_once(store: Store) -> None:
    absent = Compare("lock", "mod_revision", "==", 0)
    first = store.txn([absent], [Put("lock", b"me")], [Put("lost", b"1")])
    second = store.txn([absent], [Put("lock", b"you")], [Put("lost", b"1")])
    assert first.succeeded and not second.succeeded
    kv = store.get("lock")
    assert kv is not None and kv.value == b"me"
    assert store.get("lost") is not None  # the failure branch ran
    assert second.revision == first.revision + 1


def test_txn_compare_value_and_revision_operators(store: Store) -> None:
    rev = store.put("k", b"b")
    assert store.txn([Compare("k", "value", "==", b"b")], []).succeeded
    assert not store.txn([Compare("k", "value", "==", b"c")], []).succeeded
    assert store.txn([Compare("k", "value", "<", b"c")], []).succeeded
    assert store.txn([Compare("k", "value", ">", b"a")], []).succeeded
    assert store.txn([Compare("k", "value", "!=", b"a")], []).succeeded
    assert store.txn([Compare("k", "mod_revision", "==", rev)], []).succeeded
    assert store.txn([Compare("k", "version", "==", 1)], []).succeeded
    assert not store.txn([Compare("k", "create_revision", ">", rev)], []).succeeded
    # a missing key fails every value comparison, and compares as 0 otherwise
    assert not store.txn([Compare("nope", "value", "!=", b"x")], []).succeeded
    assert store.txn([Compare("nope", "version", "==", 0)], []).succeeded
    # every comparison must hold
    assert not store.txn(
        [Compare("k", "value", "==", b"b"), Compare("k", "version", "==", 9)], []
    ).succeeded


def test_txn_writes_share_one_revision(store: Store) -> None:
    store.put("t/old", b"x")
    res = store.txn([], [Put("t/a", b"1"), Put("t/b", b"2"), Delete("t/old")])
    assert res.succeeded
    a, b = store.get("t/a"), store.get("t/b")
    assert a is not None and b is not None
    assert a.mod_revision == b.mod_revision == res.revision
    assert store.get("t/old") is None


def test_txn_with_unknown_lease_changes_nothing(store: Store) -> None:
    rev = store.put("x", b"0")
    with pytest.raises(LeaseNotFoundError):
        store.txn([], [Put("x", b"1"), Put("y", b"1", lease=12345)])
    kv = store.get("x")
    assert kv is not None and kv.value == b"0" and store.range("").revision == rev


def test_leases_keepalive_revoke(store: Store) -> None:
    lease = store.grant(30)
    store.put("l/a", b"1", lease=lease)
    store.put("l/b", b"1", lease=lease)
    kv = store.get("l/a")
    assert kv is not None and kv.lease == lease
    assert store.keepalive(lease) == pytest.approx(30, abs=1)
    ttl = store.time_to_live(lease)
    assert ttl is not None and 25 < ttl <= 30
    assert store.revoke(lease) is True
    assert store.range("l/").kvs == []
    assert store.time_to_live(lease) is None
    assert store.revoke(lease) is False
    with pytest.raises(LeaseNotFoundError):
        store.keepalive(lease)
    with pytest.raises(LeaseNotFoundError):
        store.put("l/c", b"1", lease=lease)


def test_put_without_lease_detaches_key(store: Store) -> None:
    lease = store.grant(30)
    store.put("k", b"1", lease=lease)
    store.put("k", b"2")  # now a plain key
    store.revoke(lease)
    kv = store.get("k")
    assert kv is not None and kv.value == b"2"


def test_lease_expiry_deletes_keys_and_notifies_watchers(backend: Backend) -> None:
    store = backend.store
    ttl = backend.short_ttl
    lease = store.grant(ttl)
    store.put("m/dead", b"1", lease=lease)
    rev = store.put("m/alive", b"1")
    started = time.monotonic()
    with store.watch("m/", rev + 1) as watch:
        events = watch.get(timeout=ttl + 5.0)
    elapsed = time.monotonic() - started
    assert [(e.type, e.kv.key) for e in events] == [("delete", "m/dead")]
    assert ttl * 0.8 <= elapsed < ttl + 3.0
    assert store.get("m/dead") is None and store.get("m/alive") is not None
    assert store.time_to_live(lease) is None


def test_keepalive_keeps_lease_past_its_ttl(backend: Backend) -> None:
    store = backend.store
    ttl = backend.short_ttl
    lease = store.grant(ttl)
    store.put("hb", b"1", lease=lease)
    end = time.monotonic() + 2 * ttl
    while time.monotonic() < end:
        store.keepalive(lease)
        time.sleep(ttl / 4)
    assert store.get("hb") is not None
    store.revoke(lease)


def test_watch_replays_history_in_revision_order(store: Store) -> None:
    start = store.put("w/a", b"1")
    store.put("other", b"1")
    store.txn([], [Put("w/b", b"2"), Put("w/c", b"3")])
    store.delete("w/a")
    with store.watch("w/", start) as watch:
        events = list(iter_events(watch, timeout=0.3))
    assert [(e.type, e.kv.key) for e in events] == [
        ("put", "w/a"),
        ("put", "w/b"),
        ("put", "w/c"),
        ("delete", "w/a"),
    ]
    revisions = [e.kv.mod_revision for e in events]
    assert revisions == sorted(revisions) and revisions[1] == revisions[2]


def test_watch_default_start_sees_only_new_events(store: Store) -> None:
    store.put("n/old", b"1")
    with store.watch("n/") as watch:
        assert watch.get(timeout=0.1) == []
        store.put("n/new", b"1")
        events = watch.get(timeout=5.0)
    assert [e.kv.key for e in events] == ["n/new"]


def test_watch_wakes_on_a_put_from_another_thread(backend: Backend) -> None:
    store = backend.store
    writer = backend.new_client()
    rev = store.range("").revision
    timer = threading.Timer(0.2, lambda: writer.put("x/1", b"v"))
    started = time.monotonic()
    timer.start()
    try:
        with store.watch("x/", rev + 1) as watch:
            events = watch.get(timeout=10.0)
    finally:
        timer.join()
    assert [e.kv.key for e in events] == ["x/1"]
    assert time.monotonic() - started < 5.0  # woken by the put, not by the timeout


def test_watch_timeout_returns_empty_on_time(store: Store) -> None:
    with store.watch("silent/") as watch:
        started = time.monotonic()
        assert watch.get(timeout=0.2) == []
        assert 0.15 <= time.monotonic() - started < 2.0


def test_wait_for_condition_with_deadline(backend: Backend) -> None:
    store = backend.store
    writer = backend.new_client()
    timer = threading.Timer(0.1, lambda: [writer.put(f"r/{i}", b"") for i in range(3)])
    timer.start()
    try:
        res = wait_for(store, "r/", lambda r: len(r.kvs) >= 3, timeout=10.0)
    finally:
        timer.join()
    assert res is not None and len(res.kvs) == 3
    started = time.monotonic()
    assert wait_for(store, "r/", lambda r: len(r.kvs) >= 4, timeout=0.2) is None
    assert time.monotonic() - started < 2.0


def test_concurrent_cas_exactly_one_winner(backend: Backend) -> None:
    backend.store.put("gen", b"0")
    clients = [backend.new_client() for _ in range(6)]
    barrier = threading.Barrier(len(clients))
    wins: list[bool] = []
    lock = threading.Lock()

    def contend(client: Store) -> None:
        barrier.wait()
        res = client.txn([Compare("gen", "value", "==", b"0")], [Put("gen", b"1")])
        with lock:
            wins.append(res.succeeded)

    threads = [threading.Thread(target=contend, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(wins) == [False] * 5 + [True]
    kv = backend.store.get("gen")
    assert kv is not None and kv.value == b"1" and kv.version == 2


def test_compacted_history_is_an_error() -> None:
    store = MemoryStore(history=4)
    for i in range(20):
        store.put("c", str(i).encode())
    with pytest.raises(CompactedError):
        store.watch("c", 1)
    latest = store.range("c").revision
    with store.watch("c", latest) as watch:
        assert [e.kv.value for e in watch.get(0.1)] == [b"19"]


def test_closed_watch_and_store_raise(store: Store) -> None:
    watch = store.watch("z/")
    watch.close()
    with pytest.raises(StoreClosedError):
        watch.get(0.1)
    store.close()
    with pytest.raises(StoreClosedError):
        store.get("z")


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), float("inf"), 8 * 86400.0])
def test_a_lease_ttl_out_of_bounds_is_refused(store: Store, ttl: float) -> None:
    """Every store refuses a lease that never expires (or a nonsense one) before granting
    it: a member holding it could never be declared lost."""
    with pytest.raises((ValueError, ProtocolError)):
        store.grant(ttl)
