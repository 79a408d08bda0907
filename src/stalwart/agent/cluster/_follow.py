"""The keys under one prefix of the job's store, kept current by a watch in a thread of
its own, so that a look at them costs no request.

An agent looks at some keys far more often than they change: the live members (its ring
successor once a second, the leader's lost-node check ten times a second) and the
verdict another node may end the job with (once a second). A request per look was
most of a node's steady store load: at 1,024 nodes, ~2,000 requests a second for keys
that change once per failure (docs/scale.md). A :class:`PrefixFollower` reads the prefix
once, then applies a watch's events from its own thread; its watch waits up to
``wait_s`` per request (a long-poll on the embedded store, parked by the server without
a thread; a look at the open stream under etcd), so its steady cost is one request per
``wait_s``. It can read the prefix afresh every ``reread_s`` besides (belt and braces):
worth it for one key, not for a prefix of N keys that every one of N nodes follows
(O(N^2) keys read per period for the job).

A burst of changes (N nodes joining at once) would answer each follower's long-poll
again and again, N followers times the changes: ``gap_s`` makes a follower wait that long
after a batch before it asks again, so a burst costs each follower one request per gap
(the changes meanwhile come in one batch), and a change after a quiet spell still
arrives at once. A look is O(1): the follower publishes a new read-only copy per batch.

While no watch is open (the store away, its history compacted, not yet started)
:meth:`PrefixFollower.snapshot` says so with ``None`` and the caller reads the store
itself, as it did before: a look is never answered from a state the follower cannot
vouch for.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = ["Followed", "FollowedKey", "PrefixFollower", "watch_wait"]

WAIT_S = 5.0  # one long-poll's wait: the steady cost is one request per this per node
REREAD_S = 30.0  # a fresh read of one key now and then besides its watch
RETRY_S = 1.0  # after a broken watch: how long before the next try


def _spread(seconds: float) -> float:
    """``seconds`` less up to a quarter, at random: the agents of a job start together, and
    watches that each waited exactly ``wait_s`` renewed together, every node's at once,
    for as long as the job ran (at 1,024 nodes, ~3,000 requests in a burst every 30 s;
    a loss that fell into one took twice as long to agree, docs/scale.md)."""
    return seconds * random.uniform(0.75, 1.0)


def watch_wait(lease_s: float) -> float:
    """How long an agent's watch waits per request: :data:`WAIT_S`, or its node lease
    when longer. A job configures a longer lease at scale (docs/scale.md) to spend
    fewer requests on keepalives; its watches follow, so each costs one request per
    lease too. Nothing waits on a long-poll's end: a write answers it at once, a closed
    connection ends it, and a node cut off silently for a lease is fenced anyway."""
    return max(WAIT_S, lease_s)


class Followed(NamedTuple):
    """A follower's snapshot: the keys' values, their ``mod_revision``, and the store
    revision up to which every change is in it."""

    kvs: Mapping[str, bytes]
    revisions: Mapping[str, int]
    revision: int


class PrefixFollower:
    """Every key under ``prefix`` and its value, from one range and a watch."""

    def __init__(
        self,
        store: Callable[[], Any],
        prefix: str,
        *,
        name: str,
        wait_s: float = WAIT_S,
        reread_s: float | None = None,
        gap_s: float = 0.0,
        on_change: Callable[[Mapping[str, bytes]], None] | None = None,
    ) -> None:
        """``on_change``: called from the follower's thread with each new snapshot (the
        first read's included), as soon as it is published."""
        self._store, self._prefix = store, prefix
        self._wait_s, self._reread_s, self._gap_s = wait_s, reread_s, gap_s
        self._on_change = on_change
        # never changed once published (a look shares it); None: no watch open. With the
        # values, each key's mod_revision and the store revision the snapshot holds up to:
        # for a caller that compares two followers' snapshots
        self._state: Followed | None = None
        self._watch: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def snapshot(self) -> Mapping[str, bytes] | None:
        """The keys (without the prefix) and values now, read-only (the same object until
        the next change); None while no watch is open."""
        state = self._state
        return None if state is None else state.kvs

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception:  # the store away for a moment: unknown until a new watch
                self._forget()
                self._stop.wait(RETRY_S)

    def state(self) -> Followed | None:
        """The snapshot with each key's ``mod_revision`` and the store revision it holds
        up to (every change at or before it is in); None while no watch is open."""
        return self._state

    def _follow(self) -> None:
        store = self._store()
        snap = store.range(self._prefix)
        watch = store.watch(self._prefix, snap.revision + 1)  # no event between the two
        n = len(self._prefix)
        with self._lock:
            self._close_watch()
            if self._stop.is_set():  # closed while we opened it
                with contextlib.suppress(Exception):
                    watch.close()
                return
            self._watch = watch
            first = MappingProxyType({kv.key[n:]: kv.value for kv in snap.kvs})
            revs = {kv.key[n:]: kv.mod_revision for kv in snap.kvs}
            self._state = Followed(first, MappingProxyType(revs), snap.revision)
        self._changed(first)
        reread_at = time.monotonic() + _spread(self._reread_s or float("inf"))
        while not self._stop.is_set() and time.monotonic() < reread_at:
            events = watch.get(timeout=_spread(self._wait_s))
            if not events:
                continue
            with self._lock:
                state = self._state
                if state is None or self._watch is not watch:
                    return
                kvs, revs = dict(state.kvs), dict(state.revisions)
                for event in events:
                    if event.type == "put":
                        kvs[event.kv.key[n:]] = event.kv.value
                        revs[event.kv.key[n:]] = event.kv.mod_revision
                    else:
                        kvs.pop(event.kv.key[n:], None)
                        revs.pop(event.kv.key[n:], None)
                now = MappingProxyType(kvs)
                revision = max(state.revision, events[-1].kv.mod_revision)
                self._state = Followed(now, MappingProxyType(revs), revision)
            self._changed(now)
            self._stop.wait(self._gap_s)

    def _changed(self, kvs: Mapping[str, bytes]) -> None:
        if self._on_change is not None:
            self._on_change(kvs)

    def _forget(self) -> None:
        with self._lock:
            self._state = None
            self._close_watch()

    def _close_watch(self) -> None:
        if self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.close()
            self._watch = None

    def close(self) -> None:
        self._stop.set()
        self._forget()  # ends a get() in progress on an in-process store
        self._thread.join(0.1)  # a long-poll ends when its client closes: not waited for


class FollowedKey:
    """One key's value from a :class:`PrefixFollower` on it; while the follower has no
    watch open, from a read of the store at most every ``every_s`` (the last value read
    in between). For a key looked at on every turn of the agent's loop and written once
    a job (a rank finished the job, the verdict another node ended it with): a look
    costs no request."""

    def __init__(
        self, store: Callable[[], Any], key: str, *, name: str, wait_s: float, every_s: float
    ) -> None:
        self._store, self._key, self._every_s = store, key, every_s
        self._follower = PrefixFollower(store, key, name=name, wait_s=wait_s, reread_s=REREAD_S)
        self._read_at = 0.0
        self._last: bytes | None = None

    def value(self) -> bytes | None:
        """The key's value now (None: no such key); a store error propagates."""
        kvs = self._follower.snapshot()
        if kvs is not None:
            return kvs.get("")  # the key itself (the prefix also matches longer names)
        now = time.monotonic()
        if now >= self._read_at:
            self._read_at = now + self._every_s
            got = self._store().get(self._key)
            self._last = None if got is None else got.value
        return self._last

    def close(self) -> None:
        self._follower.close()
