"""The job of tests/agent/test_late_failure.py: a few DDP steps under ``stalwart.init()``,
then rank 1 fails after the loop (a final save to a full disk, a bad eval): its peer has
already passed the finish barrier and exits 0."""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    sess = stalwart.init()
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sess.track(model=model, optimizer=opt)
    for step in sess.steps(args.steps):
        g = torch.Generator().manual_seed(step * 100 + sess.rank)
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
    if sess.rank == 1:
        raise OSError("final save failed: no space left on device")
    sess.close()


if __name__ == "__main__":
    main()
