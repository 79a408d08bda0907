"""A plain torchrun DDP script (no stalwart import) with long evaluation pauses.

Written in the style of the scripts people launch with ``torchrun`` and nothing else:
``init_process_group("gloo")`` from torchrun's environment, a model seeded alike on every
rank, DDP, a ``DistributedSampler``, and every ``eval_every`` steps an evaluation on rank 0
only that keeps it busy for ``eval_seconds`` (forward passes: CPU time) while the other
ranks wait for it in ``dist.barrier()``. Under ``stalwart run`` it must behave as under
torchrun: finish, never be killed as hung for a long eval or a slow start-up.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _record import Recorder
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=4, help="steps between evals")
    p.add_argument("--eval_seconds", type=float, default=2.0)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(64, 32, generator=g)
    ds = TensorDataset(torch.arange(64), xs, (xs.sum(1) > 0).long())
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=8, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 2)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    rec = Recorder(a.out, rank)
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for idx, x, y in loader:
            step += 1
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rec.step(
                step, generation=0, rank=rank, world=world, loss=loss.item(), samples=idx.tolist()
            )
            if step % a.eval_every == 0:
                if rank == 0:
                    t0 = time.monotonic()
                    with torch.no_grad():
                        while time.monotonic() - t0 < a.eval_seconds:
                            model.module(torch.randn(256, 32))
                    print(f"epoch {epoch} step {step} eval done", flush=True)
                dist.barrier()
    rec.final(model.module.state_dict(), step=step, world=world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
