"""A small job for ``--strategy async`` (and, unchanged, for synchronous DDP).

A 2-layer MLP learns a fixed random teacher network. Each worker reads its own data
partition: the batch of step ``s`` for partition ``p`` is drawn from a generator seeded
with ``(s, p)``, where ``p`` is ``sess.rank`` (the launch rank, under async too: each
worker is its own replica group, so its own partition).
Synchronous DDP over W workers and async over W
groups of one therefore see the same samples at every step, and their final losses on
one held-out batch compare the two routes at the same step count::

    stalwart run --nproc-per-node 2 examples/train_async.py --out runs/sync.json
    stalwart run --nproc-per-node 2 --strategy async --sync-every 10 \\
        examples/train_async.py --out runs/async.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart

DIM, HIDDEN = 16, 64


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )


def _batch(step: int, part: int, size: int, teacher: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step * 1_000_003 + part)
    x = torch.randn(size, DIM, generator=g)
    with torch.no_grad():
        y = teacher(x) + 0.01 * torch.randn(size, 1, generator=g)
    return x, y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--out", default=None, help="rank 0 writes the final losses here (JSON)")
    p.add_argument(
        "--seed-by-rank", action="store_true", help="seed the model by rank (nanoGPT-style)"
    )
    args = p.parse_args()

    sess = stalwart.init()
    part = sess.rank  # the launch rank (under async too): this worker's partition
    torch.manual_seed(1234)
    teacher = _mlp()
    torch.manual_seed(1337 + sess.rank if args.seed_by_rank else 0)
    model = DDP(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sess.track(model=model, optimizer=opt)
    for step in sess.steps(args.steps):
        x, y = _batch(step, part, args.batch, teacher)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sess.log(loss=loss)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    x, y = _batch(0, 10_000, 4096, teacher)  # held out: step 0 is never trained on
    with torch.no_grad():
        held_out = F.mse_loss(model(x), y).item()
    digest = hashlib.sha256()
    for t in model.module.state_dict().values():
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    print(f"part {part} held-out loss {held_out:.6f} params {digest.hexdigest()[:16]}", flush=True)
    if args.out:
        with open(f"{args.out}.{part}", "w") as f:
            json.dump({"held_out": held_out, "params": digest.hexdigest(), "part": part}, f)
    sess.close()


if __name__ == "__main__":
    main()
