"""agent/cluster/_members.py: the live members from one range and a watch's events,
followed in a thread of its own: a read costs no request."""

from __future__ import annotations

from typing import Any

from _load import wait_until

from stalwart.agent.cluster._members import MemberView, ring_successor
from stalwart.coordinator import MemoryStore


class _Counting:
    def __init__(self, inner: MemoryStore) -> None:
        self.inner, self.ranges = inner, 0

    def range(self, prefix: str) -> Any:
        self.ranges += 1
        return self.inner.range(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_view_follows_joins_and_leaves_reading_the_membership_once() -> None:
    inner = MemoryStore()
    store = _Counting(inner)
    lease = inner.grant(30)
    inner.put("/s/j/members/node0", b"{}")
    inner.put("/s/j/members/node1", b"{}", lease)
    view = MemberView(store, "/s/j/members/")
    try:
        assert view.ids() == {"node0", "node1"}
        inner.put("/s/j/members/node2", b"{}")
        inner.revoke(lease)  # node 1's lease ends: its key goes
        inner.put("/s/j/other", b"x")  # not a member
        assert wait_until(lambda: view.ids() == {"node0", "node2"}, 10)
        ranges = store.ranges
        for _ in range(100):
            assert view.nodes() == {0, 2}
        assert store.ranges == ranges  # O(changes) per read, not every member each time
        assert view.read_nodes() == {0, 2} and store.ranges == ranges + 1  # asked: a read
    finally:
        view.close()


def test_a_view_without_its_watch_reads_the_store() -> None:
    inner = MemoryStore()
    inner.put("/s/j/members/node0", b"{}")
    view = MemberView(inner, "/s/j/members/")
    view.close()  # no watch open now: a read is a range, never a stale answer
    inner.put("/s/j/members/node5", b"{}")
    assert view.nodes() == {0, 5}


def test_the_ring_successor_wraps_and_skips_the_node_itself() -> None:
    assert ring_successor(1, {0, 1, 3}) == 3
    assert ring_successor(3, {0, 1, 3}) == 0
    assert ring_successor(2, {2}) is None
