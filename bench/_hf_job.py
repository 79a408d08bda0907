"""The HF-style job of bench/recovery.py: a Transformers GPT-2 built from a config.

It imports transformers at the top, as a Hugging Face script does, and trains a model of
about the size of the minimal job's (2 layers, 128 dims, tied embedding and LM head) with
the stalwart lines, so that the difference between the two jobs' RTO is what a
replacement pays for the script's imports. Rank 0 appends one JSON line per completed
step to ``--step-log`` (step, wall-clock end time), like bench/_recovery_job.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

import stalwart

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from _job_args import job_parser
from train_lm import batch


def main() -> None:
    args = job_parser(steps=100, seq=64).parse_args()
    vocab, size = 128, 8
    log = open(args.step_log, "a")  # noqa: SIM115 - lives as long as the process
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=args.seq,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    sess = stalwart.init()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, 10, args.steps)
    sess.track(model=ddp, optimizer=opt, scheduler=sched)
    for step in sess.steps(args.steps):
        x, y = batch(step, rank, size, args.seq, vocab)
        loss = ddp(input_ids=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        sess.log(loss=loss)
        if rank == 0 and sess.step_ok:
            log.write(json.dumps({"step": step, "t": time.time()}) + "\n")
            log.flush()
    sess.close()


if __name__ == "__main__":
    main()
