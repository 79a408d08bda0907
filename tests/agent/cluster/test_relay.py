"""The agent's generation relay to its workers (agent/cluster/_relay.py) with the worker's
real GenerationWatch (runtime/comm/_coord.py): a bump the agent's feed delivers reaches
every worker with no store request of theirs; a worker connecting between bumps hears
the next; one that does not read never blocks the agent; a relay that ends or is not
there leaves the worker on the store's watch."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from stalwart.agent.cluster._generation import JobGeneration
from stalwart.agent.cluster._relay import GenerationRelay
from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.runtime.comm._coord import GenerationWatch

from .._fakes import FakeEvents, FakeLaunch


class _Counting(MemoryStore):
    """Counts the requests of the watched coordinator (the worker's)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.calls += 1

    def get(self, key: str) -> Any:
        self._count()
        return super().get(key)

    def watch(self, prefix: str, start_revision: int | None = None) -> Any:
        self._count()
        return super().watch(prefix, start_revision)


def _until(cond: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _worker(store: MemoryStore, relay: str) -> GenerationWatch:
    coord = Coordinator(store, CoordinatorConfig(job_id="relay"))
    watch = GenerationWatch(coord, relay=relay)
    watch.follow(0)
    return watch


def test_a_bump_reaches_every_worker_through_the_agent_with_no_request_of_theirs() -> None:
    store = MemoryStore()
    agent = JobGeneration(
        Coordinator(store, CoordinatorConfig(job_id="relay")), FakeLaunch(), FakeEvents(), 8
    )
    close = agent.started(0)
    assert agent.relay_address.startswith("@")
    workers_store = _Counting()  # the workers' reads go here: only their first one
    workers_store.put("/stalwart/relay/gen", b"0")
    workers = [_worker(workers_store, agent.relay_address) for _ in range(8)]
    try:
        assert _until(lambda: workers_store.calls == 8)  # one read each, after connecting
        agent.follow()  # the agent's poll: accepts the workers waiting to connect
        other = Coordinator(store, CoordinatorConfig(job_id="relay"))
        other.advance_generation(0, "node 3 lost")  # another node's bump, in the store
        for w in workers:
            assert w.moved.wait(20), "the relay did not tell a worker"
            assert w.seen == 1
        assert workers_store.calls == 8  # no watch, no read: the relay told them
    finally:
        for w in workers:
            w.close()
        close()


def test_a_worker_that_connects_between_bumps_hears_the_next() -> None:
    relay = GenerationRelay()
    store = MemoryStore()
    try:
        relay.publish(1)
        late = _worker(store, relay.address)  # connected after 1 was sent
        assert _until(lambda: late._relay_sock is not None)
        assert not late.moved.is_set()
        relay.publish(2)  # accepts it from the listen queue, then sends
        assert late.moved.wait(20) and late.seen == 2
        relay.publish(2)  # a number once: nothing more
        late.follow(2)
        relay.publish(3)
        assert late.moved.wait(20) and late.seen == 3
        late.close()
    finally:
        relay.close()


def test_a_worker_that_does_not_read_never_blocks_the_agent() -> None:
    relay = GenerationRelay()
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stuck.connect("\0" + relay.address[1:])
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        relay.tend()
        for generation in range(1, 20_001):  # far more than its buffers hold; a send
            relay.publish(generation)  # that blocked would hang here (the test's timeout)
        assert relay._workers == []  # dropped once its buffer was full
    finally:
        stuck.close()
        relay.close()


def test_a_relay_that_ends_leaves_the_worker_on_the_stores_watch() -> None:
    relay = GenerationRelay()
    store = MemoryStore()
    worker = _worker(store, relay.address)
    try:
        assert _until(lambda: worker._relay_sock is not None)
        relay.tend()
        relay.close()  # the agent closes (or dies): the worker's recv ends
        assert _until(lambda: worker._relay_sock is None)
        Coordinator(store, CoordinatorConfig(job_id="relay")).advance_generation(0, "t")
        assert worker.moved.wait(20), "after its relay ended the worker saw no bump"
    finally:
        worker.close()


def test_no_relay_there_means_the_stores_watch() -> None:
    store = MemoryStore()
    for address in ("@stalwart-gen-nobody-listens", "/not/abstract", "@" + "x" * 200):
        worker = _worker(store, address)
        try:
            gen = Coordinator(store, CoordinatorConfig(job_id="relay")).generation()
            Coordinator(store, CoordinatorConfig(job_id="relay")).advance_generation(gen, "t")
            assert worker.moved.wait(20), address
        finally:
            worker.close()
