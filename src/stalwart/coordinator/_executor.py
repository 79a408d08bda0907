"""One thread that runs the store server's short requests, in arrival order.

With a thread per connection, every request took the store's one lock itself: at
hundreds of nodes ~4 threads per node queued on that lock, and on a loaded host each
hand-off waited for a core (a lock convoy: docs/scale.md, 512 nodes). Here the
connection threads only read and write their sockets; the requests themselves run on
one thread, which drains every request queued while it ran, so the store's lock is
taken by one thread (and the long-polls, which sleep on it) instead of hundreds.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["StoreExecutor"]

_STOP = object()


class StoreExecutor:
    """``call(fn, *args)`` runs ``fn(*args)`` on the executor's thread and returns it."""

    def __init__(self, name: str = "stalwart-store-exec") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``'s result; ``fn`` must not raise (the server's ``_run`` wraps)."""
        slot: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._jobs.put((fn, args, slot))
        return slot.get()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, args, slot = job
            slot.put(fn(*args))

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout)
