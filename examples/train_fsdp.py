"""A small language model sharded with FSDP2 (``fully_shard``) on CPU: the FSDP recipe.

The stalwart lines are marked. ``sess.mesh`` is a DeviceMesh whose process group is
re-formed underneath after a failure, so the FSDP module and the optimizer are built
once and survive recoveries. Deterministic on CPU: the model is seeded and the batch of
step s on rank r is generated from (s, r), so a run with failures must end with the
same parameters as one without.

``--global-batch G``: the samples come from ``stalwart.data.loader`` instead (a dataset
whose sample i is a function of i) with ``sess.use_batch`` keeping G samples per step
whatever the world size, so a job persisted at 4 workers and restarted at 2 on the same
``--run-dir`` trains on as a 2-worker job would (the loader re-partitions the rest of the
epoch; the parameters and optimizer moments are resharded). ``--loss-log FILE``: rank 0
appends the job's mean loss per step (over every rank's samples) as JSON lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import stalwart  # stalwart
from stalwart.data import BatchConfig


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


class Sequences(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The same sequences as :func:`batch`, sample i a function of i alone."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(i, 0, 1, self.seq, self.vocab)
        return x[0], y[0]


def step_loss(model: nn.Module, batches: list[tuple[torch.Tensor, ...]], vocab: int) -> float:
    """Forward and backward over the step's micro-batches (the mean over all of them)."""
    total = 0.0
    for x, y in batches:
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)) / len(batches)
        loss.backward()
        total += float(loss.detach())
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--out", default=None, help="rank 0 saves the full parameters here")
    p.add_argument("--global-batch", type=int, default=0, help="0: a batch per (step, rank)")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--loss-log", default=None, help="rank 0 appends the job's mean loss")
    args = p.parse_args()

    sess = stalwart.init()  # stalwart
    torch.manual_seed(0)
    model = MlpLM(args.vocab, args.dim, args.layers)
    for block in model.blocks:
        fully_shard(block, mesh=sess.mesh)  # stalwart: mesh=sess.mesh
    fully_shard(model, mesh=sess.mesh)  # stalwart: mesh=sess.mesh
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.global_batch:  # samples from the resumable loader, a constant global batch
        data = stalwart.data.loader(Sequences(args.samples, args.seq, args.vocab), args.batch)
        sess.track(model=model, optimizer=opt, loader=data)  # stalwart
        sess.use_batch(BatchConfig(global_batch=args.global_batch, micro_batch=args.batch))
    else:
        sess.track(model=model, optimizer=opt)  # stalwart
    log = open(args.loss_log, "a") if args.loss_log and sess.rank == 0 else None  # noqa: SIM115
    for step in sess.steps(args.steps):  # stalwart
        opt.zero_grad()
        if args.global_batch:
            loss = torch.tensor(step_loss(model, list(data.step_batches()), args.vocab))
        else:
            x, y = batch(step, sess.rank, args.batch, args.seq, args.vocab)
            loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
            loss.backward()
        opt.step()
        sess.log(loss=loss)  # stalwart
        if log is not None or args.loss_log:  # every rank takes part in the mean
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean, group=sess.mesh.get_group())
            if log is not None and sess.step_ok:
                rec = {"step": step, "loss": float(mean) / sess.world_size}
                log.write(json.dumps(rec | {"world": sess.world_size}) + "\n")
                log.flush()
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
