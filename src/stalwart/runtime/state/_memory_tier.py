"""The memory tier: the steps this rank's (or a peer's) snapshot slots hold, and restoring
one of them (the slot of a given step may be the older of the two)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.slots import read_replica_marker, slot_count
from stalwart.checkpoint.snapshot import SnapshotConfig, Snapshotter
from stalwart.contract.shm_names import SlotNames

if TYPE_CHECKING:
    from stalwart.checkpoint import CheckpointManager

__all__ = [
    "committed_disk_steps",
    "holds_replica",
    "memory_steps",
    "peer_name",
    "peer_slots",
    "read_slots",
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


def committed_disk_steps(ckpt: CheckpointManager, keep: int = 8) -> list[int]:
    """The newest persisted steps of this rank's own checkpoint (its shards): on local
    disk, or in the bucket tier a restore reads directly (``--ckpt-tier``)."""
    return [int(s) for s in ckpt.steps()[-keep:]]


def memory_steps(snap: Snapshotter) -> list[int]:
    """Steps held by complete slots (waits for a background copy first)."""
    return snap.steps()


def restore_memory_step(snap: Snapshotter, state: Mapping[str, Any], step: int) -> int:
    """Load the newest complete slot of ``step`` into ``state``; returns its bytes."""
    snap.restore(state, step=step)
    meta = snap.latest()  # every slot of a run has the same layout, hence the same size
    return int(meta.data_size) if meta is not None else 0


def peer_name(target: int, holders: Iterable[tuple[int, Mapping[str, Any]]]) -> int | None:
    """The first member among ``holders`` ((name, published info), lowest name first)
    on this host whose published steps hold ``target``: whose slots the peer tier of
    fixed and elastic recoveries alike reads (across hosts: a buddy's replica, or disk)."""
    import socket

    host = socket.gethostname()
    for name, info in sorted(holders, key=lambda h: h[0]):
        if target in info.get("steps", []) and info.get("host") == host:
            return name
    return None


def peer_slots(
    names: SlotNames, target: int, holders: Iterable[tuple[int, Mapping[str, Any]]]
) -> Snapshotter | None:
    """The slots of :func:`peer_name`'s member, if any (as many as it keeps)."""
    name = peer_name(target, holders)
    return None if name is None else read_slots(names, name)


def read_slots(names: SlotNames, rank: int) -> Snapshotter:
    """Another process's slots (``rank``'s, on this host), opened to read them: with as
    many slots as its directory holds, not a count assumed here. A DDP job with replica
    digest checks keeps three (the verified snapshot stays pinned, runtime/integrity/_checks.py);
    a reader of two missed a step held in the third, and a node loss's adopted ranks
    then found "no complete snapshot of step N" in a survivor's slots."""
    try:
        count = slot_count(names.rank_dir(rank))
    except FileNotFoundError:
        count = 0
    return Snapshotter(SnapshotConfig(names.rank(rank), slots=max(2, count), shm_dir=names.shm_dir))
