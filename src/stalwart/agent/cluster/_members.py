"""The job's live nodes as this agent sees them, kept by a watch on the membership.

Every agent reads the live nodes often: its ring successor once a second
(agent/cluster/_peerwatch.py) and the leader looks for lost nodes at each store poll
(agent/cluster/_cluster.py, ten a second). A range of every member key per read is O(N)
at N nodes, so O(N^2) a second for the job: at 1,024 nodes, a million member keys a
second read from etcd (docs/scale.md); a request per read (a short look at a watch) was
still one request per node per second. The view follows the membership from a watch in a
thread of its own (agent/cluster/_follow.py): a read costs no request, a node's loss
costs each agent one event, and the steady cost is one long-poll per node per
``wait_s``. While its watch is broken (the store away, its history compacted) a read
ranges the membership itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stalwart.agent.cluster._follow import WAIT_S, PrefixFollower

__all__ = ["MemberView", "node_ids", "ring_successor"]

GAP_S = 1.0  # a burst of joins reaches a view once a second (the ring is read as often)


def ring_successor(node: int, live: set[int]) -> int | None:
    """The next live node after ``node`` in the ring of node ids (None: none left)."""
    others = sorted(n for n in live if n != node)
    if not others:
        return None
    after = [n for n in others if n > node]
    return after[0] if after else others[0]


class MemberView:
    """Live member ids under ``prefix`` (``.../members/``), from one range and a watch."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        *,
        wait_s: float = WAIT_S,
        on_change: Callable[[Mapping[str, bytes]], None] | None = None,
    ) -> None:
        """``on_change``: as :class:`PrefixFollower`'s (each new snapshot, from its thread)."""
        self._store, self._prefix = store, prefix
        self._follower = PrefixFollower(
            lambda: store,
            prefix,
            name="stalwart-members",
            wait_s=wait_s,
            gap_s=GAP_S,
            on_change=on_change,
        )
        # (the snapshot, its node ids): parsed once per change, replaced whole (threads)
        self._parsed: tuple[Mapping[str, bytes] | None, frozenset[int]] = (None, frozenset())

    def ids(self) -> set[str]:
        """The member ids now (a copy)."""
        kvs = self._follower.snapshot()
        return set(kvs) if kvs is not None else self.read_ids()

    def read_ids(self) -> set[str]:
        """The member ids read from the store now (one range): for the moment a caller
        knows of a change the watch may not have carried yet (a revoke it just made)."""
        n = len(self._prefix)
        return {kv.key[n:] for kv in self._store.range(self._prefix).kvs}

    def close(self) -> None:
        self._follower.close()

    def nodes(self) -> set[int]:
        """The live agents' node ids (members named ``node<k>``; ranks are not nodes)."""
        followed = self.followed()
        return node_ids(self.read_ids()) if followed is None else set(followed)

    def followed(self) -> frozenset[int] | None:
        """:meth:`nodes` as the watch has them; None while no watch is open."""
        kvs = self._follower.snapshot()
        return None if kvs is None else self._ids(kvs)

    def followed_at(self) -> tuple[frozenset[int], int] | None:
        """:meth:`followed` and the store revision it holds up to, from one snapshot."""
        state = self._follower.state()
        return None if state is None else (self._ids(state.kvs), state.revision)

    def _ids(self, kvs: Mapping[str, bytes]) -> frozenset[int]:
        seen, nodes = self._parsed
        if kvs is not seen:  # parsed once per change, not per look (N names)
            nodes = frozenset(node_ids(set(kvs)))
            self._parsed = (kvs, nodes)
        return nodes

    def read_nodes(self) -> set[int]:
        """:meth:`nodes` read from the store now (see :meth:`read_ids`)."""
        return node_ids(self.read_ids())


def node_ids(ids: set[str]) -> set[int]:
    """The node ids among member names (``node<k>``; ``rank<r>`` and others are not)."""
    return {int(m[4:]) for m in ids if m.startswith("node") and m[4:].isdigit()}
