"""The rejoin of a fixed-size job (every strategy but elastic): each launched rank is
a member for life, a generation forms when all ``world_size`` ranks arrived.

Every rank publishes the steps its snapshot slots hold, the last step it completed and
what it persisted (runtime/rejoin/_rendezvous.py); all compute the same restore point from the
same data, restore from the fastest tier that holds it (own memory, a buddy's replica,
a same-host peer's slots, disk), then build the group (runtime/comm/_formation.py). If a
member does not make it, the generation is ended and everyone starts over at the next.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stalwart.runtime.comm._coord import fence_compares
from stalwart.runtime.comm._formation import (
    Formation,
    Position,
    end_generation,
    form_group,
    formed,
)
from stalwart.runtime.rejoin._arrivals import RelayedArrivals
from stalwart.runtime.rejoin._loops import RecoveryLoops
from stalwart.runtime.rejoin._rendezvous import (
    Agreement,
    agree,
    leaving,
    members_of,
    no_common_point,
)
from stalwart.runtime.state._memory_tier import (
    committed_disk_steps,
    holds_replica,
    memory_steps,
    peer_name,
    read_slots,
    restore_memory_step,
    taken_from_replica,
)

if TYPE_CHECKING:
    from stalwart.checkpoint import Snapshotter
    from stalwart.contract.env import WorkerEnv
    from stalwart.contract.shm_names import SlotNames
    from stalwart.coordinator import Coordinator, Store
    from stalwart.data import BatchConfig
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm.group import GenerationGroup
    from stalwart.runtime.state._tracking import TrackedState

__all__ = ["FixedRejoin", "memory_source", "restore_agreed"]


class FixedRejoin:
    """:class:`~stalwart.runtime.comm._formation.Rejoin` with the launch's world size."""

    resizes = False

    def __init__(
        self,
        env: WorkerEnv,
        group: GenerationGroup,
        tracked: TrackedState,
        position: Position,
        coord: Coordinator | None,
        store: Store | None,
        events: EventLog | None,
        *,
        use_memory: bool,
    ) -> None:
        self.env, self.group, self.tracked, self.position = env, group, tracked, position
        self.coord, self.store, self.events = coord, store, events
        self.use_memory = use_memory  # restart: every worker is new, nothing in memory
        self.batch: BatchConfig | None = None  # sess.use_batch's policy, re-applied
        self.loops = RecoveryLoops()  # a step failing alike after in-place recoveries
        self._members: tuple[int, ...] = ()  # the formed generation's pids by rank
        # the agent's arrival relay: one transaction and one watch per node, not per worker
        relay = env.arrival_relay
        self._relay = RelayedArrivals(relay, env.local_world_size) if relay else None

    def on_track(self, state: Mapping[str, Any]) -> None:
        pass

    def use_batch(self, config: BatchConfig, position: Position) -> None:
        from stalwart.data import apply_plan, plan_batch

        config.validate(self.env.min_world, self.env.world_size)
        self.batch = config
        apply_plan(self.tracked.state, plan_batch(config, position.world_size), position.rank)

    def join(self, min_generation: int, done: int) -> Formation:
        rank, world = self.position.rank, self.position.world_size
        if self.coord is None or self.store is None:  # alone: nothing to agree on
            self.group.build(0)
            formed(self.group, self.tracked.state, step=0, fresh=True)
            return Formation(0, rank, world, 0, "none")
        while True:
            a = self._agree(self.coord, self.store, min_generation, done)
            restored = self._restore(a, done)
            if leaving(a):  # members that trained exit (a fresh start): form without them
                min_generation = a.generation + 1
                continue
            fresh, state = a.target is None, self.tracked.state
            if not form_group(
                self.group, self.coord, a.generation, state, step=restored, fresh=fresh
            ):
                min_generation = a.generation + 1
                continue
            lost = max(0, a.last_done - restored) if a.generation > 0 else 0
            self._members = members_of(a)
            self.loops.formed(self._members)  # raises: a failure that changed nothing
            return Formation(a.generation, rank, world, restored, a.tier, lost)

    def _agree(self, coord: Coordinator, store: Store, min_generation: int, done: int) -> Agreement:
        tracked, rank = self.tracked, self.position.rank
        snap = tracked.snapshots
        info: dict[str, object] = {
            "steps": memory_steps(snap) if self.use_memory else [],
            "done": done,
            "rank": rank,
            "pid": os.getpid(),  # a member replaced between two failures: another pid
            "host": socket.gethostname(),
            "replicated": tracked.replicated,
        }
        if tracked.copy_key is not None:  # HSDP: the ranks of this key hold our shards
            info["copy"] = tracked.copy_key
        if holds_replica(snap):  # slots a buddy kept for our lost node
            info["replica"] = True
        ckpt = tracked.checkpoints
        if not tracked.replicated:  # own shards on disk: agree on a step all ranks hold
            info["disk"] = committed_disk_steps(ckpt)
        elif tracked.part is not None:  # rank 0's copy and this rank's own part
            info["disk"] = tracked.part.disk_steps(committed_disk_steps(ckpt))
        return agree(
            store,
            coord,
            self.env.job,
            rank,
            self.position.world_size,
            info,
            use_memory=self.use_memory,
            disk_step=tracked.disk_step(),
            min_generation=min_generation,
            timeout_s=self.env.hang_ceiling_s,
            fence=fence_compares(self.env),
            launch=self.env.restart_count,
            relay=self._relay,
        )

    def _restore(self, a: Agreement, done: int) -> int:
        """Load the agreed step; returns it (0: a fresh start)."""
        t_restore = time.perf_counter()
        rank = self.position.rank
        nbytes, tier, preloaded = restore_agreed(self.tracked, a, rank, use_memory=self.use_memory)
        restored = a.target if a.target is not None else 0
        # raises: trained (or preloaded) state, and nowhere to go
        preload = self.tracked.preload
        no_common_point(a, done, rank, preloaded=preload is not None and preload.touched)
        if self.events is not None and a.tier != "none":
            source = peer_rank(a, rank) if tier == "peer" else None
            self.events.emit(
                "restore",
                step=restored,
                tier=tier,
                seconds=time.perf_counter() - t_restore,
                bytes=nbytes,
                **({"preloaded": True} if preloaded else {}),
                **({"source_rank": source} if source is not None else {}),
            )
        return restored

    def adopt(self, formation: Formation) -> None:
        pass

    def settle(self, formation: Formation, seconds: float) -> None:
        """A restored state carries the learning-rate scale of the world it was saved at
        (a checkpoint persisted by another world size): the plan is applied again (it is
        idempotent: it scales by the plan's over the restored one)."""
        from stalwart.data import apply_plan, plan_batch

        if self.batch is not None and formation.tier != "none":
            plan = plan_batch(self.batch, formation.world_size)
            apply_plan(self.tracked.state, plan, formation.rank)

    def failed(self, position: Position, reason: str) -> None:
        assert self.coord is not None
        end_generation(self.coord, self.events, position, reason)
        try:  # who ended it and why: a member for this step's failure, or the agent
            why = str(self.coord.generation_meta().get("reason", ""))
        except Exception:  # unknown: not counted
            why = ""
        # judged when the next generation forms; counted only when a member ended this
        # one for this failure (a lost node, a fenced agent: the job moved on, no loop)
        self.loops.failed(reason, self._members, same_cause=why)

    def before_step(self, done: int) -> None:
        pass

    def after_step(self, step: int) -> bool:
        return False

    def admit(self, step: int, position: Position) -> int:
        return position.generation + 1

    def finished(self, rank: int) -> None:
        pass

    def close(self) -> None:
        pass


