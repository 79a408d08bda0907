"""The job of bench/_detect_straggler.py: a DDP MLP under stalwart, one intra-op thread
per rank so that every rank computes at the same pace unless chaos ``slow`` says
otherwise (the straggler figures compare ranks with each other). It trains until
``--steps``; the benchmark ends it with SIGTERM once it measured what it needs."""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    d = args.dim
    model = torch.nn.Sequential(
        torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d), torch.nn.ReLU(),
        torch.nn.Linear(d, 1),
    )  # fmt: skip
    sess = stalwart.init()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    sess.track(model=ddp, optimizer=opt)
    gen = torch.Generator().manual_seed(sess.rank)
    x, y = torch.randn(args.batch, d, generator=gen), torch.randn(args.batch, 1, generator=gen)
    for _ in sess.steps(args.steps):
        for _ in range(4):  # ~4 forward/backward passes of compute per step
            loss = torch.nn.functional.mse_loss(ddp.module(x), y)
            loss.backward()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sess.log(loss=loss)


if __name__ == "__main__":
    main()
