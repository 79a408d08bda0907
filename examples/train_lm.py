"""A small transformer language model on synthetic data: the demo's training job.

A plain DDP script plus the stalwart lines (marked). Deterministic on CPU: the model is
seeded, and the batch of step s on rank r is generated from (s, r), so a run with
failures and recoveries must end with the same parameters as one without.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart  # stalwart


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, dim * 4, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def batch(step: int, rank: int, size: int, seq: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Sequences x[i+1] = (5 x[i] + 3) mod vocab with 10% noise: learnable, reproducible."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(vocab, (size, 1), generator=g)
    steps = torch.arange(seq + 1)
    seqs = (start * (5**steps) + 3 * ((5**steps) - 1) // 4) % vocab
    noise = torch.rand(size, seq + 1, generator=g) < 0.1
    seqs = torch.where(noise, torch.randint(vocab, (size, seq + 1), generator=g), seqs)
    return seqs[:, :-1], seqs[:, 1:]


@torch.no_grad()
def evaluate(model: nn.Module, args: argparse.Namespace) -> float:
    """Mean loss on held-out batches (their own seeds: the training RNG is untouched)."""
    model.eval()
    losses = []
    for i in range(args.eval_iters):
        x, y = batch(10**7 + i, 0, args.batch, args.seq, args.vocab)
        losses.append(F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    p.add_argument("--eval-every", type=int, default=0, help="rank 0 evaluates every N steps")
    p.add_argument("--eval-iters", type=int, default=50, help="batches per evaluation")
    p.add_argument(
        "--step-s",
        type=float,
        default=0.0,
        help="each step also waits this long (a far data store, a device sync): a job that "
        "lasts at least steps x this on any machine, with the same parameters",
    )
    p.add_argument(
        "--skip-steps",
        default="",
        help="comma-separated steps whose batch is not trained on (the fault-free peer of "
        "a run whose NaN at those steps was rolled back: --on-nan rollback)",
    )
    args = p.parse_args()

    sess = stalwart.init()  # stalwart
    torch.manual_seed(0)
    model = DDP(TinyLM(args.vocab, args.dim, args.layers, args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sess.track(model=model, optimizer=opt)  # stalwart
    t0 = time.time()
    skip = {int(s) for s in args.skip_steps.split(",") if s}
    for step in sess.steps(args.steps):  # stalwart
        if step in skip:
            continue
        x, y = batch(step, sess.rank, args.batch, args.seq, args.vocab)
        loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_s:
            time.sleep(args.step_s)
        sess.log(loss=loss)  # stalwart
        if args.eval_every and step % args.eval_every == 0 and sess.rank == 0:
            with sess.pause("eval"):  # stalwart: not a step (the others wait meanwhile)
                val = evaluate(model.module, args)
            print(f"step {step} val loss {val:.3f}", flush=True)
        if sess.rank == 0 and step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.1f}s)", flush=True)
    if sess.rank == 0:
        digest = hashlib.sha256()
        for t in model.module.state_dict().values():
            digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        print(
            f"final loss {sess.metrics.get('loss', float('nan')):.4f} "
            f"params sha256 {digest.hexdigest()[:16]}",
            flush=True,
        )
        if args.out:
            torch.save(model.module.state_dict(), args.out)
    sess.close()


if __name__ == "__main__":
    main()