def memory_source(
    names: SlotNames, rank: int, agreement: Agreement, own: Snapshotter
) -> Snapshotter:
    """Our own slots if they hold the agreed step, else the lowest-ranked peer on this
    host that does (the peer tier; across hosts, a buddy's replica or disk)."""
    if agreement.target in memory_steps(own):
        return own
    peer = peer_rank(agreement, rank)
    if peer is None:
        raise RuntimeError(f"no snapshot of step {agreement.target} reachable from rank {rank}")
    return read_slots(names, peer)


def peer_rank(agreement: Agreement, rank: int) -> int | None:
    """The lowest-ranked member on this host whose published slots hold the agreed step
    and the same state as ``rank`` (any member of a replicated DDP job; under HSDP, one
    of the same ``copy`` key: the same shards in another replica group)."""
    infos = agreement.everyone()
    mine = next((i for i in infos if int(i.get("rank", -1)) == rank), {})
    holders = [
        (int(i.get("rank", 0)), i)
        for i in infos
        if i.get("copy") == mine.get("copy") and int(i.get("rank", -1)) != rank
    ]
    target = agreement.target
    return None if target is None else peer_name(target, holders)


def restore_agreed(
    tracked: TrackedState, a: Agreement, rank: int, *, use_memory: bool
) -> tuple[int, str, bool]:
    """Load the agreed step ``a.target`` into the tracked state from the fastest source
    that holds it; returns (bytes, tier, preloaded): tier ``memory`` (own slots),
    ``replica`` (own slots taken over from a buddy), ``peer`` (a same-host peer's slots)
    or ``disk`` (a replicated state: rank 0's copy, then the rank's own per-rank part,
    runtime/state/_perrank.py); ``preloaded``: a standby's state already held it
    (runtime/state/_standby.py), nothing was copied."""
    if a.target is None:
        return 0, a.tier, False
    snap = tracked.snapshots
    if a.tier in ("memory", "peer"):
        source = memory_source(tracked.names, rank, a, snap)
        tier = "memory" if source is snap else "peer"
        if source is snap and taken_from_replica(snap):
            tier = "replica"  # a lost node's slots, kept by its buddy
            preload = tracked.preload
            if preload is not None and preload.holds(snap.directory, a.target):
                meta = snap.latest()
                return (int(meta.data_size) if meta is not None else 0), tier, True
        nbytes = restore_memory_step(source, tracked.state, a.target)
        if source is not snap and tracked.part is not None:
            tracked.part.restore(a.target, tier)  # a peer's slots hold the peer's RNG
        return nbytes, tier, False
    if a.tier == "disk":
        if use_memory and a.target in memory_steps(snap):
            # the agreed step is on disk for everyone, and in our own memory too (the
            # snapshot it was persisted from): the same bytes, faster
            return restore_memory_step(snap, tracked.state, a.target), "memory", False
        nbytes = tracked.restore_disk(a.target)
        if tracked.part is not None:  # rank 0's copy: then this rank's own part over it
            tracked.part.restore(a.target, "disk")
        return nbytes, "disk", False
    return 0, a.tier, False
