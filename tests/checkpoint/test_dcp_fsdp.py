"""DCP interop of sharded (FSDP2) checkpoints across world sizes: real gloo on CPU.

One 4-rank FSDP2 job trains two steps and saves the same state twice: with stalwart's
engine (every rank its own shard, one commit, as tests/checkpoint/test_reshard.py) and
with plain ``dcp.save``. Then, in one 2-rank job:

- export (stalwart -> DCP) is loaded by plain DCP into a 2-rank FSDP2 model;
- import (DCP -> stalwart) is restored by stalwart into a 2-rank FSDP2 model whose
  optimizer is fresh (no moments to load into: they must come back as this rank's
  DTensor shards, not as whole tensors);

both equal the 4-rank state bit for bit, and both train the next step to the same
numbers. The shards are uneven (30 rows over 4 ranks, 6 and 3 rows leave ranks empty).
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _spawn import spawn_world
from torch import nn

LR = 1e-2


def _build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 10), nn.LayerNorm(10), nn.Linear(10, 6), nn.Linear(6, 3))
    for layer in (model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)  # lr must come back as LR


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randint(30, (4, 5), generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and moment as a whole tensor (a collective: all ranks call it)."""
    out: dict[str, Any] = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in opt.state[p].items():
            out[f"opt.{i}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def _same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k}"
        else:
            assert a[k] == b[k], f"{what}: {k}"


def _save4(rank: int, root: Path, mesh: Any) -> None:
    from stalwart.checkpoint import CheckpointConfig, CheckpointManager, publish_step

    model, opt = _build(mesh)
    for g in opt.param_groups:
        g["lr"] = LR
    for step in range(2):
        _train(model, opt, step)
    ref = _full(model, opt)
    if rank == 0:
        torch.save(ref, root / "ref.pt")
    ns = f"dcp-fsdp-{uuid.uuid4().hex[:8]}-r{rank}"
    cfg = CheckpointConfig(str(root / "ck"), namespace=ns, rank=rank, world_size=4)
    mgr = CheckpointManager(cfg)
    try:
        mgr.snapshot({"model": model, "optimizer": opt}, 2)
        mgr.persist(commit=False).result(timeout=120)
        dist.barrier()
        if rank == 0:
            publish_step(mgr.storage, 2, 4)
    finally:
        mgr.close()
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=root / "dcp"
    )


def _plain_dcp_load(mesh: Any, ckpt: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """docs/interop.md's recipe for a sharded model: only torch."""
    import torch.distributed.checkpoint as dcp

    model, opt = _build(mesh)
    for p in model.parameters():  # create the optimizer's state tensors (DTensors)
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    return model, opt


def _stalwart_restore(rank: int, mesh: Any, root: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    from stalwart.checkpoint import CheckpointConfig, CheckpointManager

    model, opt = _build(mesh)  # a fresh optimizer: no state yet
    ns = f"dcp-fsdp-{uuid.uuid4().hex[:8]}-r{rank}"
    mgr = CheckpointManager(CheckpointConfig(str(root), namespace=ns, rank=rank, world_size=2))
    try:
        assert mgr.restore({"model": model, "optimizer": opt}).step == 2
    finally:
        mgr.close()
    return model, opt


def _load2(rank: int, root: Path, mesh: Any) -> None:
    ref = torch.load(root / "ref.pt", weights_only=True)
    exported = _plain_dcp_load(mesh, root / "exported")
    imported = _stalwart_restore(rank, mesh, root / "imported")
    _same(ref, _full(*exported), "export -> plain DCP at 2 ranks")
    _same(ref, _full(*imported), "DCP -> import -> stalwart at 2 ranks")
    _train(*exported, 2)
    _train(*imported, 2)
    _same(_full(*exported), _full(*imported), "the next step from either")


def _worker(rank: int, world: int, store: str, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        (_save4 if world == 4 else _load2)(rank, root, mesh)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp2_four_ranks_to_two_both_ways(tmp_path: Path) -> None:
    from stalwart.cli.main import main

    spawn_world(_worker, (4, str(tmp_path / "store4"), tmp_path), 4)
    ck, dcp_dir = str(tmp_path / "ck"), str(tmp_path / "dcp")
    assert main(["ckpt", "export", "--format", "dcp", ck, str(tmp_path / "exported")]) == 0
    assert main(["ckpt", "import", dcp_dir, str(tmp_path / "imported"), "--step", "2"]) == 0
    spawn_world(_worker, (2, str(tmp_path / "store2"), tmp_path), 2)
