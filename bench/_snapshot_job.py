"""The job of bench/snapshot_path.py: the demo's DDP transformer under ``stalwart.init()``.

Every rank appends one JSON line per step to ``--step-log`` with the wall time of the
whole step as the loop sees it (from one ``sess.steps`` yield to the next: the training
step plus what the session does between steps: snapshot, persist, commit hand-off,
cadence choice), so a cost put on the step loop shows up in it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from _job_args import job_parser
from train_lm import TinyLM, batch

import stalwart


def main() -> None:
    args = job_parser(steps=40, seq=32).parse_args()
    vocab, size = 128, 8
    sess = stalwart.init()
    torch.manual_seed(0)
    model = DDP(TinyLM(vocab, args.dim, args.layers, args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sess.track(model=model, optimizer=opt)
    rows = []
    prev: tuple[int, float] | None = None
    for step in sess.steps(args.steps):
        now = time.perf_counter()
        if prev is not None and step == prev[0] + 1:
            rows.append({"rank": sess.rank, "step": prev[0], "loop_s": now - prev[1]})
        prev = (step, now)
        x, y = batch(step, sess.rank, size, args.seq, vocab)
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with open(args.step_log, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    sess.close()


if __name__ == "__main__":
    main()
