"""Persisting a part of a snapshot (a replicated job's per-rank state): only the named
entries and their tensors are written, and they load back on their own."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from stalwart.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    RNGState,
    committed_steps,
    open_storage,
    restore_state,
)
from stalwart.checkpoint._select import select
from stalwart.errors import CheckpointFormatError

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


def test_select_keeps_the_named_entries_and_their_tensors() -> None:
    tree = {
        "t": "dict",
        "items": [
            ["model", {"t": "dict", "items": [["w", {"t": "tensor", "id": 0}]]}],
            ["_rng", {"t": "dict", "items": [["torch", {"t": "tensor", "id": 1}]]}],
            ["meta", {"t": "dict", "items": [["a", {"t": "ndarray", "id": 2}]]}],
        ],
    }
    layout = [{"id": i, "path": f"p{i}"} for i in range(3)]
    sub, kept = select(tree, layout, ["_rng", "meta"])
    assert [k for k, _ in sub["items"]] == ["_rng", "meta"]
    assert [e["id"] for e in kept] == [1, 2]
    with pytest.raises(CheckpointFormatError, match="no entry nope"):
        select(tree, layout, ["nope"])


def test_persist_part_writes_only_the_part_and_restores_it(
    tmp_path: Path, shm_namespace: str
) -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    model = torch.nn.Linear(64, 64)
    meta = {"best_val_loss": 2.5, "iter_num": 7}
    state = {"model": model, "_rng": RNGState(), "meta": meta}
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path / "full"), namespace=shm_namespace))
    part = open_storage(str(tmp_path / "part"))
    try:
        mgr.snapshot(state, 5)
        want = (torch.get_rng_state(), random.random(), np.random.rand())
        random.seed(3)
        np.random.seed(3)
        r = mgr.persist_part(part, ["_rng", "meta"], keep_last=2).result()
        assert r.committed and r.total_bytes < 64 * 64 * 4  # no model bytes
        torch.manual_seed(9)
        random.seed(9)
        np.random.seed(9)
        meta["best_val_loss"] = 0.1
        sub = {"_rng": state["_rng"], "meta": meta}
        assert restore_state(part, sub, step=5).step == 5
        assert torch.equal(torch.get_rng_state(), want[0])
        assert (random.random(), np.random.rand()) == want[1:]
        assert meta == {"best_val_loss": 2.5, "iter_num": 7}
        for step in (6, 7, 8):
            mgr.snapshot(state, step)
            mgr.persist_part(part, ["_rng", "meta"], keep_last=2).result()
        assert committed_steps(part) == [7, 8]  # pruned by the persister
    finally:
        mgr.close()
