"""Who commits a sharded step (the last rank to write it, exactly once per generation),
and the step counts ``--persist-every auto`` becomes for a sharded job."""

from __future__ import annotations

import threading

import pytest

from stalwart.coordinator import MemoryStore
from stalwart.runtime._cadence import CadenceRecordError
from stalwart.runtime._sharded import AutoPersist, ShardedCommit


def _members(store: MemoryStore, world: int, launch: int = 0) -> list[ShardedCommit]:
    return [ShardedCommit(store, "job", launch, r, world) for r in range(world)]


def test_the_rank_that_completes_the_set_commits_once() -> None:
    store = MemoryStore()
    a, b, c = _members(store, 3)
    assert not a.written(0, 10)
    assert not c.written(0, 10)
    assert b.written(0, 10)  # the last index of step 10: b commits it
    assert not a.written(0, 10)  # a late duplicate record never wins a second time
    # another generation (or a relaunch) is a different claim: the old one does not count
    assert not a.written(1, 10) and not b.written(1, 10)
    assert c.written(1, 10)
    x, y, z = _members(store, 3, launch=1)
    assert not x.written(1, 10) and not y.written(1, 10) and z.written(1, 10)


def test_concurrent_writers_elect_exactly_one_committer() -> None:
    store = MemoryStore()
    members = _members(store, 8)
    won: list[int] = []
    start = threading.Barrier(len(members))

    def write(m: ShardedCommit) -> None:
        start.wait()
        if m.written(0, 4):
            won.append(m.rank)

    threads = [threading.Thread(target=write, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1


def test_prune_drops_older_steps_and_keeps_the_committed_one() -> None:
    store = MemoryStore()
    a, b = _members(store, 2)
    assert not a.written(0, 2)  # step 2: b never wrote it (it skipped that persist)
    a.written(0, 4)
    assert b.written(0, 4)
    assert not a.written(0, 6)  # in flight: newer than the commit
    b.prune(0, 4)
    keys = [kv.key for kv in store.range("/stalwart/job/sharded/").kvs]
    assert not [k for k in keys if "/000000000002/" in k]
    assert [k for k in keys if "/000000000006/" in k]
    assert not a.written(0, 4)  # step 4's claim survives its prune


def test_auto_becomes_the_same_persist_steps_on_every_rank() -> None:
    store = MemoryStore()
    zero, one = AutoPersist(store, "job", 0), AutoPersist(store, "job", 1)
    assert not one.due(10, 10.0, [1.0])  # rank 0 has not chosen yet: nobody persists
    # rank 0 at step 10: Daly's 10 s over a 2 s median step = every 5 steps, from step 12,
    # so step 10 (a multiple of 5) is not a persist point for rank 0 either: rank 1
    # looked before rank 0 published, and a step only one rank wrote never commits
    assert not zero.due(10, 10.0, [2.0, 2.0, 3.0])
    assert (zero.every, zero.start) == (5, 12)
    assert not one.due(11, 99.0, [9.0])  # reads the job's record, ignores its own timing
    assert (one.every, one.start) == (5, 12)
    persisted = [s for s in range(12, 31) if zero.due(s, 1.0, [1.0])]
    assert persisted == [15, 20, 25, 30]
    assert [s for s in range(12, 31) if one.due(s, 1.0, [1.0])] == persisted


def test_a_restarted_rank_0_adopts_the_jobs_record() -> None:
    store = MemoryStore()
    assert not AutoPersist(store, "job", 0).due(8, 10.0, [2.0])  # every 5 from 10
    again = AutoPersist(store, "job", 0)  # a later generation, another MTBF and step time
    assert again.due(10, 70.0, [1.0]) and (again.every, again.start) == (5, 10)


def test_a_malformed_auto_record_is_refused() -> None:
    store = MemoryStore()
    store.put("/stalwart/job/persist-auto", b'{"every": 0, "from": 3}')
    with pytest.raises(CadenceRecordError, match="persist-every auto"):
        AutoPersist(store, "job", 1).due(9, 1.0, [1.0])
