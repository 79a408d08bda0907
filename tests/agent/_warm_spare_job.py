"""The job of tests/agent/test_warm_spares_job.py: DDP steps under ``stalwart.init()``
that record each set-up and end (rank, pid) in a file, and pace themselves (50 ms a step) until
the test creates its release file; the pacing changes no state."""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--setups",
        required=True,
        help="each set-up appends 'setup RANK PID', each end 'end RANK PID'",
    )
    p.add_argument("--release", required=True, help="no pacing once this file exists")
    p.add_argument("--out", required=True, help="rank 0 saves the final parameters here")
    args = p.parse_args()
    sess = stalwart.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sess.track(model=model, optimizer=opt)
    with open(args.setups, "a") as f:  # the set-up is done: the steps come next
        f.write(f"setup {sess.rank} {os.getpid()}\n")
    for step in sess.steps(args.steps):
        if not os.path.exists(args.release):
            time.sleep(0.05)
        g = torch.Generator().manual_seed(step * 100 + sess.rank)
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
    with open(args.setups, "a") as f:
        f.write(f"end {sess.rank} {os.getpid()}\n")
    if sess.rank == 0:
        torch.save(model.module.state_dict(), args.out)
    sess.close()


if __name__ == "__main__":
    main()
