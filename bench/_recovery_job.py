"""The job of bench/recovery.py, in two flavours of the same training loop.

``--mode torchrun``: a plain DDP script written the usual way (init_process_group from
torchrun's environment, torch.save every ``--ckpt-every`` steps, torch.load on start).
``--mode stalwart``: the same loop with the stalwart lines. Rank 0 appends one JSON line
per completed step to ``--step-log`` (step, wall-clock end time); ``--fault`` makes rank
1 kill (SIGKILL) or stop (SIGSTOP) itself at the start of ``--fault-step`` in the first
attempt only (torchrun flavour; stalwart runs use --chaos for the same thing).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from _job_args import job_parser
from train_lm import TinyLM, batch


def main() -> None:
    p = job_parser(steps=100, seq=64)
    p.add_argument("--mode", choices=["torchrun", "stalwart"], required=True)
    p.add_argument("--ckpt", default="")
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--fault", choices=["", "kill", "hang"], default="")
    p.add_argument("--fault-step", type=int, default=50)
    args = p.parse_args()
    vocab, size = 128, 8

    log = open(args.step_log, "a")  # noqa: SIM115 - lives as long as the process
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        log.write(json.dumps({"start": time.time(), "restart": restart}) + "\n")
        log.flush()
    torch.manual_seed(0)
    model = TinyLM(vocab, args.dim, args.layers, args.seq)
    if args.mode == "stalwart":
        from torch.nn.parallel import DistributedDataParallel as DDP

        import stalwart

        sess = stalwart.init()
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        sess.track(model=ddp, optimizer=opt)
        steps = sess.steps(args.steps)
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        start = 0
        if args.ckpt and os.path.exists(args.ckpt):
            ck = torch.load(args.ckpt, weights_only=True)
            ddp.module.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            start = int(ck["step"])
        steps = iter(range(start + 1, args.steps + 1))
    for step in steps:
        first_try = args.mode == "torchrun" and rank == 1 and restart == 0
        if first_try and args.fault and step == args.fault_step:
            log.write(json.dumps({"fault": time.time()}) + "\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        x, y = batch(step, rank, size, args.seq, vocab)
        loss = F.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        saving = args.mode == "torchrun" and args.ckpt and args.ckpt_every and rank == 0
        if saving and step % args.ckpt_every == 0:
            tmp = args.ckpt + ".tmp"
            state = {"model": ddp.module.state_dict(), "optimizer": opt.state_dict()}
            torch.save({**state, "step": step}, tmp)
            os.replace(tmp, args.ckpt)
        if rank == 0 and (args.mode == "torchrun" or sess.step_ok):
            log.write(json.dumps({"step": step, "t": time.time()}) + "\n")
            log.flush()
    if args.mode == "stalwart":
        sess.close()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
