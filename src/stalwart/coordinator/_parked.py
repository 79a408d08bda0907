"""The store server's parked long-polls (_loop.py): per prefix, to find the ones a write
wakes, and in a heap of their timeouts. Only the event loop's thread touches them."""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

__all__: list[str] = []


class Watch:
    """A long-poll waiting for events under ``prefix`` from revision ``start``."""

    __slots__ = ("conn", "deadline", "prefix", "start")

    def __init__(self, conn: Any, prefix: str, start: int, deadline: float) -> None:
        self.conn, self.prefix, self.start, self.deadline = conn, prefix, start, deadline


class Parked:
    """Parked long-polls; a connection's own is ``conn.watch`` while it waits."""

    def __init__(self) -> None:
        self._by_prefix: dict[str, set[Watch]] = defaultdict(set)
        self._timeouts: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()

    def park(self, conn: Any, prefix: str, start: int, deadline: float) -> None:
        watch = conn.watch = Watch(conn, prefix, start, deadline)
        self._by_prefix[prefix].add(watch)
        heapq.heappush(self._timeouts, (deadline, next(self._seq), watch))

    def unpark(self, watch: Watch | None) -> None:
        if watch is None or watch.conn.watch is not watch:
            return
        watch.conn.watch = None
        parked = self._by_prefix.get(watch.prefix)
        if parked is not None:
            parked.discard(watch)
            if not parked:
                del self._by_prefix[watch.prefix]

    def next_timeout(self) -> float | None:
        return self._timeouts[0][0] if self._timeouts else None

    def timed_out(self, now: float) -> Iterator[Watch]:
        """The parked long-polls whose timeout passed (the caller unparks each)."""
        heap = self._timeouts
        while heap and heap[0][0] <= now:
            _, _, watch = heapq.heappop(heap)
            if watch.conn.watch is watch:
                yield watch

    def under(self, keys: set[str], everything: bool) -> Iterator[tuple[str, list[Watch]]]:
        """``(prefix, its long-polls)`` for every prefix one of ``keys`` falls under."""
        for prefix in list(self._by_prefix):
            if everything or any(k.startswith(prefix) for k in keys):
                yield prefix, list(self._by_prefix.get(prefix, ()))
