"""JobGeneration, in-process over a real Coordinator on a MemoryStore: the one agent-side
owner of the generation, the restart count and the master port."""

from __future__ import annotations

from typing import Any

from stalwart.agent.cluster._generation import JobGeneration

from .._fakes import FakeEvents, FakeLaunch, coordinator


def _gen() -> tuple[JobGeneration, FakeEvents, FakeLaunch]:
    events, launch = FakeEvents(), FakeLaunch()
    return JobGeneration(coordinator(), launch, events, world_size=4), events, launch


def test_bump_advances_and_records_the_generation() -> None:
    gen, events, _ = _gen()
    assert gen.sync() == 0 and gen.current == 0
    assert gen.bump("crash of rank 1") == 1 and gen.current == 1
    assert events.of("generation") == [
        {"generation": 1, "world_size": 4, "reason": "crash of rank 1"}
    ]


def test_a_bump_that_must_win_bumps_again_over_a_worker_that_bumped_first() -> None:
    coord = coordinator()
    events, launch = FakeEvents(), FakeLaunch()
    gen = JobGeneration(coord, launch, events, world_size=2)
    coord.advance_generation(0, "a worker's collective failed")  # it got there first
    assert gen.bump("restart after crash", must_win=True) == 2
    assert coord.generation_meta()["reason"] == "restart after crash"
    lost = JobGeneration(coord, launch, events, world_size=2)
    assert lost.bump("late") == 2  # lost the race: takes the winner's number
    assert coord.generation() == 2


def test_a_restart_moves_to_a_fresh_published_port_and_other_nodes_follow_it() -> None:
    coord = coordinator()
    launch = FakeLaunch()
    here = JobGeneration(coord, launch, FakeEvents(), world_size=2)
    there = JobGeneration(coord, launch, FakeEvents(), world_size=2)
    assert here.restart("crash of rank 0") == 1
    assert launch.records["master-1"] == {"port": here.master_port}
    followed = there.follow()
    assert followed is not None and followed.restart and followed.generation == 1
    there.follow_port()
    assert there.master_port == here.master_port
    assert there.follow() is None  # nothing new
    assert there.restarts == 0
    there.restarted()
    assert there.restarts == 1


def test_following_an_in_place_recovery_is_not_a_restart() -> None:
    coord = coordinator()
    gen = JobGeneration(coord, FakeLaunch(), FakeEvents(), world_size=2)
    coord.advance_generation(0, "hang of rank 3")
    followed = gen.follow()
    assert followed is not None and not followed.restart and gen.current == 1


def test_following_through_a_watch_reads_the_store_only_when_it_moved() -> None:
    """Issue 31: the agent's poll looked at the generation with a store read ten times
    a second; with the feed (agent/cluster/_genfeed.py) a look reads nothing until a bump."""
    import time

    from stalwart.agent.cluster._genfeed import GenerationFeed

    coord = coordinator()
    reads = [0]

    class Counting:
        def generation(self) -> int:
            reads[0] += 1
            return coord.generation()

        def advance_generation(self, expected: int, reason: str) -> Any:
            return coord.advance_generation(expected, reason)

        def generation_meta(self) -> dict[str, Any]:
            reads[0] += 1
            return coord.generation_meta()

    here = JobGeneration(Counting(), FakeLaunch(), FakeEvents(), world_size=2)
    feed = GenerationFeed(lambda: coord.store, coord.generation_key)
    try:
        here.use_feed(feed)
        deadline = time.monotonic() + 30
        while feed.latest() is None:  # the watch opened (no fixed sleep)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(50):
            assert here.follow() is None
        assert reads[0] == 0
        coord.advance_generation(0, "node 3 lost")
        while (followed := here.follow()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert followed.generation == 1 and not followed.restart
        # the number and its reason came in one watch event: no read (two before)
        assert reads[0] == 0
        coord.advance_generation(1, "restart after crash of rank 2")
        while (followed := here.follow()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert followed.generation == 2 and followed.restart and reads[0] == 0
    finally:
        feed.close()


class _Feed:
    def __init__(self, latest: int | None, reasons: dict[int, str]) -> None:
        self._latest, self._reasons = latest, reasons

    def latest(self) -> int | None:
        return self._latest

    def reason(self, generation: int) -> str | None:
        return self._reasons.get(generation)


def test_a_feed_without_the_bumps_reason_reads_the_store() -> None:
    """The watch carried the number but not its record (or an older one's): the store is
    read, so a restart is never followed as an in-place recovery."""
    coord = coordinator()
    here = JobGeneration(coord, FakeLaunch(), FakeEvents(), world_size=2)
    coord.advance_generation(0, "restart after crash of rank 0")
    here.use_feed(_Feed(1, {0: "start"}))
    followed = here.follow()
    assert followed is not None and followed.generation == 1 and followed.restart
    coord.advance_generation(1, "hang of rank 1")
    here.use_feed(_Feed(2, {2: "restart after hang of rank 1"}))  # trusted as carried
    followed = here.follow()
    assert followed is not None and followed.generation == 2 and followed.restart
