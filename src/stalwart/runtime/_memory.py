"""The memory tier: the steps this rank's (or a peer's) snapshot slots hold, and restoring
one of them (the slot of a given step may be the older of the two)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stalwart.checkpoint.snapshot import Snapshotter

__all__ = ["memory_steps", "restore_memory_step"]


def memory_steps(snap: Snapshotter) -> list[int]:
    """Steps held by complete slots (waits for a background copy first)."""
    return snap.steps()


def restore_memory_step(snap: Snapshotter, state: Mapping[str, Any], step: int) -> int:
    """Load the newest complete slot of ``step`` into ``state``; returns its bytes."""
    snap.restore(state, step=step)
    meta = snap.latest()  # every slot of a run has the same layout, hence the same size
    return int(meta.data_size) if meta is not None else 0
