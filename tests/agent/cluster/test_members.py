"""agent/cluster/_members.py: the live members from one range and a watch's events."""

from __future__ import annotations

from typing import Any

from stalwart.agent.cluster._members import MemberView
from stalwart.coordinator import CompactedError, MemoryStore


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
    assert view.ids() == {"node0", "node1"}
    inner.put("/s/j/members/node2", b"{}")
    inner.revoke(lease)  # node 1's lease ends: its key goes
    inner.put("/s/j/other", b"x")  # not a member
    for _ in range(100):
        assert view.ids() == {"node0", "node2"}
    assert store.ranges == 1  # O(changes) per read, not every member each time
    view.close()


def test_a_broken_watch_falls_back_to_a_fresh_read() -> None:
    inner = MemoryStore()
    store = _Counting(inner)
    inner.put("/s/j/members/node0", b"{}")
    view = MemberView(store, "/s/j/members/")
    assert view.ids() == {"node0"}

    class Broken:
        def get(self, timeout: float | None = None) -> Any:
            raise CompactedError("history gone")

        def close(self) -> None:
            pass

    view._watch = Broken()
    inner.put("/s/j/members/node5", b"{}")
    assert view.ids() == {"node0", "node5"}
    assert store.ranges == 2
