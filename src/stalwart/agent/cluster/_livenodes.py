"""The job's live nodes for every agent, at O(N) events per change for the job.

Every agent needs the live node ids: its ring successor (the peer watch, the replica
buddy), whoever adopts a lost node, the data plane's watch. Each agent used to follow
every member key (agent/cluster/_members.py): N nodes forming a job cost N^2/2 watch
events, 556 per node while 1,024 formed, and most of the join's CPU (docs/scale.md).

Now one agent, the *writer*, follows the member keys and ``joined/``, and writes the
set into one key as ranges (agent/cluster/_digest.py), at most once per batch of changes
(a second during a burst of joins); every other agent follows that one key. A burst of
N joins costs each of them one event per second of the burst, a loss one event.

Who writes: whoever holds ``live/writer`` (``"<node> <lease>"``), a key on its own
member lease, so it goes with the writer's lease. An agent that may write (``claims``:
node 0 on the embedded store, which hosts it and adopts every lost node; every agent
under etcd) claims the key when it finds it vacant, in one transaction; the others wait
for the next vacancy.

``left`` (joined, no member key) is computed by the writer from two watches that go at
their own pace; a node whose ``joined`` key is newer than the members' snapshot is not
counted (it may have a member key that watch has not carried yet): a lag never reads as
a loss.
Every digest write is checked against the writer key's revision in the same
transaction: a writer that lost its lease (stopped, cut off, fenced) can never
overwrite its successor's digest. It finds out at its next write and stops writing.

What a reader sees lags the writer's view by one write and one watch event; where a
decision needs the store's own word (the node whose death a peer watch just saw), the
caller reads the members itself (:meth:`LiveNodes.read_nodes`). Without a digest (the
writer not there yet, the watch broken, a malformed one) a look reads the store too:
never an answer the follower cannot vouch for.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from stalwart.agent.cluster._digest import LiveDigest, encode_digest, parse_digest
from stalwart.agent.cluster._follow import Followed, PrefixFollower
from stalwart.agent.cluster._members import GAP_S, MemberView, node_ids
from stalwart.coordinator import Compare, Put

__all__ = ["LiveNodes"]

_WRITER, _DIGEST = "writer", "digest"


class LiveNodes:
    """The live (and departed) node ids of the job under ``root``, for agent ``node``."""

    def __init__(
        self,
        store: Any,
        root: str,
        node: int,
        *,
        claims: bool,
        lease: Callable[[], int | None],
        wait_s: float,
    ) -> None:
        """``claims``: whether this agent takes the writer's part when it is vacant;
        ``lease``: this agent's member lease now (None before it joined), which the
        writer key is put on; ``wait_s``: each watch's long-poll."""
        self._store, self._root, self._node = store, root, node
        self._claims, self._lease, self._wait_s = claims, lease, wait_s
        self._prefix = f"{root}/live/"
        self._digest = PrefixFollower(
            lambda: store, self._prefix, name="stalwart-live", wait_s=wait_s
        )
        self._parsed: tuple[Mapping[str, bytes] | None, LiveDigest | None] = (None, None)
        # the writer's part: set while we hold live/writer (its create revision)
        self._lock = threading.Lock()
        self._claim = 0
        self._written = b""
        self._members: MemberView | None = None
        self._joined: PrefixFollower | None = None

    # ------------------------------------------------------------ looks
    def nodes(self) -> set[int]:
        """The live node ids now (from the writer's digest, or our own view if we write)."""
        members = self._members
        if members is not None and self._claim:
            followed = members.followed()
            if followed is not None:
                return set(followed)
        digest = self._current()
        return set(digest.live) if digest is not None else self.read_nodes()

    def left(self) -> set[int]:
        """Nodes that joined and have no member key now (a goodbye or a loss)."""
        members, joined = self._members, self._joined
        if self._claim and members is not None and joined is not None:
            at, joined_at = members.followed_at(), joined.state()  # live: one snapshot
            if at is not None and joined_at is not None:
                return _left(at[0], at[1], joined_at)
        digest = self._current()
        if digest is not None:
            return set(digest.left)
        joined_ids = self._read("joined")  # first: a node joins (its member key), then says so
        return joined_ids - self.read_nodes()

    def read_nodes(self) -> set[int]:
        """The live node ids read from the store now (one range of the members)."""
        return self._read("members")

    def _read(self, what: str) -> set[int]:
        prefix = f"{self._root}/{what}/"
        return node_ids({kv.key[len(prefix) :] for kv in self._store.range(prefix).kvs})

    def _current(self) -> LiveDigest | None:
        kvs = self._digest.snapshot()
        if kvs is None or _DIGEST not in kvs or _WRITER not in kvs:
            return None  # no writer now: nobody vouches that the digest is current
        seen, digest = self._parsed
        if kvs is not seen:  # parsed once per change, not per look
            digest = parse_digest(kvs[_DIGEST])
            self._parsed = (kvs, digest)
        return digest

    @property
    def writing(self) -> bool:
        """Whether this agent holds the writer's part now."""
        return bool(self._claim)

    # ------------------------------------------------------------ the writer's part
    def tick(self) -> None:
        """Called from the agent's poll: claim the writer's part if it is vacant and we
        may; let it go if a write found it taken. Store errors wait for the next tick."""
        if self._claim or self._members is not None:
            if not self._claim:  # a refused write let it go: stop following everything
                self._stop_writing()
            return
        if not self._claims:
            return
        kvs = self._digest.snapshot()
        lease = self._lease()
        if kvs is None or lease is None:
            return
        key, mark = self._prefix + _WRITER, f"{self._node} {lease}".encode()
        with contextlib.suppress(Exception):  # the store away, our lease gone: next tick
            if _WRITER not in kvs:
                put = Put(key, mark, lease=lease)
                result = self._store.txn([Compare(key, "create_revision", "==", 0)], [put])
                if result.succeeded:
                    self._start_writing(result.revision)
            elif kvs[_WRITER] == mark:  # ours, and we do not write: a claim's lost answer
                kv = self._store.get(key)  # (a timeout), or a revision we got wrong
                if kv is not None and kv.value == mark:
                    self._start_writing(kv.create_revision)

    def _start_writing(self, claim: int) -> None:
        with self._lock:
            self._claim, self._written = claim, b""
        self._members = MemberView(
            self._store, f"{self._root}/members/", wait_s=self._wait_s, on_change=self._changed
        )
        self._joined = PrefixFollower(
            lambda: self._store,
            f"{self._root}/joined/",
            name="stalwart-joined",
            wait_s=self._wait_s,
            gap_s=GAP_S,
            on_change=self._changed,
        )
        # a follower's first snapshot may have come before both were set: look once more
        with contextlib.suppress(Exception):  # the store away: the follower calls again
            self._changed({})

    def _changed(self, _kvs: Mapping[str, bytes]) -> None:
        """A follower's new snapshot (from its thread): write the digest if it moved. A
        store error propagates: the follower reads afresh and calls again."""
        members, joined = self._members, self._joined
        if members is None or joined is None:
            return
        at, joined_at = members.followed_at(), joined.state()  # live: one snapshot
        if at is None or joined_at is None:
            return
        live, revision = at
        with self._lock:
            if not self._claim:
                return
            raw = encode_digest(self._node, live, _left(live, revision, joined_at))
            if raw == self._written:
                return
            writer = self._prefix + _WRITER
            fence = Compare(writer, "create_revision", "==", self._claim)
            ok = self._store.txn([fence], [Put(self._prefix + _DIGEST, raw)]).succeeded
            if ok:
                self._written = raw
            else:  # another agent writes now (our lease went): stop at the next tick
                self._claim = 0

    def _stop_writing(self) -> None:
        for follower in (self._members, self._joined):
            if follower is not None:
                follower.close()
        self._members = self._joined = None

    def close(self) -> None:
        with self._lock:
            self._claim = 0
        self._stop_writing()
        self._digest.close()


def _left(live: frozenset[int], members_at: int, joined: Followed) -> set[int]:
    """Nodes that joined and have no member key, as of the members' snapshot: a node
    whose ``joined`` key is newer than that snapshot may have a member key the members'
    watch has not carried yet (the two watches go at their own pace), so it is not
    counted as gone on the strength of a lag (it would be reported lost, then found)."""
    known = {name for name, revision in joined.revisions.items() if revision <= members_at}
    return node_ids(known) - live
