"""A small language model sharded with FSDP2 (``fully_shard``) on CPU: the FSDP recipe.

The stalwart lines are marked. ``sess.mesh`` is a DeviceMesh whose process group is
re-formed underneath after a failure, so the FSDP module and the optimizer are built
once and survive recoveries. Deterministic on CPU: the model is seeded and the batch of
step s on rank r is generated from (s, r), so a run with failures must end with the
same parameters as one without.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import stalwart  # stalwart


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class MlpLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(step: int, rank: int, size: int, seq: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Sequences x[i+1] = (5 x[i] + 3) mod vocab with 10% noise."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(vocab, (size, 1), generator=g)
    steps = torch.arange(seq + 1)
    seqs = (start * (5**steps) + 3 * ((5**steps) - 1) // 4) % vocab
    noise = torch.rand(size, seq + 1, generator=g) < 0.1
    seqs = torch.where(noise, torch.randint(vocab, (size, seq + 1), generator=g), seqs)
    return seqs[:, :-1], seqs[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--out", default=None, help="rank 0 saves the full parameters here")
    args = p.parse_args()

    sess = stalwart.init()  # stalwart
    torch.manual_seed(0)
    model = MlpLM(args.vocab, args.dim, args.layers)
    for block in model.blocks:
        fully_shard(block, mesh=sess.mesh)  # stalwart: mesh=sess.mesh
    fully_shard(model, mesh=sess.mesh)  # stalwart: mesh=sess.mesh
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sess.track(model=model, optimizer=opt)  # stalwart
    for step in sess.steps(args.steps):  # stalwart
        x, y = batch(step, sess.rank, args.batch, args.seq, args.vocab)
        loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sess.log(loss=loss)  # stalwart
    # every rank takes part in gathering the full parameters (a collective)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if not sess.step_ok:  # a peer failed during the gather: nothing trustworthy to save
        raise SystemExit("a peer failed while gathering the final parameters; not saved")
    if sess.rank == 0:
        digest = hashlib.sha256()
        for t in full.values():
            digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        print(
            f"final loss {sess.metrics.get('loss', float('nan')):.4f} "
            f"params sha256 {digest.hexdigest()[:16]}",
            flush=True,
        )
        if args.out:
            torch.save(full, args.out)
    sess.close()


if __name__ == "__main__":
    main()
