"""``--strategy elastic`` for a sharded (FSDP2) job: a new world size is a restart.

FSDP2 fixes a module's shards and the optimizer's DTensor moments to the mesh it was
built on, so a survivor process cannot go on at another size (runtime/_fsdp.py
``resize_by_restarts``; its ``sess.mesh`` puts ``el/sharded`` in the job's store). When
that key is set, a member's loss or join starts every worker of the new membership
again, at once, each with its dense rank (launch-rank order) and the new
``WORLD_SIZE``: they restore the newest persisted step resharded onto that world, and
the loader re-partitions the epoch under the batch policy. A member that is started
again (not a permanent fault) keeps the size; ``permanent`` shrinks it; a ``join``
grows it back. One node only (the worker refuses more).
"""

from __future__ import annotations

from stalwart.agent._outcome import end_with_verdict
from stalwart.agent._workers import Worker, WorkerState
from stalwart.agent.policy import RecoveryParts
from stalwart.contract.env import WorkerFields
from stalwart.coordinator.elastic_keys import Keys

__all__ = ["ShardedResize"]


class ShardedResize:
    """Owns the resized world: which launch ranks are members and their dense ranks."""

    def __init__(self, parts: RecoveryParts, keys: Keys) -> None:
        self._p = parts
        self._keys = keys
        self._seen = False
        self._ranks: dict[int, int] | None = None  # launch rank -> rank (None: launch's)

    def active(self) -> bool:
        """The job's workers built a ``sess.mesh`` under elastic (read once it is set)."""
        if not self._seen:
            self._seen = self._p.coord.store.get(self._keys.sharded) is not None
        return self._seen

    def fields(self, worker: Worker) -> WorkerFields:
        """The rank and world size of ``worker``'s next process (none: the launch's)."""
        if self._ranks is None or worker.rank not in self._ranks:
            return {}
        return {"rank": self._ranks[worker.rank], "world_size": len(self._ranks)}

    def members(self) -> list[Worker]:
        """The workers that are in the job (not left for good)."""
        return [w for w in self._p.workers if w.state is not WorkerState.GONE]

    def restart(self, members: list[Worker], what: str) -> None:
        """Every worker of ``members`` starts again at ``len(members)`` ranks (the caller
        wrote ``recovery_begin``); a ``resize`` event when the size changes."""
        p = self._p
        size = len(members)
        if size < p.cfg.min_world:
            line = (
                f"{what}: the FSDP2 job would have {size} members, fewer than its minimum "
                f"{p.cfg.min_world}; lower MIN in --nproc-per-node MIN:MAX, or resume from "
                "the last checkpoint with more workers"
            )
            p.coord.store.put(self._keys.failed, line.encode())
            end_with_verdict(p.launch, line)
        before = len(self._ranks) if self._ranks is not None else p.cfg.world_size
        self._ranks = {w.rank: i for i, w in enumerate(sorted(members, key=lambda w: w.rank))}
        p.launch.publish("last-done", {"step": p.workers.last_step() or 0})
        gen = p.generation.restart(what, world_size=size)
        if size != before:
            why = "grow" if size > before else "shrink"
            p.events.emit(
                "resize", world_size=size, from_world_size=before, reason=why, generation=gen
            )
        p.workers.stop_all("resize")
        p.generation.restarted()
        if size == before:
            how = f"at the same size ({size}): a sharded job cannot re-form in place"
        else:
            how = f"at {size} (was {before}), the newest persisted step resharded"
        p.say(f"{what}: restarting the FSDP2 job's workers {how}")
        for w in sorted(members, key=lambda w: w.rank):
            p.spawn(w)
