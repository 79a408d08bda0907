"""Read a chosen step back from this rank's shared-memory snapshot slots.

``Snapshotter.restore`` loads the newest slot only; rolling back to "the last step every
member completed" needs the slot of a given step, which may be the older of the two.
This reads the slot files (``stalwart.checkpoint._shm``) the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stalwart.checkpoint._shm import SlotFiles, SlotMeta
from stalwart.checkpoint.snapshot import Snapshotter, readonly_tensor
from stalwart.errors import CheckpointNotFoundError

__all__ = ["memory_steps", "restore_memory_step"]


def _metas(snap: Snapshotter) -> list[tuple[int, SlotMeta]]:
    out = []
    for i in range(snap.config.slots):
        meta = SlotFiles(snap.directory, i).read_meta()
        if meta is not None:
            out.append((i, meta))
    return out


def memory_steps(snap: Snapshotter) -> list[int]:
    """Steps held by complete slots (waits for a background copy first)."""
    snap.wait()
    return sorted({m.step for _, m in _metas(snap)})


def restore_memory_step(snap: Snapshotter, state: Mapping[str, Any], step: int) -> int:
    """Load the newest complete slot of ``step`` into ``state``; returns its bytes."""
    from stalwart.checkpoint._load import SavedTensor, load_into

    snap.wait()
    found = [(i, m) for i, m in _metas(snap) if m.step == step]
    if not found:
        raise CheckpointNotFoundError(f"no snapshot of step {step} in {snap.directory}")
    index, meta = max(found, key=lambda im: im[1].seq)
    buf = readonly_tensor(SlotFiles(snap.directory, index).map_readonly())
    offsets = {e["id"]: int(e["offset"]) for e in meta.layout}

    def fill(entry: SavedTensor, dst: torch.Tensor) -> None:
        off = offsets[entry.id]
        dst.view(-1).view(torch.uint8).copy_(buf[off : off + entry.nbytes])

    saved = [
        SavedTensor(e["id"], e["path"], e["dtype"], e["shape"], e["nbytes"], e["shard"])
        for e in meta.layout
    ]
    load_into(state, meta.tree, saved, fill)
    return int(meta.data_size)
