"""A store that could not run does not expire the leases whose keepalives it could not
read: MemoryStore renews every lease when a sleeping watcher's wake comes late (the
store's process was descheduled), and still expires a lease nobody keeps alive."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from _load import scaled

from stalwart.coordinator._stall import STALL_S
from stalwart.coordinator.errors import LeaseNotFoundError, StoreClosedError
from stalwart.coordinator.memory import MemoryStore


def _watcher(store: MemoryStore) -> threading.Thread:
    start = store.revision + 1

    def watch() -> None:
        with contextlib.suppress(StoreClosedError):  # the test closes the store at its end
            store.wait_events("w/", start, 30.0)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline and not store._stall.sleeping:  # asleep, wake planned
        time.sleep(0.01)
    assert store._stall.sleeping
    return t


@pytest.mark.timeout(60)
def test_a_lease_kept_alive_survives_a_store_that_did_not_run_past_its_deadline() -> None:
    store = MemoryStore()
    lease = store.grant(0.3)
    store.put("k", b"v", lease=lease)
    watcher = _watcher(store)  # plans to wake at the lease's deadline, to expire it
    with store._lock:  # the store's process does not run: the keepalive waits unread
        time.sleep(0.3 + STALL_S + 0.5)
    assert store.keepalive(lease) == 0.3  # the stall was seen: renewed, then kept alive
    assert store.stalls == 1 and store.get("k") is not None
    store.close()
    watcher.join(timeout=10)


@pytest.mark.timeout(60)
def test_a_lease_nobody_keeps_alive_still_expires_on_time() -> None:
    store = MemoryStore()
    lease = store.grant(0.3)
    store.put("w/k", b"v", lease=lease)
    events = store.wait_events("w/", store.revision + 1, 30.0)  # wakes at the deadline
    assert [e.type for e in events] == ["delete"]  # (a late wake renews once, then expires)
    with pytest.raises(LeaseNotFoundError):
        store.keepalive(lease)
