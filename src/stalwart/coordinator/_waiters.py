"""Whom a MemoryStore write wakes, and when leases expire: O(1) per call in the number of
watchers and leases.

At N nodes the embedded store holds ~N leases and ~2N long-polls asleep at once (each
agent's generation watch and membership view, each worker's generation watch). It used
to wake every sleeping long-poll at every write (one condition for all) and to scan
every lease at every call for one that expired, and every sleeping watcher woke at the
earliest lease deadline: O(N) per call, O(N^2) a second for the job (docs/scale.md). Here
a long-poll sleeps on the condition of its prefix, woken only by writes under it; the
lease deadlines are a heap; one sleeping long-poll, the timer, wakes at the earliest
deadline to expire the lease (and to tell a stall, _stall.py), and hands the role to
another sleeper when it returns. An event loop serving the store (the server's,
_loop.py) parks its long-polls itself and listens here instead: ``listen(fn)`` has
``fn(keys)`` called with the keys of every write, ``fn(())`` on a new lease deadline
and ``fn(None)`` when every waiter must look again (stop, close). The caller holds the
store's lock.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from stalwart.coordinator._stall import StallWatch

__all__ = ["ExpiryQueue", "Waiters"]


class _Deadline(Protocol):
    @property
    def deadline(self) -> float: ...


class ExpiryQueue:
    """Lease deadlines in a heap; a renewed lease's old entries are skipped."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def push(self, deadline: float, lease_id: int) -> None:
        if deadline != math.inf:  # a pinned lease (MemoryStore.pin) has no deadline
            heapq.heappush(self._heap, (deadline, lease_id))

    def push_all(self, leases: Mapping[int, _Deadline]) -> None:
        for lease_id, entry in leases.items():
            self.push(entry.deadline, lease_id)

    def due(self, now: float, leases: Mapping[int, _Deadline]) -> list[int]:
        """The leases whose deadline passed (each once)."""
        out: list[int] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            entry = leases.get(lease_id)
            if entry is not None and entry.deadline <= now and lease_id not in out:
                out.append(lease_id)
        return out

    def earliest(self, leases: Mapping[int, _Deadline]) -> float | None:
        """The earliest current deadline (stale entries on top dropped)."""
        heap = self._heap
        while heap:
            deadline, lease_id = heap[0]
            entry = leases.get(lease_id)
            if entry is not None and entry.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None


class _Prefix:
    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self.waiters = 0  # in wait_events now
        self.sleeping = 0  # asleep on cond now


class Waiters:
    """Long-polls asleep per prefix, and which one is the lease timer."""

    def __init__(self, lock: threading.Lock, stall: StallWatch) -> None:
        self._lock = lock
        self._stall = stall
        self._prefixes: dict[str, _Prefix] = {}
        self._timer: object | None = None  # the long-poll that wakes at lease expiry
        self._timer_cond: threading.Condition | None = None
        self._listeners: list[Callable[[tuple[str, ...] | None], None]] = []

    def listen(self, fn: Callable[[tuple[str, ...] | None], None]) -> None:
        """Call ``fn`` (under the store's lock: it must only take note) on every change."""
        self._listeners.append(fn)

    def unlisten(self, fn: Callable[[tuple[str, ...] | None], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def _tell(self, keys: tuple[str, ...] | None) -> None:
        for fn in self._listeners:
            fn(keys)

    def enter(self, prefix: str) -> Any:
        entry = self._prefixes.get(prefix)
        if entry is None:
            entry = self._prefixes[prefix] = _Prefix(self._lock)
        entry.waiters += 1
        return (prefix, object())

    def leave(self, waiter: Any) -> None:
        prefix, token = waiter
        entry = self._prefixes[prefix]
        entry.waiters -= 1
        if entry.waiters == 0:
            del self._prefixes[prefix]
        if self._timer is token:  # another sleeper takes the role
            self._timer = self._timer_cond = None
            for other in self._prefixes.values():
                if other.sleeping:
                    other.cond.notify()
                    break

    def sleep(
        self, waiter: Any, wait: float | None, next_expiry: Callable[[], float | None]
    ) -> bool:
        """Sleep until a write under the prefix, ``wait`` seconds, or (the timer) the
        next lease deadline; True if the store stalled (StallWatch)."""
        prefix, token = waiter
        entry = self._prefixes[prefix]
        entry.sleeping += 1
        try:
            if self._timer is None or self._timer is token:
                self._timer, self._timer_cond = token, entry.cond
                until = next_expiry()
                if until is not None:
                    wait = until if wait is None else min(wait, until)
                return self._stall.sleep(entry.cond, wait)
            entry.cond.wait(wait)
            return False
        finally:
            entry.sleeping -= 1

    def wrote(self, keys: Iterable[str]) -> None:
        """Wake the long-polls of every prefix one of ``keys`` falls under."""
        keys = tuple(keys)
        self._tell(keys)
        for prefix, entry in self._prefixes.items():
            if entry.sleeping and any(k.startswith(prefix) for k in keys):
                entry.cond.notify_all()

    def new_deadline(self) -> None:
        """A lease was granted: the timer may need to wake sooner."""
        self._tell(())
        if self._timer_cond is not None:
            self._timer_cond.notify_all()

    def wake_all(self) -> None:
        self._tell(None)
        for entry in self._prefixes.values():
            entry.cond.notify_all()
