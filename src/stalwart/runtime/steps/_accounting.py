"""Step timing, snapshot cadence, persist cadence and the `steps` events of a session.

Snapshot cadence: the job's one record, chosen by rank 0 from the stalls and step times
measured here and applied from the same step by every member (runtime/steps/_cadence.py: a
rollback target must be a step every member holds). No training step blocks on the
store for it.

Persist: the engine writes and commits the step as a ``CommitPlan`` made here says
(checkpoint/commit.py) and says what became of it; this logs it and hands a refusal to
the session (runtime/comm/_fenced.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.interval import daly_interval
from stalwart.contract.shm_names import SlotNames
from stalwart.errors import SnapshotWontFitError, StalwartError
from stalwart.logs import get_logger
from stalwart.metrics.journal import EMPTY, OPEN, WRITING, StepJournal
from stalwart.runtime.comm._coord import CommitKeys
from stalwart.runtime.steps._align import StepAlignment
from stalwart.runtime.steps._cadence import CALIBRATE, AutoPersist, SnapshotCadence, choose_every
from stalwart.runtime.steps._metric_log import MetricLog

if TYPE_CHECKING:
    from stalwart.chaos import Fault
    from stalwart.checkpoint import CommitPlan, PersistResult, ShardedCommit, SnapshotResult
    from stalwart.contract.env import WorkerEnv
    from stalwart.coordinator import Coordinator, Store
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm._formation import Position
    from stalwart.runtime.state._tracking import TrackedState

__all__ = ["StepAccounting"]

_log = get_logger(__name__)
_FLUSH_S = 1.0
_WARMUP = 2  # steps after a (re)start left out of the p99 (NVRx skips 5 warm-up iterations)


class StepAccounting:
    def __init__(
        self,
        env: WorkerEnv,
        position: Position,
        tracked: TrackedState,
        events: EventLog | None,
        coord: Coordinator | None,
        store: Store | None,
    ) -> None:
        self.env, self.position, self.tracked = env, position, tracked
        self.events, self.coord, self.store = events, coord, store
        # a commit refused as fenced: the session says so and leaves (runtime/comm/_fenced.py)
        self.on_refused: Callable[[BaseException, int, int], None] = lambda e, s, g: None
        self.durations: deque[float] = deque(maxlen=100)
        # what the hang threshold is made of: the first steps after a (re)start are left
        # out (DDP's first iteration, a rebuilt group), a replacement starts from its
        # rank's p99 in the job (the agent hands it on), not from nothing
        self._recent: deque[float] = deque(maxlen=100)
        self._since_start = 0
        inherited = float(getattr(env, "step_p99_s", 0.0) or 0.0)
        if inherited > 0:
            self._recent.append(inherited)
        self.stalls: list[float] = []
        fixed = int(getattr(env, "snapshot_every", 0) or 0)
        alone = store is None or coord is None
        self.cadence = SnapshotCadence(env.job, position, None if alone else store, fixed)
        self._cadence_noted = fixed > 0  # a fixed --snapshot-every needs no note
        self._batch: dict[str, Any] | None = None
        self._last_flush = time.monotonic()
        self._slow: list[tuple[Fault, float]] = []
        # the persist in flight: resolved once committed and logged (or why it failed)
        self._persist: Future[str | None] | None = None
        self._t_start = time.monotonic()
        self._last_persist = time.monotonic()
        self._persist_s = 1.0  # the last persist's duration (a guess before the first)
        self.metrics = MetricLog(events)  # sess.log values (rank 0)
        self._journal: StepJournal | None = None  # the open batch, safe from our death
        self._auto: AutoPersist | None = None  # sharded + auto: the steps rank 0 chose
        self._sharded: ShardedCommit | None = None  # sharded: who commits a step
        self._refused = False  # the last snapshot did not fit in /dev/shm
        # snapshots (rollback targets) only at a gradient accumulation cycle's end
        self.alignment = StepAlignment()

    # ------------------------------------------------------------ timing
    def p99(self) -> float:
        if not self._recent:
            return 0.0
        ordered = sorted(self._recent)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def slow(self, fault: Fault) -> None:
        self._slow.append((fault, time.monotonic()))

    def step_done(self, step: int, t0: float) -> None:
        dur = time.perf_counter() - t0
        now = time.monotonic()
        factor = 1.0
        for fault, fired in list(self._slow):
            if fault.slows(step, now - fired):
                factor = max(factor, fault.factor)
            else:
                self._slow.remove((fault, fired))
        if factor > 1.0:
            time.sleep(dur * (factor - 1.0))
            dur *= factor
        self.durations.append(dur)
        self._since_start += 1
        if self._since_start > _WARMUP:
            self._recent.append(dur)
        if self.position.rank != 0 or self.events is None:
            return
        self.metrics.step_done(step, self.position.generation)
        b = self._batch
        if b is None:
            self._batch = {
                "first_step": step,
                "last_step": step,
                "count": 1,
                "busy_s": dur,
                "t_first_start": time.time() - dur,
                "generation": self.position.generation,
            }
        else:
            b["last_step"], b["count"], b["busy_s"] = step, b["count"] + 1, b["busy_s"] + dur
        journal = self._open_journal()
        if journal is not None:
            journal.write(OPEN, self._batch, t_end=time.time())
        if now - self._last_flush > _FLUSH_S:
            self.flush()

    def _open_journal(self) -> StepJournal | None:
        """Under `stalwart run` only: the agent writes the batch if this process dies."""
        if self._journal is None and self.env.managed and self.env.progress:
            path = SlotNames(self.env.job, self.env.shm_run).step_journal(os.getpid())
            with contextlib.suppress(OSError):
                self._journal = StepJournal(path)
        return self._journal

    def flush(self) -> None:
        self.metrics.flush()
        self._last_flush = time.monotonic()
        batch, self._batch = self._batch, None
        if batch is None or self.events is None:
            return
        if self._journal is not None:
            self._journal.write(WRITING, batch)
        self.events.emit("steps", **batch)
        if self._journal is not None:
            self._journal.write(EMPTY, None)
        if self.coord is not None:
            # fenced: a member of an old generation cannot record progress
            with contextlib.suppress(StalwartError):
                self.coord.commit_step(batch["generation"], batch["last_step"], "rank0")

    def recovered(self, seconds: float) -> None:
        self._batch = None
        if self._journal is not None:
            self._journal.write(EMPTY, None)
        self.metrics.recovered()
        self._since_start = 0
        self.alignment.forgive()  # owed by undone steps: a replacement owes nothing

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.settle()  # a loop left early: its last snapshot is still logged
        with contextlib.suppress(Exception):
            self.flush()  # and its last steps recorded
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    # ------------------------------------------------------------ snapshots
    def _choose(self) -> int:
        return choose_every(self.stalls, list(self.durations), self.env.snapshot_budget)

    def _snapshot_due(self, step: int) -> bool:
        """The job's cadence (runtime/steps/_cadence.py); rank 0 notes it once it is known."""
        due = self.cadence.due(step, self._choose)
        every = self.cadence.every
        if every is not None and not self._cadence_noted:
            self._cadence_noted = True
            if self.position.rank == 0 and self.events is not None:
                self.events.emit(
                    "note",
                    message=f"snapshot cadence: every {every} steps from step {self.cadence.start}",
                )
        return due

    def _persist_due(self, step: int, final: bool = False) -> bool:
        every = self.env.persist_every
        # replicated (DDP) state has one copy to persist, rank 0's, and every rank its
        # per-rank part at the same steps (runtime/state/_perrank.py); own shards: each rank
        part = self.tracked.part
        if every == 0 or (
            self._writer()[0] != 0 and self.tracked.replicated and (part is None or every < 0)
        ):
            return False
        if final:  # the trained state: on disk even when total is not a multiple of N
            return True
        if every > 0:
            return step % every == 0
        if self.tracked.sharded and self.position.world_size > 1:
            # sharded: every rank at the same steps (a step is committed once all wrote it)
            if self._auto is None:
                self._auto = AutoPersist(self.store, self.env.job, self.position.rank)
            return step >= CALIBRATE and self._auto.due(
                step, self.auto_interval(), list(self.durations)
            )
        return time.monotonic() - self._last_persist >= self.auto_interval()

    def auto_interval(self) -> float:
        """Daly's optimum interval from the last persist's duration and the MTBF seen so
        far (failures = generations; a 1 h prior before the first)."""
        elapsed = time.monotonic() - self._t_start
        failures = self.position.generation
        mtbf = elapsed / failures if failures else max(3600.0, elapsed)
        return daly_interval(max(self._persist_s, 1e-3), max(mtbf, 1e-3))

    def maybe_snapshot(self, step: int, *, final: bool = False, force: bool = False) -> None:
        """After step ``step`` (``final``: the loop's last step; ``force``: an integrity
        check step, whose snapshot the replicas compare). With a ``unit`` > 1 a snapshot
        or persist due at a step inside a unit is owed to the unit's last step: every
        member owes the same ones (the cadence is the job's), so all snapshot alike."""
        persist = self._persist_due(step, final)
        due = self._snapshot_due(step) or force  # always asked: rank 0 publishes
        persist, due = self.alignment.settle(step, final, persist, due)
        if (persist or due) and not self.snapshot_now(step):
            return  # refused (no room in /dev/shm): nothing new to persist either
        if persist:
            self._start_persist(step, wait=final)

    def snapshot_now(self, step: int) -> bool:
        """Snapshot after ``step``; False when /dev/shm cannot hold it (refused before
        it started, the older snapshots intact: training goes on, and says so once)."""
        tracked = self.tracked
        try:
            tracked.checkpoints.snapshot(
                tracked.state, step, blocking=False, on_done=self._snapshot_done
            )
        except SnapshotWontFitError as err:
            if not self._refused and self.events is not None:
                domain = {"rank": self.position.rank, "node": None, "device": None}
                self.events.emit("probe", probe="shm", ok=False, detail=str(err), domain=domain)
            self._refused = True
            return False
        if self._refused and self.events is not None:
            domain = {"rank": self.position.rank, "node": None, "device": None}
            detail = f"snapshot of step {step} fits in /dev/shm again"
            self.events.emit("probe", probe="shm", ok=True, detail=detail, domain=domain)
        self._refused = False
        return True

    def _snapshot_done(self, snap: SnapshotResult) -> None:
        """A snapshot is complete (its background copy waited for: its stall is final):
        its event is logged now, not at the next snapshot, so the last one is too."""
        self.stalls.append(snap.blocking_s)
        if self.position.rank == 0 and self.events is not None:
            self.events.emit(
                "snapshot",
                step=snap.step,
                stall_s=snap.blocking_s,
                bytes=snap.nbytes,
                tier="memory",
            )

    def settle(self) -> None:
        """Wait for the snapshot in flight (its event is logged then): at the end of the
        loop, where no optimizer step will wait for it."""
        if self.tracked.opened:
            self.tracked.checkpoints.snapshots.wait()

    # ------------------------------------------------------------ persist
    def _start_persist(self, step: int, *, wait: bool = False) -> None:
        tracked = self.tracked
        if tracked.part is not None and self.env.persist_every > 0:
            tracked.part.persist(step)  # small, never skipped: queued before rank 0's copy
        if self._writer()[0] != 0 and tracked.replicated:
            return
        if self._persist is not None and not self._persist.done():
            if not wait:
                return  # one at a time; the next cadence point will catch up
            self._persist.exception()  # the final step's persist must not be skipped
        sharded = tracked.sharded and self.position.world_size > 1
        if self.events is not None and (self.position.rank == 0 or not sharded):
            self.events.emit("persist_begin", step=step)  # sharded: once for the job
        self._last_persist = time.monotonic()
        t0 = time.perf_counter()
        generation = self.position.generation
        # under a coordinator the engine commits it by the plan, fenced: a member of an
        # old generation cannot make it visible (alone: the persister commits it). HSDP:
        # a replica at replicate coordinate > 0 writes references to its coordinate-0
        # peer's shards, not the same bytes again (runtime/comm/_mesh.py)
        key = tracked.copy_key
        copy_of = key if sharded and key is not None and key != self.position.rank else None
        plan = None if self.coord is None else self._commit_plan(generation)
        fut = tracked.checkpoints.persist(commit=True if plan is None else plan, copy_of=copy_of)
        # waited for: committed and logged, not ``fut`` (its waiters wake before its
        # callbacks: the session exited while the reader thread logged the last step)
        settled: Future[str | None] = Future()
        self._persist = settled

        def done(f: Future[PersistResult]) -> None:
            failed: str | None = f"the persist of step {step} did not complete"
            try:
                failed = self._persist_done(f, step, generation, t0)
            finally:
                settled.set_result(failed)

        fut.add_done_callback(done)

    def _persist_done(
        self, f: Future[PersistResult], step: int, generation: int, t0: float
    ) -> str | None:
        """This rank's persist is done (written; committed or why not): log it, a
        failure's line returned. A sharded step is logged by the rank that committed it."""
        err = f.exception()
        outcome = f.result().commit if err is None else None
        if outcome is not None and outcome.error is not None:
            err = outcome.error  # FencedError, store or storage errors: reported, not raised
            self.on_refused(err, step, generation)
        events = self.events
        if err is not None:
            line = str(err).splitlines()[0] if str(err) else type(err).__name__
            if events is not None:
                events.emit("persist_end", step=step, ok=False, seconds=0.0, error=line)
            return f"the persist of step {step} did not commit ({line})"
        r = f.result()
        self._persist_s = time.perf_counter() - t0
        sharded = self.tracked.sharded and self.position.world_size > 1
        committed = outcome.result if outcome is not None else None
        if events is None or (sharded and committed is None):
            return None  # another rank commits this step and logs it
        m = committed.manifest if committed is not None and sharded else None
        events.emit(
            "persist_end",
            step=r.step,
            ok=True,
            seconds=time.perf_counter() - t0,
            bytes_written=r.written_bytes if m is None else m.new_bytes,
            total_bytes=r.total_bytes if m is None else m.total_bytes,
        )
        return None

    def _commit_plan(self, generation: int) -> CommitPlan:
        """How the engine commits this rank's persist (checkpoint/commit.py), fenced by
        the coordinator's record. A sharded step: once, by the last rank to write it,
        as the job's one root. Else this rank's directory, keeping the newest step every
        rank's directory holds; rank 0 then records the job's checkpoint."""
        from stalwart.checkpoint import CommitPlan, FencedCommit

        coord, rank, world = self.coord, self.position.rank, self.position.world_size
        assert coord is not None
        if self.tracked.sharded and world > 1:
            return CommitPlan.sharded_step(coord, self._claim(rank, world), generation)
        _, world, shard = self._writer()  # async: the replica group's directory
        own = not self.tracked.replicated and world > 1
        fenced = FencedCommit(
            coord,
            shard=shard,
            peers=tuple(f"rank{r}" for r in range(world)) if own else (),
            job_record=self.position.rank == 0,  # the job's record (each committed its own)
        )
        return CommitPlan(fenced, generation)

    def _claim(self, rank: int, world: int) -> ShardedCommit:
        """The job's record of who wrote a sharded step (in the job's store)."""
        from stalwart.checkpoint import ShardedCommit

        if self._sharded is None:
            assert self.store is not None
            keys, launch = CommitKeys(self.store), self.env.restart_count
            self._sharded = ShardedCommit(keys, self.env.job, launch, rank, world)
        return self._sharded

    def _writer(self) -> tuple[int, int, str]:
        """(rank, world size, shard name) among the writers of this rank's checkpoint:
        the session's, or under --strategy async its replica group's (each group its
        own directory, runtime/state/_tracking.py)."""
        group = self.env.replica_group
        if group is None:
            return self.position.rank, self.position.world_size, f"rank{self.position.rank}"
        return group[1], group[2], f"group{group[0]}.rank{group[1]}"

    def wait_persist(self) -> None:
        """The loop's end: the last snapshot complete (and logged), its persist committed
        and logged (DESIGN.md: the final committed checkpoint is the last persist step)."""
        self.settle()
        failed = self._persist.result() if self._persist is not None else None
        if failed is not None:  # the trained state is not on disk: said, never silent
            _log.warning("rank %d: %s; the newest checkpoint is older", self.position.rank, failed)
