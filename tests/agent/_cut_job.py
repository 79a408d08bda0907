"""The job of tests/agent/test_control_cut.py: DDP steps under ``stalwart.init()`` that
write a per-rank step journal (``--journal DIR``: ``DIR/<rank>-<pid>``: one line ``generation
step wall_time`` per completed step, written when the session has accepted it, i.e. at
the start of the next iteration), so the test can see in which generation every step
completed and when. Data depend on the step and rank only: a run with failures ends
with the same parameters as one without."""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--out", default="")
    p.add_argument("--journal", required=True)
    args = p.parse_args()
    sess = stalwart.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sess.track(model=model, optimizer=opt)
    os.makedirs(args.journal, exist_ok=True)
    journal = open(os.path.join(args.journal, f"{sess.rank}-{os.getpid()}"), "a")  # noqa: SIM115
    pending: tuple[int, int] | None = None  # (generation, step) yielded, not yet accepted

    def accepted() -> None:
        # accepted in its generation (after a recovery, a restored step is no evidence)
        if pending is not None and (sess.generation, sess.step) == pending:
            journal.write(f"{pending[0]} {pending[1]} {time.time():.6f}\n")
            journal.flush()

    for step in sess.steps(args.steps):
        accepted()
        pending = (sess.generation, step)
        g = torch.Generator().manual_seed(step * 100 + sess.rank)
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
        time.sleep(args.step_s)  # a step long enough to be seen in the journal
    accepted()
    journal.close()
    if args.out and sess.rank == 0:
        torch.save(dict(model.module.state_dict()), args.out)
    sess.close()


if __name__ == "__main__":
    main()
