"""``MemoryStore.watch``'s Watch: pulls from the store's ``wait_events``."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from stalwart.coordinator.errors import StoreClosedError
from stalwart.coordinator.store import Event

__all__ = ["MemoryWatch"]


class _Events(Protocol):
    def wait_events(
        self,
        prefix: str,
        start_revision: int,
        timeout: float | None,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[Event]: ...

    def poll_events(
        self, prefix: str, start_revision: int, *, max_bytes: int | None = None
    ) -> tuple[list[Event], int]: ...

    def wake_waiters(self) -> None: ...


class MemoryWatch:
    """A :class:`~stalwart.coordinator.store.Watch` over a :class:`MemoryStore`."""

    def __init__(self, store: _Events, prefix: str, start: int) -> None:
        self._store = store
        self._prefix = prefix
        self._next = start
        self._closed = False

    @property
    def next_revision(self) -> int:
        """The first revision the next :meth:`get` can return."""
        return self._next

    def get(self, timeout: float | None = None) -> list[Event]:
        if self._closed:
            raise StoreClosedError("this watch is closed; open a new one")
        events = self._store.wait_events(
            self._prefix, self._next, timeout, cancelled=lambda: self._closed
        )
        if not events and not self._closed:  # nothing up to the store's revision: skip it
            events, looked_to = self._store.poll_events(self._prefix, self._next)
            if not events:
                self._next = max(self._next, looked_to + 1)
        if events:
            self._next = events[-1].kv.mod_revision + 1
        return events

    def close(self) -> None:
        """Close the watch; a :meth:`get` waiting in another thread returns ``[]`` now."""
        if not self._closed:
            self._closed = True
            self._store.wake_waiters()

    def __enter__(self) -> MemoryWatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
