"""Telling a store that could not run from clients that stopped calling (MemoryStore).

A watcher that sleeps until the next lease deadline puts its planned wake on record; a
call or a wake that comes more than ``STALL_S`` after the earliest planned wake means the
store's process did not run in between (descheduled on a loaded host, a long pause),
so keepalives sent in time may be waiting unread: the store then renews every lease
before it expires any (docs/architecture.md). The caller holds the store's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["STALL_S", "StallWatch"]

STALL_S = 1.0
"""A sleeping watcher woken this much later than it asked to be means the store stalled."""


class StallWatch:
    """The planned wakes of the store's sleeping watchers, and how often it stalled."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._planned: dict[int, float] = {}
        self._seq = 0
        self.stalls = 0

    @property
    def sleeping(self) -> int:
        """How many watchers are asleep with a planned wake."""
        return len(self._planned)

    def sleep(self, cond: threading.Condition, wait: float | None) -> bool:
        """``cond.wait(wait)`` with its planned wake on record; True if the wake came late."""
        if wait is None:
            cond.wait()
            return False
        self._seq += 1
        token, planned = self._seq, self._clock() + wait
        self._planned[token] = planned
        try:
            cond.wait(wait)
        finally:
            planned = self._planned.pop(token, planned)  # moved on if a stall was seen
        return self.stalled(planned)

    def stalled(self, planned: float | None = None) -> bool:
        """True (once per stall) if now is ``STALL_S`` past the earliest planned wake."""
        now = self._clock()
        earliest = min(self._planned.values(), default=None)
        if planned is not None:
            earliest = planned if earliest is None else min(earliest, planned)
        if earliest is None or now <= earliest + STALL_S:
            return False
        self.stalls += 1
        for key in self._planned:
            self._planned[key] = now  # counted once: the wakes it held up are now
        return True
