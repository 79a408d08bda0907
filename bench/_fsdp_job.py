"""The job of bench/fsdp.py: examples/train_fsdp.py's model and data in two flavours.

``--mode torchrun``: plain FSDP2 written the usual way (init_process_group from
torchrun's environment, ``init_device_mesh``). ``--mode stalwart``: the same loop with
the stalwart lines (``mesh=sess.mesh``). Rank 0 appends one JSON line per completed step
to ``--step-log`` (step, wall-clock end time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_fsdp import MlpLM, batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["torchrun", "stalwart"], required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-log", required=True)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    vocab, size = 128, 8
    rank = int(os.environ.get("RANK", "0"))
    log = open(args.step_log, "a")  # noqa: SIM115 - lives as long as the process
    torch.manual_seed(0)
    model = MlpLM(vocab, args.dim, args.layers)
    if args.mode == "stalwart":
        import stalwart

        sess = stalwart.init()
        mesh = sess.mesh
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.mode == "stalwart":
        sess.track(model=model, optimizer=opt)
        steps = sess.steps(args.steps)
    else:
        steps = iter(range(1, args.steps + 1))
    for step in steps:
        x, y = batch(step, rank, size, args.seq, vocab)
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            log.write(json.dumps({"step": step, "t": time.time()}) + "\n")
            log.flush()
    if args.mode == "stalwart":
        sess.close()


if __name__ == "__main__":
    main()
