"""An FSDP2 (DTensor) state through a snapshot: survivors restore in place, and a fresh
optimizer (a replacement worker's, no state yet) gets its moments back as DTensors."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.runtime.group import ensure_local_default_group


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


def test_a_fresh_sharded_optimizer_gets_state_tensors_before_a_reshard() -> None:
    """Before a restore at another world size the moments must exist with the new shard
    shapes (they are cut to them): one zero-gradient, zero-lr step creates them and
    leaves the parameters, the learning rate and the gradients as they were."""
    from stalwart.checkpoint._state import init_sharded_optimizers

    model, opt = _build()
    before = _locals(model)
    plain = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    init_sharded_optimizers({"model": model, "optimizer": opt, "plain": plain})
    assert not plain.state  # not sharded: nothing to cut, left alone
    moments = [st["exp_avg"] for st in opt.state.values()]
    assert len(moments) == len(before) and all(isinstance(m, DTensor) for m in moments)
    assert [m.to_local().shape for m in moments] == [b.shape for b in before]
    for a, b in zip(_locals(model), before, strict=True):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == 0.1
    assert all(p.grad is None for p in model.parameters())
    _step(model, opt, 1)
    stepped = opt.state[next(iter(model.parameters()))]["step"]
    init_sharded_optimizers({"optimizer": opt})  # has state already: untouched
    assert opt.state[next(iter(model.parameters()))]["step"] is stepped
