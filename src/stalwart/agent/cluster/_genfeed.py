"""The job's generation as a watch delivers it to this agent: its loop's store poll reads
this instead of the store.

The agent's loop looks at the generation at every store poll (ten a second). A read per
look made the generation the largest share of a job's steady store load: at 1,024 nodes,
~10,000 reads a second for a number that changes once per failure (docs/scale.md). The
feed keeps one watch on the generation key (a long-poll of up to ``_WAIT_S`` on the
embedded store, a stream under etcd) and remembers the newest generation it carried. A
look costs nothing; a broken watch (the store away, its history compacted) says
"unknown" until a new one is open, and the caller reads the store then, as before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["GenerationFeed"]

_WAIT_S = 5.0  # one long-poll's wait: the steady cost is one request per this per node
_READ_S = 30.0  # a read now and then besides the watch (belt and braces)


class GenerationFeed:
    """The newest generation seen on the key ``key()`` of the store ``store()``."""

    def __init__(
        self, store: Callable[[], Any], key: Callable[[], str], read: Callable[[], int]
    ) -> None:
        self._store, self._key, self._read = store, key, read
        self._latest: int | None = None  # None: no watch open (the caller reads)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="stalwart-genfeed", daemon=True)
        self._thread.start()

    def latest(self) -> int | None:
        """The newest generation the watch carried (None: unknown, read the store)."""
        return self._latest

    def _saw(self, generation: int) -> None:
        with self._lock:
            if self._latest is None or generation > self._latest:
                self._latest = generation

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception:  # the store away for a moment: unknown until a new watch
                self._latest = None
                self._close_watch()
                self._stop.wait(1.0)

    def _follow(self) -> None:
        watch = self._watch = self._store().watch(self._key())  # open first, then read
        next_read = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_read:
                self._saw(self._read())
                next_read = time.monotonic() + _READ_S
            for event in watch.get(timeout=_WAIT_S):
                try:
                    self._saw(int(event.kv.value))
                except (AttributeError, TypeError, ValueError):  # a delete: read it
                    next_read = 0.0

    def _close_watch(self) -> None:
        if self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.close()
            self._watch = None

    def close(self) -> None:
        self._stop.set()
        self._close_watch()  # ends a get() in progress on an in-process store
        self._thread.join(0.1)  # a long-poll ends when its client closes: not waited for
