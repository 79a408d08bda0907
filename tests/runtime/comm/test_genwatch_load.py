"""A worker's GenerationWatch in steady state (issue 31): one long-poll per 5 s over
the embedded store's client, no read a second; a bump still seen at once."""

from __future__ import annotations

import os
import threading
from typing import Any

from stalwart.coordinator import (
    Coordinator,
    CoordinatorConfig,
    MemoryStore,
    StoreClient,
    StoreServer,
)
from stalwart.runtime.comm._coord import GenerationWatch

TOKEN = os.urandom(32)


class _Counting(MemoryStore):
    """The server's store: counts the worker's requests that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lock = threading.Lock()

    def _counted(self) -> None:
        with self.lock:
            self.calls += 1

    def get(self, key: str) -> Any:
        self._counted()
        return super().get(key)

    def wait_events(self, *args: Any, **kwargs: Any) -> Any:
        self._counted()
        return super().wait_events(*args, **kwargs)


def test_a_quiet_generation_costs_one_long_poll_not_three_requests_a_second() -> None:
    store = _Counting()
    with StoreServer(TOKEN, store=store) as server:
        client = StoreClient("127.0.0.1", server.port, TOKEN)
        coord = Coordinator(client, CoordinatorConfig(job_id="quiet"))
        watch = GenerationWatch(coord)
        try:
            watch.follow(0)
            # the watch is open and its first read done: then a quiet 3 s
            assert _wait(lambda: store.calls >= 2)
            before = store.calls
            assert not watch.moved.wait(3.0)
            quiet = store.calls - before
            Coordinator(store, CoordinatorConfig(job_id="quiet")).advance_generation(0, "t")
            assert watch.moved.wait(30)  # the long-poll returns on the bump
        finally:
            watch.close()
            client.close()
    # at most the long-poll in flight and its successor (it was a 0.5 s long-poll and
    # a read a second: 9 requests in 3 s)
    assert quiet <= 2, quiet


def _wait(cond: Any, timeout: float = 30.0) -> bool:
    done = threading.Event()
    deadline = 0.0
    while not cond():
        deadline += 0.01
        if deadline > timeout:
            return False
        done.wait(0.01)
    return True
