"""Retention under a coordinator never deletes the newest step every rank committed."""

from __future__ import annotations

from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.runtime._accounting import _common_step


def test_common_step_is_the_oldest_rank_newest_commit() -> None:
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="job"))
    assert _common_step(coord, 2, replicated=False) == set()  # nobody committed yet
    coord.record_shard_commit(0, 10, "rank0")
    assert _common_step(coord, 2, replicated=False) == set()  # rank 1 has nothing: keep policy
    coord.record_shard_commit(0, 8, "rank1")
    coord.record_shard_commit(0, 12, "rank0")
    assert _common_step(coord, 2, replicated=False) == {8}  # rank 0 keeps 8 for a restore
    assert _common_step(coord, 2, replicated=True) == set()  # one directory: newest is kept
    assert sorted(coord.shard_commits()) == ["rank0", "rank1"]  # one key per shard
