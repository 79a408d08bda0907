"""The job of bench/recovery.py's hang and verdict figures: a small DDP model, with an
optional CPU-busy rank-0 "eval" every N steps (nanoGPT's pattern, not declared with
sess.pause) and an optional deterministic bug (rank 1 raises at a step, every time).

``--mode stalwart`` runs the five-line port; ``--mode plain`` a plain torchrun script.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def busy(seconds: float) -> None:
    a = torch.randn(128, 128)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        a = torch.tanh(a @ a)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["stalwart", "plain"], default="stalwart")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-s", type=float, default=3.0)
    p.add_argument("--bug-at", type=int, default=0, help="launch rank 1 raises at this step")
    args = p.parse_args()
    launch_rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    if args.mode == "plain":
        dist.init_process_group("gloo")
        steps: object = range(1, args.steps + 1)
        rank = dist.get_rank()
    else:
        import stalwart

        sess = stalwart.init()
        rank = sess.rank
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.mode == "stalwart":
        sess.track(model=model, optimizer=opt)
        steps = sess.steps(args.steps)
    for step in steps:  # type: ignore[attr-defined]
        if args.eval_every and step % args.eval_every == 0 and rank == 0:
            busy(args.eval_s)
        if args.bug_at and step == args.bug_at and launch_rank == 1:
            raise ValueError(f"bad batch at step {step}")
        loss = model(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if args.mode == "plain":
        dist.destroy_process_group()
    else:
        sess.close()


if __name__ == "__main__":
    main()
