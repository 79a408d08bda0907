"""The memory tier: the steps this rank's (or a peer's) snapshot slots hold, and restoring
one of them (the slot of a given step may be the older of the two)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stalwart.checkpoint.slots import SlotNames, read_replica_marker
from stalwart.checkpoint.snapshot import Snapshotter

__all__ = [
    "committed_disk_steps",
    "holds_replica",
    "memory_source",
    "memory_steps",
    "restore_agreed",
    "restore_memory_step",
    "taken_from_replica",
]


def holds_replica(snap: Snapshotter) -> bool:
    """Whether these slots were taken over from a buddy's replica (not restored yet)."""
    return read_replica_marker(snap.directory, consume=False)


def taken_from_replica(snap: Snapshotter) -> bool:
    """True once for slots an agent took over from a buddy's replica (the restore
    reports the ``replica`` tier); the marker is consumed."""
    return read_replica_marker(snap.directory, consume=True)


def committed_disk_steps(storage: Any, keep: int = 8) -> list[int]:
    """The newest persisted steps of this rank's own storage (its shards)."""
    from stalwart.checkpoint import committed_steps

    return [int(s) for s in committed_steps(storage)[-keep:]]


def memory_steps(snap: Snapshotter) -> list[int]:
    """Steps held by complete slots (waits for a background copy first)."""
    return snap.steps()


def restore_memory_step(snap: Snapshotter, state: Mapping[str, Any], step: int) -> int:
    """Load the newest complete slot of ``step`` into ``state``; returns its bytes."""
    snap.restore(state, step=step)
    meta = snap.latest()  # every slot of a run has the same layout, hence the same size
    return int(meta.data_size) if meta is not None else 0


def memory_source(names: SlotNames, rank: int, agreement: Any, own: Snapshotter) -> Snapshotter:
    """Our own slots if they hold the agreed step, else the lowest-ranked peer on this
    host that does (the peer tier; across hosts, a buddy's replica or disk)."""
    import socket

    from stalwart.checkpoint import SnapshotConfig

    target = agreement.target
    if target in memory_steps(own):
        return own
    host = socket.gethostname()
    for info in sorted(agreement.infos, key=lambda i: int(i.get("rank", 0))):
        if target in info.get("steps", []) and info.get("host") == host:
            return Snapshotter(SnapshotConfig(names.rank(int(info["rank"]))))
    raise RuntimeError(f"no snapshot of step {target} reachable from rank {rank}")


def restore_agreed(sess: Any, a: Any, *, use_memory: bool) -> tuple[int, str, bool]:
    """Load the agreed step ``a.target`` into the session's state from the fastest source
    that holds it; returns (bytes, tier, preloaded): tier ``memory`` (own slots),
    ``replica`` (own slots taken over from a buddy), ``peer`` (a same-host peer's slots)
    or ``disk`` (a replicated state: rank 0's copy, then the rank's own per-rank part,
    runtime/_perrank.py); ``preloaded``: a standby's state already held it (runtime/_standby.py),
    nothing was copied."""
    snap = sess._ckpt.snapshots
    if a.target is None:
        return 0, a.tier, False
    if a.tier in ("memory", "peer"):
        source = memory_source(SlotNames(sess.env.job, sess.env.shm_run), sess.rank, a, snap)
        tier = "memory" if source is snap else "peer"
        if source is snap and taken_from_replica(snap):
            tier = "replica"  # a lost node's slots, kept by its buddy
            preload = getattr(sess, "_preload", None)
            if preload is not None and preload.holds(snap.directory, a.target):
                meta = snap.latest()
                return (int(meta.data_size) if meta is not None else 0), tier, True
        nbytes = restore_memory_step(source, sess._state, a.target)
        if source is not snap and sess._part is not None:
            sess._part.restore(a.target, tier)  # a peer's slots hold the peer's RNG
        return nbytes, tier, False
    if a.tier == "disk":
        if use_memory and a.target in memory_steps(snap):
            # the agreed step is on disk for everyone, and in our own memory too (the
            # snapshot it was persisted from): the same bytes, faster
            return restore_memory_step(snap, sess._state, a.target), "memory", False
        nbytes = sess._ckpt.restore(sess._state, step=a.target).bytes_read
        if sess._part is not None:  # rank 0's copy: then this rank's own part over it
            sess._part.restore(a.target, "disk")
        return nbytes, "disk", False
    return 0, a.tier, False
