"""One object per rank that snapshots, persists and restores a tracked state.

Training calls :meth:`CheckpointManager.snapshot` (the only blocking part) and, at its
persist cadence, :meth:`persist`, which hands the newest complete slot to the persister
process and returns at once. The slot stays pinned until the persist is done, so later
snapshots never overwrite bytes that are being written out.

Under a coordinator the persist carries a :class:`~stalwart.checkpoint.commit.CommitPlan`
(the coordinator's fence, this member's shard, the generation, a sharded job's claim):
the persister writes the step uncommitted and, once its reply is in, the manager commits
it through :class:`~stalwart.checkpoint.commit.StepCommitter` (the one commit path the
persister process uses too) before the persist's future resolves, so a fenced member
cannot commit and the result says what was committed, or why not
(``PersistResult.commit``). :meth:`CheckpointManager.commit` commits a step persisted
with ``commit=False`` by hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.catalog import committed_steps
from stalwart.checkpoint.commit import CommitPlan, CommitResult, FencedCommit, StepCommitter
from stalwart.checkpoint.persist import PersistConfig, Persister, PersistResult
from stalwart.checkpoint.restore import RestoreResult, restore_state
from stalwart.checkpoint.retention import RetentionPolicy
from stalwart.checkpoint.snapshot import SnapshotConfig, SnapshotResult, Snapshotter
from stalwart.checkpoint.storage import Storage, open_storage, storage_options
from stalwart.errors import CheckpointError, CheckpointNotFoundError, StorageUnavailableError

if TYPE_CHECKING:
    from stalwart.checkpoint.storage import S3Config

__all__ = ["CheckpointConfig", "CheckpointManager"]


@dataclass(frozen=True)
class CheckpointConfig:
    """``root`` is a str, not a Path, because it may be a remote URL (``s3://...``)."""

    root: str
    namespace: str = "default-r0"
    rank: int = 0
    world_size: int = 1
    slots: int = 2
    shm_dir: str = "/dev/shm"
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    persist: PersistConfig = field(default_factory=PersistConfig)
    replicated: bool = False  # DDP: every rank holds the same state
    s3: S3Config | None = None
    """For an ``s3://`` root: endpoint, part size, parallel parts, retries (``None``: the
    defaults, and boto3's own endpoint settings); the persister process gets the same."""
    tiers: tuple[str, ...] = ()
    """Slower tiers of this checkpoint (``--ckpt-tier``'s bucket prefix that ``root`` is
    copied to): read directly by :meth:`CheckpointManager.restore` for the steps ``root``
    lacks (a fresh node, a lost disk); never written here. ``tier_s3``: their options."""
    tier_s3: S3Config | None = None


class CheckpointManager:
    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.storage: Storage = open_storage(config.root, s3=config.s3)
        self.tiers: list[Storage] = [open_storage(u, s3=config.tier_s3) for u in config.tiers]
        self.snapshots = Snapshotter(SnapshotConfig(config.namespace, config.slots, config.shm_dir))
        self.persister = Persister(config.persist)
        self._inflight: Future[PersistResult] | None = None

    def snapshot(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        blocking: bool = True,
        on_done: Callable[[SnapshotResult], None] | None = None,
    ) -> SnapshotResult:
        """See :meth:`Snapshotter.snapshot` (``on_done``: once it is complete)."""
        return self.snapshots.snapshot(state, step, blocking=blocking, on_done=on_done)

    def persist(
        self,
        *,
        commit: bool | CommitPlan | None = None,
        generation: int = 0,
        copy_of: int | None = None,
    ) -> Future[PersistResult]:
        """Write the newest snapshot in the background. One persist at a time: a second
        call waits for the first (what a slow disk costs shows up here, not in snapshot).
        A snapshot still copying in the background is not waited for: the request is
        handed to the persister once the copy is complete. ``copy_of``: this rank's
        DTensor shards are that rank's (HSDP replicas): written as references only.

        ``commit``: True, the persister commits the step itself (alone, no fence; the
        default for one rank); False, it is left uncommitted (:meth:`commit` later); a
        :class:`CommitPlan`, it is written uncommitted and then committed as the plan
        says before the future resolves, its result's ``commit`` saying what was
        committed or why not (a fenced refusal is an outcome, not the future's error:
        only a failed write is)."""
        if self._inflight is not None:
            self._inflight.exception()
        cfg = self.config
        plan = commit if isinstance(commit, CommitPlan) else None
        alone = cfg.world_size == 1 if commit is None else commit is True
        fut = self._hand_over(
            {
                "storage": self.storage.url,
                "s3": storage_options(self.storage),
                "rank": cfg.rank,
                "world_size": cfg.world_size,
                "commit": alone,
                "generation": generation,
                "replicated": cfg.replicated,
                "keep_last": cfg.retention.keep_last,
                "keep_every": cfg.retention.keep_every,
                "copy_of": copy_of,
            },
            plan,
        )
        self._inflight = fut
        return fut

    def persist_part(
        self,
        storage: Storage,
        names: Sequence[str],
        *,
        keep_last: int,
        keep_every: int | None = None,
    ) -> Future[PersistResult]:
        """Write only the top-level entries ``names`` of the newest snapshot into
        ``storage`` (a one-rank checkpoint of its own), committed and pruned to
        ``keep_last`` steps by the persister; the request queues behind :meth:`persist`'s
        in the same process and never waits for it."""
        request = {"storage": storage.url, "rank": 0, "world_size": 1, "commit": True}
        request["s3"] = storage_options(storage)
        request.update(only=list(names), keep_last=keep_last, keep_every=keep_every)
        return self._hand_over(request)

    def _hand_over(
        self, request: dict[str, Any], plan: CommitPlan | None = None
    ) -> Future[PersistResult]:
        """Submit ``request`` for the newest complete slot, pinned until its persist is
        done, once the snapshot in flight is complete (on its copying thread: see
        :meth:`Snapshotter.after_copy`), and commit it by ``plan`` once written. A
        failure before the request is submitted here and now (no snapshot, no
        persister) is raised, as it always was."""
        self.persister.start()
        out: Future[PersistResult] = Future()
        submitted: list[bool] = []

        def submit(copy_error: BaseException | None) -> None:
            try:
                if copy_error is not None:
                    raise copy_error
                found = self.snapshots.pin_latest(wait=False)
                if found is None:
                    raise CheckpointNotFoundError("nothing to persist: take a snapshot first")
                slot = found[0]
                payload = dict(request, slot_dir=self.snapshots.directory, slot=slot)
                try:
                    inner = self.persister.submit(payload)
                except BaseException:
                    self.snapshots.unpin(slot)
                    raise
            except BaseException as err:
                out.set_exception(err)
                return
            submitted.append(True)
            inner.add_done_callback(lambda f: self._done(slot, f, out, plan))

        self.snapshots.after_copy(submit)
        if out.done() and not submitted:
            raise out.exception() or CheckpointError("the persist was not handed over")
        return out

    def _done(
        self,
        slot: int,
        inner: Future[PersistResult],
        out: Future[PersistResult],
        plan: CommitPlan | None,
    ) -> None:
        """The persister's reply (on its reader thread): the slot is unpinned first, the
        written step committed by ``plan``, then ``out`` resolved."""
        self.snapshots.unpin(slot)
        err = inner.exception()
        if err is not None:
            out.set_exception(err)
            return
        result = inner.result()
        if plan is not None:
            committer = self._committer(plan.fenced)
            result.commit = committer.commit_written(
                result.step, generation=plan.generation, sharded=plan.sharded
            )
        out.set_result(result)

    def commit(
        self,
        step: int,
        *,
        generation: int,
        fenced: FencedCommit | None = None,
        protect: Collection[int] = (),
    ) -> CommitResult:
        """Commit a step persisted with ``commit=False`` (fenced by the coordinator's
        record under ``fenced``: see :class:`StepCommitter`), then apply the retention
        policy. ``protect`` names steps GC must keep (ones another member may still
        restore from); the newest committed step is always kept."""
        return self._committer(fenced).commit(step, generation=generation, protect=protect)

    def _committer(self, fenced: FencedCommit | None) -> StepCommitter:
        return StepCommitter(
            self.storage,
            world_size=self.config.world_size,
            replicated=self.config.replicated,
            retention=self.config.retention,
            fenced=fenced,
        )

    def save(self, state: Mapping[str, Any], step: int) -> PersistResult:
        """Snapshot and persist, and wait for the commit (for scripts and tests)."""
        self.snapshot(state, step)
        return self.persist().result()

    def wait(self) -> PersistResult | None:
        fut, self._inflight = self._inflight, None
        return fut.result() if fut is not None else None

    def restore(self, state: Mapping[str, Any], *, step: int | None = None) -> RestoreResult:
        cfg = self.config
        return restore_state(
            self.storage,
            state,
            rank=cfg.rank,
            world_size=cfg.world_size,
            step=step,
            quarantine_damaged=cfg.world_size == 1,
            slower=self.tiers,
        )

    def steps(self) -> list[int]:
        """The committed steps a restore can read: the root's and its slower tiers' (a
        tier that cannot be listed, the bucket down, adds none)."""
        found = set(committed_steps(self.storage))
        for tier in self.tiers:
            with contextlib.suppress(StorageUnavailableError):
                found |= set(committed_steps(tier))
        return sorted(found)

    def restore_from_memory(self, state: Mapping[str, Any]) -> int:
        """Fastest tier: this rank's newest shared-memory snapshot."""
        return self.snapshots.restore(state)

    def close(self, *, unlink_snapshots: bool = True) -> None:
        try:
            if self._inflight is not None:
                with contextlib.suppress(CheckpointError):
                    self._inflight.result()
        finally:
            self.persister.close()
            self.snapshots.close(unlink=unlink_snapshots)
