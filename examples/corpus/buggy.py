"""A script with a deterministic bug: the rank launched as 1 raises at the same step in
every incarnation (a corrupt sample in its shard, say), however often it is restarted or
rolled back.

What a user needs from a fault-tolerance runtime here is a verdict, not a loop: the job
ends within a minute with one line naming the rank, the step and the error, instead of
re-forking the rank forever. Otherwise an ordinary small DDP loop with the five stalwart
lines (marked); ``--bug_step 0`` turns the bug off.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _record import Recorder
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bug_step", type=int, default=6)
    p.add_argument("--bug_rank", type=int, default=1, help="the rank (as launched) with the bug")
    a = p.parse_args()

    sess = stalwart.init()  # stalwart
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sess.track(model=model, optimizer=optimizer)  # stalwart
    rec = Recorder(a.out, sess.env.rank)
    for step in sess.steps(a.steps):  # stalwart
        g = torch.Generator().manual_seed(1000 * step + sess.rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
        if sess.env.rank == a.bug_rank and step == a.bug_step:
            raise ValueError("corpus-bug: label 7 out of range in shard file 3")
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sess.log(loss=loss)  # stalwart
        if sess.step_ok:
            rec.step(
                step,
                generation=sess.generation,
                rank=sess.rank,
                world=sess.world_size,
                loss=loss.item(),
                samples=[],
            )
    rec.final(model.module.state_dict(), step=a.steps, world=sess.world_size)
    sess.close()  # stalwart


if __name__ == "__main__":
    main()
