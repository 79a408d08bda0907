"""GenerationGroup's wait: a collective stuck on a lost peer is left as soon as the
generation moves on (not at the peer's socket close or the collective timeout), a slow
one that completes is not disturbed; GenerationWatch sees a bump through a store watch.

Two ranks of a real gloo group run in two threads of this process (a group of two
needs both to connect); the stuck peer is rank 1 simply never entering the collective.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from torch.distributed import HashStore

from stalwart.coordinator import Coordinator, CoordinatorConfig, Event, KeyValue, MemoryStore
from stalwart.runtime.comm._coord import GenerationWatch
from stalwart.runtime.comm.group import GenerationGroup, GenerationMovedError

# far longer than the test may take: only leaving early lets these tests pass
TIMEOUT_S = 600.0
pytestmark = pytest.mark.timeout(120)


def _groups(n: int, namespace: str) -> list[GenerationGroup]:
    """``n`` members of generation 0, built concurrently (each waits for the others)."""
    store = HashStore()
    store.set_timeout(timedelta(seconds=60))
    groups = [GenerationGroup(None, r, n, TIMEOUT_S, namespace, store=store) for r in range(n)]
    threads = [threading.Thread(target=g.build, args=(0,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g.pg is not None for g in groups)
    return groups


@pytest.fixture
def pair() -> Iterator[tuple[GenerationGroup, GenerationGroup]]:
    groups = _groups(2, "group-test")
    yield groups[0], groups[1]


def test_a_stuck_collective_is_left_when_the_generation_moves(
    pair: tuple[GenerationGroup, GenerationGroup],
) -> None:
    g0, g1 = pair
    moved = threading.Event()
    g0.moved = moved.is_set
    threading.Timer(0.3, moved.set).start()
    pg = g0.pg
    g0.allreduce_(torch.ones(1))  # rank 1 never joins: only the move ends the wait
    assert isinstance(g0.error, GenerationMovedError)
    assert g0.pg is None and "generation 0" in str(g0.error)
    # the abandoned work still runs in its buried group; rank 1 ends it cleanly
    flat = torch.ones(1)
    g1.allreduce_(flat)
    assert g1.error is None and flat.item() == 2.0
    assert pg is not None


def test_a_slow_collective_completes_while_the_generation_stays(
    pair: tuple[GenerationGroup, GenerationGroup],
) -> None:
    g0, g1 = pair
    g0.moved = lambda: False
    late = torch.full((1,), 2.0)
    timer = threading.Timer(0.3, g1.allreduce_, args=(late,))  # several 50 ms slices
    timer.start()
    flat = torch.ones(1)
    g0.allreduce_(flat)
    timer.join()
    assert g0.error is None and flat.item() == 3.0 and late.item() == 3.0


def test_a_dead_member_fails_every_peer_not_only_its_neighbours() -> None:
    """Rank 3 dies (its group is dropped: its sockets close). Its ring neighbours see
    that and drop their groups in turn, so rank 1, which never talks to rank 3, fails
    too, well before the collective timeout. Regression: an error kept with its
    traceback kept the waiting frame, the work and so the group's sockets alive."""
    groups = _groups(4, "ring-test")
    live = [threading.Thread(target=g.allreduce_, args=(torch.ones(1),)) for g in groups[:3]]
    for t in live:
        t.start()
    groups[3].close()  # the dead member's sockets close
    for t in live:
        t.join(90)  # only a timeout-free failure ends these in time
    assert not any(t.is_alive() for t in live)
    assert all(g.error is not None and g.pg is None for g in groups[:3])


def test_generation_watch_sees_a_bump_through_the_store_watch() -> None:
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="watch-test"))
    # the fallback read comes every 10 minutes: only the watch can be this quick
    watch = GenerationWatch(coord, interval_s=TIMEOUT_S)
    try:
        watch.follow(0)
        coord.advance_generation(0, "test")
        assert watch.moved.wait(30)
        watch.follow(1)
        assert not watch.moved.is_set()
        coord.advance_generation(1, "test")
        assert watch.moved.wait(30)
    finally:
        watch.close()


def test_a_group_is_left_only_for_a_generation_past_its_own() -> None:
    """The survivors' rule under every strategy (elastic included): a collective of
    generation g is left once the job is past g, while a group being formed for the
    generation the bump made is not disturbed by that bump."""
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="left-test"))
    watch = GenerationWatch(coord, interval_s=TIMEOUT_S)
    try:
        watch.follow(0)
        assert not watch.left(0)
        coord.advance_generation(0, "test")
        assert watch.moved.wait(30)
        assert watch.left(0)  # generation 0's stuck collective: leave it
        assert not watch.left(1)  # generation 1's formation (before follow(1)): stay
    finally:
        watch.close()


class _LateWork:
    """A work whose slice times out, and which completes right after (a real race)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return True


def test_a_work_that_completes_just_after_its_slice_is_a_success() -> None:
    group = GenerationGroup(None, 0, 1, TIMEOUT_S, "late-test")
    group.moved = lambda: False
    assert group.error_of(_LateWork()) is None  # not the slice's timeout
    err = group.error_of(_LateWork(RuntimeError("Connection closed by peer")))
    assert isinstance(err, RuntimeError) and "closed by peer" in str(err)


def test_a_watch_event_is_read_without_a_store_round_trip() -> None:
    """The event carries the new generation: the watch does not read the key again."""
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="watch-event-test"))
    watch = GenerationWatch(coord, interval_s=TIMEOUT_S)
    try:
        watch.follow(2)

        def no_read() -> int:
            raise AssertionError("read the generation although the event carried it")

        coord.generation = no_read  # type: ignore[method-assign]
        same = KeyValue(coord.generation_key, b"2", 5, 1, 2)
        watch._seen([Event("put", same)])
        assert not watch.moved.is_set()
        watch._seen([Event("put", same), Event("put", KeyValue(same.key, b"3", 6, 1, 3))])
        assert watch.moved.is_set()
    finally:
        watch.close()
