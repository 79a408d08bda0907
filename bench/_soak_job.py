"""bench/soak.py's training job: a small DDP model whose run is a function of its
arguments alone, so a run under faults must end with a fault-free run's parameters.

A 2-layer MLP (``--dim`` x ``--hidden``; 6 MB of parameters and AdamW moments at the
defaults), AdamW, the batch of step s on rank r generated from (seed, s, r) with its own
generator (no global RNG is drawn). ``--step-ms`` sleeps each step (it stands in for the
rest of a real step without taking a core from the machine's other work; it changes no
state, so the fault-free reference runs with 0). Rank 0 appends ``{step, t, gen}`` to
``--step-log`` for every completed step (a redone step appears again) and writes the
sha256 of the final parameters and optimizer state to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over every parameter and every optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for _, st in sorted(opt.state_dict()["state"].items()):
        for key in sorted(st):
            v = st[key]
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-ms", type=float, default=100.0, help="sleep per step (no state)")
    p.add_argument("--step-log", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    sess = stalwart.init()
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh())
    net.append(nn.Linear(args.hidden, args.dim))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sess.track(model=model, optimizer=opt)
    log = open(args.step_log, "a") if args.step_log and sess.rank == 0 else None  # noqa: SIM115
    for step in sess.steps(args.steps):
        g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1024 + sess.rank)
        x = torch.randn(args.batch, args.dim, generator=g)
        loss = (model(x) - x.roll(1, dims=1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()  # skipped by the runtime when the step's allreduce failed
        if args.step_ms > 0:
            time.sleep(args.step_ms / 1000)
        if log is not None and sess.step_ok:
            log.write(json.dumps({"step": step, "t": time.time(), "gen": sess.generation}) + "\n")
            log.flush()
    if args.out and sess.rank == 0:
        with open(args.out, "w") as f:
            f.write(state_digest(model.module, opt) + "\n")
    sess.close()


if __name__ == "__main__":
    main()
