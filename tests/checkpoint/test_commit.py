"""The one commit path (StepCommitter): alone, and fenced by the coordinator's record,
which decides a commit whose compare-and-swap had an unknown outcome."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpoint import FencedCommit, RetentionPolicy, StepCommitter, committed_steps
from stalwart.checkpoint._writer import write_rank
from stalwart.checkpoint.format import PENDING_PREFIX, step_dir
from stalwart.checkpoint.storage import LocalStorage
from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.coordinator.coordinator import CheckpointRecord
from stalwart.errors import FencedError


def _write(storage: LocalStorage, step: int, fill: int = 1) -> None:
    data = memoryview(bytearray([fill]) * 64)
    layout = [{"id": 0, "path": ".w", "dtype": "uint8", "shape": [64], "nbytes": 64, "offset": 0}]
    tree = {"t": "dict", "items": [[".w", {"t": "tensor", "id": 0}]]}
    write_rank(
        storage, step=step, rank=0, world_size=1, tree=tree, layout=layout, data=data, known={}
    )


def _pending(storage: LocalStorage, step: int) -> list[str]:
    return [n for n in storage.listdir(step_dir(step)) if n.startswith(PENDING_PREFIX)]


class _LostReply:
    """A coordinator whose compare-and-swap reply is lost in transit: the transaction
    is applied (``applied``) or not, and the caller gets a connection error either way."""

    def __init__(self, coord: Coordinator, applied: bool) -> None:
        self.coord, self.applied = coord, applied

    def generation(self) -> int:
        return self.coord.generation()

    def record_shard_commit(self, generation: int, step: int, shard: str) -> CheckpointRecord:
        if self.applied:
            self.coord.record_shard_commit(generation, step, shard)
        raise ConnectionError("the store did not answer in time")

    def shard_commits(self) -> dict[str, CheckpointRecord]:
        return self.coord.shard_commits()

    def commit_checkpoint(
        self, generation: int, step: int, meta: dict[str, object] | None = None, by: str = ""
    ) -> CheckpointRecord:
        return self.coord.commit_checkpoint(generation, step, meta, by)


@pytest.fixture
def coord() -> Coordinator:
    return Coordinator(MemoryStore(), CoordinatorConfig(job_id="job"))


def test_alone_it_commits_and_applies_retention(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path), direct_io=False)
    committer = StepCommitter(storage, retention=RetentionPolicy(keep_last=2))
    for step in (1, 2, 3):
        _write(storage, step, step)
        done = committer.commit(step)
    assert done.manifest.step == 3 and done.gc is not None and done.gc.deleted_steps == [1]
    assert committed_steps(storage) == [2, 3]


def test_fenced_commit_records_the_shard_then_the_job(tmp_path: Path, coord: Coordinator) -> None:
    storage = LocalStorage(str(tmp_path), direct_io=False)
    _write(storage, 4)
    fenced = FencedCommit(coord, shard="rank0", job_record=True)
    StepCommitter(storage, fenced=fenced).commit(4, generation=0)
    assert committed_steps(storage) == [4]
    assert coord.shard_commits()["rank0"].step == 4
    latest = coord.latest_checkpoint()
    assert latest is not None and (latest.step, latest.by) == (4, "rank0")


def test_a_stale_member_publishes_nothing(tmp_path: Path, coord: Coordinator) -> None:
    storage = LocalStorage(str(tmp_path), direct_io=False)
    _write(storage, 4)
    assert coord.advance_generation(0, "a member failed").won
    committer = StepCommitter(storage, fenced=FencedCommit(coord, shard="rank0"))
    with pytest.raises(FencedError, match="rejoin"):
        committer.commit(4, generation=0)
    assert committed_steps(storage) == [] and not _pending(storage, 4)


def test_a_lost_reply_is_decided_by_the_record_read_back(
    tmp_path: Path, coord: Coordinator
) -> None:
    """The compare-and-swap was applied but its reply was lost: the coordinator accepted
    the commit, so the step is published (else the disk and the record disagreed)."""
    storage = LocalStorage(str(tmp_path), direct_io=False)
    _write(storage, 6)
    fenced = FencedCommit(_LostReply(coord, applied=True), shard="rank0")
    StepCommitter(storage, fenced=fenced).commit(6, generation=0)
    assert committed_steps(storage) == [6] and not _pending(storage, 6)


def test_a_lost_request_leaves_the_step_invisible(tmp_path: Path, coord: Coordinator) -> None:
    storage = LocalStorage(str(tmp_path), direct_io=False)
    _write(storage, 6)
    fenced = FencedCommit(_LostReply(coord, applied=False), shard="rank0")
    with pytest.raises(ConnectionError):
        StepCommitter(storage, fenced=fenced).commit(6, generation=0)
    assert committed_steps(storage) == [] and not _pending(storage, 6)
    assert "rank0" not in coord.shard_commits()


def test_common_step_is_the_oldest_rank_newest_commit(coord: Coordinator, tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path), direct_io=False)

    def common(peers: tuple[str, ...]) -> set[int]:
        fenced = FencedCommit(coord, shard="rank0", peers=peers)
        return StepCommitter(storage, fenced=fenced).common_step()

    both = ("rank0", "rank1")
    assert common(both) == set()  # nobody committed yet
    coord.record_shard_commit(0, 10, "rank0")
    assert common(both) == set()  # rank 1 has nothing: keep policy
    coord.record_shard_commit(0, 8, "rank1")
    coord.record_shard_commit(0, 12, "rank0")
    assert common(both) == {8}  # rank 0 keeps 8 for a restore
    assert common(()) == set()  # one directory (replicated): the newest is kept anyway
    assert sorted(coord.shard_commits()) == ["rank0", "rank1"]  # one key per shard


def test_retention_keeps_the_common_step(tmp_path: Path, coord: Coordinator) -> None:
    storage = LocalStorage(str(tmp_path), direct_io=False)
    coord.record_shard_commit(0, 2, "rank1")  # rank 1's newest commit is step 2
    fenced = FencedCommit(coord, shard="rank0", peers=("rank0", "rank1"))
    committer = StepCommitter(storage, retention=RetentionPolicy(keep_last=1), fenced=fenced)
    for step in (1, 2, 3, 4):
        _write(storage, step, step)
        committer.commit(step, generation=0)
    assert committed_steps(storage) == [2, 4]
