"""HSDP on disk: the replicas at replicate coordinate > 0 write references to their
coordinate-0 peer's shards instead of the same bytes; the checkpoint still restores at
the same mesh (each copy read from its peer's pack) and resharded onto 2 ranks.

Runs real gloo process groups on CPU (FileStore rendezvous), like test_reshard.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _spawn import spawn_world

from stalwart.checkpoint.format import ChunkRef, RankIndex, TensorEntry
from stalwart.errors import CheckpointFormatError

ROWS, COLS = 10, 6
_PACK = "data/000000000005-r00000-abcd.pack"


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _worker(rank: int, world: int, store: str, root: str, mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from stalwart.checkpoint import CheckpointConfig, CheckpointManager, publish_step

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if world == 4:  # HSDP 2x2: ranks 2, 3 hold ranks 0, 1's shards
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        place = [Replicate(), Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (world,))
        place = [Shard(0)]
    seed = 1 if mode == "save" else 0
    state: dict[str, object] = {
        "params": {"w": distribute_tensor(_full(seed), mesh, place)},
        "meta": {"epoch": 3 if mode == "save" else 0, "rank": rank},
    }
    ns = f"hsdpcopy-{uuid.uuid4().hex[:8]}-r{rank}"
    mgr = CheckpointManager(CheckpointConfig(root, namespace=ns, rank=rank, world_size=world))
    try:
        if mode == "save":
            mgr.snapshot(state, 5)
            copy_of = rank - 2 if rank >= 2 else None
            mgr.persist(commit=False, copy_of=copy_of).result(timeout=120)
            dist.barrier()
            if rank == 0:
                publish_step(mgr.storage, 5, world)
            dist.barrier()
            # the same mesh, from zeros: a copy entry is read from its peer's pack
            state["params"] = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, place)}
            state["meta"] = {}
        assert mgr.restore(state).step == 5
        w = state["params"]["w"]  # type: ignore[index]
        assert torch.equal(w.full_tensor(), _full(1))
        assert state["meta"] == {"epoch": 3, "rank": rank}  # its own, not the peer's
    finally:
        mgr.close()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(600)  # 6 processes importing torch; minutes on a loaded machine
def test_hsdp_replicas_write_references_and_restore(tmp_path: Path) -> None:
    from stalwart.checkpoint import open_storage
    from stalwart.checkpoint.catalog import load_index, load_manifest

    root = str(tmp_path / "ck")
    for world, mode in ((4, "save"), (2, "load")):
        store = str(tmp_path / f"store-{world}-{mode}")
        spawn_world(_worker, (world, store, root, mode), world)
    storage = open_storage(root)
    manifest = load_manifest(storage, 5)
    indexes = [load_index(storage, manifest, r) for r in range(4)]
    for r, idx in enumerate(indexes):
        (w,) = [t for t in idx.tensors if t.path.endswith("w")]
        if r < 2:
            assert w.copy_of is None and w.chunks
        else:
            assert w.copy_of == r - 2 and not w.chunks
    shard_bytes = ROWS // 2 * COLS * 4
    assert all(idx.new_bytes >= shard_bytes for idx in indexes[:2])
    assert all(idx.new_bytes < shard_bytes for idx in indexes[2:])  # only their small values


def _entry(**kw: object) -> dict[str, object]:
    e = TensorEntry(0, "w", "float32", [2], 8, [], {"global_shape": [4], "offsets": [2]}, 0)
    d = e.to_json()
    d.update(kw)
    return d


def test_copy_entry_round_trips_and_is_validated() -> None:
    idx = RankIndex(5, 1, 2, None, [TensorEntry.from_json(_entry())])
    back = RankIndex.decode(idx.encode(), "idx")
    assert back.tensors[0].copy_of == 0 and back.tensors[0].chunks == []
    plain = TensorEntry(0, "w", "float32", [2], 8, [ChunkRef("0" * 32, _PACK, 0, 8)])
    assert "copy_of" not in plain.to_json()  # indexes without copies are unchanged
    with pytest.raises(CheckpointFormatError, match="copy entry"):
        TensorEntry.from_json(_entry(shard=None))
    with pytest.raises(CheckpointFormatError, match="copy entry"):
        TensorEntry.from_json(_entry(chunks=[["0" * 32, _PACK, 0, 8]]))
    bad = RankIndex(5, 1, 2, None, [TensorEntry.from_json(_entry(copy_of=7))])
    with pytest.raises(CheckpointFormatError, match="names no rank"):
        RankIndex.decode(bad.encode(), "idx")
