"""The job of tests/agent/test_default_group.py: every rank seeds ``1337 + rank`` before
building its DDP model (as nanoGPT does) and, first thing in each step, sums its rank + 1
over the default group with a plain ``dist.all_reduce``. Each committed step writes one
record (``--out DIR``, a file per process): the world the default group reported, the
sum, and the digest of the parameters."""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart
from stalwart import StepFailedError


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    sess = stalwart.init()
    torch.manual_seed(1337 + dist.get_rank())  # replicas differ until stalwart makes them equal
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sess.track(model=model, optimizer=opt)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{os.getpid()}.jsonl"), "a") as out:
        for step in sess.steps(args.steps):
            total = torch.tensor([dist.get_rank() + 1.0])
            try:
                dist.all_reduce(total)  # a peer killed at this step fails it here
            except StepFailedError as err:
                out.write(json.dumps({"step": step, "failed": str(err)}) + "\n")
                out.flush()
                continue  # the runtime rolls the step back and redoes it
            g = torch.Generator().manual_seed(step * 100 + sess.rank)
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
            opt.step()
            if not sess.step_ok:
                continue
            digest = hashlib.sha256()
            for t in model.module.state_dict().values():
                digest.update(t.detach().numpy().tobytes())
            rec = {"step": step, "gen": sess.generation, "rank": dist.get_rank()}
            rec |= {"world": dist.get_world_size(), "sum": total.item()}
            rec |= {"digest": digest.hexdigest()[:16]}
            out.write(json.dumps(rec) + "\n")
            out.flush()
    sess.close()


if __name__ == "__main__":
    main()
