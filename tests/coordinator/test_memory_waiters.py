"""Issue 31: a write to the embedded store wakes only the long-polls of its prefix, and a
call finds expired leases without scanning every lease (coordinator/_waiters.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stalwart.coordinator import MemoryStore


def test_a_write_wakes_only_the_watchers_of_its_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    looks = [0]
    collect = MemoryStore._collect_locked

    def counted(self: MemoryStore, *args: Any) -> Any:
        looks[0] += 1
        return collect(self, *args)

    monkeypatch.setattr(MemoryStore, "_collect_locked", counted)
    woken = [0]
    notify_all = threading.Condition.notify_all

    def counted_notify(self: threading.Condition) -> None:
        woken[0] += len(self._waiters)  # type: ignore[attr-defined]  # (CPython's)
        notify_all(self)

    monkeypatch.setattr(threading.Condition, "notify_all", counted_notify)
    n = 20
    got: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: got.append(store.wait_events(f"w/{i}/", 1, 60)))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while looks[0] < n:  # each looked once, then sleeps (under the store's lock)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    woken[0] = 0  # (starting a thread notifies too)
    try:
        for k in range(n):
            store.put(f"other/{k}", b"x")
        assert woken[0] == 0  # every write woke every watcher: n * n
    finally:
        for i in range(n):
            store.put(f"w/{i}/k", b"x")
        for t in threads:
            t.join(30)
    assert len(got) == n
    assert looks[0] <= 2 * n + 2  # one look each, then one per own write (was: every write)


def test_an_expired_lease_still_reaches_a_sleeping_watcher() -> None:
    store = MemoryStore()
    lease = store.grant(0.2)
    store.put("m/a", b"x", lease=lease)
    others = [threading.Thread(target=store.wait_events, args=(f"x/{i}/", 1, 5)) for i in range(3)]
    for t in others:
        t.start()
    events = store.wait_events("m/", store.revision + 1, 30)
    assert [e.type for e in events] == ["delete"]
    for t in others:
        t.join(10)
