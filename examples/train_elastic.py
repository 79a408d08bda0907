"""The demo's language model trained from a dataset through the resumable loader, with a
constant global batch: the job for ``--strategy elastic`` (``make demo-elastic``).

Differences from train_lm.py: the samples come from ``stalwart.data.loader`` (a
map-style dataset, re-partitioned on every resize) and ``sess.use_batch`` keeps the
global batch constant whatever the world size (gradient accumulation: the loader yields
``micro_batches`` micro-batches per step). ``--trace DIR`` writes, per rank and step, the
rank's mean loss and the sample indices it read (the elastic equivalence test compares
them with a fixed-size run).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from train_lm import TinyLM

import stalwart
from stalwart.data import BatchConfig


class Sequences(torch.utils.data.Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """x[i+1] = (5 x[i] + 3) mod vocab with 10% noise; sample i is a function of i."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7919 * i + 1)
        start = torch.randint(self.vocab, (1,), generator=g)
        steps = torch.arange(self.seq + 1)
        s = (start * (5**steps) + 3 * ((5**steps) - 1) // 4) % self.vocab
        noise = torch.rand(self.seq + 1, generator=g) < 0.1
        s = torch.where(noise, torch.randint(self.vocab, (self.seq + 1,), generator=g), s)
        return i, s[:-1], s[1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--ballast-mb", type=int, default=0, help="extra tracked state (MiB)")
    p.add_argument("--trace", default=None, help="directory for per-rank loss/sample traces")
    p.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    args = p.parse_args()

    sess = stalwart.init()
    torch.manual_seed(0)
    model = DDP(TinyLM(args.vocab, args.dim, args.layers, args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = stalwart.data.loader(Sequences(args.samples, args.seq, args.vocab), args.micro_batch)
    extra = {}
    if args.ballast_mb:  # more model state (frozen), so that a transfer has bytes to move
        ballast = torch.nn.Module()
        ballast.weight = torch.nn.Parameter(torch.zeros(args.ballast_mb << 18), False)
        extra["ballast"] = ballast
    sess.track(model=model, optimizer=opt, loader=data, **extra)
    sess.use_batch(BatchConfig(global_batch=args.global_batch, micro_batch=args.micro_batch))
    trace = None
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        trace = open(os.path.join(args.trace, f"pid{os.getpid()}.jsonl"), "a")  # noqa: SIM115
    t0 = time.time()
    for step in sess.steps(args.steps):
        opt.zero_grad()
        batches = list(data.step_batches())
        total, seen = 0.0, []
        for i, (idx, x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                logits = model(x).reshape(-1, args.vocab)
                loss = F.cross_entropy(logits, y.reshape(-1)) / len(batches)
                loss.backward()
            total += loss.item()
            seen += idx.tolist()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        sess.log(loss=total)
        if trace is not None and sess.step_ok:
            rec = {"step": step, "gen": sess.generation, "world": sess.world_size, "t": time.time()}
            rec |= {"rank": sess.rank, "member": sess.env.rank, "pid": os.getpid()}
            rec |= {"loss": total, "samples": seen}
            trace.write(json.dumps(rec) + "\n")
            trace.flush()
        if sess.rank == 0 and step % 100 == 0:
            print(f"step {step} loss {total:.3f} world {sess.world_size} ({time.time() - t0:.1f}s)")
    if sess.rank == 0:
        digest = hashlib.sha256()
        for t in model.module.state_dict().values():
            digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        print(f"final loss {total:.4f} params sha256 {digest.hexdigest()[:16]}", flush=True)
        if args.out:
            torch.save(model.module.state_dict(), args.out)
    sess.close()


if __name__ == "__main__":
    main()
