"""The job's live nodes as this agent sees them, kept by a watch on the membership.

Every agent reads the live nodes often: its ring successor once a second
(agent/cluster/_peerwatch.py) and, under etcd, every agent looks for lost nodes at each store
poll (agent/cluster/_cluster.py, ten a second). A range of every member key per read is O(N)
at N nodes, so O(N^2) a second for the job: at 1,024 nodes, a million member keys a
second read from etcd (docs/scale.md). The view reads the membership once, then
applies the watch's join/leave events at each read: O(changes), and a node's loss costs
each agent one event. A broken watch (the store away, its history compacted) falls
back to a fresh range at the next read.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from stalwart.coordinator import StoreError

__all__ = ["MemberView", "ring_successor"]

_PEEK_S = 0.002  # a read takes the events already there (an etcd watch needs > 0 to look)


def ring_successor(node: int, live: set[int]) -> int | None:
    """The next live node after ``node`` in the ring of node ids (None: none left)."""
    others = sorted(n for n in live if n != node)
    if not others:
        return None
    after = [n for n in others if n > node]
    return after[0] if after else others[0]


class MemberView:
    """Live member ids under ``prefix`` (``.../members/``), from one range and a watch."""

    def __init__(self, store: Any, prefix: str) -> None:
        self._store, self._prefix = store, prefix
        self._ids: set[str] = set()
        self._watch: Any = None
        self._lock = threading.Lock()  # the agent's loop, its data plane and standbys read

    def ids(self) -> set[str]:
        """The member ids now (a copy)."""
        with self._lock:
            if self._watch is None:
                self._reset()
            else:
                try:
                    events = self._watch.get(_PEEK_S)
                except StoreError:
                    self._reset()
                    return set(self._ids)
                for event in events:
                    member = event.kv.key[len(self._prefix) :]
                    if event.type == "put":
                        self._ids.add(member)
                    else:
                        self._ids.discard(member)
            return set(self._ids)

    def _reset(self) -> None:
        self._close()
        snap = self._store.range(self._prefix)
        self._ids = {kv.key[len(self._prefix) :] for kv in snap.kvs}
        self._watch = self._store.watch(self._prefix, snap.revision + 1)

    def _close(self) -> None:
        if self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.close()
            self._watch = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def nodes(self) -> set[int]:
        """The live agents' node ids (members named ``node<k>``; ranks are not nodes)."""
        return {int(m[4:]) for m in self.ids() if m.startswith("node") and m[4:].isdigit()}
