"""bench/fsdp.py's checkpoint figures: a 4-rank FSDP2 state persisted by stalwart and by
torch.distributed.checkpoint (DCP), then each restored into 2 ranks (resharded), in one run.

The state: a stack of ``Linear(dim, dim)`` layers, each ``fully_shard``-ed over a 4-rank
gloo mesh, and AdamW after real steps (parameters and two moments: 12 bytes per
parameter). Both sides are measured warm (a first save of each, then one more optimizer
step so that every byte changed, and the save that is timed), from the state in memory
to every rank's bytes durable and the checkpoint committed, between barriers:

- ``persist_s``: stalwart's snapshot into shared memory on every rank, the persister
  processes writing each rank's shard, the manifest published (the engine's path
  under `stalwart run`, less the coordinator's compare-and-swap). The persisters run
  at normal priority here (``nice=0``; under `stalwart run` they run at nice 10 so that
  training keeps its cores): nothing trains beside this save, and DCP writes from the
  training process at normal priority too;
- ``dcp_save_s``: ``dcp.save`` of ``get_state_dict(model, opt)``;
- ``restore_reshard_s``: a fresh 2-rank job (new model, optimizer without state)
  restoring stalwart's 4-rank checkpoint with ``CheckpointManager.restore``;
- ``dcp_load_reshard_s``: the same job loading DCP's checkpoint (``get_state_dict``,
  ``dcp.load``, ``set_state_dict``). The two restored states are compared (equal).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _build(world: int, dim: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, dim: int) -> None:
    opt.zero_grad()
    model(torch.randn(2, dim)).square().mean().backward()
    opt.step()


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _save(rank: int, world: int, work: Path, dim: int, layers: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from stalwart.checkpoint import CheckpointConfig, CheckpointManager, publish_step
    from stalwart.checkpoint.persist import PersistConfig

    model, opt = _build(world, dim, layers)
    state = {"model": model, "optimizer": opt}
    ns = f"bench-fsdp-{uuid.uuid4().hex[:8]}-r{rank}"
    cfg = CheckpointConfig(str(work / "ours"), ns, rank, world, persist=PersistConfig(nice=0))
    mgr = CheckpointManager(cfg)
    try:

        def persist(step: int) -> None:
            mgr.snapshot(state, step)
            mgr.persist(commit=False).result(timeout=600)
            dist.barrier()
            if rank == 0:
                publish_step(mgr.storage, step, world)

        def dcp_save(where: str) -> None:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / where))

        _train_step(model, opt, dim)
        mgr.snapshot(state, 1)  # both slots faulted in, the persister process started
        persist(1)
        dcp_save("dcp-warm")
        _train_step(model, opt, dim)  # every byte changes: nothing deduplicates
        persist_s = _timed(lambda: persist(2))
        dcp_save_s = _timed(lambda: dcp_save("dcp"))
    finally:
        mgr.close()
    nbytes = sum(p.to_local().numel() * 12 for p in model.parameters())  # params + 2 moments
    return {"persist_s": persist_s, "dcp_save_s": dcp_save_s, "rank_bytes": float(nbytes)}


def _load(rank: int, world: int, work: Path, dim: int, layers: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from stalwart.checkpoint import CheckpointConfig, CheckpointManager

    ours, ours_opt = _build(world, dim, layers)
    ns = f"bench-fsdp-{uuid.uuid4().hex[:8]}-r{rank}"
    mgr = CheckpointManager(CheckpointConfig(str(work / "ours"), ns, rank, world))
    try:
        restore_s = _timed(lambda: mgr.restore({"model": ours, "optimizer": ours_opt}, step=2))
    finally:
        mgr.close()
    theirs, theirs_opt = _build(world, dim, layers)

    def dcp_load() -> None:
        msd, osd = get_state_dict(theirs, theirs_opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(work / "dcp"))
        set_state_dict(theirs, theirs_opt, model_state_dict=msd, optim_state_dict=osd)

    dcp_s = _timed(dcp_load)
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    ) and all(
        torch.equal(ours_opt.state[a][k].to_local(), theirs_opt.state[b][k].to_local())
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        for k in ("exp_avg", "exp_avg_sq")
    )
    return {"restore_reshard_s": restore_s, "dcp_load_reshard_s": dcp_s, "equal": float(same)}


def _worker(rank: int, world: int, mode: str, work: Path, dim: int, layers: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{work}/store-{mode}", rank=rank, world_size=world
    )
    try:
        fn = _save if mode == "save" else _load
        result = fn(rank, world, work, dim, layers)
        (work / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure(work: Path, state_mb: int, dim: int = 2048) -> dict[str, Any]:
    """Save at 4 ranks, load at 2; the figures and their ratios (one run)."""
    layers = max(1, round(state_mb * 2**20 / (12 * dim * dim)))
    for mode, world in (("save", 4), ("load", 2)):
        mp.spawn(_worker, args=(world, mode, work, dim, layers), nprocs=world, join=True)
    saved = json.loads((work / "save-rank0.json").read_text())
    loaded = json.loads((work / "load-rank0.json").read_text())
    total = sum(
        json.loads((work / f"save-rank{r}.json").read_text())["rank_bytes"] for r in range(4)
    )
    return {
        "ckpt_state_mb": total / 2**20,
        "persist_s": saved["persist_s"],
        "dcp_save_s": saved["dcp_save_s"],
        "persist_vs_dcp_save": saved["persist_s"] / saved["dcp_save_s"],
        "restore_reshard_s": loaded["restore_reshard_s"],
        "dcp_load_reshard_s": loaded["dcp_load_reshard_s"],
        "restore_vs_dcp_load": loaded["restore_reshard_s"] / loaded["dcp_load_reshard_s"],
        "restored_equal": bool(loaded["equal"]),
        "ckpt_load_average": os.getloadavg()[0],
    }


if __name__ == "__main__":
    import sys
    import tempfile

    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-ckpt-") as tmp:
        print(json.dumps(measure(Path(tmp), mb)))
