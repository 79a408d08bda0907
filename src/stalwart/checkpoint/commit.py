"""The one commit path of a persisted step: the manifest (fenced), then retention.

Two places commit a step that every rank has written: the persister process, alone
(no coordinator: ``stalwart.init()`` outside `stalwart run`, scripts, tests), and the
training process under `stalwart run`, whose commit is fenced by the coordinator. Both
go through :class:`StepCommitter`, so the order of writes, the fence and the retention
that follows are the same code in both (docs/checkpoint-format.md, "The fence").

Under a coordinator the coordinator's record is the source of truth for whether a step
was committed. Its compare-and-swap (``record_shard_commit``) either succeeds, fails
with :class:`FencedError`, or fails in transit (a store timeout, a dropped connection)
with its outcome unknown: the transaction may have been applied. In that last case the
committer reads the record back and publishes the manifest if and only if the record
holds this step in this generation, so the directory on disk and the coordinator never
disagree about a commit the coordinator accepted. Retention reads the same records: the
newest step every shard of the job committed is kept (a restore needs it on every rank).

No torch here: the persister process imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.checkpoint._writer import publish_step
from stalwart.checkpoint.catalog import load_manifest
from stalwart.checkpoint.format import Manifest, manifest_path
from stalwart.checkpoint.retention import GcReport, RetentionPolicy, collect_garbage
from stalwart.checkpoint.storage import Storage
from stalwart.errors import FencedError

__all__ = ["CommitFence", "CommitRecord", "CommitResult", "FencedCommit", "StepCommitter"]


class CommitRecord(Protocol):
    """What the coordinator recorded for a commit (``coordinator.CheckpointRecord``)."""

    @property
    def step(self) -> int: ...

    @property
    def generation(self) -> int: ...


class CommitFence(Protocol):
    """The coordinator's side of a commit (``stalwart.coordinator.Coordinator``)."""

    def generation(self) -> int: ...

    def record_shard_commit(self, generation: int, step: int, shard: str) -> CommitRecord: ...

    def shard_commits(self) -> Mapping[str, CommitRecord]: ...

    def commit_checkpoint(
        self, generation: int, step: int, meta: dict[str, Any] | None = None, by: str = ""
    ) -> CommitRecord: ...


@dataclass(frozen=True)
class FencedCommit:
    """How one member commits under a coordinator."""

    fence: CommitFence
    """The coordinator: its generation check, its compare-and-swap record, read back."""
    shard: str
    """This checkpoint directory's name in the coordinator's records (``rank<R>``)."""
    peers: tuple[str, ...] = ()
    """Every shard directory of the job (per-rank state): the newest step all of them
    committed is kept by retention. Empty for one shared directory (replicated state),
    where the newest commit, always kept, is that step."""
    job_record: bool = False
    """Also record the job's checkpoint (``ckpt_latest``) once the step is visible: one
    member does it (rank 0), after its own directory committed."""


@dataclass(frozen=True)
class CommitResult:
    manifest: Manifest
    gc: GcReport | None  # None: no retention policy (nothing collected)


class StepCommitter:
    """Commits the persisted steps of one checkpoint root."""

    def __init__(
        self,
        storage: Storage,
        *,
        world_size: int = 1,
        replicated: bool = False,
        retention: RetentionPolicy | None = None,
        fenced: FencedCommit | None = None,
    ) -> None:
        self.storage = storage
        self.world_size = world_size
        self.replicated = replicated
        self.retention = retention
        self.fenced = fenced

    def commit(
        self,
        step: int,
        *,
        generation: int = 0,
        protect: Collection[int] = (),
        pause: Callable[[str], None] | None = None,
    ) -> CommitResult:
        """Publish the manifest of ``step`` (every rank's index must be there), fenced
        when a coordinator is given, then apply the retention policy keeping
        ``protect`` and the job's common step. Raises :class:`FencedError` when this
        member's generation is stale: nothing is then visible. ``pause(stage)``: tests
        (see :func:`stalwart.checkpoint.publish_step`).

        A step already committed is left exactly as it is (its manifest returned, no
        record, no retention): a committed step is immutable, and a re-persist of it
        after a restart from an older step wrote nothing (docs/checkpoint-format.md)."""
        if self.storage.exists(manifest_path(step)):
            return CommitResult(load_manifest(self.storage, step), None)
        fenced = self.fenced
        # read before this commit's own record (the common step the job had until now)
        keep = set(protect) | self.common_step() if self.retention is not None else set()
        manifest = publish_step(
            self.storage,
            step,
            self.world_size,
            generation=generation,
            replicated=self.replicated,
            is_current=None if fenced is None else self._is_current,
            record=None if fenced is None else lambda _m: self._record(generation, step),
            pause=pause,
        )
        gc = None
        if self.retention is not None:
            gc = collect_garbage(self.storage, self.retention, protect=keep)
        if fenced is not None and fenced.job_record:
            fenced.fence.commit_checkpoint(generation, step, by=fenced.shard)
        return CommitResult(manifest, gc)

    def common_step(self) -> set[int]:
        """The newest step every shard of the job committed, by the coordinator's
        records (empty alone, for one shared directory, or before every shard did)."""
        fenced = self.fenced
        if fenced is None or len(fenced.peers) <= 1:
            return set()
        records = fenced.fence.shard_commits()
        steps = [records[p].step for p in fenced.peers if p in records]
        return {min(steps)} if len(steps) == len(fenced.peers) else set()

    def _is_current(self, generation: int) -> bool:
        assert self.fenced is not None
        return self.fenced.fence.generation() == generation

    def _record(self, generation: int, step: int) -> None:
        """The fence: the coordinator's compare-and-swap; an unknown outcome is decided
        by reading the record back (raises when the step is not recorded)."""
        assert self.fenced is not None
        fence, shard = self.fenced.fence, self.fenced.shard
        try:
            fence.record_shard_commit(generation, step, shard)
        except FencedError:
            raise
        except Exception:
            if not self._recorded(generation, step):
                raise  # not accepted (or unknown and unreadable): the step stays invisible

    def _recorded(self, generation: int, step: int) -> bool:
        assert self.fenced is not None
        try:
            record = self.fenced.fence.shard_commits().get(self.fenced.shard)
        except Exception:
            return False
        return record is not None and (record.step, record.generation) == (step, generation)
