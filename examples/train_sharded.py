"""A job whose state differs on every rank (like FSDP shards): nobody else holds a copy.

Each rank owns ``--size-mb`` of parameters and updates a window of them per step,
deterministically from (step, rank); there is no DDP, so no peer's snapshot can stand in
for a lost rank: its state comes from its own memory, a buddy node's replica, or disk.
One small allreduce per step couples the ranks, as a sharded job's collectives do (a
failed one discards the step, and the session recovers).
Used by the node-loss tests and bench/node_loss.py. At the end every rank writes the
sha256 of its parameters to ``--out``.rank<R>.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
from torch import nn

import stalwart


class WindowUpdate(torch.optim.Optimizer):
    """Updates one window of the parameters per step. An optimizer, so that the runtime
    orders it after a background snapshot copy (as it does Adam's in-place update)."""

    def __init__(self, params: list[nn.Parameter], rank: int, window: int) -> None:
        super().__init__(params, {"rank": rank, "window": window, "step": 0})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            step, window = group["step"], group["window"]
            for w in group["params"]:
                start = (step * window) % max(1, w.numel() - window + 1)
                part = w[start : start + window]
                part.mul_(0.999).add_(step * 1e-3 + group["rank"] * 1e-4)


class Shard(nn.Module):
    def __init__(self, numel: int, rank: int) -> None:
        super().__init__()
        # deterministic per rank and cheap to build (a real job builds its model before
        # restoring too; random init of GBs would dominate the recovery time here)
        init = torch.arange(numel, dtype=torch.float32).remainder_(977.0).mul_(1e-3)
        self.w = nn.Parameter(init.add_(rank), requires_grad=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--size-mb", type=float, default=4.0, help="parameters per rank, MB")
    p.add_argument("--window-mb", type=float, default=1.0, help="updated per step, MB")
    p.add_argument("--step-ms", type=float, default=20.0, help="extra compute per step, ms")
    p.add_argument("--out", default=None)
    p.add_argument("--step-log", default=None, help="rank 0 appends {step, t, gen} lines")
    args = p.parse_args()

    sess = stalwart.init()
    numel = int(args.size_mb * 2**20) // 4
    window = max(1, min(numel, int(args.window_mb * 2**20) // 4))
    shard = Shard(numel, sess.rank)
    opt = WindowUpdate([shard.w], sess.rank, window)
    sess.track(model=shard, optimizer=opt)
    spin = torch.ones(64, 64)
    log = open(args.step_log, "a") if args.step_log and sess.rank == 0 else None  # noqa: SIM115
    for step in sess.steps(args.steps):
        opt.param_groups[0]["step"] = step
        deadline = time.perf_counter() + args.step_ms / 1000
        while time.perf_counter() < deadline:  # stands in for the forward/backward
            spin = (spin @ spin).clamp_(-1, 1)
        sess.group.allreduce_(torch.ones(1))  # the step's collective
        opt.step()  # skipped by the runtime when the collective failed
        sess.log(step=step)
        if log is not None and sess.step_ok:
            log.write(f'{{"step": {step}, "t": {time.time():.6f}, "gen": {sess.generation}}}\n')
            log.flush()
    if args.out:
        digest = hashlib.sha256(shard.w.detach().numpy().tobytes()).hexdigest()
        with open(f"{args.out}.rank{sess.rank}", "w") as f:
            f.write(digest + "\n")


if __name__ == "__main__":
    main()
