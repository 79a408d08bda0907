"""Who commits a sharded step (the last rank to write it, exactly once per generation),
over the job's store as the worker gives it (runtime/comm/_coord.py ``CommitKeys``), and what
the engine's commit of a persisted step says (committed, left to a peer, refused)."""

from __future__ import annotations

import threading
from pathlib import Path

from stalwart.checkpoint import (
    CommitPlan,
    FencedCommit,
    ShardedCommit,
    StepCommitter,
    committed_steps,
)
from stalwart.checkpoint._writer import write_rank
from stalwart.checkpoint.storage import LocalStorage
from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.errors import FencedError
from stalwart.runtime.comm._coord import CommitKeys


def _members(store: MemoryStore, world: int, launch: int = 0) -> list[ShardedCommit]:
    return [ShardedCommit(CommitKeys(store), "job", launch, r, world) for r in range(world)]


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


def _write(storage: LocalStorage, step: int, rank: int, world: int) -> None:
    data = memoryview(bytearray([rank + 1]) * 64)
    layout = [{"id": 0, "path": ".w", "dtype": "uint8", "shape": [64], "nbytes": 64, "offset": 0}]
    tree = {"t": "dict", "items": [[".w", {"t": "tensor", "id": 0}]]}
    write_rank(
        storage,
        step=step,
        rank=rank,
        world_size=world,
        tree=tree,
        layout=layout,
        data=data,
        known={},
    )


def test_the_last_writer_commits_and_the_outcome_says_who(tmp_path: Path) -> None:
    """Each rank's commit of a written step: the first is left to its peer, the last
    commits the job's one root (recorded as ``sharded``, and as the job's checkpoint)."""
    store = MemoryStore()
    coord = Coordinator(store, CoordinatorConfig(job_id="job"))
    storage = LocalStorage(str(tmp_path), direct_io=False)
    outcomes = []
    for member in _members(store, 2):
        _write(storage, 4, member.rank, 2)
        plan = CommitPlan.sharded_step(coord, member, generation=0)
        committer = StepCommitter(storage, world_size=2, fenced=plan.fenced)
        outcomes.append(committer.commit_written(4, generation=0, sharded=plan.sharded))
    first, last = outcomes
    assert first.by_peer and first.result is None and first.error is None
    assert last.result is not None and last.result.manifest.step == 4 and not last.by_peer
    assert committed_steps(storage) == [4]
    assert coord.shard_commits()["sharded"].step == 4
    latest = coord.latest_checkpoint()
    assert latest is not None and latest.step == 4


def test_a_refused_commit_is_an_outcome_not_an_exception(tmp_path: Path) -> None:
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="job"))
    storage = LocalStorage(str(tmp_path), direct_io=False)
    _write(storage, 4, 0, 1)
    assert coord.advance_generation(0, "a member failed").won
    plan = CommitPlan(FencedCommit(coord, shard="rank0"), generation=0)
    out = StepCommitter(storage, fenced=plan.fenced).commit_written(4, generation=0)
    assert out.refused and isinstance(out.error, FencedError) and out.result is None
    assert committed_steps(storage) == []
