"""An FSDP2 (DTensor) state through a snapshot: survivors restore in place, and a fresh
optimizer (a replacement worker's, no state yet) gets its moments back as DTensors."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.runtime.comm.group import ensure_local_default_group


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    ensure_local_default_group()
    import torch.distributed as dist

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def _locals(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def test_fresh_optimizer_gets_dtensor_moments(shm_namespace: str) -> None:
    model, opt = _build()
    _step(model, opt, 1)
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        snap.snapshot(state, 1)
        _step(model, opt, 2)
        want = _locals(model)

        fresh_model, fresh_opt = _build()  # a replacement worker: no optimizer state yet
        fresh: dict[str, Any] = {"model": fresh_model, "optimizer": fresh_opt}
        assert snap.restore(fresh) == 1
        moments = [v for st in fresh_opt.state.values() for v in st.values() if v.dim() > 0]
        assert moments and all(isinstance(v, DTensor) for v in moments)
        _step(fresh_model, fresh_opt, 2)  # would mix Tensor and DTensor without the fix
        for a, b in zip(_locals(fresh_model), want, strict=True):
            assert torch.equal(a, b)

        assert snap.restore(state) == 1  # a survivor: in place, same result
        _step(model, opt, 2)
        for a, b in zip(_locals(model), want, strict=True):
            assert torch.equal(a, b)
    finally:
        snap.close(unlink=True)
