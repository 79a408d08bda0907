"""MemoryStore.pin: the lease of the store's own process (node 0's agent under the
embedded store) ends only when revoked; every other lease still expires on time."""

from __future__ import annotations

import pytest

from stalwart.coordinator.errors import LeaseNotFoundError
from stalwart.coordinator.memory import MemoryStore


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pinned_lease_outlives_its_ttl_and_another_lease_does_not() -> None:
    clock = _Clock()
    store = MemoryStore(clock=clock)
    host, other = store.grant(1.0), store.grant(1.0)
    store.put("m/host", b"0", lease=host)
    store.put("m/other", b"1", lease=other)
    store.pin(host)
    clock.now += 5.0  # five ttls, nobody kept either alive
    assert store.get("m/other") is None  # expired on time
    assert store.get("m/host") is not None
    assert store.keepalive(host) == 1.0 and store.time_to_live(host) == 1.0
    clock.now += 50.0
    assert store.get("m/host") is not None  # a keepalive did not unpin it
    with pytest.raises(LeaseNotFoundError):
        store.keepalive(other)
    assert store.revoke(host)
    assert store.get("m/host") is None  # revoked: its keys go
    store.close()


def test_the_expiry_timer_has_nothing_to_wait_for_with_only_a_pinned_lease() -> None:
    clock = _Clock()
    store = MemoryStore(clock=clock)
    lease = store.grant(2.0)
    assert store.tick() == pytest.approx(2.001)
    store.pin(lease)
    assert store.tick() is None  # no deadline: an event loop sleeps until a request
    store.close()


def test_pinning_a_lease_that_is_gone_says_so() -> None:
    clock = _Clock()
    store = MemoryStore(clock=clock)
    lease = store.grant(1.0)
    clock.now += 2.0
    with pytest.raises(LeaseNotFoundError, match="grant one"):
        store.pin(lease)
    store.close()
