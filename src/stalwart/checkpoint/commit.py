"""The one commit path of a persisted step: who commits it, the manifest (fenced), then
retention.

Two places commit a step that every rank has written: the persister process, alone
(no coordinator: ``stalwart.init()`` outside `stalwart run`, scripts, tests), and the
training process under `stalwart run`, whose commit is fenced by the coordinator. Both
go through :class:`StepCommitter`, so the order of writes, the fence and the retention
that follows are the same code in both (docs/checkpoint-format.md, "The fence").

Under a coordinator the trainer hands :meth:`CheckpointManager.persist
<stalwart.checkpoint.manager.CheckpointManager.persist>` a :class:`CommitPlan` (the
coordinator as the fence, this member's shard name, the generation the step was trained
in and, for a sharded job, the job's claim on the step); once this rank's index is
durable the manager carries the plan out here (:meth:`StepCommitter.commit_written`) and
the persist's result says what became of it (:class:`CommitOutcome`: committed, left to
the rank that completes a sharded step, or refused and why). The trainer keeps the
cadence and the events; what is committed, by whom, and whether the fence lets it is
decided here.

Under a coordinator the coordinator's record is the source of truth for whether a step
was committed. Its compare-and-swap (``record_shard_commit``) either succeeds, fails
with :class:`FencedError`, or fails in transit (a store timeout, a dropped connection)
with its outcome unknown: the transaction may have been applied. In that last case the
committer reads the record back and publishes the manifest if and only if the record
holds this step in this generation, so the directory on disk and the coordinator never
disagree about a commit the coordinator accepted. Retention reads the same records: the
newest step every shard of the job committed is kept (a restore needs it on every rank).

**A sharded step** (FSDP2, DTensor state) has no one copy to persist: each rank writes
its shard, at the same step-fixed points, into one checkpoint root in the multi-rank
format (its pack and its index ``step_<S>/rank_<R>.json``), and the step becomes visible
with one manifest that lists every rank's index. Who writes it: the last rank to finish.
Each rank, once its index is durable, records that in the job's store
(:meth:`ShardedCommit.written`, over the few key operations of :class:`CommitStore`);
the rank whose record completes the set, and wins a compare-and-swap on the step's claim
key, commits the step through :class:`StepCommitter`, fenced by the coordinator's
generation record. Nobody waits for anyone: a rank that is not last returns at once, and
a step some rank never wrote (it died, or skipped that persist because its previous one
was still running) is never committed and is collected later as an uncommitted
leftover. A member of an old generation cannot commit: the claim is per generation, and
the commit itself is fenced. Restoring such a checkpoint at another world size reshards
it (:func:`stalwart.checkpoint.restore_state`).

No torch here: the persister process imports this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.checkpoint._writer import publish_step
from stalwart.checkpoint.catalog import load_manifest
from stalwart.checkpoint.format import Manifest, manifest_path
from stalwart.checkpoint.retention import GcReport, RetentionPolicy, collect_garbage
from stalwart.checkpoint.storage import Storage
from stalwart.errors import FencedError

__all__ = [
    "SHARD_NAME",
    "CommitFence",
    "CommitOutcome",
    "CommitPlan",
    "CommitRecord",
    "CommitResult",
    "CommitStore",
    "FencedCommit",
    "ShardedCommit",
    "StepCommitter",
]

SHARD_NAME = "sharded"
"""The name of the job's one sharded checkpoint root in the coordinator's commit records."""


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


class CommitStore(Protocol):
    """What the sharded commit needs of the job's key/value store: four key operations
    (the coordinator's ``Store`` behind them: runtime/comm/_coord.py ``CommitKeys``), so the
    checkpoint engine imports no coordinator."""

    def put(self, key: str, value: bytes) -> None: ...

    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, sorted."""
        ...

    def create(self, key: str, value: bytes) -> bool:
        """Put ``key`` only if it is absent (a compare-and-swap): whether this call did."""
        ...

    def delete_prefixes(self, prefixes: Collection[str]) -> None:
        """Delete every key under each of ``prefixes``, in one transaction."""
        ...


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


@dataclass(frozen=True)
class CommitOutcome:
    """What became of the commit of a step this member persisted under a
    :class:`CommitPlan` (``PersistResult.commit``): one of three."""

    step: int
    result: CommitResult | None = None
    """Committed here: the manifest made visible, and what retention collected."""
    by_peer: bool = False
    """A sharded step whose set another rank completes: that rank commits it (and says
    so); nothing was committed here, and nothing went wrong."""
    error: BaseException | None = None
    """Not committed: :class:`FencedError` when the fence refused it (this member's
    generation is no longer the job's), else the store's or the storage's error. Never
    raised into training: the trainer reports it."""

    @property
    def refused(self) -> bool:
        """Refused by the fence: the job moved to another generation."""
        return isinstance(self.error, FencedError)


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

    def commit_written(
        self, step: int, *, generation: int, sharded: ShardedCommit | None = None
    ) -> CommitOutcome:
        """This member's write of ``step`` is durable: commit it (:meth:`commit`), or
        for a sharded step record the write and commit only if this rank completes the
        set (``sharded``'s claim, then its older records pruned). Never raises: an error
        (the fence's refusal, the store's, the storage's) is the outcome's ``error``."""
        try:
            if sharded is not None and not sharded.written(generation, step):
                return CommitOutcome(step, by_peer=True)  # a later rank commits it
            result = self.commit(step, generation=generation)
            if sharded is not None:
                sharded.prune(generation, step)
        except Exception as err:
            return CommitOutcome(step, error=err)
        return CommitOutcome(step, result=result)

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


class ShardedCommit:
    """The job's record of which ranks have written their index of a sharded step (the
    module's docstring: the last rank to write commits it, once per generation)."""

    def __init__(self, store: CommitStore, job: str, launch: int, rank: int, world_size: int):
        self.store = store
        self.root = f"/stalwart/{job}/sharded/"
        self.launch, self.rank, self.world_size = launch, rank, world_size

    def _step_prefix(self, generation: int, step: int) -> str:
        # the launch too: a relaunched job's workers may reach the same generation number
        return f"{self.root}{self.launch}.{generation:012d}/{step:012d}/"

    def written(self, generation: int, step: int) -> bool:
        """Record that this rank's index of ``step`` is durable; True for exactly one
        member of ``generation``: the one that then commits the step."""
        prefix = self._step_prefix(generation, step)
        self.store.put(prefix + f"rank{self.rank:06d}", b"1")
        keys = self.store.keys(prefix)
        if sum(k[len(prefix) :].startswith("rank") for k in keys) < self.world_size:
            return False  # a later rank commits
        return self.store.create(prefix + "claim", json.dumps({"rank": self.rank}).encode())

    def prune(self, generation: int, step: int) -> None:
        """After ``step`` committed: drop the records of older steps and generations (the
        store does not grow with the run). ``step``'s own records stay, so that a late
        member of the same step can never win its claim a second time."""
        keep = self._step_prefix(generation, step)
        stale = {
            k[: k.rindex("/") + 1]
            for k in self.store.keys(self.root)
            if k[: k.rindex("/") + 1] < keep
        }
        if stale:
            self.store.delete_prefixes(sorted(stale))


@dataclass(frozen=True)
class CommitPlan:
    """How a step this member persists is committed under a coordinator: handed to
    :meth:`CheckpointManager.persist <stalwart.checkpoint.manager.CheckpointManager.persist>`,
    carried out by :meth:`StepCommitter.commit_written` once the write is durable."""

    fenced: FencedCommit
    """The fence (the coordinator) and this member's name in its commit records."""
    generation: int
    """The generation the step was trained in: the fence refuses it once the job left it."""
    sharded: ShardedCommit | None = None
    """A sharded step: committed once, by the rank whose write completes the set."""

    @classmethod
    def sharded_step(cls, fence: CommitFence, claim: ShardedCommit, generation: int) -> CommitPlan:
        """A sharded job's step: the job's one root, recorded as :data:`SHARD_NAME`;
        the rank that commits it records the job's checkpoint too."""
        return cls(FencedCommit(fence, shard=SHARD_NAME, job_record=True), generation, claim)
