"""agent/cluster/_follow.py: the keys under a prefix kept by a watch in its own thread, a
look costing no request; unknown (None) while no watch is open."""

from __future__ import annotations

import threading
import time
from typing import Any

from _load import wait_until

from stalwart.agent.cluster._follow import PrefixFollower
from stalwart.coordinator import CompactedError, MemoryStore

from ._helpers import CountingStore


def test_a_look_costs_no_request_and_a_change_arrives_as_an_event() -> None:
    inner = MemoryStore()
    store = CountingStore(inner)
    inner.put("/j/members/node0", b"a")
    follower = PrefixFollower(lambda: store, "/j/members/", name="t", wait_s=30.0)
    try:
        assert wait_until(lambda: follower.snapshot() is not None, 10)
        assert follower.snapshot() == {"node0": b"a"}
        before = store.requests
        for _ in range(1000):
            assert follower.snapshot() == {"node0": b"a"}
        assert store.requests == before  # 1,000 looks: no request
        lease = inner.grant(30)
        inner.put("/j/members/node1", b"b", lease)
        inner.put("/j/other", b"x")  # outside the prefix
        assert wait_until(lambda: follower.snapshot() == {"node0": b"a", "node1": b"b"}, 10)
        inner.revoke(lease)  # its key goes with the lease
        assert wait_until(lambda: follower.snapshot() == {"node0": b"a"}, 10)
    finally:
        follower.close()


def test_a_quiet_prefix_costs_one_request_per_wait() -> None:
    """The steady cost: a long-poll per ``wait_s``, not a request per look."""
    inner = MemoryStore()
    store = CountingStore(inner)
    follower = PrefixFollower(lambda: store, "/j/v", name="t", wait_s=0.2)
    try:
        assert wait_until(lambda: follower.snapshot() is not None, 10)
        start = store.requests
        assert wait_until(lambda: store.requests >= start + 3, 10)  # it keeps polling
        assert follower.snapshot() == {}
    finally:
        follower.close()


def test_a_broken_watch_says_unknown_then_reads_afresh() -> None:
    inner = MemoryStore()
    broken = threading.Event()

    class Breaking(CountingStore):
        def watch(self, prefix: str, start_revision: int | None = None) -> Any:
            if broken.is_set():
                broken.clear()  # the next try opens a good one

                class Compacted:
                    def get(self, timeout: float | None = None) -> Any:
                        raise CompactedError("history gone")

                    def close(self) -> None:
                        pass

                return Compacted()
            return CountingStore.__getattr__(self, "watch")(prefix, start_revision)

    store = Breaking(inner)
    inner.put("/j/m/a", b"1")
    follower = PrefixFollower(lambda: store, "/j/m/", name="t", wait_s=0.1, reread_s=0.3)
    try:
        assert wait_until(lambda: follower.snapshot() == {"a": b"1"}, 10)
        seen: list[Any] = []
        broken.set()  # the reread after 0.3 s opens a watch that breaks
        assert wait_until(lambda: seen.append(follower.snapshot()) or seen[-1] is None, 10)
        inner.put("/j/m/b", b"2")  # written while no watch was open
        assert wait_until(lambda: follower.snapshot() == {"a": b"1", "b": b"2"}, 10)
    finally:
        follower.close()


def test_close_ends_the_thread_and_forgets() -> None:
    inner = MemoryStore()
    follower = PrefixFollower(lambda: inner, "/j/", name="follow-close", wait_s=30.0)
    assert wait_until(lambda: follower.snapshot() is not None, 10)
    follower.close()
    assert follower.snapshot() is None
    names = lambda: {t.name for t in threading.enumerate()}  # noqa: E731
    assert wait_until(lambda: "follow-close" not in names(), 10)


def test_a_burst_of_changes_costs_a_request_per_gap_not_per_change() -> None:
    """N nodes joining at once: each follower asks once per ``gap_s``, and the changes
    meanwhile arrive in one batch (without the gap, a long-poll per change)."""
    inner = MemoryStore()
    store = CountingStore(inner)
    follower = PrefixFollower(lambda: store, "/j/m/", name="t", wait_s=30.0, gap_s=0.5)
    try:
        assert wait_until(lambda: follower.snapshot() is not None, 10)
        start, t0 = store.requests, time.monotonic()
        first = follower.snapshot()
        for k in range(200):  # ~0.2 s of writes: a request per gap covers them
            inner.put(f"/j/m/node{k}", b"x")
            if k % 20 == 0:
                threading.Event().wait(0.01)  # the follower gets a look in between
        burst_s = time.monotonic() - t0  # longer on a loaded machine: more gaps in it
        assert wait_until(lambda: len(follower.snapshot() or {}) == 200, 10)
        bound = 3 + int(burst_s / 0.5)  # one per gap the burst spans, and the last batch
        assert store.requests - start <= bound, (store.requests - start, burst_s)
        assert first is not None and len(first) == 0  # a snapshot never changes under us
    finally:
        follower.close()


def test_watches_started_together_do_not_renew_together() -> None:
    """A job's agents start together: long-polls that each waited exactly ``wait_s``
    renewed in one burst per period for the whole job (1,024 nodes: ~3,000 requests every
    30 s). Each wait is up to a quarter shorter, at random."""
    from stalwart.agent.cluster._follow import _spread

    waits = [_spread(30.0) for _ in range(1000)]
    assert all(22.5 <= w <= 30.0 for w in waits)
    assert max(waits) - min(waits) > 5.0  # spread over the quarter, not one instant
