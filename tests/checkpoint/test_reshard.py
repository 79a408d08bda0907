"""DTensor state saved by 2 ranks restores into 3 ranks (and back), bit for bit.

Runs real gloo process groups on CPU; one multi-process test per direction."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _spawn import spawn_world

ROWS, COLS = 10, 6  # 10 rows over 3 ranks: uneven shards (4, 4, 2)


def _full(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, COLS, generator=g)


def _state(mesh: object, placement: str) -> dict[str, object]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    place = Shard(0) if placement == "row" else Shard(1)
    return {
        "params": {
            "w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [place]),  # type: ignore[arg-type]
            "r": distribute_tensor(torch.zeros(COLS), mesh, [Replicate()]),  # type: ignore[arg-type]
        },
        "meta": {"epoch": 0},
    }


def _worker(rank: int, world: int, store: str, root: str, mode: str, placement: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from stalwart.checkpoint import CheckpointConfig, CheckpointManager, publish_step

    # a FileStore rendezvous: no port to race for with other tests
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh, placement)
    params = state["params"]
    assert isinstance(params, dict)
    ns = f"reshard-{uuid.uuid4().hex[:8]}-r{rank}"
    mgr = CheckpointManager(CheckpointConfig(root, namespace=ns, rank=rank, world_size=world))
    try:
        if mode == "save":
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            place = Shard(0) if placement == "row" else Shard(1)
            params["w"] = distribute_tensor(_full(1), mesh, [place])
            params["r"] = distribute_tensor(_full(2)[0], mesh, [Replicate()])
            state["meta"] = {"epoch": 3}
            mgr.snapshot(state, 5)
            mgr.persist(commit=False).result(timeout=60)
            dist.barrier()
            if rank == 0:
                publish_step(mgr.storage, 5, world)
            dist.barrier()
        else:
            res = mgr.restore(state)
            assert res.step == 5
            assert torch.equal(params["w"].full_tensor(), _full(1))  # type: ignore[attr-defined]
            assert torch.equal(params["r"].full_tensor(), _full(2)[0])  # type: ignore[attr-defined]
            assert state["meta"] == {"epoch": 3}
    finally:
        mgr.close()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)  # 5 spawned interpreters importing torch: over 120 s at load 18
@pytest.mark.parametrize(("save_world", "load_world", "placement"), [(2, 3, "row"), (3, 2, "col")])
def test_dtensor_reshard(tmp_path: Path, save_world: int, load_world: int, placement: str) -> None:
    root = str(tmp_path / "ck")
    for world, mode in ((save_world, "save"), (load_world, "load")):
        store = str(tmp_path / f"store-{mode}")
        spawn_world(_worker, (world, store, root, mode, placement), world)
