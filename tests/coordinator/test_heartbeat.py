"""Member heartbeats are hedged: a renewal stuck on a lossy link (TCP retransmission
backoff, then a reconnect whose SYNs are lost too) does not hold the next one back, so
the lease is kept by whichever renewal answers first (coordinator/membership.py)."""

from __future__ import annotations

import threading
import time

import pytest

from stalwart.coordinator.errors import LeaseNotFoundError
from stalwart.coordinator.membership import MAX_RENEWALS_IN_FLIGHT, Member
from stalwart.coordinator.memory import MemoryStore

TTL = 2.0
INTERVAL = 0.25


class _StuckStore(MemoryStore):
    """A store whose first ``stuck`` renewals hang until ``release`` is set, as a request
    waiting on a lost segment; the others are answered at once."""

    def __init__(self, stuck: int) -> None:
        super().__init__()
        self.stuck = stuck
        self.release = threading.Event()
        self.started = 0
        self.answered = 0
        self.finished = 0  # answered or raised
        self._count = threading.Lock()

    def keepalive(self, lease: int) -> float:
        with self._count:
            self.started += 1
            hang = self.started <= self.stuck
        try:
            if hang:
                self.release.wait(60.0)
            ttl = super().keepalive(lease)
            with self._count:
                self.answered += 1
            return ttl
        finally:
            with self._count:
                self.finished += 1


def _until(cond: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return True
        threading.Event().wait(0.02)
    return False


def _stuck_member() -> tuple[_StuckStore, Member, list[BaseException]]:
    """A member heartbeating on a store whose first renewal sticks; its losses listed."""
    store = _StuckStore(stuck=1)
    member = Member(store, "node1", store.grant(TTL), TTL, INTERVAL)
    lost: list[BaseException] = []
    member.start_heartbeat(on_lost=lost.append)
    return store, member, lost


def test_a_stuck_renewal_does_not_let_the_lease_expire() -> None:
    store, member, lost = _stuck_member()
    try:
        # a single renewal at a time would sit behind the stuck one and the lease would
        # expire TTL later; hedged, the next renewals keep it through several TTLs
        assert _until(lambda: store.answered >= 3 * TTL / INTERVAL), store.answered
        assert store.time_to_live(member.lease) is not None
        assert member.lost is None and lost == []
        assert time.monotonic() - member.renewal_sent < TTL
    finally:
        store.release.set()
        member.leave()
        store.close()


def test_renewals_in_flight_are_bounded() -> None:
    store = _StuckStore(stuck=1_000)  # a store that answers nothing
    lease = store.grant(60.0)
    member = Member(store, "node1", lease, 60.0, 0.05)
    member.start_heartbeat()
    try:
        assert _until(lambda: store.started >= MAX_RENEWALS_IN_FLIGHT)
        threading.Event().wait(20 * 0.05)  # twenty more intervals: nothing more is sent
        assert store.started == MAX_RENEWALS_IN_FLIGHT
    finally:
        store.release.set()
        member.leave()
        store.close()


def test_a_renewal_that_fails_after_leave_is_not_a_loss() -> None:
    store, member, lost = _stuck_member()
    assert _until(lambda: store.started >= 1)
    member.leave()  # revokes the lease: the stuck renewal now finds it gone
    store.release.set()
    assert _until(lambda: store.finished >= 1)  # the stuck renewal found the lease gone
    with pytest.raises(LeaseNotFoundError):
        store.keepalive(member.lease)
    assert lost == [] and member.lost is None
    store.close()


def _renewers(member_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"stalwart-renewal-{member_id}")]


def test_a_store_that_answers_keeps_one_renewer_thread_and_leave_ends_it() -> None:
    store = _StuckStore(stuck=0)
    lease = store.grant(TTL)
    member = Member(store, "quiet", lease, TTL, 0.02)
    member.start_heartbeat()
    try:
        assert _until(lambda: store.answered >= 20)
        assert len(_renewers("quiet")) == 1  # not a thread per renewal
    finally:
        member.leave()
        store.close()
    assert _until(lambda: not _renewers("quiet"), 10.0)
