"""A full disk fails the save with a clear error, keeps the previous checkpoint, and
does not disturb training (the persister reports the error; nothing raises in snapshot)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import CheckpointConfig, CheckpointManager, open_storage, verify_step
from stalwart.errors import DiskFullError


def test_enospc_keeps_previous_checkpoint(small_tmpfs: Path, shm_namespace: str) -> None:
    root = small_tmpfs / "ckpt"
    state = {"w": torch.arange(250_000, dtype=torch.float32)}  # 1 MB
    mgr = CheckpointManager(CheckpointConfig(str(root), namespace=shm_namespace))
    try:
        mgr.save(state, 1)
        state["w"].add_(1)
        big = {"w": state["w"], "big": torch.randn(3_000_000)}  # 12 MB: cannot fit
        mgr.snapshot(big, 2)
        with pytest.raises(DiskFullError, match=r"no space left .* free space"):
            mgr.persist().result(timeout=60)
        # training goes on: the next snapshot and a smaller save still work
        state["w"].add_(1)
        mgr.snapshot(state, 3)
        assert mgr.persist().result(timeout=60).committed
    finally:
        mgr.close()
    storage = open_storage(str(root))
    assert verify_step(storage, 1).ok and verify_step(storage, 3).ok
    assert not (root / "step_000000000002" / "MANIFEST.json").exists()
    leftovers = [p.name for p in (root / "data").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
