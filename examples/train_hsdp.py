"""HSDP on CPU: FSDP2 (``fully_shard``) over a 2-D ("replicate", "shard") mesh.

The stalwart lines are marked. ``sess.init_device_mesh`` is torch's ``init_device_mesh``
for a job under stalwart: ``--replicate R`` replica groups of ``world / R`` ranks each,
every group holding the whole model sharded over its ranks (rank = group * size + shard).
Run on 2 nodes of 2 workers with ``--replicate 2``, each node is one replica group, so a
lost node's shards are still in the other node's memory: its ranks restore them from
there (the ``peer`` tier), not from a disk. Deterministic on CPU: the model is seeded,
the batch of step s on rank r is generated from (s, r), and each rank writes the sha256
of its own shards to ``--out``.rank<R>, so a run with failures must end equal to one
without, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import stalwart  # stalwart


def batch(step: int, rank: int, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, dim, generator=g)
    return x, torch.sin(x.flip(-1))


def model_of(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same initial state on every rank (each keeps its shards)
    return nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--replicate", type=int, default=2, help="replica groups (mesh dim 0)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--step-ms", type=float, default=0.0, help="extra compute per step, ms")
    p.add_argument("--out", default=None, help="each rank writes its shards' sha256 here")
    p.add_argument("--step-log", default=None, help="rank 0 appends {step, t, gen} lines")
    p.add_argument(
        "--dim0-name",
        default="replicate",
        help="mesh dim 0's name; another name hides the replicas from stalwart (the "
        "same HSDP job, but a lost node's shards come from disk: bench/_hsdp_node_loss.py)",
    )
    args = p.parse_args()

    sess = stalwart.init()  # stalwart
    shape = (args.replicate, sess.world_size // args.replicate)
    mesh = sess.init_device_mesh(shape, (args.dim0_name, "shard"))  # stalwart
    model = model_of(args.dim, args.layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sess.track(model=model, optimizer=opt)  # stalwart
    log = open(args.step_log, "a") if args.step_log and sess.rank == 0 else None  # noqa: SIM115
    for step in sess.steps(args.steps):  # stalwart
        x, y = batch(step, sess.rank, args.batch, args.dim)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
        sess.log(loss=loss)  # stalwart
        if log is not None:
            log.write(f'{{"step": {step}, "t": {time.time()}, "gen": {sess.generation}}}\n')
            log.flush()
    if args.out:
        digest = hashlib.sha256()
        for t in model.state_dict().values():
            local = t.to_local() if hasattr(t, "to_local") else t
            digest.update(
                local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
        for s in opt.state_dict()["state"].values():
            for v in s.values():
                local = v.to_local() if hasattr(v, "to_local") else v
                digest.update(
                    local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                )
        with open(f"{args.out}.rank{sess.rank}", "w") as f:
            f.write(digest.hexdigest())
    sess.close()


if __name__ == "__main__":
    main()
